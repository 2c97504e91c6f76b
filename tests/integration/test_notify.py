"""`dilocod syncer` and `dilocod learner` as real processes under a stand-in for systemd's notify
socket: READY=1 with a STATUS=, STATUS= updates, WATCHDOG=1 pings at half of WATCHDOG_USEC,
STOPPING=1 on SIGTERM, their state on disk and exit 0; and the pings stop while the syncer's event
loop is blocked or a learner's training step hangs, and come back when released.

The test binds the datagram socket (abstract namespace) and reads it with deadlines. The faults
come from the daemons' own entry modules, written here: on SIGUSR1 the syncer's entry blocks the
main thread (the syncer's event loop) inside the signal handler, and the learner's entry makes its
next training step hang. Both tell the test socket when they block and when they are released, so
the messages before and after are ordered in one queue, and both wait on a FIFO the test writes to.
dilocod itself has no test hook for this. Nothing sleeps: a quiet spell is a receive that times out.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from devkit.daemons import (
    LEARNER_ENTRY,
    DaemonProcess,
    start_learner,
    start_syncer,
    write_learner_entry,
)
from dilocod.learner.state import STATE_FILE, load_local_state
from dilocod.syncer.checkpoint import load_latest_checkpoint

#: The watchdog timeout handed to the daemons: pings every 0.5 s.
WATCHDOG_USEC = 1_000_000
PING_INTERVAL_S = WATCHDOG_USEC / 1e6 / 2
#: No ping for this long (five intervals) counts as "the pings stopped".
QUIET_S = 5 * PING_INTERVAL_S
#: The pings must have stopped by then (they stop about 1 s after a step hangs).
QUIET_DEADLINE_S = 30.0
#: Deadline for any message that is due; far above the intervals, for a busy 2-core machine.
DEADLINE_S = 120.0
SYNCER_ARGS = ("--fragments", "3", "--sync-every", "6", "--quorum", "1", "--outer-momentum", "0.5")
#: A learner step takes this long (the entry sleeps), so the learners do not spin on the two cores.
STEP_S = "0.02"

ENTRY_SOURCE = '''
"""The test model of learner_test_entry, with faults a test triggers with SIGUSR1."""
import dataclasses
import os
import signal
import socket

import learner_test_entry

_pending = {"block_next_step": False}


def _tell_test(message):
    # Sent to the test's notify socket, so it is queued in order with the daemon's own messages.
    address = os.environ["NOTIFY_SOCKET"]
    target = b"\\0" + address[1:].encode() if address.startswith("@") else address
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(message.encode(), target)


def _block(what):
    _tell_test(f"X_TEST_BLOCKED={what}")
    fd = os.open(os.environ["DILOCOD_TEST_RELEASE_FIFO"], os.O_RDONLY)
    try:
        os.read(fd, 1)
    finally:
        os.close(fd)
    _tell_test(f"X_TEST_RELEASED={what}")


def make_syncer(ctx):
    # The syncer's event loop runs on the main thread, where Python runs signal handlers: this one
    # keeps the loop from running until the test writes to the FIFO.
    signal.signal(signal.SIGUSR1, lambda signum, frame: _block("event loop"))
    return learner_test_entry.make_trainer(ctx)


def make_learner(ctx):
    trainer = learner_test_entry.make_trainer(ctx)
    step = trainer.step

    def step_that_may_hang(index):
        if _pending["block_next_step"]:
            _pending["block_next_step"] = False
            _block("training step")
        return step(index)

    signal.signal(signal.SIGUSR1, lambda signum, frame: _pending.update(block_next_step=True))
    return dataclasses.replace(trainer, step=step_that_may_hang)
'''
SYNCER_ENTRY = "notify_test_entry:make_syncer"
LEARNER_FAULT_ENTRY = "notify_test_entry:make_learner"


@dataclass
class Manager:
    """systemd's side of sd_notify(3): a bound datagram socket and every message it received."""

    sock: socket.socket
    address: str
    #: Every message's assignments, in arrival order.
    received: list[dict[str, str]] = field(default_factory=list)

    def environ(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.address, "WATCHDOG_USEC": str(WATCHDOG_USEC)}

    def receive(self, timeout_s: float) -> dict[str, str] | None:
        """The next message, or None when none came within timeout_s."""
        self.sock.settimeout(max(timeout_s, 1e-3))
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        message = dict(line.partition("=")[::2] for line in data.decode().splitlines())
        self.received.append(message)
        return message

    def wait_for(
        self, accept: Callable[[dict[str, str]], bool], timeout_s: float = DEADLINE_S
    ) -> dict[str, str]:
        """Receive until a message accept() takes; fail at the deadline."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            message = self.receive(remaining)
            if message is not None and accept(message):
                return message
        raise AssertionError(f"no such message within {timeout_s} s; received {self.received}")

    def wait_for_quiet_pings(self, timeout_s: float = DEADLINE_S) -> list[dict[str, str]]:
        """Receive until no WATCHDOG=1 has come for QUIET_S; return what came meanwhile. Fails if the
        pings go on until the deadline."""
        deadline = time.monotonic() + timeout_s
        last_ping = time.monotonic()
        meanwhile: list[dict[str, str]] = []
        while time.monotonic() < deadline:
            quiet_until = last_ping + QUIET_S
            message = self.receive(quiet_until - time.monotonic())
            if message is None:
                if time.monotonic() >= quiet_until:
                    return meanwhile
                continue
            meanwhile.append(message)
            if message.get("WATCHDOG") == "1":
                last_ping = time.monotonic()
        raise AssertionError(f"the pings never stopped for {QUIET_S} s: {meanwhile}")


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[Manager]:
    # Whatever runs this suite (systemd itself in CI) must not reach the daemons started here.
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)
    name = f"dilocod-test-{secrets.token_hex(8)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(f"\0{name}")
    try:
        yield Manager(sock, f"@{name}")
    finally:
        sock.close()


@pytest.fixture
def entry_dir(tmp_path: Path) -> Path:
    directory = write_learner_entry(tmp_path / "entry")
    (directory / "notify_test_entry.py").write_text(ENTRY_SOURCE)
    return directory


@pytest.fixture
def release_fifo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """A FIFO the entries' faults wait on; calling the fixture's value releases one of them."""
    path = tmp_path / "release.fifo"
    os.mkfifo(path)
    monkeypatch.setenv("DILOCOD_TEST_RELEASE_FIFO", str(path))
    # Read-write, so this open never waits for a reader, and the fault's read-only open never waits
    # for a writer; the byte written goes to the fault, the only one that reads.
    fd = os.open(path, os.O_RDWR)

    def release() -> None:
        os.write(fd, b"x")

    try:
        yield release
    finally:
        os.close(fd)


def _notified(
    monkeypatch: pytest.MonkeyPatch, manager: Manager, start: Callable[[], DaemonProcess]
) -> DaemonProcess:
    """Start a daemon whose environment reaches the manager (only this one)."""
    with monkeypatch.context() as patch:
        for key, value in manager.environ().items():
            patch.setenv(key, value)
        patch.setenv("LEARNER_TEST_STEP_S", STEP_S)
        return start()


def _stop(daemon: DaemonProcess) -> None:
    """SIGTERM, and the exit status systemd would see: 0."""
    code = daemon.stop()
    assert code == 0, f"exit {code}:\n{daemon.stderr()}"


def _syncer_for_learners(tmp_path: Path, entry_dir: Path, monkeypatch: pytest.MonkeyPatch) -> DaemonProcess:
    with monkeypatch.context() as patch:
        patch.setenv("LEARNER_TEST_STEP_S", STEP_S)
        return start_syncer(tmp_path, entry_dir, tmp_path / "syncer", *SYNCER_ARGS, entry=LEARNER_ENTRY)


def test_the_syncer_tells_systemd_ready_status_watchdog_and_stopping(
    tmp_path: Path, entry_dir: Path, manager: Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_dir = tmp_path / "syncer"
    syncer = _notified(
        monkeypatch,
        manager,
        lambda: start_syncer(tmp_path, entry_dir, state_dir, *SYNCER_ARGS, entry=LEARNER_ENTRY),
    )
    try:
        ready = manager.wait_for(lambda m: "READY" in m)
        assert ready["READY"] == "1"
        assert ready["STATUS"].startswith(f"listening on 127.0.0.1:{syncer.port}, 3 fragments")
        for _ in range(3):
            manager.wait_for(lambda m: m.get("WATCHDOG") == "1")
        assert not syncer.log_events("checkpoint")
        _stop(syncer)
    finally:
        if syncer.alive():
            syncer.kill()
    stopping = manager.wait_for(lambda m: "STOPPING" in m)
    assert stopping == {"STOPPING": "1", "STATUS": "stopping: finishing merges, writing a checkpoint"}
    assert manager.received.index(ready) < manager.received.index(stopping)
    # The checkpoint written on the way out, loadable as a restart would load it.
    assert syncer.log_events("checkpoint")
    loaded = load_latest_checkpoint(state_dir)
    assert loaded is not None and len(loaded.state.versions) == 3


def test_the_learner_tells_systemd_ready_status_watchdog_and_stopping(
    tmp_path: Path, entry_dir: Path, manager: Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncer = _syncer_for_learners(tmp_path, entry_dir, monkeypatch)
    state_dir = tmp_path / "learner"
    learner = None
    try:
        learner = _notified(
            monkeypatch,
            manager,
            lambda: start_learner(
                tmp_path,
                entry_dir,
                syncer.port,
                "notified",
                "--state-dir",
                str(state_dir),
                "--progress-every-s",
                "0.5",
            ),
        )
        ready = manager.wait_for(lambda m: "READY" in m)
        assert ready == {"READY": "1", "STATUS": f"training from step 0, syncer 127.0.0.1:{syncer.port}"}
        # The periodic line once the learner has healed and trains with the syncer.
        status = manager.wait_for(lambda m: "syncer connected" in m.get("STATUS", ""))
        assert status["STATUS"].startswith("step ") and "steps/s" in status["STATUS"]
        for _ in range(3):
            manager.wait_for(lambda m: m.get("WATCHDOG") == "1")
        syncer.wait_for("round merged", lambda r: r["contributors"] == ["notified"], DEADLINE_S)
        _stop(learner)
        stopping = manager.wait_for(lambda m: "STOPPING" in m)
        assert stopping["STATUS"] == "stopping: finishing the step, saving the local state"
        saved = load_local_state(state_dir)
        assert saved is not None and saved["step"] > 0 and saved["learner_id"] == "notified"
        assert (state_dir / STATE_FILE).is_file()
        _stop(syncer)
    finally:
        for daemon in (learner, syncer):
            if daemon is not None and daemon.alive():
                daemon.kill()


def test_a_blocked_syncer_event_loop_stops_the_watchdog_pings(
    tmp_path: Path,
    entry_dir: Path,
    manager: Manager,
    monkeypatch: pytest.MonkeyPatch,
    release_fifo: Callable[[], None],
) -> None:
    syncer = _notified(
        monkeypatch,
        manager,
        lambda: start_syncer(tmp_path, entry_dir, tmp_path / "syncer", *SYNCER_ARGS, entry=SYNCER_ENTRY),
    )
    try:
        manager.wait_for(lambda m: "READY" in m)
        manager.wait_for(lambda m: m.get("WATCHDOG") == "1")
        syncer.process.send_signal(signal.SIGUSR1)
        manager.wait_for(lambda m: m.get("X_TEST_BLOCKED") == "event loop")
        # Everything queued before the marker was sent before the block; from here on, no ping.
        assert manager.wait_for_quiet_pings(timeout_s=QUIET_S + 1.0) == []
        release_fifo()
        manager.wait_for(lambda m: m.get("X_TEST_RELEASED") == "event loop")
        manager.wait_for(lambda m: m.get("WATCHDOG") == "1")
        _stop(syncer)
    finally:
        if syncer.alive():
            syncer.kill()
    manager.wait_for(lambda m: "STOPPING" in m)


def test_a_hung_training_step_stops_the_learner_watchdog_pings(
    tmp_path: Path,
    entry_dir: Path,
    manager: Manager,
    monkeypatch: pytest.MonkeyPatch,
    release_fifo: Callable[[], None],
) -> None:
    syncer = _syncer_for_learners(tmp_path, entry_dir, monkeypatch)
    learner = None
    try:
        learner = _notified(
            monkeypatch,
            manager,
            lambda: start_learner(
                tmp_path,
                entry_dir,
                syncer.port,
                "hangs",
                "--entry",
                LEARNER_FAULT_ENTRY,
                "--progress-every-s",
                "0.5",
            ),
        )
        manager.wait_for(lambda m: "READY" in m)
        manager.wait_for(lambda m: m.get("WATCHDOG") == "1")
        learner.process.send_signal(signal.SIGUSR1)
        manager.wait_for(lambda m: m.get("X_TEST_BLOCKED") == "training step")
        # A step running for the whole watchdog timeout is a hang: the pings stop after at most
        # WATCHDOG_USEC / interval = 2 more (one more where a tick lands on the boundary)...
        meanwhile = manager.wait_for_quiet_pings(timeout_s=QUIET_DEADLINE_S)
        pings = [i for i, m in enumerate(meanwhile) if m.get("WATCHDOG") == "1"]
        assert len(pings) <= 3, meanwhile
        # ...while the event loop still runs: its STATUS lines go on during the quiet spell.
        after_last_ping = meanwhile[pings[-1] + 1 :] if pings else meanwhile
        assert any("STATUS" in m for m in after_last_ping), meanwhile
        release_fifo()
        manager.wait_for(lambda m: m.get("X_TEST_RELEASED") == "training step")
        manager.wait_for(lambda m: m.get("WATCHDOG") == "1")
        _stop(learner)
        manager.wait_for(lambda m: "STOPPING" in m)
        _stop(syncer)
    finally:
        for daemon in (learner, syncer):
            if daemon is not None and daemon.alive():
                daemon.kill()
