"""The outer loop's math (docs/design.md §3): pure functions over lists of tensors.

The schedule of rounds, the learner's outer gradient and how it adopts a merged fragment, merge
weights, the RDA and mean merges, the outer Nesterov step (alone, and fused with the merge for the
syncer), the guard that screens outer gradients, and lossy wire precision with error feedback
(the fragment plan is the model's: dilocod.model.plan). Both daemons compose these; nothing else
re-implements them. In-place functions end with an underscore. Imports nothing of the project
(tests/unit/test_layering.py): no networking, clocks or logging; torch is the only heavy
dependency.
"""

from __future__ import annotations

from dilocod.outer.apply import APPLY_MODES, apply_update_
from dilocod.outer.gradient import pseudo_gradient
from dilocod.outer.guard import Verdict, check_outer_gradient
from dilocod.outer.merge import embedding_mask, mean_merge, rda_merge
from dilocod.outer.nesterov import nesterov_step_
from dilocod.outer.quantize import (
    QuantizationReport,
    QuantizedTensor,
    dequantize,
    quantization_report,
    quantize,
    quantize_with_feedback_,
)
from dilocod.outer.schedule import RoundOpening, open_rounds, quorum_clock, round_fragment, rounds_due
from dilocod.outer.step import outer_step_
from dilocod.outer.weights import merge_weights

__all__ = [
    "APPLY_MODES",
    "QuantizationReport",
    "QuantizedTensor",
    "RoundOpening",
    "Verdict",
    "apply_update_",
    "check_outer_gradient",
    "dequantize",
    "embedding_mask",
    "mean_merge",
    "merge_weights",
    "nesterov_step_",
    "open_rounds",
    "outer_step_",
    "pseudo_gradient",
    "quantization_report",
    "quantize",
    "quantize_with_feedback_",
    "quorum_clock",
    "rda_merge",
    "round_fragment",
    "rounds_due",
]
