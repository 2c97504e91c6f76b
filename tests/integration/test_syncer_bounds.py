"""What a peer can make a real `dilocod syncer` hold, by its state: before JOIN nothing is
allocated for it (a push stream is refused by its header, an early chunk closes its connection),
liveness frames before JOIN are allowed, and a joined learner's push must have the size its plan
says. One syncer process serves every test here; each checks it serves on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.daemons import DaemonProcess, entry_model, start_syncer, write_entry
from devkit.scripted_learner import ScriptedLearner
from devkit.transfers import CoreClient
from dilocod.transport.endpoints import connect
from dilocod.transport.errors import TransferFailed
from dilocod.transport.loop import run
from dilocod.wire.codecs import checksum
from dilocod.wire.errors import ErrorCode
from dilocod.wire.events import MessageReceived, PeerWentAway
from dilocod.wire.frames import ChunkHeader, Codec
from dilocod.wire.manifest import ModelEntry, pack_manifest
from dilocod.wire.messages import Join, Plan, Pong, PushHeader

DEADLINE_S = 120.0
CHUNK_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def entry_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_entry(tmp_path_factory.mktemp("bounds") / "entry")


@pytest.fixture(scope="module")
def entries(entry_dir: Path) -> tuple[ModelEntry, ...]:
    return entry_model(entry_dir)[0]


@pytest.fixture(scope="module")
def syncer(tmp_path_factory: pytest.TempPathFactory, entry_dir: Path) -> Iterator[DaemonProcess]:
    work = tmp_path_factory.mktemp("syncer")
    process = start_syncer(work, entry_dir, work / "state", "--fragments", "2", "--sync-every", "2")
    try:
        yield process
        assert process.alive(), process.stderr()
    finally:
        assert process.stop() == 0, process.stderr()


def test_a_push_before_join_is_refused_by_its_header(
    syncer: DaemonProcess, entries: tuple[ModelEntry, ...]
) -> None:
    """Nothing is allocated for a peer that has not joined: its push stream is reset NOT_JOINED
    from the header, and the session may still join afterwards."""
    manifest, raw = pack_manifest([("w", "float32", [256 * 1024])])

    async def main() -> None:
        async with asyncio.timeout(DEADLINE_S):
            session = await connect("127.0.0.1", syncer.port, peer_id="early-push", streams=1)
            try:
                header = PushHeader(
                    tuple(manifest), raw, "none", CHUNK_BYTES, fragment=0, round=0, base_version=0
                )
                with pytest.raises(TransferFailed) as refused:
                    await session.send_fragment(header, bytearray(raw))
                assert refused.value.code == ErrorCode.NOT_JOINED
                await session.send(Join(entries, ""))
                assert isinstance(await session.recv(), Plan)
            finally:
                await session.close("done")

    run(main())


def test_an_early_chunk_before_join_closes_its_connection(syncer: DaemonProcess) -> None:
    """Before JOIN no chunk is kept ahead of a header (the early-chunk bound is 0 bytes)."""
    payload = bytes(4096)
    with CoreClient(syncer.port) as client:
        client.conn.send_chunk(1, ChunkHeader(0, len(payload), Codec.NONE, 0, checksum(payload)), payload)
        client.flush()
        went = client.went_away()
    assert went.error_code == ErrorCode.UNKNOWN_TRANSFER
    assert "early-chunk bound of 0 bytes" in went.reason


def test_pong_before_join_is_allowed(syncer: DaemonProcess, entries: tuple[ModelEntry, ...]) -> None:
    """SPEC §4.4: JOIN is the first frame but for PING, PONG and the closing frames. A learner
    answers the syncer's idle PING on its own, possibly before it sends JOIN."""
    with CoreClient(syncer.port) as client:
        client.conn.send(Pong(1))
        client.conn.send(Join(entries, ""))
        client.flush()
        plan = client.wait_for(lambda e: isinstance(e, MessageReceived | PeerWentAway))
    assert isinstance(plan, MessageReceived) and isinstance(plan.message, Plan), plan


def test_an_oversized_push_is_refused_by_its_header(
    syncer: DaemonProcess, entries: tuple[ModelEntry, ...]
) -> None:
    """A push whose manifest is the plan's but whose raw_bytes are larger: reset with
    LIMIT_EXCEEDED naming both sizes, before anything is allocated; the learner goes on."""

    async def main() -> None:
        async with asyncio.timeout(DEADLINE_S):
            learner = ScriptedLearner("oversized", syncer.port, entries, step_s=0.01)
            await learner.join()
            assert learner.session is not None
            try:
                await learner.run(steps=4, until=lambda: max(learner.versions) >= 1)  # joined: rounds run
                raw = len(learner.anchors[0]) * 4
                oversized = raw + CHUNK_BYTES
                header = PushHeader(
                    learner.manifests[0], oversized, "none", CHUNK_BYTES, fragment=0, round=0, base_version=0
                )
                with pytest.raises(TransferFailed) as refused:
                    await learner.session.send_fragment(header, bytearray(oversized))
                assert refused.value.code == ErrorCode.LIMIT_EXCEEDED
                assert f"declares {oversized} raw bytes" in refused.value.message
                assert f"at fp32 has {raw}" in refused.value.message
                versions = max(learner.versions)
                await learner.run(steps=4, until=lambda: max(learner.versions) > versions)
            finally:
                await learner.close()

    run(main())
