"""The files under systemd/: both units pass `systemd-analyze verify` and keep their hardening score,
say what the daemons need (Type=notify, the watchdog, exit 78 not restarted, a stop timeout above
the daemons' own shutdown grace, the credential and state directory wired to the flags the CLI
has), the example configurations load through dilocod's own loader, the sysctl file sets what the
WAN needs, and the sysusers file is valid.

The tests that run systemd-analyze skip without it, naming the package to install; .ci/run installs
it and makes them required (devkit/host.py). The shipped units name the binary where a
real install puts it (/opt/dilocod/venv/bin/dilocod); verify checks that ExecStart's binary exists
and is executable, so it runs on copies whose ExecStart names this virtualenv's `dilocod` instead,
nothing else changed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from devkit.host import need_tool
from dilocod.cli import main as cli
from dilocod.config import (
    EX_CONFIG,
    LearnerConfig,
    SyncerConfig,
    defaults,
    load_config,
    settings,
)
from dilocod.learner.daemon import NETWORK_STOP_TIMEOUT_S
from dilocod.transport.options import TransportOptions

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
UNITS = ("dilocod-syncer.service", "dilocod-learner@.service")
#: Where the shipped units expect dilocod: the install path systemd/README.md describes.
INSTALLED_DILOCOD = "/opt/dilocod/venv/bin/dilocod"
#: `systemd-analyze security` exposure (0-100, lower is tighter) the units must stay within; the
#: learner keeps GPU devices, any system call and W+X memory for CUDA, hence its higher figure.
EXPOSURE_LIMITS = {"dilocod-syncer.service": 20, "dilocod-learner@.service": 40}
#: SyncerService.serve drains merges in flight for up to 60 s on SIGTERM before its checkpoint.
SYNCER_MERGE_DRAIN_S = 60.0
VERIFY_TIMEOUT_S = 120.0


def _systemd_analyze() -> str:
    return need_tool("systemd-analyze", "Debian/Ubuntu: apt-get install systemd; .ci/run does")


def _venv_dilocod() -> Path:
    """The `dilocod` console script of the interpreter running the tests."""
    candidate = Path(sys.executable).parent / "dilocod"
    found = candidate if candidate.is_file() else shutil.which("dilocod")
    if found is None:
        pytest.fail("no `dilocod` executable next to the test interpreter or on PATH: pip install -e .")
    return Path(found)


def _testable_copy(unit: str, directory: Path) -> Path:
    text = (SYSTEMD / unit).read_text()
    assert f"ExecStart={INSTALLED_DILOCOD} " in text, f"{unit} must start {INSTALLED_DILOCOD}"
    copy = directory / unit
    copy.write_text(text.replace(f"ExecStart={INSTALLED_DILOCOD} ", f"ExecStart={_venv_dilocod()} "))
    return copy


def _verify(paths: list[Path]) -> list[str]:
    """systemd-analyze verify's exit status and its diagnostics about these units (it exits 0 on an
    unknown key or a bad value and only warns, so the warnings are the finding)."""
    done = subprocess.run(
        [_systemd_analyze(), "verify", "--man=no", *map(str, paths)],
        check=False,
        capture_output=True,
        text=True,
        timeout=VERIFY_TIMEOUT_S,
    )
    # Diagnostics name the file (path:line) or the unit (a template as NAME@i.service).
    names = [p.name.split("@")[0].removesuffix(".service") for p in paths]
    output = (done.stdout + done.stderr).splitlines()
    findings = [line for line in output if any(name in line for name in names)]
    if done.returncode != 0:
        findings.append(f"exit {done.returncode}: {done.stdout}{done.stderr}")
    return findings


def _settings(unit: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of every assignment, repeated keys kept in order."""
    section, settings = "", []
    for raw in (SYSTEMD / unit).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.append((section, key, value))
    return settings


def _one(unit: str, key: str) -> str:
    values = [v for _, k, v in _settings(unit) if k == key]
    assert len(values) == 1, f"{unit}: {key} set {len(values)} times"
    return values[0]


def _seconds(timespan: str) -> float:
    units = {"s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    match = re.fullmatch(r"(\d+)\s*([a-z]+)?", timespan)
    assert match is not None, timespan
    return int(match.group(1)) * units[match.group(2) or "s"]


def test_both_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    copies = [_testable_copy(unit, tmp_path) for unit in UNITS]
    assert _verify(copies) == []


def test_verify_findings_are_caught(tmp_path: Path) -> None:
    # The check above must fail on what verify only warns about.
    broken = tmp_path / "dilocod-syncer.service"
    text = _testable_copy("dilocod-syncer.service", tmp_path).read_text()
    broken.write_text(text.replace("WatchdogSec=60s", "WatchdogSec=soon\nWatchdogSeconds=60"))
    findings = _verify([broken])
    assert any("WatchdogSec" in line for line in findings), findings
    assert any("WatchdogSeconds" in line for line in findings), findings


@pytest.mark.parametrize("unit", UNITS)
def test_hardening_exposure_stays_low(unit: str, tmp_path: Path) -> None:
    analyze = _systemd_analyze()
    version = subprocess.run([analyze, "--version"], capture_output=True, text=True, check=True).stdout
    if int(version.split()[1]) < 250:
        pytest.skip("systemd-analyze security --offline needs systemd 250 or later")
    done = subprocess.run(
        [
            analyze,
            "security",
            "--offline=true",
            f"--threshold={EXPOSURE_LIMITS[unit]}",
            str(_testable_copy(unit, tmp_path)),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=VERIFY_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr


@pytest.mark.parametrize("unit", UNITS)
def test_the_units_give_the_daemons_what_they_expect(unit: str) -> None:
    command = "syncer" if unit.startswith("dilocod-syncer") else "learner"
    assert _one(unit, "Type") == "notify"
    assert _one(unit, "NotifyAccess") == "main"
    assert _seconds(_one(unit, "WatchdogSec")) >= 60
    assert _one(unit, "Restart") == "on-failure"
    assert _one(unit, "RestartPreventExitStatus") == str(EX_CONFIG)
    for key in ("NoNewPrivileges", "PrivateTmp", "ProtectHome"):
        assert _one(unit, key) == "yes"
    assert _one(unit, "ProtectSystem") == "strict"
    # SIGTERM's own grace must end before systemd's SIGKILL.
    grace_s = (
        SYNCER_MERGE_DRAIN_S + TransportOptions().handshake_timeout_s
        if command == "syncer"
        else NETWORK_STOP_TIMEOUT_S
    )
    assert _seconds(_one(unit, "TimeoutStopSec")) > 2 * grace_s

    # ExecStart: the secret from the credential, the state in the StateDirectory, and every flag
    # one the command really has.
    exec_start = _one(unit, "ExecStart").split()
    assert exec_start[:2] == [INSTALLED_DILOCOD, command]
    flags = dict(zip(exec_start[2::2], exec_start[3::2], strict=True))
    name, _, _ = _one(unit, "LoadCredential").partition(":")
    assert flags["--secret-file"] == f"%d/{name}"
    assert flags["--state-dir"] == f"%S/{_one(unit, 'StateDirectory')}"
    known = {opt for param in cli.commands[command].params for opt in param.opts}
    assert set(flags) <= known


def test_the_learner_keeps_its_gpus() -> None:
    unit = "dilocod-learner@.service"
    keys = {key for _, key, _ in _settings(unit)}
    assert "PrivateDevices" not in keys
    assert _one(unit, "DevicePolicy") == "closed"
    allowed = [v.split()[0] for _, k, v in _settings(unit) if k == "DeviceAllow"]
    for device in ("char-nvidia-frontend", "char-nvidia-uvm", "/dev/nvidiactl", "/dev/nvidia-uvm"):
        assert device in allowed
    assert all(v.split()[1] == "rw" for _, k, v in _settings(unit) if k == "DeviceAllow")


def test_the_example_configs_load_through_the_real_loader() -> None:
    syncer = load_config(SyncerConfig, SYSTEMD / "syncer.toml.example", {})
    learner = load_config(LearnerConfig, SYSTEMD / "learner.toml.example", {})
    # The units pass these two; a value in the file would only be overridden.
    for config in (syncer, learner):
        assert config.state_dir is None and config.secret_file is None
        assert not config.insecure
    assert learner.syncer is not None and learner.syncer.port == syncer.listen.port
    assert learner.id is not None and learner.device.startswith("cuda")
    # The firewall rules in the README open the port the example listens on.
    readme = (SYSTEMD / "README.md").read_text()
    assert f"dport {syncer.listen.port} accept" in readme
    assert f"ufw allow {syncer.listen.port}/tcp" in readme


#: Keys an example sets off their default on purpose (keys without a default show an example).
SET_OFF_DEFAULT = {"syncer": set(), "learner": {"device", "progress_every_s"}}
#: The units pass these as flags, so the examples leave them out.
PASSED_BY_THE_UNITS = {"state_dir", "secret_file"}
#: `key = value`, set or commented out (`# key = value`): a line of an example that names a key.
EXAMPLE_LINE = re.compile(r"^(#\s*)?([a-z][a-z0-9_-]*)\s*=\s*(.+)$")


@pytest.mark.parametrize(("daemon", "cls"), [("syncer", SyncerConfig), ("learner", LearnerConfig)])
def test_the_example_configs_show_every_setting_and_its_default(daemon: str, cls: type) -> None:
    """Every key an example names, set or commented out, is a declared setting whose value parses;
    every setting but the two the units pass is there; a value shown is the default unless the key
    has none or is set off it on purpose (SET_OFF_DEFAULT)."""
    declared, default = settings(cls), defaults(cls)
    shown: dict[str, object] = {}
    for line in (SYSTEMD / f"{daemon}.toml.example").read_text().splitlines():
        match = EXAMPLE_LINE.match(line)
        if match is None:
            continue
        key = match.group(2).replace("-", "_")
        assert key in declared, f"{daemon}.toml.example: {match.group(2)} is no setting of {daemon}"
        assert key not in shown, f"{daemon}.toml.example names {key} twice"
        shown[key] = declared[key].parse(tomllib.loads(f"v = {match.group(3)}")["v"], key)
    assert set(declared) - set(shown) == PASSED_BY_THE_UNITS
    for key, value in shown.items():
        if default[key] is not None and key not in SET_OFF_DEFAULT[daemon]:
            assert value == default[key], (
                f"{daemon}.toml.example: {key} = {value!r}, default {default[key]!r}"
            )


def test_the_sysctl_file_tunes_tcp_for_the_wan() -> None:
    path = SYSTEMD / "sysctl.d" / "60-dilocod-wan.conf"
    settings: dict[str, str] = {}
    explained = False  # a comment block since the last blank line
    for line in path.read_text().splitlines():
        if not line.strip():
            explained = False
        elif line.startswith("#"):
            explained = True
        else:
            key, _, value = line.partition("=")
            settings[key.strip()] = " ".join(value.split())
            assert explained, f"{key.strip()}: say why in a comment right above it"
    bdp_bytes = 5e9 * 0.100 / 8  # 5 Gbit/s x 100 ms
    for key in ("net.core.rmem_max", "net.core.wmem_max"):
        assert int(settings[key]) >= max(64 * 2**20, 2 * bdp_bytes)
    for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
        low, default, high = map(int, settings[key].split())
        assert low <= default <= high and high >= 2 * bdp_bytes
    assert settings["net.core.default_qdisc"] == "fq"
    assert settings["net.ipv4.tcp_congestion_control"] == "bbr"
    assert settings["net.ipv4.tcp_mtu_probing"] == "1"
    assert settings["net.ipv4.tcp_slow_start_after_idle"] == "0"
    # Every key is one this kernel knows (a typo would only be logged by systemd-sysctl at boot).
    for key in settings:
        assert Path("/proc/sys", *key.split(".")).exists(), key


def test_the_sysusers_file_is_valid(tmp_path: Path) -> None:
    sysusers = need_tool("systemd-sysusers", "Debian/Ubuntu: apt-get install systemd; .ci/run does")
    done = subprocess.run(
        [sysusers, f"--root={tmp_path}", "--dry-run", str(SYSTEMD / "sysusers.d" / "dilocod.conf")],
        check=False,
        capture_output=True,
        text=True,
        timeout=VERIFY_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    # Older systemd writes the name without quotes.
    assert re.search(r"Creating user '?dilocod'? ", done.stdout + done.stderr), done.stdout + done.stderr
