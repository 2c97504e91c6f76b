"""Where each fragment of the syncer's plan lives in the learner's model, and how it is laid out on
the wire: the fragment's pieces (row slices of parameters, tied ones once) in plan order, packed as
float32 exactly as the syncer packs them (wire.manifest.fragment_manifest), so an update's bytes are
read in place and a push's bytes are written in place. A layout's params are views of the live
parameters' rows: an in-place write to one writes the parameter.

Updates travel at fp32 (read in place) or bf16 (decoded into an fp32 buffer of this layout first):
update_precision says which of the two layouts an update's manifest is, and refuses anything else.

Checks the plan against the model before anything is trained: a learner whose parameter names or
shapes differ from the syncer's gets a PlanMismatch naming the first difference. Must not import
networking.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dilocod.precision import push_layout, tensor_views
from dilocod.wire.manifest import ModelEntry, TensorEntry, fragment_manifest, piece_rows
from dilocod.wire.messages import Plan

WIRE_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}


class PlanMismatch(ValueError):
    """The syncer's model is not this learner's model; the message names the first difference."""


class UpdateRefused(ValueError):
    """An update whose manifest is not its fragment's layout at fp32 or bf16: the syncer's bug."""


#: The precisions a learner accepts updates at (a syncer's --update-precision).
UPDATE_PRECISIONS = ("fp32", "bf16")


def update_precision(
    fragment: int, layout: Sequence[TensorEntry], manifest: Sequence[TensorEntry], raw_bytes: int
) -> str:
    """Which precision an update of a fragment travels at: its manifest and size must be the
    plan's layout of that fragment (`layout`, fp32: same names and shapes, in order) at fp32 or
    bf16; else UpdateRefused says how it differs."""
    shapes = [(entry.name, entry.shape) for entry in layout]
    for precision in UPDATE_PRECISIONS:
        expected, size = push_layout(shapes, precision)
        if tuple(manifest) == expected and raw_bytes == size:
            return precision
    dtypes = sorted({entry.dtype for entry in manifest})
    theirs = [(entry.name, entry.shape) for entry in manifest]
    why = (
        f"its tensors differ from the plan's ({len(theirs)} listed, the plan has {len(shapes)})"
        if theirs != shapes
        else f"its dtypes are {dtypes} and its {raw_bytes} bytes are laid out otherwise"
    )
    raise UpdateRefused(f"an update of fragment {fragment} is not the plan's layout at fp32 or bf16: {why}")


def model_entries(model: torch.nn.Module) -> tuple[ModelEntry, ...]:
    """The model's parameters as JOIN lists them: a Parameter shared under several names once."""
    seen: set[int] = set()
    entries: list[ModelEntry] = []
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        dtype = WIRE_DTYPES.get(parameter.dtype)
        if dtype is None:
            raise PlanMismatch(f"parameter {name!r} has dtype {parameter.dtype}; only float parameters train")
        entries.append(ModelEntry(name, dtype, tuple(parameter.shape)))
    return tuple(entries)


@dataclass(frozen=True, slots=True)
class FragmentLayout:
    index: int
    manifest: tuple[TensorEntry, ...]
    raw_bytes: int
    params: tuple[Tensor, ...]
    #: Views onto whole shared-memory mappings, by the mapping's id. The network process's buffers
    #: are mapped once and reused for every update and snapshot of a size, and at a step boundary
    #: building a fragment's views (50-60 µs there) costs as much as copying its bytes. The views
    #: hold the mapping, so its id cannot be reused while they are kept; a new plan makes new
    #: layouts and so drops them.
    _kept: dict[int, list[Tensor]] = field(default_factory=dict, compare=False, repr=False)

    def views(self, buffer: bytearray | memoryview) -> list[Tensor]:
        """float32 views of this fragment's tensors onto a wire-layout buffer (sharing memory).
        For a buffer that is a whole mmap the same list comes back each time: read it, never
        change the list itself."""
        if len(buffer) != self.raw_bytes:
            raise ValueError(f"fragment {self.index}: {len(buffer)} bytes, the layout has {self.raw_bytes}")
        owner = buffer.obj if isinstance(buffer, memoryview) else None
        # Only a view of the whole mapping: it starts at offset 0, as the kept views do.
        if not isinstance(owner, mmap.mmap) or len(owner) != len(buffer) or not buffer.contiguous:
            return tensor_views(buffer, self.manifest)
        kept = self._kept.get(id(owner))
        if kept is None:
            kept = self._kept[id(owner)] = tensor_views(buffer, self.manifest)
        return kept


def layouts_for(plan: Plan, model: torch.nn.Module) -> list[FragmentLayout]:
    """The plan's fragments over this model's parameters, after checking that the models agree."""
    ours = model_entries(model)
    check_plan(plan, ours)
    parameters = dict(model.named_parameters())
    shapes = {e.name: e.shape for e in plan.model}
    layouts = []
    for index, pieces in enumerate(plan.fragments):
        manifest, raw_bytes = fragment_manifest(pieces, shapes)
        params = tuple(piece_view(parameters[name], start, stop) for name, start, stop in pieces)
        layouts.append(FragmentLayout(index, manifest, raw_bytes, params))
    return layouts


def piece_view(parameter: Tensor, start: int, stop: int) -> Tensor:
    """Rows [start, stop) of a parameter as a view of its storage (the parameter itself when the
    piece is all of it): writing the view in place writes the parameter."""
    if (start, stop) == (0, piece_rows(parameter.shape)):
        return parameter
    return parameter.data[start:stop]


def check_plan(plan: Plan, ours: Sequence[ModelEntry]) -> None:
    theirs = {e.name: e for e in plan.model}
    for entry in ours:
        other = theirs.get(entry.name)
        if other is None:
            raise PlanMismatch(f"parameter {entry.name!r} of this learner is not in the syncer's model")
        if other.shape != entry.shape:
            here, there = list(entry.shape), list(other.shape)
            raise PlanMismatch(
                f"parameter {entry.name!r} has shape {here} at this learner, {there} at the syncer"
            )
    mine = {e.name for e in ours}
    for entry in plan.model:
        if entry.name not in mine:
            raise PlanMismatch(f"the syncer's parameter {entry.name!r} is missing from this learner's model")
