"""The learner's training loop (dilocod.learner.runtime.TrainingLoop) with a real tiny torch model,
its AdamW and a real Bridge, all in this process. The test plays the network: it posts plans,
merged fragments, requests and fatals on the bridge and drains what the loop sends back. Expected
parameters are computed here from the equations of docs/design.md §3.3, and fragment bytes are packed
here from the wire manifest (not with the loop's own layout code). Waiting is on observed thread
states with deadlines, never on a timer."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
import torch
from torch import Tensor, nn

from devkit.device_standins import StandInStreams, recording_pins
from dilocod.contract import StepResult, Trainer
from dilocod.learner.bridge import Adopt, Bridge, LostPush
from dilocod.learner.device import Copier, DeviceCopier, DeviceCopy
from dilocod.learner.link import compute_push
from dilocod.learner.runtime import LearnerStopped, RuntimeConfig, TrainingLoop
from dilocod.learner.state import STATE_FILE, LocalStateError
from dilocod.model.compare import PlanMismatch
from dilocod.model.entry import EntryError, StepFailed
from dilocod.model.params import model_entries
from dilocod.wire.codecs import checksum
from dilocod.wire.manifest import ModelEntry, TensorEntry, pack_manifest, piece_rows
from dilocod.wire.messages import FragmentRequest, Plan

ENTRY = "tests_rig:make_trainer"
INCARNATION = "inc-1"
DEADLINE_S = 10.0
CPU = torch.device("cpu")
#: The device paths a test runs on: the CPU's, and the GPU's with CPU stand-ins of its streams
#: (devkit/device_standins.py): the same parameters, bit for bit.
PATHS = pytest.mark.parametrize("path", ["host", "staged"])
#: With the anchors on the device too (--anchors device: δ computed there, no host anchor).
ALL_PATHS = pytest.mark.parametrize("path", ["host", "staged", "device-anchors"])


def copier_of(path: str) -> Copier | None:
    return None if path == "host" else DeviceCopier(CPU, StandInStreams(), recording_pins()[0])


def anchors_of(path: str) -> str:
    return "device" if path == "device-anchors" else "host"


# ---------------------------------------------------------------------------- the user's side


def make_model(seed: int) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


class Job:
    """A user's training: a tiny regression with AdamW, a data cursor, and a record of the
    parameters each step started from."""

    def __init__(self, seed: int = 0) -> None:
        self.model = make_model(seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        data = torch.Generator().manual_seed(123)
        self.x = torch.randn(16, 4, generator=data)
        self.y = torch.randn(16, 2, generator=data)
        self.cursor = 0
        self.seen: list[dict[str, Tensor]] = []  # parameters at the start of each step
        self.started_at: list[float] = []
        self.during_step: Callable[[int], None] | None = None
        self.result: Callable[[int], object] = lambda i: StepResult(tokens=10 + i, loss=0.5)

    def params(self) -> dict[str, Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def step(self, index: int) -> Any:
        self.started_at.append(time.monotonic())
        self.seen.append(self.params())
        rows = slice(4 * (self.cursor % 4), 4 * (self.cursor % 4) + 4)
        loss = nn.functional.mse_loss(self.model(self.x[rows]), self.y[rows])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.cursor += 1
        if self.during_step is not None:
            self.during_step(index)
        return self.result(index)

    def state_dict(self) -> Mapping[str, Any]:
        return {"cursor": self.cursor, "order": torch.arange(self.cursor)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cursor = int(state["cursor"])
        assert torch.equal(state["order"], torch.arange(self.cursor))

    def trainer(self) -> Trainer:
        return Trainer(self.model, self.optimizer, self.step, self.state_dict, self.load_state_dict)


# ---------------------------------------------------------------------------- the network's side


def pack(names: tuple[str, ...], values: Mapping[str, Tensor]) -> bytearray:
    """Fragment bytes as the syncer lays them out: float32 at the manifest's offsets."""
    manifest, raw = pack_manifest([(n, "float32", values[n].shape) for n in names])
    buffer = bytearray(raw)
    flat = torch.frombuffer(buffer, dtype=torch.float32)
    for entry in manifest:
        start = entry.offset // 4
        flat[start : start + values[entry.name].numel()] = values[entry.name].reshape(-1)
    return buffer


def unpack(names: tuple[str, ...], buffer: bytearray, shapes: Mapping[str, torch.Size]) -> dict[str, Tensor]:
    manifest, raw = pack_manifest([(n, "float32", shapes[n]) for n in names])
    assert len(buffer) == raw
    flat = torch.frombuffer(bytearray(buffer), dtype=torch.float32)
    return {e.name: flat[e.offset // 4 : e.offset // 4 + e.nbytes // 4].view(e.shape) for e in manifest}


@dataclass
class Rig:
    job: Job
    bridge: Bridge
    loop: TrainingLoop
    plan: Plan
    heal_buffers: dict[int, bytearray] = field(default_factory=dict)

    @property
    def fragments(self) -> tuple[tuple[str, ...], ...]:
        """The parameter names of each fragment (this rig's plan holds whole parameters)."""
        return tuple(tuple(name for name, _, _ in pieces) for pieces in self.plan.fragments)

    def manifest(self, fragment: int) -> tuple[TensorEntry, ...]:
        shapes = {n: p.shape for n, p in self.job.model.named_parameters()}
        return self.manifest_of(self.fragments[fragment], shapes)

    @staticmethod
    def manifest_of(names: tuple[str, ...], shapes: Mapping[str, torch.Size]) -> tuple[TensorEntry, ...]:
        return tuple(pack_manifest([(n, "float32", shapes[n]) for n in names])[0])

    def heal(self, versions: tuple[int, ...] = (3, 5), seed: int = 1) -> dict[str, Tensor]:
        """Post the plan and every fragment's global value as a heal; returns those values."""
        generator = torch.Generator().manual_seed(seed)
        values = {n: torch.randn(p.shape, generator=generator) for n, p in self.job.model.named_parameters()}
        self.bridge.post_plan(self.plan)
        for fragment, names in enumerate(self.fragments):
            buffer = pack(names, values)
            self.heal_buffers[fragment] = buffer
            self.bridge.post_update(Adopt(fragment, versions[fragment], buffer, True, INCARNATION))
        return values

    def update(self, fragment: int, version: int, values: Mapping[str, Tensor]) -> bytearray:
        buffer = pack(self.fragments[fragment], values)
        self.bridge.post_update(Adopt(fragment, version, buffer, False, INCARNATION))
        return buffer

    def of(self, fragment: int, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {n: values[n] for n in self.fragments[fragment]}


def rig(
    *,
    apply: str = "overwrite",
    mix_alpha: float = 0.5,
    overlap: int = 2,
    steps: int | None = None,
    state_dir: Path | None = None,
    join_timeout_s: float = DEADLINE_S,
    seed: int = 0,
    quorum: int = 1,
    path: str = "host",
    answer: str = "arrival",
) -> Rig:
    job = Job(seed)
    config = RuntimeConfig(
        entry=ENTRY,
        apply=apply,
        mix_alpha=mix_alpha,
        answer=answer,
        steps=steps,
        state_dir=state_dir,
        join_timeout_s=join_timeout_s,
        anchors=anchors_of(path),
    )
    bridge = Bridge()
    loop = TrainingLoop(config, job.trainer(), bridge, CPU, "m0", copier=copier_of(path))
    # Whole parameters, so that values here are keyed by name: the first parameter alone, then the
    # rest (row slices are the layout's business, tests/unit/test_learner_layout.py).
    entries = model_entries(job.model)
    whole = [(e.name, 0, piece_rows(e.shape)) for e in entries]
    plan = Plan(
        INCARNATION,
        entries,
        (tuple(whole[:1]), tuple(whole[1:])),
        (3, 5),
        sync_every=2,
        overlap=overlap,
        quorum=quorum,
    )
    return Rig(job, bridge, loop, plan)


def waiting_in(thread: threading.Thread, caller: Callable[..., Any]) -> bool:
    """Whether `thread` is blocked in Bridge.wait (inside threading.Condition.wait), called from
    `caller`. From then on, a post that takes the bridge's lock is bound to wake it."""
    frame = sys._current_frames().get(thread.ident or -1)
    chain = []
    while frame is not None:
        chain.append(frame.f_code)
        frame = frame.f_back
    wanted = [threading.Condition.wait.__code__, Bridge.wait.__code__, caller.__code__]
    return any(chain[i : i + 3] == wanted for i in range(len(chain)))


def until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def network_thread(work: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    failures: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=run, name="test-network", daemon=True)
    thread.start()
    return thread, failures


def assert_params(job: Job, want: Mapping[str, Tensor]) -> None:
    got = job.params()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


# ---------------------------------------------------------------------------- healing


@PATHS
def test_heal_adopts_every_fragment_bit_exactly_whatever_the_mode(path: str) -> None:
    r = rig(apply="mix", mix_alpha=0.5, overlap=1, path=path)
    assert len(r.fragments) == 2 and len(r.fragments[1]) > 1  # padding between tensors on the wire
    values = r.heal(versions=(3, 5))
    r.loop.boundary()
    # Mutation caught: `mode = self.config.apply` (a heal mixed instead of overwriting).
    assert_params(r.job, values)
    assert r.loop.versions == {0: 3, 1: 5}
    assert r.loop.anchors[0] is r.heal_buffers[0] and r.loop.anchors[1] is r.heal_buffers[1]
    assert [r.loop.counters(p) for p in (0, 1)] == [(0, 0), (0, 0)]
    assert r.loop.overlap == 1 and r.loop.incarnation == INCARNATION


def test_first_heal_is_awaited_before_the_first_step() -> None:
    r = rig(steps=1)
    main = threading.current_thread()
    healed: dict[str, dict[str, Tensor]] = {}

    def network() -> None:
        until(lambda: waiting_in(main, TrainingLoop._wait_for_first_heal), "the loop to wait for a heal")
        healed["values"] = r.heal()

    thread, failures = network_thread(network)
    r.loop.run(threading.Event())
    thread.join(DEADLINE_S)
    assert not failures, failures
    # Mutation caught: run() skipping _wait_for_first_heal (step 0 trains the unhealed init).
    for name, value in healed["values"].items():
        assert torch.equal(r.job.seen[0][name], value), name


def test_a_model_unlike_the_syncers_is_named() -> None:
    r = rig()
    entries = list(r.plan.model)
    first = entries[0]
    entries[0] = ModelEntry(first.name, first.dtype, (*first.shape[:-1], first.shape[-1] + 1))
    bad = Plan(INCARNATION, tuple(entries), r.plan.fragments, (0, 0), 2, 2, 1)
    r.bridge.post_plan(bad)
    with pytest.raises(PlanMismatch, match=repr(first.name)):
        r.loop.boundary()


# ---------------------------------------------------------------------------- snapshots and pushes


@PATHS
def test_request_snapshots_the_fragment_at_the_step_boundary(path: str) -> None:
    r = rig(path=path)
    values = r.heal(versions=(3, 5))
    r.loop.boundary()
    for _ in range(3):
        r.loop.boundary()
        r.loop.one_step()
    now = r.job.params()
    r.bridge.post_request(FragmentRequest(1, 7, 5))
    r.loop.boundary()
    snapshots, steps = r.bridge.drain()
    assert [(s.step, s.tokens) for s in steps] == [(1, 10), (2, 11), (3, 12)]
    assert len(snapshots) == 1
    snap = snapshots[0]
    names = r.fragments[1]
    assert (snap.fragment, snap.round, snap.base_version) == (1, 7, 5)
    # Mutation caught: c_steps/c_tokens not counted per step (0, 0) or counted from the start.
    assert (snap.c_steps, snap.c_tokens) == (3, 10 + 11 + 12)
    assert bytes(snap.theta) == bytes(pack(names, now))  # wire layout, padding zero, bit-exact
    assert snap.anchor is r.heal_buffers[1]
    # CPU: the copy is complete; staged, the network waits for the side stream's event.
    assert snap.ready is None if path == "host" else isinstance(snap.ready, DeviceCopy)
    assert r.loop.awaiting == {1}

    # The snapshot is a copy: later steps do not move it.
    r.loop.one_step()
    assert bytes(snap.theta) == bytes(pack(names, now))

    # The push the network computes from it: δ = anchor - θ, and a checksum per chunk.
    chunk_bytes = 64
    manifest, delta, checksums = compute_push(snap, r.manifest(1), chunk_bytes)
    assert manifest == r.manifest(1)  # fp32: the fragment's own layout
    want = pack(names, {n: values[n] - now[n] for n in names})
    assert bytes(delta) == bytes(want)
    assert any(want) and len(want) > 2 * chunk_bytes
    assert checksums == [checksum(bytes(want[i : i + chunk_bytes])) for i in range(0, len(want), chunk_bytes)]


def test_with_its_anchors_on_the_device_a_learner_pushes_the_same_delta_and_keeps_no_host_anchor() -> None:
    host, device = rig(), rig(path="device-anchors")
    copier = device.loop.copier
    assert isinstance(copier, DeviceCopier)
    for r in (host, device):
        r.heal(versions=(3, 5))
        r.loop.boundary()
        for _ in range(3):
            r.loop.one_step()
        r.bridge.post_request(FragmentRequest(1, 7, 5))
        r.loop.boundary()
    (want,), _ = host.bridge.drain()
    (got,), _ = device.bridge.drain()
    assert got.delta and len(got.anchor) == 0 and not want.delta
    push = [compute_push(s, host.manifest(1), 64) for s in (want, got)]
    assert bytes(push[0][1]) == bytes(push[1][1]) and push[0][2] == push[1][2]
    # The host keeps no anchor: the heal's buffers went back once their copies were done.
    assert device.loop.anchors == {} and sorted(device.loop.device_anchors) == [0, 1]
    # A merge replaces the device anchor: staged in the snapshot's slot, done with; the anchor it
    # replaces goes back for reuse.
    made = copier.slots.made
    assert made == 3 and copier.slots.free == 1
    new = {n: torch.randn(p.shape) for n, p in device.job.model.named_parameters()}
    device.update(1, 6, new)
    device.loop.boundary()
    assert bytes(device.loop.device_anchors[1].numpy()) == bytes(pack(device.fragments[1], new))
    assert copier.slots.made == made and copier.slots.free == 1
    assert device.loop._digest(1) == f"{checksum(pack(device.fragments[1], new)):016x}"


def test_an_update_still_on_its_way_to_the_device_is_applied_a_boundary_later_and_never_waited_for() -> None:
    """Decoupled, a merge is copied to the device from the boundary that takes it, and applied at
    the first boundary where that copy has landed: the training stream never waits for PCIe. A
    heal does not wait for a later boundary: the stream waits for it on the device."""
    r = rig(path="staged")
    copier = r.loop.copier
    assert isinstance(copier, DeviceCopier) and isinstance(copier.streams, StandInStreams)
    streams = copier.streams
    streams.hold = True
    values = r.heal(versions=(3, 5))
    r.loop.boundary()
    assert_params(r.job, values)
    assert r.loop.versions == {0: 3, 1: 5}
    assert len(streams.main_waited) == 2  # the heal: applied at once, the stream waiting on the device
    streams.complete_all()
    r.loop.one_step()
    before = r.job.params()
    waited = len(streams.main_waited)
    new = {n: torch.randn(p.shape) for n, p in r.job.model.named_parameters()}
    r.update(0, 4, new)
    r.loop.boundary()  # taken, its copy started, not landed: not applied yet
    assert r.loop.versions[0] == 3 and 0 in r.loop.held
    assert_params(r.job, before)
    r.loop.one_step()
    trained = r.job.params()
    streams.complete_all()
    r.loop.boundary()  # landed: applied, and the stream had nothing to wait for
    assert r.loop.versions[0] == 4 and 0 not in r.loop.held
    assert_params(r.job, r.of(0, new))
    assert_params(r.job, r.of(1, trained))
    assert all(event.completed for event in streams.main_waited[waited:])
    # The last boundary, before the final save, applies what is still on its way.
    r.update(1, 6, new)
    r.loop.boundary(last=True)
    assert r.loop.versions[1] == 6 and not r.loop.held


def test_counters_restart_at_the_send_and_at_an_overwrite_per_fragment() -> None:
    r = rig()
    r.heal(versions=(3, 5))
    r.loop.boundary()
    for _ in range(2):
        r.loop.one_step()  # tokens 10, 11
    merged = r.update(1, 6, {n: torch.full(p.shape, 0.25) for n, p in r.job.model.named_parameters()})
    r.loop.boundary()
    # The overwrite dropped fragment 1's local progress: its counters start again with it.
    assert [r.loop.counters(p) for p in (0, 1)] == [(2, 10 + 11), (0, 0)] and r.loop.versions[1] == 6
    for _ in range(3):
        r.loop.one_step()  # tokens 12, 13, 14
    r.bridge.post_request(FragmentRequest(0, 8, 3))
    r.bridge.post_request(FragmentRequest(1, 9, 6))
    r.loop.boundary()
    snapshots, _ = r.bridge.drain()
    got = {s.fragment: (s.base_version, s.c_steps, s.c_tokens) for s in snapshots}
    assert got == {0: (3, 5, 10 + 11 + 12 + 13 + 14), 1: (6, 3, 12 + 13 + 14)}
    assert snapshots[1].anchor is merged and snapshots[0].anchor is r.heal_buffers[0]
    # And at the send: the next push of fragment 0 counts only the steps after this one.
    assert [r.loop.counters(p) for p in (0, 1)] == [(0, 0), (0, 0)]
    r.loop.one_step()  # tokens 15
    r.bridge.post_request(FragmentRequest(0, 10, 3))
    r.loop.boundary()
    (snap,), _ = r.bridge.drain()
    assert (snap.c_steps, snap.c_tokens) == (1, 15)


def test_a_lost_push_is_counted_again_in_the_fragments_next_push() -> None:
    """A push whose session ended under it (Bridge.post_lost): its steps are still in θ - anchor,
    so the counters go back to before it, and the push made when the syncer asks again (a
    rejoining learner is asked for the rounds still open) counts them."""
    r = rig()
    r.heal(versions=(3, 5))
    r.loop.boundary()
    for _ in range(3):
        r.loop.one_step()  # tokens 10, 11, 12
    r.bridge.post_request(FragmentRequest(0, 8, 3))
    r.loop.boundary()
    (first,), _ = r.bridge.drain()
    assert (first.c_steps, first.c_tokens) == (3, 10 + 11 + 12)
    for _ in range(2):
        r.loop.one_step()  # tokens 13, 14
    r.bridge.post_lost(LostPush(0, 8))
    r.bridge.post_request(FragmentRequest(0, 8, 3))  # asked again
    r.loop.boundary()
    (again,), _ = r.bridge.drain()
    # Mutation caught: a lost push changing nothing (the push would count 2 steps of 5).
    assert (again.round, again.c_steps, again.c_tokens) == (8, 5, 10 + 11 + 12 + 13 + 14)
    assert r.loop.progress.lost == 1 and r.loop.in_flight[0].round == 8


def test_a_lost_push_is_not_counted_again_once_its_fragment_moved_on() -> None:
    """Applied since (an overwrite restarts the counters), or pushed again since: the lost push's
    steps are no longer what the counters lack."""
    r = rig()
    r.heal(versions=(3, 5))
    r.loop.boundary()
    r.loop.one_step()  # tokens 10
    r.bridge.post_request(FragmentRequest(0, 8, 3))
    r.loop.boundary()
    r.bridge.drain()
    r.update(0, 4, {n: torch.full(p.shape, 0.25) for n, p in r.job.model.named_parameters()})
    r.loop.one_step()  # tokens 11
    r.loop.boundary()  # round 8 merged without the push; overwritten
    r.bridge.post_lost(LostPush(0, 8))  # the news of the lost push comes after
    r.loop.one_step()  # tokens 12
    r.bridge.post_request(FragmentRequest(0, 10, 4))
    r.loop.boundary()
    (snap,), _ = r.bridge.drain()
    assert (snap.c_steps, snap.c_tokens) == (1, 12) and r.loop.progress.lost == 0
    r.loop.one_step()  # tokens 13
    r.bridge.post_lost(LostPush(0, 8))  # an older round than the push in flight now (10)
    r.loop.boundary()
    assert r.loop.counters(0) == (1, 13) and r.loop.in_flight[0].round == 10


@pytest.mark.parametrize("apply", ["overwrite", "mix", "keep-local"])
def test_a_request_overtaken_by_its_fragments_update_is_answered_first(apply: str) -> None:
    """A request for the version held and the newer version of that fragment reach the same
    boundary (the round merged before the request arrived): the snapshot goes first and holds the
    steps since the held version; after the update it would hold none (a push of zero weight).
    A request for the new version, in the same inbox, is answered after the update."""
    r = rig(apply=apply)
    r.heal(versions=(3, 5))
    r.loop.boundary()
    for _ in range(3):
        r.loop.one_step()  # tokens 10, 11, 12
    before = r.job.params()
    merged = {n: torch.full(p.shape, 0.5) for n, p in r.job.model.named_parameters()}
    r.bridge.post_request(FragmentRequest(0, 7, 3))  # its round merged into version 4 meanwhile
    r.update(0, 4, merged)
    r.bridge.post_request(FragmentRequest(1, 8, 6))  # a round of fragment 1 at version 6 ...
    r.update(1, 6, merged)  # ... whose version comes with it
    r.loop.boundary()
    snapshots, _ = r.bridge.drain()
    got = {s.fragment: (s.base_version, s.c_steps, s.c_tokens) for s in snapshots}
    # Fragment 1's request is answered after its update: an overwrite (keep-local with nothing
    # sent is one) dropped its 3 steps, leaving nothing to push; mix keeps them, and so does its push.
    if apply == "mix":
        # Mix keeps the steps through the apply: applies come first, and the push follows.
        assert got == {0: (4, 3, 10 + 11 + 12), 1: (6, 3, 10 + 11 + 12)}
    else:
        assert got == {0: (3, 3, 10 + 11 + 12), 1: (6, 0, 0)}
        (first,) = [s for s in snapshots if s.fragment == 0]
        assert bytes(first.theta) == bytes(pack(r.fragments[0], before))
    assert r.loop.versions == {0: 4, 1: 6}
    if apply == "overwrite":
        assert_params(r.job, r.of(0, merged))


def test_request_before_healing_is_not_answered() -> None:
    r = rig()
    r.bridge.post_plan(r.plan)
    r.bridge.post_request(FragmentRequest(0, 1, 0))
    r.loop.boundary()
    assert r.bridge.drain()[0] == [] and r.loop.awaiting == set()


# ---------------------------------------------------------------------------- apply modes


@PATHS
def test_overwrite_adopts_the_merged_fragment_and_leaves_the_others(path: str) -> None:
    r = rig(apply="overwrite", path=path)
    r.heal()
    r.loop.boundary()
    r.loop.one_step()
    r.loop.one_step()
    before = r.job.params()
    new = {n: torch.randn(p.shape) for n, p in r.job.model.named_parameters()}
    buffer = r.update(0, 4, new)
    r.loop.boundary()
    assert_params(r.job, r.of(0, new))
    assert_params(r.job, r.of(1, before))
    assert r.loop.anchors[0] is buffer and r.loop.versions == {0: 4, 1: 5}


@PATHS
def test_mix_blends_local_and_merged(path: str) -> None:
    alpha = 0.25
    r = rig(apply="mix", mix_alpha=alpha, path=path)
    r.heal()
    r.loop.boundary()
    r.loop.one_step()
    r.loop.one_step()
    local = r.job.params()
    new = {n: torch.randn(p.shape) for n, p in r.job.model.named_parameters()}
    r.update(1, 6, new)
    r.loop.boundary()
    got = r.job.params()
    for name in r.fragments[1]:
        want = alpha * local[name].double() + (1 - alpha) * new[name].double()
        # Mutation caught: alpha and 1 - alpha swapped (mix_alpha not passed, or inverted).
        torch.testing.assert_close(got[name].double(), want, rtol=1e-6, atol=1e-7)
        assert not torch.equal(got[name], new[name])
    assert_params(r.job, r.of(0, local))
    assert r.loop.anchors[1] is not None and r.loop.versions[1] == 6


@PATHS
def test_keep_local_keeps_the_steps_taken_while_the_fragment_was_away(path: str) -> None:
    r = rig(apply="keep-local", path=path)
    r.heal()
    r.loop.boundary()
    r.loop.one_step()
    r.bridge.post_request(FragmentRequest(0, 0, 3))  # round 0, due at step 1
    r.loop.boundary()
    sent = r.job.params()
    (snap,), _ = r.bridge.drain()
    assert bytes(snap.theta) == bytes(pack(r.fragments[0], sent))
    r.loop.one_step()
    r.loop.one_step()
    now = r.job.params()
    new = {n: torch.randn(p.shape) for n, p in r.job.model.named_parameters()}
    r.update(0, 4, new)
    r.loop.boundary()
    got = r.job.params()
    for name in r.fragments[0]:
        want = new[name] + (now[name] - sent[name])
        assert not torch.equal(now[name], sent[name])  # steps were taken in flight
        # Mutation caught: not recording θ_sent at the snapshot (falls back to overwrite).
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-6)
    assert r.loop.sent == {}
    assert r.loop.awaiting == set()


def test_keep_local_without_a_push_overwrites() -> None:
    r = rig(apply="keep-local")
    r.heal()
    r.loop.boundary()
    r.loop.one_step()
    new = {n: torch.randn(p.shape) for n, p in r.job.model.named_parameters()}
    r.update(1, 6, new)
    r.loop.boundary()
    assert_params(r.job, r.of(1, new))


# ---------------------------------------------------------------------------- stopping and user errors


def test_fatal_from_the_network_stops_at_the_next_boundary(tmp_path: Path) -> None:
    r = rig(steps=10, state_dir=tmp_path)
    r.heal()

    def during_step(index: int) -> None:
        if index == 2:
            r.bridge.post_fatal("the syncer's model is not ours")

    r.job.during_step = during_step
    with pytest.raises(LearnerStopped, match="the syncer's model is not ours"):
        r.loop.run(threading.Event())
    assert len(r.job.seen) == 3 and r.loop.step_index == 3
    assert (tmp_path / STATE_FILE).exists()  # saved on the way out


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        pytest.param({"tokens": 5}, "returned a dict", id="not-a-StepResult"),
        pytest.param(None, "returned a NoneType", id="none"),
        pytest.param(StepResult(tokens=-1), "tokens=-1", id="negative-tokens"),
        pytest.param(StepResult(tokens=2.5), "tokens=2.5", id="float-tokens"),  # type: ignore[arg-type]
        pytest.param(StepResult(tokens=3, loss="low"), "loss='low'", id="string-loss"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_step_result_names_the_entry_and_the_step(bad: object, match: str) -> None:
    r = rig(steps=5)
    r.heal()
    r.job.result = lambda i: bad if i == 2 else StepResult(tokens=10 + i, loss=0.1)
    # Mutation caught: one_step using the result unchecked (AttributeError or no error at all).
    with pytest.raises(EntryError, match=match) as caught:
        r.loop.run(threading.Event())
    assert "step(2)" in str(caught.value) and ENTRY in str(caught.value)
    assert r.loop.step_index == 2


# ---------------------------------------------------------------------------- lock-step (PLAN quorum 0)
# The rig's plan: P = 2, H = 2, so round r syncs fragment r mod 2 and is due at step r + 1.


class SyncerBridge(Bridge):
    """A Bridge whose wait() plays a lock-step syncer on the spot (the loop waits only when it
    needs the next round's request or the merge of what it pushed): it answers with that, and
    records at which step the loop waited and what it had sent."""

    def __init__(self) -> None:
        super().__init__()
        self.r: Rig | None = None
        self.merged: Mapping[str, Tensor] = {}
        self.next_round = 0
        self.versions: dict[int, int] = {}
        self.waits: list[tuple[int, str]] = []  # (steps taken, what was posted)
        self.pushes: list[Any] = []

    def wait(self, timeout_s: float) -> None:
        r = self.r
        assert r is not None
        snapshots, _ = self.drain()
        self.pushes.extend(snapshots)
        steps = len(r.job.seen)
        if snapshots:
            for snap in snapshots:
                self.versions[snap.fragment] += 1
                r.update(snap.fragment, self.versions[snap.fragment], r.of(snap.fragment, self.merged))
            self.waits.append((steps, "merge"))
        else:
            fragment = self.next_round % 2
            self.post_request(FragmentRequest(fragment, self.next_round, self.versions[fragment]))
            self.waits.append((steps, f"request {self.next_round}"))
            self.next_round += 1


def lockstep_run(overlap: int, steps: int) -> tuple[Rig, SyncerBridge]:
    r = rig(overlap=overlap, steps=steps, quorum=0)
    bridge = SyncerBridge()
    r.bridge = r.loop.bridge = bridge
    r.heal(versions=(3, 5))
    bridge.r, bridge.versions = r, dict(enumerate(r.plan.versions))
    bridge.merged = {n: torch.full(p.shape, 0.125) for n, p in r.job.model.named_parameters()}
    r.loop.run(threading.Event())
    return r, bridge


def test_lockstep_tau0_snapshots_at_the_due_step_and_waits_for_the_merge_before_the_next_step() -> None:
    r, syncer = lockstep_run(overlap=0, steps=3)
    # Round r is due at step r + 1: the loop waited there for its request, then for its merge,
    # before taking another step. Mutation caught: a step between the push and the merge (tau = 1).
    assert syncer.waits == [
        (1, "request 0"),
        (1, "merge"),
        (2, "request 1"),
        (2, "merge"),
        (3, "request 2"),
        (3, "merge"),
    ]
    assert [(p.fragment, p.round, p.step, p.c_steps) for p in syncer.pushes] == [
        (0, 0, 1, 1),
        (1, 1, 2, 2),
        (0, 2, 3, 2),
    ]
    # The step after each sync starts from the merged fragment.
    for name in r.fragments[0]:
        assert torch.equal(r.job.seen[1][name], syncer.merged[name]), name
    for name in r.fragments[1]:
        assert torch.equal(r.job.seen[2][name], syncer.merged[name]), name
    assert r.loop.lateness.late_snapshots == 0 and r.loop.lateness.late_applies == 0
    assert r.loop.in_flight == {}


def test_lockstep_tau2_applies_exactly_tau_steps_after_the_snapshot() -> None:
    r, syncer = lockstep_run(overlap=2, steps=4)
    # The merge of round 0 (pushed at step 1) came at once but is held to step 3.
    assert [(p.fragment, p.round, p.step) for p in syncer.pushes][:2] == [(0, 0, 1), (1, 1, 2)]
    merged0 = r.of(0, syncer.merged)
    for index, seen in enumerate(r.job.seen):  # seen[i]: the parameters step i + 1 started from
        applied = index >= 3  # applied at the boundary of step 3, before step 4
        for name in merged0:
            assert torch.equal(seen[name], merged0[name]) == applied, (index, name)
    assert r.loop.lateness.late_snapshots == 0 and r.loop.lateness.late_applies == 0


def test_a_merge_held_for_its_due_step_survives_a_new_session_of_the_same_incarnation() -> None:
    """Lock-step, tau = 2: the merge of round 0 (pushed at step 1) arrives and is held to step 3.
    The session is lost and joined again meanwhile, to the same syncer incarnation, whose JOIN
    said it holds that version: the held merge is applied at its due step, not dropped (the
    syncer will not send it again)."""
    r = rig(overlap=2, quorum=0, join_timeout_s=5.0)
    r.heal(versions=(3, 5))
    r.loop.boundary()
    r.loop.one_step()
    r.bridge.post_request(FragmentRequest(0, 0, 3))
    r.loop.boundary()  # step 1: round 0's push
    merged = {n: torch.full(p.shape, 0.25) for n, p in r.job.model.named_parameters()}
    r.update(0, 4, r.of(0, merged))
    r.loop.one_step()
    r.bridge.post_request(FragmentRequest(1, 1, 5))
    r.loop.boundary()  # step 2: round 1's push; round 0's merge is here, held to step 3
    assert r.loop.held[0].version == 4
    r.bridge.post_plan(dataclasses.replace(r.plan, versions=(4, 5), next_round=2))
    r.loop.one_step()
    r.bridge.post_request(FragmentRequest(0, 2, 4))
    r.loop.boundary()  # step 3: round 0's merge is due
    # Mutation caught: the plan letting go of every held update (the loop waits for the merge in
    # vain, gives up, and fragment 0 stays at version 3).
    assert r.loop.versions[0] == 4 and r.loop.given_up == set()
    for name, value in r.of(0, merged).items():
        assert torch.equal(dict(r.job.model.named_parameters())[name].detach(), value), name


def test_lockstep_gives_up_after_join_timeout() -> None:
    timeout_s = 0.3
    r = rig(overlap=0, steps=2, join_timeout_s=timeout_s, quorum=0)
    r.heal()
    r.bridge.post_request(FragmentRequest(0, 0, 3))
    started = time.monotonic()
    r.loop.run(threading.Event())  # no merge ever comes back, nor the next round's request
    assert len(r.job.seen) == 2
    waited = time.monotonic() - started
    assert r.loop.given_up == {0}
    # Two waits (round 0's merge at step 1, round 1's request at step 2), each bounded; the merge
    # given up is not waited for again.
    assert waited >= 2 * timeout_s
    # Mutation caught: waiting in whole seconds past the deadline (bridge.wait(1.0) unbounded).
    assert waited < 2 * timeout_s + 1.0


def test_decoupled_tau0_never_waits() -> None:
    r = rig(overlap=0, steps=3, join_timeout_s=DEADLINE_S, answer="due")
    # Held to its due step (2), so that its push carries steps and a merge is awaited.
    r.heal()
    r.bridge.post_request(FragmentRequest(1, 1, 5))
    started = time.monotonic()
    r.loop.run(threading.Event())  # the merge never comes back: training goes on regardless
    assert time.monotonic() - started < DEADLINE_S / 2
    assert len(r.job.seen) == 3 and r.loop.awaiting == {1}


def test_overlap_never_waits() -> None:
    r = rig(overlap=2, steps=3, join_timeout_s=DEADLINE_S, answer="due")
    # Held to its due step (2), so that its push carries steps and a merge is awaited.
    r.heal()
    r.bridge.post_request(FragmentRequest(1, 1, 5))
    started = time.monotonic()
    r.loop.run(threading.Event())  # the merge never comes back: training goes on regardless
    assert time.monotonic() - started < DEADLINE_S / 2
    assert len(r.job.seen) == 3 and r.loop.awaiting == {1}


@pytest.mark.parametrize(("answer", "snapshot_step"), [("due", 3), ("arrival", 1)])
def test_a_decoupled_request_is_answered_on_arrival_or_held_to_its_due_step(
    answer: str, snapshot_step: int
) -> None:
    """Round 1 is due at step 2; the loop has boundaries at steps 1 and 3 only. Held to its due
    step, the snapshot comes at 3, a step late; answered on arrival, at 1, not late."""
    r = rig(answer=answer)
    r.heal(versions=(3, 5))
    r.loop.boundary()
    r.bridge.post_request(FragmentRequest(1, 1, 5))
    snapshots = []
    for steps in (1, 2):
        for _ in range(steps):
            r.loop.one_step()
        r.loop.boundary()
        snapshots += r.bridge.drain()[0]
    assert [(snap.round, snap.step) for snap in snapshots] == [(1, snapshot_step)]
    assert list(r.loop.lateness.snapshots) == [max(0, snapshot_step - 2)]
    assert r.loop.lateness.summary()["late_snapshots"] == (snapshot_step > 2)


# ---------------------------------------------------------------------------- local state


def test_local_state_round_trips(tmp_path: Path) -> None:
    first = rig(steps=3, state_dir=tmp_path, seed=0)
    first.heal()
    first.loop.run(threading.Event())  # saves on the way out
    assert (tmp_path / STATE_FILE).exists()

    second = rig(state_dir=tmp_path, seed=7)
    assert not torch.equal(second.job.model[0].weight, first.job.model[0].weight)
    assert second.loop.restore()
    assert_params(second.job, first.job.params())
    assert second.loop.step_index == 3 and second.job.cursor == 3
    assert second.loop.incarnation == INCARNATION
    want, got = first.job.optimizer.state_dict(), second.job.optimizer.state_dict()
    assert want["param_groups"] == got["param_groups"]
    # Mutation caught: restore() skipping the optimizer (its state would be empty).
    assert want["state"].keys() == got["state"].keys() and want["state"]
    for key, state in want["state"].items():
        for name, value in state.items():
            assert torch.equal(got["state"][key][name], value), (key, name)
    # Both continue identically: same parameters, moments, step counts and data cursor.
    first.job.step(3)
    second.job.step(3)
    assert_params(second.job, first.job.params())


def test_no_state_dir_or_no_file_restores_nothing(tmp_path: Path) -> None:
    assert not rig().loop.restore()
    assert not rig(state_dir=tmp_path / "empty").loop.restore()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign"])
def test_a_corrupt_state_file_is_a_clear_error(tmp_path: Path, damage: str) -> None:
    path = tmp_path / STATE_FILE
    if damage == "garbage":
        path.write_bytes(b"not a torch file at all")
    else:
        saver = rig(state_dir=tmp_path)
        saver.loop.save()
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        else:
            torch.save({"model": {}}, path)
    with pytest.raises(LocalStateError) as caught:
        rig(state_dir=tmp_path).loop.restore()
    assert str(path) in str(caught.value)


# ---------------------------------------------------------------------------- what the user's code gives back


def _with_user_state(r: Rig, user: Callable[[], Mapping[str, Any]]) -> None:
    r.loop.trainer = dataclasses.replace(r.loop.trainer, state_dict=user)


def test_a_state_that_would_not_load_is_named_before_any_step(tmp_path: Path) -> None:
    r = rig(steps=3, state_dir=tmp_path)
    _with_user_state(r, lambda: {"cursor": 0, "rng": np.random.default_rng(0)})
    with pytest.raises(LocalStateError, match=r"Trainer.state_dict\(\)\['rng'\] is a numpy"):
        r.loop.check_state()
    assert r.job.seen == []  # the factory's initial state: no step needed to find it
    assert not (tmp_path / STATE_FILE).exists()
    # Without a state directory nothing is saved, so nothing needs to load.
    r = rig(steps=3)
    _with_user_state(r, lambda: {"rng": np.random.default_rng(0)})
    r.loop.check_state()


def test_a_state_that_turns_bad_is_refused_at_the_save_and_the_last_good_file_stays(tmp_path: Path) -> None:
    r = rig(steps=3, state_dir=tmp_path)
    r.heal()
    r.loop.save()
    _with_user_state(r, lambda: {"cursor": np.int64(r.job.cursor), "order": torch.arange(r.job.cursor)})
    with pytest.raises(LocalStateError, match=r"\['cursor'\] is a numpy.int64"):
        r.loop.run(threading.Event())
    assert r.loop.step_index == 3
    saved = torch.load(tmp_path / STATE_FILE, weights_only=True)
    assert saved["step"] == 0 and saved["user"]["cursor"] == 0  # still loadable, from before


def test_a_step_that_raises_carries_the_users_frames_only(tmp_path: Path) -> None:
    r = rig(steps=5, state_dir=tmp_path)
    r.heal()

    def during_step(index: int) -> None:
        if index == 2:
            raise ValueError("a bad batch")

    r.job.during_step = during_step
    with pytest.raises(StepFailed, match=r"step\(2\) raised ValueError: a bad batch") as caught:
        r.loop.run(threading.Event())
    assert ENTRY in str(caught.value) and "\n" not in str(caught.value)
    cause = caught.value.__cause__
    assert isinstance(cause, ValueError)
    frames = [frame.name for frame in traceback.extract_tb(cause.__traceback__)]
    # Mutation caught: the traceback starting at dilocod's one_step (and the step watch's wrapper).
    assert frames == ["step", "during_step"], frames
    assert (tmp_path / STATE_FILE).exists()  # saved on the way out, as after any stop


def test_a_failed_save_does_not_hide_the_steps_exception(tmp_path: Path) -> None:
    r = rig(steps=5, state_dir=tmp_path)
    r.heal()
    r.job.result = lambda i: 0.5 if i == 1 else StepResult(tokens=10, loss=0.1)
    _with_user_state(r, lambda: {"rng": np.random.default_rng(0)} if r.job.cursor > 1 else {})
    with structlog.testing.capture_logs() as logs, pytest.raises(EntryError, match="returned a float"):
        r.loop.run(threading.Event())
    (record,) = [r for r in logs if r["log_level"] == "error"]
    assert "local state not saved" in record["event"] and "['rng']" in record["error"]


# ---------------------------------------------------------------------------- counters = outer gradient

#: The constant step of ConstantJob: every parameter moves by -STEP_DELTA per step, exactly.
STEP_DELTA = 0.5
TOKENS_PER_STEP = 7


class ConstantJob:
    """A training whose every step moves every parameter by exactly -STEP_DELTA: an outer gradient
    then says how many steps it holds (δ / STEP_DELTA per value)."""

    def __init__(self) -> None:
        self.model = nn.Linear(3, 2)
        with torch.no_grad():
            for param in self.model.parameters():
                param.zero_()

    def step(self, index: int) -> StepResult:
        with torch.no_grad():
            for param in self.model.parameters():
                param.sub_(STEP_DELTA)
        return StepResult(tokens=TOKENS_PER_STEP, loss=0.0)

    def trainer(self) -> Trainer:
        return Trainer(self.model, None, self.step)


@ALL_PATHS
@pytest.mark.parametrize("apply", ["keep-local", "mix"])
def test_every_push_holds_exactly_the_steps_and_tokens_it_reports(apply: str, path: str) -> None:
    """The syncer here sends back what was pushed (Θ_new = θ_sent), late, sometimes at the very
    boundary of the fragment's next request: the case where main pushed 0 steps (weight 0) and
    the next keep-local apply dropped them. Every push must report the steps since the fragment's
    last push, hold exactly those (keep-local: δ = steps · STEP_DELTA; mix keeps alpha of those
    taken while the fragment was away), and none may report 0 steps."""
    alpha = 0.5
    job = ConstantJob()
    config = RuntimeConfig(entry=ENTRY, apply=apply, mix_alpha=alpha, anchors=anchors_of(path))
    bridge = Bridge()
    loop = TrainingLoop(config, job.trainer(), bridge, CPU, "m0", copier=copier_of(path))
    fragments = (("weight",), ("bias",))
    shapes = {n: p.shape for n, p in job.model.named_parameters()}
    pieces = tuple(tuple((n, 0, piece_rows(shapes[n])) for n in names) for names in fragments)
    plan = Plan(INCARNATION, model_entries(job.model), pieces, (0, 0), 2, 2, 1)
    bridge.post_plan(plan)
    zeros = {n: torch.zeros(s) for n, s in shapes.items()}
    #: What this syncer last sent of each fragment: the anchor of the learner's next push.
    anchors = {fragment: pack(names, zeros) for fragment, names in enumerate(fragments)}
    for fragment in (0, 1):
        bridge.post_update(Adopt(fragment, 0, bytearray(anchors[fragment]), True, INCARNATION))
    loop.boundary()
    versions = {0: 0, 1: 0}
    # (step, what happens at its boundary): r = request of fragment f; u = the merge of its last push.
    script = {
        1: ["r0"], 2: ["r1"], 3: ["u0", "r0"], 4: ["u1"], 5: ["r1"], 6: ["u0"], 7: ["r0", "u1", "r1"],
        9: ["u0"], 10: ["r0"], 11: ["r1", "u1"], 12: ["u0", "r0"],
    }  # fmt: skip
    pushed: dict[int, Any] = {}
    trained_since: dict[int, int] = {0: 0, 1: 0}
    in_flight: dict[int, int] = {}  # fragment -> steps taken since its push, while unapplied
    applied: dict[int, int] = {}  # fragment -> steps its merge was away, applied since its last push
    checked = 0
    round_index = 0
    for step in range(1, 13):
        loop.one_step()
        for fragment in (0, 1):
            trained_since[fragment] += 1
            if fragment in in_flight:
                in_flight[fragment] += 1
        for event in script.get(step, []):
            fragment = int(event[1])
            if event[0] == "u":
                snap, anchor = pushed[fragment]
                versions[fragment] += 1
                theta = bytearray(snap.theta)
                if snap.delta:  # the device computed δ: θ_sent = anchor - δ
                    flat = np.frombuffer(theta, dtype=np.float32)
                    np.subtract(np.frombuffer(anchor, dtype=np.float32), flat, out=flat)
                anchors[fragment] = theta
                bridge.post_update(Adopt(fragment, versions[fragment], bytearray(theta), False, INCARNATION))
                applied[fragment] = in_flight.pop(fragment)
            else:
                bridge.post_request(FragmentRequest(fragment, round_index, versions[fragment]))
                round_index += 1
        loop.boundary()
        for snap in bridge.drain()[0]:
            fragment = snap.fragment
            assert snap.c_steps > 0, "a push of no steps"
            assert (snap.c_steps, snap.c_tokens) == (
                trained_since[fragment],
                TOKENS_PER_STEP * trained_since[fragment],
            )
            _, delta, _ = compute_push(snap, Rig.manifest_of(fragments[fragment], shapes), 64)
            held = torch.frombuffer(bytearray(delta), dtype=torch.float32)[
                : shapes[fragments[fragment][0]].numel()
            ]
            if apply == "keep-local" or fragment not in applied:
                want = snap.c_steps * STEP_DELTA
            else:
                # mix: θ ← alpha·θ + (1 - alpha)·θ_sent keeps alpha of the steps taken in flight.
                away = applied.pop(fragment)
                want = (alpha * away + (snap.c_steps - away)) * STEP_DELTA
            torch.testing.assert_close(held, torch.full_like(held, want), rtol=0, atol=1e-6)
            pushed[fragment] = (snap, anchors[fragment])
            trained_since[fragment] = 0
            in_flight[fragment] = 0
            checked += 1
    assert checked == 9 and loop.progress.passes == 0
