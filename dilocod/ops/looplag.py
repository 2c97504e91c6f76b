"""Event-loop lag: how late a loop wakes up from a short sleep, sampled for as long as it runs.

What every session on that loop feels while something blocks it (a copy, an allocation, a GC
pause): the syncer's status and the learner's progress lines give its p50, p99 and max over the
last SAMPLES wakes (one minute), and a wake later than STALL_MS is told to on_stall as it happens
(the syncer logs it with what it had under way). Must not import torch, networking or logging.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from dilocod.ops.figures import quantiles

#: The loop is woken this often; the last SAMPLES wakes make the figures.
INTERVAL_S = 0.05
SAMPLES = 1200
#: A wake this late is a stall worth a line of its own (the syncer's goal is a max of 200 ms).
STALL_MS = 100.0


class LoopLag:
    """Run `watch()` as a task on the loop to measure; `figures()` from the same loop."""

    def __init__(
        self,
        interval_s: float = INTERVAL_S,
        samples: int = SAMPLES,
        *,
        stall_ms: float = STALL_MS,
        on_stall: Callable[[float], None] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.samples_ms: deque[float] = deque(maxlen=samples)
        self.stall_ms = stall_ms
        self.on_stall = on_stall

    async def watch(self, publish: Callable[[dict[str, float]], None] | None = None, every: int = 20) -> None:
        """Sample until cancelled; publish(figures()) every `every` samples when given (one
        second at the default interval), for statistics that are read as plain values."""
        loop = asyncio.get_running_loop()
        count = 0
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            lag_ms = max(0.0, (loop.time() - due) * 1e3)
            self.samples_ms.append(lag_ms)
            if lag_ms > self.stall_ms and self.on_stall is not None:
                self.on_stall(lag_ms)
            count += 1
            if publish is not None and count % every == 0:
                publish(self.figures())

    def figures(self) -> dict[str, float]:
        return quantiles(self.samples_ms)
