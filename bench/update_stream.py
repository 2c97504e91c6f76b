"""The transport alone on a heal's shape: a Server sends K updates of 67 MB (codec none, prepared
checksums) to a client Session in another process, one at a time, and times them from the first
header to the last acknowledgement. The client lands them in fresh buffers (as a learner healing
does) or in reused ones (--reuse).

    python bench/update_stream.py            # fresh receive buffers
    python bench/update_stream.py --reuse

Measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from dilocod.transport.endpoints import Server, connect
from dilocod.transport.options import TransportOptions
from dilocod.transport.session import FragmentReceived, Session
from dilocod.wire.codecs import chunk_checksums
from dilocod.wire.manifest import pack_manifest
from dilocod.wire.messages import StatusRequest, UpdateHeader
from dilocod.wire.stream import StreamHeader

FRAGMENT_BYTES = 67 << 20
CHUNK_BYTES = 1 << 20


async def serve(count: int) -> None:
    data = bytearray(os.urandom(CHUNK_BYTES)) * (FRAGMENT_BYTES // CHUNK_BYTES)
    checksums = chunk_checksums(data, CHUNK_BYTES)
    manifest, raw_bytes = pack_manifest([("w", "float32", [FRAGMENT_BYTES // 4])])
    done = asyncio.Event()

    async def handle(session: Session) -> None:
        await session.recv()  # the client's hello
        started = time.perf_counter()
        for index in range(count):
            header = UpdateHeader(tuple(manifest), raw_bytes, "none", CHUNK_BYTES, fragment=index, version=0)
            await session.send_fragment(header, data, checksums=checksums)
        seconds = time.perf_counter() - started
        gbit_s = count * FRAGMENT_BYTES * 8 / seconds / 1e9
        print(f"{count} x {FRAGMENT_BYTES >> 20} MiB in {seconds:.3f} s: {gbit_s:.2f} Gbit/s")
        done.set()

    async with Server(handle, server_id="bench", secret=None, options=TransportOptions()) as server:
        _, port = await server.listen("127.0.0.1", 0)
        print(port, flush=True)
        await done.wait()


async def receive(port: int, count: int, streams: int, reuse: bool) -> None:
    pool: list[bytearray] = []
    kept: list[memoryview] = []

    def allocate(header: StreamHeader) -> memoryview:
        return memoryview(pool.pop() if pool else bytearray(header.raw_bytes))

    session = await connect("127.0.0.1", port, peer_id="bench", streams=streams, options=TransportOptions())
    session.set_allocator(allocate)
    await session.send(StatusRequest())
    for _ in range(count):
        item = await session.recv()
        while not isinstance(item, FragmentReceived):
            item = await session.recv()
        if reuse and isinstance(item.buffer.obj, bytearray):
            pool.append(item.buffer.obj)
        else:
            kept.append(item.buffer)  # a heal keeps every fragment
    await session.close("done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=15)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--reuse", action="store_true")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.count))
        return
    if args.port is not None:
        asyncio.run(receive(args.port, args.count, args.streams, args.reuse))
        return
    command = [sys.executable, __file__, "--count", str(args.count)]
    server = subprocess.Popen([*command, "--serve"], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = server.stdout.readline().strip()
    flags = ["--streams", str(args.streams), *(["--reuse"] if args.reuse else [])]
    subprocess.run([*command, "--port", port, *flags], check=True)
    print(server.stdout.read().strip())
    server.wait(timeout=60)


if __name__ == "__main__":
    main()
