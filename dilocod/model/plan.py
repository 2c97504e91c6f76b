"""The fragment plan: which parameter rows travel together in one outer round (docs/design.md §3.1).

The parameters are laid end to end in registration order (a tied Parameter once) and that
sequence is cut into P consecutive ranges of near-equal numel, at row boundaries only: cut k is
the row boundary nearest numel * k / P (ties to the earlier boundary), moved forward or back only
as far as it takes to leave every fragment at least one row. A fragment is therefore a list of
pieces, each a parameter's contiguous rows [start, stop) along dim 0 (a tensor without rows, 0-d
or with a first dimension of 0, is one piece, start 0, stop 1); consecutive ranges hold at most
one piece of each parameter. With every row at most r elements, each fragment is within r of the
mean, whatever the tensors' sizes; P is capped at the number of rows in the model.

The result depends only on the ordered (name, shape) list, never on the process's hash seed, so
the syncer and every learner compute the same plan (the learner reads it from PLAN anyway).

Pure: no torch tensors are touched (a module is only asked for its parameters' names and shapes).
Must not import networking, clocks or logging (wire.manifest, pure, says what a row is).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from dilocod.wire.manifest import piece_rows

if TYPE_CHECKING:
    from torch import nn

#: A parameter's size as the plan accepts it: a shape, or a numel (read as the shape (numel,)).
Size = int | Sequence[int]


class Piece(NamedTuple):
    """Rows [start, stop) of parameter `name` along dim 0; equal to the tuple (name, start, stop)."""

    name: str
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Fragment:
    """One fragment: its pieces in model order, and how many elements they hold."""

    index: int
    pieces: tuple[Piece, ...]
    numel: int

    @property
    def names(self) -> tuple[str, ...]:
        """The parameters this fragment holds rows of (each once: a fragment has one piece of each)."""
        return tuple(p.name for p in self.pieces)


@dataclass(frozen=True, slots=True)
class FragmentPlan:
    fragments: tuple[Fragment, ...]

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def total_numel(self) -> int:
        return sum(f.numel for f in self.fragments)

    @property
    def imbalance(self) -> float:
        """Largest fragment over the mean fragment size (1.0 is perfect; 1.0 when all are empty)."""
        total = self.total_numel
        if total == 0:
            return 1.0
        return max(f.numel for f in self.fragments) * len(self.fragments) / total

    def fragments_of(self, name: str) -> list[int]:
        """Indices of the fragments holding rows of parameter name (KeyError if none)."""
        found = [f.index for f in self.fragments if name in f.names]
        if not found:
            raise KeyError(name)
        return found

    def to_lists(self) -> list[list[list[object]]]:
        """The plan as PLAN.fragments carries it: per fragment, [name, start, stop] per piece."""
        return [[[p.name, p.start, p.stop] for p in f.pieces] for f in self.fragments]


def _shape(name: str, size: Size) -> tuple[int, ...]:
    if isinstance(size, bool):
        raise TypeError(f"size of {name!r} must be an int or a shape, not a bool")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"size of {name!r} is negative: {size}")
        return (size,)
    dims = tuple(int(d) for d in size)
    if any(d < 0 for d in dims):
        raise ValueError(f"shape of {name!r} has a negative dimension: {dims}")
    return dims


def plan_fragments(named_sizes: Iterable[tuple[str, Size]], num_fragments: int) -> FragmentPlan:
    """Cut the parameters, in the order given, into num_fragments consecutive row ranges of
    near-equal numel (capped at the number of rows). named_sizes holds (name, shape) or
    (name, numel) pairs; names must be unique."""
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be at least 1, got {num_fragments}")
    shapes: dict[str, tuple[int, ...]] = {}
    for name, size in named_sizes:
        if name in shapes:
            raise ValueError(f"parameter {name!r} appears twice")
        shapes[name] = _shape(name, size)
    if not shapes:
        raise ValueError("cannot plan fragments for a model without parameters")

    names = list(shapes)
    rows = [piece_rows(shapes[n]) for n in names]
    row_numel = [math.prod(shapes[n]) // r for n, r in zip(names, rows, strict=True)]
    # first_row[t]: the global index of tensor t's first row; first_numel[t]: elements before it.
    first_row = [0] * (len(names) + 1)
    first_numel = [0] * (len(names) + 1)
    for t in range(len(names)):
        first_row[t + 1] = first_row[t] + rows[t]
        first_numel[t + 1] = first_numel[t] + rows[t] * row_numel[t]
    total_rows, total = first_row[-1], first_numel[-1]

    def numel_before(row: int) -> int:
        t = bisect.bisect_right(first_row, row) - 1
        if t == len(names):
            return total
        return first_numel[t] + (row - first_row[t]) * row_numel[t]

    def nearest_boundary(target: float) -> int:
        # The tensor holding the target: the last whose first element is at or before it.
        t = min(bisect.bisect_right(first_numel, target) - 1, len(names) - 1)
        if row_numel[t] == 0:
            return first_row[t]
        j = min(rows[t], max(0, math.floor((target - first_numel[t]) / row_numel[t])))
        low = first_row[t] + j
        high = min(low + 1, first_row[t + 1])
        # Boundaries inside one tensor are evenly spaced; the tensor's end is the next one's start.
        return low if target - numel_before(low) <= numel_before(high) - target else high

    count = min(num_fragments, total_rows)
    cuts = [0]
    for k in range(1, count):
        cut = nearest_boundary(total * k / count)
        cuts.append(min(max(cut, cuts[-1] + 1), total_rows - (count - k)))
    cuts.append(total_rows)

    fragments: list[Fragment] = []
    for k in range(count):
        begin, end = cuts[k], cuts[k + 1]
        pieces: list[Piece] = []
        t = bisect.bisect_right(first_row, begin) - 1
        while t < len(names) and first_row[t] < end:
            start = max(begin, first_row[t]) - first_row[t]
            stop = min(end, first_row[t + 1]) - first_row[t]
            pieces.append(Piece(names[t], start, stop))
            t += 1
        fragments.append(Fragment(k, tuple(pieces), numel_before(end) - numel_before(begin)))
    return FragmentPlan(tuple(fragments))


def module_sizes(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a module's parameters, a Parameter shared under several names counted once.

    Tied weights (an embedding reused as the output head) are one tensor: it must be merged once,
    so only its first name in registration order is kept, as module.named_parameters() does.
    """
    seen: set[int] = set()
    named: list[tuple[str, tuple[int, ...]]] = []
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        named.append((name, tuple(parameter.shape)))
    return named


def plan_module(module: nn.Module, num_fragments: int) -> FragmentPlan:
    """plan_fragments over a module's parameters in registration order, tied Parameters once."""
    return plan_fragments(module_sizes(module), num_fragments)
