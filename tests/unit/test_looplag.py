"""ops.figures.quantiles and ops.looplag.LoopLag: the figures status and progress lines give."""

from __future__ import annotations

import asyncio
import time

from dilocod.ops.figures import quantiles
from dilocod.ops.looplag import LoopLag


def test_quantiles_of_nothing_are_zeros() -> None:
    assert quantiles([]) == {"p50": 0, "p99": 0, "max": 0}


def test_quantiles_pick_ranks_and_keep_integers() -> None:
    figures = quantiles(list(range(100, 0, -1)))
    assert figures == {"p50": 51, "p99": 100, "max": 100}
    assert all(type(v) is int for v in figures.values())
    assert quantiles([0.12345, 2.5]) == {"p50": 2.5, "p99": 2.5, "max": 2.5}


def test_a_blocked_loop_shows_in_the_published_lag() -> None:
    async def scenario() -> dict[str, float]:
        lag = LoopLag(interval_s=0.01, samples=100)
        seen = asyncio.Event()
        published: list[dict[str, float]] = []

        def publish(figures: dict[str, float]) -> None:
            published.append(figures)
            if figures["max"] >= 80.0:
                seen.set()

        task = asyncio.ensure_future(lag.watch(publish, every=2))
        # The fault: a callback that holds the loop for 100 ms while the watcher sleeps.
        asyncio.get_running_loop().call_soon(time.sleep, 0.1)
        async with asyncio.timeout(20.0):
            await seen.wait()
        task.cancel()
        return published[-1]

    figures = asyncio.run(scenario())
    assert figures["max"] >= 80.0
    assert figures["p50"] <= figures["max"]


def test_a_stall_is_told_as_it_happens_and_a_short_wait_is_not() -> None:
    async def scenario() -> list[float]:
        stalls: list[float] = []
        told = asyncio.Event()

        def on_stall(lag_ms: float) -> None:
            stalls.append(lag_ms)
            told.set()

        lag = LoopLag(interval_s=0.01, samples=100, stall_ms=60.0, on_stall=on_stall)
        task = asyncio.ensure_future(lag.watch())
        loop = asyncio.get_running_loop()
        loop.call_soon(time.sleep, 0.02)  # held 20 ms: under the threshold
        loop.call_later(0.1, time.sleep, 0.1)  # held 100 ms: a stall
        async with asyncio.timeout(20.0):
            await told.wait()
        task.cancel()
        return stalls

    stalls = asyncio.run(scenario())
    # Only wakes past the threshold are told (the 20 ms hold is not, unless the host delayed it
    # past 60 ms itself); the 100 ms hold is, at 90 ms late or more.
    assert stalls and all(lag_ms > 60.0 for lag_ms in stalls) and max(stalls) >= 90.0
