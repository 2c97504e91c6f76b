"""The names and defaults every part of dilocod agrees on and users type: codec names, wire
precisions, "auto", the default chunk size. The wire carries them, so they live here; config,
transport, tuning, linkbench, the learner and the syncer import them from here instead of
spelling them again.

Must not import anything, of the project or beyond.
"""

from __future__ import annotations

#: Chunk codecs by name, in the order of wire.frames.Codec's values.
CODECS = ("none", "lz4", "zstd")
#: What a user writes to let dilocod choose (a learner's --streams and --codec, `bench`'s lists).
AUTO = "auto"
#: Wire precisions of outer gradients (dilocod.model.precision, wire.layouts).
PRECISIONS = ("fp32", "bf16", "int8", "int4")
#: Wire precisions of updates: the syncer rounds what it sends, never its master.
UPDATE_PRECISIONS = PRECISIONS[:2]
#: Chunk size of pushes and updates unless configured (a learner's and a syncer's --chunk).
DEFAULT_CHUNK_BYTES = 1 << 20
