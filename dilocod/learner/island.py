"""A learner that is a torchrun job (an "island"): rank 0 alone talks to the syncer; at every step
boundary it shares what arrived with the other ranks through torch.distributed, so that every rank
applies the same merged fragments at the same step and keeps the same counters. Decisions that end
a wait or the run are agreed collectively (a minimum over ranks), so no rank is left alone in a
collective.

On CPU the process group is gloo. On GPUs it is one group with two backends, gloo for CPU tensors
and NCCL for CUDA ones: agreements, token totals and control travel as CPU tensors over gloo, so
they cost the training stream no host-device synchronisation at all, and fragment bytes travel as
CUDA tensors over NCCL, from device memory: rank 0 copies an update in once (learner.device, the
training stream waiting on the device) and broadcasts it, and every rank applies it from there.
Each rank's current device is its own GPU (set_device before the group starts).

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
from dilocod.learner.device import Copier, DeviceCopier, Upload

#: The process group of a GPU island: CPU tensors (control) over gloo, CUDA ones over NCCL.
GPU_BACKENDS = "cpu:gloo,cuda:nccl"


@dataclass(frozen=True, slots=True)
class IslandConfig:
    rank: int
    world_size: int
    local_rank: int


class Island:
    def __init__(self, config: IslandConfig, device: torch.device) -> None:
        self.rank = config.rank
        self.world_size = config.world_size
        #: Where fragment bytes travel: the GPU (NCCL) or host memory (gloo). Control is on the CPU.
        self.device = device if device.type == "cuda" else torch.device("cpu")

    @classmethod
    def start(cls, config: IslandConfig, device: torch.device) -> Island:
        if device.type == "cuda":
            # Before the group: NCCL binds each rank's communicator to its current device, and
            # without this every rank's would be cuda:0.
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend=GPU_BACKENDS if device.type == "cuda" else "gloo")
        return cls(config, device)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def agree(self, local: bool) -> bool:
        """True only if every rank says True (a CPU collective: no device synchronisation)."""
        flag = torch.tensor([1 if local else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def total(self, value: int) -> int:
        """The sum over ranks (the island's tokens in one step), as agree()."""
        total = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return int(total.item())

    def _broadcast_bytes(self, payload: bytearray) -> bytearray:
        """Rank 0's bytes on every rank, as CPU tensors. (torch's broadcast_object_list would
        pickle.)"""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0)
        if not self.leader:
            payload = bytearray(int(size.item()))
        if payload:
            dist.broadcast(torch.frombuffer(payload, dtype=torch.uint8), src=0)
        return payload

    def share(self, inbox: Inbox, copier: Copier) -> Inbox:
        """Rank 0's inbox on every rank, fragment bytes included: on a GPU as device buffers of
        `copier` (Adopt.staged; the followers' Adopt.buffer is empty), else in host buffers."""
        control = decode_control(
            self._broadcast_bytes(bytearray(encode_control(inbox)) if self.leader else bytearray())
        )
        shared = Inbox(control.plan, [], list(control.requests), control.fatal, list(control.lost))
        on_device = isinstance(copier, DeviceCopier) and self.device.type == "cuda"
        for index, note in enumerate(control.updates):
            staged = None
            if on_device:
                assert isinstance(copier, DeviceCopier)
                buffer = inbox.updates[index].buffer if self.leader else bytearray()
                upload = copier.prefetch(buffer) if self.leader else None
                if note.nbytes:
                    flat = copier.ready(upload) if upload is not None else copier.slot(note.nbytes)
                    dist.broadcast(flat, src=0)  # NCCL, ordered after the upload on the device
                    staged = Upload(flat)
            else:
                buffer = inbox.updates[index].buffer if self.leader else bytearray(note.nbytes)
                if note.nbytes:
                    # In place, straight into the followers' buffers.
                    dist.broadcast(torch.frombuffer(buffer, dtype=torch.uint8), src=0)
            shared.updates.append(
                Adopt(note.fragment, note.version, buffer, note.heal, note.incarnation, staged)
            )
        return shared
