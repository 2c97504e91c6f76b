"""How many data connections a link needs: the bandwidth-delay-product arithmetic of the stream
count (choose_streams, auto_streams), the window one TCP stream reaches under the host's sysctls
(TcpSettings, read from /proc/sys by read_tcp_settings), and the warning that names the sysctl and
the value that would lift a cap (bdp_warning).

Pure but for read_tcp_settings. Must not import torch, asyncio or socket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MiB = 1 << 20


#: The sysctl file that raises every limit below for 2-5 Gbit/s at up to 100 ms (both hosts).
SYSCTL_FILE = "systemd/sysctl.d/60-dilocod-wan.conf"


#: Stock Linux values, used for a sysctl this host does not expose (another OS, a locked sandbox).
LINUX_DEFAULTS = {
    "rmem_max": 212_992,
    "wmem_max": 212_992,
    "tcp_rmem": (4096, 131_072, 6_291_456),
    "tcp_wmem": (4096, 16_384, 4_194_304),
    "tcp_adv_win_scale": 1,
}


def _window_from_space(space: int, adv_win_scale: int) -> int:
    """The receive window a buffer of `space` bytes allows (the kernel's tcp_win_from_space before
    Linux 6.6): the rest is reserved for the kernel's own per-packet overhead."""
    if adv_win_scale > 0:
        return space - (space >> adv_win_scale)
    return space >> -adv_win_scale


def _space_for_window(window: int, adv_win_scale: int) -> int:
    """The inverse: the smallest buffer whose window is at least `window` bytes."""
    if adv_win_scale > 0:
        return math.ceil(window * (1 << adv_win_scale) / ((1 << adv_win_scale) - 1))
    return window << -adv_win_scale


@dataclass(frozen=True, slots=True)
class TcpSettings:
    """The host's TCP sysctls that bound what one stream can carry (read_tcp_settings)."""

    congestion_control: str
    available_congestion_control: tuple[str, ...]
    rmem_max: int
    wmem_max: int
    tcp_rmem: tuple[int, int, int]
    tcp_wmem: tuple[int, int, int]
    #: net.ipv4.tcp_adv_win_scale: the share of a receive buffer kept for the kernel's overhead
    #: (1: half). Linux 6.6 replaced it by a measured ratio that is near one half for full-size
    #: Ethernet segments, so the arithmetic below stays a fair estimate there too.
    adv_win_scale: int = 1

    @property
    def max_window_bytes(self) -> int:
        """The largest window one stream can reach with dilocod's sockets: window_bytes(None)."""
        return self.window_bytes(None)

    def window_bytes(self, fixed_buffer_bytes: int | None = None) -> int:
        """The most bytes one stream can keep in flight, per round trip.

        dilocod.transport.sockets.tune leaves Linux autotuning on unless
        TransportOptions.socket_buffer_bytes fixes the buffers, and no daemon fixes them; with
        autotuning, a receive buffer grows up to tcp_rmem[2] and the window to the part of it not
        reserved for overhead (tcp_rmem[2] / 2 by default), while the send buffer, which holds
        every unacknowledged byte, grows up to tcp_wmem[2] (large TSO packets make its overhead
        small). rmem_max and wmem_max do not matter then. With fixed buffers of B bytes
        (SO_RCVBUF/SO_SNDBUF) the kernel takes min(B, rmem_max) (or wmem_max) and doubles it for
        the same overhead, so about min(B, rmem_max, wmem_max) is in flight. The sender's limit
        and the receiver's both apply; this host's settings stand in for the peer's (install the
        same sysctl file on both ends).
        """
        if fixed_buffer_bytes is not None:
            return min(fixed_buffer_bytes, self.rmem_max, self.wmem_max)
        return min(_window_from_space(self.tcp_rmem[2], self.adv_win_scale), self.tcp_wmem[2])


@dataclass(frozen=True, slots=True)
class StreamsChoice:
    streams: int
    #: What one stream carries at this RTT: window / rtt, in Gbit/s.
    per_stream_gbps: float
    reason: str
    #: Which sysctls to raise, and to what, when max_streams cannot fill rate x rtt; else None.
    sysctl_advice: str | None


def _per_stream_gbps(window_bytes: int, rtt_s: float) -> float:
    return math.inf if rtt_s <= 0 else window_bytes * 8 / rtt_s / 1e9


def _bdp_bytes(rate_gbps: float, rtt_s: float) -> float:
    return rate_gbps * 1e9 / 8 * max(rtt_s, 0.0)


def _streams_needed(bdp_bytes: float, window_bytes: int) -> int:
    # The small tolerance keeps an exact multiple (2.0000000001 after float rounding) at 2.
    return max(1, math.ceil(bdp_bytes / window_bytes - 1e-9))


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB" if n < 10 * MiB else f"{n / MiB:.0f} MiB"


def _round_up_mib(n: float) -> int:
    """n rounded up to a power of two of MiB: sysctl values a person recognises."""
    return MiB << max(0, math.ceil(math.log2(max(n, 1) / MiB)))


def choose_streams(
    rate_gbps: float,
    rtt_s: float,
    window_bytes: int,
    *,
    min_streams: int = 1,
    max_streams: int = 16,
    headroom: float = 1.0,
) -> StreamsChoice:
    """Enough streams to keep rate x rtt (the bandwidth-delay product) in flight: ceil(bdp x
    headroom / window), clamped to min_streams..max_streams.

    A TCP stream carries at most one window per round trip: a 4 MiB window at 100 ms carries
    4 MiB x 8 / 0.1 s = 0.34 Gbit/s, so 5 Gbit/s needs 15 streams. When max_streams cannot fill
    the link, sysctl_advice says how far to raise the windows (assuming the default overhead
    halving of receive buffers).
    """
    if window_bytes <= 0:
        raise ValueError(f"window must be positive, not {window_bytes}")
    if not 1 <= min_streams <= max_streams:
        raise ValueError(f"need 1 <= min_streams <= max_streams, not {min_streams}, {max_streams}")
    if headroom < 1.0:
        raise ValueError(f"headroom must be at least 1, not {headroom}")
    per_stream = _per_stream_gbps(window_bytes, rtt_s)
    bdp = _bdp_bytes(rate_gbps, rtt_s)
    needed = _streams_needed(bdp * headroom, window_bytes)
    streams = min(max(needed, min_streams), max_streams)
    reason = (
        f"{rate_gbps:.2f} Gbit/s x {rtt_s * 1e3:.3g} ms RTT = {bdp / 1e6:.3g} MB in flight; one stream's "
        f"{_mib(window_bytes)} window carries {per_stream:.3g} Gbit/s, so {needed} stream"
        f"{'s fill' if needed != 1 else ' fills'} the link"
        + (f" with {headroom:g} x headroom" if headroom > 1.0 else "")
    )
    advice = None
    if needed > max_streams:
        window = bdp / max_streams
        rmem, wmem = _round_up_mib(_space_for_window(math.ceil(window), 1)), _round_up_mib(window)
        reason += f"; capped at {max_streams}, which carry {per_stream * max_streams:.2f} Gbit/s"
        advice = (
            f"raise the third value of net.ipv4.tcp_rmem to at least {rmem} ({_mib(rmem)}) and of "
            f"net.ipv4.tcp_wmem to at least {wmem} ({_mib(wmem)}) on both hosts, so that {max_streams} "
            f"streams keep {bdp / 1e6:.3g} MB in flight (see {SYSCTL_FILE})"
        )
    elif streams > needed:
        reason += f"; {streams} is the least used"
    return StreamsChoice(streams, per_stream, reason, advice)


#: --streams auto without advice: the rate the stream count is planned for (the top of the 2-5
#: Gbit/s links dilocod is built for); at least two data connections, so that losing one leaves
#: another to resend its chunks on; at most 64 (a session's max_data_connections).
AUTO_RATE_GBPS = 5.0


AUTO_MIN_STREAMS = 2


AUTO_MAX_STREAMS = 64


#: Streams beyond what the windows' maxima need: a cubic stream's window spends most of its time
#: below its maximum (at 100 ms and 4 MiB windows one carried 0.26 Gbit/s, 0.8 of window / RTT),
#: and a connection costs little once open (docs/design.md).
AUTO_HEADROOM = 1.5


def auto_streams(rtt_s: float, settings: TcpSettings) -> StreamsChoice:
    """What `--streams auto` opens without advice, at this RTT with this host's TCP windows: the
    learner's choice for every session, and `dilocod bench`'s "auto" row."""
    return choose_streams(
        AUTO_RATE_GBPS,
        rtt_s,
        settings.max_window_bytes,
        min_streams=AUTO_MIN_STREAMS,
        max_streams=AUTO_MAX_STREAMS,
        headroom=AUTO_HEADROOM,
    )


def bdp_warning(rate_gbps: float, rtt_s: float, settings: TcpSettings, streams: int) -> str | None:
    """A sentence naming the sysctls to raise when `streams` streams cannot keep rate x rtt in
    flight with this host's windows; None when they can."""
    window = settings.max_window_bytes
    if streams < 1 or window <= 0:
        return None
    carried = streams * _per_stream_gbps(window, rtt_s)
    if carried >= rate_gbps:
        return None
    bdp = _bdp_bytes(rate_gbps, rtt_s)
    need = math.ceil(bdp / streams)
    fixes = []
    if _window_from_space(settings.tcp_rmem[2], settings.adv_win_scale) < need:
        rmem = _round_up_mib(_space_for_window(need, settings.adv_win_scale))
        fixes.append(f"net.ipv4.tcp_rmem's maximum from {settings.tcp_rmem[2]} to {rmem}")
    if settings.tcp_wmem[2] < need:
        fixes.append(f"net.ipv4.tcp_wmem's maximum from {settings.tcp_wmem[2]} to {_round_up_mib(need)}")
    return (
        f"{streams} stream{'s' if streams != 1 else ''} with {_mib(window)} windows carry at most "
        f"{carried:.2f} Gbit/s at {rtt_s * 1e3:.3g} ms RTT, less than {rate_gbps:.2f}: raise "
        f"{' and '.join(fixes)} on both hosts ({SYSCTL_FILE} sets both to 128 MiB)"
    )


def read_tcp_settings(proc_root: Path = Path("/proc/sys")) -> TcpSettings:
    """The TCP sysctls of this host, from /proc/sys (or a copy of its layout under proc_root).

    A file that is missing or unreadable gives the stock Linux value (LINUX_DEFAULTS) and, for
    the congestion control, "unknown": this feeds estimates, never a refusal to run.
    """

    def read(name: str) -> list[str] | None:
        try:
            return (proc_root / name).read_text().split()
        except (OSError, UnicodeDecodeError):
            return None

    def integers(name: str, default: Any, count: int) -> Any:
        words = read(name)
        try:
            values = [int(w) for w in words] if words is not None and len(words) == count else None
        except ValueError:
            values = None
        if values is None:
            return default
        return values[0] if count == 1 else tuple(values)

    congestion = read("net/ipv4/tcp_congestion_control")
    available = read("net/ipv4/tcp_available_congestion_control")
    return TcpSettings(
        congestion_control=congestion[0] if congestion else "unknown",
        available_congestion_control=tuple(available or ()),
        rmem_max=integers("net/core/rmem_max", LINUX_DEFAULTS["rmem_max"], 1),
        wmem_max=integers("net/core/wmem_max", LINUX_DEFAULTS["wmem_max"], 1),
        tcp_rmem=integers("net/ipv4/tcp_rmem", LINUX_DEFAULTS["tcp_rmem"], 3),
        tcp_wmem=integers("net/ipv4/tcp_wmem", LINUX_DEFAULTS["tcp_wmem"], 3),
        adv_win_scale=integers("net/ipv4/tcp_adv_win_scale", LINUX_DEFAULTS["tcp_adv_win_scale"], 1),
    )
