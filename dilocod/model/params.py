"""A torch model's parameters as the wire lists them (JOIN, PLAN): each Parameter once, however
many names it is tied under, with its dtype's wire name and its shape. The syncer lists the model
its entry builds; the learner lists its own and compares (dilocod.model.compare)."""

from __future__ import annotations

import torch

from dilocod.model.compare import PlanMismatch
from dilocod.wire.manifest import ModelEntry

#: torch's float dtypes by their wire names (wire.manifest.DTYPE_SIZES): the parameters that train.
WIRE_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}


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
