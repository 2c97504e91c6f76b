"""The charlm model: a small GPT-style byte-level language model.

Token embedding over the 256 byte values, learned positions, `layers` pre-norm transformer blocks
(causal self-attention, then a GELU MLP), a final norm, and an output head tied to the token
embedding. No biases and no dropout: fewer tiny tensors to sync, and nothing random in forward.

Every process that builds a CharLM with the same config gets the same parameter names, in the
same order, with the same initial values: the syncer builds it on the CPU for the initial global
model and every learner starts from identical weights (seeded by `init_seed`, never by the
learner's own seed). Imports torch only; nothing about data, optimizers or dilocod's networking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: Byte-level: the vocabulary is every byte value.
VOCAB_SIZE = 256


@dataclass(frozen=True, slots=True)
class CharLMConfig:
    """Shape of the model. The defaults make one training step of 16 x 128 bytes take ~50 ms on
    one CPU core (measured on the project's 2-core machines) at 221,760 parameters."""

    width: int = 64
    layers: int = 4
    heads: int = 4
    #: Longest window the model reads, in bytes (the learned positions' count).
    context: int = 128
    #: MLP hidden width as a multiple of `width`.
    mlp_ratio: int = 4
    #: Seeds the initial weights; the same everywhere, so every process starts from one model.
    init_seed: int = 0

    def __post_init__(self) -> None:
        for name in ("width", "layers", "heads", "context", "mlp_ratio"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"CharLMConfig.{name} must be a positive int, got {value!r}")
        if self.width % self.heads:
            raise ValueError(f"CharLMConfig.width ({self.width}) must be divisible by heads ({self.heads})")

    @property
    def num_parameters(self) -> int:
        """Parameter count (the tied head counted once), without building the model."""
        block = 2 * self.width + 4 * self.width**2 + 2 * self.mlp_ratio * self.width**2
        return (VOCAB_SIZE + self.context + 1) * self.width + self.layers * block


class CausalSelfAttention(nn.Module):
    def __init__(self, config: CharLMConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width, bias=False)
        self.proj = nn.Linear(config.width, config.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).view(batch, time, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: CharLMConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.width
        self.attn_norm = nn.LayerNorm(config.width, bias=False)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.width, bias=False)
        self.mlp_in = nn.Linear(config.width, hidden, bias=False)
        self.mlp_out = nn.Linear(hidden, config.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))


class CharLM(nn.Module):
    """Bytes in (batch, time) int64, next-byte logits out (batch, time, 256).

    Parameter names: token_embed.weight, pos_embed.weight, blocks.{i}.{attn_norm, attn.qkv,
    attn.proj, mlp_norm, mlp_in, mlp_out}.weight, final_norm.weight. Both embeddings match the
    syncer's default --embedding-pattern '*embed*', so RDA merges them by plain mean.
    """

    def __init__(self, config: CharLMConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else CharLMConfig()
        cfg = self.config
        # Construction draws from the global RNG for torch's default inits; fork it so building
        # a model leaves the caller's random stream untouched (the values are overwritten below).
        with torch.random.fork_rng(devices=[]):
            self.token_embed = nn.Embedding(VOCAB_SIZE, cfg.width)
            self.pos_embed = nn.Embedding(cfg.context, cfg.width)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
            self.final_norm = nn.LayerNorm(cfg.width, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2's scheme from a private generator: N(0, 0.02), the projections that write into the
        # residual stream scaled by 1/sqrt(2 * layers) so its variance does not grow with depth;
        # norms start at 1. Parameters are visited in registration order, so the values depend only
        # on the config.
        generator = torch.Generator().manual_seed(self.config.init_seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.layers)
        with torch.no_grad():
            for name, parameter in self.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.fill_(1.0)
                elif name.endswith(("attn.proj.weight", "mlp_out.weight")):
                    parameter.normal_(0.0, residual_std, generator=generator)
                else:
                    parameter.normal_(0.0, 0.02, generator=generator)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        time = tokens.shape[1]
        if time > self.config.context:
            raise ValueError(f"input of {time} bytes is longer than the context ({self.config.context})")
        x = self.token_embed(tokens) + self.pos_embed.weight[:time]
        for block in self.blocks:
            x = block(x)
        # The head is the token embedding itself (tied): one tensor, one name, merged once.
        return F.linear(self.final_norm(x), self.token_embed.weight)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy in nats per byte."""
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
