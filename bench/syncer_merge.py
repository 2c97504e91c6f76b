"""One syncer merge against the fused bound: GlobalModel.merge of M pushes into a fragment, against
dilocod.outer.outer_step_ alone in place on tensors of the same size (what bench/outer_merge.py
calls "merge": the fused RDA + Nesterov step, consume_deltas=True).

GlobalModel.merge does more than the step: it steps from Θ_p and b_p into two pool buffers (new
buffers on merge, see dilocod/syncer/model.py), sums their squared norms on the way (the commit
check and the screen's scale) and hashes the result for sending. Both take turns within each
repetition, on buffers taken once (as the syncer's pool keeps them), each after a read of a large
buffer that evicts the caches; best and median of the repetitions are reported.

Run from the repository root: ``python bench/syncer_merge.py [--mb 67] [--pushes 2] [--reps 9]``.
Measures and records; asserts nothing. Must not be imported by dilocod.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dilocod.model.plan import plan_fragments
from dilocod.outer import outer_step_
from dilocod.syncer.model import GlobalModel
from dilocod.wire.manifest import ModelEntry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=67.108864, help="fragment size, decimal MB")
    parser.add_argument("--pushes", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--flush-mb", type=int, default=512)
    args = parser.parse_args()
    numel = int(args.mb * 1e6 / 4)
    specs = [ModelEntry("w", "float32", (numel,))]
    model = GlobalModel(
        plan_fragments([("w", (numel,))], 1), specs, chunk_bytes=1 << 20, embedding_pattern="-"
    )
    model.load({"w": torch.randn(numel)})
    model.publish_all()
    model.buffers.max_idle = args.pushes + 2
    size = model.fragments[0].raw_bytes
    pushes = [model.buffers.take(size) for _ in range(args.pushes)]
    params, momentum = torch.randn(numel), torch.zeros(numel)
    deltas = [torch.empty(numel) for _ in range(args.pushes)]
    flush = torch.ones(args.flush_mb * 250_000)
    times: dict[str, list[float]] = {"syncer merge": [], "fused step": []}
    for rep in range(args.reps):
        for push in pushes:
            model.deltas(0, push)[0].normal_(0, 1e-3)
        flush.sum()
        started = time.perf_counter()
        snapshot = model.merge(0, pushes, [1.0] * args.pushes, lr=0.7, mu=0.9, merge="rda", version=rep + 1)
        times["syncer merge"].append(time.perf_counter() - started)
        model.publish(0, snapshot)
        for delta in deltas:
            delta.normal_(0, 1e-3)
        flush.sum()
        started = time.perf_counter()
        outer_step_(
            [params], [momentum], [[d] for d in deltas], [1.0] * args.pushes, 0.7, 0.9, consume_deltas=True
        )
        times["fused step"].append(time.perf_counter() - started)
    result = {
        "fragment_bytes": size,
        "pushes": args.pushes,
        "threads": torch.get_num_threads(),
        "buffers_created": model.buffers.created,
        "seconds": {
            name: {"best": round(min(t), 4), "median": round(statistics.median(t), 4)}
            for name, t in times.items()
        },
    }
    result["merge_vs_fused_best"] = round(min(times["syncer merge"]) / min(times["fused step"]), 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
