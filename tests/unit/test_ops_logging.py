"""Logging configuration, observed from outside: a child process configures logging, logs through
structlog, stdlib logging and warnings, and the test reads what reached its stderr (a pipe, or a
pseudo-terminal for the console rendering). Running in a child keeps the process-wide logging state
of the test runner untouched.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest

from dilocod.ops.logging import configure_logging

CHILD_TIMEOUT_S = 60.0

CHILD = """
import logging, sys, warnings
import structlog
from dilocod.ops.logging import configure_logging

configure_logging(**eval(sys.argv[1]))
configure_logging(**eval(sys.argv[1]))  # twice: still one handler, one line per record
log = structlog.get_logger("dilocod.syncer")
log.debug("debug detail", fragment=3)
log.info("round merged", fragment=3, version=7, contributors=["a", "b"], grace_waited_s=0.25)
logging.getLogger("asyncio").warning("stdlib says %s", "hello")
try:
    raise RuntimeError("boom")
except RuntimeError:
    log.exception("merge failed", fragment=4)
warnings.warn("deprecated knob", UserWarning, stacklevel=1)
"""


def _run_child(
    kwargs: dict[str, object], *, stderr: int = subprocess.PIPE
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, repr(kwargs)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=True,
    )


def _json_lines(stderr: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stderr.splitlines()]


def test_json_lines_on_a_pipe_with_the_common_fields() -> None:
    started = datetime.now(UTC)
    done = _run_child({})
    records = _json_lines(done.stderr)
    assert done.stdout == ""
    assert [r["event"] for r in records] == [
        "round merged",
        "stdlib says hello",
        "merge failed",
        records[3]["event"],  # the warning's text, checked below
    ]
    for record in records:
        stamp = str(record["timestamp"])
        assert stamp.endswith("Z"), stamp
        when = datetime.fromisoformat(stamp)
        assert when.utcoffset() == timedelta(0)
        assert started - timedelta(seconds=1) <= when <= datetime.now(UTC) + timedelta(seconds=1)

    merged, stdlib, failed, warned = records
    assert {k: merged[k] for k in ("logger", "level", "fragment", "version", "contributors")} == {
        "logger": "dilocod.syncer",
        "level": "info",
        "fragment": 3,
        "version": 7,
        "contributors": ["a", "b"],
    }
    assert merged["grace_waited_s"] == 0.25
    assert (stdlib["logger"], stdlib["level"]) == ("asyncio", "warning")
    assert (failed["level"], failed["fragment"]) == ("error", 4)
    assert "RuntimeError: boom" in str(failed["exception"])
    assert (warned["logger"], warned["level"]) == ("py.warnings", "warning")
    assert str(warned["event"]).endswith("UserWarning: deprecated knob")


def test_level_debug_lets_debug_through() -> None:
    records = _json_lines(_run_child({"level": "DEBUG"}).stderr)
    assert records[0]["event"] == "debug detail"
    assert records[0]["level"] == "debug"


def test_level_error_filters_structlog_and_stdlib_alike() -> None:
    records = _json_lines(_run_child({"level": "error"}).stderr)
    assert [r["event"] for r in records] == ["merge failed"]


def test_json_false_renders_for_people_even_on_a_pipe() -> None:
    stderr = _run_child({"json": False}).stderr
    lines = stderr.splitlines()
    assert any("round merged" in line and "dilocod.syncer" in line for line in lines)
    assert "Traceback" in stderr and "RuntimeError: boom" in stderr
    for line in lines:
        with pytest.raises(json.JSONDecodeError):
            json.loads(line)


def test_console_rendering_on_a_terminal() -> None:
    controller, terminal = pty.openpty()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, repr({})], stdout=subprocess.DEVNULL, stderr=terminal
        )
        os.close(terminal)
        terminal = -1
        output = b""
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            output += chunk
        assert child.wait(timeout=CHILD_TIMEOUT_S) == 0
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)
    text = output.decode()
    assert "round merged" in text
    assert not text.lstrip().startswith("{")


def test_unknown_level_is_refused_before_anything_changes() -> None:
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        configure_logging(level="loud")
