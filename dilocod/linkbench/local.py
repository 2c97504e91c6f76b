"""`dilocod bench local`: the WAN rates an operator plans for, reproduced on one host. For each rate,
two network namespaces joined by a veth pair shaped with `tc qdisc ... tbf` in both directions,
`dilocod bench serve` in one and `dilocod bench run` in the other, so everything crosses the
shaped link; "loopback" runs both ends on the loopback device of one fresh namespace.

Everything made here carries this process's id in its name and is removed on the way out: after
each link, on error, on Ctrl-C and on SIGTERM. Namespaces left by a run that was killed with
SIGKILL are found by that id at the next start (their process is gone) and removed then. Root is
needed (namespaces, links, qdiscs); without it the command says so and changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from dilocod.linkbench.client import RunPlan
from dilocod.ops.processes import read_ready_line, stop_process

PREFIX = "dilocod-bench"
LOOPBACK = "loopback"
#: tbf's bucket holds this much of the rate: 2 ms (1.25 MB at 5 Gbit, 0.5 MB at 2 Gbit) lets any
#: sender here reach 0.956 of the rate, and adds little to a transfer that starts with it full
#: (a 4 MB bucket let an 8 MiB transfer through at 1.4x the rate).
TBF_BURST_S = 0.002
#: Never below a few GSO segments of 64 KiB, or the shaper caps below its rate.
TBF_MIN_BURST_BYTES = 256 * 1024
TBF_LATENCY = "20ms"
CLIENT_TIMEOUT_S = 600.0
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$", re.IGNORECASE)


class LocalBenchError(Exception):
    """The local benchmark cannot run here (not root, no ip/tc) or a step of it failed."""


def parse_rate(text: str) -> str:
    """'2gbit', '500mbit' or 'loopback' (checked, normalised); ValueError naming the problem."""
    text = text.strip().lower()
    if text == LOOPBACK or _RATE.match(text):
        return text
    raise ValueError(f"{text!r} is not a tc rate (like 2gbit or 500mbit) or 'loopback'")


def rate_gbps(rate: str) -> float | None:
    match = _RATE.match(rate)
    if match is None:
        return None
    scale = {"k": 1e-6, "m": 1e-3, "g": 1.0, None: 1e-9}[match.group(2) and match.group(2).lower()]
    return float(match.group(1)) * scale


def burst_bytes(rate: str) -> int:
    gbps = rate_gbps(rate) or 0.0
    return max(TBF_MIN_BURST_BYTES, int(gbps * 1e9 / 8 * TBF_BURST_S))


def require_tools() -> None:
    if os.geteuid() != 0:
        raise LocalBenchError(
            "`dilocod bench local` makes network namespaces, a veth pair and tc qdiscs, which needs "
            "root: run it with sudo (it removes everything it makes), or measure a real link with "
            "`dilocod bench serve` at one end and `dilocod bench run` at the other"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LocalBenchError(f"`dilocod bench local` needs {' and '.join(missing)} (iproute2) on PATH")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise LocalBenchError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def our_namespaces() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout.splitlines()
    return [line.split()[0] for line in listed if line.startswith(PREFIX + "-")]


def remove_stale() -> list[str]:
    """Delete namespaces of earlier runs whose process no longer exists; their names."""
    removed = []
    for name in our_namespaces():
        match = re.match(rf"^{PREFIX}-(\d+)-", name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    return removed


@dataclass(frozen=True, slots=True)
class Link:
    """The namespaces of one rate: the server listens in `server`, the client runs in `client`."""

    rate: str
    server: str
    client: str
    server_ip: str

    def exec_in(self, namespace: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", namespace, *argv]


@contextlib.contextmanager
def shaped_link(rate: str, index: int) -> Iterator[Link]:
    """Make the namespaces (and the shaped veth pair) of one rate; remove them on exit."""
    base = f"{PREFIX}-{os.getpid()}-{index}"
    made: list[str] = []
    try:
        if rate == LOOPBACK:
            made.append(base)
            _ip("netns", "add", base)
            _ip("-n", base, "link", "set", "lo", "up")
            yield Link(rate, base, base, "127.0.0.1")
            return
        server, client = f"{base}-s", f"{base}-c"
        for name in (server, client):
            _ip("netns", "add", name)
            made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        # Interface names are at most 15 bytes; made inside the server namespace, so they can
        # never clash with the host's or another run's, and go away with it.
        _ip("-n", server, "link", "add", "dlb-s", "type", "veth", "peer", "name", "dlb-c", "netns", client)
        subnet = f"10.{200 + index % 50}.{os.getpid() % 250}"
        for name, dev, host in ((server, "dlb-s", 1), (client, "dlb-c", 2)):
            _ip("-n", name, "addr", "add", f"{subnet}.{host}/30", "dev", dev)
            _ip("-n", name, "link", "set", dev, "up")
            # Both directions are shaped: pushes go client to server, the echoed update back.
            tc = ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate]
            tc += ["burst", str(burst_bytes(rate)), "latency", TBF_LATENCY]
            done = subprocess.run(
                ["ip", "netns", "exec", name, *tc], capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                raise LocalBenchError(f"`{' '.join(tc)}` failed: {done.stderr.strip()}")
        yield Link(rate, server, client, f"{subnet}.1")
    finally:
        for name in reversed(made):
            _ip("netns", "delete", name, check=False)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every `finally` here removes what it made."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_args(plan: RunPlan) -> list[str]:
    """`dilocod bench run` options that reproduce plan in the child."""
    args = ["--size", str(plan.size_bytes), "--streams", ",".join(map(str, plan.streams))]
    args += ["--codec", ",".join(plan.codecs), "--duration", f"{plan.duration_s}s", "--data", plan.data]
    args += ["--chunk", str(plan.chunk_bytes), "--assumed-rtt", f"{plan.assumed_rtt_s * 1e3}ms"]
    args += ["--vs", "gloo"] if plan.vs_gloo else ["--vs", "none"]
    # Both ends share this host's cores: each may count on half of them for its codec.
    args += ["--threads", str(plan.threads or max(1, (os.cpu_count() or 2) // 2))]
    return args


def measure_rate(link: Link, plan: RunPlan, secret_file: Path, extra_env: dict[str, str]) -> dict[str, Any]:
    python = [sys.executable, "-m", "dilocod", "bench"]
    env = {**os.environ, **extra_env}
    serve = [
        *python,
        "serve",
        "--listen",
        f"{link.server_ip}:0",
        "--secret-file",
        str(secret_file),
        "--ready-json",
    ]
    server = subprocess.Popen(link.exec_in(link.server, serve), stdout=subprocess.PIPE, env=env)
    try:
        port = int(read_ready_line(server, f"bench server in {link.server}")["port"])
        run = [*python, "run", "--target", f"{link.server_ip}:{port}", "--secret-file", str(secret_file)]
        run += [*run_args(plan), "--json", "-", "--no-save-advice", "--no-table"]
        # The child's progress bar and table go to this terminal (stderr); its JSON comes here.
        client = subprocess.run(
            link.exec_in(link.client, run),
            stdout=subprocess.PIPE,
            env=env,
            timeout=CLIENT_TIMEOUT_S,
            check=False,
        )
        if client.returncode != 0:
            raise LocalBenchError(f"`dilocod bench run` over {link.rate} exited with {client.returncode}")
        result = json.loads(client.stdout)
    finally:
        stop_process(server, timeout_s=10)
    (measured,) = result["links"]
    return {"rate": link.rate, **{k: v for k, v in measured.items() if k != "rate"}}


def run_local(
    rates: Sequence[str], plan: RunPlan, *, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Measure every rate; {"links": [...]} in the order given."""
    require_tools()
    remove_stale()
    links = []
    with _terminate_as_interrupt(), tempfile.TemporaryDirectory(prefix="dilocod-bench-") as tmp:
        secret_file = Path(tmp) / "secret"
        # Authenticated like any link beyond loopback: the run exercises the real handshake.
        secret_file.write_text(secrets.token_hex(32) + "\n")
        secret_file.chmod(0o600)
        for index, rate in enumerate(rates):
            with shaped_link(rate, index) as link:
                links.append(measure_rate(link, plan, secret_file, extra_env or {}))
    return {"links": links}
