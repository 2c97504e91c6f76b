"""The bench's JSON shape check, its table, its rate parsing and the server's gloo request parsing:
pure functions, fixed inputs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from dilocod.linkbench import local
from dilocod.linkbench.client import RunPlan
from dilocod.linkbench.local import (
    LocalBenchError,
    choose_delay,
    emulator_rate,
    emulator_sides,
    parse_rate,
    parse_rtt,
    parse_sysctls,
    rate_gbps,
    run_args,
)
from dilocod.linkbench.report import format_table, link_name, schema_errors
from dilocod.linkbench.report import main as report_main
from dilocod.linkbench.serve import MAX_GLOO_BYTES, parse_gloo_request

GOOD = {
    "links": [
        {
            "rate": "2gbit",
            "target": "10.200.1.1:7070",
            "raw_gbps": 1.913,
            "gloo_gbps": 1.9,
            "rtt_ms": 0.05,
            "round_trip_ms": 2300.0,
            "size_bytes": 256 << 20,
            "data": "bf16",
            "runs": [
                {"codec": "none", "streams": 1, "gbps": 1.85, "ratio_to_raw": 0.97, "compression_ratio": 1.0},
                {
                    "codec": "auto",
                    "chosen": "zstd",
                    "streams": 4,
                    "gbps": 2.6,
                    "ratio_to_raw": 1.36,
                    "compression_ratio": 1.45,
                },
            ],
            "recommendation": {"streams": 4, "codec": "zstd", "chunk_bytes": 1 << 20, "why": "because"},
            "warnings": ["raise net.core.rmem_max"],
        }
    ]
}


def test_a_conforming_document_has_no_errors() -> None:
    assert schema_errors(GOOD) == []
    assert schema_errors(json.loads(json.dumps(GOOD))) == []


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (("raw_gbps",), "fast", "links[0].raw_gbps has type str"),
        (("gloo_gbps",), True, "links[0].gloo_gbps has type bool"),
        (("runs", 0, "streams"), 1.5, "links[0].runs[0].streams has type float"),
        (("recommendation", "codec"), None, "links[0].recommendation.codec has type NoneType"),
    ],
)
def test_a_wrong_type_is_named(path: tuple[object, ...], value: object, expected: str) -> None:
    document = copy.deepcopy(GOOD)
    target = document["links"][0]
    for key in path[:-1]:
        target = target[key]  # type: ignore[index]
    target[path[-1]] = value  # type: ignore[index]
    assert schema_errors(document) == [expected]


def test_missing_fields_are_named() -> None:
    document = copy.deepcopy(GOOD)
    del document["links"][0]["rtt_ms"]
    del document["links"][0]["runs"][1]["compression_ratio"]
    assert schema_errors(document) == [
        "links[0].rtt_ms is missing",
        "links[0].runs[1].compression_ratio is missing",
    ]
    assert schema_errors({"link": []}) == ['the document must be an object with a "links" list']


def test_gloo_may_be_unmeasured_and_the_table_says_so() -> None:
    document = copy.deepcopy(GOOD)
    document["links"][0]["gloo_gbps"] = None
    assert schema_errors(document) == []
    table = format_table(document)
    assert "gloo broadcast not measured" in table
    assert "auto:zstd" in table
    assert "recommendation: 4 streams, codec zstd, chunks of 1 MiB" in table
    assert "warning: raise net.core.rmem_max" in table


def test_rates() -> None:
    assert parse_rate("2gbit") == "2gbit"
    assert parse_rate(" 500Mbit ") == "500mbit"
    assert parse_rate("loopback") == "loopback"
    assert rate_gbps("2gbit") == 2.0
    assert rate_gbps("500mbit") == 0.5
    assert rate_gbps("loopback") is None
    with pytest.raises(ValueError, match="not a tc rate"):
        parse_rate("2 gigabit")


def test_the_child_run_gets_the_whole_plan() -> None:
    plan = RunPlan(size_bytes=1 << 24, streams=(1, 4), codecs=("none", "auto"), duration_s=3.0, vs_gloo=True)
    args = run_args(plan)
    assert args[args.index("--size") + 1] == str(1 << 24)
    assert args[args.index("--streams") + 1] == "1,4"
    assert args[args.index("--codec") + 1] == "none,auto"
    assert args[args.index("--vs") + 1] == "gloo"
    assert args[args.index("--assumed-rtt") + 1] == "50.0ms"


def test_a_gloo_request_is_checked_before_anything_starts() -> None:
    ok = json.dumps({"master": "10.0.0.2:4000", "size": 1 << 20, "repeats": 3}).encode()
    assert parse_gloo_request(ok) == ("10.0.0.2:4000", 1 << 20, 3)
    bad = [
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (json.dumps({"master": "nowhere", "size": 8, "repeats": 1}).encode(), "master must be HOST:PORT"),
        (json.dumps({"master": "h:1", "size": MAX_GLOO_BYTES + 1, "repeats": 1}).encode(), "size must be"),
        (json.dumps({"master": "h:1", "size": 8, "repeats": 0}).encode(), "repeats must be"),
    ]
    for body, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_gloo_request(body)


def test_replotting_checks_the_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"links": [{"rate": "2gbit"}]}))
    assert report_main([str(bad), str(tmp_path / "out.png")]) == 1
    assert "not a dilocod bench document: links[0].raw_gbps is missing" in capsys.readouterr().err
    assert not (tmp_path / "out.png").exists()
    assert report_main([str(bad)]) == 2


def test_round_trip_times() -> None:
    assert [parse_rtt(t) for t in ("30ms", " 100MS ", "0ms", "2.5ms")] == [30.0, 100.0, 0.0, 2.5]
    for bad in ("30", "0.1s", "-5ms", "ms"):
        with pytest.raises(ValueError, match="not a round-trip time"):
            parse_rtt(bad)


def test_the_emulators_sides_are_read_from_what_it_prints() -> None:
    printed = (
        "wanem up: rate 5g bit/s, rtt 100 ms, pid 12345, log run/wanem.log\n"
        "A: netns wanem-a dev wan0 addr 10.77.0.1 (fd77::1)\n"
        "B: netns wanem-b dev wan0 addr 10.77.0.2 (fd77::2)\n"
    )
    assert emulator_sides(printed) == {"A": ("wanem-a", "10.77.0.1"), "B": ("wanem-b", "10.77.0.2")}
    assert emulator_sides("wanem up: failed\n") == {}
    assert emulator_rate("5gbit") == "5g" and emulator_rate("500mbit") == "500m"


def test_no_delay_needs_no_emulator_and_a_missing_one_is_named_both_ways(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert choose_delay([0.0], None) == ""
    monkeypatch.setattr(local, "netem_available", lambda: False)
    monkeypatch.delenv(local.EMULATOR_ENV, raising=False)
    with pytest.raises(LocalBenchError, match=r"no netem .*--wan-emulator PATH or DILOCOD_WAN_EMULATOR"):
        choose_delay([0.0, 30.0], None)
    with pytest.raises(LocalBenchError, match="not an executable file"):
        choose_delay([30.0], str(tmp_path / "nowhere.sh"))
    script = tmp_path / "emulator.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setenv(local.EMULATOR_ENV, str(script))
    assert choose_delay([100.0], None) == str(script)
    monkeypatch.setattr(local, "netem_available", lambda: True)
    assert choose_delay([100.0], str(script)) == "netem"


def test_the_table_names_the_added_round_trip() -> None:
    document = copy.deepcopy(GOOD)
    document["links"][0].update({"emulated_rtt_ms": 100.0, "delay_by": "/opt/wanem.sh"})
    assert schema_errors(document) == []
    assert "link 2gbit + 100 ms RTT (emulator)" in format_table(document)


def test_a_sysctl_file_is_read_as_systemd_reads_it() -> None:
    text = "# comment\n; also\n\nnet.ipv4.tcp_rmem = 4096  131072 134217728\n-net.core.default_qdisc=fq\n"
    assert parse_sysctls(text) == [
        ("net.ipv4.tcp_rmem", "4096 131072 134217728"),
        ("net.core.default_qdisc", "fq"),
    ]
    with pytest.raises(ValueError, match=r"line 2: 'net\.ipv4\.tcp_rmem' is not"):
        parse_sysctls("# ok\nnet.ipv4.tcp_rmem\n")
    with pytest.raises(ValueError, match="line 1"):
        parse_sysctls("net.ipv4.tcp_rmem =\n")


def test_the_repositorys_sysctl_file_parses() -> None:
    from pathlib import Path

    keys = dict(
        parse_sysctls((Path(__file__).parents[2] / "systemd/sysctl.d/60-dilocod-wan.conf").read_text())
    )
    assert keys["net.ipv4.tcp_rmem"].split()[2] == keys["net.ipv4.tcp_wmem"].split()[2] == "134217728"


def test_a_link_is_named_with_its_round_trip_and_sysctls() -> None:
    link = {"rate": "5gbit", "emulated_rtt_ms": 100.0, "delay_by": "/x/wanem.sh"}
    assert link_name(link) == "5gbit + 100 ms RTT (emulator)"
    link["sysctls"] = {"file": "60-dilocod-wan.conf", "applied": {}, "not_in_namespace": []}
    assert link_name(link) == "5gbit + 100 ms RTT (emulator) with 60-dilocod-wan.conf"
    assert (
        link_name({"rate": "2gbit", "emulated_rtt_ms": 30.0, "delay_by": "netem"})
        == "2gbit + 30 ms RTT (netem)"
    )
    lossy = {
        "rate": "5gbit",
        "emulated_rtt_ms": 100.0,
        "delay_by": "netem",
        "loss_pct": 0.1,
        "congestion": "cubic",
    }
    assert link_name(lossy) == "5gbit + 100 ms RTT (netem), 0.1 % loss, cubic"
