"""Where each fragment of the syncer's plan lives in the learner's model, and how it is laid out on
the wire: the fragment's pieces (row slices of parameters, tied ones once) in plan order, packed as
float32 exactly as the syncer packs them (wire.manifest.fragment_manifest), so an update's bytes are
read in place and a push's bytes are written in place. A layout's params are views of the live
parameters' rows: an in-place write to one writes the parameter.

Updates travel at fp32 (read in place) or bf16 (decoded into an fp32 buffer of this layout first),
as their header states: plancheck.check_update refuses one that is not this layout at that
precision.

Checks the plan against the model before anything is trained: a learner whose parameter names or
shapes differ from the syncer's gets a PlanMismatch naming the first difference (the check itself,
torch-free for the network process, is dilocod.learner.plancheck's). Must not import networking.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dilocod.learner.plancheck import check_plan
from dilocod.model.params import model_entries
from dilocod.model.precision import tensor_views
from dilocod.wire.manifest import TensorEntry, fragment_manifest, piece_rows
from dilocod.wire.messages import Plan


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
