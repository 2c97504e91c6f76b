"""A syncer checkpoint of a large model against the disk's own write rate, with merges going on.

Builds the syncer's GlobalModel of N x Linear(4096, 4096, bias=False) (N = 15: 252M parameters,
Θ and b 1.0 GB each), then:
1. the disk: the same number of bytes (both files) written with a plain loop and fsync'd, in the
   same directory (what `dd conv=fsync` measures);
2. SyncerService.checkpoint() while a driver keeps merging fragments round-robin in the service's
   merge worker (real GlobalModel.merge), each merge's start and end time-stamped: the merges that
   ran inside the checkpoint's interval, and the longest a merge waited for the worker;
3. with --old, the same under the previous scheme (save_checkpoint of model.state() as one job in
   the merge worker), for comparison.

    python bench/checkpoint_write.py --layers 15 --dir /var/tmp

Measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dilocod.config import SyncerConfig
from dilocod.learner.layout import model_entries
from dilocod.outer import plan_fragments
from dilocod.syncer.checkpoint import SyncerState, save_checkpoint
from dilocod.syncer.model import GlobalModel
from dilocod.syncer.rounds import RoundConfig, Rounds
from dilocod.syncer.service import SyncerService

SLICE = 64 << 20


def disk_rate(directory: Path, nbytes: int) -> float:
    """Seconds to write nbytes to a new file in directory and fsync it (then delete it)."""
    block = bytearray(os.urandom(1 << 20)) * (SLICE >> 20)
    path = directory / "disk-rate.bin"
    started = time.perf_counter()
    with open(path, "wb") as f:
        done = 0
        while done < nbytes:
            done += f.write(memoryview(block)[: min(SLICE, nbytes - done)])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def build(layers: int, fragments: int) -> GlobalModel:
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers)])
    specs = model_entries(module)
    plan = plan_fragments([(s.name, s.shape) for s in specs], fragments)
    model = GlobalModel(plan, specs, chunk_bytes=1 << 20, embedding_pattern="*embed*")
    model.load(dict(module.named_parameters()))
    del module
    model.publish_all()
    return model


async def run(
    service: SyncerService, old: bool, merges_on: bool
) -> tuple[float, float, list[tuple[float, float, float]]]:
    """One checkpoint with merges going on: (start, end, [(queued, began, ended) per merge])."""
    model, loop = service.model, asyncio.get_running_loop()
    pushes = {s.index: bytearray(s.raw_bytes) for s in model.fragments}
    merges: list[tuple[float, float, float]] = []
    done = asyncio.Event()

    def merge(index: int, queued: float) -> None:
        began = time.perf_counter()
        store = model.fragments[index]
        snapshot = model.merge(
            index,
            [pushes[index]],
            [1.0],
            lr=0.7,
            mu=0.9,
            merge="mean",
            target=model.spare_buffer(index),
            version=store.version + 1,
        )
        store.spare.append(snapshot.buffer)
        merges.append((queued, began, time.perf_counter()))

    async def merging() -> None:
        index = 0
        while merges_on and not done.is_set():
            await loop.run_in_executor(service._executor, merge, index, time.perf_counter())
            index = (index + 1) % len(model.fragments)

    def old_save() -> None:
        params, momentum = model.state()
        save_checkpoint(service.state_dir, SyncerState(params, momentum, model.versions, {}))

    driver = asyncio.create_task(merging())
    await asyncio.sleep(1.0)  # merges under way before the checkpoint starts
    started = time.perf_counter()
    if old:
        await loop.run_in_executor(service._executor, old_save)
    else:
        await service.checkpoint()
    ended = time.perf_counter()
    await asyncio.sleep(0.5)
    done.set()
    await driver
    return started, ended, merges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--fragments", type=int, default=24)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--old", action="store_true", help="also time the previous scheme")
    parser.add_argument("--no-merges", action="store_true", help="checkpoints alone, no merges meanwhile")
    args = parser.parse_args()
    model = build(args.layers, args.fragments)
    nbytes = 2 * sum(s.raw_bytes for s in model.fragments)
    with tempfile.TemporaryDirectory(prefix="dilocod-ckpt-", dir=args.dir) as tmp:
        work = Path(tmp)
        disk_s = disk_rate(work, nbytes)
        print(f"{len(model.fragments)} fragments, Θ + b = {nbytes / 1e9:.2f} GB")
        rate = nbytes / disk_s / 1e9
        print(f"disk: write + fsync of {nbytes / 1e9:.2f} GB: {disk_s:.2f} s ({rate:.2f} GB/s)")
        for old in [False, True] if args.old else [False]:
            state_dir = work / ("old" if old else "new")
            service = SyncerService(
                SyncerConfig(),
                model,
                Rounds(RoundConfig(fragments=len(model.fragments), sync_every=1_000_000)),
                state_dir=state_dir,
                incarnation="bench",
                secret=None,
                meta={},
            )
            try:
                started, ended, merges = asyncio.run(run(service, old, not args.no_merges))
            finally:
                service._checkpointer.shutdown(wait=True)
                service._executor.shutdown(wait=True)
                service._screener.shutdown(wait=True)
            inside = [m for m in merges if started <= m[2] <= ended]
            waits = [m[1] - m[0] for m in merges if m[0] <= ended and m[1] >= started]
            seconds = ended - started
            name = "previous (one job in the merge worker)" if old else "fragment by fragment"
            print(
                f"checkpoint, {name}: {seconds:.2f} s ({nbytes / seconds / 1e9:.2f} GB/s, "
                f"{seconds / disk_s:.2f}x the disk's time); merges ended inside it: {len(inside)}; "
                f"longest wait for the merge worker meanwhile: {max(waits, default=0.0):.3f} s; "
                f"merges meanwhile: {len(merges)}"
            )
            for _queued, began, end in inside[:3]:
                print(f"  merge inside: began {began - started:+.3f} s, ended {end - started:+.3f} s")
            shutil.rmtree(state_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
