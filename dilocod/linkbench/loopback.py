"""`dilocod bench loopback`: the raw TCP ceiling and dilocod fragment transfers between two real
processes on 127.0.0.1, measured side by side in one run.

For each stream count, one dilocod session with that many data connections pushes a fragment of
gradient-like float32 with each codec, and right before every timed push the raw ceiling is
measured with as many plain sockets (a thread per stream, and one thread for all of them, which is
dilocod's own shape); each ratio is the median of those side-by-side pairs, so load that comes and
goes on a shared machine moves both sides of it. A push is timed from its header to the receiver's
acknowledgement, so it includes verification of every chunk. The receiver's CPU share comes from
its own process times, read over the timed interval.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dilocod.linkbench.client import server_status, wire_bytes
from dilocod.linkbench.raw import RawClient, RawMode
from dilocod.linkbench.serve import process_status
from dilocod.ops.processes import read_ready_line
from dilocod.transport.endpoints import connect
from dilocod.transport.loop import loop_factory, run
from dilocod.transport.options import TransportOptions
from dilocod.transport.session import Session
from dilocod.wire.choices import DEFAULT_CHUNK_BYTES
from dilocod.wire.codecs import chunk_checksums
from dilocod.wire.manifest import pack_manifest
from dilocod.wire.messages import PushHeader

READY_TIMEOUT_S = 60.0
Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class LoopbackPlan:
    size_bytes: int
    streams: tuple[int, ...]
    codecs: tuple[str, ...]
    repeats: int = 3
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    shuffle: bool = True
    use_uvloop: bool = True


def gradient_bytes(size_bytes: int, seed: int = 0) -> bytearray:
    """float32 values shaped like an outer gradient (small, roughly normal); torch makes them."""
    import torch  # noqa: PLC0415 - only this benchmark needs tensors

    generator = torch.Generator().manual_seed(seed)
    out = bytearray(size_bytes // 4 * 4)
    torch.frombuffer(out, dtype=torch.float32).copy_(torch.randn(size_bytes // 4, generator=generator) * 1e-3)
    return out


def start_server(use_uvloop: bool) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    command = [
        sys.executable,
        "-m",
        "dilocod",
        "bench",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--insecure",
        "--ready-json",
    ]
    if not use_uvloop:
        command.append("--no-uvloop")
    child = subprocess.Popen(command, stdout=subprocess.PIPE)
    try:
        return child, read_ready_line(child, "bench server", READY_TIMEOUT_S)
    except RuntimeError:
        child.kill()
        child.wait()
        raise


RAW_MODES: tuple[RawMode, ...] = ("threaded", "shared")


@dataclass(slots=True)
class _RawPair:
    """Both raw ceilings for one stream count, measured right beside every dilocod transfer so
    that each ratio compares two moments of the same (shared, noisy) machine."""

    clients: dict[RawMode, RawClient]
    samples: dict[RawMode, list[float]]

    @classmethod
    def open(cls, port: int, streams: int, data: bytearray) -> _RawPair:
        pair = cls({}, {mode: [] for mode in RAW_MODES})
        try:
            for mode in RAW_MODES:
                pair.clients[mode] = RawClient("127.0.0.1", port, streams, mode)
                pair.clients[mode].send(memoryview(data))  # warm-up: the receiver allocates
        except BaseException:
            pair.close()
            raise
        return pair

    def measure(self, data: bytearray) -> dict[RawMode, float]:
        view = memoryview(data)
        gbps = {mode: len(data) * 8 / client.send(view) / 1e9 for mode, client in self.clients.items()}
        for mode, value in gbps.items():
            self.samples[mode].append(value)
        return gbps

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


async def _timed_runs(
    plan: LoopbackPlan,
    session: Session,
    raw: _RawPair,
    header: PushHeader,
    data: bytearray,
    shuffle: int,
    checksums: list[int] | None,
    progress: Progress,
) -> dict[str, Any]:
    rates, cores, sender_cores, ratios = [], [], [], []
    to_raw: dict[RawMode, list[float]] = {mode: [] for mode in RAW_MODES}
    for _ in range(plan.repeats):
        # The event loop is blocked while the raw sockets run: nothing else is in flight then.
        ceiling = raw.measure(data)
        before, wire_before = await server_status(session), wire_bytes(session)
        own_before = process_status()
        start = time.perf_counter()
        await session.send_fragment(header, data, shuffle_item_size=shuffle, checksums=checksums)
        seconds = time.perf_counter() - start
        own_after = process_status()
        after, wire = await server_status(session), wire_bytes(session) - wire_before
        rates.append(header.raw_bytes * 8 / seconds / 1e9)
        for mode in RAW_MODES:
            to_raw[mode].append(rates[-1] / ceiling[mode])
        cores.append((after["cpu_s"] - before["cpu_s"]) / (after["wall_s"] - before["wall_s"]))
        sender_cores.append(
            (own_after["cpu_s"] - own_before["cpu_s"]) / (own_after["wall_s"] - own_before["wall_s"])
        )
        ratios.append(header.raw_bytes / wire)
    gbps, core_share = statistics.median(rates), statistics.median(cores)
    hashing = "while sending" if checksums is None else "prepared"
    row = {
        "codec": header.codec,
        "streams": len(session.data),
        "checksums": hashing,
        "gbps": round(gbps, 3),
        "ratio_to_raw": round(statistics.median(to_raw["threaded"]), 3),
        "ratio_to_one_thread_raw": round(statistics.median(to_raw["shared"]), 3),
        "compression_ratio": round(statistics.median(ratios), 4),
        "receiver_cores": round(core_share, 3),
        "receiver_cores_per_5gbps": round(core_share * 5 / gbps, 3),
        "sender_cores": round(statistics.median(sender_cores), 3),
    }
    progress(
        f"  dilocod {header.codec:>4} x{row['streams']} (checksums {hashing}): {gbps:6.2f} Gbps, "
        f"{row['ratio_to_raw']:.2f}x raw, {row['ratio_to_one_thread_raw']:.2f}x one-thread raw, "
        f"receiver {core_share:.2f} cores, sender {row['sender_cores']:.2f} cores"
    )
    return row


async def _fragment_runs(
    plan: LoopbackPlan, port: int, raw: _RawPair, streams: int, data: bytearray, progress: Progress
) -> list[dict[str, Any]]:
    options = TransportOptions(chunk_bytes=plan.chunk_bytes)
    session = await connect(
        "127.0.0.1", port, peer_id=f"bench-{streams}", role="bench", streams=streams, options=options
    )
    manifest, raw_bytes = pack_manifest([("gradient", "float32", [len(data) // 4])])
    runs = []
    try:
        for codec in plan.codecs:
            header = PushHeader(tuple(manifest), raw_bytes, codec, plan.chunk_bytes)
            shuffle = 4 if plan.shuffle and codec != "none" else 0
            await session.send_fragment(header, data, shuffle_item_size=shuffle)  # warm-up
            runs.append(await _timed_runs(plan, session, raw, header, data, shuffle, None, progress))
            if codec == "none":
                # What the syncer does for M learners, and a learner where it makes the outer
                # gradient: the chunk checksums are computed once, outside the transfer.
                start = time.perf_counter()
                checksums = chunk_checksums(data, plan.chunk_bytes)
                prepare_s = time.perf_counter() - start
                row = await _timed_runs(plan, session, raw, header, data, shuffle, checksums, progress)
                runs.append({**row, "prepare_ms": round(prepare_s * 1e3, 2)})
    finally:
        await session.close("bench done")
    return runs


def run_loopback(plan: LoopbackPlan, progress: Progress) -> dict[str, Any]:
    progress(f"making {plan.size_bytes / 2**20:.0f} MiB of gradient-like float32 ...")
    data = gradient_bytes(plan.size_bytes)
    child, ready = start_server(plan.use_uvloop)
    try:
        raw_rows, runs = [], []
        for streams in plan.streams:
            raw = _RawPair.open(ready["raw_port"], streams, data)
            try:
                runs.extend(
                    run(
                        _fragment_runs(plan, ready["port"], raw, streams, data, progress),
                        use_uvloop=plan.use_uvloop,
                    )
                )
            finally:
                raw.close()
            row = {
                "streams": streams,
                "gbps": round(statistics.median(raw.samples["threaded"]), 3),
                "one_thread_gbps": round(statistics.median(raw.samples["shared"]), 3),
            }
            raw_rows.append(row)
            progress(
                f"raw TCP x{streams} (median beside the transfers above): {row['gbps']:6.2f} Gbps with a "
                f"thread per stream, {row['one_thread_gbps']:6.2f} Gbps with one thread"
            )
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
    return {
        "raw_gbps": max(r["gbps"] for r in raw_rows),
        "raw": raw_rows,
        "runs": runs,
        "size_bytes": plan.size_bytes,
        "chunk_bytes": plan.chunk_bytes,
        "repeats": plan.repeats,
        "loop": "uvloop" if loop_factory(plan.use_uvloop) else "asyncio",
        "cpus": os.cpu_count(),
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"loopback, {result['size_bytes'] / 2**20:.0f} MiB float32 fragment, chunks of "
        f"{result['chunk_bytes'] / 2**20:g} MiB, median of {result['repeats']}, {result['loop']}",
        "raw: plain TCP with a thread per stream (T) and one thread for all streams (1T), measured right",
        "before each timed transfer; x T and x 1T are medians of those per-transfer ratios",
        "",
        f"{'codec':>6} {'checksums':>13} {'streams':>7} {'Gbps':>7} {'raw T':>7} {'x T':>5} "
        f"{'raw 1T':>7} {'x 1T':>5} {'ratio':>6} {'rx cores':>8} {'rx@5G':>6}",
    ]
    raw_by_streams = {r["streams"]: r for r in result["raw"]}
    for row in result["runs"]:
        raw = raw_by_streams[row["streams"]]
        lines.append(
            f"{row['codec']:>6} {row['checksums']:>13} {row['streams']:>7} {row['gbps']:>7.2f} "
            f"{raw['gbps']:>7.2f} {row['ratio_to_raw']:>5.2f} "
            f"{raw['one_thread_gbps']:>7.2f} {row['ratio_to_one_thread_raw']:>5.2f} "
            f"{row['compression_ratio']:>6.3f} {row['receiver_cores']:>8.2f} "
            f"{row['receiver_cores_per_5gbps']:>6.2f}"
        )
    return "\n".join(lines)
