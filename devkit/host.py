"""What some tests need of the host beyond Python and make (root, systemd-analyze, ip and tc), and
what happens when it is missing: on a developer's machine the test skips with a reason naming what
is missing and how to get it; where DILOCOD_TEST_REQUIRE_HOST=1 is set (.ci/run sets it after
installing them) the test fails instead, so a missing install step cannot hide behind a skip."""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_ENV = "DILOCOD_TEST_REQUIRE_HOST"


def need(present: bool, what: str) -> None:
    """Skip (or, where the host must have everything, fail) unless `present`; `what` names the
    missing thing and how to get it."""
    if present:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{what} ({REQUIRE_ENV}=1: this host must have it)")
    pytest.skip(what)


def need_root(why: str) -> None:
    need(os.geteuid() == 0, f"needs root: {why}")


def need_tool(name: str, install: str) -> str:
    """The path of an executable the test runs."""
    path = shutil.which(name)
    need(path is not None, f"needs {name}, which is not on PATH ({install})")
    assert path is not None
    return path
