"""dilocod.learner.health: a step that runs for the whole limit is unhealthy, a finished or failed
one clears, and the STATUS line says what an operator looks for. Time is a clock the test sets."""

from __future__ import annotations

import pytest

from dilocod.learner.health import StepWatch, status_line


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_only_a_step_running_for_the_whole_limit_is_unhealthy() -> None:
    clock = Clock()
    watch = StepWatch(clock)
    seen: list[tuple[float, bool]] = []

    def step(index: int) -> int:
        for elapsed_s in (0.0, 9.9, 10.0, 60.0):
            clock.now_s = 100.0 + elapsed_s
            seen.append((watch.busy_for_s(), watch.healthy(limit_s=10.0)))
        return index + 1

    watched = watch.watch(step)
    assert watch.healthy(limit_s=10.0) and watch.busy_for_s() == 0.0
    assert watched(4) == 5
    assert [busy for busy, _ in seen] == pytest.approx([0.0, 9.9, 10.0, 60.0])
    assert [healthy for _, healthy in seen] == [True, True, False, False]
    # Between steps, however long since the last one (a wait for the syncer, a save): healthy.
    clock.now_s += 1000.0
    assert watch.healthy(limit_s=10.0) and watch.busy_since is None


def test_a_step_that_raises_is_no_longer_in_progress() -> None:
    clock = Clock()
    watch = StepWatch(clock)

    def step(index: int) -> int:
        raise RuntimeError("CUDA error")

    with pytest.raises(RuntimeError, match="CUDA error"):
        watch.watch(step)(0)
    clock.now_s += 1000.0
    assert watch.healthy(limit_s=10.0)


def test_status_line() -> None:
    network = {"syncer": "connected", "last_round_s": 0.42, "sent_bytes": 10}
    assert status_line(1200, 3.14159, 2.5, network) == (
        "step 1200, 3.14 steps/s, loss 2.5000, syncer connected, last round 0.42 s"
    )
    assert status_line(0, None, None, {"syncer": "away", "last_round_s": None}) == "step 0, syncer away"
    assert status_line(7, 0.0, None, {}) == "step 7, 0.00 steps/s"
