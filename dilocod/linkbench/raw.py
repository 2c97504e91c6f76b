"""The raw TCP ceiling: plain sockets, 4 MiB writes and reads, no framing, no checks. What any
sender on this path can reach; dilocod's numbers are read against it.

Two shapes of the same test, chosen per connection by its first byte:

- threaded (b"T"): one thread per stream at each end, blocking sendall / recv_into. The most a
  process can push when it spends a core per stream.
- shared (b"S"): one thread for all streams at each end, non-blocking sockets under a selector.
  The most one thread can push, which is the shape of dilocod itself (one event loop per process
  drives every data connection), so it is the like-for-like ceiling for a dilocod session.

The receiver lands the bytes in a destination as large as its share of the transfer (reused
between transfers), 4 MiB per recv_into, as any real receiver of a fragment must. Receiving into
one cache-resident 4 MiB buffer over and over would measure the cache, not the path.

Wire format of the raw test (not the dilocod protocol): after the mode byte, the sender writes an
8-byte big-endian length then that many bytes; the receiver answers with the same 8-byte length
once it holds them all.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from dilocod.transport.sockets import tune

BLOCK_BYTES = 4 * 1024 * 1024
THREADED, SHARED = b"T", b"S"
RawMode = Literal["threaded", "shared"]
_MODE_BYTES: dict[str, bytes] = {"threaded": THREADED, "shared": SHARED}
_LENGTH = struct.Struct(">Q")
_POLL_S = 0.2  # how often the receiver looks at its stop flag


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("raw peer closed early")
        got += n


@dataclass(slots=True)
class _Inbound:
    """One shared-mode connection on the receiving side: mode byte, length, then the body."""

    sock: socket.socket
    head: memoryview = field(default_factory=lambda: memoryview(bytearray(1 + _LENGTH.size)))
    head_got: int = 0
    destination: memoryview = field(default_factory=lambda: memoryview(bytearray(0)))
    total: int = -1
    got: int = 0

    def on_readable(self) -> bool:
        """Read what is there; False once the connection is finished."""
        if self.total < 0:
            n = self.sock.recv_into(self.head[self.head_got :])
            if n == 0:
                return False
            self.head_got += n
            if self.head_got < len(self.head):
                return True
            self.total = _LENGTH.unpack(self.head[1:])[0]
            if len(self.destination) != self.total:
                self.destination = memoryview(bytearray(self.total))
            self.got = 0
        if self.got < self.total:
            try:
                n = self.sock.recv_into(self.destination[self.got : self.got + BLOCK_BYTES])
            except BlockingIOError:
                return True  # the header came alone; the body follows on a later wake-up
            if n == 0:
                return False
            self.got += n
        if self.got == self.total:
            # 8 bytes into a socket that has sent nothing else: it never blocks.
            self.sock.sendall(_LENGTH.pack(self.total))
            self.total, self.head_got = -1, 1  # the next transfer starts at its length
        return True


def serve_raw(listener: socket.socket, stop: threading.Event) -> None:
    """Accept raw-test connections until stop is set. Threaded-mode connections get a thread
    each; shared-mode ones are all served by this thread."""
    listener.setblocking(False)
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        while not stop.is_set():
            for key, _ in selector.select(_POLL_S):
                if key.fileobj is listener:
                    _accept(listener, selector)
                    continue
                inbound: _Inbound = key.data
                try:
                    first_wake = inbound.head_got == 0 and inbound.total < 0
                    if first_wake and not _route(inbound, selector):
                        continue
                    if inbound.on_readable():
                        continue
                except OSError:
                    pass
                selector.unregister(inbound.sock)
                inbound.sock.close()
        for key in list(selector.get_map().values()):
            if key.fileobj is not listener:
                key.fileobj.close()  # type: ignore[union-attr]


def _accept(listener: socket.socket, selector: selectors.BaseSelector) -> None:
    try:
        conn, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return
    except OSError:
        return
    tune(conn)
    conn.setblocking(False)
    selector.register(conn, selectors.EVENT_READ, _Inbound(conn))


def _route(inbound: _Inbound, selector: selectors.BaseSelector) -> bool:
    """Look at the mode byte: hand a threaded-mode connection to its own thread (False), keep a
    shared-mode one here (True)."""
    mode = inbound.sock.recv(1, socket.MSG_PEEK)
    if mode == THREADED:
        selector.unregister(inbound.sock)
        inbound.sock.setblocking(True)
        threading.Thread(target=_serve_threaded, args=(inbound.sock,), daemon=True).start()
        return False
    if mode != SHARED:
        raise OSError(f"unknown raw-test mode {mode!r}")
    return True


def _serve_threaded(conn: socket.socket) -> None:
    destination = memoryview(bytearray(0))
    head = memoryview(bytearray(_LENGTH.size))
    with conn:
        try:
            conn.recv(1)  # the mode byte
            while True:
                _recv_exact(conn, head)
                total = _LENGTH.unpack(head)[0]
                if len(destination) != total:
                    destination = memoryview(bytearray(total))
                got = 0
                while got < total:
                    n = conn.recv_into(destination[got : got + BLOCK_BYTES])
                    if n == 0:
                        return
                    got += n
                conn.sendall(_LENGTH.pack(total))
        except OSError:
            return


class RawClient:
    """N connected raw-test streams of one mode; send(data) splits the buffer evenly across them."""

    def __init__(
        self, host: str, port: int, streams: int, mode: RawMode = "threaded", congestion: str | None = "bbr"
    ) -> None:
        self.mode = mode
        self.socks = [socket.create_connection((host, port)) for _ in range(streams)]
        for sock in self.socks:
            tune(sock, congestion=congestion)
            sock.sendall(_MODE_BYTES[mode])
        self._pool = ThreadPoolExecutor(max_workers=streams) if mode == "threaded" else None
        self.received: list[int] = []  # what the receiver acknowledged, per stream, last transfer

    def _send_one(self, sock: socket.socket, share: memoryview) -> int:
        sock.sendall(_LENGTH.pack(len(share)))
        for start in range(0, len(share), BLOCK_BYTES):
            sock.sendall(share[start : start + BLOCK_BYTES])
        ack = memoryview(bytearray(_LENGTH.size))
        _recv_exact(sock, ack)
        return _LENGTH.unpack(ack)[0]

    def _send_shared(self, shares: list[memoryview]) -> list[int]:
        socks = self.socks[: len(shares)]
        sent = dict.fromkeys(socks, 0)
        acks = {sock: memoryview(bytearray(_LENGTH.size)) for sock in socks}
        got = dict.fromkeys(socks, 0)
        with selectors.DefaultSelector() as selector:
            for sock, share in zip(socks, shares, strict=True):
                sock.sendall(_LENGTH.pack(len(share)))
                sock.setblocking(False)
                # The share goes in a list: selectors compares data on modify, and comparing two
                # memoryviews reads them whole.
                selector.register(sock, selectors.EVENT_WRITE, [share])
            try:
                while selector.get_map():
                    for key, events in selector.select():
                        sock, (share,) = key.fileobj, key.data
                        assert isinstance(sock, socket.socket)
                        if events & selectors.EVENT_WRITE:
                            start = sent[sock]
                            sent[sock] += sock.send(share[start : start + BLOCK_BYTES])
                            if sent[sock] == len(share):
                                selector.modify(sock, selectors.EVENT_READ, key.data)
                            continue
                        n = sock.recv_into(acks[sock][got[sock] :])
                        if n == 0:
                            raise ConnectionError("raw peer closed early")
                        got[sock] += n
                        if got[sock] == _LENGTH.size:
                            selector.unregister(sock)
            finally:
                for sock in socks:
                    sock.setblocking(True)
        return [_LENGTH.unpack(acks[sock])[0] for sock in socks]

    def send(self, data: memoryview) -> float:
        """Seconds to move data (the same buffer the fragment test sends), from the first write
        to the last acknowledgement."""
        step = -(-len(data) // len(self.socks))
        shares = [data[i : i + step] for i in range(0, len(data), step)]
        start = time.perf_counter()
        if self._pool is not None:
            self.received = list(self._pool.map(self._send_one, self.socks[: len(shares)], shares))
        else:
            self.received = self._send_shared(shares)
        seconds = time.perf_counter() - start
        if sum(self.received) != len(data):
            raise ConnectionError(f"raw receiver acknowledged {sum(self.received)} of {len(data)} bytes")
        return seconds

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        if self._pool is not None:
            self._pool.shutdown()
