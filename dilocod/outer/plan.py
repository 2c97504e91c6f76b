"""The fragment plan: which parameters travel together in one outer round (docs/design.md §3.1).

Balanced greedy bin-packing (longest processing time first): parameters sorted by size, largest
first, ties broken by name; each goes into the currently lightest fragment, ties to the lowest
index. The result depends only on the set of (name, size) pairs, never on their order or on the
process's hash seed, so the syncer and every learner compute the same plan.

Pure: no torch tensors are touched (a module is only asked for its parameters' names and shapes).
Must not import networking, clocks or logging.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

#: A parameter's size as the plan accepts it: a numel or a shape.
Size = int | Sequence[int]


@dataclass(frozen=True, slots=True)
class Fragment:
    """One fragment: its parameter names, in the order they were placed (largest first)."""

    index: int
    names: tuple[str, ...]
    numel: int


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

    def fragment_of(self, name: str) -> int:
        """Index of the fragment holding parameter name (KeyError if the plan has no such name)."""
        for fragment in self.fragments:
            if name in fragment.names:
                return fragment.index
        raise KeyError(name)

    def to_lists(self) -> list[list[str]]:
        """The plan as plain lists of names, the form the syncer sends to learners."""
        return [list(f.names) for f in self.fragments]


def _numel(name: str, size: Size) -> int:
    if isinstance(size, bool):
        raise TypeError(f"size of {name!r} must be an int or a shape, not a bool")
    if isinstance(size, int):
        numel = size
    else:
        dims = [int(d) for d in size]
        if any(d < 0 for d in dims):
            raise ValueError(f"shape of {name!r} has a negative dimension: {tuple(dims)}")
        numel = math.prod(dims)
    if numel < 0:
        raise ValueError(f"size of {name!r} is negative: {numel}")
    return numel


def plan_fragments(named_sizes: Iterable[tuple[str, Size]], num_fragments: int) -> FragmentPlan:
    """Split parameters into num_fragments balanced fragments (capped at the number of parameters).

    named_sizes holds (name, numel) or (name, shape) pairs; names must be unique.
    """
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be at least 1, got {num_fragments}")
    sizes: dict[str, int] = {}
    for name, size in named_sizes:
        if name in sizes:
            raise ValueError(f"parameter {name!r} appears twice")
        sizes[name] = _numel(name, size)
    if not sizes:
        raise ValueError("cannot plan fragments for a model without parameters")

    count = min(num_fragments, len(sizes))
    # Heap of (load, index): the lightest fragment first, ties to the lowest index.
    heap = [(0, i) for i in range(count)]
    members: list[list[str]] = [[] for _ in range(count)]
    loads = [0] * count
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, index = heapq.heappop(heap)
        members[index].append(name)
        loads[index] = load + sizes[name]
        heapq.heappush(heap, (loads[index], index))
    return FragmentPlan(tuple(Fragment(i, tuple(members[i]), loads[i]) for i in range(count)))


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
    """plan_fragments over a module's parameters, tied Parameters counted once."""
    return plan_fragments(module_sizes(module), num_fragments)
