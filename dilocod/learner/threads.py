"""How many intra-op threads torch gets in a learner (torch.set_num_threads): a pure decision from
the cores this process may run on, where the learner's network runs, how many ranks share the
host, and what the user chose.

torch starts as many intra-op threads as the host has cores, and each parallel op waits for all of
them at its end: when the network (its process, or its thread) takes one of those cores, every op
waits for the thread that lost its core. A small model, whose ops are short, then trains several
times slower than alone (measured on 2 cores: 68 steps/s instead of 210 with one thread). So one
core is left to the network where it runs, and the ranks of an island on the host share the rest.
An explicit choice (OMP_NUM_THREADS, or torch.set_num_threads in the entry) is kept.

Reads nothing itself (cli.py passes what it read from the host and the environment in); must not
import torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostCpus:
    """What the command read about this host for the choice."""

    #: The cores this process may run on (os.sched_getaffinity).
    cores: int
    #: Ranks of the island on this host (torchrun's LOCAL_WORLD_SIZE); 1 without torchrun.
    local_world_size: int = 1
    #: OMP_NUM_THREADS as the environment sets it; None when unset.
    omp_num_threads: str | None = None


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    #: The intra-op threads to set; None to leave torch's as they are.
    threads: int | None
    #: Why, for the log line.
    reason: str


def choose_intra_op_threads(
    host: HostCpus, network: str | None, *, torch_default: int, current: int
) -> ThreadChoice:
    """The threads for this rank. `network` is "process" or "thread" where the learner's network
    runs on this host, None where it does not; `torch_default` is what torch chose before the
    entry ran, `current` what it has now (a difference is the entry's own choice)."""
    if host.omp_num_threads:
        return ThreadChoice(None, f"OMP_NUM_THREADS={host.omp_num_threads} is set")
    if current != torch_default:
        return ThreadChoice(None, f"the entry called torch.set_num_threads({current})")
    ranks = max(1, host.local_world_size)
    # Never below one core per rank for the network's sake: it is mostly idle, the step never is.
    reserved = 1 if network is not None and host.cores > ranks else 0
    share = max(1, (host.cores - reserved) // ranks)
    threads = min(share, torch_default)
    parts = [f"{host.cores} cores available"]
    if reserved:
        parts.append(f"1 for the network {network}")
    if ranks > 1:
        parts.append(f"the rest shared by {ranks} ranks on this host")
    if threads < share:
        parts.append(f"no more than torch's default of {torch_default}")
    return ThreadChoice(threads, ", ".join(parts))
