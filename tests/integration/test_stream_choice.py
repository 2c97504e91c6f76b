"""The seam `--streams auto` uses: connect() asks a callback how many data connections to open once
the control connection is authenticated, and the session reports the kernel's round-trip time,
from which the learner picks the count (tuning.choose_streams). Real sockets on loopback, both
loop kinds."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from devkit.transfers import in_process_server
from dilocod.transport.endpoints import connect
from dilocod.transport.session import Session
from dilocod.tuning.streams import choose_streams

Arun = Callable[..., object]


async def _idle(session: Session) -> None:
    await session.closed.wait()


def test_the_data_connections_follow_the_measured_rtt(arun: Arun) -> None:
    seen: list[tuple[int, float | None]] = []

    def data_streams(session: Session) -> int:
        rtt_s = session.round_trip_s()
        seen.append((len(session.data), rtt_s))
        assert rtt_s is not None
        # Loopback: 5 Gbit/s x a few microseconds fits one window; the learner asks for two at least.
        return choose_streams(5.0, rtt_s, 4 << 20, min_streams=3).streams

    async def main() -> None:
        async with in_process_server(_idle) as (server, port):
            session = await connect("127.0.0.1", port, peer_id="rtt", streams=9, data_streams=data_streams)
            try:
                assert len(session.data) == 3
                rtt_s = session.round_trip_s()
                assert rtt_s is not None and 0 < rtt_s < 0.05
            finally:
                await session.close("done")
            assert not server.handler_errors

    arun(main())
    [(data_before, rtt_s)] = seen
    assert data_before == 0  # asked before any data connection was opened
    assert rtt_s is not None and 0 < rtt_s < 0.05  # loopback: microseconds, well under 50 ms


def test_a_callback_out_of_range_is_refused(arun: Arun) -> None:
    async def main() -> None:
        async with in_process_server(_idle) as (_, port):
            with pytest.raises(ValueError, match="data_streams chose 1000"):
                await connect("127.0.0.1", port, peer_id="bad", data_streams=lambda session: 1000)

    arun(main())
