"""The /metrics endpoint: the text prometheus_client renders (exposition format 0.0.4), served on
the daemon's own event loop.

Owns the listener, not the metrics: what a metric means, and its families, belong to the daemons
(dilocod.syncer.metrics, with prometheus_client's collectors and exposition). The endpoint is
written here rather than taken from prometheus_client because its servers are a thread per
request with neither a read deadline nor a request-size cap (start_http_server) or need an ASGI
server beside the daemon (make_asgi_app): this one is a coroutine per connection on the loop that
already runs (one request per connection, GET or HEAD /metrics only, as a scraper calls it every
few seconds at most), every read and write has a deadline, the request head a size cap and the
connections a count cap, so a stalled or hostile client costs one bounded slot.
Must not import torch, dilocod.transport or dilocod.wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from types import TracebackType

#: What generate_latest writes (prometheus_client's text exposition, format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger(__name__)

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def _response(status: int, body: bytes, *, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
    )
    if status == 405:
        head += "Allow: GET, HEAD\r\n"
    return head.encode() + b"\r\n" + body


class MetricsServer:
    """Serves `render()` on GET /metrics; `async with MetricsServer(host, port, render) as server`.

    `render` runs on the event loop for every scrape, so it must be quick (the syncer's renders
    its status: a few dozen families).
    Connections beyond `max_connections` are answered 503 and closed at once, so a client opening
    many sockets cannot starve the scraper for longer than `read_timeout_s`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        render: Callable[[], str],
        *,
        max_request_bytes: int = 8192,
        read_timeout_s: float = 5.0,
        write_timeout_s: float = 5.0,
        max_connections: int = 16,
    ) -> None:
        self.host = host
        self._requested_port = port
        self._render = render
        self.max_request_bytes = max_request_bytes
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self.max_connections = max_connections
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.StreamWriter, asyncio.Event] = {}
        self._closing = False

    @property
    def port(self) -> int:
        """The bound port. With port 0 give one address, not a name that resolves to several: each
        of those sockets would get its own ephemeral port, and this reports the first."""
        if self._server is None:
            raise RuntimeError("the metrics server is not listening")
        return int(self._server.sockets[0].getsockname()[1])

    async def __aenter__(self) -> MetricsServer:
        self._server = await asyncio.start_server(
            self._serve, self.host, self._requested_port, limit=self.max_request_bytes
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._closing = True
        server.close()
        # Python 3.11's Server.wait_closed does not wait for open connections, and cancelled
        # handlers are logged by asyncio as errors; aborting the transports ends every handler
        # normally instead (a pending read sees EOF, a pending drain a reset), and we wait for them.
        finished = [done.wait() for done in self._connections.values()]
        for writer in self._connections:
            writer.transport.abort()
        await asyncio.gather(*finished)
        # A connection accepted in the same loop pass as close() never reaches _serve on Python
        # 3.11's asyncio loop (Server._attach asserts after close; the socket waits for the garbage
        # collector). Harmless when the process is exiting, which is when daemons close this.
        await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing:  # accepted just before close() but started after it
            writer.transport.abort()
            return
        done = asyncio.Event()
        self._connections[writer] = done
        try:
            try:
                if len(self._connections) > self.max_connections:
                    await self._write(writer, _response(503, b"too many connections\n"))
                    return
                response = await self._respond(reader)
                if response is not None:
                    await self._write(writer, response)
            except (ConnectionError, TimeoutError):
                pass  # the client went away or stalled: nothing to tell it
            finally:
                writer.close()
                with contextlib.suppress(ConnectionError, TimeoutError):
                    async with asyncio.timeout(self.write_timeout_s):
                        await writer.wait_closed()
        finally:
            del self._connections[writer]
            done.set()

    async def _respond(self, reader: asyncio.StreamReader) -> bytes | None:
        """The response to one request, or None when the connection should just be dropped."""
        try:
            async with asyncio.timeout(self.read_timeout_s):
                head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            return _response(408, b"request timeout\n")
        except asyncio.LimitOverrunError:
            return _response(431, b"request too large\n")
        except asyncio.IncompleteReadError:
            return None
        request_line = head.split(b"\r\n", 1)[0]
        parts = request_line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _response(400, b"bad request\n")
        method, target = parts[0], parts[1]
        # Bodies are never read: every response closes the connection, so leftovers do no harm.
        if method not in (b"GET", b"HEAD"):
            return _response(405, b"method not allowed\n")
        if target.split(b"?", 1)[0] != b"/metrics":
            return _response(404, b"not found\n")
        try:
            body = self._render().encode()
        except Exception:
            log.exception("rendering metrics failed")
            return _response(500, b"rendering metrics failed\n")
        response = _response(200, body, content_type=CONTENT_TYPE)
        if method == b"HEAD":
            return response[: len(response) - len(body)]
        return response

    async def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        async with asyncio.timeout(self.write_timeout_s):
            await writer.drain()
