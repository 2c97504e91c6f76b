"""Socket options for WAN links: TCP_NODELAY, BBR where offered, and optional fixed buffers.

Linux autotunes receive windows up to net.ipv4.tcp_rmem's maximum; a fixed SO_RCVBUF turns
autotuning off and is capped by net.core.rmem_max, so buffers are only fixed when asked.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from pathlib import Path

TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)
PREFERRED_CONGESTION = b"bbr"


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
