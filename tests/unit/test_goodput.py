"""The goodput simulation (devkit/goodput.py): its command line (bench/goodput.py), trends, and
agreement with its closed forms. Short horizons and few seeds keep the file fast; tolerances are a
few standard errors of the seeds' mean plus the closed forms' own approximation where they have one.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from devkit import goodput

BENCH = Path(__file__).resolve().parents[2] / "bench"

DAY_S = goodput.SECONDS_PER_DAY
P = goodput.Params()


def _means(chips: int, p: goodput.Params, *, seeds: int, days: float) -> dict:
    return goodput.headline(goodput.run_fleet(chips, p, seeds=seeds, days=days))


def test_json_cli_shape_and_ranges() -> None:
    cmd = [sys.executable, str(BENCH / "goodput.py"), "--chips", "1200000", "--json"]
    out = subprocess.run([*cmd, "--seeds", "2", "--days", "3"], capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    doc = json.loads(lines[0])
    assert set(doc) == {"dp", "elastic_dp", "decoupled"}
    assert set(doc["decoupled"]) == {"2", "4", "8", "16"}
    values = [doc["dp"], doc["elastic_dp"], *doc["decoupled"].values()]
    assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in values)
    # The ordering the paper reports at this scale.
    assert doc["dp"] < doc["elastic_dp"] < doc["decoupled"]["8"]


def test_help_names_the_key_parameters() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "goodput.py"), "--help"], capture_output=True, text=True, check=True
    )
    for flag in (
        "--chips",
        "--json",
        "--seeds",
        "--days",
        "--restart-s",
        "--ckpt-interval-s",
        "--reconfig-s",
    ):
        assert flag in out.stdout


def test_more_chips_lower_dp_goodput() -> None:
    dp = [_means(c, P, seeds=2, days=3)["dp"] for c in goodput.CHIP_COUNTS]
    assert all(a > b for a, b in itertools.pairwise(dp)), dp
    elastic = [_means(c, P, seeds=2, days=3)["elastic_dp"] for c in goodput.CHIP_COUNTS]
    assert all(a > b for a, b in itertools.pairwise(elastic)), elastic


@pytest.mark.parametrize("chips", [1_200_000, 2_400_000])
def test_more_islands_higher_decoupled_goodput_at_scale(chips: int) -> None:
    dec = _means(chips, P, seeds=2, days=3)["decoupled"]
    ms = sorted(dec, key=int)
    assert all(dec[a] < dec[b] for a, b in itertools.pairwise(ms)), dec


def test_no_failures_gives_full_goodput() -> None:
    p = replace(P, mtbi_chip_s=math.inf)
    fleet = goodput.run_fleet(1_200_000, p, seeds=1, days=1)
    for scheme in fleet["schemes"].values():
        assert scheme["goodput"]["mean"] == 1.0
        assert scheme["uptime"]["mean"] == 1.0
        assert scheme["interruptions_per_seed"] == [0]
    cf = fleet["closed_form"]
    assert cf["dp"] == cf["elastic_dp"] == 1.0
    assert all(v == 1.0 for v in cf["decoupled"].values())


def test_interruptions_follow_the_fleet_rate() -> None:
    chips, days = 600_000, 5
    expected = P.interruptions_per_s(chips) * days * DAY_S
    n = goodput.simulate_dp(chips, P, days * DAY_S, random.Random(1)).interruptions
    assert abs(n - expected) < 5 * math.sqrt(expected)


@pytest.mark.parametrize(
    "chips, p",
    [
        (600_000, P),
        (150_000, P),
        # Few large groups: the capacity elastic data-parallel misses while groups are out, and
        # repaired groups hit again before they rejoin, matter here.
        (150_000, replace(P, dp_group_chips=4096)),
        (150_000, replace(P, dp_group_chips=4096, group_repair_s=3600.0)),
        (1_200_000, replace(P, ckpt_interval_s=30.0, sync_every_steps=96)),
    ],
)
def test_closed_form_agrees_with_simulation(chips: int, p: goodput.Params) -> None:
    seeds = 5
    fleet = goodput.run_fleet(chips, p, seeds=seeds, days=20)
    cf = fleet["closed_form"]
    expect = {"dp": cf["dp"], "elastic_dp": cf["elastic_dp"]}
    expect.update({f"decoupled_{m}": v for m, v in cf["decoupled"].items()})
    for name, want in expect.items():
        g = fleet["schemes"][name]["goodput"]
        # A standard error from 5 seeds can itself come out small by chance: a floor of 0.004.
        noise = 4 * g["std"] / math.sqrt(seeds) + 0.004
        slack = 0.006 if name == "elastic_dp" else 0.0  # elastic's closed form is first order
        assert abs(g["mean"] - want) <= noise + slack, (name, g["mean"], want)
    for m, want in cf["decoupled_uptime"].items():
        got = fleet["schemes"][f"decoupled_{m}"]["uptime"]["mean"]
        assert abs(got - want) <= 0.005, (m, got, want)


def test_quorum_halts_the_run_below_k() -> None:
    # With K = M every island must be live; uptime is then P(all up), and no work counts otherwise.
    p = replace(P, quorum_k=4)
    chips, seeds = 1_200_000, 3
    runs = [goodput.simulate_decoupled(chips, 4, p, 5 * DAY_S, random.Random(s)) for s in range(seeds)]
    uptime = statistics.fmean(r.uptime for r in runs)
    want = goodput.closed_form(chips, p, (4,))["decoupled_uptime"]["4"]
    assert abs(uptime - want) < 0.02
    assert statistics.fmean(r.goodput for r in runs) <= uptime
    k1 = goodput.simulate_decoupled(chips, 4, P, 5 * DAY_S, random.Random(0))
    assert k1.uptime > uptime


def test_lost_unpushed_progress() -> None:
    window = P.sync_every_steps * P.step_s
    assert goodput.lost_unpushed_s(0.0, P) == 0.0
    assert goodput.lost_unpushed_s(window, P) == pytest.approx(window / 2)
    assert goodput.lost_unpushed_s(10 * window, P) == window / 2
    assert goodput.lost_unpushed_s(window / 2, P) == pytest.approx(window / 2 - window / 8)
    assert goodput.lost_unpushed_s(5.0, replace(P, sync_every_steps=0)) == 0.0
    # The closed-form expectation against a Monte Carlo mean over exponential run lengths.
    rate = 1 / 30.0
    rng = random.Random(3)
    mc = statistics.fmean(goodput.lost_unpushed_s(rng.expovariate(rate), P) for _ in range(200_000))
    assert goodput.expected_lost_unpushed_s(rate, P) == pytest.approx(mc, rel=0.01)


def test_dp_rolls_back_to_its_last_snapshot() -> None:
    # Snapshots every step lose almost nothing; a long interval loses about half of it per failure.
    chips = 600_000
    every_step = goodput.simulate_dp(chips, replace(P, ckpt_interval_s=1.0), 5 * DAY_S, random.Random(0))
    default = goodput.simulate_dp(chips, P, 5 * DAY_S, random.Random(0))
    assert every_step.uptime == default.uptime  # the same failures, the same recoveries
    assert every_step.goodput > default.goodput
    assert every_step.goodput == pytest.approx(every_step.uptime, abs=0.01)
