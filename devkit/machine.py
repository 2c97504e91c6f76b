"""What every benchmark records about where it ran: the CPU, the cores it may use, the load when it
started, the versions of Python, torch and the event loop, and which commit of dilocod (and whether
the measured part of the tree differed from it). Imported by the scripts in bench/."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            found = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        found = ""
    return found or platform.processor() or "unknown"


def code_version(measured: str = "dilocod") -> str:
    """The commit, and whether `measured` (a path in the checkout) differs from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", measured], cwd=ROOT, check=False)
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head}, {measured} {'modified' if dirty.returncode else 'as committed'}"


def machine_facts(measured: str = "dilocod", **extra: Any) -> dict[str, Any]:
    import torch

    try:
        import uvloop

        loop = f"uvloop {uvloop.__version__}"
    except ImportError:
        loop = "asyncio"
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu": cpu_model(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loop": loop,
        "dilocod": code_version(measured),
        **extra,
    }
