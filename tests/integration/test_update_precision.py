"""`dilocod syncer --update-precision bf16` with real processes: a learner trains against it and
ends holding, for every fragment at the syncer's final version, exactly the upcast of bf16(Θ_p) of
the syncer's final checkpoint (the merge worker's encoding), and a learner that joins afterwards
heals to that for every fragment (encodings made again on demand); the syncer's egress counts
bf16 bytes. Every wait is on a process exit or a log record, with a deadline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from devkit.daemons import start_learner, start_syncer, syncer_status, write_learner_entry
from dilocod.model.params import model_entries
from dilocod.model.plan import plan_fragments
from dilocod.model.precision import recast
from dilocod.syncer.checkpoint import load_latest_checkpoint
from dilocod.syncer.model import GlobalModel
from dilocod.wire.codecs import checksum

DEADLINE_S = 120.0
FRAGMENTS = 2


def _bf16_fragments(entry_dir: Path, state_dir: Path) -> tuple[list[tuple[int, str, str]], int, int]:
    """(version, digest of the upcast of bf16(Θ_p), digest of Θ_p) of every fragment of the
    syncer's newest checkpoint, laid out as a learner holds its anchors; and the bytes of all the
    fragments at bf16 and at fp32."""
    sys.path.insert(0, str(entry_dir))
    try:
        import learner_test_entry
    finally:
        sys.path.remove(str(entry_dir))
    loaded = load_latest_checkpoint(state_dir)
    assert loaded is not None
    specs = list(model_entries(learner_test_entry.make_model()))
    plan = plan_fragments([(s.name, s.shape) for s in specs], len(loaded.state.versions))
    model = GlobalModel(
        plan, specs, chunk_bytes=1 << 20, embedding_pattern="*embed*", update_precision="bf16"
    )
    model.load(loaded.state.params, loaded.state.momentum, loaded.state.versions)
    out = []
    for store in model.fragments:
        encoding = model.encode(store.index, store.master)
        anchor = bytearray(store.raw_bytes)
        recast(encoding.buffer, store.update_manifest, anchor, store.manifest)
        out.append((store.version, f"{checksum(anchor):016x}", f"{checksum(store.master):016x}"))
    sizes = [(store.update_bytes, store.raw_bytes) for store in model.fragments]
    return out, sum(bf16 for bf16, _ in sizes), sum(fp32 for _, fp32 in sizes)


def test_a_learner_holds_the_bf16_rounding_of_the_syncer_fragments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lock-step with tau = 0: the trainer applies every merge before its next step.
    monkeypatch.setenv("LEARNER_TEST_STEP_S", "0.01")
    entry_dir = write_learner_entry(tmp_path / "entry")
    syncer = start_syncer(
        tmp_path,
        entry_dir,
        tmp_path / "syncer",
        "--fragments", str(FRAGMENTS), "--sync-every", "4", "--quorum", "all", "--overlap", "0",
        "--merge", "mean", "--update-precision", "bf16",
        entry="learner_test_entry:make_trainer",
    )  # fmt: skip
    try:
        trainer = start_learner(tmp_path, entry_dir, syncer.port, "trainer", "--steps", "16")
        assert trainer.process.wait(timeout=DEADLINE_S) == 0, trainer.stderr()
        # Its pushes are merged or dropped once it has gone; then a learner that only heals.
        syncer.wait_for("learner left", lambda record: True, DEADLINE_S)
        status = syncer_status(syncer.port)
        observer = start_learner(tmp_path, entry_dir, syncer.port, "observer", "--steps", "1")
        assert observer.process.wait(timeout=DEADLINE_S) == 0, observer.stderr()
    finally:
        assert syncer.stop() == 0, syncer.stderr()
    assert status["update_precision"] == "bf16"
    final, bf16_bytes, fp32_bytes = _bf16_fragments(entry_dir, tmp_path / "syncer")
    merged = syncer.log_events("round merged")
    assert merged and all(version > 0 for version, _, _ in final), final
    # bf16 changes the bytes (this is not the fp32 path) ...
    assert all(bf16 != fp32 for _, bf16, fp32 in final), final
    # ... and the learners hold exactly the upcast of what the syncer sent.
    (trained,) = trainer.log_events("holding fragments")
    held = [
        (v, d, f[1])
        for v, d, f in zip(trained["versions"], trained["digests"], final, strict=True)
        if v == f[0]
    ]
    assert held and all(d == want for _, d, want in held), (trained, final)
    (healed,) = observer.log_events("holding fragments")
    assert healed["versions"] == [v for v, _, _ in final], (healed, final)
    assert healed["digests"] == [d for _, d, _ in final], (healed, final)
    # The heal travelled at bf16: one update per fragment, about half the fp32 bytes.
    (stopped,) = observer.log_events("learner stopped")
    assert stopped["received_bytes"] == bf16_bytes < 0.55 * fp32_bytes, (stopped, bf16_bytes, fp32_bytes)
    assert status["bytes_out"] > 0
