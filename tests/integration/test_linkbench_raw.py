"""The raw TCP ceiling of the benchmarks, on real loopback sockets: both shapes (a thread per
stream, one thread for all) move every byte of uneven shares and are acknowledged per stream, one
receiver serves both shapes at once, and a connection with an unknown mode byte is closed without
disturbing the others."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from dilocod.linkbench.raw import RawClient, RawMode, serve_raw

SIZE = 9 * 1024 * 1024 + 5  # not a multiple of the stream count nor of the 4 MiB block


@pytest.fixture
def raw_port() -> Iterator[int]:
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    thread = threading.Thread(target=serve_raw, args=(listener, stop), daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=10)
        listener.close()
    assert not thread.is_alive()


@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("mode", ["threaded", "shared"])
def test_every_byte_is_acknowledged(raw_port: int, mode: RawMode, streams: int) -> None:
    data = memoryview(bytearray(SIZE))
    client = RawClient("127.0.0.1", raw_port, streams, mode)
    try:
        for _ in range(2):  # the second transfer reuses the receiver's destinations
            assert client.send(data) > 0
            assert len(client.received) == streams
            assert sum(client.received) == SIZE
            assert max(client.received) - min(client.received) <= streams
    finally:
        client.close()


def test_both_shapes_at_once_and_a_bad_mode_byte(raw_port: int) -> None:
    data = memoryview(bytearray(SIZE))
    with socket.create_connection(("127.0.0.1", raw_port), timeout=10) as stranger:
        stranger.sendall(b"X" + bytes(8))
        # Closed unanswered: an orderly end of stream, or a reset since its bytes went unread.
        with contextlib.suppress(ConnectionResetError):
            assert stranger.recv(1) == b""
    threaded = RawClient("127.0.0.1", raw_port, 2, "threaded")
    shared = RawClient("127.0.0.1", raw_port, 2, "shared")
    try:
        shared.send(data)
        threaded.send(data)
        assert sum(shared.received) == sum(threaded.received) == SIZE
    finally:
        threaded.close()
        shared.close()
