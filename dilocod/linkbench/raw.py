"""The raw TCP ceiling: plain blocking sockets, sendall / recv_into with 4 MiB buffers, one
thread per stream. What any sender on this path can reach; dilocod's numbers are read against it.

The receiver lands the bytes in a destination as large as its share of the transfer (reused
between transfers), 4 MiB per recv_into, as any real receiver of a fragment must. Receiving into
one cache-resident 4 MiB buffer over and over would measure the cache, not the path.

Wire format of the raw test (not the dilocod protocol): the sender writes an 8-byte big-endian
length then that many bytes; the receiver answers one byte when it has them all.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from dilocod.transport.sockets import tune

BLOCK_BYTES = 4 * 1024 * 1024
_LENGTH = struct.Struct(">Q")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("raw peer closed early")
        got += n


def serve_raw(listener: socket.socket, stop: threading.Event) -> None:
    """Accept raw-test connections until stop is set; each is served by its own thread."""
    listener.settimeout(0.5)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()


def _serve_one(conn: socket.socket) -> None:
    destination = memoryview(bytearray(0))
    head = memoryview(bytearray(_LENGTH.size))
    with conn:
        tune(conn)
        try:
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
                conn.sendall(b"\x01")
        except (ConnectionError, OSError):
            return


class RawClient:
    """N connected raw-test streams; send(data) splits the buffer evenly across them."""

    def __init__(self, host: str, port: int, streams: int) -> None:
        self.socks = [socket.create_connection((host, port)) for _ in range(streams)]
        for sock in self.socks:
            tune(sock)
        self._pool = ThreadPoolExecutor(max_workers=streams)

    def _send_one(self, sock: socket.socket, share: memoryview) -> None:
        sock.sendall(_LENGTH.pack(len(share)))
        for start in range(0, len(share), BLOCK_BYTES):
            sock.sendall(share[start : start + BLOCK_BYTES])
        _recv_exact(sock, memoryview(bytearray(1)))

    def send(self, data: memoryview) -> float:
        """Seconds to move data (the same buffer the fragment test sends), from the first write
        to the last acknowledgement."""
        step = -(-len(data) // len(self.socks))
        shares = [data[i : i + step] for i in range(0, len(data), step)]
        start = time.perf_counter()
        list(self._pool.map(self._send_one, self.socks[: len(shares)], shares))
        return time.perf_counter() - start

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self._pool.shutdown()
