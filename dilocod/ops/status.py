"""`dilocod status`: one short session with role "status" that asks for and prints a daemon's
status, or says why none came back. The status schema belongs to the daemon; this module only
fetches and formats it."""

from __future__ import annotations

import asyncio
import math
import os
import ssl as ssl_module
from typing import Any

from dilocod.config import Address
from dilocod.transport.endpoints import connect
from dilocod.transport.errors import HandshakeFailed
from dilocod.transport.options import TransportOptions
from dilocod.wire.errors import ErrorCode
from dilocod.wire.messages import StatusRequest, StatusResponse


async def fetch_status(
    address: Address, *, secret: bytes | None, timeout_s: float, ssl: ssl_module.SSLContext | None = None
) -> dict[str, Any]:
    options = TransportOptions(handshake_timeout_s=timeout_s)
    async with asyncio.timeout(timeout_s):
        session = await connect(
            address.host,
            address.port,
            peer_id=f"status-{os.getpid()}",
            role="status",
            secret=secret,
            ssl=ssl,
            streams=0,
            options=options,
        )
        try:
            await session.send(StatusRequest())
            while True:
                item = await session.recv()
                if isinstance(item, StatusResponse):
                    return item.status
        finally:
            await session.close("status read")


def describe_failure(address: Address, exc: BaseException, *, tls: bool = False) -> str:
    """For a person: why no status came back from `address`. A refused authentication (a wrong
    or missing shared secret, a TLS certificate one end does not accept) is told apart from a
    network that does not carry the connection: the fixes differ. `tls`: this end used TLS."""
    if isinstance(exc, HandshakeFailed) and exc.code is ErrorCode.AUTH_FAILED:
        return (
            f"authentication with {address} refused ({exc}): a wrong shared secret; --secret-file "
            "must hold the secret the syncer was started with"
        )
    if isinstance(exc, HandshakeFailed) and exc.code is ErrorCode.AUTH_REQUIRED:
        return (
            f"authentication with {address} refused ({exc}): pass --secret-file exactly when the "
            "syncer has a shared secret, with the same secret"
        )
    if isinstance(exc, ssl_module.SSLError):
        return (
            f"the TLS handshake with {address} failed ({exc}): check --tls-cert, "
            "--tls-key and --tls-ca (--tls-ca must sign the syncer's certificate, and the syncer's "
            "CA this end's), and that the syncer uses TLS"
        )
    if isinstance(exc, HandshakeFailed) and exc.code not in (None, ErrorCode.TIMEOUT):
        return f"{address} refused the session: {exc}"
    if type(exc) is ConnectionError or (isinstance(exc, HandshakeFailed) and exc.code is None):
        # Connected, then the peer hung up in the handshake: what a TLS syncer does to a client
        # whose certificate it does not accept, or that speaks no TLS at all.
        cause = (
            "with TLS, the syncer did not accept this end's certificate (is --tls-cert signed by "
            "the CA the syncer trusts?)"
            if tls
            else "does the syncer require TLS (--tls-cert, --tls-key, --tls-ca)?"
        )
        return f"{address} closed the connection in the handshake ({exc}): authentication refused; {cause}"
    return f"cannot reach {address}: {exc}"


def format_status(status: dict[str, Any]) -> str:
    """For a person: the syncer's summary, its fragments and its learners as tables; any other
    daemon's status as key: value lines."""
    if status.get("role") != "syncer":
        width = max((len(str(k)) for k in status), default=0)
        return "\n".join(f"{key:<{width}}  {value}" for key, value in sorted(status.items()))
    lag = status.get("loop_lag_ms", {})
    # A syncer from before the window was reported gave 1 / the mean reported step time instead.
    window = status.get("steps_per_s_window_s")
    rate_label = f"steps/s (last {window} s)" if window else "steps/s (1/step)"
    lines = [
        f"syncer {status['incarnation']}  up {status['uptime_s']:.0f} s  clock {status['clock']}  "
        f"next round {status['next_round']}",
        f"rounds merged {status['rounds_merged']}  abandoned {status['rounds_abandoned']}  "
        f"skipped {_skipped(status.get('rounds_skipped'))}  "
        f"quorum: {describe_quorum_sizes(status['quorum_sizes'])}  "
        f"grace waited {status['grace_waited_s']:.2f} s",
        f"received {_bytes(status['bytes_in'])}  sent {_bytes(status['bytes_out'])}  "
        f"rejected pushes {status['rejected_pushes']}  checkpoints {status['checkpoints_written']}  "
        f"loop lag p99 {lag.get('p99', 0.0):.1f} ms",
        # Absent from a syncer older than CHUNK_RESEND and JOIN's held and partial.
        f"chunks asked again {status.get('chunks_asked_again', 0)}  "
        f"fragments held at rejoins {status.get('fragments_held_at_join', 0)}  "
        f"chunks resumed {status.get('chunks_resumed', 0)}",
        "",
        "fragment versions: " + " ".join(f"{f['index']}:{f['version']}" for f in status["fragments"]),
        "",
        f"{'learner':<20} {'connected':>9} {rate_label:>18} {'steps':>8} {'merged':>7} {'weight share':>13} "
        f"{'goodput':>8} {'pushes wasted':>14}",
    ]
    for learner in status["learners"]:
        connected = "yes" if learner.get("connected") else "no"
        rate, steps = _figure(learner.get("steps_per_s"), ".2f"), _figure(learner.get("steps", 0), "d")
        merged, share = (
            _figure(learner.get("contributions"), "d"),
            _figure(learner.get("weight_share"), ".1%"),
        )
        goodput = _figure(learner.get("goodput", 0.0), ".1%")
        lines.append(
            f"{learner.get('id', '?')!s:<20} {connected:>9} {rate:>18} {steps:>8} {merged:>7} {share:>13} "
            f"{goodput:>8} {_wasted(learner):>14}"
        )
    if not status["learners"]:
        lines.append("(no learner has joined yet)")
    unlisted = status.get("learners_total", 0) - len(status["learners"])
    if isinstance(unlisted, int) and unlisted > 0:
        lines.append(f"({unlisted} more learners not listed: those that left longest ago)")
    return "\n".join(lines)


def _figure(value: object, spec: str) -> str:
    """One learner's figure as `spec` formats it, or "?" for what is not a finite number of the
    expected kind: a row never stops the table."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "?"
    if spec == "d":
        return f"{value:d}" if isinstance(value, int) else "?"
    return f"{value:{spec}}" if math.isfinite(value) else "?"


def _wasted(learner: dict[str, Any]) -> str:
    """Pushes refused or released unmerged, as a share of the pushes sent ("-" before any, or
    from a syncer that does not count them)."""
    pushes, wasted = learner.get("pushes", 0), learner.get("pushes_wasted", 0)
    if not (isinstance(pushes, int) and isinstance(wasted, int)) or pushes <= 0:
        return "-"
    return f"{wasted / pushes:.1%}"


def describe_quorum_sizes(sizes: dict[str, int]) -> str:
    """How many learners the merged rounds took, in words, the commonest first: {"1": 40, "2": 12}
    reads "40 rounds with 1 learner, 12 with 2"."""
    if not sizes:
        return "no round merged yet"
    parts = []
    for size, count in sorted(((int(k), v) for k, v in sizes.items()), key=lambda kv: (-kv[1], kv[0])):
        if parts:
            parts.append(f"{count} with {size}")
        else:
            rounds = "round" if count == 1 else "rounds"
            parts.append(f"{count} {rounds} with {size} {'learner' if size == 1 else 'learners'}")
    return ", ".join(parts)


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _skipped(by_reason: object) -> str:
    """Rounds skipped, by reason ("0" from a syncer that does not say; "?" for what is not counts)."""
    if not by_reason:
        return "0"
    if not isinstance(by_reason, dict) or not all(isinstance(v, int) for v in by_reason.values()):
        return "?"
    return f"{sum(by_reason.values())} (" + ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items())) + ")"
