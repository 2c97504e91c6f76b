"""`dilocod bench run`: what one link carries, measured from this host against a `dilocod bench
serve` at the other end, everything side by side in one session on one path.

For each stream count: the raw TCP ceiling (plain sockets with dilocod's socket options, a thread
per stream) right before every timed dilocod push, so each ratio compares two moments of the same
link; dilocod fragment pushes for each codec, "auto" being the codec the tuning model picks from
codec figures measured on this very data and the ceiling measured on this link. Then the RTT (TCP
connects), one fragment round trip (a push the server echoes back as an update), optionally a
torch.distributed gloo broadcast of the same bytes over the same path, the host's TCP settings with
the bandwidth-delay-product warnings, and the recommendation (streams, codec, chunk size) that
`dilocod learner --streams auto --codec auto` reads.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from dilocod.linkbench.gloo import free_port, interface_for
from dilocod.linkbench.raw import RawClient
from dilocod.linkbench.serve import ECHO_ROUND, GLOO_ROUND
from dilocod.transport.endpoints import connect
from dilocod.transport.options import TransportOptions
from dilocod.transport.session import FragmentReceived, Session
from dilocod.tuning.advice import Advice
from dilocod.tuning.codecs import CodecChoice, CodecFigure, choose_codec, measure_codecs
from dilocod.tuning.streams import TcpSettings, auto_streams, bdp_warning, choose_streams, read_tcp_settings
from dilocod.wire.choices import AUTO, CODECS, DEFAULT_CHUNK_BYTES
from dilocod.wire.codecs import chunk_checksums
from dilocod.wire.manifest import pack_manifest
from dilocod.wire.messages import PushHeader, StatusRequest, StatusResponse, UpdateHeader

#: Transfers per combination are fitted into --duration, within these bounds.
MIN_REPEATS, MAX_REPEATS = 1, 9
RTT_SAMPLES = 9
GLOO_REPEATS = 3
GLOO_TIMEOUT_S = 120.0
#: Stream counts within this share of the best are as good: the recommendation takes the fewest.
STREAMS_TOLERANCE = 0.03
#: Test data kinds: what a learner sends (outer gradients in bf16 or fp32) or incompressible bytes.
DATA_KINDS = ("bf16", "fp32", "random")
#: Every timed transfer (raw, push, gloo broadcast) starts after the link has been idle this long:
#: a shaper's token bucket (2 ms of the rate in `bench local`) is then full for each of them alike,
#: instead of fuller for whichever followed a pause (a full bucket is 0.4 % of a 256 MiB transfer).
QUIET_START_S = 0.01


class Progress(Protocol):
    def note(self, line: str) -> None: ...
    def advance(self, label: str) -> None: ...


@dataclass(frozen=True, slots=True)
class RunPlan:
    size_bytes: int = 256 << 20
    #: Data connection counts; AUTO_STREAMS is what `dilocod learner --streams auto` would open
    #: without advice at the RTT measured here (auto_streams).
    streams: tuple[int, ...] = (1, 2, 4, 8)
    codecs: tuple[str, ...] = (*CODECS, AUTO)
    duration_s: float = 20.0
    vs_gloo: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    data: str = "bf16"
    assumed_rtt_s: float = 0.05
    #: CPU threads each end can spend compressing (the codec model's `threads`); None = all cores.
    #: `bench local` runs both ends on one host, so each gets half.
    threads: int | None = None
    #: The TCP congestion control of this side's sockets (raw and dilocod alike); the daemons use
    #: bbr where the kernel has it.
    congestion: str = "bbr"

    @property
    def codec_threads(self) -> int:
        return self.threads or os.cpu_count() or 1

    def steps(self) -> int:
        """Progress steps: one per (streams, codec) combination, plus RTT, round trip and gloo."""
        return len(self.streams) * len(self.codecs) + 2 + int(self.vs_gloo)


#: In RunPlan.streams: the learner's own choice (`--streams auto`), resolved once the RTT is known.
AUTO_STREAMS = 0


def streams_text(streams: Sequence[int]) -> str:
    """RunPlan.streams as `--streams` takes it."""
    return ",".join(AUTO if s == AUTO_STREAMS else str(s) for s in streams)


def make_data(kind: str, size_bytes: int, seed: int = 0) -> tuple[bytearray, int]:
    """Test bytes and their float item size (the byte-plane shuffle's unit; 0 for random bytes,
    which travel as a float32 push of whatever bits they hold).

    bf16 and fp32 are shaped like outer gradients: normal values whose scale differs from tensor
    to tensor (1e-4 … 1e-2 in blocks of 256 Ki values), which is what decides their entropy."""
    if kind == "random":
        return bytearray(os.urandom(size_bytes)), 0
    import torch  # noqa: PLC0415 - only the gradient-shaped data needs tensors

    dtype, item = (torch.bfloat16, 2) if kind == "bf16" else (torch.float32, 4)
    count = size_bytes // item
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(count, generator=generator)
    block = 1 << 18
    blocks = -(-count // block)
    scales = 10 ** torch.empty(blocks).uniform_(-4, -2, generator=generator)
    values.mul_(scales.repeat_interleave(block)[:count])
    out = bytearray(count * item)
    torch.frombuffer(out, dtype=dtype).copy_(values.to(dtype))
    return out, item


def measure_rtt(host: str, port: int, samples: int = RTT_SAMPLES) -> float:
    """Median seconds of a TCP connect: one SYN / SYN-ACK exchange, so one round trip."""
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        with socket.create_connection((host, port), timeout=10):
            times.append(time.perf_counter() - start)
    return statistics.median(times)


async def server_status(session: Session) -> dict[str, Any]:
    """The bench server's StatusResponse (its ports, CPU seconds and wall clock)."""
    await session.send(StatusRequest())
    while True:
        item = await session.recv()
        if isinstance(item, StatusResponse):
            return item.status


def wire_bytes(session: Session) -> int:
    """Bytes this session has written on all its connections (frames included)."""
    return sum(p.conn.bytes_sent for p in [session.control, *session.data])


def _header(data: bytearray, item: int, codec: str, chunk_bytes: int, round_: int = 0) -> PushHeader:
    precision, dtype, size = ("bf16", "bfloat16", 2) if item == 2 else ("fp32", "float32", 4)
    manifest, _ = pack_manifest([("fragment", dtype, [len(data) // size])])
    # Bytes past the last whole value (a short gloo request) travel as padding (SPEC §5.2).
    return PushHeader(tuple(manifest), len(data), codec, chunk_bytes, round=round_, precision=precision)


@dataclass(slots=True)
class _Link:
    """One measured link, built up as the run goes."""

    host: str
    port: int
    raw_port: int
    plan: RunPlan
    data: bytearray
    item: int
    progress: Progress
    figures: list[CodecFigure]
    repeats: int = 1
    auto: CodecChoice | None = None
    checksums: list[int] | None = None

    async def combinations(self, streams: int, secret: bytes | None) -> tuple[list[dict[str, Any]], float]:
        """Every codec at this stream count; returns the rows and the median raw ceiling."""
        options = TransportOptions(chunk_bytes=self.plan.chunk_bytes, congestion=self.plan.congestion)
        session = await connect(
            self.host, self.port, peer_id=f"bench-{streams}", role="bench", secret=secret,
            streams=streams, options=options,
        )  # fmt: skip
        raw = RawClient(self.host, self.raw_port, streams, "threaded", self.plan.congestion)
        ceilings: list[float] = []
        try:
            view = memoryview(self.data)
            raw.send(view)  # warm-up: the receiver allocates its destination
            await session.send_fragment(
                _header(self.data, self.item, "none", self.plan.chunk_bytes), self.data
            )
            # Round robin: each repeat times every codec once, so a slow spell of a shared host (or
            # of the link) falls on all of them alike instead of on whichever ran through it; the
            # order rotates from one repeat to the next, so no codec always follows the costliest.
            codecs = list(self.plan.codecs)
            samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in codecs}
            for repeat in range(self.repeats):
                turn = repeat % len(codecs)
                for name in codecs[turn:] + codecs[:turn]:
                    samples[name].append(await self._timed(session, raw, ceilings, name))
            rows = [self._row(name, len(session.data), samples[name], samples.get("none")) for name in codecs]
        finally:
            raw.close()
            await session.close("bench done")
        return rows, statistics.median(ceilings)

    def _codec(self, name: str, ceilings: list[float]) -> str:
        """The codec a row named `name` sends with; auto is chosen once per link."""
        if name != AUTO:
            return name
        if self.auto is None:
            # The first ceiling of this link is the rate the model plans for.
            self.auto = choose_codec(self.figures, statistics.median(ceilings), self.plan.codec_threads)
            self.progress.note(f"auto codec: {self.auto.codec} ({self.auto.reason})")
        return self.auto.codec

    async def _timed(
        self, session: Session, raw: RawClient, ceilings: list[float], name: str
    ) -> tuple[float, float, float]:
        """One raw transfer, then one push with the row's codec: (Gbit/s, x raw, compression)."""
        view = memoryview(self.data)
        codec = self._codec(name, ceilings)
        header = _header(self.data, self.item, codec, self.plan.chunk_bytes)
        shuffle = self.item if codec != "none" else 0
        checksums = None
        if codec == "none":
            # A learner prepares the checksums of an uncompressed push while it makes the gradient.
            if self.checksums is None:
                self.checksums = chunk_checksums(self.data, self.plan.chunk_bytes)
            checksums = self.checksums
        await asyncio.sleep(QUIET_START_S)
        ceiling = self.data_gbps(raw.send(view))
        ceilings.append(ceiling)
        wire_before = wire_bytes(session)
        await asyncio.sleep(QUIET_START_S)
        start = time.perf_counter()
        await session.send_fragment(header, self.data, shuffle_item_size=shuffle, checksums=checksums)
        gbps = self.data_gbps(time.perf_counter() - start)
        return gbps, gbps / ceiling, len(self.data) / max(wire_bytes(session) - wire_before, 1)

    def _row(
        self,
        name: str,
        streams: int,
        samples: list[tuple[float, float, float]],
        uncompressed: list[tuple[float, float, float]] | None,
    ) -> dict[str, Any]:
        """The medians of one codec's repeats at one stream count, as a JSON row. With the
        uncompressed row's samples, also the median of this codec's rate over uncompressed's in
        the same repeat: side by side, as the raw ratio is."""
        rates, to_raw, ratios = zip(*samples, strict=True)
        row: dict[str, Any] = {
            "codec": name,
            "streams": streams,
            "gbps": round(statistics.median(rates), 3),
            "ratio_to_raw": round(statistics.median(to_raw), 3),
            "compression_ratio": round(statistics.median(ratios), 4),
        }
        if uncompressed is not None:
            paired = [mine[0] / theirs[0] for mine, theirs in zip(samples, uncompressed, strict=True)]
            row["ratio_to_none"] = round(statistics.median(paired), 3)
        if name == AUTO and self.auto is not None:
            row["chosen"] = self.auto.codec
        self.progress.advance(f"{name} x{streams}: {row['gbps']:.2f} Gbps, {row['ratio_to_raw']:.2f}x raw")
        return row

    def data_gbps(self, seconds: float) -> float:
        return len(self.data) * 8 / seconds / 1e9

    async def round_trip(self, streams: int, codec: str, secret: bytes | None) -> float:
        """Seconds from the start of a push to the end of the update that echoes it."""
        options = TransportOptions(chunk_bytes=self.plan.chunk_bytes, congestion=self.plan.congestion)
        session = await connect(
            self.host, self.port, peer_id="bench-rt", role="bench", secret=secret, streams=streams,
            options=options,
        )  # fmt: skip
        try:
            header = _header(self.data, self.item, codec, self.plan.chunk_bytes, round_=ECHO_ROUND)
            shuffle = self.item if codec != "none" else 0
            times = []
            for _ in range(2):  # the first allocates the server's buffers
                start = time.perf_counter()
                await session.send_fragment(header, self.data, shuffle_item_size=shuffle)
                while True:
                    item = await session.recv()
                    if isinstance(item, FragmentReceived) and isinstance(item.header, UpdateHeader):
                        break
                times.append(time.perf_counter() - start)
            return times[-1]
        finally:
            await session.close("bench done")

    async def gloo(self, secret: bytes | None) -> float:
        """Gbit/s of a torch.distributed gloo broadcast of the same bytes, this host to the server."""
        session = await connect(
            self.host, self.port, peer_id="bench-gloo", role="bench", secret=secret, streams=1
        )
        try:
            sock = session.control.transport.get_extra_info("sockname")
            local = str(sock[0])
            port = free_port(local)
            env = {**os.environ}
            ifname = interface_for(local)
            if ifname is not None:
                env["GLOO_SOCKET_IFNAME"] = ifname
            # c10d warns that it cannot name a peer in a namespace without DNS: noise, not a fault.
            env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            command = [sys.executable, "-m", "dilocod.linkbench.gloo", "--rank", "0", "--master"]
            command += [f"{local}:{port}", "--size", str(len(self.data)), "--repeats", str(GLOO_REPEATS)]
            command += ["--quiet-start", str(QUIET_START_S)]
            rank0 = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE, env=env)
            try:
                request = json.dumps(
                    {"master": f"{local}:{port}", "size": len(self.data), "repeats": GLOO_REPEATS}
                ).encode()
                # The request rides on an authenticated push; the server starts rank 1 for it.
                header = _header(bytearray(request), 0, "none", self.plan.chunk_bytes, round_=GLOO_ROUND)
                await session.send_fragment(header, bytearray(request))
                async with asyncio.timeout(GLOO_TIMEOUT_S):
                    out, _ = await rank0.communicate()
            except BaseException:
                if rank0.returncode is None:
                    rank0.kill()
                    await rank0.wait()
                raise
            if rank0.returncode != 0:
                raise RuntimeError(f"the gloo broadcast failed (rank 0 exited with {rank0.returncode})")
            return float(json.loads(out.decode().strip().splitlines()[-1])["gbps"])
        finally:
            await session.close("bench done")


async def measure_link(
    host: str, port: int, plan: RunPlan, *, secret: bytes | None, progress: Progress
) -> dict[str, Any]:
    """Everything `dilocod bench run` reports about one link, as one JSON-ready dict."""
    progress.note(f"making {plan.size_bytes / 2**20:.0f} MiB of {plan.data} test data ...")
    data, item = make_data(plan.data, plan.size_bytes)
    session = await connect(host, port, peer_id="bench-probe", role="bench", secret=secret, streams=0)
    try:
        raw_port = int((await server_status(session))["raw_port"])
    finally:
        await session.close("bench probe done")
    rtt_s = measure_rtt(host, raw_port)
    progress.advance(f"RTT {rtt_s * 1e3:.3f} ms")
    settings = read_tcp_settings()
    auto_choice = auto_streams(rtt_s, settings) if AUTO_STREAMS in plan.streams else None
    if auto_choice is not None:
        progress.note(f"auto streams: {auto_choice.streams} ({auto_choice.reason})")
    counts = [auto_choice.streams if s == AUTO_STREAMS and auto_choice else s for s in plan.streams]
    sample = memoryview(data)[: min(len(data), 32 << 20)]
    figures = measure_codecs(sample, chunk_bytes=plan.chunk_bytes, shuffle_item_size=item)
    link = _Link(host, port, raw_port, plan, data, item, progress, figures)
    # Fit the repeats into --duration from one raw transfer's time (the slowest part of each pair
    # is the raw or the uncompressed push, both about one transfer at the link's rate).
    with_raw = RawClient(host, raw_port, max(counts), "threaded", plan.congestion)
    try:
        with_raw.send(memoryview(data))
        transfer_s = with_raw.send(memoryview(data))
    finally:
        with_raw.close()
    pairs = len(plan.streams) * len(plan.codecs)
    link.repeats = max(MIN_REPEATS, min(MAX_REPEATS, int(plan.duration_s / (pairs * 2 * transfer_s))))
    runs: list[dict[str, Any]] = []
    raw_by_streams: dict[int, float] = {}
    for streams, asked in zip(counts, plan.streams, strict=True):
        rows, ceiling = await link.combinations(streams, secret)
        if asked == AUTO_STREAMS:
            rows = [{**row, "streams_auto": True} for row in rows]
        runs.extend(rows)
        raw_by_streams[streams] = round(ceiling, 3)
    raw_gbps = max(raw_by_streams.values())
    best = max(runs, key=lambda r: r["gbps"])
    best_codec = best.get("chosen", best["codec"])
    round_trip_s = await link.round_trip(best["streams"], best_codec, secret)
    progress.advance(f"round trip {round_trip_s * 1e3:.0f} ms")
    gloo_gbps = None
    if plan.vs_gloo:
        gloo_gbps = round(await link.gloo(secret), 3)
        progress.advance(f"gloo {gloo_gbps:.2f} Gbps")
    recommendation = recommend(runs, raw_gbps, rtt_s, settings, link.auto, plan)
    warnings = [
        w
        for w in (
            bdp_warning(raw_gbps, rtt_s, settings, recommendation["streams"]),
            bdp_warning(raw_gbps, plan.assumed_rtt_s, settings, recommendation["streams"]),
        )
        if w is not None
    ]
    return {
        "target": f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
        "raw_gbps": raw_gbps,
        "raw": [{"streams": s, "gbps": g} for s, g in raw_by_streams.items()],
        "gloo_gbps": gloo_gbps,
        "rtt_ms": round(rtt_s * 1e3, 4),
        "round_trip_ms": round(round_trip_s * 1e3, 2),
        "round_trip_of": {"streams": best["streams"], "codec": best_codec},
        "runs": runs,
        "recommendation": recommendation,
        "codec_figures": [_figure_json(f) for f in figures],
        "tcp": _settings_json(settings),
        "warnings": warnings,
        "congestion": plan.congestion,
        "auto_streams": None
        if auto_choice is None
        else {"streams": auto_choice.streams, "reason": auto_choice.reason},
        "size_bytes": len(data),
        "data": plan.data,
        "repeats": link.repeats,
    }


def recommend(
    runs: list[dict[str, Any]],
    raw_gbps: float,
    rtt_s: float,
    settings: TcpSettings,
    auto: CodecChoice | None,
    plan: RunPlan,
) -> dict[str, Any]:
    """Streams: the fewest measured that come within STREAMS_TOLERANCE of the best, but never fewer
    than the bandwidth-delay product at the measured RTT needs. Codec: the tuning model's pick
    (what "auto" measured), else the best fixed codec measured."""
    best = max(r["gbps"] for r in runs)
    good = sorted(r["streams"] for r in runs if r["gbps"] >= best * (1 - STREAMS_TOLERANCE))
    by_bdp = choose_streams(raw_gbps, rtt_s, settings.max_window_bytes)
    streams = max(good[0], by_bdp.streams)
    if auto is not None:
        codec, reason = auto.codec, auto.reason
    else:
        fixed = [r for r in runs if r["codec"] in CODECS]
        top = max(fixed, key=lambda r: r["gbps"])
        codec, reason = top["codec"], f"{top['codec']} measured fastest ({top['gbps']:.2f} Gbps)"
    return {
        "streams": streams,
        "codec": codec,
        "chunk_bytes": plan.chunk_bytes,
        "why": f"{by_bdp.reason}; {reason}",
    }


def advice_from(link: dict[str, Any], figures: list[CodecFigure], target: str = "") -> Advice:
    """The learner's advice from a measured link, saved for the syncer address `target` ("" = any
    syncer: the bench server usually listens on another port, or host, than the syncer)."""
    rec = link["recommendation"]
    return Advice(
        target=target,
        rate_gbps=link["raw_gbps"],
        rtt_ms=link["rtt_ms"],
        streams=rec["streams"],
        codec=rec["codec"],
        chunk_bytes=rec["chunk_bytes"],
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        figures=tuple(figures),
    )


def figures_of(link: dict[str, Any]) -> list[CodecFigure]:
    return [
        CodecFigure(f["codec"], f["ratio"], _inf(f["compress_gbps"]), _inf(f["decompress_gbps"]))
        for f in link["codec_figures"]
    ]


def _inf(value: float | None) -> float:
    return math.inf if value is None else float(value)


def _figure_json(figure: CodecFigure) -> dict[str, Any]:
    # JSON has no infinity: an unbounded codec speed (none) is written as null.
    out = asdict(figure)
    for key in ("compress_gbps", "decompress_gbps"):
        out[key] = None if math.isinf(out[key]) else round(out[key], 3)
    out["ratio"] = round(out["ratio"], 4)
    return out


def _settings_json(settings: TcpSettings) -> dict[str, Any]:
    out = asdict(settings)
    out["max_window_bytes"] = settings.max_window_bytes
    return out
