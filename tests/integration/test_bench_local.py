"""`dilocod bench run` and `dilocod bench local` on real processes, real sockets and real network
namespaces shaped with tc tbf: the JSON has its documented shape, the shaper really caps the link,
the namespaces are always removed (after a run, when the client fails, on SIGTERM), a wrong secret
gets nothing, and without root the command says what it needs and makes nothing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.host import need_root, need_tool
from dilocod.linkbench.client import RunPlan
from dilocod.linkbench.local import (
    EMULATOR_ENV,
    PREFIX,
    LocalBenchError,
    apply_sysctls,
    netem_available,
    our_namespaces,
    parse_sysctls,
    run_local,
    shaped_link,
)
from dilocod.linkbench.report import schema_errors
from dilocod.ops.processes import read_ready_line, stop_process
from dilocod.tuning.advice import load_advice

RUN_TIMEOUT_S = 300
DEADLINE_S = 120.0
SMALL = ["--size", "8MiB", "--duration", "1s", "--data", "bf16"]


def dilocod(*args: str) -> list[str]:
    return [sys.executable, "-m", "dilocod", *args]


def namespaces_of(pid: int) -> list[str]:
    return [name for name in our_namespaces() if name.startswith(f"{PREFIX}-{pid}-")]


@pytest.fixture
def _root() -> None:
    need_root("`dilocod bench local` makes network namespaces and shapes them with tc")
    for tool in ("ip", "tc"):
        need_tool(tool, "Debian/Ubuntu: apt-get install iproute2")


@pytest.mark.usefixtures("_root")
def test_a_shaped_link_is_measured_and_everything_is_removed(tmp_path: Path) -> None:
    out = tmp_path / "links.json"
    command = dilocod("bench", "local", "--rate", "2gbit", "--streams", "1,2", "--codec", "none,zstd,auto")
    process = subprocess.Popen(
        [*command, *SMALL, "--json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    stdout, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
    assert process.returncode == 0, stderr.decode()
    assert namespaces_of(process.pid) == []
    document = json.loads(out.read_text())
    assert schema_errors(document) == []
    (link,) = document["links"]
    assert link["rate"] == "2gbit"
    # The shaper is in the path: every sender gets most of the tbf rate and none much more (the
    # bucket lets its 4 MB through at line rate after each pause, a few % of 8 MiB transfers;
    # the same path unshaped carries ten times as much).
    assert 1.5 < link["raw_gbps"] < 2.6
    assert link["gloo_gbps"] is not None and 1.0 < link["gloo_gbps"] < 2.6
    assert {(r["codec"], r["streams"]) for r in link["runs"]} == {
        (codec, streams) for codec in ("none", "zstd", "auto") for streams in (1, 2)
    }
    for run in link["runs"]:
        assert run["gbps"] > 0 and run["ratio_to_raw"] > 0 and run["ratio_to_none"] > 0
        if run["codec"] == "none":
            assert run["ratio_to_none"] == 1.0  # itself, repeat by repeat
    zstd = [r["compression_ratio"] for r in link["runs"] if r["codec"] == "zstd"]
    assert min(zstd) > 1.1  # bf16 gradient-shaped data compresses; random bytes would not
    assert link["recommendation"]["streams"] in (1, 2)
    assert link["recommendation"]["codec"] in ("none", "lz4", "zstd")
    assert link["rtt_ms"] > 0 and link["round_trip_ms"] > 0
    assert "link 2gbit" in stdout.decode() and "x none" in stdout.decode()  # the table for a person


@pytest.mark.usefixtures("_root")
def test_namespaces_are_removed_when_the_client_fails() -> None:
    # A chunk size of zero is refused by the client's own option check (exit 78) after the
    # namespaces and the server exist.
    with pytest.raises(LocalBenchError, match="exited with 78"):
        run_local(["2gbit"], RunPlan(size_bytes=1 << 20, streams=(1,), codecs=("none",), chunk_bytes=0))
    assert namespaces_of(os.getpid()) == []


@pytest.mark.usefixtures("_root")
def test_sigterm_mid_run_removes_everything() -> None:
    command = dilocod("bench", "local", "--rate", "2gbit,5gbit", "--size", "64MiB", "--duration", "60s")
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not namespaces_of(process.pid):
            assert process.poll() is None, f"bench local exited with {process.returncode} before measuring"
            assert time.monotonic() < deadline, "bench local made no namespace in time"
            time.sleep(0.1)  # polling a condition (the namespace list), not waiting out an event
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 130
    finally:
        stop_process(process, signal.SIGKILL, timeout_s=10)
    assert namespaces_of(process.pid) == []


@contextlib.contextmanager
def bench_server(secret: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`dilocod bench serve` on loopback with this secret; it must exit 0 on SIGTERM at the end."""
    serve = dilocod("bench", "serve", "--listen", "127.0.0.1:0", "--secret-file", str(secret), "--ready-json")
    server = subprocess.Popen(serve, stdout=subprocess.PIPE)
    try:
        yield server, int(read_ready_line(server, "bench serve")["port"])
    finally:
        assert stop_process(server, timeout_s=10) == 0


def test_a_wrong_secret_gets_nothing(tmp_path: Path) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("a" * 64 + "\n")
    bad.write_text("b" * 64 + "\n")
    with bench_server(good) as (server, port):
        run = dilocod("bench", "run", "--target", f"127.0.0.1:{port}", "--secret-file", str(bad), *SMALL)
        done = subprocess.run(
            [*run, "--no-save-advice"], capture_output=True, timeout=RUN_TIMEOUT_S, check=False
        )
        assert done.returncode == 1
        assert "AUTH_FAILED" in done.stderr.decode()
        assert done.stdout == b""
        assert server.poll() is None  # the server goes on


def test_bench_run_saves_advice_for_the_syncer_named(tmp_path: Path) -> None:
    secret, advice = tmp_path / "secret", tmp_path / "advice.json"
    secret.write_text("c" * 64 + "\n")
    with bench_server(secret) as (_, port):
        run = dilocod("bench", "run", "--target", f"127.0.0.1:{port}", "--secret-file", str(secret), *SMALL)
        run += ["--streams", "1", "--codec", "none,auto", "--advice-for", "10.1.2.3:7070", "--json", "-"]
        env = {**os.environ, "DILOCOD_ADVICE": str(advice)}
        done = subprocess.run(run, capture_output=True, timeout=RUN_TIMEOUT_S, check=False, env=env)
        assert done.returncode == 0, done.stderr.decode()
    document = json.loads(done.stdout)
    assert schema_errors(document) == []
    assert document["links"][0]["rate"] == "as found"
    saved = load_advice("10.1.2.3:7070", advice)
    assert saved is not None and saved.target == "10.1.2.3:7070"
    recommendation = document["links"][0]["recommendation"]
    assert (saved.streams, saved.codec) == (recommendation["streams"], recommendation["codec"])
    assert load_advice("10.9.9.9:7070", advice) is None  # saved for one syncer, not for any
    assert f"saved to {advice} for 10.1.2.3:7070" in done.stderr.decode()


def test_without_root_it_says_so_and_makes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # The euid is the seam: a venv in a root-owned checkout is not always runnable by another user.
    need_tool("ip", "Debian/Ubuntu: apt-get install iproute2")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LocalBenchError, match="needs root: run it with sudo"):
        run_local(["2gbit"], RunPlan(size_bytes=1 << 20))
    monkeypatch.undo()
    # Its own namespaces only: another run of the suite on this host may be making some.
    assert namespaces_of(os.getpid()) == []


def _delay_args() -> list[str]:
    """How this host delays a link: netem where the kernel has it, else the WAN emulator named by
    DILOCOD_WAN_EMULATOR or the one built beside this repository (../shared/wanem); a skip with
    the reason when there is neither (an external tool: never required of a host)."""
    if netem_available():
        return []
    named = os.environ.get(EMULATOR_ENV)
    beside = Path(__file__).resolve().parents[2].parent / "shared" / "wanem" / "wanem.sh"
    emulator = Path(named) if named else beside
    if not emulator.is_file() or (not named and not (emulator.parent / "wanem").is_file()):
        pytest.skip(f"no netem in this kernel and no WAN emulator ({EMULATOR_ENV} or a built {beside})")
    return ["--wan-emulator", str(emulator)]


@pytest.mark.slow
@pytest.mark.usefixtures("_root")
def test_a_link_with_a_round_trip_carries_the_learners_own_stream_count_near_raw(tmp_path: Path) -> None:
    """One delayed link end to end (2 Gbit/s, 30 ms): the RTT measured across it is the one asked
    for, the row `--streams auto` opens is the learner's choice at that RTT, and its pushes come
    near the raw multi-stream rate of the same link in the same run (the targets themselves are
    measured by the benchmark, bench/notes/wan-rtt.md; this bound only catches a transport that
    stops striping or stalls at real RTT)."""
    out = tmp_path / "links.json"
    command = dilocod("bench", "local", "--rate", "2gbit", "--rtt", "30ms", *_delay_args())
    command += ["--streams", "auto", "--codec", "none", "--data", "random", "--size", "64MiB"]
    command += ["--duration", "4s", "--json", str(out)]

    def listed() -> str:
        return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout

    before = listed()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
    assert process.returncode == 0, stderr.decode()
    assert listed() == before  # ours and the emulator's namespaces are gone
    document = json.loads(out.read_text())
    assert schema_errors(document) == []
    (link,) = document["links"]
    assert link["emulated_rtt_ms"] == 30.0 and 25.0 <= link["rtt_ms"] <= 60.0, link["rtt_ms"]
    (row,) = link["runs"]
    assert row["streams_auto"] and row["streams"] == link["auto_streams"]["streams"] >= 2
    assert row["gbps"] >= 0.7 * link["raw_gbps"], (row, link["raw"])


@pytest.mark.usefixtures("_root")
def test_the_sysctl_file_is_applied_inside_the_namespaces_and_never_on_the_host() -> None:
    """--sysctls: the repository's file inside a shaped link's two namespaces; keys a namespace
    does not have (default_qdisc) or cannot set (net.core.rmem_max) are reported, and the host's
    own values stay as they were."""

    def sysctl(key: str, namespace: str | None = None) -> str:
        command = (
            ["sysctl", "-n", key]
            if namespace is None
            else ["ip", "netns", "exec", namespace, "sysctl", "-n", key]
        )
        return " ".join(subprocess.run(command, capture_output=True, text=True, check=True).stdout.split())

    host = {key: sysctl(key) for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.core.rmem_max")}
    settings = parse_sysctls((Path(__file__).parents[2] / "systemd/sysctl.d/60-dilocod-wan.conf").read_text())
    with shaped_link("2gbit", 0) as link:
        done = apply_sysctls(link, settings)
        for namespace in (link.server, link.client):
            assert sysctl("net.ipv4.tcp_rmem", namespace) == "4096 131072 134217728"
            assert sysctl("net.ipv4.tcp_wmem", namespace) == "4096 65536 134217728"
    assert done["applied"]["net.ipv4.tcp_slow_start_after_idle"] == "0"
    assert "net.core.default_qdisc" in done["not_in_namespace"]
    assert set(done["applied"]) | set(done["not_in_namespace"]) == {key for key, _ in settings}
    assert {key: sysctl(key) for key in host} == host
