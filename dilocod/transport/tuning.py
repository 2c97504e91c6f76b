"""Link tuning: how many data connections and which chunk codec to use on one link, and the advice
`dilocod bench` saves for `dilocod learner --streams auto --codec auto`.

Owns the throughput model of a codec on a link (predicted_gbps, choose_codec), the
bandwidth-delay-product arithmetic of the stream count (choose_streams, bdp_warning), the window
one TCP stream can reach under the host's sysctls (TcpSettings), the learner's running codec
decision (CodecTuner, fed by PushMeter) and the advice file's format. Those are pure. The few
functions that measure or touch files sit at the end: measure_codecs (times the codecs on one
thread), read_tcp_settings (/proc/sys), advice_path, save_advice and load_advice.

Must not import torch, asyncio or socket: `dilocod bench` and the CLI use this without tensors.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from dilocod.wire import codecs as wire_codecs
from dilocod.wire.frames import CODEC_NAMES as WIRE_CODEC_NAMES
from dilocod.wire.frames import CODECS_BY_NAME, ChunkHeader, Codec

log = structlog.get_logger("dilocod.tuning")

CODEC_NAMES = ("none", "lz4", "zstd")
MiB = 1 << 20
#: The sysctl file that raises every limit below for 2-5 Gbit/s at up to 100 ms (both hosts).
SYSCTL_FILE = "systemd/sysctl.d/60-dilocod-wan.conf"
#: Stock Linux values, used for a sysctl this host does not expose (another OS, a locked sandbox).
LINUX_DEFAULTS = {
    "rmem_max": 212_992,
    "wmem_max": 212_992,
    "tcp_rmem": (4096, 131_072, 6_291_456),
    "tcp_wmem": (4096, 16_384, 4_194_304),
    "tcp_adv_win_scale": 1,
}


# ------------------------------------------------------------------------------------------ codecs


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


# ----------------------------------------------------------------------------------------- streams


def _window_from_space(space: int, adv_win_scale: int) -> int:
    """The receive window a buffer of `space` bytes allows (the kernel's tcp_win_from_space before
    Linux 6.6): the rest is reserved for the kernel's own per-packet overhead."""
    if adv_win_scale > 0:
        return space - (space >> adv_win_scale)
    return space >> -adv_win_scale


def _space_for_window(window: int, adv_win_scale: int) -> int:
    """The inverse: the smallest buffer whose window is at least `window` bytes."""
    if adv_win_scale > 0:
        return math.ceil(window * (1 << adv_win_scale) / ((1 << adv_win_scale) - 1))
    return window << -adv_win_scale


@dataclass(frozen=True, slots=True)
class TcpSettings:
    """The host's TCP sysctls that bound what one stream can carry (read_tcp_settings)."""

    congestion_control: str
    available_congestion_control: tuple[str, ...]
    rmem_max: int
    wmem_max: int
    tcp_rmem: tuple[int, int, int]
    tcp_wmem: tuple[int, int, int]
    #: net.ipv4.tcp_adv_win_scale: the share of a receive buffer kept for the kernel's overhead
    #: (1: half). Linux 6.6 replaced it by a measured ratio that is near one half for full-size
    #: Ethernet segments, so the arithmetic below stays a fair estimate there too.
    adv_win_scale: int = 1

    @property
    def max_window_bytes(self) -> int:
        """The largest window one stream can reach with dilocod's sockets: window_bytes(None)."""
        return self.window_bytes(None)

    def window_bytes(self, fixed_buffer_bytes: int | None = None) -> int:
        """The most bytes one stream can keep in flight, per round trip.

        dilocod.transport.sockets.tune leaves Linux autotuning on unless
        TransportOptions.socket_buffer_bytes fixes the buffers, and no daemon fixes them; with
        autotuning, a receive buffer grows up to tcp_rmem[2] and the window to the part of it not
        reserved for overhead (tcp_rmem[2] / 2 by default), while the send buffer, which holds
        every unacknowledged byte, grows up to tcp_wmem[2] (large TSO packets make its overhead
        small). rmem_max and wmem_max do not matter then. With fixed buffers of B bytes
        (SO_RCVBUF/SO_SNDBUF) the kernel takes min(B, rmem_max) (or wmem_max) and doubles it for
        the same overhead, so about min(B, rmem_max, wmem_max) is in flight. The sender's limit
        and the receiver's both apply; this host's settings stand in for the peer's (install the
        same sysctl file on both ends).
        """
        if fixed_buffer_bytes is not None:
            return min(fixed_buffer_bytes, self.rmem_max, self.wmem_max)
        return min(_window_from_space(self.tcp_rmem[2], self.adv_win_scale), self.tcp_wmem[2])


@dataclass(frozen=True, slots=True)
class StreamsChoice:
    streams: int
    #: What one stream carries at this RTT: window / rtt, in Gbit/s.
    per_stream_gbps: float
    reason: str
    #: Which sysctls to raise, and to what, when max_streams cannot fill rate x rtt; else None.
    sysctl_advice: str | None


def _per_stream_gbps(window_bytes: int, rtt_s: float) -> float:
    return math.inf if rtt_s <= 0 else window_bytes * 8 / rtt_s / 1e9


def _bdp_bytes(rate_gbps: float, rtt_s: float) -> float:
    return rate_gbps * 1e9 / 8 * max(rtt_s, 0.0)


def _streams_needed(bdp_bytes: float, window_bytes: int) -> int:
    # The small tolerance keeps an exact multiple (2.0000000001 after float rounding) at 2.
    return max(1, math.ceil(bdp_bytes / window_bytes - 1e-9))


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB" if n < 10 * MiB else f"{n / MiB:.0f} MiB"


def _round_up_mib(n: float) -> int:
    """n rounded up to a power of two of MiB: sysctl values a person recognises."""
    return MiB << max(0, math.ceil(math.log2(max(n, 1) / MiB)))


def choose_streams(
    rate_gbps: float,
    rtt_s: float,
    window_bytes: int,
    *,
    min_streams: int = 1,
    max_streams: int = 16,
    headroom: float = 1.0,
) -> StreamsChoice:
    """Enough streams to keep rate x rtt (the bandwidth-delay product) in flight: ceil(bdp x
    headroom / window), clamped to min_streams..max_streams.

    A TCP stream carries at most one window per round trip: a 4 MiB window at 100 ms carries
    4 MiB x 8 / 0.1 s = 0.34 Gbit/s, so 5 Gbit/s needs 15 streams. When max_streams cannot fill
    the link, sysctl_advice says how far to raise the windows (assuming the default overhead
    halving of receive buffers).
    """
    if window_bytes <= 0:
        raise ValueError(f"window must be positive, not {window_bytes}")
    if not 1 <= min_streams <= max_streams:
        raise ValueError(f"need 1 <= min_streams <= max_streams, not {min_streams}, {max_streams}")
    if headroom < 1.0:
        raise ValueError(f"headroom must be at least 1, not {headroom}")
    per_stream = _per_stream_gbps(window_bytes, rtt_s)
    bdp = _bdp_bytes(rate_gbps, rtt_s)
    needed = _streams_needed(bdp * headroom, window_bytes)
    streams = min(max(needed, min_streams), max_streams)
    reason = (
        f"{rate_gbps:.2f} Gbit/s x {rtt_s * 1e3:.3g} ms RTT = {bdp / 1e6:.3g} MB in flight; one stream's "
        f"{_mib(window_bytes)} window carries {per_stream:.3g} Gbit/s, so {needed} stream"
        f"{'s fill' if needed != 1 else ' fills'} the link"
        + (f" with {headroom:g} x headroom" if headroom > 1.0 else "")
    )
    advice = None
    if needed > max_streams:
        window = bdp / max_streams
        rmem, wmem = _round_up_mib(_space_for_window(math.ceil(window), 1)), _round_up_mib(window)
        reason += f"; capped at {max_streams}, which carry {per_stream * max_streams:.2f} Gbit/s"
        advice = (
            f"raise the third value of net.ipv4.tcp_rmem to at least {rmem} ({_mib(rmem)}) and of "
            f"net.ipv4.tcp_wmem to at least {wmem} ({_mib(wmem)}) on both hosts, so that {max_streams} "
            f"streams keep {bdp / 1e6:.3g} MB in flight (see {SYSCTL_FILE})"
        )
    elif streams > needed:
        reason += f"; {streams} is the least used"
    return StreamsChoice(streams, per_stream, reason, advice)


#: --streams auto without advice: the rate the stream count is planned for (the top of the 2-5
#: Gbit/s links dilocod is built for); at least two data connections, so that losing one leaves
#: another to resend its chunks on; at most 64 (a session's max_data_connections).
AUTO_RATE_GBPS = 5.0
AUTO_MIN_STREAMS = 2
AUTO_MAX_STREAMS = 64
#: Streams beyond what the windows' maxima need: a cubic stream's window spends most of its time
#: below its maximum (at 100 ms and 4 MiB windows one carried 0.26 Gbit/s, 0.8 of window / RTT),
#: and a connection costs little once open (docs/design.md).
AUTO_HEADROOM = 1.5


def auto_streams(rtt_s: float, settings: TcpSettings) -> StreamsChoice:
    """What `--streams auto` opens without advice, at this RTT with this host's TCP windows: the
    learner's choice for every session, and `dilocod bench`'s "auto" row."""
    return choose_streams(
        AUTO_RATE_GBPS,
        rtt_s,
        settings.max_window_bytes,
        min_streams=AUTO_MIN_STREAMS,
        max_streams=AUTO_MAX_STREAMS,
        headroom=AUTO_HEADROOM,
    )


def bdp_warning(rate_gbps: float, rtt_s: float, settings: TcpSettings, streams: int) -> str | None:
    """A sentence naming the sysctls to raise when `streams` streams cannot keep rate x rtt in
    flight with this host's windows; None when they can."""
    window = settings.max_window_bytes
    if streams < 1 or window <= 0:
        return None
    carried = streams * _per_stream_gbps(window, rtt_s)
    if carried >= rate_gbps:
        return None
    bdp = _bdp_bytes(rate_gbps, rtt_s)
    need = math.ceil(bdp / streams)
    fixes = []
    if _window_from_space(settings.tcp_rmem[2], settings.adv_win_scale) < need:
        rmem = _round_up_mib(_space_for_window(need, settings.adv_win_scale))
        fixes.append(f"net.ipv4.tcp_rmem's maximum from {settings.tcp_rmem[2]} to {rmem}")
    if settings.tcp_wmem[2] < need:
        fixes.append(f"net.ipv4.tcp_wmem's maximum from {settings.tcp_wmem[2]} to {_round_up_mib(need)}")
    return (
        f"{streams} stream{'s' if streams != 1 else ''} with {_mib(window)} windows carry at most "
        f"{carried:.2f} Gbit/s at {rtt_s * 1e3:.3g} ms RTT, less than {rate_gbps:.2f}: raise "
        f"{' and '.join(fixes)} on both hosts ({SYSCTL_FILE} sets both to 128 MiB)"
    )


# ------------------------------------------------------------------- the learner's codec decision


@dataclass(frozen=True, slots=True)
class PushPeriod:
    """A stretch of time during which pushes were on the wire, all with one codec."""

    codec: str
    raw_bytes: int
    seconds: float


@dataclass(slots=True)
class PushMeter:
    """Turns overlapping pushes into busy periods: from the start of the first push in flight to
    the end of the last, with the raw bytes of all of them. Two pushes that share the link each
    see half of it; the period sees all of it. A push ends with the receiver's acknowledgement, a
    round trip after its last byte left, so one RTT (at most half the period) is taken off.

    A period measures nothing, and is dropped, when a push in it failed, when it mixes codecs, or
    when it carried less than min_bytes: small pushes say more about latency than about the rate.
    Time is passed in (now_s)."""

    min_bytes: int = 0
    _in_flight: int = 0
    _started_s: float = 0.0
    _raw_bytes: int = 0
    _codecs: set[str] = field(default_factory=set)
    _spoiled: bool = False

    def started(self, now_s: float, codec: str) -> None:
        if self._in_flight == 0:
            self._started_s, self._raw_bytes, self._spoiled = now_s, 0, False
            self._codecs.clear()
        self._in_flight += 1
        self._codecs.add(codec)

    def finished(self, now_s: float, raw_bytes: int | None, rtt_s: float = 0.0) -> PushPeriod | None:
        """A push ended, with its raw size, or None if it failed. Returns the period it closes, if
        that measures anything."""
        if self._in_flight == 0:
            raise ValueError("finished() without started()")
        self._in_flight -= 1
        if raw_bytes is None:
            self._spoiled = True
        else:
            self._raw_bytes += raw_bytes
        if self._in_flight or self._spoiled or len(self._codecs) != 1 or now_s <= self._started_s:
            return None
        if self._raw_bytes < self.min_bytes:
            return None
        seconds = now_s - self._started_s
        return PushPeriod(next(iter(self._codecs)), self._raw_bytes, max(seconds - rtt_s, seconds / 2))


@dataclass(slots=True)
class CodecTuner:
    """The learner's codec under --codec auto without advice: a small state machine fed with the
    codec figures of its own first outer gradient and with every push period it completes.

    - It starts uncompressed; the first period measures the link (raw bytes / seconds), and with
      the figures that gives the first choose_codec.
    - It keeps an EMA of the raw-equivalent Gbit/s achieved under the current codec. The link rate
      it implies is that EMA for none, and the EMA / ratio (the wire rate) for a compressor, which
      assumes the pushes were bound by the link. When that rate moves by more than `change_factor`
      from the one the last choice was made for, it chooses again.
    - A compressor bound by the CPU hides the link: its pushes run at the CPU's rate whatever the
      link does. So every `probe_every` pushes under a compressor, one goes uncompressed (see
      next_codec) and measures the link itself; a link that moved by `change_factor` is chosen
      for again.
    - A compressor that achieves less than uncompressed pushes do (by the margin), after
      `min_pushes` periods, was bound by the CPU below the model's figures: it is ruled out until
      the link rate changes, and the next best (often none) is chosen. This is what keeps auto
      near uncompressed at worst when the model's CPU figures are too optimistic.

    Methods return a CodecChoice (to be logged) for the first choice and for every change of
    codec, else None: a re-evaluation that keeps the codec only moves the planned link rate.
    """

    threads: int
    margin: float = 1.03
    change_factor: float = 1.5
    #: Weight of the newest period in the EMAs.
    ema_weight: float = 0.3
    min_pushes: int = 3
    #: Under a compressor, one push in this many (plus one) goes uncompressed to measure the link.
    probe_every: int = 16
    codec: str = "none"
    figures: tuple[CodecFigure, ...] = ()
    #: The link rate the current codec was chosen for; None until the first choice.
    planned_link_gbps: float | None = None
    #: EMA of uncompressed periods (probes included): what none achieves on this link.
    none_gbps: float | None = None
    #: EMA of periods under the current codec, since it was chosen.
    ema_gbps: float | None = None
    pushes: int = 0
    since_probe: int = 0
    ruled_out: set[str] = field(default_factory=set)

    def figures_measured(self, figures: Iterable[CodecFigure]) -> CodecChoice | None:
        self.figures = tuple(figures)
        link = self.link_gbps()
        if link is None or self.planned_link_gbps is not None:
            return None  # the first push period makes the first choice
        return self._choose(link, "first choice", always=True)

    def next_codec(self) -> str:
        """The codec of the next push: the current one, or none as a probe of the link."""
        if self.codec == "none":
            return "none"
        self.since_probe += 1
        if self.since_probe > self.probe_every:
            self.since_probe = 0
            return "none"
        return self.codec

    def push_done(self, period: PushPeriod) -> CodecChoice | None:
        if period.raw_bytes <= 0 or period.seconds <= 0:
            return None
        gbps = period.raw_bytes * 8 / period.seconds / 1e9
        if period.codec == "none" and self.codec != "none":  # a probe
            self.none_gbps = self._ema(self.none_gbps, gbps)
            return self._check(self.none_gbps)
        if period.codec != self.codec:
            return None  # a period that started under the previous codec says nothing of this one
        self.ema_gbps = self._ema(self.ema_gbps, gbps)
        self.pushes += 1
        if self.codec == "none":
            self.none_gbps = self.ema_gbps
        link = self.link_gbps()
        if not self.figures or link is None:
            return None
        if self.planned_link_gbps is None:
            return self._choose(link, "first choice", always=True)
        if self.pushes < self.min_pushes:
            return None
        return self._check(link)

    def link_gbps(self) -> float | None:
        """The link rate the current codec's pushes imply (see the class docstring), or None."""
        if self.ema_gbps is None:
            return None
        if self.codec == "none":
            return self.ema_gbps
        ratio = next((f.ratio for f in self.figures if f.codec == self.codec), 1.0)
        return self.ema_gbps / max(ratio, 1.0)

    def _check(self, link: float) -> CodecChoice | None:
        planned = self.planned_link_gbps
        if planned is None or not self.figures:
            return None
        achieved, uncompressed = self.ema_gbps, self.none_gbps
        if (
            self.codec != "none"
            and self.pushes >= self.min_pushes
            and achieved is not None
            and uncompressed is not None
            and achieved < uncompressed / self.margin
        ):
            self.ruled_out.add(self.codec)
            return self._choose(
                uncompressed,
                f"{self.codec} achieved {achieved:.2f} Gbit/s, less than the {uncompressed:.2f} "
                "of uncompressed pushes, so the CPU bound it",
            )
        if link > planned * self.change_factor or link < planned / self.change_factor:
            self.ruled_out.clear()
            return self._choose(link, f"the link rate moved from {planned:.2f} to {link:.2f} Gbit/s")
        return None

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ema_weight * (new - old)

    def _choose(self, link_gbps: float, why: str, *, always: bool = False) -> CodecChoice | None:
        candidates = [f for f in self.figures if f.codec not in self.ruled_out]
        choice = choose_codec(candidates, link_gbps, self.threads, self.margin)
        self.planned_link_gbps = link_gbps
        if choice.codec == self.codec and not always:
            return None
        if choice.codec != self.codec:
            self.codec, self.ema_gbps, self.pushes, self.since_probe = choice.codec, None, 0, 0
        reason = choice.reason
        if self.ruled_out and all(f.codec == "none" for f in candidates):
            out = " and ".join(sorted(self.ruled_out))
            reason = f"uncompressed at {link_gbps:.2f} Gbit/s: {out} did worse than uncompressed here"
        return CodecChoice(choice.codec, choice.predicted_gbps, f"{why}: {reason}")


def spread_sample(data: wire_codecs.Buffer, chunk_bytes: int, max_bytes: int) -> bytes:
    """Whole chunks spread evenly over `data`, at most max_bytes of them (a fragment's first
    tensors can differ from its last: embeddings, norms, large matrices)."""
    view = memoryview(data).cast("B")
    chunks = max(1, math.ceil(len(view) / chunk_bytes))
    take = max(1, min(chunks, max_bytes // chunk_bytes))
    picks = sorted({i * chunks // take for i in range(take)})
    return b"".join(view[i * chunk_bytes : (i + 1) * chunk_bytes] for i in picks)


# ------------------------------------------------------------------------------ advice for a link


@dataclass(frozen=True, slots=True)
class Advice:
    """What `dilocod bench` recommends for one link; JSON-serialisable (save_advice)."""

    #: "host:port" of the syncer (or bench server) it was measured against; "" = any.
    target: str
    #: Measured link rate: the raw TCP ceiling.
    rate_gbps: float
    rtt_ms: float
    streams: int
    codec: str
    chunk_bytes: int
    #: ISO 8601 time of the measurement.
    measured_at: str
    figures: tuple[CodecFigure, ...] = ()


ADVICE_SCHEMA = "dilocod-link-advice/1"


def advice_to_json(advice: Advice) -> dict[str, Any]:
    out = asdict(advice)
    # JSON has no infinity: an unbounded codec speed (none) is written as null.
    out["figures"] = [
        {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(f).items()}
        for f in advice.figures
    ]
    return out


class _Invalid(ValueError):
    pass


def _field(entry: Mapping[str, Any], key: str, kind: Any) -> Any:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise _Invalid(f"{key} is {value!r}")
    return value


def _speed(value: object, key: str) -> float:
    if value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise _Invalid(f"{key} is {value!r}")
    return float(value)


def advice_from_json(entry: object) -> Advice:
    """Raises ValueError naming the first field that is missing or of the wrong kind."""
    if not isinstance(entry, dict):
        raise _Invalid(f"an entry is {type(entry).__name__}, not an object")
    codec = _field(entry, "codec", str)
    if codec not in CODEC_NAMES:
        raise _Invalid(f"codec is {codec!r}")
    streams = _field(entry, "streams", int)
    chunk = _field(entry, "chunk_bytes", int)
    if not 0 <= streams <= 64 or chunk <= 0:
        raise _Invalid(f"streams {streams} or chunk_bytes {chunk} out of range")
    figures = []
    listed = entry.get("figures", [])
    if not isinstance(listed, list):
        raise _Invalid(f"figures is {listed!r}")
    for figure in listed:
        if not isinstance(figure, dict) or figure.get("codec") not in CODEC_NAMES:
            raise _Invalid(f"a codec figure is {figure!r}")
        ratio = _speed(figure.get("ratio"), "ratio")
        compress = _speed(figure.get("compress_gbps"), "compress_gbps")
        decompress = _speed(figure.get("decompress_gbps"), "decompress_gbps")
        figures.append(CodecFigure(figure["codec"], ratio, compress, decompress))
    rate, rtt = float(_field(entry, "rate_gbps", int | float)), float(_field(entry, "rtt_ms", int | float))
    if not (math.isfinite(rate) and math.isfinite(rtt) and rate >= 0 and rtt >= 0):
        raise _Invalid(f"rate_gbps {rate} or rtt_ms {rtt} out of range")
    return Advice(
        target=_field(entry, "target", str),
        rate_gbps=rate,
        rtt_ms=rtt,
        streams=streams,
        codec=codec,
        chunk_bytes=chunk,
        measured_at=_field(entry, "measured_at", str),
        figures=tuple(figures),
    )


# ------------------------------------------------------------------- measuring and reading files


def measure_codecs(
    sample: wire_codecs.Buffer,
    *,
    chunk_bytes: int = 1 << 20,
    shuffle_item_size: int = 4,
    codecs: Sequence[str] = CODEC_NAMES,
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
        WIRE_CODEC_NAMES[codec],
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


def read_tcp_settings(proc_root: Path = Path("/proc/sys")) -> TcpSettings:
    """The TCP sysctls of this host, from /proc/sys (or a copy of its layout under proc_root).

    A file that is missing or unreadable gives the stock Linux value (LINUX_DEFAULTS) and, for
    the congestion control, "unknown": this feeds estimates, never a refusal to run.
    """

    def read(name: str) -> list[str] | None:
        try:
            return (proc_root / name).read_text().split()
        except (OSError, UnicodeDecodeError):
            return None

    def integers(name: str, default: Any, count: int) -> Any:
        words = read(name)
        try:
            values = [int(w) for w in words] if words is not None and len(words) == count else None
        except ValueError:
            values = None
        if values is None:
            return default
        return values[0] if count == 1 else tuple(values)

    congestion = read("net/ipv4/tcp_congestion_control")
    available = read("net/ipv4/tcp_available_congestion_control")
    return TcpSettings(
        congestion_control=congestion[0] if congestion else "unknown",
        available_congestion_control=tuple(available or ()),
        rmem_max=integers("net/core/rmem_max", LINUX_DEFAULTS["rmem_max"], 1),
        wmem_max=integers("net/core/wmem_max", LINUX_DEFAULTS["wmem_max"], 1),
        tcp_rmem=integers("net/ipv4/tcp_rmem", LINUX_DEFAULTS["tcp_rmem"], 3),
        tcp_wmem=integers("net/ipv4/tcp_wmem", LINUX_DEFAULTS["tcp_wmem"], 3),
        adv_win_scale=integers("net/ipv4/tcp_adv_win_scale", LINUX_DEFAULTS["tcp_adv_win_scale"], 1),
    )


def advice_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where `dilocod bench` saves link advice and the learner looks for it: $DILOCOD_ADVICE when
    set, else $XDG_CONFIG_HOME/dilocod/link-advice.json, with XDG_CONFIG_HOME defaulting to
    ~/.config (the XDG base directory rule). Under systemd, set DILOCOD_ADVICE in the unit (or
    give the service user a home): a service has no ~/.config of a person's."""
    env = os.environ if environ is None else environ
    explicit = env.get("DILOCOD_ADVICE")
    if explicit:
        return Path(explicit).expanduser()
    config_home = env.get("XDG_CONFIG_HOME")
    base = Path(config_home) if config_home and Path(config_home).is_absolute() else Path.home() / ".config"
    return base / "dilocod" / "link-advice.json"


def _read_links(path: Path) -> dict[str, Any]:
    """The file's entries keyed by target; raises ValueError saying what is wrong with it."""
    try:
        document = json.loads(path.read_text())
    except UnicodeDecodeError as exc:
        raise ValueError(f"not text: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(document, dict) or document.get("schema") != ADVICE_SCHEMA:
        found = document.get("schema") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"schema is {found!r}, not {ADVICE_SCHEMA!r}")
    links = document.get("links")
    if not isinstance(links, dict):
        raise ValueError("no 'links' object")
    return links


def save_advice(advice: Advice, path: Path | None = None) -> Path:
    """Write `advice` into the advice file (advice_path() unless given), keeping the entries of
    other targets: one file, a dict keyed by target. Atomic: a temporary file in the same
    directory, fsync, rename, fsync of the directory, so a reader sees the old file or the new
    one, never half of one. A corrupt file is replaced (with a warning). Returns the path."""
    path = path or advice_path()
    links: dict[str, Any] = {}
    try:
        links = _read_links(path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        log.warning("replacing an unusable link advice file", path=str(path), problem=str(exc))
    links[advice.target] = advice_to_json(advice)
    text = json.dumps({"schema": ADVICE_SCHEMA, "links": links}, indent=2, sort_keys=True) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return path


def load_advice(target: str, path: Path | None = None) -> Advice | None:
    """The advice saved for `target` ("host:port" exactly as saved), else the one saved for any
    target (""), else None. A file that cannot be read, is not JSON, has another schema or holds
    a malformed entry logs a warning saying so and gives None: the learner then tunes itself."""
    path = path or advice_path()
    try:
        links = _read_links(path)
        entry = links.get(target, links.get(""))
        return None if entry is None else advice_from_json(entry)
    except FileNotFoundError:
        return None
    except OSError as exc:
        problem = exc.strerror or str(exc)
    except ValueError as exc:
        problem = str(exc)
    log.warning("ignoring the link advice file", path=str(path), target=target, problem=problem)
    return None
