"""Prometheus metrics: the syncer's page read back by prometheus_client's parser; a real HTTP
client against the endpoint for status codes, and raw sockets for the clients that misbehave.

Blocking clients run in worker threads (asyncio.to_thread) so the server keeps its event loop;
every wait is a socket timeout or an asyncio deadline, never a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from devkit.syncer_status import status_of
from dilocod.ops.metrics import CONTENT_TYPE, MetricsServer
from dilocod.syncer.metrics import render_syncer_metrics
from dilocod.transport.loop import run

TEST_DEADLINE_S = 60.0
CLIENT_TIMEOUT_S = 10.0
#: The server's read deadline in these tests; clients wait CLIENT_TIMEOUT_S, far longer.
READ_TIMEOUT_S = 0.5

#: What the server serves in these tests: the syncer's page for a small status.
STATUS = status_of(
    fragments=[{"index": 0, "version": 3}, {"index": 1, "version": 2}],
    learners=[
        {
            "id": 'odd "name"\nwith\\slash',
            "connected": True,
            "contributions": 5,
            "weight_share": 1.0,
            "steps_per_s": 2.5,
            "goodput": 0.9,
        }
    ],
    rounds_skipped={"merges-behind": 1},
    quorum_sizes={"1": 3},
    grace_waited_s=0.25,
    bytes_in=1 << 20,
)
PAGE = render_syncer_metrics(STATUS)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A page's samples, read back by prometheus_client's own parser."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_syncers_page_reads_back_as_its_status() -> None:
    """Every family once, with its type; labels escaped (a learner id may hold quotes, a newline
    and a backslash) and read back as they were."""
    got = samples(PAGE)
    learner = (("learner", STATUS["learners"][0]["id"]),)
    assert got[("dilocod_rounds_merged_total", ())] == 3
    assert got[("dilocod_learner_contributions_total", learner)] == 5
    assert got[("dilocod_learner_connected", learner)] == 1
    assert got[("dilocod_fragment_version", (("fragment", "1"),))] == 2
    assert got[("dilocod_rounds_skipped_total", (("reason", "merges-behind"),))] == 1
    assert got[("dilocod_received_bytes_total", ())] == 1 << 20
    assert got[("dilocod_event_loop_lag_seconds", (("quantile", "0.99"),))] == 0.0005
    types = [line.split()[2:] for line in PAGE.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len({name for name, _ in types}) == 24
    assert ["dilocod_sent_bytes_total", "counter"] in types and [
        "dilocod_checkpoints_failed",
        "gauge",
    ] in types


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


def _request(port: int, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def _read_to_eof(sock: socket.socket) -> bytes:
    """What the server sends before it closes; a reset counts as a close."""
    sock.settimeout(CLIENT_TIMEOUT_S)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _stalled_client(port: int) -> socket.socket:
    """A client that starts a request and never finishes it."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S)
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
    return sock


def test_status_codes_from_a_real_client(arun: Callable[[Coroutine[Any, Any, None]], None]) -> None:

    async def main() -> None:
        async with MetricsServer("127.0.0.1", 0, lambda: PAGE) as server:
            assert server.port > 0
            status, headers, body = await asyncio.to_thread(_request, server.port, "GET", "/metrics")
            assert (status, headers["content-type"], body.decode()) == (200, CONTENT_TYPE, PAGE)
            assert int(headers["content-length"]) == len(body)

            status, _, body = await asyncio.to_thread(_request, server.port, "GET", "/metrics?debug=1")
            assert (status, body.decode()) == (200, PAGE)

            status, headers, body = await asyncio.to_thread(_request, server.port, "HEAD", "/metrics")
            assert (status, body) == (200, b"")
            assert int(headers["content-length"]) == len(PAGE.encode())

            for path in ("/", "/metrics/extra", "/favicon.ico"):
                status, _, _ = await asyncio.to_thread(_request, server.port, "GET", path)
                assert status == 404, path

            for method in ("POST", "PUT", "DELETE"):
                status, headers, _ = await asyncio.to_thread(_request, server.port, method, "/metrics")
                assert status == 405, method
                assert headers["allow"] == "GET, HEAD"

    arun(main())


def test_garbage_request_line_gets_400(arun: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    def garbage(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S) as sock:
            sock.sendall(b"\x16\x03\x01 hello there\r\n\r\n")
            return _read_to_eof(sock)

    async def main() -> None:
        async with MetricsServer("127.0.0.1", 0, lambda: "") as server:
            reply = await asyncio.to_thread(garbage, server.port)
            assert reply.startswith(b"HTTP/1.1 400 ")

    arun(main())


def test_render_failure_is_a_500_and_the_server_survives(
    arun: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    calls = 0

    def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("status not ready")
        return "up 1\n"

    async def main() -> None:
        async with MetricsServer("127.0.0.1", 0, flaky) as server:
            status, _, _ = await asyncio.to_thread(_request, server.port, "GET", "/metrics")
            assert status == 500
            status, _, body = await asyncio.to_thread(_request, server.port, "GET", "/metrics")
            assert (status, body) == (200, b"up 1\n")

    arun(main())


def test_oversized_request_is_cut_off(arun: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    def oversized(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S) as sock:
            # The server may close while we are still sending: that is the point.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * (1 << 20))
            return _read_to_eof(sock)

    async def main() -> None:
        async with MetricsServer(
            "127.0.0.1", 0, lambda: "", max_request_bytes=4096, read_timeout_s=CLIENT_TIMEOUT_S * 3
        ) as server:
            # The read deadline is far away, so only the size cap can end this before the client's
            # own timeout; the reply is the 431 unless a reset overtook it.
            reply = await asyncio.to_thread(oversized, server.port)
            assert reply == b"" or reply.startswith(b"HTTP/1.1 431 "), reply[:100]
            status, _, _ = await asyncio.to_thread(_request, server.port, "GET", "/metrics")
            assert status == 200

    arun(main())


def test_stalled_client_is_cut_off_while_others_are_served(
    arun: Callable[[Coroutine[Any, Any, None]], None],
) -> None:

    async def main() -> None:
        async with MetricsServer("127.0.0.1", 0, lambda: PAGE, read_timeout_s=READ_TIMEOUT_S) as server:
            stalled = await asyncio.to_thread(_stalled_client, server.port)
            try:
                status, _, body = await asyncio.to_thread(_request, server.port, "GET", "/metrics")
                assert (status, body.decode()) == (200, PAGE)
                # Cut off at the server's read deadline, well inside the client's own timeout.
                reply = await asyncio.to_thread(_read_to_eof, stalled)
                assert reply.startswith(b"HTTP/1.1 408 ")
            finally:
                stalled.close()

    arun(main())


def test_connections_beyond_the_cap_are_refused_at_once(
    arun: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def main() -> None:
        async with MetricsServer(
            "127.0.0.1", 0, lambda: "", read_timeout_s=CLIENT_TIMEOUT_S * 3, max_connections=2
        ) as server:
            # Accepted in connection order: the two stalled clients hold both slots.
            stalled = [await asyncio.to_thread(_stalled_client, server.port) for _ in range(2)]
            try:
                status, _, _ = await asyncio.to_thread(_request, server.port, "GET", "/metrics")
                assert status == 503
            finally:
                for sock in stalled:
                    sock.close()

    arun(main())


def test_leaving_the_server_closes_open_connections(
    arun: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    async def main() -> None:
        async with MetricsServer("127.0.0.1", 0, lambda: "", read_timeout_s=CLIENT_TIMEOUT_S * 3) as server:
            stalled = await asyncio.to_thread(_stalled_client, server.port)
            port = server.port
            # Connections are accepted in order, so once a later request is answered the stalled
            # one has its handler. (One accepted in the same loop pass as close() is lost by
            # Python 3.11's asyncio.Server until garbage collection; that is not under test.)
            status, _, _ = await asyncio.to_thread(_request, port, "GET", "/metrics")
            assert status == 200
        try:
            # Closed when the server left, not at its (far away) read deadline.
            assert await asyncio.to_thread(_read_to_eof, stalled) == b""
        finally:
            stalled.close()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.to_thread(_request, port, "GET", "/metrics")
        with pytest.raises(RuntimeError):
            _ = server.port

    arun(main())
