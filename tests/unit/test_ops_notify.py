"""systemd notify and watchdog: exact datagrams on real sockets, and pings that follow the event loop.

A test plays the service manager with a datagram socket bound in tmp_path or in the abstract
namespace. Watchdog timing is measured from the datagrams themselves, received with deadlines; the
only sleep is the deliberate time.sleep that blocks the event loop, which is the fault under test.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from dilocod.ops.notify import Notifier, parse_notify_address, watchdog_loop
from dilocod.transport.loop import run

#: Deadline for a datagram that is due; far above the intervals used here.
RECV_DEADLINE_S = 5.0
#: Deadline for a whole test coroutine.
TEST_DEADLINE_S = 60.0

Manager = tuple[socket.socket, str]


@pytest.fixture(params=["path", "abstract"])
def manager(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Manager]:
    """A bound datagram socket and the NOTIFY_SOCKET value that reaches it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        path = tmp_path / "notify.sock"
        sock.bind(str(path))
        value = str(path)
    else:
        name = f"dilocod-test-{secrets.token_hex(8)}"
        sock.bind(f"\0{name}")
        value = f"@{name}"
    try:
        yield sock, value
    finally:
        sock.close()


@pytest.fixture(params=["asyncio", "uvloop"])
def arun(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, None]], None]:
    if request.param == "uvloop":
        pytest.importorskip("uvloop")

    def _run(main: Coroutine[Any, Any, None]) -> None:
        async def bounded() -> None:
            async with asyncio.timeout(TEST_DEADLINE_S):
                await main

        run(bounded(), use_uvloop=request.param == "uvloop")

    return _run


def _recv(sock: socket.socket, timeout_s: float = RECV_DEADLINE_S) -> str:
    sock.settimeout(timeout_s)
    return sock.recv(4096).decode()


def _queued(sock: socket.socket) -> list[str]:
    """Every datagram already waiting, without waiting for more."""
    sock.setblocking(False)
    messages = []
    try:
        while True:
            messages.append(sock.recv(4096).decode())
    except BlockingIOError:
        return messages


async def _arecv(sock: socket.socket) -> str:
    sock.setblocking(False)
    async with asyncio.timeout(RECV_DEADLINE_S):
        return (await asyncio.get_running_loop().sock_recv(sock, 4096)).decode()


def test_state_messages_arrive_exactly(manager: Manager) -> None:
    sock, value = manager
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": value})
    try:
        assert notifier.enabled
        assert notifier.ready()
        assert _recv(sock) == "READY=1"
        assert notifier.status("merging round 3")
        assert _recv(sock) == "STATUS=merging round 3"
        assert notifier.ready(status="listening on 127.0.0.1:7000")
        assert _recv(sock) == "READY=1\nSTATUS=listening on 127.0.0.1:7000"
        assert notifier.watchdog()
        assert _recv(sock) == "WATCHDOG=1"
        assert notifier.stopping()
        assert _recv(sock) == "STOPPING=1"
        assert notifier.stopping(status="checkpointing")
        assert _recv(sock) == "STOPPING=1\nSTATUS=checkpointing"

        before_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        assert notifier.reloading()
        after_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        first, second = _recv(sock).split("\n")
        assert first == "RELOADING=1"
        key, _, usec = second.partition("=")
        assert key == "MONOTONIC_USEC"
        assert before_usec <= int(usec) <= after_usec
        assert notifier.last_error is None
    finally:
        notifier.close()


def test_without_a_mapping_the_process_environment_is_read(
    manager: Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, value = manager
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    notifier = Notifier.from_environment()
    try:
        assert notifier.watchdog_interval_s == 1.0
        assert notifier.ready()
        assert _recv(sock) == "READY=1"
    finally:
        notifier.close()


def test_status_text_cannot_smuggle_assignments(manager: Manager) -> None:
    sock, value = manager
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": value})
    try:
        notifier.status("bad input\nREADY=1")
        assert _recv(sock) == "STATUS=bad input READY=1"
    finally:
        notifier.close()


def test_no_notify_socket_is_a_silent_no_op(arun: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    notifier = Notifier.from_environment({"WATCHDOG_USEC": "1000000"})
    assert not notifier.enabled
    # Pings with nowhere to go are pointless, so the watchdog is off too.
    assert notifier.watchdog_interval_s is None
    assert [notifier.ready(), notifier.status("x"), notifier.watchdog(), notifier.reloading()] == [False] * 4
    assert not notifier.stopping()
    assert notifier.last_error is None

    async def main() -> None:
        await watchdog_loop(notifier, lambda: True)  # returns at once; the deadline would say otherwise

    arun(main())


@pytest.mark.parametrize("value", ["", "relative/notify", "@", "vsock:2:1234"])
def test_unusable_addresses_disable_notification(value: str) -> None:
    assert parse_notify_address(value) is None
    assert not Notifier.from_environment({"NOTIFY_SOCKET": value}).enabled


def test_abstract_address_gets_a_leading_nul() -> None:
    assert parse_notify_address("@/org/freedesktop/systemd1/notify") == b"\0/org/freedesktop/systemd1/notify"
    assert parse_notify_address("/run/systemd/notify") == "/run/systemd/notify"


def test_vanished_socket_does_not_raise(tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": str(path)})
    try:
        assert notifier.ready()
        assert _recv(sock) == "READY=1"
        sock.close()
        assert not notifier.watchdog()  # closed but still on disk: ECONNREFUSED
        assert isinstance(notifier.last_error, ConnectionRefusedError)
        path.unlink()
        assert not notifier.stopping()  # gone from disk: ENOENT
        assert isinstance(notifier.last_error, FileNotFoundError)
    finally:
        sock.close()
        notifier.close()


def test_vanished_abstract_socket_does_not_stop_the_watchdog(
    arun: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    notifier = Notifier.from_environment(
        {"NOTIFY_SOCKET": f"@dilocod-test-{secrets.token_hex(8)}", "WATCHDOG_USEC": "20000"}
    )

    async def main() -> None:
        checked = asyncio.Event()
        calls = 0

        def healthy() -> bool:
            nonlocal calls
            calls += 1
            if calls == 5:
                checked.set()
            return True

        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(watchdog_loop(notifier, healthy))
            await checked.wait()  # five ticks, each trying to ping nobody, and still running
            assert not task.done()
            task.cancel()

    try:
        arun(main())
        assert isinstance(notifier.last_error, ConnectionRefusedError)
    finally:
        notifier.close()


@pytest.mark.parametrize(
    ("environ", "interval_s"),
    [
        ({"WATCHDOG_USEC": "3000000"}, 1.5),
        ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}, 1.5),
        ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getppid())}, None),
        ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "not-a-pid"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval_follows_sd_watchdog_enabled(
    environ: dict[str, str], interval_s: float | None
) -> None:
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": "/run/systemd/notify", **environ})
    assert notifier.watchdog_interval_s == interval_s


def test_watchdog_pid_of_another_process_sends_no_pings(
    manager: Manager, arun: Callable[[Coroutine[Any, Any, None]], None]
) -> None:
    sock, value = manager
    notifier = Notifier.from_environment(
        {"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "20000", "WATCHDOG_PID": str(os.getpid() + 1)}
    )

    async def main() -> None:
        await watchdog_loop(notifier, lambda: True)  # nothing to do for us: returns at once

    try:
        arun(main())
        assert _queued(sock) == []
    finally:
        notifier.close()


def test_watchdog_pings_at_half_the_timeout(
    manager: Manager, arun: Callable[[Coroutine[Any, Any, None]], None]
) -> None:
    sock, value = manager
    # 0.6 s timeout: pings every 0.3 s. Pinging at the full timeout or at a quarter of it would put
    # four gaps at 2.4 s or 0.6 s, outside the bounds below with room for a busy machine.
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "600000"})
    assert notifier.watchdog_interval_s == pytest.approx(0.3)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stamps = []
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(watchdog_loop(notifier, lambda: True))
            for _ in range(5):
                assert await _arecv(sock) == "WATCHDOG=1"
                stamps.append(loop.time())
            task.cancel()
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        assert 1.05 <= stamps[-1] - stamps[0] <= 2.0, gaps
        assert min(gaps) >= 0.2, gaps

    try:
        arun(main())
    finally:
        notifier.close()


def test_blocked_event_loop_stops_the_pings(
    manager: Manager, arun: Callable[[Coroutine[Any, Any, None]], None]
) -> None:
    sock, value = manager
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "100000"})
    block_s = 0.5  # ten intervals of 50 ms: a pinger that does not need the loop would send ~10

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(watchdog_loop(notifier, lambda: True))
            for _ in range(2):
                assert await _arecv(sock) == "WATCHDOG=1"
            # From here to the count there is no await, so the watchdog task cannot run except by
            # some other thread; whatever is queued after the block was sent during it.
            _queued(sock)
            time.sleep(block_s)  # noqa: ASYNC251 - blocking the loop is the fault under test
            assert _queued(sock) == []
            for _ in range(2):  # the loop is back: so are the pings
                assert await _arecv(sock) == "WATCHDOG=1"
            task.cancel()

    try:
        arun(main())
    finally:
        notifier.close()


def test_unhealthy_ticks_send_no_pings_and_health_resumes_them(
    manager: Manager, arun: Callable[[Coroutine[Any, Any, None]], None]
) -> None:
    sock, value = manager
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "40000"})

    async def main() -> None:
        state = {"healthy": False, "calls": 0}
        three_sick_ticks = asyncio.Event()

        def healthy() -> bool:
            state["calls"] += 1
            if state["calls"] == 3:
                three_sick_ticks.set()
            return bool(state["healthy"])

        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(watchdog_loop(notifier, healthy))
            async with asyncio.timeout(RECV_DEADLINE_S):
                await three_sick_ticks.wait()
            assert _queued(sock) == []
            state["healthy"] = True
            assert await _arecv(sock) == "WATCHDOG=1"
            task.cancel()

    try:
        arun(main())
    finally:
        notifier.close()
