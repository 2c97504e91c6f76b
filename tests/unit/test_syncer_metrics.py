"""The syncer's /metrics page rendered from its status: session handlers that failed by a bug of
their own are counted (a departure never is: tests/integration/test_handler_errors.py)."""

from __future__ import annotations

import re

from devkit.syncer_status import status_of
from dilocod.syncer.metrics import render_syncer_metrics


def test_handler_errors_are_a_counter() -> None:
    text = render_syncer_metrics(status_of(handler_errors=2))
    assert "# TYPE dilocod_session_handler_errors_total counter" in text
    assert re.search(r"^dilocod_session_handler_errors_total 2\.0$", text, re.MULTILINE)


def test_failing_checkpoints_are_a_gauge_an_alert_can_watch() -> None:
    """A full disk is survived (the syncer merges on), so nothing else would show it to an operator."""
    text = render_syncer_metrics(status_of(checkpoints_failed=3))
    assert "# TYPE dilocod_checkpoints_failed gauge" in text
    assert re.search(r"^dilocod_checkpoints_failed 3\.0$", text, re.MULTILINE)


def test_a_damaging_path_and_what_rejoins_saved_are_counters() -> None:
    text = render_syncer_metrics(
        status_of(chunks_asked_again=7, fragments_held_at_join=23, chunks_resumed=41)
    )
    assert re.search(r"^dilocod_chunks_asked_again_total 7\.0$", text, re.MULTILINE)
    assert re.search(r"^dilocod_fragments_held_at_join_total 23\.0$", text, re.MULTILINE)
    assert re.search(r"^dilocod_chunks_resumed_total 41\.0$", text, re.MULTILINE)


def test_skipped_rounds_and_late_pushes_on_disk_are_shown() -> None:
    """A syncer whose merges fall behind skips rounds: an operator sees it, by reason."""
    text = render_syncer_metrics(
        status_of(rounds_skipped={"merges-behind": 4, "busy": 1}, late_pushes_on_disk=3)
    )
    assert re.search(r'^dilocod_rounds_skipped_total\{reason="merges-behind"\} 4\.0$', text, re.MULTILINE)
    assert re.search(r'^dilocod_rounds_skipped_total\{reason="busy"\} 1\.0$', text, re.MULTILINE)
    assert re.search(r"^dilocod_late_pushes_on_disk 3\.0$", text, re.MULTILINE)
