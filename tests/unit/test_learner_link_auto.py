"""`dilocod learner --streams auto --codec auto` inside the Link: explicit values win, saved advice
comes next, and without advice the stream count follows the session's RTT and the host's TCP
windows while the codec follows the CodecTuner, fed by push periods and the measured figures.
No network: the Link's decision seams are called directly, with a stand-in session."""

from __future__ import annotations

import asyncio
import math

import pytest
from structlog.testing import capture_logs

import dilocod.learner.link as link_module
from dilocod.learner.bridge import Bridge
from dilocod.learner.link import Link, LinkConfig
from dilocod.tuning.advice import Advice
from dilocod.tuning.codecs import CodecFigure
from dilocod.tuning.streams import AUTO_MAX_STREAMS, TcpSettings

MiB = 1 << 20
IMAGE = TcpSettings("bbr", ("bbr",), 4 * MiB, 4 * MiB, (4096, 131072, 32 * MiB), (4096, 16384, 4 * MiB))
STOCK = TcpSettings("cubic", ("cubic",), 212992, 212992, (4096, 131072, 6 * MiB), (4096, 16384, 4 * MiB))
#: Windows of 512 KiB: 64 streams carry 2.7 Gbit/s at 100 ms.
SMALL = TcpSettings("cubic", ("cubic",), 212992, 212992, (4096, 131072, MiB), (4096, 16384, MiB // 2))
COMPRESSIBLE = [
    CodecFigure("none", 1.0, math.inf, math.inf),
    CodecFigure("lz4", 1.1, 6.0, 20.0),
    CodecFigure("zstd", 1.5, 3.0, 10.0),
]
ADVICE = Advice("syncer:7070", 4.78, 12.5, 6, "lz4", MiB, "2026-05-01T12:00:00+00:00", tuple(COMPRESSIBLE))


def _link(**config: object) -> Link:
    return Link(LinkConfig("127.0.0.1", 7070, "learner-a", None, **config), (), Bridge())  # type: ignore[arg-type]


class _Session:
    """What _auto_streams reads of a session."""

    def __init__(self, rtt_s: float | None) -> None:
        self.rtt_s = rtt_s

    def round_trip_s(self) -> float | None:
        return self.rtt_s


def test_explicit_values_win_over_advice() -> None:
    with capture_logs() as logs:
        link = _link(streams=3, codec="zstd", advice=ADVICE)
    assert (link._streams, link._codec, link._tuner) == (3, "zstd", None)
    assert logs == []


def test_auto_takes_the_saved_advice() -> None:
    with capture_logs() as logs:
        link = _link(streams="auto", codec="auto", advice=ADVICE)
    assert (link._streams, link._codec, link._tuner) == (6, "lz4", None)
    assert link.stats.codec == "lz4"
    assert [(e["event"], e["source"]) for e in logs] == [
        ("streams chosen", "advice"),
        ("codec chosen", "advice"),
    ]
    assert "syncer:7070" in logs[0]["reason"] and "4.78 Gbit/s" in logs[0]["reason"]


def test_auto_without_advice_measures() -> None:
    link = _link(streams="auto", codec="auto")
    assert link._streams is None  # chosen for every session from its RTT
    assert link._codec == "none" and link._tuner is not None
    assert link._tuner.threads == link._options.codec_threads


def test_streams_follow_the_rtt_and_the_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    link = _link(streams="auto")
    monkeypatch.setattr(link_module, "read_tcp_settings", lambda: IMAGE)
    with capture_logs() as logs:
        # 62.5 MB / 4 MiB = 14.9 windows, 1.5 x that with headroom
        assert link._auto_streams(0.0, _Session(0.100)) == 23  # type: ignore[arg-type]
        assert link._auto_streams(0.0, _Session(0.030)) == 7  # type: ignore[arg-type]  # 18.75 MB
        assert link._auto_streams(0.0, _Session(50e-6)) == 2  # type: ignore[arg-type]  # loopback: the least
    assert [e["log_level"] for e in logs] == ["info", "info", "info"]
    assert (
        logs[0]["rtt_ms"] == 100.0 and logs[0]["rtt_from"] == "kernel" and "23 streams" in logs[0]["reason"]
    )

    monkeypatch.setattr(link_module, "read_tcp_settings", lambda: STOCK)  # 3 MiB windows: 30 with headroom
    with capture_logs() as logs:
        assert link._auto_streams(0.0, _Session(0.100)) == 30  # type: ignore[arg-type]
    assert [e["log_level"] for e in logs] == ["info"]

    # 512 KiB windows: too few even at 64
    monkeypatch.setattr(link_module, "read_tcp_settings", lambda: SMALL)
    with capture_logs() as logs:
        assert link._auto_streams(0.0, _Session(0.100)) == AUTO_MAX_STREAMS  # type: ignore[arg-type]
    [entry] = logs
    assert entry["log_level"] == "warning" and "net.ipv4.tcp_rmem" in entry["sysctl"]


def test_without_a_kernel_rtt_the_connect_time_stands_in(monkeypatch: pytest.MonkeyPatch) -> None:
    link = _link(streams="auto")
    monkeypatch.setattr(link_module, "read_tcp_settings", lambda: IMAGE)

    async def main() -> int:
        dialled_s = asyncio.get_running_loop().time() - 0.100  # the control connection took 100 ms
        return link._auto_streams(dialled_s, _Session(None))  # type: ignore[arg-type]

    with capture_logs() as logs:
        streams = asyncio.run(main())
    assert streams >= 15  # at least 100 ms, so at least the streams 100 ms needs
    assert logs[0]["rtt_from"] == "connect time"


def test_the_codec_follows_the_tuner() -> None:
    link = _link(codec="auto")
    assert link._tuner is not None
    link._meter.started(0.0, "none")
    link._push_ended(1.0, 250_000_000, _Session(None))  # type: ignore[arg-type]  # 2 Gbit/s; no figures yet
    assert link._codec == "none"

    loop = asyncio.new_event_loop()
    try:
        measured = loop.create_future()
        measured.set_result(COMPRESSIBLE)
        with capture_logs() as logs:
            link._codecs_measured(measured)
    finally:
        loop.close()
    assert link._codec == link.stats.codec == "zstd"
    assert [e["event"] for e in logs] == ["codec figures measured", "codec chosen"]
    assert logs[1]["source"] == "measured" and logs[1]["predicted_gbps"] == 3.0
    assert link._tuner.next_codec() == "zstd"

    link._meter.started(2.0, "zstd")
    link._push_ended(3.0, None, _Session(None))  # type: ignore[arg-type]  # a failed push measures nothing
    link._meter.started(4.0, "zstd")
    link._push_ended(5.0, 1 << 20, _Session(None))  # type: ignore[arg-type]  # nor does a small one
    assert link._tuner.pushes == 0
    link._meter.started(6.0, "zstd")
    link._push_ended(7.0, 375_000_000, _Session(0.5))  # type: ignore[arg-type]  # 3 Gbit/s net of the ack RTT
    assert link._tuner.pushes == 1 and link._tuner.ema_gbps == pytest.approx(6.0)
