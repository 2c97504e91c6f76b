"""Where a learner's step boundary spends its time: the parts of `TrainingLoop.boundary` timed
inside a real learner process.

The same setup as bench/learner_overhead.py's split placement (its entry module, model and step;
a fresh `dilocod syncer --fragments 24 --sync-every 24 --overlap 2` on CPU 1; the learner's
training thread on CPU 0, everything else of it on CPU 1), but the learner runs through this
script, which first wraps the boundary and the methods it calls in timers (perf_counter_ns for the
wall time, thread_time_ns for the training thread's CPU time in the whole boundary) and then calls
dilocod's own command line. Each part's median over the measured boundaries, with how often it was
called per boundary, is printed and written to --json, next to the step's own medians (the step
itself, and the time between steps as the entry sees it). Nothing in dilocod is changed, but each
timer costs a microsecond or two: the boundary measured here is a little longer than without them
(more so with --detail, which also times what inside the parts costs most).

--runs learners are timed one after another, each against its own syncer (this host's parts drift
by about 10 % from one run to the next; compare changes across runs of one invocation, or of
several runs each).

Run from the repository root: ``python bench/boundary_profile.py [--steps 2400] [--runs 2]
[--detail]``. Must not be imported by dilocod or the tests.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import learner_overhead as lo  # bench/learner_overhead.py: run as python bench/<script>.py

from devkit.machine import machine_facts

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "boundary_profile.json"

#: The parts timed, in the modules where the runtime looks them up, as (what to call it, module,
#: class or None, attribute, only with --detail). Without --detail, the boundary's four steps; with
#: it, also what inside them costs most. Each timer adds a microsecond or two to the boundary, so
#: with --detail the parts add up to more. Tensor.copy_ and the socket's recvmsg are then wrapped
#: for the whole process, but timed only inside the boundary. The boundary itself is timed
#: separately, with its CPU time.
PARTS: tuple[tuple[str, str, str | None, str, bool], ...] = (
    ("take the inbox", "dilocod.learner.netproc", "ProcessBridge", "take", False),
    ("  read the socket", "dilocod.learner.netproc", "Channel", "receive", True),
    ("    recvmsg", "socket", "socket", "recvmsg", True),
    ("    msgpack.unpackb", "msgpack", None, "unpackb", True),
    ("  decode a control", "dilocod.learner.netproc", None, "control_from_raw", True),
    ("apply an update", "dilocod.learner.runtime", "TrainingLoop", "_apply", False),
    ("  apply_update_", "dilocod.learner.runtime", None, "apply_update_", True),
    ("copy a fragment out", "dilocod.learner.runtime", "TrainingLoop", "_snapshot", False),
    ("  HostCopier.copy_out", "dilocod.learner.runtime", "HostCopier", "copy_out", True),
    ("both: Tensor.copy_", "torch", "Tensor", "copy_", True),
    ("the flush", "dilocod.learner.netproc", "ProcessBridge", "flush", False),
    ("  queue (msgpack.packb)", "dilocod.learner.netproc", "Channel", "queue", True),
    ("  send datagrams", "dilocod.learner.netproc", "Channel", "send", True),
)
BOUNDARY = "the boundary"


class Timers:
    """Durations per part, per boundary, on the training thread only."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.boundaries: list[dict[str, Any]] = []
        self.current: dict[str, list[int]] | None = None
        self.main = threading.main_thread()

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.current is None or threading.current_thread() is not self.main:
                return function(*args, **kwargs)
            started = time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                if self.current is not None:
                    self.current.setdefault(name, []).append(time.perf_counter_ns() - started)

        return timed

    def wrap_boundary(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.current = {}
            cpu, started = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter_ns() - started, time.thread_time_ns() - cpu
                self.boundaries.append({"wall_ns": wall, "cpu_ns": cpu, "parts": self.current})
                self.current = None

        return timed

    def save(self) -> None:
        self.out.write_text(json.dumps(self.boundaries))


def parts(detail: bool) -> list[tuple[str, str, str | None, str, bool]]:
    return [part for part in PARTS if detail or not part[4]]


def install(out: Path, detail: bool) -> None:
    """Wrap the boundary and its parts."""
    import importlib

    timers = Timers(out)
    runtime = importlib.import_module("dilocod.learner.runtime")
    runtime.TrainingLoop.boundary = timers.wrap_boundary(runtime.TrainingLoop.boundary)  # type: ignore[method-assign]
    for name, module_name, owner_name, attribute, _ in parts(detail):
        module = importlib.import_module(module_name)
        owner: Any = module if owner_name is None else getattr(module, owner_name)
        setattr(owner, attribute, timers.wrap(name.strip(), getattr(owner, attribute)))
    atexit.register(timers.save)


def inside(out: str, detail: bool, argv: list[str]) -> int:
    """The learner process: install the timers, then run `dilocod learner` as the command would."""
    install(Path(out), detail)
    from dilocod.cli import main

    try:
        main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    return 0


def summarise(boundaries: list[dict[str, Any]], measured: int, detail: bool) -> dict[str, Any]:
    """Medians over the last `measured` boundaries (the training loop's, not the first heal's)."""
    window = boundaries[-measured - 1 : -1]  # the last one adopts after the last step
    out: dict[str, Any] = {
        "boundaries": len(window),
        BOUNDARY: {
            "median_us": statistics.median(b["wall_ns"] for b in window) / 1e3,
            "cpu_median_us": statistics.median(b["cpu_ns"] for b in window) / 1e3,
        },
    }
    for name, *_ in parts(detail):
        key = name.strip()
        calls = [d for b in window for d in b["parts"].get(key, [])]
        per_boundary = [sum(b["parts"].get(key, [])) for b in window]
        out[key] = {
            "calls_per_boundary": len(calls) / len(window),
            "median_per_call_us": statistics.median(calls) / 1e3 if calls else None,
            "median_per_boundary_us": statistics.median(per_boundary) / 1e3,
        }
    return out


def run_once(entry_dir: Path, work: Path, base: dict[str, Any], index: int, detail: bool) -> dict[str, Any]:
    times = work / f"times-{index}.json"
    parts_path = work / f"parts-{index}.json"
    config = {**base, "times": str(times), "others_cpu": 1, "network": "process"}

    def through_this_script(command: list[str]) -> list[str]:
        # python -m dilocod learner ... becomes python <this script> --inside PARTS DETAIL learner ...
        here = str(Path(__file__).resolve())
        return [sys.executable, here, "--inside", str(parts_path), str(int(detail)), *command[3:]]

    lo.run_under_dilocod(entry_dir, work, config, {0}, {1}, launch=through_this_script)
    recorded = json.loads(times.read_text())
    lo.check_split(recorded.get("placement"), 1)
    summary = summarise(json.loads(parts_path.read_text()), base["steps"], detail)
    summary["step"] = lo.summarise(recorded)
    return summary


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time the parts of a learner's step boundary (split placement, network process, "
        "P = H = 24, tau = 2, a fresh syncer per run).",
    )
    parser.add_argument("--steps", type=int, default=2400, help="measured steps per run (default 2400)")
    parser.add_argument("--warmup", type=int, default=60, help="steps before the measurement (default 60)")
    parser.add_argument("--runs", type=int, default=2, help="learner runs, one after another (default 2)")
    parser.add_argument("--batch", type=int, default=2, help="sequences of 32 tokens per step (default 2)")
    parser.add_argument(
        "--detail", action="store_true", help="also time what inside the four parts costs most"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the numbers")
    args = parser.parse_args(argv)
    if min(args.steps, args.runs, args.batch) < 1 or args.warmup < 2:
        parser.error("--steps, --runs and --batch take at least 1, --warmup at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--inside"]:
        return inside(argv[1], argv[2] == "1", argv[3:])
    args = parse_args(argv)
    base = lo.entry_config(args.batch, args.warmup, args.steps)
    machine = machine_facts("dilocod")
    started = time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory(prefix="dilocod-boundary-profile-") as tmp:
        work = Path(tmp)
        entry_dir = work / "entry"
        entry_dir.mkdir()
        (entry_dir / f"{lo.ENTRY_MODULE}.py").write_text(lo.ENTRY_SOURCE)
        for index in range(args.runs):
            run = run_once(entry_dir, work, base, index, args.detail)
            runs.append(run)
            print(f"run {index}:", file=sys.stderr)
            print(report(run, args.detail), file=sys.stderr)
    record = {
        "command": shlex.join(["python", "bench/boundary_profile.py", *argv]),
        "machine": machine,
        "seconds": round(time.monotonic() - started, 1),
        "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


def report(run: dict[str, Any], detail: bool) -> str:
    step, whole = run["step"], run[BOUNDARY]
    lines = [
        f"  {run['boundaries']} boundaries; the step itself {step['step_median_ms']:.2f} ms, "
        f"between steps {step['between_median_ms'] * 1e3:.0f} µs (medians)",
        f"  {BOUNDARY:<24} {whole['median_us']:7.1f} µs (CPU {whole['cpu_median_us']:.1f} µs)",
    ]
    for name, *_ in parts(detail):
        part = run[name.strip()]
        per_call = part["median_per_call_us"]
        per_call_text = "" if per_call is None else f", {per_call:.1f} µs a call"
        lines.append(
            f"  {name:<24} {part['median_per_boundary_us']:7.1f} µs "
            f"({part['calls_per_boundary']:.2f} calls{per_call_text})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
