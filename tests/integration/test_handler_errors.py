"""What a transport Server makes of the way each session's handler ends: a peer that leaves (even
when the handler's task group wraps the SessionClosed in an ExceptionGroup) is the normal end of a
session, neither kept nor logged; a handler's own bug is logged once, with its traceback, and
counted. Real sockets on loopback, both loop kinds; every wait is on a counter, with a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from structlog.testing import capture_logs

from devkit.transfers import REPLY_TIMEOUT_S, in_process_server, wait_until
from dilocod.transport.endpoints import connect
from dilocod.transport.session import Session
from dilocod.wire.messages import Ping, StatusRequest

Arun = Callable[..., object]
#: Far more departures than a leak could hide in; each costs one loopback session.
DEPARTURES = 40


@dataclass
class GroupHandler:
    """Like the syncer's: a task group (a sender and the receive loop) per session, so a peer's
    departure ends the handler with an ExceptionGroup holding SessionClosed. `bug_on` names the
    peer whose handler fails with a bug of its own instead."""

    bug_on: str = ""
    ended: int = 0

    async def __call__(self, session: Session) -> None:
        try:
            if session.peer.peer_id == self.bug_on:
                await session.recv()
                raise KeyError("a handler's own bug")
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._ping(session))
                while True:
                    await session.recv()
        finally:
            self.ended += 1

    async def _ping(self, session: Session) -> None:
        await session.send(Ping(1))
        await session.closed.wait()
        await session.send(Ping(2))  # SessionClosed: the session is gone


def _errors(logs: list[dict[str, object]]) -> list[dict[str, object]]:
    return [record for record in logs if record.get("log_level") in ("error", "critical", "exception")]


def test_departures_are_not_errors(arun: Arun) -> None:
    handler = GroupHandler()

    async def main() -> None:
        async with in_process_server(handler) as (server, port):
            for i in range(DEPARTURES):
                session = await connect("127.0.0.1", port, peer_id=f"leaving-{i}", streams=1)
                if i % 2:
                    await session.close("done")  # an orderly goodbye
                else:
                    session.control.transport.abort()  # a peer that vanishes
                    await session.close("aborted")
            await wait_until(lambda: handler.ended == DEPARTURES, REPLY_TIMEOUT_S)
            assert server.handler_errors == 0
            assert not server.sessions

    with capture_logs() as logs:
        arun(main())
    assert _errors(logs) == []


def test_a_handler_bug_is_logged_once_and_counted(arun: Arun) -> None:
    handler = GroupHandler(bug_on="buggy")

    async def main() -> None:
        async with in_process_server(handler) as (server, port):
            buggy = await connect("127.0.0.1", port, peer_id="buggy", streams=0)
            try:
                await buggy.send(StatusRequest())
                await wait_until(lambda: handler.ended == 1, REPLY_TIMEOUT_S)
                # The bug closed its own session (and only that one).
                async with asyncio.timeout(REPLY_TIMEOUT_S):
                    await buggy.closed.wait()
            finally:
                await buggy.close("done")
            assert server.handler_errors == 1
            leaving = await connect("127.0.0.1", port, peer_id="leaving", streams=0)
            await leaving.close("done")
            await wait_until(lambda: handler.ended == 2, REPLY_TIMEOUT_S)
            assert server.handler_errors == 1

    with capture_logs() as logs:
        arun(main())
    (record,) = _errors(logs)
    assert record["peer"] == "buggy"
    exc_info = record["exc_info"]
    assert isinstance(exc_info, KeyError) or "KeyError" in repr(exc_info)
