"""What a user would otherwise use to move a fragment: a torch.distributed gloo broadcast of the same
number of bytes over the same path, between the two ends of `dilocod bench`.

Each end runs this module as its own process (`python -m dilocod.linkbench.gloo`), so the bench
processes never hold a process group: rank 0 (the measuring side, which hosts the rendezvous) and
rank 1 (started by `dilocod bench serve` when an authenticated session asks for it). Rank 0
prints one JSON line: the median Gbit/s of the timed broadcasts. Gloo picks its interface by
GLOO_SOCKET_IFNAME, which the callers set to the interface that carries the bench session, so the
broadcast takes the same path as the fragments (not whatever the host name resolves to).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import socket
import statistics
import struct
import sys
import time
from collections.abc import Sequence
from datetime import timedelta

_SIOCGIFADDR = 0x8915
TIMEOUT_S = 90.0


def free_port(host: str) -> int:
    """A port free on host right now, for the rendezvous (the store binds it a moment later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def interface_for(ip: str) -> str | None:
    """The name of the IPv4 interface that holds ip (None for IPv6 or an address not found)."""
    try:
        packed = socket.inet_aton(ip)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if answer[20:24] == packed:
                return name
    return None


def broadcast(
    rank: int, master: str, size_bytes: int, repeats: int, quiet_start_s: float = 0.0
) -> list[float]:
    """Join the two-rank group and time `repeats` broadcasts of size_bytes from rank 0; seconds
    each, from a barrier before to a barrier after (so the time ends when rank 1 holds the bytes).
    Each starts after quiet_start_s of an idle link, as the bench's other timed transfers do."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    host, _, port = master.rpartition(":")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{host.strip('[]')}:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    try:
        tensor = torch.empty(size_bytes // 4, dtype=torch.float32)
        if rank == 0:
            tensor.normal_()
        dist.broadcast(tensor, 0)  # warm-up: connections, buffers
        times = []
        for _ in range(repeats):
            time.sleep(quiet_start_s)  # rank 0 (the one timing); rank 1 waits in the barrier meanwhile
            dist.barrier()
            start = time.perf_counter()
            dist.broadcast(tensor, 0)
            dist.barrier()
            times.append(time.perf_counter() - start)
        return times
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, choices=(0, 1), required=True)
    parser.add_argument("--master", required=True, help="HOST:PORT of rank 0's rendezvous")
    parser.add_argument("--size", type=int, required=True, help="bytes per broadcast")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quiet-start", type=float, default=0.0, help="idle seconds before each broadcast")
    args = parser.parse_args(argv)
    times = broadcast(args.rank, args.master, args.size, args.repeats, args.quiet_start)
    if args.rank == 0:
        gbps = [args.size // 4 * 4 * 8 / t / 1e9 for t in times]
        print(json.dumps({"gbps": statistics.median(gbps), "runs": gbps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
