"""A learner that is a torchrun job (an "island"): rank 0 alone talks to the syncer; at every step
boundary it shares what arrived with the other ranks through torch.distributed (gloo on CPU, NCCL
on GPU), so that every rank applies the same merged fragments at the same step and keeps the same
counters. Decisions that end a wait or the run are agreed collectively (a minimum over ranks), so
no rank is left alone in a collective.

Control travels as one small msgpack map (dilocod.learner.control) holding exactly what the
followers need; never pickle: a process group's port is a network port too, and unpickling what
arrives there would run whatever a peer on it sent. Fragment bytes travel as uint8 tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dilocod.learner.bridge import Adopt, Inbox
from dilocod.learner.control import decode_control, encode_control


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

    def _broadcast_bytes(self, payload: bytearray) -> bytearray:
        """Rank 0's bytes on every rank. (torch's broadcast_object_list would pickle.)"""
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
        return payload

    def share(self, inbox: Inbox) -> Inbox:
        """Rank 0's inbox on every rank, fragment bytes included."""
        control = decode_control(
            self._broadcast_bytes(bytearray(encode_control(inbox)) if self.leader else bytearray())
        )
        shared = Inbox(control.plan, [], list(control.requests), control.fatal, list(control.lost))
        for index, note in enumerate(control.updates):
            buffer = inbox.updates[index].buffer if self.leader else bytearray(note.nbytes)
            if note.nbytes:
                host = torch.frombuffer(buffer, dtype=torch.uint8)
                if self.device.type == "cpu":
                    dist.broadcast(host, src=0)  # in place, straight into the followers' buffers
                else:
                    moved = host.to(self.device)
                    dist.broadcast(moved, src=0)
                    if not self.leader:
                        host.copy_(moved.cpu())
            shared.updates.append(Adopt(note.fragment, note.version, buffer, note.heal, note.incarnation))
        return shared
