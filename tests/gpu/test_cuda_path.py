"""The learner's CUDA path on a real GPU (dilocod.learner.device, docs/design.md §3.8): regions
page-locked and unlocked, snapshots and applies byte for byte against the CPU path, the training
stream never waiting for a side-stream copy, no buffer reused under a running copy in thread mode,
outer gradients computed on the device as on the host, device step times; then real daemons: a GPU
learner (host and device anchors, network process and thread) ends on the syncer's fragments, and
an island of 2 ranks on NCCL where 2 GPUs exist. Skipped where CUDA is not: the same bookkeeping is
tested on the CPU through stand-ins (tests/unit/test_learner_device.py)."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch

from devkit.daemons import run_island, start_learner, start_syncer, syncer_status
from devkit.device_standins import Mixed, layouts_of
from dilocod.learner.bridge import Bridge, Snapshot
from dilocod.learner.buffers import mapped_buffer
from dilocod.learner.delta import fragment_delta_
from dilocod.learner.device import CudaStreams, DeviceClock, DeviceCopier, HostCopier, HostPins
from dilocod.outer import apply_update_

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA on this host")

DEADLINE_S = 180.0
#: GPU cycles a side stream spins for (torch.cuda._sleep): about a second on current GPUs, far
#: longer than anything the training stream is asked to do meanwhile.
HOLD_CYCLES = 2_000_000_000


@pytest.fixture
def models() -> tuple[Mixed, Mixed]:
    """The same parameters (three dtypes, row slices: MBs of them) on the CPU and on the GPU."""
    cpu = Mixed(scale=100)
    return cpu, copy.deepcopy(cpu).cuda()


def hold_side(copier: DeviceCopier) -> None:
    """Keep the copier's side stream busy: what is queued on it after this waits."""
    assert isinstance(copier.streams, CudaStreams)
    with copier.streams.on_side():
        torch.cuda._sleep(HOLD_CYCLES)


def test_a_region_is_page_locked_once_and_unlocked_when_it_goes() -> None:
    pins = HostPins.for_cuda()
    buffer = mapped_buffer(1, 1 << 20)
    assert not torch.frombuffer(buffer, dtype=torch.uint8).is_pinned()
    pins.pin(buffer)
    pins.pin(buffer[4096:])
    assert pins.pinned == 1 and torch.frombuffer(buffer, dtype=torch.uint8).is_pinned()
    pins.unpin(buffer)
    assert not torch.frombuffer(buffer, dtype=torch.uint8).is_pinned()


@pytest.mark.parametrize("fragment", [0, 1])
def test_a_snapshot_holds_the_cpu_paths_bytes(models: tuple[Mixed, Mixed], fragment: int) -> None:
    cpu, gpu = models
    want, _ = HostCopier().copy_out(layouts_of(cpu)[fragment], bytearray)
    copier = DeviceCopier.for_cuda(torch.device("cuda"))
    got, ready = copier.copy_out(layouts_of(gpu)[fragment], lambda n: mapped_buffer(0, n))
    assert ready is not None
    ready.wait()
    assert bytes(got) == bytes(want)
    copier.close()


def test_the_training_stream_never_waits_for_a_snapshots_copy_to_the_host(
    models: tuple[Mixed, Mixed],
) -> None:
    _cpu, gpu = models
    copier = DeviceCopier.for_cuda(torch.device("cuda"))
    layout = layouts_of(gpu)[0]
    torch.cuda.synchronize()
    hold_side(copier)
    _buffer, ready = copier.copy_out(layout, lambda n: mapped_buffer(0, n))
    training = torch.cuda.Event()
    training.record()
    training.synchronize()  # the training stream's work, the staging copy included, is done
    assert ready is not None and not ready.done()  # while the copy to the host still waits
    ready.wait()
    copier.close()


def test_an_apply_is_the_updates_bytes_and_its_buffer_waits_for_the_copy(
    models: tuple[Mixed, Mixed],
) -> None:
    cpu, gpu = models
    cpu_layout, layout = layouts_of(cpu)[1], layouts_of(gpu)[1]
    update = mapped_buffer(0, layout.raw_bytes)
    generator = torch.Generator().manual_seed(3)
    for view in cpu_layout.views(update):
        view.copy_(torch.randn(view.shape, generator=generator))
    apply_update_(list(cpu_layout.params), cpu_layout.views(update), "overwrite")
    copier = DeviceCopier.for_cuda(torch.device("cuda"))
    torch.cuda.synchronize()
    hold_side(copier)
    upload = copier.prefetch(update)
    assert upload is not None and not upload.landed()  # queued: the host did not wait
    staged = copier.stage(layout, update, upload)
    apply_update_(list(layout.params), staged.views, "overwrite")
    copier.done(staged)
    released: list[bool] = []
    copier.let_go(update, lambda: released.append(True))
    copier.settle()
    assert released == []  # the copy still reads it
    torch.cuda.synchronize()
    copier.settle()
    assert released == [True]
    for got, want in zip(gpu.parameters(), cpu.parameters(), strict=True):
        assert torch.equal(got.cpu(), want)
    copier.close()


def test_a_snapshot_dropped_under_its_copy_keeps_its_buffer_in_thread_mode(
    models: tuple[Mixed, Mixed],
) -> None:
    cpu, gpu = models
    want, _ = HostCopier().copy_out(layouts_of(cpu)[0], bytearray)
    layout = layouts_of(gpu)[0]
    bridge = Bridge(page_aligned=True)
    copier = DeviceCopier.for_cuda(torch.device("cuda"))
    bridge.on_discard = copier.forget
    anchor = bridge.update_buffer(layout.raw_bytes)
    torch.cuda.synchronize()
    hold_side(copier)
    theta, ready = copier.copy_out(layout, bridge.snapshot_buffer)
    bridge.send_snapshot(Snapshot(0, 1, 0, 1, 1, theta, anchor, ready), wake=False)
    with torch.no_grad():
        gpu.wide.add_(1.0)  # the next steps
    later, ready_later = copier.copy_out(layout, bridge.snapshot_buffer)
    assert later is not theta  # not handed out under the running copy
    bridge.send_snapshot(Snapshot(0, 2, 0, 1, 1, later, anchor, ready_later), wake=False)
    assert bridge.copying == 1
    torch.cuda.synchronize()
    assert bytes(theta) == bytes(want)  # the first copy landed whole, overwritten by nothing
    bridge.drain()
    assert bridge.copying == 0
    copier.close()


@pytest.mark.parametrize("fragment", [0, 1])
def test_an_outer_gradient_on_the_device_is_the_hosts_bit_for_bit(
    models: tuple[Mixed, Mixed], fragment: int
) -> None:
    cpu, gpu = models
    cpu_layout, layout = layouts_of(cpu)[fragment], layouts_of(gpu)[fragment]
    anchor = bytearray(layout.raw_bytes)
    generator = torch.Generator().manual_seed(fragment)
    for view in cpu_layout.views(anchor):
        view.copy_(torch.randn(view.shape, generator=generator))
    theta, _ = HostCopier().copy_out(cpu_layout, bytearray)
    want = bytearray(layout.raw_bytes)
    fragment_delta_(anchor, theta, want)
    copier = DeviceCopier.for_cuda(torch.device("cuda"))
    on_device = torch.frombuffer(anchor, dtype=torch.uint8).cuda()
    got, ready = copier.copy_out(layout, lambda n: mapped_buffer(0, n), anchor=on_device)
    assert ready is not None
    ready.wait()
    assert bytes(got) == bytes(want)
    copier.close()


def test_step_times_are_the_devices_not_the_hosts() -> None:
    """A step that only queues its work returns at once; its time is the device's, read a step or
    so later."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()  # the kernel loaded: queueing it costs microseconds from here
    clock = DeviceClock.for_cuda(CudaStreams(torch.device("cuda")))
    queued = []

    def step() -> float:
        clock.start()
        started = time.perf_counter()
        torch.cuda._sleep(HOLD_CYCLES // 20)  # about 50 ms on the device
        queued.append(time.perf_counter() - started)
        return clock.stop()

    for _ in range(6):
        step()
    torch.cuda.synchronize()
    measured = step()  # the ends of the last two sleeps have completed: the last one's time
    assert measured > 10 * max(queued), (measured, queued)


# ---------------------------------------------------------------------------- real daemons


GPU_ENTRY_SOURCE = """
import torch
import dilocod


def make_model(device="cpu"):
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    return model.to(device)


def make_trainer(ctx):
    model = make_model(ctx.device)
    if ctx.role == "syncer":
        return dilocod.Trainer(model=model, optimizer=None, step=lambda i: dilocod.StepResult(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator(device=ctx.device).manual_seed(ctx.seed)

    def step(index):
        x = torch.randn(64, 64, generator=generator, device=ctx.device)
        loss = (model(x) - x[:, :8].tanh()).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return dilocod.StepResult(tokens=64, loss=None)  # never synchronises the host

    return dilocod.Trainer(model=model, optimizer=optimizer, step=step)


def make_island_trainer(ctx):
    model = make_model(ctx.device)
    if ctx.role == "syncer":
        return dilocod.Trainer(model=model, optimizer=None, step=lambda i: dilocod.StepResult(0))
    parallel = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.device(ctx.device).index])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator(device=ctx.device).manual_seed(1000 * ctx.seed + ctx.rank)

    def step(index):
        x = torch.randn(64, 64, generator=generator, device=ctx.device)
        loss = (parallel(x) - x[:, :8].tanh()).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return dilocod.StepResult(tokens=64, loss=None)

    return dilocod.Trainer(model=model, optimizer=optimizer, step=step)
"""
SYNCER_ARGS = ("--fragments", "3", "--sync-every", "6", "--quorum", "1")


@pytest.fixture
def gpu_entry(tmp_path: Path) -> Path:
    directory = tmp_path / "entry"
    directory.mkdir()
    (directory / "gpu_entry.py").write_text(GPU_ENTRY_SOURCE)
    return directory


@pytest.mark.parametrize(
    ("anchors", "network"), [("host", "process"), ("device", "process"), ("device", "thread")]
)
def test_a_gpu_learner_ends_on_the_syncers_fragments(
    tmp_path: Path, gpu_entry: Path, anchors: str, network: str
) -> None:
    syncer = start_syncer(
        tmp_path, gpu_entry, tmp_path / "syncer", *SYNCER_ARGS, entry="gpu_entry:make_trainer"
    )
    try:
        gpu = start_learner(
            tmp_path, gpu_entry, syncer.port, "gpu", "--steps", "120", "--device", "cuda",
            "--anchors", anchors, "--network", network, entry="gpu_entry:make_trainer",
        )  # fmt: skip
        assert gpu.process.wait(timeout=DEADLINE_S) == 0, gpu.stderr()
        syncer.wait_for("learner left", lambda record: True, DEADLINE_S)
        observer = start_learner(
            tmp_path, gpu_entry, syncer.port, "observer", "--steps", "1", entry="gpu_entry:make_trainer"
        )
        assert observer.process.wait(timeout=DEADLINE_S) == 0, observer.stderr()
        status = syncer_status(syncer.port)
    finally:
        assert syncer.stop() == 0, syncer.stderr()
    merged = syncer.log_events("round merged")
    assert len(merged) >= 5 and all(set(r["contributors"]) == {"gpu"} for r in merged)
    (trained,) = gpu.log_events("holding fragments")
    (healed,) = observer.log_events("holding fragments")  # the syncer's fragments, on the CPU
    same = [p for p, v in enumerate(trained["versions"]) if v == healed["versions"][p]]
    assert same, (trained, healed)
    assert [trained["digests"][p] for p in same] == [healed["digests"][p] for p in same]
    assert status["learners"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an island of 2 ranks needs 2 GPUs")
def test_an_island_of_two_gpus_applies_the_same_fragments_over_nccl(tmp_path: Path, gpu_entry: Path) -> None:
    syncer = start_syncer(
        tmp_path, gpu_entry, tmp_path / "syncer", *SYNCER_ARGS, entry="gpu_entry:make_trainer"
    )
    state = tmp_path / "island"
    try:
        done = run_island(
            tmp_path, gpu_entry, syncer.port, "gpu_entry:make_island_trainer", "cuda", 60, DEADLINE_S
        )
        assert done.returncode == 0, done.stderr[-4000:]
    finally:
        assert syncer.stop() == 0, syncer.stderr()
    assert syncer.log_events("round merged")
    ranks = [torch.load(state / f"rank-{r}" / "learner-state.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["step"] == ranks[1]["step"] == 60
    for name, value in ranks[0]["model"].items():
        assert torch.equal(value.cpu(), ranks[1]["model"][name].cpu()), name
