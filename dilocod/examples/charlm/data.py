"""The charlm data: the Python standard library's own source files, present on every machine.

The corpus is every *.py file under sysconfig's "stdlib" directory (site-packages and
dist-packages pruned: they differ between machines), in sorted order of relative POSIX path,
read as bytes. The split is a pure function of the relative paths and file sizes:

- held out for evaluation: the files whose path hashes (BLAKE2b, not Python's salted hash()) into
  the lowest 5 %;
- training: every other file, dealt into `shards` shards in path order, each file to the shard
  with the fewest bytes so far (ties to the lowest index). Shards are disjoint, cover the training
  part, hold about equal bytes, and each mixes every package (the shards are near-IID, so the
  union seen by M learners resembles the whole training part that data-parallel would see).

A shard's files are concatenated into one uint8 tensor; batches are random contiguous windows of
it. Batch number `cursor` of a stream is drawn from a torch.Generator seeded from (seed, rank,
cursor), so a stream is reproducible from three ints and its position is one: saving `cursor`
and restoring it continues the exact same sequence. Nothing is cached on disk and nothing is
kept between calls: a process reads only its own shard (and the held-out files when evaluating).
Scanning the stdlib (about 1,800 files, 31 MB for CPython 3.11) takes tens of milliseconds.

Must not import dilocod's networking or the model; torch only for the tensors.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: Fraction of files (by path hash) held out for evaluation.
HELD_OUT_FRACTION = 0.05
#: Directories under the stdlib that are not the stdlib: third-party packages differ per machine.
_PRUNED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One corpus file: its path relative to the stdlib root (POSIX form) and its size in bytes."""

    relpath: str
    size: int


@dataclass(frozen=True, slots=True)
class CorpusSplit:
    """The held-out files and the training files dealt into shards, each in path order."""

    held_out: tuple[SourceFile, ...]
    shards: tuple[tuple[SourceFile, ...], ...]

    @property
    def held_out_bytes(self) -> int:
        return sum(f.size for f in self.held_out)

    def shard_bytes(self, shard: int) -> int:
        return sum(f.size for f in self.shards[shard])


def stdlib_root() -> Path:
    """The directory holding this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path | None = None) -> tuple[SourceFile, ...]:
    """Every *.py file under root (default: the stdlib), sorted by relative POSIX path."""
    root = stdlib_root() if root is None else root
    found: list[SourceFile] = []
    for directory, subdirs, files in os.walk(root):
        # Pruning in place stops os.walk from descending: site-packages alone can hold 10x the
        # stdlib's files, and it is not the same on every machine.
        subdirs[:] = [d for d in subdirs if d not in _PRUNED_DIRS]
        base = Path(directory)
        for name in files:
            if name.endswith(".py"):
                path = base / name
                if path.is_file():
                    found.append(SourceFile(path.relative_to(root).as_posix(), path.stat().st_size))
    if not found:
        raise FileNotFoundError(f"no *.py files under {root}: charlm needs the Python standard library")
    found.sort(key=lambda f: f.relpath)
    return tuple(found)


def is_held_out(relpath: str, fraction: float = HELD_OUT_FRACTION) -> bool:
    """Whether a file belongs to the evaluation part: a stable hash of its path, not its contents."""
    digest = hashlib.blake2b(relpath.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


def split_sources(
    sources: Sequence[SourceFile], shards: int, held_out_fraction: float = HELD_OUT_FRACTION
) -> CorpusSplit:
    """Held-out files by path hash; the rest dealt into `shards` byte-balanced shards in order."""
    if type(shards) is not int or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    ordered = sorted(sources, key=lambda f: f.relpath)
    held_out = tuple(f for f in ordered if is_held_out(f.relpath, held_out_fraction))
    members: list[list[SourceFile]] = [[] for _ in range(shards)]
    loads = [0] * shards
    for source in ordered:
        if is_held_out(source.relpath, held_out_fraction):
            continue
        # Least-loaded first, ties to the lowest index: balanced bytes, every shard a mix.
        target = min(range(shards), key=lambda i: (loads[i], i))
        members[target].append(source)
        loads[target] += source.size
    return CorpusSplit(held_out, tuple(tuple(m) for m in members))


def read_sources(sources: Sequence[SourceFile], root: Path | None = None) -> torch.Tensor:
    """The files' bytes concatenated in the given order, as one uint8 tensor.

    Files are joined without separators: a window may span the end of one file and the start of
    the next, which costs a few odd predictions and keeps every byte usable.
    """
    root = stdlib_root() if root is None else root
    buffer = bytearray()
    for source in sources:
        buffer += (root / source.relpath).read_bytes()
    if not buffer:
        return torch.empty(0, dtype=torch.uint8)
    # frombuffer shares the bytearray's memory; the clone owns its storage outright.
    return torch.frombuffer(buffer, dtype=torch.uint8).clone()


def load_shard(shard: int, shards: int, root: Path | None = None) -> torch.Tensor:
    """Training shard `shard` of `shards`, read from the stdlib (only that shard's files)."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is not in 0..{shards - 1}")
    root = stdlib_root() if root is None else root
    split = split_sources(list_sources(root), shards)
    return read_sources(split.shards[shard], root)


def load_held_out(root: Path | None = None) -> torch.Tensor:
    """The evaluation part, read from the stdlib (independent of the shard count)."""
    root = stdlib_root() if root is None else root
    return read_sources(split_sources(list_sources(root), 1).held_out, root)


def _check_length(data: torch.Tensor, context: int, what: str) -> None:
    if data.dim() != 1 or data.dtype != torch.uint8:
        raise ValueError(f"{what} must be a 1-D uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}")
    if data.numel() < context + 1:
        raise ValueError(f"{what} holds {data.numel()} bytes, fewer than one window of {context + 1}")


def _batch_seed(seed: int, rank: int, cursor: int) -> int:
    # A hash rather than arithmetic so that (seed, cursor) pairs never collide across learners
    # (seed * K + cursor would repeat learner 0's batches in learner 1 after K steps).
    digest = hashlib.blake2b(f"charlm:{seed}:{rank}:{cursor}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # manual_seed takes a non-negative int64


def windows_at(data: torch.Tensor, starts: torch.Tensor, context: int) -> torch.Tensor:
    """Rows data[start : start + context + 1] for each start, as int64 (batch, context + 1)."""
    offsets = torch.arange(context + 1)
    return data[starts.unsqueeze(1) + offsets].long()


class BatchStream:
    """Random windows of one shard: batch number `cursor` is a pure function of (seed, rank, cursor).

    state_dict() / load_state_dict() carry the stream's position as plain ints, the form
    Trainer.state_dict must take (it round-trips through torch.load(weights_only=True)).
    """

    def __init__(
        self, data: torch.Tensor, *, context: int, batch_size: int, seed: int, rank: int = 0, cursor: int = 0
    ) -> None:
        _check_length(data, context, "the shard")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.data = data
        self.context = context
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.cursor = cursor

    def batch_at(self, cursor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets, each (batch_size, context) int64 on the CPU."""
        generator = torch.Generator().manual_seed(_batch_seed(self.seed, self.rank, cursor))
        starts = torch.randint(0, self.data.numel() - self.context, (self.batch_size,), generator=generator)
        windows = windows_at(self.data, starts, self.context)
        return windows[:, :-1], windows[:, 1:]

    def next_batch(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at the cursor, moved to device; advances the cursor by one."""
        inputs, targets = self.batch_at(self.cursor)
        self.cursor += 1
        if device is not None:
            inputs, targets = inputs.to(device), targets.to(device)
        return inputs, targets

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor, "seed": self.seed, "rank": self.rank}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the position. A cursor saved under another seed or rank is taken as a position
        in this stream: it is only a count, and refusing it would stop a deliberately re-seeded
        learner from starting."""
        cursor = state.get("cursor")
        if type(cursor) is not int or cursor < 0:
            raise ValueError(f"charlm data state needs a non-negative int 'cursor', got {cursor!r}")
        self.cursor = cursor


def held_out_windows(data: torch.Tensor, *, context: int, count: int) -> torch.Tensor:
    """`count` windows of context + 1 bytes spread evenly over the held-out bytes (no RNG: the same
    windows on every call and every process), int64 (count, context + 1)."""
    _check_length(data, context, "the held-out part")
    if count < 1:
        raise ValueError(f"count must be positive, got {count}")
    last = data.numel() - context - 1
    starts = torch.tensor([i * last // max(count - 1, 1) for i in range(count)], dtype=torch.long)
    return windows_at(data, starts, context)
