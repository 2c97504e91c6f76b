"""Both ends of the learner's process boundary (dilocod.learner.netproc, netchild) in one process: a
ChildBridge on its own event loop thread, as in the network process (without a Link), and the moves
the tests make on either side (an update received by the child, step boundaries on the training
side, snapshots drained by the child). Every wait has a deadline; none of it knows about a test."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from typing import Any

from dilocod.learner.arena import Arena
from dilocod.learner.bridge import Adopt, Inbox, Snapshot
from dilocod.learner.channel import Channel
from dilocod.learner.netchild import ChildBridge
from dilocod.learner.netproc import ProcessBridge

#: The longest any one wait here lasts.
DEADLINE_S = 10.0


class ChildOnThread:
    """A ChildBridge on its own event loop thread, as in the network process (without a Link)."""

    def __init__(self, sock: socket.socket, arena: Arena | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.bridge = ChildBridge(Channel(sock), arena)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self.bridge.start, self.loop, [])

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the child's loop; its result."""
        done = threading.Event()
        out = []

        def run() -> None:
            out.append(fn(*args))
            done.set()

        self.loop.call_soon_threadsafe(run)
        if not done.wait(DEADLINE_S):
            raise AssertionError(f"the child's loop did not run {fn!r} in time")
        return out[0]

    def forwarded(self) -> None:
        """Until what was posted has been forwarded: a forward due now runs on a later turn of the
        loop than the post, possibly after a callback queued behind the post."""
        for _ in range(100):
            if self.call(lambda: self.bridge._forward_handle is None):
                return
            threading.Event().wait(DEADLINE_S / 100)
        raise AssertionError("the child did not forward what was posted in time")

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(DEADLINE_S)


def receive_update(
    child: ChildOnThread, fragment: int, version: int, data: bytes, heal: bool = False
) -> memoryview:
    """What the Link does with an update: received into a buffer of the child's (the session's
    allocator), then posted; the buffer it landed in."""

    def run() -> memoryview:
        buffer = child.bridge.update_buffer(len(data))
        buffer[:] = data
        child.bridge.post_update(Adopt(fragment, version, buffer, heal, "inc"))
        return buffer

    return child.call(run)


def take_until(parent: ProcessBridge, predicate: Callable[[Inbox], object]) -> Inbox:
    """Step boundaries (take, then flush, as the runtime does) until predicate(inbox) holds."""
    for _ in range(100):
        parent.wait(DEADLINE_S / 100)
        inbox = parent.take()
        parent.flush()  # what the boundary gives back goes with its outbox
        if predicate(inbox):
            return inbox
    raise AssertionError("the child's messages did not arrive in time")


def drain_snapshots(child: ChildOnThread, count: int) -> list[Snapshot]:
    """The snapshots that reach the child, until there are `count` of them."""
    got: list[Snapshot] = []
    for _ in range(100):
        snapshots, _steps = child.call(child.bridge.drain)
        got += snapshots
        if len(got) >= count:
            return got
        threading.Event().wait(DEADLINE_S / 100)
    raise AssertionError(f"{count} snapshots did not reach the child in time (got {len(got)})")
