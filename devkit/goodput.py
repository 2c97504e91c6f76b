"""Goodput under chip failures: data-parallel, elastic data-parallel and Decoupled DiLoCo, simulated.

Goodput is the fraction of the chip-time (chips x wall time) that ends up as training progress. A
discrete-event simulation (a heap of failure, recovery and repair events over a horizon of --days,
for several seeds) runs three ways of training on the same fleet with the same failure rate:

- **dp**, data-parallel: one synchronous job on every chip. Any interruption stops every chip; the
  job recovers (DETECT_S + RESTART_S) and resumes from its last in-memory snapshot, so the progress
  since that snapshot (taken every CKPT_INTERVAL_S) is lost too.
- **elastic_dp**, elastic data-parallel: the data-parallel group (DP_GROUP_CHIPS) holding the
  interrupted host is dropped; all chips pause for DETECT_S + RECONFIG_S while the survivors
  rebuild their collectives, lose the step in flight, and go on at reduced size. The dropped group
  is repaired (GROUP_REPAIR_S: a hot spare swapped in and the group relaunched) and rejoins at the
  next reconfiguration, when it is copied the current weights.
- **decoupled**, Decoupled DiLoCo with M learners: the chips split evenly into M islands, each a
  synchronous job of its own. An interruption takes down only its island, which recovers
  (DETECT_S + RESTART_S), heals from the syncer (HEAL_S) and trains again; the local progress it had
  not yet pushed to the syncer is lost (on average half of the H steps between two syncs of a
  fragment). The others keep training. Goodput counts the useful work of live islands, and nothing
  while fewer than K (QUORUM_K) islands are live.

A recovering unit (the whole job, an island, a dropped group) is back a fixed time after its
*latest* interruption: an interruption during a recovery restarts it, because a synchronous job
can only start when every one of its hosts is up. A unit is therefore up exactly when no
interruption hit it in the last D seconds, which gives the closed forms below; the simulation does
not use them, the tests and the table compare against them.

Failures: every chip sees an interruption once per MTBI_CHIP_S on average (exponential). An
interruption takes a whole host (FAILURE_DOMAIN_CHIPS chips) at once, so a fleet of N chips sees
N / (FAILURE_DOMAIN_CHIPS x MTBI_CHIP_S) interruptions per second, each on a uniformly chosen host:
the superposition of one exponential clock per host, drawn as one stream. Only the products of
that rate with the time constants matter: doubling FAILURE_DOMAIN_CHIPS is the same as halving
every recovery time. Every parameter below says what it models and where its value comes from;
"assumption" means ours, not the paper's (docs/design.md §3.7 gives only the fleet sizes, the MTBI and
the published goodputs).

Closed forms (λ the interruption rate of the unit, D its recovery time):

    dp          = e^(-λD) · κ(λ, CKPT_INTERVAL_S),   κ(λ, c) = λc·e^(-λc) / (1 - e^(-λc))
                  (the expected progress kept at the last snapshot, per unit of run time)
    elastic_dp ≈ e^(-λD) · κ(λ, STEP_S) · (1 - f),  f = a / (1 + a),
                  a = ([GROUP_REPAIR_S > D] + λ·max(0, GROUP_REPAIR_S - D)) / groups
                  (the groups out while it runs: first order, see closed_form)
    decoupled   = e^(-λ_m·D_m) · (1 - λ_m·E[lost]),   λ_m = λ / M, D_m = DETECT_S + RESTART_S + HEAL_S
    uptime      = P(at least K of M islands up),    each up with probability e^(-λ_m·D_m)

The simulator and its closed forms; bench/goodput.py is its command line (``python bench/goodput.py
[--chips 1200000 --json] [--seeds 5] [--days 60] [--sensitivity] [--out FILE]``), and
tests/unit/test_goodput.py checks it against the closed forms. Pure Python (no numpy, no torch);
imports nothing from dilocod.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

SECONDS_PER_DAY = 86_400.0

# --- The fleet and its failures -------------------------------------------------------------------

# Mean time between interruptions seen by one chip: one year (docs/design.md §3.7, the paper's figure).
MTBI_CHIP_S = 365.0 * SECONDS_PER_DAY

# Chips taken down by one interruption: a host of 4 chips (assumption: a TPU host holds 4 chips, a
# GPU host 8). Interruptions are host events (reboot, NIC, power, a chip's fault resetting its
# host), and a chip's MTBI counts its host's events, so a host is interrupted once per MTBI_CHIP_S.
# The most influential parameter: it divides the fleet's interruption rate (see --sensitivity);
# with 1-chip interruptions, every recovery time below would have to be 4 x shorter for the same
# goodputs.
FAILURE_DOMAIN_CHIPS = 4

# Chips of one data-parallel group, the unit elastic data-parallel drops: one model replica's
# tensor/pipeline-parallel slice, 256 chips (assumption: a 16 x 16 slice). Matters only through
# the capacity missing while groups are out, which stays below 0.2 % here.
DP_GROUP_CHIPS = 256

# --- Training ------------------------------------------------------------------------------------

# Time of one training step: 1 s (docs/design.md §3.7 uses 1 s steps for its bandwidth figure).
STEP_S = 1.0

# H, steps between two syncs of the same fragment: 24 (docs/design.md §3.6 default). A restarted
# learner re-adopts every fragment from the syncer (docs/design.md §3.5), so for each fragment it loses
# the steps since it last adopted it: H/2 steps on average once it has run H steps.
SYNC_EVERY_STEPS = 24

# K, the minimum quorum: 1 (docs/design.md §3.6 default). Fewer than K live islands halt the run.
QUORUM_K = 1

# --- Recovery ------------------------------------------------------------------------------------

# Time from an interruption until the job notices it: 10 s (assumption: a collective timing out or
# a host health check, on the order of ten seconds).
DETECT_S = 10.0

# Time to bring a synchronous job (the whole data-parallel job, or one island) back once the
# interruption is known: a hot spare host swapped for the interrupted one, the job's processes
# relaunched on every host, the runtime and its collectives initialised, and (data-parallel) the
# state restored from in-memory snapshots held by peer hosts: 60 s. Assumption, and calibrated:
# docs/design.md gives no restart time; about a minute is the fast end of what hot spares and in-memory
# state allow, and it is the round value at which Decoupled DiLoCo M = 8 lands on the paper's 88 %
# (bench/RESULTS.md §6). Taken equal for 1.2M chips and for one island of 150k, which favours
# data-parallel.
RESTART_S = 60.0

# Data-parallel snapshots its state to host memory every 120 s of training (120 steps) without
# pausing (an asynchronous in-memory snapshot), and a restart rolls back to the last one.
# Assumption, and calibrated: with RESTART_S fixed, the round value at which data-parallel lands on
# the paper's 27 %. Already far more frequent than persistent checkpoints (usually tens of minutes
# apart); the sensitivity shows data-parallel with a snapshot every step (an upper bound).
CKPT_INTERVAL_S = 120.0

# Elastic data-parallel's pause after an interruption, beyond DETECT_S: the survivors abort the
# step in flight, agree on the new membership and rebuild their collectives over about 4,700
# groups: 45 s. Assumption, and calibrated: no relaunch and no state restore, so less than
# RESTART_S, but collective initialisation over 10^5 hosts is most of a restart; the round value
# at which elastic data-parallel lands on the paper's 58 %.
RECONFIG_S = 45.0

# Time a dropped data-parallel group is out before it can rejoin: its interrupted host swapped
# for a hot spare and the group relaunched, the same work as RESTART_S: 60 s (assumption). It
# then waits for the next reconfiguration (the next interruption's pause), so repaired groups never
# pause the others on their own.
GROUP_REPAIR_S = 60.0

# Time for a restarted learner to heal: download the global model from the syncer before it trains
# again: 32 s = 5e9 parameters x 4 bytes over 5 Gbps (docs/design.md §3.7: a model of about 5B
# parameters; §1: 2-5 Gbps links, the fast end).
HEAL_S = 5e9 * 4 * 8 / 5e9

# --- What the table covers -----------------------------------------------------------------------

CHIP_COUNTS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
LEARNER_COUNTS = (2, 4, 8, 16)
DEFAULT_SEEDS = 5
DEFAULT_DAYS = 60.0
DEFAULT_SENSITIVITY_DAYS = 20.0

# The published figures at 1.2M chips (docs/design.md §3.7).
PAPER_AT_1_2M = {"dp": 0.27, "elastic_dp": 0.58, "decoupled_8": 0.88}


@dataclass(frozen=True)
class Params:
    """Every knob of the model; the defaults are the module constants above."""

    mtbi_chip_s: float = MTBI_CHIP_S
    failure_domain_chips: int = FAILURE_DOMAIN_CHIPS
    dp_group_chips: int = DP_GROUP_CHIPS
    step_s: float = STEP_S
    sync_every_steps: int = SYNC_EVERY_STEPS
    quorum_k: int = QUORUM_K
    detect_s: float = DETECT_S
    restart_s: float = RESTART_S
    ckpt_interval_s: float = CKPT_INTERVAL_S
    reconfig_s: float = RECONFIG_S
    group_repair_s: float = GROUP_REPAIR_S
    heal_s: float = HEAL_S

    def interruptions_per_s(self, chips: int) -> float:
        """Interruptions per second over a fleet of `chips` (0 when the MTBI is infinite)."""
        if math.isinf(self.mtbi_chip_s):
            return 0.0
        return chips / (self.failure_domain_chips * self.mtbi_chip_s)

    @property
    def dp_recovery_s(self) -> float:
        return self.detect_s + self.restart_s

    @property
    def elastic_pause_s(self) -> float:
        return self.detect_s + self.reconfig_s

    @property
    def island_recovery_s(self) -> float:
        return self.detect_s + self.restart_s + self.heal_s


@dataclass(frozen=True)
class Outcome:
    """One simulated run: goodput and uptime are fractions of the horizon."""

    goodput: float
    uptime: float
    interruptions: int


_FAIL, _BACK, _REPAIRED = 0, 1, 2


def _next_failure(heap: list, rng: random.Random, rate: float, now: float, seq: int) -> None:
    if rate > 0.0:
        heapq.heappush(heap, (now + rng.expovariate(rate), seq, _FAIL, -1))


def simulate_dp(chips: int, p: Params, horizon_s: float, rng: random.Random) -> Outcome:
    """Data-parallel: every interruption stops the job, which rolls back to its last snapshot."""
    rate = p.interruptions_per_s(chips)
    recovery_s, ckpt_s = p.dp_recovery_s, p.ckpt_interval_s
    heap: list = []
    seq = 0
    _next_failure(heap, rng, rate, 0.0, seq)
    up, running_since, back_at = True, 0.0, -1.0
    useful_s = up_s = 0.0
    n = 0
    while heap:
        t, _, kind, _ = heapq.heappop(heap)
        if t >= horizon_s:
            break
        if kind == _FAIL:
            n += 1
            if up:
                run = t - running_since
                up_s += run
                useful_s += ckpt_s * math.floor(run / ckpt_s)  # progress since the snapshot is lost
                up = False
            back_at = t + recovery_s  # restarts a recovery already under way
            seq += 1
            heapq.heappush(heap, (back_at, seq, _BACK, -1))
            seq += 1
            _next_failure(heap, rng, rate, t, seq)
        elif t == back_at:  # a _BACK superseded by a later interruption is skipped
            up, running_since = True, t
    if up:
        up_s += horizon_s - running_since
        useful_s += horizon_s - running_since
    return Outcome(useful_s / horizon_s, up_s / horizon_s, n)


def simulate_elastic_dp(chips: int, p: Params, horizon_s: float, rng: random.Random) -> Outcome:
    """Elastic data-parallel: an interrupted group is dropped; everyone pauses to reconfigure."""
    rate = p.interruptions_per_s(chips)
    groups = max(1, chips // p.dp_group_chips)
    pause_s, step_s, repair_s = p.elastic_pause_s, p.step_s, p.group_repair_s
    heap: list = []
    seq = 0
    _next_failure(heap, rng, rate, 0.0, seq)
    live = groups
    repair_until: dict[int, float] = {}  # dropped groups under repair
    ready: set[int] = set()  # repaired groups waiting for the next reconfiguration
    running, running_since, resume_at = True, 0.0, -1.0
    useful_s = up_s = 0.0
    n = 0
    while heap:
        t, _, kind, g = heapq.heappop(heap)
        if t >= horizon_s:
            break
        if kind == _FAIL:
            n += 1
            g = rng.randrange(groups)
            if g in ready:  # repaired and waiting to rejoin: back to repair
                ready.discard(g)
            elif g not in repair_until:  # a live group: drop it and pause everyone
                if running:
                    run = t - running_since
                    up_s += run
                    useful_s += (run - math.fmod(run, step_s)) * live / groups  # the step in flight is lost
                    running = False
                live -= 1
                resume_at = t + pause_s
                seq += 1
                heapq.heappush(heap, (resume_at, seq, _BACK, -1))
            repair_until[g] = t + repair_s
            seq += 1
            heapq.heappush(heap, (t + repair_s, seq, _REPAIRED, g))
            seq += 1
            _next_failure(heap, rng, rate, t, seq)
        elif kind == _REPAIRED:
            if repair_until.get(g) == t:
                del repair_until[g]
                ready.add(g)
        elif t == resume_at:
            live += len(ready)  # repaired groups join at the reconfiguration
            ready.clear()
            running, running_since = True, t
    if running:
        up_s += horizon_s - running_since
        useful_s += (horizon_s - running_since) * live / groups
    return Outcome(useful_s / horizon_s, up_s / horizon_s, n)


def lost_unpushed_s(trained_s: float, p: Params) -> float:
    """Local progress a learner loses when it dies `trained_s` after healing (seconds of its work).

    With P = H fragments synced round robin, one per step, fragment p was last adopted a uniform
    0..H steps ago once the learner has run H steps (H/2 lost on average), and at heal before that.
    """
    window_s = p.sync_every_steps * p.step_s
    if window_s <= 0.0:
        return 0.0
    if trained_s >= window_s:
        return window_s / 2.0
    return trained_s - trained_s * trained_s / (2.0 * window_s)


def simulate_decoupled(chips: int, learners: int, p: Params, horizon_s: float, rng: random.Random) -> Outcome:
    """Decoupled DiLoCo: an interruption takes down its island only; the others keep training."""
    rate = p.interruptions_per_s(chips)
    recovery_s, k = p.island_recovery_s, p.quorum_k
    heap: list = []
    seq = 0
    _next_failure(heap, rng, rate, 0.0, seq)
    live = learners
    back_at: list[float | None] = [None] * learners  # None: training
    # `clock` is the time during which at least K islands were live (the run was not halted), so an
    # island's training time since its heal is clock - healed_at[i].
    clock, last_t = 0.0, 0.0
    healed_at = [0.0] * learners
    useful_s = 0.0  # island-seconds of kept progress
    n = 0
    while heap:
        t, _, kind, i = heapq.heappop(heap)
        if t >= horizon_s:
            break
        if kind == _FAIL:
            n += 1
            i = rng.randrange(learners)
            if live >= k:
                clock += t - last_t
            last_t = t
            if back_at[i] is None:
                trained = clock - healed_at[i]
                useful_s += trained - lost_unpushed_s(trained, p)
                live -= 1
            back_at[i] = t + recovery_s  # restarts a recovery already under way
            seq += 1
            heapq.heappush(heap, (t + recovery_s, seq, _BACK, i))
            seq += 1
            _next_failure(heap, rng, rate, t, seq)
        elif back_at[i] == t:
            if live >= k:
                clock += t - last_t
            last_t = t
            back_at[i] = None
            healed_at[i] = clock
            live += 1
    if live >= k:
        clock += horizon_s - last_t
    for i in range(learners):
        if back_at[i] is None:
            useful_s += clock - healed_at[i]
    return Outcome(useful_s / (learners * horizon_s), clock / horizon_s, n)


# --- Closed forms (the cross-check) --------------------------------------------------------------


def _kept_fraction(rate: float, interval_s: float) -> float:
    """κ: expected progress kept at the last snapshot (every interval_s) per unit of run time."""
    x = rate * interval_s
    if x < 1e-12:
        return 1.0
    return x * math.exp(-x) / -math.expm1(-x)


def expected_lost_unpushed_s(rate: float, p: Params) -> float:
    """E[lost_unpushed_s(X)] for a run length X ~ Exp(rate)."""
    w = p.sync_every_steps * p.step_s
    if w <= 0.0:
        return 0.0
    if rate <= 0.0:
        return w / 2.0
    a, tail = rate, math.exp(-rate * w)
    first = (1.0 - tail * (1.0 + a * w)) / a  # ∫_0^w t·a·e^(-at) dt
    second = (2.0 - tail * (a * a * w * w + 2.0 * a * w + 2.0)) / (a * a)  # ∫_0^w t²·a·e^(-at) dt
    return first - second / (2.0 * w) + (w / 2.0) * tail


def closed_form(chips: int, p: Params, learner_counts: Sequence[int] = LEARNER_COUNTS) -> dict[str, Any]:
    """Long-run expectations: exact for dp and decoupled (K = 1), first-order for elastic_dp."""
    rate = p.interruptions_per_s(chips)
    dp = math.exp(-rate * p.dp_recovery_s) * _kept_fraction(rate, p.ckpt_interval_s)
    groups = max(1, chips // p.dp_group_chips)
    pause = p.elastic_pause_s
    # While elastic data-parallel runs, the groups out are those interrupted less than a repair time
    # before the pause that preceded the run ended (they rejoin at the next one): the pause's last
    # interruption, D before its end, if the repair outlasts D, and about λ·(repair - D) more. An
    # interruption that hits a group already out drops nothing, hence a / (1 + a).
    a = ((p.group_repair_s > pause) + rate * max(0.0, p.group_repair_s - pause)) / groups
    out_fraction = a / (1.0 + a) if rate > 0 else 0.0
    elastic = math.exp(-rate * pause) * _kept_fraction(rate, p.step_s) * (1.0 - out_fraction)
    decoupled: dict[str, float] = {}
    uptime: dict[str, float] = {}
    for m in learner_counts:
        rate_m = rate / m
        up = math.exp(-rate_m * p.island_recovery_s)
        uptime[str(m)] = sum(
            math.comb(m, j) * up**j * (1.0 - up) ** (m - j) for j in range(p.quorum_k, m + 1)
        )
        decoupled[str(m)] = up * (1.0 - rate_m * expected_lost_unpushed_s(rate_m, p))
    return {
        "dp": dp,
        "elastic_dp": elastic,
        "decoupled": decoupled,
        "decoupled_uptime": uptime,
        "exact_decoupled": p.quorum_k == 1,
    }


# --- Running the table ---------------------------------------------------------------------------


def _rng(seed: int, chips: int, scheme: str) -> random.Random:
    # A string seed is hashed deterministically (sha512), so every scheme, fleet and seed has its
    # own reproducible stream.
    return random.Random(f"goodput/{seed}/{chips}/{scheme}")


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def run_fleet(
    chips: int,
    p: Params,
    *,
    seeds: int = DEFAULT_SEEDS,
    days: float = DEFAULT_DAYS,
    learner_counts: Sequence[int] = LEARNER_COUNTS,
) -> dict[str, Any]:
    """Every scheme at one fleet size over `seeds` seeds; means, spreads and the closed forms."""
    horizon_s = days * SECONDS_PER_DAY
    sims: dict[str, Callable[[int, random.Random], Outcome]] = {
        "dp": lambda c, r: simulate_dp(c, p, horizon_s, r),
        "elastic_dp": lambda c, r: simulate_elastic_dp(c, p, horizon_s, r),
    }
    for m in learner_counts:
        sims[f"decoupled_{m}"] = lambda c, r, m=m: simulate_decoupled(c, m, p, horizon_s, r)
    per_scheme: dict[str, dict[str, Any]] = {}
    for name, sim in sims.items():
        outcomes = [sim(chips, _rng(seed, chips, name)) for seed in range(seeds)]
        per_scheme[name] = {
            "goodput": _summary([o.goodput for o in outcomes]),
            "uptime": _summary([o.uptime for o in outcomes]),
            "goodput_per_seed": [o.goodput for o in outcomes],
            "interruptions_per_seed": [o.interruptions for o in outcomes],
        }
    return {
        "chips": chips,
        "interruptions_per_hour": p.interruptions_per_s(chips) * 3600.0,
        "schemes": per_scheme,
        "closed_form": closed_form(chips, p, learner_counts),
    }


def headline(fleet: dict[str, Any], learner_counts: Sequence[int] = LEARNER_COUNTS) -> dict[str, Any]:
    """The --json shape: mean goodputs as fractions."""
    s = fleet["schemes"]
    return {
        "dp": s["dp"]["goodput"]["mean"],
        "elastic_dp": s["elastic_dp"]["goodput"]["mean"],
        "decoupled": {str(m): s[f"decoupled_{m}"]["goodput"]["mean"] for m in learner_counts},
    }


# The sensitivity runs: (parameter, values). One parameter changes at a time, at one fleet size.
SENSITIVITY: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("failure_domain_chips", (1, 4, 8)),
    ("restart_s", (30.0, 60.0, 120.0)),
    ("ckpt_interval_s", (STEP_S, 30.0, 120.0, 600.0)),
    ("reconfig_s", (15.0, 45.0, 90.0)),
    ("heal_s", (0.0, HEAL_S, 80.0)),
    ("sync_every_steps", (0, 24, 96)),
)


def run_sensitivity(
    chips: int, base: Params, *, seeds: int, days: float, learner_counts: Sequence[int] = LEARNER_COUNTS
) -> list[dict[str, Any]]:
    rows = []
    kinds = {f.name: f.type for f in fields(Params)}
    for name, values in SENSITIVITY:
        for value in values:
            cast = int if kinds[name] in ("int", int) else float
            p = replace(base, **{name: cast(value)})
            fleet = run_fleet(chips, p, seeds=seeds, days=days, learner_counts=learner_counts)
            rows.append(
                {
                    "parameter": name,
                    "value": cast(value),
                    "is_default": cast(value) == getattr(base, name),
                    "goodput": headline(fleet, learner_counts),
                    "std": {k: v["goodput"]["std"] for k, v in fleet["schemes"].items()},
                }
            )
    return rows
