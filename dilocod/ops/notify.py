"""The systemd notify protocol (sd_notify(3)) and watchdog (sd_watchdog_enabled(3)), without libsystemd.

Owns: reading NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID out of an environment mapping (os.environ
only when cli.py asks for it), sending state datagrams, and `watchdog_loop`, which pings from the
event loop itself so that a blocked loop stops the pings and systemd restarts the daemon.

Notification is best effort: a manager that went away, a full socket queue or an address we cannot
use never raises into a daemon; `send` returns False and remembers the error in `last_error`.
Must not import torch, dilocod.transport or dilocod.wire.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

USEC_PER_S = 1_000_000


def parse_notify_address(value: str | None) -> str | bytes | None:
    """NOTIFY_SOCKET as a sendto address: a path, or bytes with a leading NUL for an abstract socket.

    Like sd_notify, only absolute paths and '@' abstract names are accepted; anything else (unset,
    empty, relative, vsock: which Python's AF_UNIX socket cannot reach) yields None.
    """
    if not value:
        return None
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


def watchdog_usec(environ: Mapping[str, str], *, pid: int) -> int | None:
    """WATCHDOG_USEC when the manager expects pings from `pid`, else None (sd_watchdog_enabled).

    WATCHDOG_PID unset means "the main process", which is whoever reads it; set to another pid, the
    pings are expected from that process (we are its child or it handed the job over), not from us.
    Values that do not parse, and zero, count as "no watchdog", as in sd_watchdog_enabled's error.
    """
    raw_usec = environ.get("WATCHDOG_USEC")
    if raw_usec is None:
        return None
    try:
        usec = int(raw_usec)
    except ValueError:
        return None
    if usec <= 0:
        return None
    raw_pid = environ.get("WATCHDOG_PID")
    if raw_pid is not None:
        try:
            watched = int(raw_pid)
        except ValueError:
            return None
        if watched != pid:
            return None
    return usec


def _status_line(text: str) -> str:
    # One STATUS assignment per datagram: a newline in the text would start a new assignment
    # (a status reading "x\nREADY=1" must not declare readiness).
    return " ".join(text.splitlines())


@dataclass(slots=True, eq=False)
class Notifier:
    """Sends notify datagrams to `address`; with no address every method is a silent no-op.

    Safe to call from the event loop and the training thread alike: the socket is non-blocking (a
    stalled manager drops a message rather than stalls the loop) and sendto on a datagram socket is
    atomic per message.
    """

    address: str | bytes | None = None
    watchdog_usec: int | None = None
    last_error: OSError | None = field(default=None, init=False)
    _sock: socket.socket | None = field(default=None, init=False, repr=False)
    _sock_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] | None = None, *, pid: int | None = None
    ) -> Notifier:
        """Build from the service environment, os.environ unless given; `pid` defaults to our own.

        Only cli.py should call this without `environ` (it is the one place that reads the process
        environment); everything else, tests included, passes a mapping.
        """
        if environ is None:
            environ = os.environ
        address = parse_notify_address(environ.get("NOTIFY_SOCKET"))
        usec = watchdog_usec(environ, pid=os.getpid() if pid is None else pid)
        return cls(address=address, watchdog_usec=usec if address is not None else None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """Half of WATCHDOG_USEC, the ping interval sd_watchdog_enabled(3) recommends; None if off."""
        if self.watchdog_usec is None:
            return None
        return self.watchdog_usec / USEC_PER_S / 2

    def send(self, message: str) -> bool:
        """Send one datagram of newline-separated assignments; True if the manager's socket took it."""
        if self.address is None:
            return False
        try:
            with self._sock_lock:  # the first sends may race between the loop and training threads
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sock.setblocking(False)
                sock = self._sock
            sock.sendto(message.encode(), self.address)
        except OSError as exc:  # ENOENT, ECONNREFUSED, EAGAIN, EPERM...: never the daemon's end
            self.last_error = exc
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1" if status is None else f"READY=1\nSTATUS={_status_line(status)}")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={_status_line(text)}")

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1" if status is None else f"STOPPING=1\nSTATUS={_status_line(status)}")

    def reloading(self) -> bool:
        # Type=notify-reload (systemd >= 253) pairs RELOADING=1 with the CLOCK_MONOTONIC time, so the
        # manager can tell this reload from an earlier one; older managers ignore the extra field.
        now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send(f"RELOADING=1\nMONOTONIC_USEC={now_usec}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        with self._sock_lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


async def watchdog_loop(notifier: Notifier, healthy: Callable[[], bool]) -> None:
    """Ping WATCHDOG=1 every `watchdog_interval_s` while `healthy()` holds; return at once if off.

    The pings are sent by this coroutine on the event loop, never by a thread: if the loop is blocked
    (a synchronous call that hangs, CPU-bound work on the loop thread) no ping goes out and systemd's
    WatchdogSec fires, which is the point. `healthy` runs on the loop before each ping and must be
    cheap; the learner passes "the training loop made a step recently". An unhealthy tick skips its
    ping but the loop goes on, so pings resume as soon as health returns; if it stays away for the
    whole WATCHDOG_USEC, systemd acts.

    Ticks follow a fixed schedule from the loop's clock, so late wake-ups do not accumulate drift; a
    tick that wakes after a stall pings once and reschedules from now rather than bursting to catch up.
    """
    interval_s = notifier.watchdog_interval_s
    if interval_s is None:
        return
    loop = asyncio.get_running_loop()
    next_tick = loop.time()
    while True:
        if healthy():
            notifier.watchdog()
        next_tick += interval_s
        now = loop.time()
        if next_tick <= now:
            next_tick = now + interval_s
        await asyncio.sleep(next_tick - now)
