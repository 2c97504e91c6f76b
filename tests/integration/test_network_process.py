"""The learner's network process as the learner starts it (dilocod.learner.netproc: a real child
process, its Link dialling a real transport Server that plays the syncer's part of the protocol):
at fp32 it never loads torch (its memory map holds no torch library) and its push is, bit for bit,
dilocod.outer.pseudo_gradient of the anchor the child received and the θ the training side copied
in, infinities, signed zeros and subnormals included; at a lossy precision it loads torch for the
encoding and pushes what dilocod.model.precision encodes. Every wait has a deadline."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from dilocod.learner.bridge import Adopt, Snapshot
from dilocod.learner.link import LinkConfig
from dilocod.learner.netproc import encode_config, open_network_process
from dilocod.model.precision import encode, tensor_views
from dilocod.outer import pseudo_gradient
from dilocod.transport.endpoints import Server
from dilocod.transport.errors import SessionClosed
from dilocod.transport.session import FragmentReceived, Session
from dilocod.wire.manifest import ModelEntry, fragment_manifest
from dilocod.wire.messages import FragmentRequest, Join, Plan, PushHeader, UpdateHeader

DEADLINE_S = 60.0
ROWS, COLS = 257, 33  # 33,924 bytes: not a whole number of vector widths or chunks
MODEL = (ModelEntry("w", "float32", (ROWS, COLS)),)
PIECES = (("w", 0, ROWS),)
CHUNK_BYTES = 8192
ROUND, VERSION = 7, 3
NAN_EVERY = 101


def _values(seed: int, nan_at: int) -> bytes:
    """Float32 bytes over every binade, with infinities, signed zeros, subnormals and NaNs (every
    NAN_EVERY values from nan_at: in one operand only, as where both are NaN IEEE 754 leaves the
    result's payload open)."""
    rng = np.random.default_rng(seed)
    n = ROWS * COLS
    values = rng.standard_normal(n).astype(np.float32) * np.exp2(rng.integers(-140, 120, n)).astype(
        np.float32
    )
    bits = values.view(np.uint32)
    specials = np.array([0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x807FFFFF], np.uint32)
    places = rng.choice(n, n // 10, replace=False)
    bits[places] = rng.choice(specials, len(places))
    bits[nan_at::NAN_EVERY] = 0x7FC12345 + seed
    return bits.tobytes()


ANCHOR = _values(0, 0)
THETA = _values(1, NAN_EVERY // 2)


@dataclass
class ScriptedSyncer:
    """The syncer's side of one learner session: PLAN, the fragment as an update (the heal), a
    request for it, then the push that answers it."""

    pushes: concurrent.futures.Future[tuple[PushHeader, bytes]]

    async def __call__(self, session: Session) -> None:
        join = await session.recv()
        assert isinstance(join, Join) and join.model == MODEL
        await session.send(Plan("incarnation-1", MODEL, (PIECES,), (VERSION,), 4, 1, 1))
        manifest, raw_bytes = fragment_manifest(PIECES, {"w": (ROWS, COLS)})
        update = UpdateHeader(manifest, raw_bytes, "none", CHUNK_BYTES, fragment=0, version=VERSION)
        await session.send_fragment(update, bytearray(ANCHOR))
        await session.send(FragmentRequest(0, ROUND, VERSION))
        while True:
            item = await session.recv()
            if isinstance(item, FragmentReceived) and isinstance(item.header, PushHeader):
                self.pushes.set_result((item.header, bytes(item.buffer)))
                break
        with contextlib.suppress(SessionClosed):  # the session stays until the learner leaves
            while True:
                await session.recv()


@contextlib.contextmanager
def scripted_syncer() -> Iterator[tuple[int, concurrent.futures.Future[tuple[PushHeader, bytes]]]]:
    """The scripted syncer on an event loop of its own thread; its port and the push it gets."""
    pushes: concurrent.futures.Future[tuple[PushHeader, bytes]] = concurrent.futures.Future()
    port: concurrent.futures.Future[int] = concurrent.futures.Future()
    stop = threading.Event()

    async def serve() -> None:
        async with Server(ScriptedSyncer(pushes), server_id="syncer", secret=None) as server:
            port.set_result((await server.listen("127.0.0.1", 0))[1])
            await asyncio.to_thread(stop.wait)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield port.result(DEADLINE_S), pushes
    finally:
        stop.set()
        thread.join(DEADLINE_S)


def _torch_libraries(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "/torch/" in line})


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_network_process_pushes_without_torch_at_fp32(precision: str) -> None:
    with scripted_syncer() as (port, pushes):
        bridge, reader, side = open_network_process()
        link = LinkConfig("127.0.0.1", port, "learner-a", None, streams=1, codec="none", precision=precision)
        bridge.spawn(encode_config(link, MODEL, "", False), side)
        try:
            anchor: Adopt | None = None
            request: FragmentRequest | None = None
            loop = asyncio.new_event_loop()
            deadline = loop.time() + DEADLINE_S
            while anchor is None or request is None:  # the training side's boundaries
                assert loop.time() < deadline, "no update and request from the network process"
                bridge.wait(0.05)
                inbox = bridge.take()
                assert inbox.fatal is None, inbox.fatal
                anchor = next(iter(inbox.updates), anchor)
                request = next(iter(inbox.requests), request)
            loop.close()
            assert bytes(anchor.buffer) == ANCHOR  # received into the child's buffer, mapped here
            theta = bridge.snapshot_buffer(len(THETA))
            theta[:] = THETA
            bridge.send_snapshot(Snapshot(0, request.round, anchor.version, 1, 10, theta, anchor.buffer))
            header, pushed = pushes.result(DEADLINE_S)
            assert bridge.process is not None
            loaded = _torch_libraries(bridge.process.pid)
        finally:
            bridge.close()
            reader.sock.close()
    assert (header.fragment, header.round, header.base_version) == (0, ROUND, VERSION)
    delta = pseudo_gradient(
        [torch.frombuffer(bytearray(ANCHOR), dtype=torch.float32)],
        [torch.frombuffer(bytearray(THETA), dtype=torch.float32)],
    )[0]
    if precision == "fp32":
        assert loaded == []
        assert pushed == delta.numpy().tobytes()
    else:
        assert loaded, "a lossy precision encodes with torch: its libraries should be mapped"
        manifest = fragment_manifest(PIECES, {"w": (ROWS, COLS)})[0]
        residual = [torch.zeros(ROWS, COLS)]
        views = tensor_views(bytearray(delta.numpy().tobytes()), manifest)
        _, expected = encode(views, ["w"], precision, residual)
        assert pushed == bytes(expected)
