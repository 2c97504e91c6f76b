"""A chunk codec on one link: what a codec's measured speeds and ratio predict it carries
(predicted_gbps), which codec to use (choose_codec), and the measurement itself: the codecs timed
on whole chunks of real data on one thread (measure_codecs, spread_sample).

Pure but for measure_codecs, which takes time. Must not import torch, asyncio or socket.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dilocod.wire import codecs as wire_codecs
from dilocod.wire.choices import CODECS, DEFAULT_CHUNK_BYTES
from dilocod.wire.frames import CODEC_NAMES, CODECS_BY_NAME, ChunkHeader, Codec


@dataclass(frozen=True, slots=True)
class CodecFigure:
    """One codec measured on real data (measure_codecs)."""

    codec: str  # "none" | "lz4" | "zstd"
    #: Raw bytes / bytes on the wire; 1.0 for none (and for data the codec cannot shrink).
    ratio: float
    #: Raw Gbit/s of ONE thread compressing, byte-plane shuffle included; inf for none.
    compress_gbps: float
    #: Raw Gbit/s of ONE thread decompressing and verifying the chunk checksum; inf for none.
    decompress_gbps: float


@dataclass(frozen=True, slots=True)
class CodecChoice:
    codec: str
    #: Raw-data Gbit/s predicted for this codec on this link (predicted_gbps).
    predicted_gbps: float
    #: One sentence a person can read.
    reason: str


def predicted_gbps(figure: CodecFigure, link_gbps: float, threads: int) -> float:
    """Raw-data Gbit/s a fragment stream reaches with this codec on a link of `link_gbps`.

    The model: min(link_gbps x ratio, compress_gbps x threads, decompress_gbps x threads), and
    link_gbps itself for none. Its assumptions:
    - chunks are compressed independently, in parallel, on a pool of `threads` (Session does so,
      TransportOptions.codec_threads), and lz4 and zstd release the GIL, so a pool of t threads
      runs t times as fast as one;
    - the receiver decompresses on as many threads as the sender compresses with;
    - compressing, sending and decompressing overlap (a pipeline), so the slowest stage sets the
      rate, and the link carries `ratio` times more raw data when compressed;
    - nothing else competes for those cores. On a 2-core host the event loop needs some of one
      core too, and a syncer's pool serves every learner, so the prediction is an upper bound; the
      margin in choose_codec absorbs small errors, CodecTuner large ones.
    """
    if threads < 1:
        raise ValueError(f"threads must be at least 1, not {threads}")
    if not link_gbps > 0:
        raise ValueError(f"link rate must be positive, not {link_gbps}")
    if figure.codec == "none":
        return link_gbps
    return min(link_gbps * figure.ratio, figure.compress_gbps * threads, figure.decompress_gbps * threads)


def _bound(figure: CodecFigure, link_gbps: float, threads: int) -> str:
    """Which term of predicted_gbps sets the rate, in words."""
    terms = [
        (link_gbps * figure.ratio, f"the link carries {figure.ratio:.2f}x the raw data"),
        (figure.compress_gbps * threads, f"compression on {threads} threads is the limit"),
        (figure.decompress_gbps * threads, f"decompression on {threads} threads is the limit"),
    ]
    return min(terms, key=lambda term: term[0])[1]


def choose_codec(
    figures: Iterable[CodecFigure], link_gbps: float, threads: int, margin: float = 1.03
) -> CodecChoice:
    """The codec with the best predicted_gbps; a compressor only if it beats none by `margin`.

    none is always a candidate, measured or not. The margin keeps `auto` from compressing for a
    predicted gain smaller than the model's own error, so that a model off by a little never lands
    much below uncompressed (about 1/margin at worst). Ties between compressors go to the one that
    needs less CPU (the faster compressor).
    """
    if margin < 1:
        raise ValueError(f"margin must be at least 1, not {margin}")
    compressors = [f for f in figures if f.codec != "none"]
    if not compressors:
        return CodecChoice(
            "none", link_gbps, f"uncompressed at {link_gbps:.2f} Gbit/s: no codec was measured"
        )
    best = max(compressors, key=lambda f: (predicted_gbps(f, link_gbps, threads), f.compress_gbps))
    best_gbps = predicted_gbps(best, link_gbps, threads)
    why = _bound(best, link_gbps, threads)
    if best_gbps >= link_gbps * margin:
        return CodecChoice(
            best.codec,
            best_gbps,
            f"{best.codec} predicted {best_gbps:.2f} Gbit/s of raw data against {link_gbps:.2f} "
            f"uncompressed ({why})",
        )
    verdict = "slower" if best_gbps < link_gbps else f"less than {100 * (margin - 1):.0f} % faster"
    return CodecChoice(
        "none",
        link_gbps,
        f"uncompressed at {link_gbps:.2f} Gbit/s: the best codec, {best.codec}, predicted "
        f"{best_gbps:.2f} ({why}), {verdict}",
    )


def spread_sample(data: wire_codecs.Buffer, chunk_bytes: int, max_bytes: int) -> bytes:
    """Whole chunks spread evenly over `data`, at most max_bytes of them (a fragment's first
    tensors can differ from its last: embeddings, norms, large matrices)."""
    view = memoryview(data).cast("B")
    chunks = max(1, math.ceil(len(view) / chunk_bytes))
    take = max(1, min(chunks, max_bytes // chunk_bytes))
    picks = sorted({i * chunks // take for i in range(take)})
    return b"".join(view[i * chunk_bytes : (i + 1) * chunk_bytes] for i in picks)


def measure_codecs(
    sample: wire_codecs.Buffer,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shuffle_item_size: int = 4,
    codecs: Sequence[str] = CODECS,
    min_seconds: float = 0.2,
) -> list[CodecFigure]:
    """Each codec on `sample`, chunk by chunk, exactly as a push compresses it
    (dilocod.wire.codecs.compress with the same shuffle, falling back to raw where a chunk does not
    shrink) and as a receiver decodes it (decompress_into, checksum included), timed on this one
    thread. Passes repeat until min_seconds have gone by (at least one); the median pass counts.
    Runs for a while: call it off the event loop and off the training thread."""
    view = memoryview(sample).cast("B")
    if not view:
        raise ValueError("cannot measure codecs on an empty sample")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk size must be positive, not {chunk_bytes}")
    chunks = [view[start : start + chunk_bytes] for start in range(0, len(view), chunk_bytes)]
    return [_measure_one(CODECS_BY_NAME[name], chunks, shuffle_item_size, min_seconds) for name in codecs]


def _measure_one(
    codec: Codec, chunks: list[memoryview], shuffle_item_size: int, min_seconds: float
) -> CodecFigure:
    if codec is Codec.NONE:
        return CodecFigure("none", 1.0, math.inf, math.inf)
    raw_bytes = sum(len(chunk) for chunk in chunks)
    encoded = [wire_codecs.compress(codec, chunk, shuffle_item_size) for chunk in chunks]
    decodes = [
        (ChunkHeader(seq, len(chunk), used, shuffle, wire_codecs.checksum(chunk)), payload)
        for seq, (chunk, (used, shuffle, payload)) in enumerate(zip(chunks, encoded, strict=True))
    ]
    destination = memoryview(bytearray(max(len(chunk) for chunk in chunks)))

    def compress_all() -> None:
        for chunk in chunks:
            wire_codecs.compress(codec, chunk, shuffle_item_size)

    def decompress_all() -> None:
        for header, payload in decodes:
            wire_codecs.decompress_into(header, payload, destination[: header.raw_length])

    bits = raw_bytes * 8
    return CodecFigure(
        CODEC_NAMES[codec],
        raw_bytes / sum(len(payload) for _, payload in decodes),
        bits / _median_pass_s(compress_all, min_seconds) / 1e9,
        bits / _median_pass_s(decompress_all, min_seconds) / 1e9,
    )


def _median_pass_s(work: Any, min_seconds: float) -> float:
    times: list[float] = []
    begun = time.perf_counter()
    while not times or time.perf_counter() - begun < min_seconds:
        start = time.perf_counter()
        work()
        times.append(max(time.perf_counter() - start, 1e-9))
    times.sort()
    return times[len(times) // 2]
