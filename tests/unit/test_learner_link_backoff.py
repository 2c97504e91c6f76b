"""The Link's reconnect backoff: capped, exponential, jittered, and started over after a session
that joined, so that a learner whose link breaks now and then comes back within a second each
time instead of waiting up to backoff_max_s (found by tests/chaos: a learner stayed away 28 s after
its seventh cut). No network: the Link's session is a scripted stand-in."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from dilocod.learner.bridge import Bridge
from dilocod.learner.link import Link, LinkConfig


def _attempts(script: list[str], monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Run the Link through `script` ("joined": a session that joined, then broke; "refused": a
    dial that failed) and return the attempt number of each retry."""
    link = Link(
        LinkConfig(
            "127.0.0.1", 7070, "a", None, streams=1, codec="none", backoff_min_s=1e-4, backoff_max_s=1e-3
        ),
        (),
        Bridge(),
    )
    steps = iter(script)
    stop = asyncio.Event()

    async def one_session(_: asyncio.Event) -> None:
        step = next(steps, None)
        if step is None:
            stop.set()
            return
        if step == "joined":
            link.stats.joins += 1
        raise ConnectionError(step)

    monkeypatch.setattr(link, "_one_session", one_session)
    with capture_logs() as logs:
        asyncio.run(link.run(stop))
    return [entry["attempt"] for entry in logs if entry["event"] == "syncer unreachable"]


def test_failed_dials_back_off_further_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _attempts(["refused"] * 4, monkeypatch) == [0, 1, 2, 3]


def test_a_session_that_joined_starts_the_backoff_over(monkeypatch: pytest.MonkeyPatch) -> None:
    script = ["joined", "refused", "refused", "joined", "refused", "joined", "joined"]
    assert _attempts(script, monkeypatch) == [0, 1, 2, 0, 1, 0, 0]
