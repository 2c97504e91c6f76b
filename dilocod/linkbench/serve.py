"""The bench server: a dilocod session endpoint that swallows fragments (or echoes them back as
updates, for round trips) and a raw-TCP receiver, in one process. `dilocod bench serve` runs it;
`dilocod bench loopback` and `dilocod bench local` start it as a child process.

Two push rounds are requests rather than data, so they ride on the session's authentication:
ECHO_ROUND asks for the fragment back as an update (a round trip), and GLOO_ROUND carries a small
JSON request to start the far end of a gloo broadcast (dilocod.linkbench.gloo, rank 1) against the
client's rendezvous. A malformed request is logged and dropped; the session goes on.

Status requests answer with this process's CPU seconds and wall clock, so a client can compute the
receiver's CPU share over any interval it measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import structlog

from dilocod.config import Address
from dilocod.linkbench.gloo import interface_for
from dilocod.linkbench.raw import serve_raw
from dilocod.transport.endpoints import Server
from dilocod.transport.errors import TransferFailed
from dilocod.transport.options import TransportOptions
from dilocod.transport.session import FragmentReceived, Session
from dilocod.wire.messages import PushHeader, StatusRequest, StatusResponse, UpdateHeader
from dilocod.wire.stream import StreamHeader

ECHO_ROUND = 2**63  # a push with this round number asks for the fragment back as an update
GLOO_ROUND = 2**63 + 1  # a push with this round number asks for a gloo peer (JSON body)
#: Bounds on a gloo request: the broadcast allocates `size` bytes here.
MAX_GLOO_BYTES = 4 << 30
MAX_GLOO_REPEATS = 20

log = structlog.get_logger("dilocod.bench")


class BufferPool:
    """Receive buffers reused by size: a fresh 100 MB allocation costs several memcpys in faults."""

    def __init__(self) -> None:
        self._free: dict[int, list[bytearray]] = defaultdict(list)

    def allocate(self, header: StreamHeader) -> memoryview:
        free = self._free[header.raw_bytes]
        return memoryview(free.pop() if free else bytearray(header.raw_bytes))

    def release(self, buffer: memoryview) -> None:
        owner = buffer.obj
        if isinstance(owner, bytearray):
            self._free[len(owner)].append(owner)


def process_status() -> dict[str, Any]:
    times = os.times()
    return {"cpu_s": times.user + times.system, "wall_s": time.monotonic(), "pid": os.getpid()}


async def serve(
    listen: Address,
    *,
    secret: bytes | None,
    ready: Callable[[dict[str, Any]], None],
    raw_port: int | None = None,
    stall_timeout_s: float | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT.

    stall_timeout_s, when given, replaces both the mid-frame stall and the handshake deadlines, so a
    stalled peer can be seen cut off in seconds rather than after the default half minute.
    """
    options = TransportOptions()
    if stall_timeout_s is not None:
        options = TransportOptions(stall_timeout_s=stall_timeout_s, handshake_timeout_s=stall_timeout_s)
    pool = BufferPool()
    raw_listener = socket.create_server((listen.host, raw_port if raw_port is not None else 0))
    stop_raw = threading.Event()
    raw_thread = threading.Thread(target=serve_raw, args=(raw_listener, stop_raw), daemon=True)
    raw_thread.start()
    actual_raw_port = raw_listener.getsockname()[1]

    gloo_peers: set[asyncio.subprocess.Process] = set()

    async def handle(session: Session) -> None:
        while True:
            item = await session.recv()
            if isinstance(item, FragmentReceived):
                header = item.header
                if isinstance(header, PushHeader) and header.round == GLOO_ROUND:
                    await _start_gloo_peer(session, bytes(item.buffer), gloo_peers)
                elif isinstance(header, PushHeader) and header.round == ECHO_ROUND:
                    update = UpdateHeader(
                        header.manifest,
                        header.raw_bytes,
                        header.codec,
                        header.chunk_bytes,
                        fragment=header.fragment,
                        version=1,
                        precision=header.precision,
                    )
                    # A client that resets the echo (or asks for it past the allowance) fails that
                    # transfer only: its session goes on.
                    with contextlib.suppress(TransferFailed):
                        await session.send_fragment(update, item.buffer)
                pool.release(item.buffer)
            elif isinstance(item, StatusRequest):
                await session.send(StatusResponse({**process_status(), "raw_port": actual_raw_port}))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with Server(
            handle, server_id="bench", secret=secret, options=options, allocate=pool.allocate
        ) as server:
            host, port = await server.listen(listen.host, listen.port)
            ready(
                {
                    "event": "ready",
                    "host": host,
                    "port": port,
                    "raw_port": actual_raw_port,
                    "pid": os.getpid(),
                }
            )
            await stop.wait()
    finally:
        stop_raw.set()
        raw_listener.close()
        for peer in gloo_peers:
            if peer.returncode is None:
                peer.kill()
                await peer.wait()


def parse_gloo_request(body: bytes) -> tuple[str, int, int]:
    """(master HOST:PORT, size, repeats) from a GLOO_ROUND push; ValueError naming what is wrong."""
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise ValueError("not a JSON object")
    master, size, repeats = request.get("master"), request.get("size"), request.get("repeats")
    if not isinstance(master, str) or not master.rpartition(":")[2].isdigit():
        raise ValueError(f"master must be HOST:PORT, got {master!r}")
    if not isinstance(size, int) or not 4 <= size <= MAX_GLOO_BYTES:
        raise ValueError(f"size must be 4..{MAX_GLOO_BYTES} bytes, got {size!r}")
    if not isinstance(repeats, int) or not 1 <= repeats <= MAX_GLOO_REPEATS:
        raise ValueError(f"repeats must be 1..{MAX_GLOO_REPEATS}, got {repeats!r}")
    return master, size, repeats


async def _start_gloo_peer(session: Session, body: bytes, peers: set[asyncio.subprocess.Process]) -> None:
    try:
        master, size, repeats = parse_gloo_request(body)
    except ValueError as exc:
        log.warning("gloo request refused", peer=session.peer.peer_id, reason=str(exc))
        return
    if any(p.returncode is None for p in peers):
        log.warning("gloo request refused", peer=session.peer.peer_id, reason="a gloo broadcast is running")
        return
    env = {**os.environ}
    local = session.control.transport.get_extra_info("sockname")
    ifname = interface_for(str(local[0])) if local else None
    if ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = ifname  # the path the session takes, not the host name's
    # c10d warns that it cannot name a peer in a namespace without DNS: noise, not a fault.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    command = [sys.executable, "-m", "dilocod.linkbench.gloo", "--rank", "1", "--master", master]
    command += ["--size", str(size), "--repeats", str(repeats)]
    peer = await asyncio.create_subprocess_exec(*command, env=env, stdout=asyncio.subprocess.DEVNULL)
    peers.add(peer)
    peer_task = asyncio.ensure_future(peer.wait())
    peer_task.add_done_callback(lambda _: peers.discard(peer))
