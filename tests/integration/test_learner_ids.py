"""One live session per learner id: a second `dilocod learner` started under the id of one that is
training is refused with LEARNER_ID_IN_USE and exits 78 saying so (the first trains on, never
replaced); a learner killed with -9 and restarted at once under its id joins as usual; the same
learner process reconnecting before the syncer noticed its old connection close takes its own
place back. Real processes; every wait is on a log record, a reply or a process exit, with a
deadline."""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path

import pytest

from devkit.daemons import (
    LEARNER_ENTRY,
    entry_model,
    start_learner,
    start_syncer,
    write_entry,
    write_learner_entry,
)
from dilocod.learner.state import learner_instance
from dilocod.model.params import model_entries
from dilocod.transport.endpoints import connect
from dilocod.transport.errors import SessionClosed
from dilocod.transport.loop import run
from dilocod.transport.session import Session
from dilocod.wire.errors import ErrorCode
from dilocod.wire.manifest import ModelEntry
from dilocod.wire.messages import Join, Plan

DEADLINE_S = 180.0
SYNCER_ARGS = ("--fragments", "3", "--sync-every", "6", "--quorum", "1")


@pytest.fixture
def entry_dir(tmp_path: Path) -> Path:
    return write_learner_entry(tmp_path / "entry")


# About 35 s (it runs past the syncer's idle timeout): `make test-slow`.
@pytest.mark.slow
def test_a_second_learner_under_a_live_id_is_refused(tmp_path: Path, entry_dir: Path) -> None:
    syncer = start_syncer(tmp_path, entry_dir, tmp_path / "syncer", *SYNCER_ARGS, entry=LEARNER_ENTRY)
    first = start_learner(tmp_path, entry_dir, syncer.port, "twin", "--state-dir", str(tmp_path / "first"))
    learners = [first]
    try:
        first.wait_for("joined", lambda r: True, DEADLINE_S)
        second = start_learner(
            tmp_path, entry_dir, syncer.port, "twin", "--state-dir", str(tmp_path / "second")
        )
        learners.append(second)
        assert second.process.wait(timeout=DEADLINE_S) == 78, second.stderr()
        err = second.stderr()
        assert (
            f"another learner with id 'twin' is connected to the syncer at 127.0.0.1:{syncer.port}; "
            "give each learner its own --id" in err
        ), err
        assert "retry in" in err  # when a learner that is really gone stops holding the id
        (refused,) = syncer.log_events("learner id in use")
        assert refused["learner"] == "twin"
        # The first learner was never replaced: one session, and it goes on contributing.
        last = max((r["round"] for r in syncer.log_events("round merged")), default=-1)
        syncer.wait_for(
            "round merged", lambda r: r["round"] > last and "twin" in r["contributors"], DEADLINE_S
        )
        assert len(first.log_events("joined")) == 1 and first.alive()
        assert len(syncer.log_events("learner joined")) == 1

        # kill -9 and start again at once under the same id: the dead one's session does not
        # hold the id (its connections closed when its processes died).
        first.kill()
        again = start_learner(
            tmp_path, entry_dir, syncer.port, "twin", "--state-dir", str(tmp_path / "first")
        )
        learners.append(again)
        again.wait_for("joined", lambda r: True, DEADLINE_S)
        joins = itertools.count(1)
        syncer.wait_for("learner joined", lambda r: next(joins) == 2, DEADLINE_S)
        assert len(syncer.log_events("learner id in use")) == 1
        again.process.terminate()
        assert again.process.wait(timeout=DEADLINE_S) == 0, again.stderr()
    finally:
        for learner in learners:
            if learner.alive():
                learner.kill()
        assert syncer.stop() == 0, syncer.stderr()


async def _join(port: int, model: tuple, instance: str) -> tuple[Session, object]:
    session = await connect("127.0.0.1", port, peer_id="same", streams=0)
    await session.send(Join(model, "", instance))
    try:
        async with asyncio.timeout(DEADLINE_S):
            return session, await session.recv()
    except SessionClosed as exc:
        return session, exc


def test_the_same_learner_process_reconnecting_takes_its_place_back(tmp_path: Path) -> None:
    """Two JOINs under one id from different learner processes (instances): the second is refused
    while the first is heard from. The same instance again (a learner whose old connection the
    syncer still holds, say after a one-way network fault) replaces its old session at once."""
    entry_dir = write_entry(tmp_path / "entry")
    model, _ = entry_model(entry_dir)
    syncer = start_syncer(tmp_path, entry_dir, tmp_path / "syncer", "--fragments", "2")

    async def main() -> None:
        old, plan = await _join(syncer.port, model, "instance-a")
        assert isinstance(plan, Plan)
        other, refused = await _join(syncer.port, model, "instance-b")
        assert isinstance(refused, SessionClosed) and refused.code == ErrorCode.LEARNER_ID_IN_USE
        assert "'same'" in str(refused) and "retry in" in str(refused)
        assert old.is_open
        back, plan = await _join(syncer.port, model, "instance-a")
        assert isinstance(plan, Plan)
        async with asyncio.timeout(DEADLINE_S):
            await old.closed.wait()  # the syncer closed the session it replaced
        for session in (old, other, back):
            await session.close("done")

    try:
        run(main())
        syncer.wait_for("learner session replaced", lambda r: r["learner"] == "same", DEADLINE_S)
    finally:
        assert syncer.stop() == 0, syncer.stderr()


def _learner_model(entry_dir: Path) -> tuple[ModelEntry, ...]:
    """The model of the learner entry (LEARNER_ENTRY) as JOIN lists it."""
    sys.path.insert(0, str(entry_dir))
    try:
        import learner_test_entry

        from dilocod import LearnerContext

        ctx = LearnerContext("t", "syncer", "cpu", 0, 1, None, 0)
        return tuple(model_entries(learner_test_entry.make_trainer(ctx).model))
    finally:
        sys.path.remove(str(entry_dir))


def test_a_learner_restarted_on_its_state_dir_takes_its_old_sessions_place(
    tmp_path: Path, entry_dir: Path
) -> None:
    """A learner's host crashed and came back before the syncer noticed: its old session still
    looks alive (here a session kept open and just heard from, as a half-open connection on a WAN
    looks). Started again on its state directory, the learner carries the instance kept there and
    takes that session's place at once: it is not refused as another learner under its id (which
    would exit 78, and systemd would not restart it)."""
    syncer = start_syncer(tmp_path, entry_dir, tmp_path / "syncer", *SYNCER_ARGS, entry=LEARNER_ENTRY)
    state = tmp_path / "state"
    instance = learner_instance(state)  # made by the learner's first start, before the crash

    async def old_session() -> Session:
        session = await connect("127.0.0.1", syncer.port, peer_id="phoenix", streams=0)
        await session.send(Join(_learner_model(entry_dir), "", instance))
        async with asyncio.timeout(DEADLINE_S):
            assert isinstance(await session.recv(), Plan)
        return session

    async def main() -> None:
        old = await old_session()
        restarted = start_learner(
            tmp_path, entry_dir, syncer.port, "phoenix", "--state-dir", str(state), "--steps", "30"
        )
        try:
            assert await asyncio.to_thread(restarted.process.wait, DEADLINE_S) == 0, restarted.stderr()
        finally:
            if restarted.alive():
                restarted.kill()
        async with asyncio.timeout(DEADLINE_S):
            await old.closed.wait()  # replaced
        await old.close("done")

    try:
        run(main())
        syncer.wait_for("learner session replaced", lambda r: r["learner"] == "phoenix", DEADLINE_S)
        assert syncer.log_events("learner id in use") == []
    finally:
        assert syncer.stop() == 0, syncer.stderr()


def test_two_learners_on_one_state_dir_are_refused(tmp_path: Path, entry_dir: Path) -> None:
    """The state directory is one learner's: a second process started on it exits 78 naming the
    directory and the pid that holds it, and touches nothing there."""
    syncer = start_syncer(tmp_path, entry_dir, tmp_path / "syncer", *SYNCER_ARGS, entry=LEARNER_ENTRY)
    state = tmp_path / "state"
    first = start_learner(tmp_path, entry_dir, syncer.port, "one", "--state-dir", str(state))
    try:
        first.wait_for("joined", lambda r: True, DEADLINE_S)
        second = start_learner(tmp_path, entry_dir, syncer.port, "two", "--state-dir", str(state))
        assert second.process.wait(timeout=DEADLINE_S) == 78, second.stderr()
        assert f"--state-dir {state} is in use by another learner (pid {first.pid})" in second.stderr()
        assert first.alive()
    finally:
        if first.alive():
            first.kill()
        assert syncer.stop() == 0, syncer.stderr()
