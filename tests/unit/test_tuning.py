"""Link tuning: the codec model and choice (fixed figures, never timing), the stream count from the
bandwidth-delay product, the TCP window under the sysctls (a fake /proc tree), the advice file
(round trip, several targets, corrupt files), the learner's running codec decision, and
measure_codecs on real bytes (ratios only: speeds are not asserted)."""

from __future__ import annotations

import array
import json
import math
import os
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from dilocod.tuning.advice import Advice, advice_path, load_advice, save_advice
from dilocod.tuning.codecs import (
    CodecChoice,
    CodecFigure,
    choose_codec,
    measure_codecs,
    predicted_gbps,
    spread_sample,
)
from dilocod.tuning.streams import SYSCTL_FILE, TcpSettings, bdp_warning, choose_streams, read_tcp_settings
from dilocod.tuning.tuner import CodecTuner, PushMeter, PushPeriod

MiB = 1 << 20
INF = math.inf
NONE = CodecFigure("none", 1.0, INF, INF)
#: What random bytes give: nothing to gain, and compression still costs time.
INCOMPRESSIBLE = [NONE, CodecFigure("lz4", 1.0, 4.0, 100.0), CodecFigure("zstd", 1.0, 3.0, 100.0)]
#: bf16-like outer gradients: zstd reaches the entropy bound (about 1.5x), lz4 less.
COMPRESSIBLE = [NONE, CodecFigure("lz4", 1.1, 6.0, 20.0), CodecFigure("zstd", 1.5, 3.0, 10.0)]
#: This image's sysctls: tcp_wmem's 4 MiB maximum bounds the window (docs/design.md §4.1).
IMAGE = TcpSettings(
    "bbr", ("reno", "bbr", "cubic"), 4 * MiB, 4 * MiB, (4096, 131072, 32 * MiB), (4096, 16384, 4 * MiB)
)
STOCK = TcpSettings(
    "cubic", ("reno", "cubic"), 212992, 212992, (4096, 131072, 6 * MiB), (4096, 16384, 4 * MiB)
)
WAN_CONF = TcpSettings(
    "bbr", ("bbr",), 128 * MiB, 128 * MiB, (4096, 131072, 128 * MiB), (4096, 65536, 128 * MiB)
)


# --------------------------------------------------------------------------------- codec model


def test_a_fast_link_with_incompressible_data_stays_uncompressed() -> None:
    choice = choose_codec(INCOMPRESSIBLE, 40.0, threads=2)
    assert choice.codec == "none"
    assert choice.predicted_gbps == 40.0
    assert "40.00" in choice.reason


def test_a_slow_link_with_compressible_data_compresses() -> None:
    choice = choose_codec(COMPRESSIBLE, 2.0, threads=2)
    # zstd: min(2 x 1.5, 3 x 2, 10 x 2) = 3.0; lz4: min(2.2, 12, 40) = 2.2; none: 2.0
    assert choice.codec == "zstd"
    assert choice.predicted_gbps == pytest.approx(3.0)
    assert "link" in choice.reason


def test_compressible_data_on_a_fast_link_is_bound_by_the_cpu() -> None:
    # 40 Gbit/s: zstd could only feed 6, lz4 12; both lose to the link itself.
    choice = choose_codec(COMPRESSIBLE, 40.0, threads=2)
    assert choice.codec == "none"
    assert "lz4" in choice.reason and "slower" in choice.reason  # the best loser is named


def test_the_model_terms() -> None:
    zstd = CodecFigure("zstd", 1.5, 3.0, 10.0)
    assert predicted_gbps(zstd, 2.0, 2) == pytest.approx(3.0)  # the link
    assert predicted_gbps(zstd, 5.0, 2) == pytest.approx(6.0)  # compression on 2 threads
    assert predicted_gbps(CodecFigure("zstd", 1.5, 30.0, 2.0), 5.0, 2) == pytest.approx(4.0)  # decompression
    assert predicted_gbps(NONE, 5.0, 2) == 5.0
    with pytest.raises(ValueError, match="threads"):
        predicted_gbps(zstd, 5.0, 0)


def test_a_compressor_must_beat_uncompressed_by_the_margin() -> None:
    slight = [NONE, CodecFigure("zstd", 1.02, 100.0, 100.0)]  # 2 % better on a 2 Gbit/s link
    held_back = choose_codec(slight, 2.0, 2)  # default margin 1.03
    assert held_back.codec == "none" and "less than 3 % faster" in held_back.reason
    assert choose_codec(slight, 2.0, 2, margin=1.01).codec == "zstd"
    assert choose_codec(slight, 2.0, 2, margin=1.0).codec == "zstd"


def test_no_figures_means_uncompressed() -> None:
    assert choose_codec([], 3.0, 2).codec == "none"
    assert choose_codec([NONE], 3.0, 2).codec == "none"


figures_strategy = st.lists(
    st.builds(
        CodecFigure,
        st.sampled_from(["lz4", "zstd"]),
        st.floats(1.0, 4.0),
        st.floats(0.01, 100.0),
        st.floats(0.01, 100.0),
    ),
    max_size=4,
)


@given(figures_strategy, st.floats(0.01, 400.0), st.integers(1, 16), st.floats(1.0, 1.5))
def test_auto_never_predicts_less_than_uncompressed(
    figures: list[CodecFigure], link_gbps: float, threads: int, margin: float
) -> None:
    choice = choose_codec([NONE, *figures], link_gbps, threads, margin)
    best = max((predicted_gbps(f, link_gbps, threads) for f in figures), default=0.0)
    assert choice.predicted_gbps >= link_gbps
    if choice.codec == "none":
        assert choice.predicted_gbps == link_gbps
        assert best < link_gbps * margin
    else:
        assert choice.predicted_gbps >= link_gbps * margin
        assert choice.predicted_gbps == best


# ------------------------------------------------------------------------------------ streams


def test_streams_fill_the_bandwidth_delay_product() -> None:
    choice = choose_streams(5.0, 0.100, 4 * MiB)
    assert choice.streams == 15  # 62.5 MB / 4 MiB = 14.9
    assert choice.per_stream_gbps == pytest.approx(0.3355, rel=1e-3)
    assert choice.sysctl_advice is None
    assert "15 streams" in choice.reason


def test_too_few_streams_allowed_gives_sysctl_advice() -> None:
    choice = choose_streams(5.0, 0.100, 4 * MiB, max_streams=8)
    assert choice.streams == 8
    assert choice.sysctl_advice is not None
    # 62.5 MB over 8 streams = 7.8 MB each: tcp_wmem to 8 MiB, tcp_rmem (half is overhead) to 16 MiB
    assert "net.ipv4.tcp_rmem" in choice.sysctl_advice and str(16 * MiB) in choice.sysctl_advice
    assert "net.ipv4.tcp_wmem" in choice.sysctl_advice and str(8 * MiB) in choice.sysctl_advice
    assert SYSCTL_FILE in choice.sysctl_advice


def test_a_short_rtt_needs_the_least_streams() -> None:
    assert choose_streams(5.0, 50e-6, 4 * MiB).streams == 1
    assert choose_streams(5.0, 50e-6, 4 * MiB, min_streams=2).streams == 2
    assert choose_streams(5.0, 0.0, 4 * MiB).streams == 1
    with pytest.raises(ValueError):
        choose_streams(5.0, 0.1, 0)


@given(st.floats(0.01, 100.0), st.floats(1e-5, 0.5), st.integers(64 * 1024, 256 * MiB))
def test_the_streams_chosen_carry_the_rate_unless_capped(rate: float, rtt: float, window: int) -> None:
    choice = choose_streams(rate, rtt, window, max_streams=16)
    assert 1 <= choice.streams <= 16
    if choice.sysctl_advice is None:
        assert choice.streams * choice.per_stream_gbps >= rate * (1 - 1e-6)
        if choice.streams > 1:  # and no more than needed
            assert (choice.streams - 1) * choice.per_stream_gbps < rate


def test_the_window_one_stream_reaches() -> None:
    assert IMAGE.max_window_bytes == 4 * MiB  # tcp_wmem bounds it; tcp_rmem allows 16 MiB
    assert STOCK.max_window_bytes == 3 * MiB  # half of tcp_rmem's 6 MiB is kernel overhead
    assert WAN_CONF.max_window_bytes == 64 * MiB  # the sysctl file: 5.4 Gbit/s per stream at 100 ms
    # Fixed buffers (SO_RCVBUF/SO_SNDBUF) are capped by rmem_max and wmem_max instead.
    assert IMAGE.window_bytes(16 * MiB) == 4 * MiB
    assert WAN_CONF.window_bytes(16 * MiB) == 16 * MiB
    quarter = TcpSettings("bbr", (), 0, 0, (0, 0, 8 * MiB), (0, 0, 64 * MiB), adv_win_scale=2)
    assert quarter.max_window_bytes == 6 * MiB
    negative = TcpSettings("bbr", (), 0, 0, (0, 0, 8 * MiB), (0, 0, 64 * MiB), adv_win_scale=-2)
    assert negative.max_window_bytes == 2 * MiB


def test_bdp_warning_names_the_sysctl_that_binds() -> None:
    assert bdp_warning(5.0, 0.100, IMAGE, 15) is None
    assert bdp_warning(5.0, 0.100, WAN_CONF, 1) is None
    on_image = bdp_warning(5.0, 0.100, IMAGE, 4)
    assert on_image is not None
    assert "net.ipv4.tcp_wmem" in on_image and "tcp_rmem" not in on_image  # rmem's 16 MiB suffice
    assert SYSCTL_FILE in on_image and "1.34" in on_image
    on_stock = bdp_warning(5.0, 0.100, STOCK, 4)
    assert on_stock is not None and "net.ipv4.tcp_rmem" in on_stock and "net.ipv4.tcp_wmem" in on_stock


def _fake_proc(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_read_tcp_settings_from_a_fake_proc_tree(tmp_path: Path) -> None:
    root = _fake_proc(
        tmp_path,
        {
            "net/ipv4/tcp_congestion_control": "bbr\n",
            "net/ipv4/tcp_available_congestion_control": "reno cubic bbr\n",
            "net/core/rmem_max": "134217728\n",
            "net/core/wmem_max": "67108864\n",
            "net/ipv4/tcp_rmem": "4096\t131072\t134217728\n",
            "net/ipv4/tcp_wmem": "4096\t65536\t33554432\n",
            "net/ipv4/tcp_adv_win_scale": "2\n",
        },
    )
    settings = read_tcp_settings(root)
    assert settings == TcpSettings(
        "bbr",
        ("reno", "cubic", "bbr"),
        128 * MiB,
        64 * MiB,
        (4096, 131072, 128 * MiB),
        (4096, 65536, 32 * MiB),
        adv_win_scale=2,
    )
    assert settings.max_window_bytes == 32 * MiB  # min(128 MiB x 3/4, 32 MiB)


def test_missing_or_garbled_sysctls_read_as_linux_defaults(tmp_path: Path) -> None:
    root = _fake_proc(tmp_path, {"net/ipv4/tcp_rmem": "4096 lots\n", "net/core/wmem_max": "1 2\n"})
    settings = read_tcp_settings(root)
    assert settings.congestion_control == "unknown"
    assert settings.available_congestion_control == ()
    assert settings.tcp_rmem == (4096, 131072, 6 * MiB)
    assert settings.wmem_max == 212992
    assert settings.max_window_bytes == STOCK.max_window_bytes


# -------------------------------------------------------------------------------------- advice


def _advice(target: str = "syncer.example:7070", streams: int = 8, codec: str = "zstd") -> Advice:
    return Advice(
        target=target,
        rate_gbps=4.78,
        rtt_ms=12.5,
        streams=streams,
        codec=codec,
        chunk_bytes=MiB,
        measured_at="2026-05-01T12:00:00+00:00",
        figures=tuple(COMPRESSIBLE),
    )


def test_advice_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "link-advice.json"
    assert save_advice(_advice(), path) == path
    assert load_advice("syncer.example:7070", path) == _advice()
    document = json.loads(path.read_text())  # plain JSON: infinity is written as null
    figure = document["links"]["syncer.example:7070"]["figures"][0]
    assert figure == {"codec": "none", "ratio": 1.0, "compress_gbps": None, "decompress_gbps": None}
    assert [p.name for p in path.parent.iterdir()] == ["link-advice.json"]  # no temporary left


def test_advice_for_several_targets_shares_one_file(tmp_path: Path) -> None:
    path = tmp_path / "advice.json"
    save_advice(_advice("a:1", streams=2), path)
    save_advice(_advice("b:2", streams=4), path)
    save_advice(_advice("a:1", streams=6), path)  # replaces a:1, keeps b:2
    a, b = load_advice("a:1", path), load_advice("b:2", path)
    assert a is not None and a.streams == 6
    assert b is not None and b.streams == 4
    assert load_advice("c:3", path) is None  # no entry for it and none for any target
    save_advice(_advice("", streams=3), path)
    fallback = load_advice("c:3", path)
    assert fallback is not None and fallback.streams == 3 and fallback.target == ""
    assert load_advice("a:1", path).streams == 6  # type: ignore[union-attr]  # exact wins


def test_no_advice_file_is_quiet(tmp_path: Path) -> None:
    with capture_logs() as logs:
        assert load_advice("a:1", tmp_path / "missing.json") is None
    assert logs == []


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        pytest.param("{not json", "not JSON", id="not-json"),
        pytest.param('{"schema": "other/9", "links": {}}', "schema", id="wrong-schema"),
        pytest.param("[1, 2]", "schema", id="not-an-object"),
        pytest.param('{"schema": "dilocod-link-advice/1"}', "links", id="no-links"),
        pytest.param(
            '{"schema": "dilocod-link-advice/1", "links": {"a:1": {"codec": "brotli"}}}',
            "codec",
            id="bad-codec",
        ),
        pytest.param(
            '{"schema": "dilocod-link-advice/1", "links": {"a:1": {"codec": "zstd", "streams": "8"}}}',
            "streams",
            id="bad-streams",
        ),
    ],
)
def test_a_corrupt_advice_file_warns_and_gives_none(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "advice.json"
    path.write_text(text)
    with capture_logs() as logs:
        assert load_advice("a:1", path) is None
    assert len(logs) == 1 and logs[0]["log_level"] == "warning"
    assert logs[0]["path"] == str(path) and problem in logs[0]["problem"]


def test_saving_over_a_corrupt_file_replaces_it(tmp_path: Path) -> None:
    path = tmp_path / "advice.json"
    path.write_bytes(b"\xff\xfe garbage")
    with capture_logs() as logs:
        save_advice(_advice(), path)
    assert [entry["log_level"] for entry in logs] == ["warning"]
    assert load_advice("syncer.example:7070", path) == _advice()


def test_advice_path_follows_the_environment(tmp_path: Path) -> None:
    explicit = tmp_path / "mine.json"
    assert advice_path({"DILOCOD_ADVICE": str(explicit), "XDG_CONFIG_HOME": "/x"}) == explicit
    xdg = tmp_path / "xdg"
    assert advice_path({"XDG_CONFIG_HOME": str(xdg)}) == xdg / "dilocod" / "link-advice.json"
    home = Path.home() / ".config" / "dilocod" / "link-advice.json"
    assert advice_path({}) == home
    assert advice_path({"XDG_CONFIG_HOME": "relative/dir"}) == home  # the XDG rule: ignored


# ------------------------------------------------------------------- the learner's codec decision


def _period(codec: str, gbps: float, seconds: float = 1.0) -> PushPeriod:
    return PushPeriod(codec, round(gbps * 1e9 / 8 * seconds), seconds)


def test_the_tuner_chooses_once_it_knows_the_link_and_the_data() -> None:
    tuner = CodecTuner(threads=2)
    assert tuner.push_done(_period("none", 2.0)) is None  # no figures yet
    choice = tuner.figures_measured(COMPRESSIBLE)
    assert choice is not None and choice.codec == "zstd" and tuner.codec == "zstd"
    assert choice.predicted_gbps == pytest.approx(3.0)
    assert "first choice" in choice.reason

    # The other order: the figures first, the link's rate with the first push.
    tuner = CodecTuner(threads=2)
    assert tuner.figures_measured(INCOMPRESSIBLE) is None
    choice = tuner.push_done(_period("none", 2.0))
    assert choice is not None and choice.codec == "none"


def test_the_tuner_keeps_a_compressor_that_delivers() -> None:
    tuner = CodecTuner(threads=2)
    tuner.push_done(_period("none", 2.0))
    tuner.figures_measured(COMPRESSIBLE)
    for _ in range(10):  # the link carries 1.5x the raw data, as predicted
        assert tuner.push_done(_period("zstd", 2.9)) is None
    assert tuner.codec == "zstd"
    assert tuner.link_gbps() == pytest.approx(2.9 / 1.5)


def test_a_compressor_bound_by_the_cpu_is_dropped() -> None:
    tuner = CodecTuner(threads=2)
    tuner.push_done(_period("none", 4.0))
    fast_on_paper = [NONE, CodecFigure("zstd", 1.5, 5.0, 20.0)]  # predicts min(6, 10, 40) = 6
    assert tuner.figures_measured(fast_on_paper).codec == "zstd"  # type: ignore[union-attr]
    choices = [tuner.push_done(_period("zstd", 3.0)) for _ in range(3)]  # but it achieves 3
    assert choices[:2] == [None, None]  # not judged on fewer than min_pushes periods
    assert choices[2] is not None and choices[2].codec == "none"
    assert "zstd achieved 3.00" in choices[2].reason
    for _ in range(5):  # ruled out while the link stays as it is
        assert tuner.push_done(_period("none", 4.0)) is None
    assert tuner.codec == "none"


def _run_link(
    tuner: CodecTuner, link_gbps: float, truth: list[CodecFigure], pushes: int
) -> list[CodecChoice]:
    """Push periods on a simulated link whose codecs behave as `truth` says; the choices made."""
    by_codec = {f.codec: f for f in truth}
    made = []
    for _ in range(pushes):
        codec = tuner.next_codec()
        achieved = predicted_gbps(by_codec[codec], link_gbps, tuner.threads)
        choice = tuner.push_done(_period(codec, achieved))
        if choice is not None:
            made.append(choice)
    return made


def test_the_tuner_chooses_again_when_the_link_rate_moves() -> None:
    tuner = CodecTuner(threads=2)
    assert _run_link(tuner, 40.0, COMPRESSIBLE, 1) == []
    assert tuner.figures_measured(COMPRESSIBLE).codec == "none"  # type: ignore[union-attr]
    made = _run_link(tuner, 2.0, COMPRESSIBLE, 20)  # the link slows to 2 Gbit/s
    assert made and "moved from" in made[0].reason
    assert tuner.codec == "zstd"  # settled: the best at 2 Gbit/s
    assert _run_link(tuner, 2.0, COMPRESSIBLE, 20) == []  # and stays
    made = _run_link(tuner, 40.0, COMPRESSIBLE, 20)  # back to 40: compression would hold it back
    assert made and tuner.codec == "none"
    assert _run_link(tuner, 40.0, COMPRESSIBLE, 20) == []


def test_a_cpu_bound_compressor_is_probed_and_dropped_without_flapping() -> None:
    on_paper = [NONE, CodecFigure("zstd", 1.5, 5.0, 20.0)]  # predicts 6 on a 4 Gbit/s link
    truth = [NONE, CodecFigure("zstd", 1.5, 1.5, 20.0)]  # the cores are busier: it reaches 3
    tuner = CodecTuner(threads=2)
    _run_link(tuner, 4.0, truth, 1)
    assert tuner.figures_measured(on_paper).codec == "zstd"  # type: ignore[union-attr]
    made = _run_link(tuner, 4.0, truth, 200)
    assert [c.codec for c in made] == ["none"]  # one correction, then quiet
    assert "zstd did worse than uncompressed" in made[0].reason
    assert tuner.codec == "none" and tuner.ruled_out == {"zstd"}


@pytest.mark.parametrize("seed", range(5))
def test_noisy_pushes_on_a_steady_link_change_the_codec_rarely(seed: int) -> None:
    rng = random.Random(seed)
    on_paper = [NONE, CodecFigure("zstd", 1.10, 5.0, 20.0)]  # 4.4 against 4.0: a near tie
    truth = {"none": NONE, "zstd": CodecFigure("zstd", 1.05, 5.0, 20.0)}
    tuner = CodecTuner(threads=2)
    tuner.push_done(_period("none", 4.0))
    tuner.figures_measured(on_paper)
    changes = 0
    for _ in range(500):
        codec = tuner.next_codec()
        achieved = predicted_gbps(truth[codec], 4.0, 2) * rng.uniform(0.8, 1.2)  # +-20 % per push
        changes += tuner.push_done(_period(codec, achieved)) is not None
    assert changes <= 3


def test_a_compressor_is_probed_uncompressed_now_and_then() -> None:
    tuner = CodecTuner(threads=2, probe_every=4)
    tuner.push_done(_period("none", 2.0))
    tuner.figures_measured(COMPRESSIBLE)
    assert [tuner.next_codec() for _ in range(10)] == ["zstd"] * 4 + ["none"] + ["zstd"] * 4 + ["none"]
    # A probe that finds the link as planned changes nothing.
    assert tuner.push_done(_period("none", 2.0)) is None
    assert tuner.codec == "zstd"


def test_periods_of_another_codec_are_ignored() -> None:
    tuner = CodecTuner(threads=2)
    tuner.push_done(_period("none", 2.0))
    tuner.figures_measured(COMPRESSIBLE)
    assert tuner.codec == "zstd"
    assert tuner.push_done(_period("none", 0.1)) is None  # began before the switch
    assert tuner.ema_gbps is None


def test_the_push_meter_measures_busy_periods() -> None:
    meter = PushMeter()
    meter.started(0.0, "none")
    meter.started(0.5, "none")
    assert meter.finished(1.0, 100) is None  # one still in flight
    assert meter.finished(2.0, 300) == PushPeriod("none", 400, 2.0)
    meter.started(10.0, "none")
    meter.started(10.1, "zstd")  # a codec switch inside one period
    meter.finished(11.0, 10)
    assert meter.finished(12.0, 10) is None
    meter.started(20.0, "zstd")
    assert meter.finished(21.0, None) is None  # a failed push measures nothing
    meter.started(30.0, "zstd")
    assert meter.finished(31.0, 50) == PushPeriod("zstd", 50, 1.0)
    with pytest.raises(ValueError):
        meter.finished(32.0, 1)


def test_the_push_meter_drops_small_periods_and_the_ack_round_trip() -> None:
    meter = PushMeter(min_bytes=1000)
    meter.started(0.0, "none")
    assert meter.finished(1.0, 999) is None  # latency, not rate
    meter.started(2.0, "none")
    assert meter.finished(4.0, 1000, rtt_s=0.5) == PushPeriod("none", 1000, 1.5)
    meter.started(5.0, "none")
    assert meter.finished(6.0, 1000, rtt_s=3.0) == PushPeriod("none", 1000, 0.5)  # at most half


def test_spread_sample_takes_whole_chunks_across_the_data() -> None:
    data = bytes(range(10)) * 10  # ten chunks of 10 bytes, chunk i full of... its pattern
    chunks = [bytes([i]) * 10 for i in range(10)]
    data = b"".join(chunks)
    assert spread_sample(data, 10, 30) == chunks[0] + chunks[3] + chunks[6]
    assert spread_sample(data, 10, 1000) == data
    assert spread_sample(data[:15], 10, 5) == chunks[0]  # at least one chunk


# ------------------------------------------------------------------------------ measure_codecs


def _bf16_like(count: int, seed: int = 0) -> bytes:
    """Outer-gradient-like bf16: the top two bytes of small normal float32 values."""
    rng = random.Random(seed)
    floats = array.array("f", (rng.gauss(0.0, 1e-3) for _ in range(count))).tobytes()
    out = bytearray(count * 2)
    out[0::2] = floats[2::4]
    out[1::2] = floats[3::4]
    return bytes(out)


def test_measure_codecs_on_real_bytes() -> None:
    random_figures = {f.codec: f for f in measure_codecs(os.urandom(2 * MiB), min_seconds=0.0)}
    assert set(random_figures) == {"none", "lz4", "zstd"}
    assert random_figures["none"] == NONE
    for name in ("lz4", "zstd"):
        figure = random_figures[name]
        assert figure.ratio == pytest.approx(1.0, abs=0.01)
        assert 0 < figure.compress_gbps < INF and 0 < figure.decompress_gbps < INF

    bf16 = {f.codec: f for f in measure_codecs(_bf16_like(MiB), shuffle_item_size=2, min_seconds=0.0)}
    assert bf16["zstd"].ratio > 1.2  # the exponent bytes cluster: about 1.5x at the entropy bound
    assert bf16["lz4"].ratio > 1.0
    assert 0 < bf16["zstd"].compress_gbps < INF


def test_measure_codecs_refuses_an_empty_sample() -> None:
    with pytest.raises(ValueError, match="empty"):
        measure_codecs(b"", codecs=("zstd",))
