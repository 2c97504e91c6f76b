"""Socket options for WAN links: TCP_NODELAY, BBR where offered, and optional fixed buffers; and
the kernel's round-trip time of a connection.

Linux autotunes receive windows up to net.ipv4.tcp_rmem's maximum; a fixed SO_RCVBUF turns
autotuning off and is capped by net.core.rmem_max, so buffers are only fixed when asked.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)
PREFERRED_CONGESTION = b"bbr"
#: struct tcp_info (linux/tcp.h): 8 one-byte fields, then 32-bit ones; tcpi_rtt is the 16th of
#: those, tcpi_min_rtt (Linux 4.6+) sits after the 64-bit counters. Both in microseconds.
TCP_INFO_RTT_OFFSET = 68
TCP_INFO_MIN_RTT_OFFSET = 148
TCP_INFO_BYTES = 152
#: What tcpi_min_rtt reads before the first sample (~0U).
NO_RTT_SAMPLE = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class SocketReport:
    congestion: str
    send_buffer_bytes: int
    receive_buffer_bytes: int
    nodelay: bool


def available_congestion_controls() -> list[str]:
    path = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
    try:
        return path.read_text().split()
    except OSError:
        return []


def tune(sock: socket.socket, *, buffer_bytes: int | None = None, congestion: str | None = "bbr") -> None:
    """Apply our options to a connected or listening TCP socket; options the OS lacks are skipped."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    if congestion and congestion in available_congestion_controls():
        # Not permitted for unprivileged users on some kernels: the default then stays.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, congestion.encode())


def report(sock: socket.socket) -> SocketReport:
    try:
        congestion = sock.getsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, 16).rstrip(b"\0").decode()
    except OSError:
        congestion = "unknown"
    return SocketReport(
        congestion,
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
        bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)),
    )


def round_trip_s(sock: socket.socket) -> float | None:
    """The kernel's estimate of a connected TCP socket's round-trip time (TCP_INFO): the lowest RTT
    it has seen, which leaves out queueing behind our own data, else its smoothed RTT. None where
    the platform does not say (no TCP_INFO) or nothing has been measured yet."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, TCP_INFO_BYTES)
    except OSError:
        return None
    rtt_us = 0
    if len(info) >= TCP_INFO_MIN_RTT_OFFSET + 4:
        rtt_us = struct.unpack_from("=I", info, TCP_INFO_MIN_RTT_OFFSET)[0]
    if rtt_us in (0, NO_RTT_SAMPLE) and len(info) >= TCP_INFO_RTT_OFFSET + 4:
        rtt_us = struct.unpack_from("=I", info, TCP_INFO_RTT_OFFSET)[0]
    return rtt_us / 1e6 if 0 < rtt_us < NO_RTT_SAMPLE else None
