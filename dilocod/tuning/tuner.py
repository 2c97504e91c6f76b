"""The learner's running codec decision: push throughput measured push by push (PushMeter) and
the codec chosen again when the link's rate moves (CodecTuner), from the codec figures of its own
outer gradients (dilocod.tuning.codecs).

Pure: fed measurements, it returns decisions. Must not import torch, asyncio or socket.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dilocod.tuning.codecs import CodecChoice, CodecFigure, choose_codec


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
