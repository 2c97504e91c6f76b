"""`dilocod bench local`: the WAN rates an operator plans for, reproduced on one host. For each rate,
two network namespaces joined by a veth pair shaped with `tc qdisc ... tbf` in both directions,
`dilocod bench serve` in one and `dilocod bench run` in the other, so everything crosses the
shaped link; "loopback" runs both ends on the loopback device of one fresh namespace.

With a round-trip time (`--rtt`), each link also delays: with netem where the kernel has it (rate
and half the RTT each way, `tc qdisc ... netem`), else through an external emulator named by
`--wan-emulator` or DILOCOD_WAN_EMULATOR: a program called as `EMULATOR up RATE RTT_MS` (with
`--loss PCT` after it for a lossy link, as wanem takes it) that makes
two namespaces, prints a line `A: netns NAME ... addr IP` for the client side and `B: ...` for the
server side, and is called as `EMULATOR down` to remove them (the interface of this repository's
`../shared/wanem/wanem.sh`, whose RATE is like `5g`). With neither, the command says both ways.

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

from dilocod.linkbench.client import RunPlan, streams_text
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
#: netem's queue in packets: a bandwidth-delay product of 5 Gbit/s x 100 ms in 1500-byte packets.
NETEM_LIMIT_PACKETS = 50_000
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$", re.IGNORECASE)


#: Where the external WAN emulator may be named instead of --wan-emulator.
EMULATOR_ENV = "DILOCOD_WAN_EMULATOR"
_EMULATOR_SIDE = re.compile(r"^\s*([AB]):\s+netns\s+(\S+)\s+.*\baddr\s+([0-9.]+)")
_RTT = re.compile(r"^(\d+(?:\.\d+)?)\s*ms$")


class LocalBenchError(Exception):
    """The local benchmark cannot run here (not root, no ip/tc) or a step of it failed."""


def parse_rtt(text: str) -> float:
    """'30ms', '100ms' or '0ms' -> milliseconds; ValueError naming the problem."""
    match = _RTT.match(text.strip().lower())
    if match is None:
        raise ValueError(f"{text!r} is not a round-trip time in milliseconds (like 30ms or 100ms)")
    return float(match.group(1))


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
    rtt_ms: float = 0.0
    #: How the delay is made: "" (none), "netem", or the external emulator's path.
    delay_by: str = ""
    #: Random loss each way, percent of packets (made with the delay).
    loss_pct: float = 0.0

    def exec_in(self, namespace: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", namespace, *argv]


def parse_sysctls(text: str) -> list[tuple[str, str]]:
    """`key = value` lines of a sysctl.d file (comments, blank lines and the `-` that tells
    systemd to ignore a failure dropped); ValueError naming a line that is neither."""
    out = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.lstrip("-").partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"line {number}: {line!r} is not `key = value`")
        out.append((key.strip(), " ".join(value.split())))
    return out


def apply_sysctls(link: Link, settings: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Set each sysctl inside the link's namespaces (never the host's: a key that is not per
    network namespace, like net.core.rmem_max or default_qdisc, cannot be set from inside one and
    is reported as such); {"applied": {key: value}, "not_in_namespace": [key, ...]}."""
    if settings and shutil.which("sysctl") is None:
        raise LocalBenchError("--sysctls needs the sysctl command (Debian/Ubuntu: apt-get install procps)")
    applied: dict[str, str] = {}
    skipped: list[str] = []
    for key, value in settings:
        ok = True
        for namespace in dict.fromkeys((link.server, link.client)):
            done = subprocess.run(
                link.exec_in(namespace, ["sysctl", "-q", "-w", f"{key}={value}"]),
                capture_output=True,
                text=True,
                check=False,
            )
            ok = ok and done.returncode == 0
        if ok:
            applied[key] = value
        else:
            skipped.append(key)
    return {"applied": applied, "not_in_namespace": skipped}


def netem_available() -> bool:
    """Whether this kernel has netem: a qdisc added on the loopback device of a scratch namespace."""
    name = f"{PREFIX}-{os.getpid()}-netem"
    try:
        _ip("netns", "add", name)
        tc = ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
        done = subprocess.run(["ip", "netns", "exec", name, *tc], capture_output=True, text=True, check=False)
        return done.returncode == 0
    finally:
        _ip("netns", "delete", name, check=False)


def choose_delay(rtts: Sequence[float], emulator: str | None) -> str:
    """ "" when no link has a delay, else "netem" or the external emulator's path; LocalBenchError
    naming both ways when neither is there."""
    if not any(rtt > 0 for rtt in rtts):
        return ""
    if netem_available():
        return "netem"
    named = emulator or os.environ.get(EMULATOR_ENV)
    if not named:
        raise LocalBenchError(
            "a round-trip time needs a delay: this kernel has no netem (`modprobe sch_netem` where the "
            f"module exists), and no external emulator was named (--wan-emulator PATH or {EMULATOR_ENV})"
        )
    path = shutil.which(named) or named
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise LocalBenchError(f"the WAN emulator {named!r} is not an executable file")
    return path


def emulator_rate(rate: str) -> str:
    """A tc rate ('5gbit', '500mbit') as the emulator takes it ('5g', '500m')."""
    return rate[: -len("bit")]


def emulator_sides(printed: str) -> dict[str, tuple[str, str]]:
    """The sides `EMULATOR up` named: {"A": (namespace, ip), "B": (...)}, from its A: and B: lines."""
    found = (_EMULATOR_SIDE.match(line) for line in printed.splitlines())
    return {m.group(1): (m.group(2), m.group(3)) for m in found if m}


@contextlib.contextmanager
def emulated_link(rate: str, rtt_ms: float, emulator: str, loss_pct: float = 0.0) -> Iterator[Link]:
    """The external emulator's two namespaces: B (the server) listens, A runs the client."""
    command = [emulator, "up", emulator_rate(rate), f"{rtt_ms:g}"]
    command += ["--loss", f"{loss_pct:g}"] if loss_pct > 0 else []
    up = subprocess.run(command, capture_output=True, text=True, check=False)
    try:
        if up.returncode != 0:
            raise LocalBenchError(f"`{emulator} up` failed: {(up.stderr or up.stdout).strip()}")
        sides = emulator_sides(up.stdout)
        if set(sides) != {"A", "B"}:
            raise LocalBenchError(f"`{emulator} up` named no A: and B: sides: {up.stdout!r}")
        yield Link(rate, sides["B"][0], sides["A"][0], sides["B"][1], rtt_ms, emulator, loss_pct)
    finally:
        subprocess.run([emulator, "down"], capture_output=True, text=True, check=False)


@contextlib.contextmanager
def shaped_link(
    rate: str, index: int, rtt_ms: float = 0.0, delay_by: str = "", loss_pct: float = 0.0
) -> Iterator[Link]:
    """Make the namespaces (and the shaped veth pair) of one rate; remove them on exit. A loss
    (percent of packets, each way) needs a delay: netem or the emulator makes both."""
    if loss_pct > 0 and not (rtt_ms > 0 and delay_by):
        raise LocalBenchError("--loss needs --rtt: the loss is made by netem or the emulator with the delay")
    if rtt_ms > 0 and delay_by not in ("", "netem"):
        if rate == LOOPBACK:
            raise LocalBenchError("loopback has no rate for an emulated link: give a rate with --rtt")
        with emulated_link(rate, rtt_ms, delay_by, loss_pct) as link:
            yield link
        return
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
            # Named as made before it exists: a SIGTERM right after `ip netns add` returns (the
            # namespace is there, the append not yet run) must not leave it behind.
            made.append(name)
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        # Interface names are at most 15 bytes; made inside the server namespace, so they can
        # never clash with the host's or another run's, and go away with it.
        _ip("-n", server, "link", "add", "dlb-s", "type", "veth", "peer", "name", "dlb-c", "netns", client)
        subnet = f"10.{200 + index % 50}.{os.getpid() % 250}"
        for name, dev, host in ((server, "dlb-s", 1), (client, "dlb-c", 2)):
            _ip("-n", name, "addr", "add", f"{subnet}.{host}/30", "dev", dev)
            _ip("-n", name, "link", "set", dev, "up")
            # Both directions are shaped: pushes go client to server, the echoed update back.
            if rtt_ms > 0:  # netem: the rate and half the round trip each way
                tc = ["tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{rtt_ms / 2:g}ms"]
                tc += ["rate", rate, "limit", str(NETEM_LIMIT_PACKETS)]
                tc += ["loss", f"{loss_pct:g}%"] if loss_pct > 0 else []
            else:
                tc = ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate]
                tc += ["burst", str(burst_bytes(rate)), "latency", TBF_LATENCY]
            done = subprocess.run(
                ["ip", "netns", "exec", name, *tc], capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                raise LocalBenchError(f"`{' '.join(tc)}` failed: {done.stderr.strip()}")
        yield Link(rate, server, client, f"{subnet}.1", rtt_ms, "netem" if rtt_ms > 0 else "", loss_pct)
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
    args = ["--size", str(plan.size_bytes), "--streams", streams_text(plan.streams)]
    args += ["--codec", ",".join(plan.codecs), "--duration", f"{plan.duration_s}s", "--data", plan.data]
    args += ["--chunk", str(plan.chunk_bytes), "--assumed-rtt", f"{plan.assumed_rtt_s * 1e3}ms"]
    args += ["--vs", "gloo"] if plan.vs_gloo else ["--vs", "none"]
    args += ["--congestion", plan.congestion]
    # Both ends share this host's cores: each may count on half of them for its codec.
    args += ["--threads", str(plan.threads or max(1, (os.cpu_count() or 2) // 2))]
    return args


def measure_rate(
    link: Link,
    plan: RunPlan,
    secret_file: Path,
    extra_env: dict[str, str],
    sysctls: Sequence[tuple[str, str]] = (),
    sysctls_from: str = "",
) -> dict[str, Any]:
    tuned = {"sysctls": {"file": sysctls_from, **apply_sysctls(link, sysctls)}} if sysctls else {}
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
    delay = {"emulated_rtt_ms": link.rtt_ms, "delay_by": link.delay_by} if link.rtt_ms > 0 else {}
    if link.loss_pct > 0:
        delay["loss_pct"] = link.loss_pct
    return {"rate": link.rate, **delay, **tuned, **{k: v for k, v in measured.items() if k != "rate"}}


def run_local(
    rates: Sequence[str],
    plan: RunPlan,
    *,
    extra_env: dict[str, str] | None = None,
    rtts: Sequence[float] = (0.0,),
    emulator: str | None = None,
    sysctls: Path | None = None,
    loss_pct: float = 0.0,
) -> dict[str, Any]:
    """Measure every rate at every RTT (ms); {"links": [...]} rate by rate, in the order given.
    With `sysctls` (a sysctl.d file), its settings are applied inside each link's namespaces first."""
    try:
        settings = parse_sysctls(sysctls.read_text()) if sysctls is not None else []
    except (OSError, ValueError) as exc:
        raise LocalBenchError(f"--sysctls {sysctls}: {exc}") from None
    require_tools()
    remove_stale()
    delay_by = choose_delay(rtts, emulator)
    links = []
    with _terminate_as_interrupt(), tempfile.TemporaryDirectory(prefix="dilocod-bench-") as tmp:
        secret_file = Path(tmp) / "secret"
        # Authenticated like any link beyond loopback: the run exercises the real handshake.
        secret_file.write_text(secrets.token_hex(32) + "\n")
        secret_file.chmod(0o600)
        cases = [(rate, rtt) for rate in rates for rtt in rtts]
        for index, (rate, rtt) in enumerate(cases):
            with shaped_link(rate, index, rtt, delay_by if rtt > 0 else "", loss_pct) as link:
                source = sysctls.name if sysctls else ""
                links.append(measure_rate(link, plan, secret_file, extra_env or {}, settings, source))
    return {"links": links}
