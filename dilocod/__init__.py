"""dilocod: Decoupled DiLoCo across data centres.

Owns only the package's public surface; importing it must stay cheap (no torch).
"""

from __future__ import annotations

__version__ = "0.1.0"
