"""What a person reads when something is wrong: `dilocod status` with a wrong secret says the
authentication was refused (not that the syncer cannot be reached), a model mismatch names the
syncer and the learner instead of saying "here", and a learner that cannot reach its syncer names
the address it dials."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from dilocod.config import Address
from dilocod.learner.bridge import Bridge
from dilocod.learner.layout import check_plan
from dilocod.learner.link import Link, LinkConfig
from dilocod.model.compare import PlanMismatch, first_difference
from dilocod.ops.status import describe_failure
from dilocod.transport.errors import HandshakeFailed
from dilocod.wire.errors import ErrorCode
from dilocod.wire.manifest import ModelEntry
from dilocod.wire.messages import Plan

DEADLINE_S = 60.0


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dilocod", "status", *args, "--timeout", "20"],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )


@pytest.fixture
def keyed_server(tmp_path: Path) -> Iterator[int]:
    """A `dilocod bench serve` that authenticates with a shared secret (the same handshake as the
    syncer's); its port once it says it is ready."""
    secret = tmp_path / "secret"
    secret.write_text("a" * 64)
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "dilocod", "bench", "serve", "--listen", "127.0.0.1:0"),
            *("--secret-file", str(secret), "--ready-json"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        readable, _, _ = select.select([server.stdout], [], [], DEADLINE_S)
        assert readable, "the server never said it was ready"
        yield json.loads(server.stdout.readline())["port"]
    finally:
        server.terminate()
        server.wait(timeout=DEADLINE_S)


def test_status_with_a_wrong_secret_says_the_authentication_was_refused(
    keyed_server: int, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("b" * 64)
    done = _status("--syncer", f"127.0.0.1:{keyed_server}", "--secret-file", str(wrong))
    assert done.returncode == 1
    assert "cannot reach" not in done.stderr
    assert f"authentication with 127.0.0.1:{keyed_server} refused" in done.stderr
    assert "wrong shared secret" in done.stderr and "--secret-file" in done.stderr


def test_status_without_the_secret_says_one_is_required(keyed_server: int) -> None:
    done = _status("--syncer", f"127.0.0.1:{keyed_server}")
    assert done.returncode == 1
    assert "cannot reach" not in done.stderr
    assert "AUTH_REQUIRED" in done.stderr and "--secret-file" in done.stderr


def test_a_port_nobody_listens_on_is_still_unreachable() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = _status("--syncer", f"127.0.0.1:{port}")
    assert done.returncode == 1
    assert f"cannot reach 127.0.0.1:{port}" in done.stderr


def test_tls_failures_name_tls_and_the_flags() -> None:
    address = Address("10.0.0.1", 7070)
    verify = ssl.SSLCertVerificationError(1, "certificate verify failed: unable to get local issuer")
    message = describe_failure(address, verify, tls=True)
    assert "TLS" in message and "--tls-ca" in message and "cannot reach" not in message
    for hung_up in (HandshakeFailed(None, "connection closed"), ConnectionError("peer closed during...")):
        closed = describe_failure(address, hung_up, tls=True)
        assert "authentication refused" in closed and "TLS" in closed and "certificate" in closed
        assert "require TLS" in describe_failure(address, hung_up)
    assert "cannot reach 10.0.0.1:7070" in describe_failure(address, ConnectionRefusedError(111, "refused"))
    timeout = HandshakeFailed(ErrorCode.TIMEOUT, "no session with 10.0.0.1:7070 within 10 s")
    assert "cannot reach 10.0.0.1:7070" in describe_failure(address, timeout)


# ------------------------------------------------------------------------------ model mismatch


def test_the_syncers_mismatch_message_names_the_syncer() -> None:
    syncer = [ModelEntry("a", "float32", (2, 3))]
    learner = [ModelEntry("a", "float32", (3, 2))]
    message = str(first_difference(learner, syncer, "the learner", "the syncer"))
    assert message == "parameter 'a' has shape [3, 2] at the learner, [2, 3] at the syncer"


def test_the_learners_mismatch_message_names_the_learner() -> None:
    plan = Plan("inc", (ModelEntry("a", "float32", (2, 3)),), ((("a", 0, 2),),), (0,), 24, 2, 1)
    with pytest.raises(PlanMismatch) as mismatch:
        check_plan(plan, [ModelEntry("a", "float32", (3, 2))])
    assert " here" not in str(mismatch.value)
    assert str(mismatch.value) == "parameter 'a' has shape [3, 2] at this learner, [2, 3] at the syncer"


# ------------------------------------------------------------------------------ unreachable syncer


def test_a_learner_that_cannot_reach_its_syncer_names_the_address() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    link = Link(
        LinkConfig("127.0.0.1", port, "a", None, streams=1, codec="none", backoff_min_s=1e-4), (), Bridge()
    )
    stop = asyncio.Event()
    dial = link._one_session

    async def one_dial(stop_: asyncio.Event) -> None:
        stop.set()  # one attempt, then the loop ends
        await dial(stop_)

    link._one_session = one_dial  # type: ignore[method-assign]
    with capture_logs() as logs:
        asyncio.run(link.run(stop))
    (unreachable,) = [entry for entry in logs if entry["event"] == "syncer unreachable"]
    assert unreachable["syncer"] == f"127.0.0.1:{port}"
