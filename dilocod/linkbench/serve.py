"""The bench server: a dilocod session endpoint that swallows fragments (or echoes them back as
updates, for round trips) and a raw-TCP receiver, in one process. `dilocod bench serve` runs it;
`dilocod bench loopback` starts it as a child process.

Status requests answer with this process's CPU seconds and wall clock, so a client can compute the
receiver's CPU share over any interval it measured.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from dilocod.config import Address
from dilocod.linkbench.raw import serve_raw
from dilocod.transport.endpoints import Server
from dilocod.transport.options import TransportOptions
from dilocod.transport.session import FragmentReceived, Session
from dilocod.wire.messages import PushHeader, StatusRequest, StatusResponse, UpdateHeader
from dilocod.wire.stream import StreamHeader

ECHO_ROUND = 2**63  # a push with this round number asks for the fragment back as an update


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

    async def handle(session: Session) -> None:
        while True:
            item = await session.recv()
            if isinstance(item, FragmentReceived):
                header = item.header
                if isinstance(header, PushHeader) and header.round == ECHO_ROUND:
                    update = UpdateHeader(
                        header.manifest,
                        header.raw_bytes,
                        header.codec,
                        header.chunk_bytes,
                        fragment=header.fragment,
                        version=1,
                    )
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
