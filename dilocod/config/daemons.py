"""The configuration of `dilocod syncer` and `dilocod learner`: every key declared once, as a field
of the daemon's frozen dataclass (config.schema.setting: default, parser, --help). Defaults here,
then a TOML file, then flags. The daemons derive their parts' configurations from these
(syncer.rounds.RoundConfig.of, learner.link.LinkConfig.of, learner.runtime.RuntimeConfig.of).

Must stay cheap to import (no torch): the few values also defined beside the math (merges, apply
modes, the guard's ratio) are written out and held equal by tests/unit/test_config_daemons.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from dilocod.config.schema import (
    address,
    auto_or,
    flag,
    integer,
    learner_id,
    number,
    path,
    quorum_or_all,
    setting,
    size,
    text,
)
from dilocod.config.values import Address, ConfigError, format_size
from dilocod.wire.choices import AUTO, CODECS, DEFAULT_CHUNK_BYTES, PRECISIONS, UPDATE_PRECISIONS
from dilocod.wire.messages import QUORUM_ALL

DEFAULT_PORT = 7070
METRICS_PORT = 9464
#: The embedded default model of both daemons: a byte-level GPT on the Python standard library.
DEFAULT_ENTRY = "dilocod.examples.charlm:make_trainer"
#: outer.step.MERGES and outer.apply.APPLY_MODES (torch-free copies; a test holds them equal).
MERGES = ("rda", "mean")
APPLY_MODES = ("overwrite", "mix", "keep-local")
ANCHORS = ("host", "device")
NETWORKS = ("process", "thread")
#: learner.cadence.ANSWERS (a test holds them equal).
ANSWERS = ("arrival", "due")

_ENTRY_HELP = "MODULE:FACTORY (or an installed dilocod.trainers name) of the training."
_SECRET_HELP = "File holding the shared secret (at least 16 bytes)."
_TLS_KEY_HELP = "Mutual TLS: the private key of --tls-cert (PEM)."


def _embedded(entry: str) -> str:
    return f"the embedded byte-level LM, {entry}"


def _days(seconds: float) -> str:
    return f"{seconds:g}, {seconds / 86_400:g} days"


@dataclass(frozen=True, slots=True)
class SyncerConfig:
    """`dilocod syncer` (docs/design.md §3.6 defaults)."""

    listen: Address = setting(
        Address("0.0.0.0", DEFAULT_PORT), address(DEFAULT_PORT), "HOST:PORT learners dial."
    )
    entry: str = setting(DEFAULT_ENTRY, text(), _ENTRY_HELP, shown=_embedded)
    state_dir: Path | None = setting(
        None, path, "Directory for checkpoints (and its lock); created if missing.", required=True
    )
    fragments: int = setting(24, integer(1, 65_536), "P: fragments the model is cut into.")
    sync_every: int = setting(24, integer(1, 1_000_000), "H: inner steps between two syncs of one fragment.")
    overlap: int = setting(
        2, integer(0, 1_000_000), "tau: steps a learner keeps training while its fragment travels."
    )
    #: K; QUORUM_ALL (--quorum all) is lock-step: every live learner, at every round's due step.
    quorum: int = setting(
        1,
        quorum_or_all,
        "K: pushes a round needs before it may merge, or all: lock-step, every live learner pushes at "
        "each round's due step and waits for it (DiLoCo with --overlap 0 and --fragments 1, Streaming "
        "DiLoCo with more fragments).",
    )
    grace_factor: float = setting(
        0.5, number(0.0, 100.0), "gamma: share of the measured slack to wait for stragglers."
    )
    merge: str = setting("rda", text(MERGES), "rda or mean: how outer gradients are averaged.")
    embedding_pattern: str = setting("*embed*", text(), "Parameters merged by plain mean under RDA.")
    outer_lr: float = setting(0.7, number(0.0, 100.0, low_open=True), "Outer Nesterov learning rate.")
    outer_momentum: float = setting(0.9, number(0.0, 1.0), "Outer Nesterov momentum.")
    secret_file: Path | None = setting(None, path, _SECRET_HELP)
    insecure: bool = setting(False, flag, "Run without authentication.")
    #: Mutual TLS: this daemon's certificate chain and key, and the CA that signs its peers.
    tls_cert: Path | None = setting(None, path, "Mutual TLS: this syncer's certificate chain (PEM).")
    tls_key: Path | None = setting(None, path, _TLS_KEY_HELP)
    tls_ca: Path | None = setting(
        None, path, "Mutual TLS: the CA (PEM) that signs the learners' certificates."
    )
    metrics: Address | None = setting(
        None, address(METRICS_PORT), "HOST:PORT for Prometheus text metrics.", shown="off"
    )
    checkpoint_every_s: float = setting(300.0, number(0.0, low_open=True), "Seconds between checkpoints.")
    #: Learners gone longer than this are dropped from the roster, the status and the checkpoint.
    roster_retention_s: float = setting(
        3 * 86_400.0,
        number(0.0, low_open=True),
        "Seconds a learner that left stays in the status and the checkpoint.",
        shown=_days,
    )
    #: A late push may still be merged this many versions after its base.
    staleness: int = setting(1, integer(0, 1_000), "Versions a late push may trail and still be merged.")
    #: Outer gradients with a norm above this multiple of the running median are rejected.
    max_norm_ratio: float = setting(
        10.0,
        number(1.0),
        "Reject outer gradients above this x the recent median norm per step x their steps.",
    )
    #: Outer gradients with a norm above this multiple of their fragment's (at least 1 per value,
    #: RMS) are rejected from the first push on. The value of outer.guard.DEFAULT_MAX_FRAGMENT_RATIO.
    max_fragment_ratio: float = setting(
        10.0,
        number(0.0, low_open=True),
        "Reject outer gradients above this x their fragment's norm, taken as at least 1 per value (RMS).",
    )
    #: How updates travel: chunk size and codec (learners choose their own for pushes).
    chunk: int = setting(DEFAULT_CHUNK_BYTES, size, "Chunk size of updates.", shown=format_size)
    codec: str = setting("none", text(CODECS), "Codec of updates: none, lz4 or zstd.")
    #: Wire precision of updates: fp32, or bf16 (half the bytes; the master stays float32).
    update_precision: str = setting(
        "fp32",
        text(UPDATE_PRECISIONS),
        "Updates on the wire: fp32, or bf16 (half the bytes, rounded to nearest even; the global model "
        "stays float32).",
    )
    seed: int = setting(0, integer(0, 2**63 - 1), "Seed handed to the factory.")

    @property
    def lockstep(self) -> bool:
        return self.quorum == QUORUM_ALL

    def check(self) -> None:
        """What no single key can say: in lock-step a fragment's merge must be applied (tau steps
        after its push) no later than its next push, H steps after the last."""
        if self.lockstep and self.overlap > self.sync_every:
            raise ConfigError(
                f"--overlap: {self.overlap} is above --sync-every ({self.sync_every}); with --quorum all a "
                "fragment's merge is applied tau steps after its push and must be back before its next one"
            )


@dataclass(frozen=True, slots=True)
class LearnerConfig:
    """`dilocod learner`."""

    syncer: Address | None = setting(None, address(DEFAULT_PORT), "HOST:PORT of the syncer.", required=True)
    entry: str = setting(DEFAULT_ENTRY, text(), _ENTRY_HELP, shown=_embedded)
    id: str | None = setting(
        None, learner_id, "This learner's name (unique per learner; a restart reuses it).", required=True
    )
    state_dir: Path | None = setting(
        None,
        path,
        "Where the local state (model, inner optimizer, data cursor) is kept.",
        shown="none, nothing is saved",
    )
    #: "auto" picks cuda when this host has it, else cpu.
    device: str = setting(AUTO, text(), "cuda, cuda:N or cpu.", shown="cuda if available, else cpu")
    steps: int | None = setting(
        None, integer(1), "Stop after this many inner steps.", shown="run until stopped"
    )
    #: Data connections to the syncer; "auto": what `dilocod bench run` saved for this syncer,
    #: else enough for 5 Gbit/s at the RTT measured on connecting (dilocod.learner.link).
    streams: int | str = setting(
        AUTO,
        auto_or(integer(0, 64)),
        "Data connections to the syncer (0-64), or auto: the count `dilocod bench run` saved for this "
        "syncer, else enough to carry 5 Gbit/s at the RTT measured on connecting (2-16).",
    )
    #: Codec of pushes; "auto": what `dilocod bench run` saved for this syncer, else tuned on the
    #: learner's own outer gradients and push throughput (dilocod.tuning.tuner.CodecTuner).
    codec: str = setting(
        AUTO,
        text((AUTO, *CODECS)),
        "Codec of pushes: none, lz4, zstd, or auto: the one `dilocod bench run` saved for this syncer, "
        "else chosen from codec speeds measured on the first outer gradient and the push throughput, "
        "and chosen again when the link rate moves.",
    )
    precision: str = setting(
        "fp32", text(PRECISIONS), "Outer gradients on the wire: fp32, bf16, int8 or int4 (error feedback)."
    )
    #: Where the link to the syncer runs: "process" (a child process, so its CPU time and the GIL
    #: stay off the training thread) or "thread" (in this process, on its own event-loop thread).
    network: str = setting(
        "process",
        text(NETWORKS),
        "Where the link to the syncer runs: process (a child process: its CPU time and the GIL stay off "
        "the training thread) or thread (an event-loop thread of this process).",
    )
    apply: str = setting(
        "overwrite", text(APPLY_MODES), "overwrite, mix or keep-local: how merged fragments are applied."
    )
    mix_alpha: float = setting(0.5, number(0.0, 1.0), "Weight of the local fragment in --apply mix.")
    #: Decoupled only (lock-step always snapshots at the due step): learner.cadence.Cadence.answer_now.
    answer: str = setting(
        "arrival",
        text(ANSWERS),
        "Decoupled (--quorum K on the syncer): when a request for a fragment is answered. arrival: at "
        "the first step boundary after it came, also when that is before the round's due step of this "
        "learner's own count; due: held until that due step (the reference schedule; its pushes "
        "then often miss their round and merge a cycle later). Lock-step always answers at the due step.",
    )
    #: On a GPU, where the anchors live: "host" or "device" (learner.runtime.RuntimeConfig.anchors).
    anchors: str = setting(
        "host",
        text(ANCHORS),
        "On a GPU, where each fragment's anchor (its last merged value) is kept: host (pinned host "
        "memory) or device (one model of GPU memory in float32; outer gradients are computed there and "
        "the host keeps none). On the CPU both are host memory.",
    )
    secret_file: Path | None = setting(None, path, _SECRET_HELP)
    insecure: bool = setting(False, flag, "Connect without authentication.")
    #: Mutual TLS: this learner's certificate chain and key, and the CA that signs the syncer's.
    tls_cert: Path | None = setting(None, path, "Mutual TLS: this learner's certificate chain (PEM).")
    tls_key: Path | None = setting(None, path, _TLS_KEY_HELP)
    tls_ca: Path | None = setting(None, path, "Mutual TLS: the CA (PEM) that signs the syncer's certificate.")
    chunk: int = setting(DEFAULT_CHUNK_BYTES, size, "Chunk size of pushes.", shown=format_size)
    save_every_s: float = setting(
        300.0, number(0.0, low_open=True), "Seconds between saves of the local state."
    )
    join_timeout_s: float = setting(
        60.0, number(0.0, low_open=True), "How long to wait for the first heal before training anyway."
    )
    progress_every_s: float = setting(5.0, number(0.0, low_open=True), "Seconds between progress lines.")
    #: None: learner_seed(id), so that every learner reads different data (an explicit seed wins).
    seed: int | None = setting(
        None,
        integer(0, 2**63 - 1),
        "Seed handed to the factory (ctx.seed).",
        shown="derived from --id (31 bits of its SHA-256): different per learner, the same across "
        "restarts of one id and on every rank",
    )


def learner_seed(learner_id: str) -> int:
    """The default seed of a learner: the first 31 bits of SHA-256 of its id. Different ids read
    different data, a restart of one id reads the same (unlike hash(), which is salted per
    process), and 31 bits fit every RNG's seed (numpy's legacy seed takes < 2**32)."""
    digest = hashlib.sha256(learner_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1
