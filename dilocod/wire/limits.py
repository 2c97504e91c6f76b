"""The one Limits object: every peer-declared length, count and size is checked against it
before anything is allocated. Must not import asyncio, socket, torch or logging.
"""

from __future__ import annotations

from dataclasses import dataclass

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


def chunk_payload_bound(raw_length: int) -> int:
    """Largest compressed payload a chunk of raw_length may carry.

    Above the zstd and lz4 worst-case expansion of incompressible input; a sender whose codec
    output would exceed raw_length sends the chunk uncompressed instead, so this bound is slack.
    """
    return raw_length + raw_length // 128 + 1024


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps on everything a peer can declare. Defaults suit models up to a few billion
    parameters split into 24 fragments; a deployment may raise them on both ends."""

    max_handshake_body_bytes: int = 4 * KiB
    max_control_body_bytes: int = 4 * MiB
    max_chunk_bytes: int = 16 * MiB
    min_chunk_bytes: int = 4 * KiB
    max_fragment_bytes: int = 16 * GiB
    #: All of a JOIN's or PLAN's parameters together (a tensor larger than a fragment travels in
    #: row slices, so no single tensor is bounded by max_fragment_bytes): 1 TiB, 256e9 float32
    #: parameters, far above a 12B model's 48 GB.
    max_model_bytes: int = 1024 * GiB
    max_tensors_per_fragment: int = 65_536
    max_name_bytes: int = 1_024
    max_tensor_rank: int = 8
    max_transfers_in_flight: int = 64
    max_data_connections: int = 64
    max_peer_id_bytes: int = 128
    max_message_bytes: int = 4 * KiB
    #: Parameters a JOIN or PLAN may list: the whole model, so as many as one manifest may hold.
    max_model_tensors: int = 65_536
    #: Fragments a PLAN may declare (fragment indices are u32 on the wire; this keeps PLAN small).
    max_fragments: int = 65_536
    # Numbers a learner reports (STEP_REPORT, PUSH_HEADER): a value above its bound makes the
    # message malformed. Far above any honest learner's, and below 2**53, so that they and the
    # syncer's totals of them stay exact in float64 and in every JSON reader.
    #: A learner's step counter (STEP_REPORT.step) and the steps one push holds (c_steps): 2**40.
    max_reported_steps: int = 2**40
    #: Tokens one step processed (STEP_REPORT.tokens): 2**40, about 1.1e12.
    max_step_tokens: int = 2**40
    #: Tokens one push holds (PUSH_HEADER.c_tokens): 2**50, about 1.1e15.
    max_push_tokens: int = 2**50
    #: How long one step took (STEP_REPORT.step_time_s): one day.
    max_step_time_s: float = 86_400.0

    def max_chunks_per_fragment(self) -> int:
        return -(-self.max_fragment_bytes // self.min_chunk_bytes)


DEFAULT_LIMITS = Limits()
