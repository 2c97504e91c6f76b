"""`dilocod syncer` as a real process, with scripted learners speaking the real protocol.

Lock-step equivalence: with K = M, tau = 0, merge=mean and lossless chunks, every merged version the
syncer sends equals lock-step DiLoCo recomputed here with dilocod.outer from the very pushes the
learners sent. Then the service's behaviour: healing on join, status, bad input refused without
disturbing anyone, a stopped learner not holding K = 1 rounds back, and restarts from checkpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from devkit.daemons import (
    dilocod_cli,
    entry_model,
    export_global_model,
    start_syncer,
    syncer_status,
    write_entry,
)
from devkit.scripted_learner import ScriptedLearner
from dilocod.outer import mean_merge, merge_weights, nesterov_step_
from dilocod.outer.weights import bounded_merge_weights
from dilocod.transport.endpoints import connect
from dilocod.transport.errors import SessionClosed, TransferFailed
from dilocod.transport.loop import run
from dilocod.wire.errors import ErrorCode
from dilocod.wire.manifest import ModelEntry, fragment_manifest
from dilocod.wire.messages import Join, Plan, PushHeader, StatusRequest, StatusResponse

DEADLINE_S = 120.0


@pytest.fixture
def entry_dir(tmp_path: Path) -> Path:
    return write_entry(tmp_path / "entry")


def _flat(values: dict[str, torch.Tensor], pieces: tuple[tuple[str, int, int], ...]) -> torch.Tensor:
    """A fragment's bytes as float32: each piece's rows at its manifest offset."""
    shapes = {n: tuple(v.shape) for n, v in values.items()}
    manifest, raw = fragment_manifest(pieces, shapes)
    flat = torch.zeros(raw // 4)
    for entry, (name, start, stop) in zip(manifest, pieces, strict=True):
        rows = values[name] if values[name].dim() == 0 else values[name][start:stop]
        flat[entry.offset // 4 : entry.offset // 4 + rows.numel()] = rows.flatten()
    return flat


def test_lock_step_rounds_equal_dilocod_outer(tmp_path: Path, entry_dir: Path) -> None:
    entries, initial = entry_model(entry_dir)
    syncer = start_syncer(
        tmp_path,
        entry_dir,
        tmp_path / "state",
        *("--fragments", "2", "--sync-every", "2", "--overlap", "0", "--quorum", "2"),
        *("--merge", "mean", "--grace-factor", "0", "--outer-lr", "0.7", "--outer-momentum", "0.9"),
    )
    learners = [
        ScriptedLearner("a", syncer.port, entries, tokens_per_step=100, rate=1e-3, lockstep=True),
        ScriptedLearner(
            "b", syncer.port, entries, tokens_per_step=300, rate=3e-3, step_s=0.01, lockstep=True
        ),
    ]

    async def main() -> None:
        async with asyncio.timeout(DEADLINE_S):
            await asyncio.gather(*(learner.join() for learner in learners))
            # K = M and tau = 0: step k of both opens round k - 1, which both answer; every learner
            # keeps answering after its 8 steps until all 8 rounds are merged and adopted.
            stop = asyncio.Event()
            runs = [asyncio.create_task(learner.run(steps=8, stop=stop)) for learner in learners]
            await asyncio.gather(*(x.wait_until(lambda x=x: sum(x.versions) >= 8) for x in learners))
            stop.set()
            await asyncio.gather(*runs)
        for learner in learners:
            await learner.close()

    try:
        run(main())
    finally:
        assert syncer.stop() == 0, syncer.stderr()
    plan = learners[0].plan
    assert plan is not None and plan.quorum == 2 and plan.overlap == 0
    # Healing: version 0 of every fragment is the factory's initial model.
    params = [_flat(initial, names) for names in plan.fragments]
    momentum = [torch.zeros_like(p) for p in params]
    for learner in learners:
        for p, version, data in learner.updates:
            if version == 0:
                assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32), params[p])
    # Every round's pushes, merged here as lock-step DiLoCo does.
    by_round: dict[tuple[int, int], list[tuple[str, object]]] = defaultdict(list)
    for learner in learners:
        for push in learner.pushes:
            by_round[(push.round, push.fragment)].append((learner.name, push))
    expected: dict[tuple[int, int], torch.Tensor] = {}
    versions = [0] * len(params)
    for (_, p), contributions in sorted(by_round.items()):
        assert len(contributions) == 2, "K = M: every round merges both learners"
        contributions.sort(key=lambda c: c[0])
        pushes = [c[1] for c in contributions]
        weights = merge_weights([x.c_tokens for x in pushes], [x.c_steps for x in pushes])
        deltas = [[torch.frombuffer(bytearray(x.delta), dtype=torch.float32)] for x in pushes]
        merged = mean_merge(deltas, weights)
        nesterov_step_([params[p]], merged, [momentum[p]], lr=0.7, mu=0.9)
        versions[p] += 1
        expected[(p, versions[p])] = params[p].clone()
    assert len(expected) >= 6, f"only {len(expected)} rounds merged"
    seen = 0
    for learner in learners:
        for p, version, data in learner.updates:
            if version > 0:
                got = torch.frombuffer(bytearray(data), dtype=torch.float32)
                torch.testing.assert_close(got, expected[(p, version)], rtol=1e-6, atol=1e-8)
                seen += 1
    assert seen == 2 * len(expected)
    merged_lines = syncer.log_events("round merged")
    assert len(merged_lines) == len(expected)
    # Both learners in every round, weighted tokens x tokens per step (equal steps: 1 to 9).
    assert all(line["contributors"] == ["a", "b"] for line in merged_lines)
    assert all(line["weights"] == pytest.approx([0.1, 0.9], abs=1e-4) for line in merged_lines)


def test_bad_input_is_refused_and_the_syncer_serves_on(tmp_path: Path, entry_dir: Path) -> None:
    """A wrong model, a push nobody asked for, a push claiming a future version, and a non-finite
    outer gradient: each refused with its code, counted, never merged; the others go on."""
    entries, _ = entry_model(entry_dir)
    syncer = start_syncer(
        tmp_path, entry_dir, tmp_path / "state", "--fragments", "2", "--sync-every", "2", "--quorum", "1"
    )
    wrong = (ModelEntry(entries[0].name, "float32", (3, 3)), *entries[1:])

    # Protocol garbage: the connection is closed, nothing else notices.
    with socket.create_connection(("127.0.0.1", syncer.port), timeout=30) as garbage:
        garbage.sendall(bytes(range(256)) * 64)
        with contextlib.suppress(ConnectionResetError):
            while garbage.recv(65536):
                pass

    async def main() -> None:
        async with asyncio.timeout(DEADLINE_S):
            stranger = await connect("127.0.0.1", syncer.port, peer_id="wrong-model", streams=0)
            await stranger.send(Join(wrong, ""))
            with pytest.raises(SessionClosed) as refusal:
                await stranger.recv()
            assert refusal.value.code == ErrorCode.MODEL_MISMATCH
            assert f"parameter {entries[0].name!r} has shape [3, 3] at the learner" in str(refusal.value)
            await stranger.close()

            good = ScriptedLearner("good", syncer.port, entries, step_s=0.01)
            await good.join()
            assert good.session is not None
            # Rounds go on: waited for (a merged version comes back), not counted on within N steps.
            await good.run(steps=4, until=lambda: max(good.versions) >= 1)
            # A push for a round nobody opened: refused by its header, before its bytes are taken.
            store = good.manifests[0]
            raw = len(good.anchors[0]) * 4
            header = PushHeader(store, raw, "none", 64 * 1024, fragment=0, round=999, base_version=0)
            with pytest.raises(TransferFailed) as not_requested:
                await good.session.send_fragment(header, bytearray(raw))
            assert not_requested.value.code == ErrorCode.NOT_REQUESTED
            # A diverged learner: its NaN push is screened out, the rounds go on with the others.
            diverged = ScriptedLearner("diverged", syncer.port, entries, step_s=0.01, poison_pushes=1)
            await diverged.join()
            screened = asyncio.Event()

            async def until_screened() -> None:
                await asyncio.to_thread(
                    syncer.wait_for, "push rejected", lambda r: r["learner"] == "diverged", DEADLINE_S
                )
                screened.set()

            await asyncio.gather(good.run(stop=screened), diverged.run(stop=screened), until_screened())
            await diverged.close()
            await good.session.send(StatusRequest())
            while not isinstance(status := await good.session.recv(), StatusResponse):
                pass
            assert status.status["rejected_pushes"] >= 2
            assert status.status["rejected_by_reason"]["non-finite"] == 1
            await good.close()

    try:
        run(main())
        assert syncer.alive()
    finally:
        assert syncer.stop() == 0, syncer.stderr()
    assert syncer.log_events("model mismatch")
    (rejected,) = syncer.log_events("push rejected")
    assert rejected["learner"] == "diverged" and rejected["reason"] == "non-finite"
    for merged in syncer.log_events("round merged"):
        if merged["round"] == rejected["round"]:
            assert "diverged" not in merged["contributors"]


def test_status_command_reads_a_running_syncer(tmp_path: Path, entry_dir: Path) -> None:
    entries, _ = entry_model(entry_dir)
    syncer = start_syncer(
        tmp_path,
        entry_dir,
        tmp_path / "state",
        *("--fragments", "3", "--sync-every", "3", "--metrics", "127.0.0.1:0"),
    )

    async def main() -> None:
        learner = ScriptedLearner("solo", syncer.port, entries, step_s=0.01)
        await learner.join()
        await learner.run(steps=6)
        await learner.close()

    try:
        run(main())
        status = syncer_status(syncer.port)
        assert [f["index"] for f in status["fragments"]] == [0, 1, 2]
        assert status["rounds_merged"] >= 1 and sum(f["version"] for f in status["fragments"]) >= 1
        assert 1.0 <= status["fragment_imbalance"] <= 1.1  # row slices: near-equal fragments
        (solo,) = status["learners"]
        assert solo["id"] == "solo" and solo["contributions"] >= 1 and solo["weight_share"] == 1.0
        # Goodput: the reported step times over the wall time since "solo" first joined.
        assert solo["tracked_s"] >= solo["useful_s"] > 0
        assert solo["goodput"] == pytest.approx(solo["useful_s"] / solo["tracked_s"], abs=0.01)
        for key in ("quorum_sizes", "grace_waited_s", "bytes_in", "bytes_out", "rejected_pushes"):
            assert key in status
        assert status["loop_lag_ms"]["p99"] >= 0
        # The same numbers as Prometheus text.
        port = syncer.wait_for("metrics", lambda record: True, DEADLINE_S)["port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            text = response.read().decode()
        table = dilocod_cli("status", "--syncer", f"127.0.0.1:{syncer.port}", "--insecure")
        assert "fragment versions: 0:" in table.stdout
        # Pushes sent and how many of them were not merged (a push made as an update arrived can
        # hold no step: zero weight), and that share in the table.
        assert solo["pushes"] >= solo["contributions"] and 0 <= solo["pushes_wasted"] < solo["pushes"]
        wasted = f"{solo['pushes_wasted'] / solo['pushes']:.1%}".replace(".", r"\.")
        row = rf"^solo\s+no\s+[\d.]+\s+6\s+\d+\s+100\.0%\s+[\d.]+%\s+{wasted}$"
        assert re.search(row, table.stdout, re.MULTILINE), table.stdout
        merged = re.search(r"^dilocod_rounds_merged_total (\S+)$", text, re.MULTILINE)
        assert merged is not None and float(merged.group(1)) == status["rounds_merged"]
        assert 'dilocod_learner_contributions_total{learner="solo"}' in text
        assert 'dilocod_learner_goodput_ratio{learner="solo"}' in text
        assert 'dilocod_fragment_version{fragment="2"}' in text
    finally:
        assert syncer.stop() == 0, syncer.stderr()


def test_killed_syncer_resumes_from_its_checkpoint(tmp_path: Path, entry_dir: Path) -> None:
    """kill -9 mid-training, restart on the same state dir: versions never fall below the
    checkpoint's, and learners joining the new incarnation carry on from there."""
    entries, _ = entry_model(entry_dir)
    state = tmp_path / "state"
    args = ("--fragments", "2", "--sync-every", "2", "--checkpoint-every-s", "0.3")
    first = start_syncer(tmp_path, entry_dir, state, *args)

    async def train(port: int, steps: int, beyond: int) -> ScriptedLearner:
        """At least `steps` steps, and on until the versions have risen above `beyond` (rounds
        merged in this incarnation: a signal, not a count of steps that a loaded host may miss)."""
        learner = ScriptedLearner("m", port, entries, step_s=0.01)
        await learner.join()
        await learner.run(steps=steps, until=lambda: sum(learner.versions) > beyond)
        await learner.close()
        return learner

    try:
        trained = run(train(first.port, 10, beyond=0))
        # A checkpoint that holds merged versions is a log line away; then kill without warning.
        checkpoint = first.wait_for("checkpoint", lambda record: record["versions"] > 0, DEADLINE_S)
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()
        saved = checkpoint["versions"]
    finally:
        if first.alive():
            first.kill()
    second = start_syncer(tmp_path, entry_dir, state, *args)
    try:
        assert sum(second.info["versions"]) >= saved
        assert second.info["incarnation"] != first.info["incarnation"]
        # The learner's goodput terms come back from the checkpoint, the downtime counted as lost.
        (known,) = syncer_status(second.port)["learners"]
        assert known["id"] == "m" and not known["connected"]
        assert known["tracked_s"] > known["useful_s"] > 0
        # Its own step counter too (reports received count from 0 in each incarnation).
        assert 0 < known["step"] <= trained.steps and known["steps"] == 0
        # Training carries on after the restart: rounds merge on top of the checkpoint's versions.
        run(train(second.port, 6, beyond=sum(second.info["versions"])))
    finally:
        assert second.stop() == 0, second.stderr()


#: Rounds that must merge without a stopped learner before it is let go on.
CLEAR_ROUNDS = 6
SPEEDS = {"a": (0.02, 100), "b": (0.03, 200), "c": (0.04, 300)}  # step seconds, tokens per step


def test_a_stopped_learner_does_not_hold_k1_rounds_back(tmp_path: Path, entry_dir: Path) -> None:
    """Three learner processes at different speeds, K = 1: SIGSTOP one and the rounds go on
    without it; SIGCONT and it contributes again. Every merge weighs tokens x tokens per step (each
    learner clipped at 16x the round's lower median)."""
    entries, _ = entry_model(entry_dir)
    syncer = start_syncer(
        tmp_path, entry_dir, tmp_path / "state", "--fragments", "3", "--sync-every", "3", "--quorum", "1"
    )
    shapes = json.dumps([[e.name, list(e.shape)] for e in entries])
    learners: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, (step_s, tokens) in SPEEDS.items():
            command = [
                sys.executable,
                "-m",
                "devkit.scripted_learner",
                "--port",
                str(syncer.port),
                "--id",
                name,
            ]
            command += ["--shapes", shapes, "--step-s", str(step_s), "--tokens", str(tokens)]
            with (tmp_path / f"{name}.stderr").open("wb") as stderr:
                learners[name] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        # Every learner has contributed (one that starts late on a loaded host is waited for).
        seen: set[str] = set()

        def everyone_merged(record: dict[str, Any]) -> bool:
            seen.update(record["contributors"])
            return seen == set(SPEEDS)

        syncer.wait_for("round merged", everyone_merged, DEADLINE_S)
        learners["c"].send_signal(signal.SIGSTOP)
        stopped_after = syncer.log_events("round merged")[-1]["round"]
        # Rounds go on without c: CLEAR_ROUNDS of them merge after the stop without c (rounds that
        # were open at the stop may still carry its last pushes, however many a loaded host let
        # open). If a stopped learner held K = 1 rounds back, this wait would run into its deadline.
        without_c = itertools.count(1)
        syncer.wait_for(
            "round merged",
            lambda r: (
                r["round"] > stopped_after
                and "c" not in r["contributors"]
                and next(without_c) >= CLEAR_ROUNDS
            ),
            DEADLINE_S,
        )
        resumed_after = syncer.log_events("round merged")[-1]["round"]
        learners["c"].send_signal(signal.SIGCONT)
        syncer.wait_for(
            "round merged", lambda r: r["round"] > resumed_after and "c" in r["contributors"], DEADLINE_S
        )
    finally:
        for process in learners.values():
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait()
        assert syncer.stop() == 0, syncer.stderr()
    merged = syncer.log_events("round merged")
    assert len({name for r in merged for name in r["contributors"]}) == 3
    for record in merged:
        # Token weights, each learner's clipped at 16x the round's lower median (outer/weights.py).
        expected = bounded_merge_weights(record["tokens"], record["steps"], record["contributors"])
        assert record["weights"] == pytest.approx(expected, abs=1e-4)
        for name, tokens, steps in zip(
            record["contributors"], record["tokens"], record["steps"], strict=True
        ):
            assert tokens == steps * SPEEDS[name][1]


def test_config_file_flags_win_and_bad_values_are_named(tmp_path: Path, entry_dir: Path) -> None:
    """Every flag is a TOML key and flags win; a bad key or value exits 78 naming it; a syncer
    listening beyond loopback without a secret refuses to start; export writes the global model."""
    config = tmp_path / "syncer.toml"
    config.write_text('fragments = 3\nsync-every = 6\nmerge = "mean"\nquorum = 1\n')
    syncer = start_syncer(
        tmp_path, entry_dir, tmp_path / "state", "--config", str(config), "--fragments", "2"
    )
    try:
        assert syncer.info["fragments"] == 2  # the flag beat the file
        entries, _ = entry_model(entry_dir)

        async def one_learner() -> Plan:
            learner = ScriptedLearner("cfg", syncer.port, entries, step_s=0.01)
            await learner.join()
            await learner.run(steps=6)
            await learner.close()
            assert learner.plan is not None
            return learner.plan

        plan = run(one_learner())
        assert (plan.sync_every, plan.quorum, len(plan.fragments)) == (6, 1, 2)
    finally:
        assert syncer.stop() == 0, syncer.stderr()
    out = export_global_model(tmp_path / "state", tmp_path / "model.safetensors")
    exported = load_file(str(out))
    assert sorted(exported) == sorted(e.name for e in entries)

    def refused(*args: str) -> str:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "dilocod",
                "syncer",
                "--entry",
                "x:y",
                "--state-dir",
                str(tmp_path / "s2"),
                *args,
            ],
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 78, done.stderr.decode()
        return done.stderr.decode()

    config.write_text("fragmnts = 3\n")
    assert "unknown key 'fragmnts'" in refused("--config", str(config), "--insecure")
    assert "--quorum: 'zero' is neither all nor an integer" in refused("--quorum", "zero", "--insecure")
    assert "without a shared secret" in refused("--listen", "0.0.0.0:0")
    assert "no module named 'x'" in refused("--insecure", "--listen", "127.0.0.1:0")
