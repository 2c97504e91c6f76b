"""Hostile peers against a real syncer, with an honest learner training beside them.

What a holder of the key can send (pushes of enormous but finite values, absurd step reports and
token counts) must not make the global model non-finite, take a round's whole merge weight, or stop
rounds, checkpoints or status for the honest learner. Each attack is followed by the same checks:
the honest learner's fragments go on advancing, a checkpoint is written after the attack, `dilocod
status` answers, SIGTERM exits 0, and the exported model is finite and within the bounds of the
honest learner's own steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from devkit.daemons import (
    DaemonProcess,
    entry_model,
    export_global_model,
    start_syncer,
    syncer_status,
    write_entry,
)
from devkit.scripted_learner import ScriptedLearner
from devkit.transfers import CoreClient
from dilocod.outer.weights import MAX_WEIGHT_RATIO
from dilocod.transport.endpoints import connect
from dilocod.transport.errors import SessionClosed
from dilocod.transport.loop import run
from dilocod.wire.events import MessageReceived
from dilocod.wire.frames import ChunkHeader, Codec
from dilocod.wire.limits import DEFAULT_LIMITS
from dilocod.wire.manifest import ModelEntry
from dilocod.wire.messages import Join, Ping, Plan, StatusRequest, StatusResponse, StepReport

DEADLINE_S = 120.0
FRAGMENTS = 4
#: Every round after an attack must still merge: this many more versions of every fragment.
ROUNDS_AFTER = 3
#: A finite float32 that overflows as soon as two of them are added or one is squared.
HUGE = 3e38
#: The largest chunk a stream header may declare, and how many data connections a session may hold.
MAX_CHUNK = DEFAULT_LIMITS.max_chunk_bytes
DATA_CONNECTIONS = DEFAULT_LIMITS.max_data_connections
#: The most a learner's weight share can be in a round with one other learner.
MAX_SHARE_OF_TWO = MAX_WEIGHT_RATIO / (MAX_WEIGHT_RATIO + 1)


@pytest.fixture
def entry_dir(tmp_path: Path) -> Path:
    return write_entry(tmp_path / "entry")


def _start(tmp_path: Path, entry_dir: Path) -> DaemonProcess:
    return start_syncer(
        tmp_path,
        entry_dir,
        tmp_path / "state",
        *("--fragments", str(FRAGMENTS), "--sync-every", str(FRAGMENTS), "--quorum", "1"),
        *("--checkpoint-every-s", "1"),
    )


async def _advance(learner: ScriptedLearner, rounds: int) -> None:
    """Wait until every fragment of the honest learner is `rounds` versions newer than now."""
    target = [v + rounds for v in learner.versions]
    await learner.wait_until(lambda: all(v >= t for v, t in zip(learner.versions, target, strict=True)))


def _checkpoint_after(syncer: DaemonProcess, since: float) -> None:
    """A checkpoint logged after `since` (time.time()): saving works after the attack."""
    syncer.wait_for("checkpoint", lambda r: _when(r) > since, DEADLINE_S)


def _when(record: dict[str, object]) -> float:
    stamp = record.get("timestamp")
    if isinstance(stamp, str):
        return datetime.fromisoformat(stamp).timestamp()
    return -math.inf  # a record without a time cannot prove it came after


def _check_model(state_dir: Path, out: Path, initial: dict[str, torch.Tensor], honest_steps: int) -> None:
    """Finite, and no further from the initial model than the honest learner's steps can take it.

    The honest learner moves every value by -rate per step; with the outer Nesterov step (lr 0.7,
    momentum 0.9) a value moves at most lr / (1 - mu) = 7 times the sum of the outer gradients.
    Allowing 10 times that is generous to the merge and still far below anything a hostile push of
    HUGE values leaves behind.
    """
    exported = load_file(export_global_model(state_dir, out))
    bound = 10 * 7 * 1e-3 * max(honest_steps, 1)
    for name, start in initial.items():
        values = exported[name]
        assert bool(torch.isfinite(values).all()), f"{name} holds non-finite values"
        moved = float((values - start).abs().max())
        assert moved <= bound, f"{name} moved {moved:.3g}, more than honest training allows ({bound:.3g})"


def test_huge_finite_pushes_never_reach_the_global_model(tmp_path: Path, entry_dir: Path) -> None:
    """A key holder pushes 3e38 in every value of every push, from the first push of every
    fragment of a fresh syncer (before any history of accepted norms exists): each is refused, none
    is merged, the honest learner's rounds go on and the model stays finite."""
    entries, initial = entry_model(entry_dir)
    syncer = _start(tmp_path, entry_dir)

    async def main() -> int:
        async with asyncio.timeout(DEADLINE_S):
            rogue = ScriptedLearner(
                "rogue", syncer.port, entries, step_s=0.01, poison_pushes=10**9, poison_value=HUGE
            )
            await rogue.join()
            good = ScriptedLearner("good", syncer.port, entries, step_s=0.01)
            await good.join()
            refused = asyncio.Event()

            async def until_refused() -> None:
                for fragment in range(FRAGMENTS):
                    await asyncio.to_thread(
                        syncer.wait_for,
                        "push rejected",
                        lambda r, p=fragment: r["learner"] == "rogue" and r["fragment"] == p,
                        DEADLINE_S,
                    )
                await _advance(good, ROUNDS_AFTER)
                refused.set()

            # The rogue pushes first: its pushes are the first the syncer sees of each fragment.
            await asyncio.gather(rogue.run(stop=refused), good.run(stop=refused), until_refused())
            await rogue.close()
            await good.close()
            return good.steps

    try:
        honest_steps = run(main())
        assert syncer_status(syncer.port)["rounds_merged"] >= FRAGMENTS * ROUNDS_AFTER
    finally:
        assert syncer.stop() == 0, syncer.stderr()
    for merged in syncer.log_events("round merged"):
        assert "rogue" not in merged["contributors"], merged
    _check_model(tmp_path / "state", tmp_path / "export.safetensors", initial, honest_steps)


def test_absurd_numbers_from_one_learner_stop_nothing_for_the_others(tmp_path: Path, entry_dir: Path) -> None:
    """Step reports of 1e308 s and of 2^64 - 1 tokens close the sender's session; one of 3600 s
    (in range) is taken. Rounds, checkpoints and status go on for the honest learner throughout."""
    entries, initial = entry_model(entry_dir)
    syncer = _start(tmp_path, entry_dir)

    async def rogue_reports(report: StepReport) -> bool:
        """Join as a rogue, send one report, and say whether the syncer closed the session."""
        session = await connect("127.0.0.1", syncer.port, peer_id="numbers", role="learner", streams=0)
        try:
            await session.send(Join(entries, ""))
            while not isinstance(await session.recv(), Plan):
                pass
            await session.send(report)
            # The syncer handles a session's control messages in order: its answer to a status
            # request says it took the report and kept the session.
            await session.send(StatusRequest())
            while not isinstance(await session.recv(), StatusResponse):
                pass
            return False
        except SessionClosed:
            return True
        finally:
            await session.close()

    async def main() -> int:
        async with asyncio.timeout(4 * DEADLINE_S):
            good = ScriptedLearner("good", syncer.port, entries, step_s=0.01)
            await good.join()
            stop = asyncio.Event()
            training = asyncio.create_task(good.run(stop=stop))
            await _advance(good, 1)
            for report, closed in (
                (StepReport(1, 32, 1e308), True),
                (StepReport(1, 2**64 - 1, 0.01), True),
                (StepReport(1, 32, 3600.0), False),
            ):
                attacked = time.time()
                assert await rogue_reports(report) is closed, report
                await _advance(good, ROUNDS_AFTER)
                await asyncio.to_thread(_checkpoint_after, syncer, attacked)
                status = await asyncio.to_thread(syncer_status, syncer.port)
                assert "good" in {learner["id"] for learner in status["learners"]}
            stop.set()
            await training
            await good.close()
            return good.steps

    try:
        honest_steps = run(main())
    finally:
        assert syncer.stop() == 0, syncer.stderr()
    _check_model(tmp_path / "state", tmp_path / "export.safetensors", initial, honest_steps)


def test_a_huge_token_count_biases_but_does_not_own_the_merge(tmp_path: Path, entry_dir: Path) -> None:
    """A key holder claiming 2^40 tokens per step against an honest 100 gets a bounded share of
    every round they both contribute to, not all of it: with two learners its weight is clipped at
    MAX_WEIGHT_RATIO (16) times the other's, a share of at most 16/17."""
    entries, _ = entry_model(entry_dir)
    syncer = start_syncer(
        tmp_path,
        entry_dir,
        tmp_path / "state",
        *("--fragments", "1", "--sync-every", "2", "--quorum", "2"),
    )

    async def main() -> None:
        async with asyncio.timeout(DEADLINE_S):
            good = ScriptedLearner("good", syncer.port, entries, step_s=0.02)
            rogue = ScriptedLearner("rogue", syncer.port, entries, step_s=0.02, tokens_per_step=2**40)
            await good.join()
            await rogue.join()
            both = asyncio.Event()

            async def until_both() -> None:
                await asyncio.to_thread(
                    syncer.wait_for,
                    "round merged",
                    lambda r: sorted(r["contributors"]) == ["good", "rogue"],
                    DEADLINE_S,
                )
                both.set()

            await asyncio.gather(good.run(stop=both), rogue.run(stop=both), until_both())
            await good.close()
            await rogue.close()

    try:
        run(main())
    finally:
        assert syncer.stop() == 0, syncer.stderr()
    shared = [r for r in syncer.log_events("round merged") if len(set(r["contributors"])) == 2]
    assert shared
    for merged in shared:
        # The log rounds weights to 4 decimals: hence the tolerance below.
        weights = dict(zip(merged["contributors"], merged["weights"], strict=True))
        share = weights["rogue"] / sum(weights.values())
        assert share <= MAX_SHARE_OF_TWO + 1e-3, f"the rogue took {share:.1%} of round {merged['round']}"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def _refused_at_handshake(port: int, session: bytes) -> bool:
    """Open one more data connection of `session`: whether the syncer refused it."""
    try:
        client = CoreClient(port, kind="data", session=session)
    except AssertionError:  # the peer closed before the handshake completed
        return True
    client.close()
    return False


def _memory_attacks(port: int, entries: tuple[ModelEntry, ...], held: list[CoreClient]) -> None:
    """What a peer may do to the syncer's memory, each connection kept open while measured.

    A PING flood whose PONGs are never read (before JOIN); then a learner that joins and opens every
    data connection its session may hold, asks for one too many, and on each begins a 16 MiB chunk
    and then sends nothing more (a trickle).
    """
    flood = CoreClient(port)
    held.append(flood)
    for seq in range(100_000):
        flood.conn.send(Ping(seq))
        if seq % 1000 == 999:
            with contextlib.suppress(OSError):  # a syncer that bounds its answers cuts us off
                flood.flush()
    owner = CoreClient(port)
    held.append(owner)
    owner.conn.send(Join(entries, ""))
    owner.flush()
    owner.wait_for(lambda e: isinstance(e, MessageReceived) and isinstance(e.message, Plan))
    session = owner.peer.session
    connections = [CoreClient(port, kind="data", session=session) for _ in range(DATA_CONNECTIONS)]
    held.extend(connections)
    assert _refused_at_handshake(port, session), "a data connection beyond the advertised limit was accepted"
    chunk = ChunkHeader(0, MAX_CHUNK, Codec.NONE, 0, 0)
    for data in connections:
        data.conn.send_chunk(1, chunk, bytes(MAX_CHUNK))
        head, *_ = data.conn.data_to_send()
        with contextlib.suppress(OSError):  # a syncer may close what it will not hold
            data.sock.sendall(bytes(head) + bytes(4096))  # then nothing more: a trickle


def test_hostile_connections_cost_the_syncer_bounded_memory(tmp_path: Path, entry_dir: Path) -> None:
    """Baseline: the syncer's resident memory after an honest learner's first rounds. Then the
    attacks of _memory_attacks, all held open at once: the syncer's memory stays within 1.2x of the
    baseline, and the honest learner's rounds go on."""
    entries, _ = entry_model(entry_dir)
    syncer = _start(tmp_path, entry_dir)
    held: list[CoreClient] = []

    async def main() -> tuple[int, int]:
        async with asyncio.timeout(2 * DEADLINE_S):
            good = ScriptedLearner("good", syncer.port, entries, step_s=0.01)
            await good.join()
            stop = asyncio.Event()
            training = asyncio.create_task(good.run(stop=stop))
            await _advance(good, ROUNDS_AFTER)
            baseline = _rss_bytes(syncer.pid)
            await asyncio.to_thread(_memory_attacks, syncer.port, entries, held)
            await _advance(good, ROUNDS_AFTER)
            attacked = _rss_bytes(syncer.pid)
            stop.set()
            await training
            await good.close()
            return baseline, attacked

    try:
        baseline, attacked = run(main())
        mib = 2**20
        assert attacked <= 1.2 * baseline, (
            f"syncer RSS {attacked / mib:.0f} MiB after the attacks, {baseline / mib:.0f} MiB before"
        )
    finally:
        for client in held:
            client.close()
        assert syncer.stop() == 0, syncer.stderr()
