"""The command line stays light and says clearly what is wrong.

`dilocod --help` and `dilocod status` must not import torch (2.5 s here); that is checked by what
the process imported, not by timing it, so the test cannot flake on a busy machine.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dilocod.config import EX_CONFIG, ConfigError, parse_address, parse_int_list, parse_list, parse_size

HEAVY = ("torch", "numpy")


def _imports_after(argv: list[str]) -> tuple[int, set[str], str]:
    """Run the CLI in a fresh interpreter and report which heavy modules it loaded."""
    probe = (
        "import sys, json\n"
        "from dilocod.cli import main\n"
        f"sys.argv = ['dilocod', *{argv!r}]\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    code = exc.code if isinstance(exc.code, int) else 1\n"
        f"    heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        "    print(json.dumps({'code': code, 'heavy': heavy}), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    report = json.loads(done.stderr.strip().splitlines()[-1])
    return report["code"], set(report["heavy"]), done.stdout + done.stderr


def test_help_does_not_import_torch() -> None:
    code, heavy, output = _imports_after(["--help"])
    assert code == 0
    assert heavy == set()
    assert "bench" in output and "status" in output


def test_status_does_not_import_torch_and_reports_unreachable() -> None:
    with socket.socket() as probe:  # a port nobody listens on: bind, read it, close
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, heavy, output = _imports_after(["status", "--syncer", f"127.0.0.1:{port}", "--timeout", "5"])
    assert code == 1
    assert heavy == set()
    assert f"cannot reach 127.0.0.1:{port}" in output


def test_listening_beyond_loopback_without_secret_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dilocod", "bench", "serve", "--listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == EX_CONFIG
    assert "--secret-file" in done.stderr and "--insecure" in done.stderr


def test_short_secret_file_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("short\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocod",
            "bench",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--secret-file",
            str(secret),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == EX_CONFIG
    assert "holds 5 bytes; at least 16 are needed" in done.stderr


BEYOND_LOOPBACK = [
    pytest.param(["syncer", "--listen", "0.0.0.0:0", "--state-dir", "unused"], "listening on", id="syncer"),
    pytest.param(["learner", "--syncer", "10.0.0.7:7070", "--id", "a"], "connecting to", id="learner"),
    pytest.param(["status", "--syncer", "syncer.example:7070"], "connecting to", id="status"),
]


@pytest.mark.parametrize(("argv", "where"), BEYOND_LOOPBACK)
def test_beyond_loopback_without_credentials_exits_78_naming_the_fix(argv: list[str], where: str) -> None:
    """Before torch is imported or anything is bound or dialled."""
    code, heavy, output = _imports_after(argv)
    assert code == EX_CONFIG
    assert heavy == set()
    assert where in output and "without a shared secret or TLS" in output
    for fix in ("--secret-file FILE", "openssl rand -hex 32", "--tls-cert FILE", "--insecure"):
        assert fix in output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tls-cert", "c.pem"], "--tls-key, --tls-ca missing"),
        (
            ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem", "--insecure"],
            "exclude each other",
        ),
        (["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem"], "cannot load the TLS files"),
    ],
)
def test_bad_tls_options_exit_78(tmp_path: Path, extra: list[str], message: str) -> None:
    argv = ["learner", "--syncer", "10.0.0.7:7070", "--id", "a"]
    code, heavy, output = _imports_after(
        [*argv, *[str(tmp_path / a) if a.endswith(".pem") else a for a in extra]]
    )
    assert code == EX_CONFIG and heavy == set()
    assert message in output


def test_a_learner_on_loopback_needs_no_secret() -> None:
    """No --secret-file and no --insecure on loopback: it gets past the credentials to its entry."""
    code, _, output = _imports_after(
        ["learner", "--syncer", "127.0.0.1:9", "--id", "a", "--entry", "no_such_module:make"]
    )
    assert code == EX_CONFIG
    assert "no module named 'no_such_module'" in output
    assert "secret" not in output


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("64KiB", 65536), ("256MiB", 256 << 20), ("1GiB", 1 << 30), ("1.5GB", 1_500_000_000)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "12XB", "MiB", "0"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="--size"):
        parse_size(text, key="--size")


def test_parse_address_forms() -> None:
    assert (parse_address("10.0.0.1:7070").host, parse_address("10.0.0.1:7070").port) == ("10.0.0.1", 7070)
    assert parse_address("[::1]:9").host == "::1"
    assert parse_address("syncer", default_port=7070).port == 7070
    assert parse_address("127.0.0.5:1").is_loopback
    assert not parse_address("0.0.0.0:1").is_loopback
    for bad in ("host", "host:99999", "a:b:c"):
        with pytest.raises(ConfigError, match="--syncer"):
            parse_address(bad, key="--syncer")


def test_parse_lists() -> None:
    assert parse_list("none, zstd", key="--codec", choices=("none", "lz4", "zstd")) == ["none", "zstd"]
    with pytest.raises(ConfigError, match="brotli"):
        parse_list("none,brotli", key="--codec", choices=("none", "lz4", "zstd"))
    assert parse_int_list("1,4", key="--streams", low=1, high=64) == [1, 4]
    with pytest.raises(ConfigError, match="65"):
        parse_int_list("65", key="--streams", low=1, high=64)
