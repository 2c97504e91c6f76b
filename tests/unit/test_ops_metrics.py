"""Prometheus metrics: golden exposition text, escaping and name checks for the registry; a real
HTTP client against the server for status codes, and raw sockets for the clients that misbehave.

Blocking clients run in worker threads (asyncio.to_thread) so the server keeps its event loop;
every wait is a socket timeout or an asyncio deadline, never a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import math
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from dilocod.ops.metrics import (
    CONTENT_TYPE,
    MetricsServer,
    Registry,
    escape_label_value,
    format_value,
)
from dilocod.transport.loop import run

TEST_DEADLINE_S = 60.0
CLIENT_TIMEOUT_S = 10.0
#: The server's read deadline in these tests; clients wait CLIENT_TIMEOUT_S, far longer.
READ_TIMEOUT_S = 0.5

GOLDEN = """\
# HELP dilocod_rounds_merged_total Rounds merged since start.
# TYPE dilocod_rounds_merged_total counter
dilocod_rounds_merged_total 3
# HELP dilocod_event_loop_lag_seconds Latest event-loop lag.\\nMeasured by the watchdog.
# TYPE dilocod_event_loop_lag_seconds gauge
dilocod_event_loop_lag_seconds 0.0125
# HELP dilocod_bytes_received_total Bytes received, by peer and kind (C:\\\\ path).
# TYPE dilocod_bytes_received_total counter
dilocod_bytes_received_total{peer="learner-1",kind="push"} 1048576
dilocod_bytes_received_total{peer="odd \\"name\\"\\nwith\\\\slash",kind="push"} 2.5
# HELP dilocod_learners_connected Learners with an open session.
# TYPE dilocod_learners_connected gauge
"""


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


def _sample_registry() -> Registry:
    registry = Registry()
    rounds = registry.counter("dilocod_rounds_merged_total", "Rounds merged since start.")
    lag = registry.gauge(
        "dilocod_event_loop_lag_seconds", "Latest event-loop lag.\nMeasured by the watchdog."
    )
    received = registry.counter(
        "dilocod_bytes_received_total", "Bytes received, by peer and kind (C:\\ path).", ("peer", "kind")
    )
    registry.gauge("dilocod_learners_connected", "Learners with an open session.", ("site",))
    rounds.inc()
    rounds.inc(2)
    lag.set(0.0125)
    received.labels(peer="learner-1", kind="push").inc(1 << 20)
    received.labels(peer='odd "name"\nwith\\slash', kind="push").inc(2.5)
    return registry


def test_render_matches_golden_text() -> None:
    assert _sample_registry().render() == GOLDEN


def test_empty_registry_renders_nothing() -> None:
    assert Registry().render() == ""


def test_values_are_formatted_for_prometheus() -> None:
    assert [format_value(v) for v in (0.0, 3.0, -2.0, 0.5, 1e300, 2.0**60)] == [
        "0",
        "3",
        "-2",
        "0.5",
        "1e+300",
        "1.152921504606847e+18",
    ]
    assert [format_value(v) for v in (math.inf, -math.inf, math.nan)] == ["+Inf", "-Inf", "NaN"]


def test_label_values_are_escaped() -> None:
    assert escape_label_value('a\\b"c\nd') == 'a\\\\b\\"c\\nd'


@pytest.mark.parametrize("name", ["", "1st", "bytes-in", "bytes in", "ünits", "a{b}"])
def test_invalid_metric_names_are_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="invalid metric name"):
        Registry().counter(name, "help")


@pytest.mark.parametrize("label", ["", "__reserved", "a-b", "0peer", "a:b"])
def test_invalid_label_names_are_rejected(label: str) -> None:
    with pytest.raises(ValueError, match="invalid label name"):
        Registry().gauge("ok_name", "help", (label,))


def test_misuse_is_refused() -> None:
    registry = Registry()
    counter = registry.counter("a_total", "help")
    family = registry.counter("b_total", "help", ("peer",))
    with pytest.raises(ValueError, match="already registered"):
        registry.gauge("a_total", "help")
    with pytest.raises(ValueError, match="duplicate label"):
        registry.gauge("c", "help", ("x", "x"))
    with pytest.raises(ValueError, match="only go up"):
        counter.inc(-1)
    with pytest.raises(ValueError, match="only go up"):
        counter.inc(math.nan)
    with pytest.raises(ValueError, match="takes labels"):
        family.labels(site="a")
    with pytest.raises(TypeError):
        family.inc()
    with pytest.raises(TypeError):
        counter.labels(peer="x")
    assert counter.value == 0


def test_gauge_moves_both_ways_and_labelled_samples_can_be_removed() -> None:
    registry = Registry()
    gauge = registry.gauge("learners", "help", ("site",))
    gauge.labels(site="a").inc(3)
    gauge.labels(site="a").dec()
    gauge.labels(site="b").set(7)
    assert gauge.labels(site="a").value == 2
    gauge.remove(site="b")
    gauge.remove(site="never-seen")
    assert registry.render().splitlines()[2:] == ['learners{site="a"} 2']


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
    registry = _sample_registry()

    async def main() -> None:
        async with MetricsServer("127.0.0.1", 0, registry.render) as server:
            assert server.port > 0
            status, headers, body = await asyncio.to_thread(_request, server.port, "GET", "/metrics")
            assert (status, headers["content-type"], body.decode()) == (200, CONTENT_TYPE, GOLDEN)
            assert int(headers["content-length"]) == len(body)

            status, _, body = await asyncio.to_thread(_request, server.port, "GET", "/metrics?debug=1")
            assert (status, body.decode()) == (200, GOLDEN)

            status, headers, body = await asyncio.to_thread(_request, server.port, "HEAD", "/metrics")
            assert (status, body) == (200, b"")
            assert int(headers["content-length"]) == len(GOLDEN.encode())

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
        async with MetricsServer("127.0.0.1", 0, Registry().render) as server:
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
            "127.0.0.1", 0, Registry().render, max_request_bytes=4096, read_timeout_s=CLIENT_TIMEOUT_S * 3
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
    registry = _sample_registry()

    async def main() -> None:
        async with MetricsServer("127.0.0.1", 0, registry.render, read_timeout_s=READ_TIMEOUT_S) as server:
            stalled = await asyncio.to_thread(_stalled_client, server.port)
            try:
                status, _, body = await asyncio.to_thread(_request, server.port, "GET", "/metrics")
                assert (status, body.decode()) == (200, GOLDEN)
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
            "127.0.0.1", 0, Registry().render, read_timeout_s=CLIENT_TIMEOUT_S * 3, max_connections=2
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
        async with MetricsServer(
            "127.0.0.1", 0, Registry().render, read_timeout_s=CLIENT_TIMEOUT_S * 3
        ) as server:
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
