"""What the learner tells systemd about itself: whether the training thread is stuck inside one step
(the watchdog's second condition, after "the event loop runs"), and the one-line STATUS text.

The training thread writes one plain value (when the step it is in started; None between steps) and
the network thread's event loop reads it before each watchdog ping: a stale read costs at most one
ping interval. Steps are the part of the training loop that runs the user's code (forward, backward,
collectives inside an island, the data loader), where a hang is likely; the step boundary and the
waits of the runtime are dilocod's own code, bounded by deadlines. Must not import torch or
networking.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TypeVar

R = TypeVar("R")


class StepWatch:
    """Records when the current step started, so the event loop can tell a slow step from a hung one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: clock() when the step in progress started; None between steps. Written by the training
        #: thread only (one attribute store is atomic under the GIL).
        self.busy_since: float | None = None

    def watch(self, step: Callable[[int], R]) -> Callable[[int], R]:
        """`step` wrapped so that its start and end are recorded."""

        def watched(step_index: int) -> R:
            self.busy_since = self._clock()
            try:
                return step(step_index)
            finally:
                self.busy_since = None

        return watched

    def busy_for_s(self) -> float:
        """How long the step in progress has run; 0 between steps."""
        started = self.busy_since
        return 0.0 if started is None else max(0.0, self._clock() - started)

    def healthy(self, limit_s: float) -> bool:
        """False once one step has run for limit_s or longer (a hung step, not a slow one)."""
        return self.busy_for_s() < limit_s


def status_line(
    step: int, steps_per_s: float | None, loss: float | None, network: Mapping[str, object]
) -> str:
    """`systemctl status`'s one line: where training is and whether the syncer is reachable."""
    parts = [f"step {step}"]
    if steps_per_s is not None:
        parts.append(f"{steps_per_s:.2f} steps/s")
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if "syncer" in network:
        parts.append(f"syncer {network['syncer']}")
    latency = network.get("last_round_s")
    if latency is not None:
        parts.append(f"last round {latency} s")
    return ", ".join(parts)
