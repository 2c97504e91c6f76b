"""Fixtures for the integration tests: bench servers as real child processes (started once per
configuration, waited for with a deadline, terminated at the end), fragments of gradient-like
float32 made once per size, mutual-TLS files from trustme, and `arun`, which runs a test's
coroutine on uvloop and on the default asyncio loop in turn (the `loop_kind` parameter).

Coroutines run through dilocod.transport.loop.run inside plain test functions rather than through
pytest-asyncio's loop management, so each test owns its loop and the loop kind is explicit.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from devkit.transfers import BenchServer, BenchServers, Fragments, TlsSet
from dilocod.transport.credentials import TlsFiles
from dilocod.transport.loop import loop_name, run

T = TypeVar("T")
#: Per test coroutine: far above what any of them needs, far below pytest-timeout's limit.
TEST_DEADLINE_S = 240.0
LOOP_KINDS = ("uvloop", "asyncio")


@pytest.fixture(params=LOOP_KINDS)
def loop_kind(request: pytest.FixtureRequest) -> str:
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    return request.param


@pytest.fixture
def arun(loop_kind: str) -> Callable[[Coroutine[Any, Any, T]], T]:
    """Run a coroutine to completion on a fresh loop of the test's loop kind, with a deadline."""

    def _run(main: Coroutine[Any, Any, T]) -> T:
        async def checked() -> T:
            assert loop_name() == loop_kind
            async with asyncio.timeout(TEST_DEADLINE_S):
                return await main

        return run(checked(), use_uvloop=loop_kind == "uvloop")

    return _run


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "secret"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="session")
def bench_servers(tmp_path_factory: pytest.TempPathFactory, secret_file: Path) -> Iterator[BenchServers]:
    """Start bench servers on demand; all are terminated (SIGTERM) at the end and must exit 0."""
    servers = BenchServers(tmp_path_factory.mktemp("bench-servers"), secret_file)
    try:
        yield servers
    finally:
        statuses = servers.stop_all()
    bad = {args: status for args, status in statuses.items() if status != 0}
    assert not bad, f"bench servers did not exit cleanly on SIGTERM: {bad}"


@pytest.fixture
def bench_server(bench_servers: BenchServers, loop_kind: str) -> BenchServer:
    """An insecure bench server whose event loop is of the same kind as the test's client."""
    return bench_servers.get(use_uvloop=loop_kind == "uvloop")


@pytest.fixture(scope="session")
def fragments() -> Fragments:
    return Fragments()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsSet:
    trustme = pytest.importorskip("trustme")
    directory = tmp_path_factory.mktemp("tls")
    ca, other_ca = trustme.CA(), trustme.CA()

    def issue(name: str, identity: str, authority: Any, trusted: Any) -> TlsFiles:
        cert = authority.issue_cert(identity)
        files = TlsFiles(directory / f"{name}.crt", directory / f"{name}.key", directory / f"{name}-ca.pem")
        for pem in cert.cert_chain_pems:
            pem.write_to_path(files.cert, append=True)
        cert.private_key_pem.write_to_path(files.key)
        trusted.cert_pem.write_to_path(files.ca)
        return files

    return TlsSet(
        server=issue("server", "127.0.0.1", ca, ca),
        client=issue("client", "learner-1", ca, ca),
        stranger=issue("stranger", "learner-2", other_ca, ca),
    )
