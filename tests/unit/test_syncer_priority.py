"""The syncer's worker threads run at a lower CPU priority than its event loop (Linux nice per
thread), so merges never starve the sessions' I/O; the loop's own priority is untouched."""

from __future__ import annotations

import os
import threading

from dilocod.syncer.service import WORKER_NICENESS, _yield_to_the_loop


def test_a_worker_thread_yields_to_the_loop() -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    seen: list[int] = []

    def worker() -> None:
        _yield_to_the_loop()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=30)
    assert seen == [min(before + WORKER_NICENESS, 19)]
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
