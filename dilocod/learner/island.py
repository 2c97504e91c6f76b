"""A learner that is a torchrun job (an "island"): rank 0 alone talks to the syncer; at every step
boundary it shares what arrived with the other ranks through torch.distributed (gloo on CPU, NCCL
on GPU), so that every rank applies the same merged fragments at the same step and keeps the same
counters. Decisions that end a wait or the run are agreed collectively (a minimum over ranks), so
no rank is left alone in a collective.

Control travels as a small pickled object between ranks of one job (trusted, never from the
network); fragment bytes travel as uint8 tensors.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dilocod.learner.bridge import Adopt, Inbox


@dataclass(frozen=True, slots=True)
class IslandConfig:
    rank: int
    world_size: int
    local_rank: int


class Island:
    def __init__(self, config: IslandConfig, device: torch.device) -> None:
        self.rank = config.rank
        self.world_size = config.world_size
        # NCCL moves CUDA tensors only; gloo moves CPU tensors.
        self.device = device if device.type == "cuda" else torch.device("cpu")

    @classmethod
    def start(cls, config: IslandConfig, device: torch.device) -> Island:
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        return cls(config, device)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def agree(self, local: bool) -> bool:
        """True only if every rank says True."""
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def total(self, value: int) -> int:
        """The sum over ranks (the island's tokens in one step)."""
        total = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return int(total.item())

    def _broadcast_object(self, value: Any) -> Any:
        """Rank 0's value on every rank. (torch's broadcast_object_list needs numpy; this does not.)"""
        payload = bytearray(pickle.dumps(value)) if self.leader else bytearray()
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=0)
        if not self.leader:
            payload = bytearray(int(size.item()))
        if payload:
            data = torch.frombuffer(payload, dtype=torch.uint8)
            if self.device.type == "cpu":
                dist.broadcast(data, src=0)
            else:
                moved = data.to(self.device)
                dist.broadcast(moved, src=0)
                data.copy_(moved.cpu())
        # From rank 0 of this very job over its own process group: never bytes from the network.
        return pickle.loads(payload)

    def share(self, inbox: Inbox) -> Inbox:
        """Rank 0's inbox on every rank, fragment bytes included."""
        control = None
        if self.leader:
            control = (
                inbox.plan,
                [(u.fragment, u.version, u.heal, u.incarnation, len(u.buffer)) for u in inbox.updates],
                inbox.requests,
                inbox.fatal,
            )
        plan, updates, requests, fatal = self._broadcast_object(control)
        shared = Inbox(plan, [], list(requests), fatal)
        for index, (fragment, version, heal, incarnation, nbytes) in enumerate(updates):
            buffer = inbox.updates[index].buffer if self.leader else bytearray(nbytes)
            if nbytes:
                host = torch.frombuffer(buffer, dtype=torch.uint8)
                if self.device.type == "cpu":
                    dist.broadcast(host, src=0)  # in place, straight into the followers' buffers
                else:
                    moved = host.to(self.device)
                    dist.broadcast(moved, src=0)
                    if not self.leader:
                        host.copy_(moved.cpu())
            shared.updates.append(Adopt(fragment, version, buffer, heal, incarnation))
        return shared
