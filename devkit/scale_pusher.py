"""A scripted learner for bench/scale.py, a process of its own: it joins the syncer with the scale
model's parameter list, heals (receives every fragment), reports a step every --step-s, answers
every fragment request at once with a push of a constant outer gradient, and drops every update it
receives. It holds no
model: its memory is one anchor per fragment size and the link's pool of push and update
buffers. To the syncer it is a learner like any other (the same Link, the same protocol), so M of
them load its merges, its sends and its event loop as M learners would.

    python -m devkit.scale_pusher --syncer 127.0.0.1:7070 --id p0 --layers 15
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

import torch

from dilocod.examples.scale import TOKENS_PER_STEP, build
from dilocod.learner.bridge import Adopt, Bridge, Snapshot, StepReportItem
from dilocod.learner.link import Link, LinkConfig
from dilocod.model.params import model_entries
from dilocod.ops.logging import configure_logging
from dilocod.wire.manifest import fragment_manifest
from dilocod.wire.messages import FragmentRequest, Plan

#: Every element of a push's outer gradient (anchor - theta): about what the scale entry's nudges
#: give a real learner's fragments over a round.
DELTA = 1e-4


class ScriptedSide(Bridge):
    """The training side of a learner, played by the network loop itself: no model, no steps run."""

    def __init__(self) -> None:
        super().__init__()
        self.plan: Plan | None = None
        self.versions: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.anchors: dict[int, bytearray] = {}
        self.step = 0
        self.pushed_at: dict[int, int] = {}

    def post_plan(self, plan: Plan) -> None:
        self.plan = plan
        self.versions = dict(enumerate(plan.versions))
        shapes = {e.name: e.shape for e in plan.model}
        self.sizes = {i: fragment_manifest(pieces, shapes)[1] for i, pieces in enumerate(plan.fragments)}

    def post_update(self, adopt: Adopt) -> None:
        self.versions[adopt.fragment] = max(self.versions.get(adopt.fragment, 0), adopt.version)
        self._drop_update(adopt)  # nothing applies it: its buffer goes back to the pool at once

    def post_request(self, request: FragmentRequest) -> None:
        size = self.sizes.get(request.fragment)
        if size is None:
            return
        anchor = self._anchor(size)
        # The push computes its outer gradient in place, over theta: a pool buffer, filled anew.
        theta = self.snapshot_buffer(size)
        torch.frombuffer(theta, dtype=torch.float32).fill_(-DELTA)
        steps = max(1, self.step - self.pushed_at.get(request.fragment, 0))
        self.pushed_at[request.fragment] = self.step
        self.send_snapshot(
            Snapshot(
                request.fragment,
                request.round,
                self.versions.get(request.fragment, 0),
                steps,
                steps * TOKENS_PER_STEP,
                theta,
                anchor,
                step=self.step,
                apply_late=0,
            )
        )

    def post_fatal(self, message: str) -> None:
        raise SystemExit(f"scale pusher: {message}")

    def _anchor(self, size: int) -> bytearray:
        anchor = self.anchors.get(size)
        if anchor is None:
            anchor = self.anchors[size] = bytearray(size)
        return anchor

    def tick(self, step_s: float) -> None:
        self.step += 1
        self.report_step(StepReportItem(self.step, TOKENS_PER_STEP, step_s))


async def run(args: argparse.Namespace) -> None:
    host, _, port = args.syncer.rpartition(":")
    model = build(args.layers, 0, "meta")
    side = ScriptedSide()
    link = Link(
        LinkConfig(host, int(port), args.id, None, streams="auto", codec="none"),
        model_entries(model),
        side,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    async def steps() -> None:
        while not stop.is_set():
            await asyncio.sleep(args.step_s)  # the scripted step: this is its duration, not a wait
            if side.plan is not None and link.stats.connected:
                side.tick(args.step_s)

    async with asyncio.TaskGroup() as tasks:
        ticker = tasks.create_task(steps())
        await link.run(stop)
        ticker.cancel()


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--syncer", required=True, help="HOST:PORT")
    parser.add_argument("--id", required=True)
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--step-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    configure_logging(json=True, level="warning")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
