"""One short check of the learner's GPU path on a GPU host (at most about 5 minutes), printing one
JSON document (docs/design.md §3.8):

    python bench/gpu_check.py                 # 1.0B parameters, 30 steps alone, 60 with dilocod
    python bench/gpu_check.py --device cpu --layers 2 --width 512 --batch 64 --steps 6
                                              # a smoke run of the orchestration, anywhere

The model is `--layers` Linear(width, width) layers with GELU between (15 x 8192^2 = 1.0B parameters
at the defaults), trained with AdamW on a real forward and backward of `--batch` random rows
(TF32 matmuls): a few hundred ms per step on a current GPU.

1. alone: the entry's steps in this process, no dilocod: each step's time on the device (CUDA
   events at its start and end) and the training stream's gap between one step's end and the next
   one's start.
2. copies: in this process too, the learner's device path (dilocod.learner.device) on the model's
   24 fragments: a snapshot (the host's time to queue it, the staging copy's time on the training
   stream, the time until its copy has reached the host), an apply (the time until its copy to the
   device has landed, the apply's time on the training stream), and δ computed on the device.
3. dilocod: a syncer on this host's CPU and one learner on the GPU (the same entry; defaults, so
   24 fragments and H = 24: a snapshot and an apply at almost every boundary), once with
   --anchors host and once with --anchors device. The entry records the same two figures per step,
   written to a file the check reads at the end; the learner's and its network process's host
   memory is sampled throughout.

Reported: the device's time per step (end to end, the boundary included) with and without dilocod
and the overhead; the stream's gap per boundary (its wait: what the boundary's work cost the
training stream) against the same gap alone; the copy latencies; peak host RSS. Targets: overhead
<= 1 % at a step of >= 200 ms, training-stream wait per boundary <= 1 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
DILOCOD = [sys.executable, "-m", "dilocod"]
FRAGMENTS = 24
#: Where the entry writes its step figures (the learner's process), from the environment.
OUT_ENV = "DILOCOD_GPU_CHECK_OUT"
SIZE_ENV = "DILOCOD_GPU_CHECK_SIZE"  # "layers,width,batch"
SAMPLE_EVERY_S = 0.5


# ----------------------------------------------------------------------------- the entry


class Stack(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = nn.functional.gelu(layer(x))
        return x


def size_from_env() -> tuple[int, int, int]:
    layers, width, batch = (int(v) for v in os.environ.get(SIZE_ENV, "15,8192,8192").split(","))
    return layers, width, batch


class StepTimes:
    """Each step's time on the training stream and the stream's gap before it (CUDA events at the
    step's start and end, read once completed, never waited for), or the host's clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[Any, Any]] = []
        self._last_end: Any = None
        self.step_ms: list[float] = []
        self.gap_ms: list[float] = []
        self.period_ms: list[float] = []

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _between(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1000.0

    def timed(self, step: Callable[[int], Any]) -> Callable[[int], Any]:
        def run(index: int) -> Any:
            start = self._mark()
            result = step(index)
            self._pending.append((start, self._mark()))
            self._resolve()
            return result

        return run

    def _resolve(self, *, wait: bool = False) -> None:
        while self._pending:
            start, end = self._pending[0]
            if self.cuda and not wait and not end.query():
                return
            if self.cuda and wait:
                end.synchronize()
            self._pending.pop(0)
            self.step_ms.append(self._between(start, end))
            if self._last_end is not None:
                self.gap_ms.append(self._between(self._last_end, start))
                self.period_ms.append(self._between(self._last_end, end))
            self._last_end = end

    def figures(self, *, wait: bool = False) -> dict[str, list[float]]:
        self._resolve(wait=wait)
        return {"step_ms": self.step_ms, "gap_ms": self.gap_ms, "period_ms": self.period_ms}


def build(layers: int, width: int, device: str) -> Stack:
    with torch.device(device):
        return Stack(layers, width)


def make_trainer(ctx: Any) -> Any:
    """The entry (`--entry gpu_check:make_trainer`, bench/ on PYTHONPATH)."""
    from dilocod.contract import StepResult, Trainer

    layers, width, batch = size_from_env()
    device = torch.device(ctx.device)
    model = build(layers, width, str(device))
    if ctx.role == "syncer":
        return Trainer(model=model, optimizer=None, step=lambda i: StepResult(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = torch.Generator(device=device).manual_seed(ctx.seed)
    times = StepTimes(device)
    out = os.environ.get(OUT_ENV)

    def step(index: int) -> Any:
        x = torch.randn(batch, width, generator=generator, device=device)
        loss = (model(x) - x.roll(1, dims=1)).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return StepResult(tokens=batch, loss=None)  # never synchronises: the host runs ahead

    timed = times.timed(step)

    def recorded(index: int) -> Any:
        result = timed(index)
        if out and index % 5 == 4:
            path = Path(out)
            path.with_suffix(".tmp").write_text(json.dumps(times.figures()))
            path.with_suffix(".tmp").replace(path)
        return result

    return Trainer(model=model, optimizer=optimizer, step=recorded)


# ----------------------------------------------------------------------------- measuring


def quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "p50": round(statistics.median(ordered), 3),
        "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3),
        "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
        "max": round(ordered[-1], 3),
    }


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Entry:
    """The entry's context, as the learner would hand it."""

    def __init__(self, device: str, role: str = "learner") -> None:
        self.device, self.role, self.seed, self.rank = device, role, 0, 0


def alone(device: str, steps: int) -> dict[str, Any]:
    trainer = make_trainer(Entry(device))
    for index in range(3):  # warm: kernels chosen, allocator filled
        trainer.step(index)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    times = StepTimes(torch.device(device))
    step = times.timed(trainer.step)
    for index in range(steps):
        step(index)
    figures = times.figures(wait=True)
    return {
        "step_ms": quantiles(figures["step_ms"]),
        "period_ms": quantiles(figures["period_ms"]),
        "gap_ms": quantiles(figures["gap_ms"]),
        "host_rss_kib": rss_kib(os.getpid()),
        "trainer": trainer,
    }


def copies(model: nn.Module, device: str) -> dict[str, Any]:
    """The device path's copies on every fragment of the model's plan."""
    from dilocod.learner.buffers import mapped_buffer
    from dilocod.learner.device import copier_for
    from dilocod.learner.layout import layouts_for
    from dilocod.model.params import model_entries
    from dilocod.model.plan import plan_module
    from dilocod.wire.messages import Plan

    cuda = device.startswith("cuda")
    plan = plan_module(model, FRAGMENTS)
    fragments = tuple(tuple(f.pieces) for f in plan.fragments)
    layouts = layouts_for(
        Plan("check", model_entries(model), fragments, (0,) * len(fragments), 24, 2, 1), model
    )
    copier = copier_for(torch.device(device))
    buffers = {layout.raw_bytes: mapped_buffer(0, layout.raw_bytes) for layout in layouts}
    result: dict[str, list[float]] = {
        k: [] for k in ("queue_ms", "stream_ms", "to_host_ms", "landed_ms", "apply_ms")
    }
    result["delta_stream_ms"] = []

    def mark() -> Any:
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def between(a: Any, b: Any) -> float:
        if cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1000.0

    for rep in range(2):  # the first pins the buffers and makes the slots
        for layout in layouts:
            buffer = buffers[layout.raw_bytes]
            if cuda:
                torch.cuda.synchronize()
            started, before = time.perf_counter(), mark()
            _theta, ready = copier.copy_out(layout, lambda _n, b=buffer: b)
            queued, after = time.perf_counter(), mark()
            if ready is not None:
                ready.wait()
            landed = time.perf_counter()
            upload_started = time.perf_counter()
            upload = copier.prefetch(buffer)
            if upload is not None and upload.arrived is not None:
                upload.arrived.synchronize()
            upload_landed = time.perf_counter()
            apply_before = mark()
            staged = copier.stage(layout, buffer, upload)
            with torch.no_grad():
                for param, new in zip(layout.params, staged.views, strict=True):
                    param.copy_(new)
            apply_after = mark()
            # The update as the fragment's anchor (--anchors device), for δ on the device.
            anchor = staged.flat if staged.flat is not None else torch.frombuffer(buffer, dtype=torch.uint8)
            delta_before = mark()
            _delta, ready = copier.copy_out(layout, lambda _n, b=buffer: b, anchor=anchor)
            delta_after = mark()
            copier.done(staged)
            if ready is not None:
                ready.wait()
            if rep == 0:
                continue
            result["queue_ms"].append((queued - started) * 1000.0)
            result["stream_ms"].append(between(before, after))
            result["to_host_ms"].append((landed - started) * 1000.0)
            result["landed_ms"].append((upload_landed - upload_started) * 1000.0)
            result["apply_ms"].append(between(apply_before, apply_after))
            result["delta_stream_ms"].append(between(delta_before, delta_after))
        copier.settle()
    copier.close()
    largest = max(layout.raw_bytes for layout in layouts)
    return {
        "fragments": len(layouts),
        "largest_fragment_mb": round(largest / 1e6, 1),
        "snapshot": {
            "queue_on_host_ms": quantiles(result["queue_ms"]),
            "on_training_stream_ms": quantiles(result["stream_ms"]),
            "until_on_host_ms": quantiles(result["to_host_ms"]),
        },
        "apply": {
            "until_landed_ms": quantiles(result["landed_ms"]),
            "on_training_stream_ms": quantiles(result["apply_ms"]),
        },
        "delta_on_device": {"on_training_stream_ms": quantiles(result["delta_stream_ms"])},
    }


def with_dilocod(args: argparse.Namespace, work: Path, anchors: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        SIZE_ENV: f"{args.layers},{args.width},{args.batch}",
    }
    entry = ["--entry", "gpu_check:make_trainer"]
    syncer_log = work / f"syncer-{anchors}.log"
    syncer_cmd = [*DILOCOD, "syncer", *entry, "--listen", "127.0.0.1:0", "--insecure", "--ready-json"]
    syncer_cmd += ["--state-dir", str(work / f"s-{anchors}"), "--checkpoint-every-s", "3600"]
    syncer = subprocess.Popen(syncer_cmd, stdout=subprocess.PIPE, stderr=syncer_log.open("wb"), env=env)
    learner: subprocess.Popen[bytes] | None = None
    peaks = {"learner_kib": 0, "network_kib": 0, "syncer_kib": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(SAMPLE_EVERY_S):
            peaks["syncer_kib"] = max(peaks["syncer_kib"], rss_kib(syncer.pid))
            if learner is not None:
                peaks["learner_kib"] = max(peaks["learner_kib"], rss_kib(learner.pid))
                kids = sum(rss_kib(kid) for kid in children(learner.pid))
                peaks["network_kib"] = max(peaks["network_kib"], kids)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = work / f"steps-{anchors}.json"
    learner_log = work / f"learner-{anchors}.log"
    command: list[str] = []
    started = time.monotonic()
    try:
        assert syncer.stdout is not None
        address = f"127.0.0.1:{json.loads(syncer.stdout.readline())['port']}"
        command = [*DILOCOD, "learner", *entry, "--syncer", address, "--insecure", "--id", "gpu"]
        command += ["--device", args.device, "--steps", str(args.steps), "--anchors", anchors]
        learner = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=learner_log.open("wb"), env={**env, OUT_ENV: str(out)}
        )
        code = learner.wait(timeout=args.timeout_s)
    finally:
        stop.set()
        if learner is not None and learner.poll() is None:
            learner.kill()
        syncer.terminate()
        try:
            syncer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            syncer.kill()
    figures = json.loads(out.read_text()) if out.exists() else {"step_ms": [], "gap_ms": [], "period_ms": []}
    records = [
        json.loads(line)
        for line in learner_log.read_text(errors="replace").splitlines()
        if line.startswith("{")
    ]
    progress = [r for r in records if r.get("event") == "progress"]
    merged = sum(
        1 for line in syncer_log.read_text(errors="replace").splitlines() if '"round merged"' in line
    )
    # The first steps run before the heal and the first rounds: the steady state is what counts.
    skip = min(len(figures["period_ms"]) // 3, 10)
    return {
        "command": shlex.join(command),
        "exit": code,
        "seconds": round(time.monotonic() - started, 1),
        "step_ms": quantiles(figures["step_ms"][skip:]),
        "period_ms": quantiles(figures["period_ms"][skip:]),
        "gap_ms": quantiles(figures["gap_ms"][skip:]),
        "rounds_merged": merged,
        "last_progress": progress[-1] if progress else None,
        "peak_rss_kib": peaks,
        "log": str(learner_log) if code else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="The learner's GPU path on this host: one JSON.")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the model trains (default: cuda where torch sees a GPU, else cpu)",
    )
    parser.add_argument("--layers", type=int, default=15, help="Linear(width, width) layers (default 15)")
    parser.add_argument(
        "--width", type=int, default=8192, help="each layer's width (default 8192: 1.0B parameters)"
    )
    parser.add_argument("--batch", type=int, default=8192, help="random rows per step (default 8192)")
    parser.add_argument(
        "--steps", type=int, default=60, help="steps of the learner (alone: half; default 60)"
    )
    parser.add_argument(
        "--anchors",
        default="host,device",
        help="--anchors of the runs with dilocod, one run each (default host,device)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=150.0,
        help="deadline of each run with dilocod, in seconds (default 150)",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    started = time.monotonic()
    torch.backends.cuda.matmul.allow_tf32 = True
    os.environ[SIZE_ENV] = f"{args.layers},{args.width},{args.batch}"
    report: dict[str, Any] = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "parameters": args.layers * args.width * args.width,
    }
    first = alone(args.device, max(args.steps // 2, 4))
    trainer = first.pop("trainer")
    report["alone"] = first
    report["copies"] = copies(trainer.model, args.device)
    del trainer
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as raw:
        work = Path(raw)
        for anchors in args.anchors.split(","):
            report[f"dilocod_{anchors}"] = run = with_dilocod(args, work, anchors)
            base = report["alone"]["period_ms"].get("p50")
            if base and run["period_ms"].get("p50"):
                run["overhead"] = round(run["period_ms"]["p50"] / base - 1.0, 4)
                run["stream_wait_per_boundary_ms"] = round(
                    run["gap_ms"].get("p50", 0.0) - report["alone"]["gap_ms"].get("p50", 0.0), 3
                )
            if run["log"]:  # kept to read: the run failed
                kept = Path(tempfile.gettempdir()) / Path(run["log"]).name
                kept.write_bytes(Path(run["log"]).read_bytes())
                run["log"] = str(kept)
    report["seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(report, default=str)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
