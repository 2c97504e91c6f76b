"""Helper threads (the syncer's merge and screen workers, a learner's network side) run at a lower
CPU priority than their process's main work (Linux nice per thread); the caller's own priority is
untouched."""

from __future__ import annotations

import os
import threading

from dilocod.ops.priority import HELPER_NICENESS, lower_this_thread


def test_a_worker_thread_yields_to_the_loop() -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    seen: list[int] = []

    def worker() -> None:
        lower_this_thread()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=30)
    assert seen == [min(before + HELPER_NICENESS, 19)]
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
