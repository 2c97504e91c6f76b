"""Prometheus metrics: a small registry rendering text exposition format 0.0.4, and the HTTP
endpoint that serves it.

Owns metric names, label escaping and the /metrics listener. The registry is filled by the daemons;
what a metric means belongs to them. The server is deliberately tiny (one request per connection,
GET /metrics only) because a scraper calls it every few seconds at most; every read and write has a
deadline and the request head a size cap, so a stalled or hostile client costs one bounded slot.
Must not import torch, dilocod.transport or dilocod.wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Generic, TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_LARGEST_EXACT_INT = 2**53

log = logging.getLogger(__name__)


def _check_metric_name(name: str) -> str:
    if not _METRIC_NAME.fullmatch(name):
        raise ValueError(f"invalid metric name {name!r}")
    return name


def _check_label_name(name: str) -> str:
    # Names starting with "__" are reserved for Prometheus' own use.
    if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
        raise ValueError(f"invalid label name {name!r}")
    return name


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(value: float) -> str:
    """Integers without a fraction (most counters are), everything else as Python's shortest repr."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < _LARGEST_EXACT_INT:
        return str(int(value))
    return repr(value)


class _Value:
    """One sample. The lock makes += safe between the training thread and the event loop."""

    __slots__ = ("_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0.0

    @property
    def value(self) -> float:
        return self._value


class CounterValue(_Value):
    __slots__ = ()

    def inc(self, amount: float = 1.0) -> None:
        # A counter that goes down reads as a restart to Prometheus' rate(); refuse rather than lie.
        if not amount >= 0:
            raise ValueError(f"counters only go up, got {amount!r}")
        with self._lock:
            self._value += amount


class GaugeValue(_Value):
    __slots__ = ()

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value -= amount


V = TypeVar("V", bound="_Value")
F = TypeVar("F", "Counter", "Gauge")


class _Family(Generic[V]):
    """A metric name with HELP, TYPE and its samples, one per combination of label values."""

    kind = ""

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...], make: Callable[[], V]) -> None:
        self.name = _check_metric_name(name)
        self.help = help_text
        self.label_names = tuple(_check_label_name(label) for label in labels)
        if len(set(self.label_names)) != len(self.label_names):
            raise ValueError(f"{name}: duplicate label names {self.label_names}")
        self._make = make
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], V] = {}
        if not self.label_names:
            self._children[()] = make()

    def labels(self, **values: str) -> V:
        """The sample for these label values, created at zero on first use."""
        key = self._key(values)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._make()
            return child

    def remove(self, **values: str) -> None:
        """Forget one labelled sample (a learner that left), so label sets do not grow forever."""
        with self._lock:
            self._children.pop(self._key(values), None)

    def _key(self, values: dict[str, str]) -> tuple[str, ...]:
        if not self.label_names:
            raise TypeError(f"{self.name} has no labels")
        if set(values) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {tuple(values)}")
        return tuple(str(values[label]) for label in self.label_names)

    def _unlabelled(self) -> V:
        if self.label_names:
            raise TypeError(f"{self.name} has labels {self.label_names}: use .labels(...)")
        return self._children[()]

    @property
    def value(self) -> float:
        return self._unlabelled().value

    def render(self) -> Iterator[str]:
        yield f"# HELP {self.name} {escape_help(self.help)}"
        yield f"# TYPE {self.name} {self.kind}"
        with self._lock:
            children = list(self._children.items())
        for key, child in children:
            if key:
                pairs = ",".join(
                    f'{label}="{escape_label_value(value)}"'
                    for label, value in zip(self.label_names, key, strict=True)
                )
                yield f"{self.name}{{{pairs}}} {format_value(child.value)}"
            else:
                yield f"{self.name} {format_value(child.value)}"


class Counter(_Family[CounterValue]):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> None:
        super().__init__(name, help_text, labels, CounterValue)

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)


class Gauge(_Family[GaugeValue]):
    kind = "gauge"

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> None:
        super().__init__(name, help_text, labels, GaugeValue)

    def set(self, value: float) -> None:
        self._unlabelled().set(value)

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._unlabelled().dec(amount)


class Registry:
    """The metrics of one daemon, rendered in registration order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, Counter | Gauge] = {}

    def counter(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> Counter:
        return self._add(Counter(name, help_text, labels))

    def gauge(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> Gauge:
        return self._add(Gauge(name, help_text, labels))

    def _add(self, family: F) -> F:
        with self._lock:
            if family.name in self._families:
                raise ValueError(f"metric {family.name} is already registered")
            self._families[family.name] = family
        return family

    def render(self) -> str:
        with self._lock:
            families = list(self._families.values())
        lines = [line for family in families for line in family.render()]
        return "\n".join(lines) + "\n" if lines else ""


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

    `render` runs on the event loop for every scrape, so it must be quick (Registry.render is).
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
