"""The raw TCP ceiling: plain blocking sockets, sendall / recv_into with 4 MiB buffers, one
thread per stream. What any sender on this path can reach; dilocod's numbers are read against it.

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
    buffer = memoryview(bytearray(BLOCK_BYTES))
    head = memoryview(bytearray(_LENGTH.size))
    with conn:
        tune(conn)
        try:
            while True:
                _recv_exact(conn, head)
                remaining = _LENGTH.unpack(head)[0]
                while remaining:
                    n = conn.recv_into(buffer[: min(remaining, BLOCK_BYTES)])
                    if n == 0:
                        return
                    remaining -= n
                conn.sendall(b"\x01")
        except (ConnectionError, OSError):
            return


class RawClient:
    """N connected raw-test streams; send(total) splits total bytes evenly across them."""

    def __init__(self, host: str, port: int, streams: int) -> None:
        self.socks = [socket.create_connection((host, port)) for _ in range(streams)]
        for sock in self.socks:
            tune(sock)
        self._block = memoryview(bytearray(BLOCK_BYTES))
        self._pool = ThreadPoolExecutor(max_workers=streams)

    def _send_one(self, sock: socket.socket, nbytes: int) -> None:
        sock.sendall(_LENGTH.pack(nbytes))
        remaining = nbytes
        while remaining:
            n = min(remaining, BLOCK_BYTES)
            sock.sendall(self._block[:n])
            remaining -= n
        _recv_exact(sock, memoryview(bytearray(1)))

    def send(self, total_bytes: int) -> float:
        """Seconds to move total_bytes, from first write to the last acknowledgement."""
        share = -(-total_bytes // len(self.socks))
        start = time.perf_counter()
        list(self._pool.map(self._send_one, self.socks, [share] * len(self.socks)))
        return time.perf_counter() - start

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self._pool.shutdown()
