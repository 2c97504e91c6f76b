"""Cache-sized blocks: the shared machinery of the memory-bound passes in merge and nesterov.

A fragment is hundreds of MB; a chain of whole-tensor torch ops streams every operand through
DRAM once per op. Running the same chain block by block keeps the intermediates of one block in
the core's cache, so DRAM sees each operand once (bench/outer_merge.py measures the difference).
Elementwise ops give the same bits whichever way a tensor is cut, which is what lets the blocked
Nesterov step equal torch.optim.SGD bit for bit.

Private to dilocod.outer. Must not import networking, clocks or logging.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

#: Elements per block and per core: 512 KiB of float32. The passes touch three to five such
#: operands; 256 KiB and 512 KiB measured within a few percent of each other (bench/RESULTS.md §3),
#: smaller blocks pay Python's per-op overhead (about 1.4 µs an op), 768 KiB and up spill from the
#: 2 MiB L2. torch splits each op of a block across its threads, so the default block is this
#: times torch.get_num_threads(): every core keeps its 512 KiB share (2 threads: the merge about
#: 6 % faster than with 512 KiB blocks split in two).
BLOCK_NUMEL = 1 << 17


def check_block_numel(block_numel: int) -> None:
    if block_numel < 1:
        raise ValueError(f"block_numel must be at least 1, got {block_numel}")


def resolve_block_numel(block_numel: int | None) -> int:
    """The block size to use: block_numel, or by default BLOCK_NUMEL per torch thread."""
    if block_numel is None:
        return BLOCK_NUMEL * max(1, torch.get_num_threads())
    check_block_numel(block_numel)
    return block_numel


def blocks(tensors: Sequence[Tensor], block_numel: int) -> Iterator[list[Tensor]]:
    """Matching blocks of same-shaped tensors: 1-D slices of their flat views, or the whole tensors.

    Tensors that are not all contiguous are yielded whole (they cannot be viewed flat), as are
    tensors of at most one block.
    """
    numel = tensors[0].numel()
    if numel <= block_numel or not all(t.is_contiguous() for t in tensors):
        yield list(tensors)
        return
    # One split per tensor makes every view in a single call (slicing each block costs ~1 µs more).
    for views in zip(*(t.view(-1).split(block_numel) for t in tensors), strict=True):
        yield list(views)


def block_count(numel: int, block_numel: int) -> int:
    return max(1, -(-numel // block_numel))


class Scratch:
    """Reusable buffers of one block, one per (dtype, device), handed out in the block's shape."""

    def __init__(self, block_numel: int) -> None:
        self._numel = block_numel
        self._flats: dict[tuple[torch.dtype, torch.device, int], Tensor] = {}

    def like(self, t: Tensor, slot: int = 0) -> Tensor:
        """A buffer shaped like t; distinct slots give distinct buffers."""
        if t.numel() > self._numel:
            # A non-contiguous tensor larger than a block comes whole: it needs its own buffer.
            return torch.empty(t.shape, dtype=t.dtype, device=t.device)
        key = (t.dtype, t.device, slot)
        flat = self._flats.get(key)
        if flat is None:
            flat = self._flats[key] = torch.empty(self._numel, dtype=t.dtype, device=t.device)
        if t.numel() == self._numel and t.dim() == 1:
            return flat  # a whole block of a flat view: the usual case, no view to make
        return flat[: t.numel()].view(t.shape)


def block_capacity(tensors: Sequence[Tensor], block_numel: int) -> int:
    """The scratch size a pass over tensors needs: one block, or the largest tensor if smaller."""
    return max(1, min(block_numel, max((t.numel() for t in tensors), default=1)))
