"""dilocod: Decoupled DiLoCo across data centres.

Owns only the package's public surface; importing it must stay cheap (no torch).
"""

from __future__ import annotations

from dilocod.contract import LearnerContext, StepResult, Trainer

__version__ = "0.1.0"
__all__ = ["LearnerContext", "StepResult", "Trainer", "__version__"]
