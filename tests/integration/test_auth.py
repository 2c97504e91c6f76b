"""Security by default on real processes and sockets.

A syncer with a shared secret gives a peer with no key or a wrong key nothing (no answer to JOIN,
no PLAN, no fragment) and takes nothing from it (a push it pipelines is never read, let alone
merged), whether it uses the protocol library or writes frames by hand, while a good learner is
served throughout. A syncer in mutual TLS (certificates from trustme) listening beyond loopback
with no secret trains a real `dilocod learner` and refuses a client with no certificate, one from
another CA, or plain TCP. Both daemons refuse state files that carry code, and the code never runs.
Every wait is on a reply, a log record or a process exit, with a deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from devkit.daemons import (
    LEARNER_ENTRY,
    dilocod_cli,
    entry_model,
    start_learner,
    start_syncer,
    write_entry,
    write_learner_entry,
)
from devkit.scripted_learner import ScriptedLearner
from devkit.transfers import RawReply, TlsSet, raw_exchange
from dilocod.syncer import checkpoint
from dilocod.syncer.checkpoint import MODEL_FILE, SyncerState, save_checkpoint
from dilocod.transport.credentials import TlsFiles, client_context
from dilocod.transport.endpoints import connect
from dilocod.transport.errors import HandshakeFailed
from dilocod.transport.loop import run
from dilocod.wire.connection import PROTOCOL_MAX_VERSION
from dilocod.wire.errors import ErrorCode
from dilocod.wire.frames import FrameType, encode_header
from dilocod.wire.manifest import ModelEntry, pack_manifest
from dilocod.wire.messages import NONCE_BYTES, AuthResponse, Hello, Join, Message, PushHeader, encode_body

DEADLINE_S = 120.0
WRONG_SECRET = b"not-the-secret-" * 3
SYNCER_ARGS = ("--fragments", "2", "--sync-every", "2", "--quorum", "1")
#: Frames that would carry the model or a fragment to the peer.
GIVING = {FrameType.WELCOME, FrameType.PLAN, FrameType.UPDATE_HEADER, FrameType.CHUNK}


def _frame(message: Message, stream_id: int = 0) -> bytes:
    body = encode_body(message)
    return encode_header(message.TYPE, stream_id, len(body)) + body


def _hello(peer_id: str, *, kind: str = "control", session: bytes = b"") -> bytes:
    nonce, version = secrets.token_bytes(NONCE_BYTES), PROTOCOL_MAX_VERSION
    return _frame(Hello(version, version, kind, "learner", peer_id, nonce, session))


def _refused_at_handshake(reply: RawReply, code: ErrorCode) -> None:
    """The challenge, then ERROR with code, then the close: nothing else, least of all the model."""
    kinds = [frame.frame_type for frame in reply.frames]
    assert not GIVING & set(kinds), kinds
    assert kinds == [FrameType.AUTH_CHALLENGE, FrameType.ERROR], kinds
    error = reply.frames[-1].message
    assert error is not None and error.code == code, error  # type: ignore[union-attr]
    assert reply.closed


def _hand_written_intruders(port: int, entries: tuple[ModelEntry, ...], good_session: bytes) -> None:
    """Blocking: frames written by hand, everything a learner would send pipelined at once."""
    manifest, raw_bytes = pack_manifest([(e.name, e.dtype, e.shape) for e in entries[:1]])
    push = PushHeader(tuple(manifest), raw_bytes, "none", 64 * 1024, fragment=0, round=0, base_version=0)
    forged = _frame(AuthResponse(bytes(32)))
    # A forged proof, then JOIN and a push straight after, as if the proof had been taken.
    everything = _hello("intruder") + forged + _frame(Join(entries, "")) + _frame(push, stream_id=1)
    _refused_at_handshake(raw_exchange(port, everything), ErrorCode.AUTH_FAILED)
    # No proof at all: JOIN right after HELLO.
    _refused_at_handshake(
        raw_exchange(port, _hello("skipper") + _frame(Join(entries, ""))), ErrorCode.UNEXPECTED_FRAME
    )
    # A data connection naming the good learner's own session (and its id): an empty proof.
    steal = _hello("good", kind="data", session=good_session) + _frame(AuthResponse(b""))
    _refused_at_handshake(raw_exchange(port, steal), ErrorCode.AUTH_FAILED)


def test_a_peer_without_the_key_gets_nothing_and_sends_nothing(tmp_path: Path, secret_file: Path) -> None:
    entry_dir = write_entry(tmp_path / "entry")
    entries, _ = entry_model(entry_dir)
    secret = secret_file.read_bytes().strip()
    syncer = start_syncer(
        tmp_path, entry_dir, tmp_path / "state", *SYNCER_ARGS, credentials=("--secret-file", str(secret_file))
    )

    async def main() -> None:
        async with asyncio.timeout(DEADLINE_S):
            good = ScriptedLearner("good", syncer.port, entries, step_s=0.01, secret=secret)
            await good.join()
            assert good.session is not None
            stop = asyncio.Event()
            running = asyncio.create_task(good.run(stop=stop))
            try:
                # The protocol library itself, with a wrong key and with none.
                with pytest.raises(HandshakeFailed) as wrong:
                    await connect(
                        "127.0.0.1", syncer.port, peer_id="intruder", secret=WRONG_SECRET, streams=1
                    )
                assert wrong.value.code is ErrorCode.AUTH_FAILED
                with pytest.raises(HandshakeFailed) as keyless:
                    await connect("127.0.0.1", syncer.port, peer_id="anonymous", secret=None, streams=1)
                assert keyless.value.code is ErrorCode.AUTH_REQUIRED
                await asyncio.to_thread(
                    _hand_written_intruders, syncer.port, entries, good.session.session_id
                )
                # The good learner is served on: more rounds reach it after all of that.
                merged_before = sum(good.versions)
                await good.wait_until(lambda: sum(good.versions) >= merged_before + 4)
            finally:
                stop.set()
                await running
                await good.close()

    try:
        run(main())
        assert syncer.alive()
        # Its status too is only for holders of the key.
        keyless = dilocod_cli("status", "--syncer", f"127.0.0.1:{syncer.port}", check=False)
        assert keyless.returncode == 1 and "AUTH_REQUIRED" in keyless.stderr, keyless.stderr
        status = json.loads(
            dilocod_cli(
                "status", "--syncer", f"127.0.0.1:{syncer.port}", "--secret-file", str(secret_file), "--json"
            ).stdout
        )
    finally:
        assert syncer.stop() == 0, syncer.stderr()
    assert [learner["id"] for learner in status["learners"]] == ["good"]
    assert status["rejected_pushes"] == 0, "the intruder's push was never even read as a push"
    assert {record["learner"] for record in syncer.log_events("learner joined")} == {"good"}
    merged = syncer.log_events("round merged")
    assert merged and all(set(record["contributors"]) == {"good"} for record in merged)


# ----------------------------------------------------------------------------- mutual TLS


def _tls_flags(files: TlsFiles) -> tuple[str, ...]:
    return ("--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca))


def _no_certificate(files: TlsSet) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(files.server.ca)
    return ctx


REFUSED: list[tuple[str, Callable[[TlsSet], ssl.SSLContext | None]]] = [
    ("no client certificate", _no_certificate),
    ("a certificate from another CA", lambda files: client_context(files.stranger)),
    ("plain TCP", lambda files: None),
]


def test_mutual_tls_with_real_daemons(
    tmp_path: Path, tls_files: TlsSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TLS alone is enough beyond loopback: the syncer listens on every address with no secret.
    The learner's steps take 10 ms, so that its pushes keep pace with the rounds: at the bare
    step (40 steps in 30 ms) a request reached the training side some 24 steps after its round
    opened, every push came after its round had closed, and a third of the runs merged nothing."""
    monkeypatch.setenv("LEARNER_TEST_STEP_S", "0.01")
    entry_dir = write_learner_entry(tmp_path / "entry")
    syncer = start_syncer(
        tmp_path,
        entry_dir,
        tmp_path / "state",
        *SYNCER_ARGS,
        entry=LEARNER_ENTRY,
        credentials=("--listen", "0.0.0.0:0", *_tls_flags(tls_files.server)),
    )
    learner = start_learner(
        tmp_path,
        entry_dir,
        syncer.port,
        "tls-learner",
        "--steps",
        "40",
        credentials=_tls_flags(tls_files.client),
    )

    async def refused() -> None:
        for what, make_context in REFUSED:
            with pytest.raises(OSError) as caught:  # HandshakeFailed, a reset or an SSL error: no session
                async with asyncio.timeout(DEADLINE_S):
                    session = await connect(
                        "127.0.0.1", syncer.port, peer_id="intruder", ssl=make_context(tls_files), streams=1
                    )
                    await session.close(f"should not have opened with {what}")
                    pytest.fail(f"a session opened with {what}")
            # Refused, not merely slow: a deadline would be an OSError too.
            refusal = caught.value
            assert not isinstance(refusal, TimeoutError), (what, refusal)
            assert not (isinstance(refusal, HandshakeFailed) and refusal.code is ErrorCode.TIMEOUT), (
                what,
                refusal,
            )

    try:
        assert syncer.info["host"] == "0.0.0.0"
        syncer.wait_for("learner joined", lambda record: record["learner"] == "tls-learner", DEADLINE_S)
        run(refused())
        assert learner.process.wait(timeout=DEADLINE_S) == 0, learner.stderr()
        status = json.loads(
            dilocod_cli(
                "status", "--syncer", f"127.0.0.1:{syncer.port}", *_tls_flags(tls_files.client), "--json"
            ).stdout
        )
        stranger = dilocod_cli(
            "status", "--syncer", f"127.0.0.1:{syncer.port}", *_tls_flags(tls_files.stranger), check=False
        )
        assert stranger.returncode == 1, stranger.stderr
    finally:
        if learner.alive():
            learner.kill()
        assert syncer.stop() == 0, syncer.stderr()
    (only,) = status["learners"]
    assert only["id"] == "tls-learner" and only["contributions"] >= 1
    assert {record["learner"] for record in syncer.log_events("learner joined")} == {"tls-learner"}
    merged = syncer.log_events("round merged")
    # A late push of its own may merge beside its fresh one (docs/design.md §3.4): one learner still.
    assert merged and all(set(record["contributors"]) == {"tls-learner"} for record in merged)


# ------------------------------------------------------------------- state files carrying code


class RunsCode:
    """Pickles to a call of os.mkdir(marker): whoever unpickles it creates the marker directory."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.marker,))


def _daemon(*args: str, entry_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(entry_dir), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "dilocod", *args],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=env,
        check=False,
    )


def test_daemons_refuse_state_files_that_carry_code(tmp_path: Path) -> None:
    entry_dir = write_learner_entry(tmp_path / "entry")
    marker = tmp_path / "code-ran"

    # The syncer: a checkpoint whose model file is a pickle, its size and digest re-recorded.
    syncer_state = tmp_path / "syncer"
    saved = save_checkpoint(syncer_state, SyncerState({"w": torch.ones(2)}, {"w": torch.zeros(2)}, [0], {}))
    torch.save({"w": torch.ones(2), "payload": RunsCode(marker)}, saved / MODEL_FILE)
    data = (saved / MODEL_FILE).read_bytes()
    document = json.loads((saved / checkpoint.STATE_FILE).read_text())
    document["files"][MODEL_FILE] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (saved / checkpoint.STATE_FILE).write_text(json.dumps(document))
    done = _daemon(
        *("syncer", "--listen", "127.0.0.1:0", "--entry", LEARNER_ENTRY, "--state-dir", str(syncer_state)),
        entry_dir=entry_dir,
    )
    assert done.returncode == 78, done.stderr
    assert f"{MODEL_FILE} does not load" in done.stderr

    # The learner: its local state file carries the payload; nothing listens on the syncer port.
    learner_state = tmp_path / "learner"
    learner_state.mkdir()
    torch.save(
        {"format": "dilocod-learner-state/1", "step": 3, "extra": RunsCode(marker)},
        learner_state / "learner-state.pt",
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = _daemon(
        *("learner", "--syncer", f"127.0.0.1:{port}", "--id", "m", "--entry", LEARNER_ENTRY),
        *("--state-dir", str(learner_state), "--device", "cpu"),
        entry_dir=entry_dir,
    )
    assert done.returncode == 78, done.stderr
    assert str(learner_state / "learner-state.pt") in done.stderr and "could run code" in done.stderr
    assert "syncer unreachable" not in done.stderr  # refused before any connection
    assert not marker.exists()
