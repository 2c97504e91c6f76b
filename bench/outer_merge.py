"""Outer merge benchmark: RDA + Nesterov over M contributions of a fragment, against memory bandwidth.

Merges M = 4 float32 contributions of a 100 MB fragment with dilocod.outer's fused outer_step_
(RDA merge and outer Nesterov step), with 1 and 2 torch threads, and in the same run times an
in-place torch.add over the same fragment, the memory-bandwidth reference. The merge's traffic rate
is the bytes it must read and write at minimum divided by its time:

    minimum = (2M + 4) x F: every contribution read twice (its norm must be known before its
    direction can be averaged), the parameters and the Nesterov buffer read and written once.

torch.add's is 3 x F (two reads, one write). "merge" is outer_step_(..., consume_deltas=True)
(u' written into a contribution's own buffer; the contributions are restored, untimed, before each
run); "merge, scratch" is outer_step_(..., scratch=...), the call that leaves its inputs alone.
Also timed, for context: the same merge as two calls (rda_merge, then nesterov_step_), the blocked
nesterov_step_ alone against torch.optim.SGD's step (5 x F each), and the quantizer (bytes per
parameter and error on Gaussian values). All variants take turns within each repetition, so a
burst of load from another tenant hits them alike, and each timed run follows a read of a large
buffer (--flush-mb), so none starts with its operands in the shared L3 (260 MiB here) from the
untimed restore or the previous variant; the best of the repetitions is reported. It measures and
records; it asserts nothing about speed.

Run from the repository root: ``python bench/outer_merge.py [--json FILE]``.
Must not be imported by dilocod; it imports dilocod.outer and torch only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from devkit.machine import machine_facts
from dilocod.outer import (
    dequantize,
    merge_weights,
    nesterov_step_,
    outer_step_,
    quantization_report,
    quantize,
    rda_merge,
)

MB = 1e6  # decimal, as memory bandwidth is quoted
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "outer_merge.json"
LR, MU = 0.7, 0.9


#: (untimed setup or None, timed run)
Run = tuple[Callable[[], object] | None, Callable[[], object]]


def best_of(reps: int, runs: dict[str, Run], flush: torch.Tensor | None) -> dict[str, float]:
    """Smallest wall time of each run over reps rounds, the runs taking turns within a round.

    Before each timed run: its setup, then a read of the flush buffer (evicting the caches).
    """
    best = dict.fromkeys(runs, math.inf)
    for _ in range(reps):
        for name, (setup, run) in runs.items():
            if setup is not None:
                setup()
            if flush is not None:
                flush.sum()
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def fragment(numel: int, tensors: int) -> list[int]:
    """Split numel into `tensors` nearly equal tensor sizes."""
    base, extra = divmod(numel, tensors)
    return [base + (1 if i < extra else 0) for i in range(tensors)]


def measure(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(args.seed)
    sizes = fragment(args.fragment_mb * 1_000_000 // 4, args.tensors)
    frag_bytes = sum(sizes) * 4
    m = args.contributions
    # Outer gradients of different learners: different scales, nearly orthogonal directions.
    deltas = [[torch.randn(n, generator=gen) * (1e-3 * (1 + i)) for n in sizes] for i in range(m)]
    consumed = [[d.clone() for d in ds] for ds in deltas]
    weights = merge_weights([1000 * (i + 1) for i in range(m)], [24] * m)
    params = [torch.randn(n, generator=gen) for n in sizes]
    momentum = [torch.zeros(n) for n in sizes]
    scratch = [torch.empty(n) for n in sizes]
    merged = [torch.empty(n) for n in sizes]
    sgd_params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    for p, d in zip(sgd_params, deltas[0], strict=True):
        p.grad = d
    sgd = torch.optim.SGD(sgd_params, lr=LR, momentum=MU, nesterov=True)
    sgd.step()  # allocates its momentum buffers before timing
    left, right = torch.randn(sum(sizes), generator=gen), torch.randn(sum(sizes), generator=gen)

    flush = torch.ones(args.flush_mb * 1_000_000 // 4) if args.flush_mb > 0 else None

    def restore() -> None:
        for mine, original in zip(consumed, deltas, strict=True):
            torch._foreach_copy_(mine, original)

    runs: dict[str, Run] = {
        "torch_add": (None, lambda: left.add_(right)),
        "fused": (
            restore,
            lambda: outer_step_(params, momentum, consumed, weights, LR, MU, consume_deltas=True),
        ),
        "fused_scratch": (
            None,
            lambda: outer_step_(params, momentum, deltas, weights, LR, MU, scratch=scratch),
        ),
        "composed": (
            None,
            lambda: nesterov_step_(params, rda_merge(deltas, weights, out=merged), momentum, LR, MU),
        ),
        "nesterov": (None, lambda: nesterov_step_(params, deltas[0], momentum, LR, MU)),
        "sgd": (None, sgd.step),
    }
    best_of(1, runs, None)  # warm-up: page in every buffer
    seconds = best_of(args.reps, runs, flush)
    minimum = (2 * m + 4) * frag_bytes
    # Bytes to and from memory, counting a read for ownership where a pass writes a buffer it
    # has not read (u' into scratch, Δ into rda_merge's out).
    moved = {
        "torch_add": 3 * frag_bytes,
        "fused": (2 * m + 6) * frag_bytes,  # u' written back into the pivot, read by the step
        "fused_scratch": (2 * m + 7) * frag_bytes,  # u' into scratch (+ ownership read), read back
        "composed": (2 * m + 9) * frag_bytes,  # Δ written (+ ownership), scaled in place, read
        "nesterov": 5 * frag_bytes,
        "sgd": 6 * frag_bytes,  # plus SGD's temporary gradient, written once
    }
    counted = {**moved, "fused": minimum, "fused_scratch": minimum, "composed": minimum}
    rates = {k: counted[k] / seconds[k] / 1e9 for k in runs}
    return {
        "threads": threads,
        "fragment_bytes": frag_bytes,
        "tensors": len(sizes),
        "contributions": m,
        "minimum_bytes": minimum,
        "seconds": seconds,
        "bytes_counted": counted,
        "bytes_moved_by_implementation": moved,
        "traffic_gbps": rates,
        "moved_gbps": {k: moved[k] / seconds[k] / 1e9 for k in runs},
        "merge_vs_add": rates["fused"] / rates["torch_add"],
        "merge_moved_vs_add": moved["fused"] / seconds["fused"] / 1e9 / rates["torch_add"],
        "scratch_vs_add": rates["fused_scratch"] / rates["torch_add"],
        "scratch_moved_vs_add": moved["fused_scratch"] / seconds["fused_scratch"] / 1e9 / rates["torch_add"],
        "composed_vs_add": rates["composed"] / rates["torch_add"],
        "nesterov_vs_sgd_speedup": seconds["sgd"] / seconds["nesterov"],
    }


def quantization_rows(numel: int, seed: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * 1e-3
    rows = []
    for bits in (16, 8, 4):
        for block in (32, 64, 256):
            started = time.perf_counter()
            q = quantize(x, bits, block)
            quantize_s = time.perf_counter() - started
            started = time.perf_counter()
            dequantize(q)
            dequantize_s = time.perf_counter() - started
            report = quantization_report(x, q)
            bound = float(q.error_bounds().max())
            rows.append(
                {
                    "bits": bits,
                    "block_size": block,
                    "bytes_per_parameter": report.bytes_per_parameter,
                    "relative_l2_error": report.relative_error,
                    "max_abs_error": report.max_abs_error,
                    "max_error_over_bound": report.max_abs_error / bound,
                    "quantize_mbps": numel * 4 / quantize_s / MB,
                    "dequantize_mbps": numel * 4 / dequantize_s / MB,
                }
            )
    return rows


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(["python", "bench/outer_merge.py", *argv[1:]])


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| threads | torch.add GB/s | merge ms | merge GB/s (minimum bytes) | x torch.add "
        "| x add (bytes moved) | merge, scratch ms | x add | x add (moved) "
        "| two calls ms | two calls x add | nesterov_step_ ms | SGD.step ms | SGD / nesterov_step_ |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s, g = r["seconds"], r["traffic_gbps"]
        lines.append(
            f"| {r['threads']} | {g['torch_add']:.1f} | {s['fused'] * 1e3:.1f} | {g['fused']:.1f} "
            f"| **{r['merge_vs_add']:.2f}** | {r['merge_moved_vs_add']:.2f} "
            f"| {s['fused_scratch'] * 1e3:.1f} | {r['scratch_vs_add']:.2f} | {r['scratch_moved_vs_add']:.2f} "
            f"| {s['composed'] * 1e3:.1f} | {r['composed_vs_add']:.2f} "
            f"| {s['nesterov'] * 1e3:.1f} | {s['sgd'] * 1e3:.1f} | {r['nesterov_vs_sgd_speedup']:.1f} |"
        )
    return "\n".join(lines)


def quant_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| bits | block | bytes/param | relative L2 error | max error / bound "
        "| quantize MB/s | dequantize MB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['bits']} | {r['block_size']} | {r['bytes_per_parameter']:.4f} "
            f"| {r['relative_l2_error']:.2e} "
            f"| {r['max_error_over_bound']:.3f} | {r['quantize_mbps']:,.0f} | {r['dequantize_mbps']:,.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fragment-mb", type=int, default=100, help="fragment size, decimal MB of float32")
    parser.add_argument("--tensors", type=int, default=1, help="tensors the fragment is split into")
    parser.add_argument("--contributions", type=int, default=4, help="M, learners merged")
    parser.add_argument("--threads", default="1,2", help="torch thread counts to measure")
    parser.add_argument("--reps", type=int, default=7, help="repetitions; the best is reported")
    parser.add_argument("--quant-numel", type=int, default=1 << 22, help="values in the quantizer table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--flush-mb", type=int, default=512, help="buffer read before each timed run (decimal MB; 0: none)"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the numbers")
    args = parser.parse_args(argv)
    if args.fragment_mb < 1 or args.tensors < 1 or args.contributions < 2 or args.reps < 1:
        parser.error("--fragment-mb, --tensors and --reps must be at least 1, --contributions at least 2")
    args.thread_counts = [int(t) for t in args.threads.split(",")]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    args = parse_args(argv[1:])
    machine = machine_facts("dilocod/outer")
    results = []
    for threads in args.thread_counts:
        result = measure(args, threads)
        results.append(result)
        rates = result["traffic_gbps"]
        print(
            f"{threads} thread(s): merge {result['seconds']['fused'] * 1e3:.1f} ms = "
            f"{rates['fused']:.1f} GB/s, torch.add {rates['torch_add']:.1f} GB/s, "
            f"ratio {result['merge_vs_add']:.2f} (scratch {result['scratch_vs_add']:.2f})",
            file=sys.stderr,
        )
    quant = quantization_rows(args.quant_numel, args.seed)
    machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(table(results))
    print()
    print(quant_table(quant))
    record = {
        "command": command_line(argv),
        "machine": machine,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "byte_count": (
            "minimum (2M + 4) x F; outer_step_ moves (2M + 6) x F with consume_deltas=True and "
            "(2M + 7) x F with scratch (u' written, its read for ownership, read back)"
        ),
        "results": results,
        "quantization": quant,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
