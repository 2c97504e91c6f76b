"""A learner back on the same syncer incarnation is sent only what it lacks (SPEC §4.4): a real
`dilocod syncer` process, with sessions driven by hand as a learner's link drives them (JOIN with
the versions it holds, PLAN, the healing transfers it is sent), and with a real `dilocod learner`
whose connections the fault proxy of tests/chaos cuts. Every wait is on a log record or a
message, with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from pathlib import Path
from typing import Any

from devkit.chaos.proxy import FaultProxy
from devkit.daemons import (
    LEARNER_ENTRY,
    DaemonProcess,
    entry_model,
    start_learner,
    start_syncer,
    write_entry,
    write_learner_entry,
)
from dilocod.config import Address
from dilocod.ops.status import fetch_status
from dilocod.transport.endpoints import connect
from dilocod.transport.loop import run
from dilocod.transport.session import FragmentReceived, Session
from dilocod.wire import codecs
from dilocod.wire.frames import ChunkHeader, Codec
from dilocod.wire.manifest import ModelEntry
from dilocod.wire.messages import (
    FragmentRequest,
    Join,
    PartialUpdate,
    Plan,
    PushHeader,
    StepReport,
    UpdateHeader,
    chunk_bitmap,
)
from dilocod.wire.stream import Allocate, Resumed, StreamHeader

DEADLINE_S = 120.0
FRAGMENTS = 3


async def _join(
    port: int, join: Join, allocate: Allocate | None = None, streams: int = 1, peer_id: str = "back"
) -> tuple[Session, Plan]:
    session = await connect("127.0.0.1", port, peer_id=peer_id, streams=streams, allocate=allocate)
    await session.send(join)
    async with asyncio.timeout(DEADLINE_S):
        plan = await session.recv()
    assert isinstance(plan, Plan)
    return session, plan


async def _updates(session: Session, count: int) -> list[int]:
    """The fragments of the next `count` updates the session receives."""
    fragments = []
    async with asyncio.timeout(DEADLINE_S):
        while len(fragments) < count:
            item = await session.recv()
            if isinstance(item, FragmentReceived) and isinstance(item.header, UpdateHeader):
                fragments.append(item.header.fragment)
    return fragments


def _healed(syncer: DaemonProcess, index: int) -> dict[str, Any]:
    """The syncer's `learner healed` line of this learner's session number `index` (from 0):
    wait_for offers each record once, in order."""
    heals = itertools.count()
    return syncer.wait_for(
        "learner healed", lambda r: r["learner"] == "back" and next(heals) == index, DEADLINE_S
    )


def test_a_rejoin_is_sent_only_the_fragments_it_does_not_hold(tmp_path: Path) -> None:
    entry_dir = write_entry(tmp_path / "entry")
    model, _ = entry_model(entry_dir)
    syncer = start_syncer(tmp_path, entry_dir, tmp_path / "syncer", "--fragments", str(FRAGMENTS))

    async def main() -> None:
        first, plan = await _join(syncer.port, Join(model, "", "the-learner"))
        assert len(plan.fragments) == FRAGMENTS
        assert sorted(await _updates(first, FRAGMENTS)) == list(range(FRAGMENTS))
        # The syncer logs the heal once it has the last acknowledgement: wait for that before
        # leaving (a session closed first ends its heal unlogged).
        first_heal = await asyncio.to_thread(_healed, syncer, 0)
        await first.close("reconnecting")
        assert first_heal["sent"] == FRAGMENTS and first_heal["bytes"] > 0

        # Everything held at its current version: nothing is sent, and the learner is healed.
        held = tuple(plan.versions)
        second, again = await _join(syncer.port, Join(model, plan.incarnation, "the-learner", held))
        assert again.versions == plan.versions
        second_heal = await asyncio.to_thread(_healed, syncer, 1)
        assert second_heal["sent"] == 0 and second_heal["bytes"] == 0
        await second.close("reconnecting")

        # Fragment 1 not held, fragment 2 held at a version the syncer never had: both are sent.
        partial = (plan.versions[0], None, plan.versions[2] + 5)
        third, _ = await _join(syncer.port, Join(model, plan.incarnation, "the-learner", partial))
        assert sorted(await _updates(third, 2)) == [1, 2]
        third_heal = await asyncio.to_thread(_healed, syncer, 2)
        assert third_heal["sent"] == 2
        assert third_heal["bytes"] < first_heal["bytes"]
        await third.close("reconnecting")

        # Held from another incarnation (a syncer restarted since): healed in full.
        fourth, _ = await _join(syncer.port, Join(model, "an-older-one", "the-learner", held))
        assert sorted(await _updates(fourth, FRAGMENTS)) == list(range(FRAGMENTS))
        await fourth.close("done")
        # What rejoins did not need sent again, as an operator sees it (and /metrics counts it).
        status = await fetch_status(Address("127.0.0.1", syncer.port), secret=None, timeout_s=DEADLINE_S)
        assert status["fragments_held_at_join"] == FRAGMENTS + 1
        assert status["chunks_asked_again"] == 0

    try:
        run(main())
        joined = syncer.log_events("learner joined")
        assert [(r["heals"], r["held"]) for r in joined] == [(3, 0), (0, 3), (2, 1), (3, 0)]
    finally:
        assert syncer.stop() == 0, syncer.stderr()


RESUME_ENTRY_SOURCE = """
import torch
import dilocod


def make_trainer(ctx):
    torch.manual_seed(99)
    model = torch.nn.Linear(128, 64)  # 33 KB: 9 chunks of 4 KiB
    return dilocod.Trainer(model=model, optimizer=None, step=lambda index: dilocod.StepResult(64, 0.0))
"""


def _resume_syncer(tmp_path: Path, *args: str) -> tuple[DaemonProcess, tuple[ModelEntry, ...]]:
    """A syncer of RESUME_ENTRY_SOURCE's model in one fragment of 9 chunks, and that model."""
    entry_dir = tmp_path / "entry"
    entry_dir.mkdir()
    (entry_dir / "resume_entry.py").write_text(RESUME_ENTRY_SOURCE)
    model = (ModelEntry("weight", "float32", (64, 128)), ModelEntry("bias", "float32", (64,)))
    syncer = start_syncer(
        tmp_path, entry_dir, tmp_path / "syncer", "--fragments", "1", "--chunk", "4KiB", *args,
        entry="resume_entry:make_trainer",
    )  # fmt: skip
    return syncer, model


def test_an_update_cut_short_is_resumed_without_the_chunks_the_learner_holds(tmp_path: Path) -> None:
    """SPEC §4.4: a JOIN naming the chunks it holds of an update its lost session cut short is
    sent that version again without them, into the buffer that holds them; the fragment arrives
    byte for byte, and the syncer counts the chunks it did not send. A partial of a version the
    fragment has moved past (here: one it never had) is sent whole."""
    syncer, model = _resume_syncer(tmp_path)

    async def main() -> None:
        first, plan = await _join(syncer.port, Join(model, "", "the-learner"))
        async with asyncio.timeout(DEADLINE_S):
            whole = await first.recv()
        assert isinstance(whole, FragmentReceived) and isinstance(whole.header, UpdateHeader)
        header, fragment = whole.header, bytes(whole.buffer)
        assert header.chunks == 9 and not header.skip
        await asyncio.to_thread(_healed, syncer, 0)
        await first.close("reconnecting")

        held = [0, 1, 2, 5, 8]  # what arrived before the session was lost (the last chunk is short)
        checksums = codecs.chunk_checksums(fragment, header.chunk_bytes)
        kept = memoryview(bytearray(len(fragment)))
        for seq in held:
            part = slice(seq * header.chunk_bytes, (seq + 1) * header.chunk_bytes)
            kept[part] = fragment[part]
        offered: list[UpdateHeader] = []

        def allocate(update: StreamHeader) -> memoryview | Resumed:
            assert isinstance(update, UpdateHeader)
            offered.append(update)
            if update.skip:
                return Resumed(kept, {seq: checksums[seq] for seq in held})
            return memoryview(bytearray(update.raw_bytes))

        partial = (PartialUpdate(0, plan.versions[0], chunk_bitmap(held, header.chunks)),)
        join = Join(model, plan.incarnation, "the-learner", (None,), partial)
        second, _ = await _join(syncer.port, join, allocate=allocate)
        async with asyncio.timeout(DEADLINE_S):
            resumed = await second.recv()
        assert isinstance(resumed, FragmentReceived) and isinstance(resumed.header, UpdateHeader)
        assert [u.skipped for u in offered] == [held]
        assert resumed.buffer.obj is kept.obj and bytes(resumed.buffer) == fragment
        heal = await asyncio.to_thread(_healed, syncer, 1)
        assert heal["bytes"] == header.raw_bytes - resumed.header.skipped_bytes
        await second.close("reconnecting")

        # The version it held part of is not the fragment's: sent whole.
        stale = (PartialUpdate(0, plan.versions[0] + 5, chunk_bitmap(held, header.chunks)),)
        third, _ = await _join(syncer.port, dataclasses.replace(join, partial=stale), allocate=allocate)
        async with asyncio.timeout(DEADLINE_S):
            whole_again = await third.recv()
        assert isinstance(whole_again, FragmentReceived) and bytes(whole_again.buffer) == fragment
        assert not offered[-1].skip
        await third.close("done")
        status = await fetch_status(Address("127.0.0.1", syncer.port), secret=None, timeout_s=DEADLINE_S)
        assert status["chunks_resumed"] == len(held)

    try:
        run(main())
    finally:
        assert syncer.stop() == 0, syncer.stderr()


def test_a_push_cut_short_is_resumed_without_the_chunks_the_syncer_holds(tmp_path: Path) -> None:
    """SPEC §4.4: the syncer keeps what it verified of a push its session lost; asked again for
    that round after the learner rejoins, FRAGMENT_REQUEST says which chunks it holds, and the same
    push sent without them completes and is merged. A second learner, joined and silent, keeps the
    round collecting meanwhile."""
    syncer, model = _resume_syncer(tmp_path, "--sync-every", "2")

    async def asked(session: Session, first_step: int) -> FragmentRequest:
        """Report steps until the syncer asks for the fragment (each report waits for a reply)."""
        async with asyncio.timeout(DEADLINE_S):
            for step in itertools.count(first_step):
                await session.send(StepReport(step, 64, 0.01))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):  # a poll period, not a wait for an event
                        while True:
                            item = await session.recv()
                            if isinstance(item, FragmentRequest):
                                return item
        raise AssertionError("unreachable")

    async def main() -> None:
        other, _ = await _join(syncer.port, Join(model, "", "another"), peer_id="other")
        first, plan = await _join(syncer.port, Join(model, "", "the-learner"), streams=0)
        async with asyncio.timeout(DEADLINE_S):
            heal = await first.recv()
        assert isinstance(heal, FragmentReceived) and isinstance(heal.header, UpdateHeader)
        await asyncio.to_thread(_healed, syncer, 0)
        request = await asked(first, 1)
        gradient = bytes(range(256)) * (heal.header.raw_bytes // 256)
        header = PushHeader(
            heal.header.manifest, len(gradient), "none", heal.header.chunk_bytes,
            fragment=0, round=request.round, base_version=plan.versions[0], c_steps=4, c_tokens=256,
        )  # fmt: skip
        # Header and chunks 0-3 on the control connection (streams=0: one connection, so the
        # syncer reads them in this order before the session ends), then the session is lost.
        transfer_id, _ = first.core.start_send(header, None)
        first.control.send(header, transfer_id)
        for seq in range(4):
            raw = gradient[seq * header.chunk_bytes : (seq + 1) * header.chunk_bytes]
            chunk = ChunkHeader(seq, len(raw), Codec.NONE, 0, codecs.checksum(raw))
            first.control.send_chunk(transfer_id, chunk, raw)
        await first.close("cut")

        again = Join(model, plan.incarnation, "the-learner", (plan.versions[0],))
        second, _ = await _join(syncer.port, again, streams=0)
        async with asyncio.timeout(DEADLINE_S):  # asked at join for the round still collecting
            resume = await second.recv()
        assert isinstance(resume, FragmentRequest)
        assert (resume.round, resume.have) == (request.round, chunk_bitmap(range(4), header.chunks))
        checksums = codecs.chunk_checksums(gradient, header.chunk_bytes)
        resumed = dataclasses.replace(header, skip=resume.have)
        await second.send_fragment(resumed, gradient, checksums=checksums)  # acknowledged: whole
        status = await fetch_status(Address("127.0.0.1", syncer.port), secret=None, timeout_s=DEADLINE_S)
        assert status["chunks_resumed"] == 4
        await second.close("done")
        await other.close("done")

    try:
        run(main())
    finally:
        assert syncer.stop() == 0, syncer.stderr()


def test_a_learner_whose_connections_are_cut_rejoins_holding_its_fragments(tmp_path: Path) -> None:
    """A real learner (network process, its JOIN built by its link) healed, then every connection
    it has is reset: it dials again, its JOIN names what it holds, and the syncer sends it only
    what moved meanwhile; no more than that is healed (overwritten)."""
    entry_dir = write_learner_entry(tmp_path / "entry")
    syncer = start_syncer(
        tmp_path, entry_dir, tmp_path / "syncer", "--fragments", str(FRAGMENTS), entry=LEARNER_ENTRY
    )
    learner = None
    try:
        with FaultProxy(("127.0.0.1", syncer.port), ["cut"]) as proxy:
            learner = start_learner(tmp_path, entry_dir, proxy.port_of("cut"), "cut")
            learner.wait_for("healed", lambda r: True, DEADLINE_S)
            proxy.sever("cut", 0.0)
            back = syncer.wait_for(
                "learner joined", lambda r: r["learner"] == "cut" and r["had_incarnation"], DEADLINE_S
            )
            said = learner.wait_for("rejoined", lambda r: True, DEADLINE_S)
        assert said["held"] == FRAGMENTS, said
        assert back["held"] == said["current"] and back["heals"] == FRAGMENTS - back["held"], back
        assert back["held"] >= 1, back  # a round merges a fragment every few steps: not all moved
    finally:
        if learner is not None:
            learner.stop()
        assert syncer.stop() == 0, syncer.stderr()
