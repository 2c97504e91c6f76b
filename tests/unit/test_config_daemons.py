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
    ConfigError,
    LearnerConfig,
    SyncerConfig,
    default_text,
    defaults,
    flag_of,
    learner_seed,
    load_config,
    settings,
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
    "answer": "due",
    "save_every_s": 30,
    "join_timeout_s": 5,
    "progress_every_s": 2,
    "seed": 7,
    "network": "thread",
}

DAEMONS: dict[str, type[Any]] = {"syncer": SyncerConfig, "learner": LearnerConfig}
LISTED = [(daemon, key) for daemon, cls in DAEMONS.items() for key in settings(cls)]


@pytest.mark.parametrize(("daemon", "key"), LISTED)
def test_every_listed_key_is_accepted_by_load_config_and_the_dataclass(
    tmp_path: Path, daemon: str, key: str
) -> None:
    cls = DAEMONS[daemon]
    toml = tmp_path / "daemon.toml"
    value = SAMPLE_VALUES[key]
    toml.write_text(f"{key.replace('_', '-')} = {_toml(value)}\n")
    config = load_config(cls, toml, {})
    assert getattr(config, key) == settings(cls)[key].parse(value, key)


def test_a_key_the_daemon_does_not_list_is_refused_naming_it(tmp_path: Path) -> None:
    toml = tmp_path / "syncer.toml"
    toml.write_text('network = "process"\n')
    with pytest.raises(ConfigError, match="unknown key 'network'"):
        load_config(SyncerConfig, toml, {})


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
    """dilocod.config stays torch-free, so it writes the guard's defaults out instead of importing them."""
    from dilocod.outer import guard

    config = SyncerConfig()
    assert config.max_norm_ratio == guard.DEFAULT_MAX_NORM_RATIO
    assert config.max_fragment_ratio == guard.DEFAULT_MAX_FRAGMENT_RATIO


@pytest.mark.parametrize("value", [0, -1.0, "inf", "nan", "many"])
def test_a_meaningless_max_fragment_ratio_is_refused_naming_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match="--max-fragment-ratio"):
        load_config(SyncerConfig, None, {"max_fragment_ratio": value})


def test_max_fragment_ratio_is_a_syncer_flag() -> None:
    from dilocod.cli import main

    result = CliRunner().invoke(main, ["syncer", "--help"])
    assert result.exit_code == 0 and "--max-fragment-ratio" in result.output


def test_quorum_all_is_lockstep_and_needs_overlap_within_sync_every() -> None:
    config = load_config(SyncerConfig, None, {"quorum": "all", "overlap": "4", "sync_every": "4"})
    assert config.lockstep and config.quorum == 0
    assert not load_config(SyncerConfig, None, {"quorum": "3"}).lockstep
    with pytest.raises(ConfigError, match="--overlap: 5 is above --sync-every"):
        load_config(SyncerConfig, None, {"quorum": "all", "overlap": "5", "sync_every": "4"})
    with pytest.raises(ConfigError, match=r"--quorum: '0' is neither all nor an integer 1\.\.65536"):
        load_config(SyncerConfig, None, {"quorum": "0"})


# --------------------------------------------------------------------------- the one declaration


@pytest.mark.parametrize("cls", DAEMONS.values())
def test_every_field_is_a_declared_setting_with_help(cls: type[Any]) -> None:
    assert list(settings(cls)) == [field.name for field in dataclasses.fields(cls)]
    assert all(spec.help.strip() and spec.help.endswith(".") for spec in settings(cls).values())


@pytest.mark.parametrize("daemon", DAEMONS)
def test_help_explains_every_setting_with_its_default(daemon: str) -> None:
    """The command's options are the declared settings, in order, each with its help and its
    default (or [required]) as --help prints them."""
    from dilocod.cli import main

    cls = DAEMONS[daemon]
    command = main.commands[daemon]
    options = {param.name: param for param in command.params if param.name in settings(cls)}
    assert list(options) == list(settings(cls))
    for name, spec in settings(cls).items():
        option = options[name]
        assert option.opts == [flag_of(name)] and option.default is None  # None: not given
        assert option.help == f"{spec.help}  {default_text(cls, name)}"
        assert option.help.endswith("]") and ("[default: " in option.help or "[required]" in option.help)
    page = " ".join(CliRunner().invoke(main, [daemon, "--help"], terminal_width=100).output.split())
    for name, spec in settings(cls).items():
        assert f"{flag_of(name)} " in page and " ".join(spec.help.split()) in page


def test_defaults_are_shown_as_they_are_typed() -> None:
    assert default_text(SyncerConfig, "chunk") == "[default: 1MiB]"
    assert default_text(SyncerConfig, "checkpoint_every_s") == "[default: 300]"
    assert default_text(SyncerConfig, "listen") == "[default: 0.0.0.0:7070]"
    assert default_text(SyncerConfig, "insecure") == "[default: off]"
    assert default_text(LearnerConfig, "streams") == "[default: auto]"
    assert default_text(LearnerConfig, "syncer") == "[required]"


def _flag_text(value: object) -> object:
    """What click hands over for a flag given this value: its text (True for a switch)."""
    return value if isinstance(value, bool) else str(value)


@pytest.mark.parametrize(("daemon", "key"), LISTED)
def test_toml_and_flags_reach_the_same_field(tmp_path: Path, daemon: str, key: str) -> None:
    cls = DAEMONS[daemon]
    toml = tmp_path / "daemon.toml"
    toml.write_text(f"{key.replace('_', '-')} = {_toml(SAMPLE_VALUES[key])}\n")
    from_toml = load_config(cls, toml, {})
    from_flag = load_config(cls, None, {key: _flag_text(SAMPLE_VALUES[key])})
    assert getattr(from_toml, key) == getattr(from_flag, key) != defaults(cls)[key]
    assert from_toml == from_flag
    # Flags win over the file; a flag not given (None) leaves the file's value.
    assert load_config(cls, toml, {key: None}) == from_toml


@pytest.mark.parametrize(("daemon", "key"), LISTED)
def test_a_bad_value_names_its_key(tmp_path: Path, daemon: str, key: str) -> None:
    cls = DAEMONS[daemon]
    toml = tmp_path / "daemon.toml"
    toml.write_text(f"{key.replace('_', '-')} = [1]\n")
    with pytest.raises(ConfigError, match=f"^{key.replace('_', '-')} \\(in {toml}\\): "):
        load_config(cls, toml, {})
    if not isinstance(defaults(cls)[key], bool):  # a switch's flag has no text to get wrong
        with pytest.raises(ConfigError, match=f"^{flag_of(key)}: "):
            load_config(cls, None, {key: ""})


def test_an_unknown_flag_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="--network: not a setting"):
        load_config(SyncerConfig, None, {"network": "thread"})


def test_the_copies_beside_the_math_are_the_math_s_own() -> None:
    """config stays torch-free and stands on no daemon, so it writes the merges, apply modes and
    answer schedules out too."""
    from dilocod.config.daemons import ANSWERS, APPLY_MODES, MERGES
    from dilocod.learner.cadence import ANSWERS as CADENCE_ANSWERS
    from dilocod.outer import APPLY_MODES as OUTER_APPLY_MODES
    from dilocod.outer.step import MERGES as OUTER_MERGES

    assert MERGES == OUTER_MERGES and APPLY_MODES == OUTER_APPLY_MODES
    assert ANSWERS == CADENCE_ANSWERS


# ------------------------------------------------------- the parts' configurations, derived


def test_the_parts_take_their_defaults_from_the_declaration() -> None:
    from dilocod.learner.link import LinkConfig
    from dilocod.learner.runtime import RuntimeConfig
    from dilocod.syncer.rounds import RoundConfig

    syncer, learner = SyncerConfig(), LearnerConfig()
    assert RoundConfig.of(syncer, fragments=syncer.fragments) == RoundConfig()
    assert RuntimeConfig.of(learner) == RuntimeConfig(entry=learner.entry)
    link = LinkConfig("h", 1, "l", None)
    assert (link.streams, link.codec, link.precision) == (learner.streams, learner.codec, learner.precision)
    assert (link.chunk_bytes, link.join_timeout_s) == (learner.chunk, learner.join_timeout_s)


def test_the_parts_are_derived_from_the_daemon_s_configuration() -> None:
    """Every setting a part shares with its daemon reaches it when set off its default."""
    from dilocod.learner.link import LinkConfig
    from dilocod.learner.runtime import RuntimeConfig
    from dilocod.syncer.rounds import RoundConfig

    flags = {key: _flag_text(SAMPLE_VALUES[key]) for key in settings(SyncerConfig)}
    syncer = load_config(SyncerConfig, None, {**flags, "overlap": "2", "sync_every": "12"})
    rounds = RoundConfig.of(syncer, fragments=3)
    shared = {f.name for f in dataclasses.fields(RoundConfig)} - {"fragments", "ema_alpha"}
    assert shared and all(getattr(rounds, name) == getattr(syncer, name) for name in shared)
    assert rounds.fragments == 3
    flags = {key: _flag_text(SAMPLE_VALUES[key]) for key in settings(LearnerConfig)}
    learner = load_config(LearnerConfig, None, flags)
    runtime = RuntimeConfig.of(learner)
    assert all(getattr(runtime, f.name) == getattr(learner, f.name) for f in dataclasses.fields(runtime))
    link = LinkConfig.of(learner, secret=b"s" * 16)
    assert learner.syncer is not None
    assert (link.host, link.port, link.learner_id) == (learner.syncer.host, learner.syncer.port, learner.id)
    assert (link.streams, link.codec, link.precision) == (learner.streams, learner.codec, learner.precision)
    assert (link.chunk_bytes, link.join_timeout_s) == (learner.chunk, learner.join_timeout_s)
