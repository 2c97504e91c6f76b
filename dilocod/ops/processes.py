"""Child daemons of a parent that orchestrates them (`dilocod demo`, the benchmarks): stopping one
with a deadline, and reading the one JSON line a daemon prints on stdout once it listens
(`--ready-json`), with a deadline. Nothing here knows what the daemons do."""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
from typing import Any

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


def stop_process(
    process: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S
) -> int:
    """Send sig (if it still runs) and wait; kill it if it outlives timeout_s. Its exit status."""
    if process.poll() is None:
        process.send_signal(sig)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def read_ready_line(
    process: subprocess.Popen[bytes], what: str, timeout_s: float = READY_TIMEOUT_S
) -> dict[str, Any]:
    """The ready line of a daemon started with --ready-json; RuntimeError naming `what` (e.g. the
    daemon and its log) if it does not come in time or the daemon exits first."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            raise RuntimeError(f"{what}: not ready within {timeout_s:.0f} s")
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"{what}: exited with {process.wait()} before it was ready")
    return json.loads(line)
