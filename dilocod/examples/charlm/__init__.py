"""charlm: the embedded default model, a small GPT-style byte-level LM on the stdlib's sources.

Entry: "dilocod.examples.charlm:make_trainer". model.py holds the network (CharLM, CharLMConfig),
data.py the corpus, its split and the resumable batch stream, trainer.py the entry (make_trainer,
build_trainer, TrainConfig) and evaluate(). Defaults: 221,760 parameters (width 64, 4 layers,
4 heads, context 128), batch 16 x 128 bytes, AdamW lr 2e-3, 4 data shards (learner seed m reads
shard m % 4; `dilocod demo` passes --seed m to learner m).
"""

from dilocod.examples.charlm.data import (
    BatchStream,
    CorpusSplit,
    SourceFile,
    list_sources,
    load_held_out,
    load_shard,
    split_sources,
    stdlib_root,
)
from dilocod.examples.charlm.model import CharLM, CharLMConfig
from dilocod.examples.charlm.trainer import TrainConfig, build_trainer, evaluate, make_trainer

__all__ = [
    "BatchStream",
    "CharLM",
    "CharLMConfig",
    "CorpusSplit",
    "SourceFile",
    "TrainConfig",
    "build_trainer",
    "evaluate",
    "list_sources",
    "load_held_out",
    "load_shard",
    "make_trainer",
    "split_sources",
    "stdlib_root",
]
