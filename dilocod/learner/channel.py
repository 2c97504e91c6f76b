"""How the learner's two processes talk (the training side, dilocod.learner.netproc; the network
side, dilocod.learner.netchild): datagrams on an AF_UNIX SOCK_SEQPACKET socket, and the memory
both map.

Every message is one small msgpack datagram, a note of dilocod.learner.ipc: a frozen dataclass
encoded by its to_wire and read back by a validating decoder (read_note), so that a note that is
not what its kind says is a NetworkProcessError naming the note and the field (this module reads
no field of a decoded map itself; Channel only frames them). A Channel never blocks: what the
socket cannot take now waits in it for the next send().

Fragment bytes never go through a socket, and are never copied between the processes: they sit in
memory both map. The side that writes a buffer lends it (Lender: memfd-backed, reused once given
back) and passes its descriptor once with SCM_RIGHTS, with the note that first names it; the other
side maps it once (Mapper), or, for a piece of the anchors' arena that both already map
(dilocod.learner.arena), only learns its offset.

Written by hand: multiprocessing's Connection is a pickled byte stream, and its descriptor passing
(multiprocessing.reduction.sendfds) is a send of its own, not part of a message.
"""

from __future__ import annotations

import array
import itertools
import mmap
import os
import socket
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack

from dilocod.learner.arena import Arena
from dilocod.learner.ipc import IpcError, NewBuffer, Note, note_from_wire

#: One datagram; large messages (a plan of a model with many tensors) travel in a lent buffer.
MAX_DATAGRAM_BYTES = 32 * 1024
#: Descriptors per datagram (the kernel's SCM_MAX_FD is 253).
MAX_FDS = 200
#: recvmsg's arguments, computed once: the flags are IntFlag members, whose arithmetic runs Python
#: code on every message at the training thread's boundary.
_CUT_SHORT = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)
_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


class NetworkProcessError(RuntimeError):
    """The network process is gone or spoke out of turn; the learner cannot sync without it."""


class PeerClosedError(NetworkProcessError):
    """The other process closed its end of the data socket (it stopped, or died)."""


def shared_memory(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A new memfd of `size` bytes (at least one) and this process's mapping of it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, max(size, 1))
    return fd, mmap.mmap(fd, max(size, 1))


class Lender:
    """Buffers this side writes and the other side maps: memfd-backed, reused once given back."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self._sizes: dict[int, int] = {}
        self._free: dict[int, list[int]] = {}
        self._ids = itertools.count(1)
        self.lent = 0

    def borrow(self, size: int) -> tuple[int, memoryview, int | None]:
        """(id, a writable view of `size` bytes, the descriptor to pass when the buffer is new)."""
        free = self._free.get(size)
        fd = None
        if free:
            bid = free.pop()
        else:
            bid = next(self._ids)
            fd, self._maps[bid] = shared_memory(f"dilocod-{bid}", size)
            self._sizes[bid] = size
        self.lent += 1
        return bid, memoryview(self._maps[bid])[:size], fd

    def give_back(self, bid: int) -> None:
        if bid not in self._sizes:
            raise NetworkProcessError(f"buffer {bid} given back, but it was never lent")
        self._free.setdefault(self._sizes[bid], []).append(bid)
        self.lent -= 1


class Mapper:
    """The other side's buffers, mapped once each by id, and the pieces it cut from the anchors'
    arena (this side's, when it has one)."""

    def __init__(self, arena: Arena | None = None) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self.arena = arena
        self._pieces: dict[int, memoryview] = {}

    def add(self, bid: int, fd: int, size: int) -> None:
        try:
            self._maps[bid] = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)

    def add_piece(self, bid: int, size: int, offset: int) -> None:
        """Buffer `bid` is the piece of the anchors' arena (ours, mapped already) at `offset`."""
        if self.arena is None:
            raise NetworkProcessError(f"buffer {bid} passed as a piece of an arena this side has not got")
        try:
            self._pieces[bid] = self.arena.view(offset, size)
        except ValueError as exc:
            raise NetworkProcessError(f"buffer {bid}: {exc}") from None

    def view(self, bid: int, size: int) -> memoryview:
        piece = self._pieces.get(bid)
        if piece is not None and len(piece) == size:
            return piece
        buffer = self._maps.get(bid)
        if buffer is None or len(buffer) < size:
            raise NetworkProcessError(f"buffer {bid} of {size} bytes was never passed")
        return memoryview(buffer)[:size]


class Channel:
    """One end of a SEQPACKET socket: messages out without ever blocking (what the socket cannot
    take now waits here for the next send()), messages in as they are there."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)
        self._out: deque[tuple[bytes, list[int]]] = deque()
        self._eof = False

    def queue(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        body = msgpack.packb(message, use_bin_type=True)
        if len(body) > MAX_DATAGRAM_BYTES:
            raise NetworkProcessError(f"a {message.get('k')} message of {len(body)} bytes does not fit")
        self._out.append((body, list(fds)))

    def send(self) -> bool:
        """Send what the socket takes now; True when nothing is left queued."""
        while self._out:
            body, fds = self._out[0]
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            try:
                self.sock.sendmsg([body], ancillary)
            except BlockingIOError:
                return False
            except OSError as exc:
                raise NetworkProcessError(f"the other process is gone: {exc}") from None
            for fd in fds:
                os.close(fd)  # the other side holds its own copy of the descriptor now
            self._out.popleft()
        return True

    def receive(self) -> list[tuple[dict[str, Any], list[int]]]:
        """Every message the socket holds now, with the descriptors that came with it."""
        out: list[tuple[dict[str, Any], list[int]]] = []
        if self._eof:
            raise PeerClosedError("the other process closed its end")
        reset = False
        while True:
            try:
                body, ancillary, flags, _ = self.sock.recvmsg(MAX_DATAGRAM_BYTES, _ANCILLARY_BYTES)
            except BlockingIOError:
                return out
            except ConnectionResetError:
                # The other end closed with datagrams of ours unread in its queue, as a routine stop
                # does (the training side closes after its last boundary, whatever the child sent
                # since). The kernel reports that once, before what the other end sent us: read on,
                # to those datagrams and then the end (EOF).
                if reset:
                    raise PeerClosedError("the other process closed its end") from None
                reset = True
                continue
            except OSError as exc:
                raise NetworkProcessError(f"the other process is gone: {exc}") from None
            if not body:
                self._eof = True  # what came before the end is handed out first
                if out:
                    return out
                raise PeerClosedError("the other process closed its end")
            fds: list[int] = []
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
            if flags & _CUT_SHORT:
                for fd in fds:
                    os.close(fd)
                raise NetworkProcessError("a message from the other process was cut short")
            try:
                message = msgpack.unpackb(body, raw=False, strict_map_key=True)
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
                raise NetworkProcessError(f"an unreadable message from the other process: {exc}") from None
            if not isinstance(message, dict):  # what kind of note it is, dilocod.learner.ipc reads
                raise NetworkProcessError("a message from the other process that is not a map")
            out.append((message, fds))


def read_note(raw: dict[str, Any], fds: list[int], mapper: Mapper, sender: str) -> Note:
    """A message as its note (dilocod.learner.ipc), the buffers it introduces mapped; one that is
    not what its kind says is a NetworkProcessError naming the note and the field, and the
    descriptors that came with it are closed."""
    try:
        note = note_from_wire(raw)
    except IpcError as exc:
        for fd in fds:
            os.close(fd)
        raise NetworkProcessError(f"{sender}: {exc}") from None
    _take_fds(note.new, fds, mapper)
    return note


def _take_fds(new: Sequence[NewBuffer], fds: list[int], mapper: Mapper) -> None:
    """Map the buffers a note introduces: one descriptor each, in order, but for the pieces of the
    anchors' arena (an offset), which need none."""
    owned = [buffer for buffer in new if buffer.offset is None]
    if len(owned) != len(fds):
        for fd in fds:
            os.close(fd)
        raise NetworkProcessError(f"{len(new)} new buffers announced, {len(fds)} descriptors passed")
    for buffer, fd in zip(owned, fds, strict=True):
        mapper.add(buffer.buffer, fd, buffer.size)
    for buffer in new:
        if buffer.offset is not None:
            mapper.add_piece(buffer.buffer, buffer.size, buffer.offset)


# ----------------------------------------------------------------------------- the parent's side
