"""The daemons' configuration: every key a daemon lists as valid is accepted by load_config and by
its dataclass, every other key is refused naming it (exit 78 from the command), and a learner's
default seed differs per learner id and stays the same across restarts of one id.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dilocod.config import (
    EX_CONFIG,
    LEARNER_FIELDS,
    SYNCER_FIELDS,
    ConfigError,
    LearnerConfig,
    Parse,
    SyncerConfig,
    learner_seed,
    load_config,
)

#: A valid TOML value for each key either daemon lists (a test fails when a key is added without one).
SAMPLE_VALUES: dict[str, object] = {
    "listen": "127.0.0.1:7171",
    "syncer": "127.0.0.1:7171",
    "entry": "mypkg.train:make_trainer",
    "id": "site-a",
    "state_dir": "state",
    "device": "cpu",
    "steps": 10,
    "streams": 4,
    "fragments": 4,
    "sync_every": 12,
    "overlap": 1,
    "quorum": 2,
    "grace_factor": 1.0,
    "merge": "mean",
    "embedding_pattern": "*wte*",
    "outer_lr": 0.5,
    "outer_momentum": 0.8,
    "secret_file": "secret",
    "insecure": True,
    "tls_cert": "cert.pem",
    "tls_key": "key.pem",
    "tls_ca": "ca.pem",
    "metrics": "127.0.0.1:9999",
    "checkpoint_every_s": 60,
    "roster_retention_s": 3600,
    "staleness": 2,
    "max_norm_ratio": 5.0,
    "max_fragment_ratio": 2.5,
    "chunk": "64KiB",
    "codec": "zstd",
    "precision": "bf16",
    "update_precision": "bf16",
    "apply": "mix",
    "mix_alpha": 0.25,
    "anchors": "device",
    "save_every_s": 30,
    "join_timeout_s": 5,
    "progress_every_s": 2,
    "seed": 7,
    "network": "thread",
}

DAEMONS: dict[str, tuple[type[Any], dict[str, Parse]]] = {
    "syncer": (SyncerConfig, SYNCER_FIELDS),
    "learner": (LearnerConfig, LEARNER_FIELDS),
}
LISTED = [(daemon, key) for daemon, (_, fields) in DAEMONS.items() for key in fields]


@pytest.mark.parametrize(("daemon", "key"), LISTED)
def test_every_listed_key_is_accepted_by_load_config_and_the_dataclass(
    tmp_path: Path, daemon: str, key: str
) -> None:
    cls, fields = DAEMONS[daemon]
    assert key in {field.name for field in dataclasses.fields(cls)}, f"{daemon} lists {key} but has no field"
    toml = tmp_path / "daemon.toml"
    value = SAMPLE_VALUES[key]
    toml.write_text(f"{key.replace('_', '-')} = {_toml(value)}\n")
    config = load_config(cls, fields, toml, {})
    assert getattr(config, key) == fields[key](value, key)


def test_a_key_the_daemon_does_not_list_is_refused_naming_it(tmp_path: Path) -> None:
    toml = tmp_path / "syncer.toml"
    toml.write_text('network = "process"\n')
    with pytest.raises(ConfigError, match="unknown key 'network'"):
        load_config(SyncerConfig, SYNCER_FIELDS, toml, {})


def test_syncer_toml_with_network_exits_78_naming_the_key(tmp_path: Path) -> None:
    """The reported case: it used to be listed as valid and then crash with a TypeError."""
    toml = tmp_path / "syncer.toml"
    toml.write_text('network = "process"\n')
    done = subprocess.run(
        [
            *(sys.executable, "-m", "dilocod", "syncer", "--config", str(toml), "--insecure"),
            *("--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == EX_CONFIG, done.stderr
    assert "'network'" in done.stderr and "Traceback" not in done.stderr
    known = done.stderr.split("known keys:", 1)[1]
    assert "network" not in known


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if not isinstance(value, str) else f'"{value}"'


# --------------------------------------------------------------------------- the learner's seed


def _learner_seed_via_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    """Run `dilocod learner` up to the point it hands its setup to the daemon, and return the seed."""
    from dilocod.cli import main
    from dilocod.learner import daemon
    from dilocod.ops import logging

    seen: list[int] = []
    monkeypatch.setattr(daemon, "run_learner", lambda setup, notifier=None: seen.append(setup.seed))
    monkeypatch.setattr(logging, "configure_logging", lambda **_: None)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["learner", "--syncer", "127.0.0.1:7171", "--streams", "1", "--codec", "none", *args]
    result = CliRunner().invoke(main, argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert len(seen) == 1
    return seen[0]


def test_learners_get_different_seeds_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    seeds = {name: _learner_seed_via_cli(monkeypatch, "--id", name) for name in ("site-a", "site-b", "c")}
    assert len(set(seeds.values())) == 3
    # A restart of one id reads the same data: the seed depends on the id alone.
    assert _learner_seed_via_cli(monkeypatch, "--id", "site-a") == seeds["site-a"]
    assert seeds["site-a"] == learner_seed("site-a")


def test_an_explicit_seed_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _learner_seed_via_cli(monkeypatch, "--id", "site-a", "--seed", "0") == 0
    assert _learner_seed_via_cli(monkeypatch, "--id", "site-b", "--seed", "0") == 0
    toml = tmp_path / "learner.toml"
    toml.write_text("seed = 5\n")
    assert _learner_seed_via_cli(monkeypatch, "--id", "site-a", "--config", str(toml)) == 5


def test_the_default_seed_is_stable_and_fits_every_rng() -> None:
    # Pinned: a change would make every restarted learner read different data than before.
    assert learner_seed("site-a") == 1805979647
    seeds = [learner_seed(f"learner-{i}") for i in range(1000)]
    assert all(0 <= seed < 2**31 for seed in seeds)
    assert len(set(seeds)) == len(seeds)
    done = subprocess.run(
        [sys.executable, "-c", "from dilocod.config import learner_seed; print(learner_seed('site-a'))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    assert int(done.stdout) == learner_seed("site-a")  # not Python's salted hash()


def test_the_syncer_guard_defaults_are_the_guard_s_own() -> None:
    """config.py stays torch-free, so it writes the guard's defaults out instead of importing them."""
    from dilocod.outer import guard

    config = SyncerConfig()
    assert config.max_norm_ratio == guard.DEFAULT_MAX_NORM_RATIO
    assert config.max_fragment_ratio == guard.DEFAULT_MAX_FRAGMENT_RATIO


@pytest.mark.parametrize("value", [0, -1.0, "inf", "nan", "many"])
def test_a_meaningless_max_fragment_ratio_is_refused_naming_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match="--max-fragment-ratio"):
        load_config(SyncerConfig, SYNCER_FIELDS, None, {"max_fragment_ratio": value})


def test_max_fragment_ratio_is_a_syncer_flag() -> None:
    from dilocod.cli import main

    result = CliRunner().invoke(main, ["syncer", "--help"])
    assert result.exit_code == 0 and "--max-fragment-ratio" in result.output


def test_quorum_all_is_lockstep_and_needs_overlap_within_sync_every() -> None:
    config = load_config(
        SyncerConfig, SYNCER_FIELDS, None, {"quorum": "all", "overlap": "4", "sync_every": "4"}
    )
    assert config.lockstep and config.quorum == 0
    assert not load_config(SyncerConfig, SYNCER_FIELDS, None, {"quorum": "3"}).lockstep
    with pytest.raises(ConfigError, match="--overlap: 5 is above --sync-every"):
        load_config(SyncerConfig, SYNCER_FIELDS, None, {"quorum": "all", "overlap": "5", "sync_every": "4"})
    with pytest.raises(ConfigError, match=r"--quorum: '0' is neither all nor an integer 1\.\.65536"):
        load_config(SyncerConfig, SYNCER_FIELDS, None, {"quorum": "0"})
