"""Helpers for the integration tests: the bench server as a real child process, gradient-like
fragments, fragment round trips through the echoing server, and two hand-built clients that speak
the wire format over a plain blocking socket (raw bytes, or a sans-IO Connection core).

Every wait here has a deadline (selectors, socket timeouts, asyncio.timeout); nothing sleeps.
Imports torch lazily: only the fragment maker needs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from dilocod.linkbench.serve import ECHO_ROUND
from dilocod.transport.credentials import TlsFiles
from dilocod.transport.endpoints import Server, connect
from dilocod.transport.errors import TransferFailed
from dilocod.transport.options import TransportOptions
from dilocod.transport.session import FragmentReceived, Session
from dilocod.wire.connection import Connection
from dilocod.wire.events import Event, HandshakeCompleted, MessageReceived, PeerWentAway
from dilocod.wire.frames import HEADER_BYTES, FrameType, decode_header
from dilocod.wire.limits import DEFAULT_LIMITS, MiB
from dilocod.wire.manifest import TensorEntry, pack_manifest
from dilocod.wire.messages import (
    Message,
    PushHeader,
    StatusRequest,
    StatusResponse,
    UpdateHeader,
    decode_body,
)
from dilocod.wire.states import Role

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
#: Deadline for one fragment round trip; generous for 256 MiB through zstd on a busy 2-core box.
TRANSFER_TIMEOUT_S = 120.0
#: Deadline for a peer's reply to bad input (an ERROR frame and the close).
REPLY_TIMEOUT_S = 15.0
CHUNK_BYTES = 1 * MiB


def digest(buffer: Any) -> int:
    """128-bit xxh3 of a buffer's bytes: equal digests and lengths stand for bit-exact equality."""
    return xxhash.xxh3_128_intdigest(memoryview(buffer).cast("B"))


# ----------------------------------------------------------------------- the bench server process


@dataclass
class BenchServer:
    """A running `dilocod bench serve` child process and what its ready line said."""

    process: subprocess.Popen[bytes]
    port: int
    raw_port: int
    pid: int
    secret: bytes | None
    stderr_path: Path
    args: tuple[str, ...]

    def alive(self) -> bool:
        return self.process.poll() is None

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def max_rss_bytes(self) -> int:
        """Peak resident memory of the process so far (VmHWM)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc status")


def start_bench_server(
    work_dir: Path,
    *,
    secret_file: Path | None = None,
    use_uvloop: bool = True,
    stall_timeout_s: float | None = None,
    name: str = "bench",
) -> BenchServer:
    """Start `python -m dilocod bench serve` and wait (selectors, with a deadline) for its ready line."""
    args = ["bench", "serve", "--listen", "127.0.0.1:0", "--ready-json"]
    args += ["--secret-file", str(secret_file)] if secret_file is not None else ["--insecure"]
    if not use_uvloop:
        args.append("--no-uvloop")
    if stall_timeout_s is not None:
        args += ["--stall-timeout-s", str(stall_timeout_s)]
    stderr_path = work_dir / f"{name}-{len(list(work_dir.glob('*.stderr')))}.stderr"
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "dilocod", *args], stdout=subprocess.PIPE, stderr=stderr
        )
    try:
        info = _read_ready(process, stderr_path)
    except BaseException:
        stop_bench_process(process)
        raise
    secret = secret_file.read_bytes().strip() if secret_file is not None else None
    return BenchServer(process, info["port"], info["raw_port"], info["pid"], secret, stderr_path, tuple(args))


def _read_ready(process: subprocess.Popen[bytes], stderr_path: Path) -> dict[str, Any]:
    assert process.stdout is not None
    fd = process.stdout.fileno()
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while b"\n" not in pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                raise RuntimeError(
                    f"bench server not ready within {READY_TIMEOUT_S} s; stderr:\n"
                    + stderr_path.read_text(errors="replace")
                )
            piece = os.read(fd, 4096)
            if not piece:
                raise RuntimeError(
                    f"bench server exited with {process.wait(STOP_TIMEOUT_S)} before it was ready; "
                    "stderr:\n" + stderr_path.read_text(errors="replace")
                )
            pending += piece
    info = json.loads(pending.split(b"\n", 1)[0])
    if info.get("event") != "ready":
        raise RuntimeError(f"unexpected first line from the bench server: {info}")
    return info


def stop_bench_process(process: subprocess.Popen[bytes]) -> int:
    """SIGTERM, then SIGKILL if it does not exit within STOP_TIMEOUT_S; returns the exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)
    if process.stdout is not None:
        process.stdout.close()
    assert process.returncode is not None
    return process.returncode


class BenchServers:
    """Bench server child processes, one per configuration, started on first use."""

    def __init__(self, work_dir: Path, secret_file: Path) -> None:
        self.work_dir = work_dir
        self.secret_file = secret_file
        self._running: dict[tuple[object, ...], BenchServer] = {}

    def get(
        self,
        *,
        secure: bool = False,
        use_uvloop: bool = True,
        stall_timeout_s: float | None = None,
        name: str = "bench",
    ) -> BenchServer:
        """A running server; `name` separates servers that must not share a process history."""
        key = (secure, use_uvloop, stall_timeout_s, name)
        server = self._running.get(key)
        if server is None or not server.alive():
            server = start_bench_server(
                self.work_dir,
                secret_file=self.secret_file if secure else None,
                use_uvloop=use_uvloop,
                stall_timeout_s=stall_timeout_s,
                name=name,
            )
            self._running[key] = server
        return server

    def stop_all(self) -> dict[tuple[str, ...], int]:
        statuses = {}
        for server in self._running.values():
            statuses[server.args] = stop_bench_process(server.process)
        self._running.clear()
        return statuses


@dataclass(frozen=True)
class TlsSet:
    server: TlsFiles
    client: TlsFiles
    #: A client certificate signed by a CA the server does not trust.
    stranger: TlsFiles


# ----------------------------------------------------------------------------- fragments


@dataclass(frozen=True)
class Fragment:
    """Gradient-like bytes and the manifest that describes them."""

    manifest: tuple[TensorEntry, ...]
    data: bytearray
    digest: int

    @property
    def raw_bytes(self) -> int:
        return len(self.data)

    def push_header(self, codec: str, *, round_: int = ECHO_ROUND, fragment: int = 3) -> PushHeader:
        return PushHeader(self.manifest, self.raw_bytes, codec, CHUNK_BYTES, fragment=fragment, round=round_)


def make_fragment(size_bytes: int, seed: int = 0, *, zero_last_bytes: int = 0) -> Fragment:
    """float32 values like an outer gradient (torch.randn * 1e-3), so compressors find the
    redundancy of real gradients: an fp32 push of one tensor. Whatever is left over after the
    last whole float32 (under 4 bytes) is random padding (protocol/SPEC.md §5.2).
    zero_last_bytes zeroes the end, which any codec compresses."""
    import torch

    items = size_bytes // 4
    entries, _ = pack_manifest([("gradient", "float32", [items])])
    generator = torch.Generator().manual_seed(seed)
    data = bytearray(size_bytes)
    torch.frombuffer(data, dtype=torch.float32, count=items).copy_(
        torch.randn(items, generator=generator) * 1e-3
    )
    if tail := size_bytes - items * 4:
        noise = torch.randint(0, 256, (tail,), generator=generator, dtype=torch.uint8)
        data[items * 4 :] = bytes(noise.tolist())
    if zero_last_bytes:
        data[-zero_last_bytes:] = bytes(zero_last_bytes)
    return Fragment(tuple(entries), data, digest(data))


class Fragments:
    """Gradient-like fragments made once per size and shared (tests only read them)."""

    def __init__(self) -> None:
        self._made: dict[int, Fragment] = {}

    def get(self, size_bytes: int) -> Fragment:
        if size_bytes not in self._made:
            self._made[size_bytes] = make_fragment(size_bytes, seed=size_bytes)
        return self._made[size_bytes]


# ------------------------------------------------------------------------- async clients


def wire_bytes_sent(session: Session) -> int:
    return sum(p.conn.bytes_sent for p in [session.control, *session.data])


async def recv_fragment(session: Session, timeout_s: float = TRANSFER_TIMEOUT_S) -> FragmentReceived:
    """The next whole fragment from the peer (other messages are skipped), within a deadline."""
    async with asyncio.timeout(timeout_s):
        while True:
            item = await session.recv()
            if isinstance(item, FragmentReceived):
                return item


async def echo(
    session: Session, fragment: Fragment, codec: str, *, shuffle: int, timeout_s: float = TRANSFER_TIMEOUT_S
) -> FragmentReceived:
    """Push a fragment to the echoing bench server and receive it back as an update."""
    async with asyncio.timeout(timeout_s):
        await session.send_fragment(fragment.push_header(codec), fragment.data, shuffle_item_size=shuffle)
        return await recv_fragment(session, timeout_s)


def assert_echo_matches(received: FragmentReceived, fragment: Fragment, codec: str) -> None:
    header = received.header
    assert header.raw_bytes == fragment.raw_bytes
    assert header.manifest == fragment.manifest
    assert header.codec == codec
    assert len(received.buffer) == fragment.raw_bytes
    assert digest(received.buffer) == fragment.digest, "echoed fragment differs from what was sent"


async def status(session: Session, timeout_s: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
    async with asyncio.timeout(timeout_s):
        await session.send(StatusRequest())
        while True:
            item = await session.recv()
            if isinstance(item, StatusResponse):
                return item.status


async def check_serves(server: BenchServer, fragment: Fragment, *, streams: int = 2) -> None:
    """The same server process still completes a whole fragment round trip for a good client."""
    assert server.alive(), f"bench server died; stderr:\n{server.stderr()}"
    session = await asyncio.wait_for(
        connect("127.0.0.1", server.port, peer_id="good-client", secret=server.secret, streams=streams),
        REPLY_TIMEOUT_S,
    )
    try:
        assert (await status(session))["pid"] == server.pid
        assert_echo_matches(await echo(session, fragment, "zstd", shuffle=4), fragment, "zstd")
    finally:
        await session.close("checked")
    assert server.alive()


async def wait_until(predicate: Callable[[], bool], timeout_s: float) -> None:
    """Yield to the event loop until predicate() holds: one check per loop iteration (no fixed
    sleeps), for progress that no future reports (bytes queued on one connection)."""
    async with asyncio.timeout(timeout_s):
        # No event reports bytes queued on a connection, so check once per loop iteration.
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0)


# ------------------------------------------------------------------ hand-built, blocking clients


@dataclass(frozen=True)
class Frame:
    frame_type: FrameType
    stream_id: int
    message: Message | None  # None for CHUNK frames


def decode_frames(data: bytes) -> list[Frame]:
    """Split what a peer sent into frames and decode each control body; a partial frame fails."""
    frames, pos = [], 0
    while pos < len(data):
        assert len(data) - pos >= HEADER_BYTES, f"partial header at byte {pos}: {data[pos:]!r}"
        header = decode_header(data[pos : pos + HEADER_BYTES], DEFAULT_LIMITS, handshaking=False)
        body = data[pos + HEADER_BYTES : pos + HEADER_BYTES + header.body_length]
        assert len(body) == header.body_length, f"partial {header.frame_type.name} body"
        message = None
        if header.frame_type is not FrameType.CHUNK:
            message = decode_body(header.frame_type, body, DEFAULT_LIMITS)
        frames.append(Frame(header.frame_type, header.stream_id, message))
        pos += HEADER_BYTES + header.body_length
    return frames


@dataclass(frozen=True)
class RawReply:
    frames: list[Frame]
    closed: bool  # the peer closed (FIN or RST) within the deadline
    reset: bool
    elapsed_s: float


def read_until_closed(sock: socket.socket, timeout_s: float = REPLY_TIMEOUT_S) -> RawReply:
    """Everything the peer sends until it closes, or until the deadline passes."""
    start = time.monotonic()
    deadline = start + timeout_s
    received = bytearray()
    closed = reset = False
    while (remaining := deadline - time.monotonic()) > 0:
        sock.settimeout(remaining)
        try:
            piece = sock.recv(1 << 16)
        except TimeoutError:
            break
        except ConnectionResetError:
            closed = reset = True
            break
        if not piece:
            closed = True
            break
        received += piece
    return RawReply(decode_frames(bytes(received)), closed, reset, time.monotonic() - start)


def raw_exchange(
    port: int, payload: bytes, *, shut_write: bool = False, timeout_s: float = REPLY_TIMEOUT_S
) -> RawReply:
    """Send raw bytes on a fresh connection, optionally half-close, and read the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(payload)
            if shut_write:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may cut us off before it read everything: the reply says why
        return read_until_closed(sock, timeout_s)


class CoreClient:
    """A client built by hand: a sans-IO Connection core over a plain blocking socket.

    It completes a real handshake, then sends whatever frames a test asks for, including ones a
    correct session would never send.
    """

    def __init__(
        self,
        port: int,
        *,
        secret: bytes | None = None,
        kind: str = "control",
        session: bytes = b"",
        timeout_s: float = REPLY_TIMEOUT_S,
        capabilities: tuple[str, ...] = (),
    ) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.timeout_s = timeout_s
        self.conn = Connection(Role.CLIENT, secret=secret, local_id="hand-built", capabilities=capabilities)
        self.events: list[Event] = []
        self.conn.start(kind=kind, role="learner", session=session)
        self.flush()
        self.peer = self.wait_for(lambda e: isinstance(e, HandshakeCompleted))
        assert isinstance(self.peer, HandshakeCompleted)

    def flush(self) -> None:
        for buffer in self.conn.data_to_send():
            self.sock.sendall(buffer)

    def wait_for(self, predicate: Callable[[Event], bool]) -> Event:
        """Read until an event matching predicate arrives; fails on close or at the deadline."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            for event in self.events:
                if predicate(event):
                    self.events.remove(event)
                    return event
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no matching event within {self.timeout_s} s; got {self.events}"
            self.sock.settimeout(remaining)
            piece = self.sock.recv(1 << 16)
            assert piece, f"peer closed; events so far {self.events}"
            self.events.extend(self.conn.receive_data(piece))
            self.flush()  # the core may answer on its own (handshake replies, PONG)

    def sync(self) -> None:
        """Send what is queued plus a STATUS_REQUEST and wait for the answer: the server has then
        processed everything sent before on this connection."""
        self.conn.send(StatusRequest())
        self.flush()
        self.wait_for(lambda e: isinstance(e, MessageReceived) and isinstance(e.message, StatusResponse))

    def went_away(self) -> PeerWentAway:
        event = self.wait_for(lambda e: isinstance(e, PeerWentAway))
        assert isinstance(event, PeerWentAway)
        return event

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> CoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------ in-process servers

#: In-process ends: production defaults, but a lost acknowledgement fails within a test's budget.
TEST_OPTIONS = TransportOptions(ack_timeout_s=60.0)
#: For killing connections mid-fragment: small socket and write buffers, so the sender meets
#: backpressure, yields between chunks, and a connection dies with chunks still in flight (with
#: the defaults a fast receiver may take a whole fragment before the sender ever yields).
SMALL_BUFFERS = TransportOptions(
    ack_timeout_s=60.0, socket_buffer_bytes=256 * 1024, write_buffer_high_bytes=1 * MiB
)


@dataclass
class EchoHandler:
    """Server handler like the bench server's: every pushed fragment comes back as an update.

    Records the digest of every fragment the server's session delivered (a corrupt delivery shows
    up here), retries an update whose transfer failed, and can abort one of its own data
    connections while an update is in flight (`kill_during_update`).
    """

    kill_during_update: bool = False
    delivered: list[int] = field(default_factory=list)
    update_failures: list[TransferFailed] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    killed_at: list[int] = field(default_factory=list)  # bytes queued when it killed

    async def __call__(self, session: Session) -> None:
        self.sessions.append(session)
        while True:
            item = await session.recv()
            if isinstance(item, StatusRequest):
                await session.send(StatusResponse({"pid": os.getpid()}))
            elif isinstance(item, FragmentReceived):
                self.delivered.append(digest(item.buffer))
                await self._echo(session, item)

    async def _echo(self, session: Session, item: FragmentReceived) -> None:
        h = item.header
        update = UpdateHeader(h.manifest, h.raw_bytes, h.codec, h.chunk_bytes, fragment=3, version=1)
        shuffle = 4 if h.codec != "none" else 0
        for attempt in range(3):
            try:
                async with asyncio.TaskGroup() as tasks:
                    kill = None
                    if self.kill_during_update and attempt == 0 and session.data:
                        kill = tasks.create_task(kill_when_queued(session, h.raw_bytes, self.killed_at))
                    await session.send_fragment(update, item.buffer, shuffle_item_size=shuffle)
                    if kill is not None:
                        kill.cancel()  # an update that finished first leaves killed_at empty
                return
            except* TransferFailed as group:
                self.update_failures.extend(group.exceptions)  # type: ignore[arg-type]


def kill_when_queued(
    session: Session, raw_bytes: int, record: list[int], *, every: bool = False, share: float = 0.25
) -> Coroutine[Any, Any, None]:
    """A coroutine that, once the data connections have queued `share` of a fragment of raw_bytes
    more than now (mid-fragment, chunks still on their way), aborts the busiest one (most bytes
    waiting to be written), or every one; it records the bytes queued at that moment.

    The baseline is taken now, before the push starts: a sender that meets no backpressure may
    queue a whole fragment before the returned coroutine first runs.
    """
    protos = list(session.data)
    start = sum(p.conn.bytes_sent for p in protos)
    threshold = start + int(raw_bytes * share)

    async def kill() -> None:
        await wait_until(lambda: sum(p.conn.bytes_sent for p in protos) >= threshold, TRANSFER_TIMEOUT_S)
        record.append(sum(p.conn.bytes_sent for p in protos) - start)
        busiest = max(protos, key=lambda p: (p.write_buffer_size(), p.conn.bytes_sent))
        for proto in protos if every else [busiest]:
            assert proto.transport is not None
            proto.transport.abort()

    return kill()


@asynccontextmanager
async def in_process_server(handler: EchoHandler, **kwargs: Any) -> AsyncIterator[tuple[Server, int]]:
    """A transport Server on 127.0.0.1 in this process; yields it and its port."""
    kwargs.setdefault("secret", None)
    kwargs.setdefault("options", TEST_OPTIONS)
    async with Server(handler, server_id="in-process", **kwargs) as server:
        _, port = await server.listen("127.0.0.1", 0)
        yield server, port
