"""The learner's device path (dilocod.learner.device) on the CPU: the CUDA path's bookkeeping driven
through CPU stand-ins of its streams, events and page-locking (devkit/device_standins.py), its
copies checked byte for byte against the CPU path's, and the thread-mode bridge never reusing a
buffer a device copy still writes. tests/gpu/ runs the same path on a real GPU."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from devkit.device_standins import Mixed, StandInEvent, StandInStreams, layouts_of, recording_pins
from dilocod.learner.bridge import Bridge, Snapshot
from dilocod.learner.delta import fragment_delta_
from dilocod.learner.device import (
    MAX_PENDING_STEP_EVENTS,
    DeviceClock,
    DeviceCopier,
    DeviceCopy,
    DeviceError,
    DeviceSlots,
    Holds,
    HostCopier,
    HostPins,
)
from dilocod.learner.layout import FragmentLayout

CPU = torch.device("cpu")


def address_of(owner: bytearray | mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(owner))


# ---------------------------------------------------------------------------- page-locking


def test_a_region_is_pinned_once_whatever_its_buffers_and_unpinned_when_it_goes() -> None:
    pins, log = recording_pins()
    region = mmap.mmap(-1, 3 * mmap.PAGESIZE)
    first, second = memoryview(region)[:100], memoryview(region)[mmap.PAGESIZE :]
    alone = bytearray(5000)
    region_at, alone_at = address_of(region), address_of(alone)
    for _ in range(3):
        pins.pin(first)
        pins.pin(second)
        pins.pin(alone)
    # The whole mapping once (two registrations may not share a page), the bytearray once.
    assert log.registered == [(region_at, 3 * mmap.PAGESIZE), (alone_at, 5000)]
    assert pins.pinned == 2
    pins.unpin(second)  # the pool discarded a buffer of the region: the region goes
    assert log.unregistered == [region_at] and pins.pinned == 1
    pins.unpin(second)  # nothing pinned there any more: nothing to do
    pins.pin(first)
    assert log.registered[-1] == (region_at, 3 * mmap.PAGESIZE)
    pins.unpin_all()
    assert sorted(log.unregistered) == sorted([region_at, region_at, alone_at]) and pins.pinned == 0


def test_a_failed_registration_is_an_error_naming_the_call_and_the_lock_limit() -> None:
    pins, log = recording_pins()
    log.fail_with = 2
    buffer = bytearray(4096)
    named = r"cudaHostRegister of 4096 bytes .*stand-in error \(2\).*LimitMEMLOCK="
    with pytest.raises(DeviceError, match=named):
        pins.pin(buffer)
    assert pins.pinned == 0  # not counted as pinned: the next copy asks again
    log.fail_with = 0
    pins.pin(buffer)
    assert pins.pinned == 1
    log.unregister_fails_with = 1
    with pytest.raises(DeviceError, match=r"cudaHostUnregister .*stand-in error \(1\)"):
        pins.unpin_all()


# ---------------------------------------------------------------------------- slots and holds


def test_a_slot_is_reused_only_once_its_last_use_has_completed() -> None:
    slots = DeviceSlots(lambda size: torch.zeros(size, dtype=torch.uint8))
    pending = StandInEvent("main", 0.0, completed=False)
    a = slots.take(64)
    slots.give(a, pending)
    b = slots.take(64)
    assert b is not a and slots.made == 2  # a is still read: a new slot, never a wait
    slots.give(b, None)
    pending.completed = True
    assert slots.take(64) is a  # the oldest first, now done
    assert slots.take(64) is b
    assert slots.take(32) is not a and slots.made == 3  # by size


def test_a_buffer_a_copy_reads_goes_back_only_once_the_copy_has_completed() -> None:
    holds = Holds()
    released: list[str] = []
    reading = StandInEvent("side", 0.0, completed=False)
    holds.after(reading, lambda: released.append("a"))
    holds.after(None, lambda: released.append("b"))  # no copy: at once
    holds.after(StandInEvent("side", 0.0, completed=False), lambda: released.append("c"))
    holds.settle()
    assert released == ["b"] and len(holds) == 2
    reading.completed = True
    holds.settle()
    assert released == ["b", "a"]
    holds.drain()  # the end of training waits for the last copy
    assert released == ["b", "a", "c"] and not holds


# ---------------------------------------------------------------------------- copies


def mixed_layouts() -> tuple[Mixed, list[FragmentLayout]]:
    model = Mixed()
    return model, layouts_of(model)


def staged_copier() -> tuple[DeviceCopier, StandInStreams]:
    streams = StandInStreams()
    pins, _log = recording_pins()
    return DeviceCopier(CPU, streams, pins), streams


@pytest.mark.parametrize("fragment", [0, 1])
def test_a_staged_snapshot_holds_the_cpu_paths_bytes_and_training_never_waits(fragment: int) -> None:
    _model, layouts = mixed_layouts()
    layout = layouts[fragment]
    want, _ = HostCopier().copy_out(layout, bytearray)
    copier, streams = staged_copier()
    streams.hold = True
    got, ready = copier.copy_out(layout, lambda n: memoryview(mmap.mmap(-1, n)))
    assert bytes(got) == bytes(want)
    assert isinstance(ready, DeviceCopy) and not ready.done()
    staged, copied = streams.events
    # The side stream waits for the staging copy; the training stream waits for nothing.
    assert (staged.stream, copied.stream) == ("main", "side")
    assert streams.side_waited == [staged] and streams.main_waited == []
    ready.wait()  # the network's thread: the copy's own event
    assert copied.synchronized and ready.done()
    assert copier.pins.pinned == 1


@pytest.mark.parametrize("fragment", [0, 1])
def test_an_outer_gradient_computed_on_the_device_is_the_networks_bit_for_bit(fragment: int) -> None:
    """--anchors device: δ = anchor - θ on the training stream, in the slot, against the network's
    float32 subtraction over the host copy (learner.delta), parameters of three dtypes."""
    _model, layouts = mixed_layouts()
    layout = layouts[fragment]
    anchor_bytes = bytearray(layout.raw_bytes)
    generator = torch.Generator().manual_seed(fragment)
    for view in layout.views(anchor_bytes):
        view.copy_(torch.randn(view.shape, generator=generator))
    theta, _ = HostCopier().copy_out(layout, bytearray)
    want = bytearray(layout.raw_bytes)
    fragment_delta_(anchor_bytes, theta, want)
    copier, streams = staged_copier()
    anchor = torch.frombuffer(bytearray(anchor_bytes), dtype=torch.uint8)  # where the parameters are
    got, ready = copier.copy_out(layout, bytearray, anchor=anchor)
    assert bytes(got) == bytes(want) and any(want)
    assert streams.main_waited == [] and ready is not None and ready.done()


def test_an_update_is_staged_on_the_side_stream_and_its_buffer_held_until_the_copy_is_done() -> None:
    _model, layouts = mixed_layouts()
    layout = layouts[1]
    update = memoryview(mmap.mmap(-1, layout.raw_bytes))
    for view in layout.views(update):
        view.copy_(torch.arange(view.numel()).view(view.shape))
    copier, streams = staged_copier()
    streams.hold = True
    staged = copier.stage(layout, update)
    (arrived,) = streams.events
    assert arrived.stream == "side" and streams.main_waited == [arrived]  # on the device, not the host
    for got, want in zip(staged.views, layout.views(update), strict=True):
        assert torch.equal(got, want) and got.data_ptr() != want.data_ptr()
    copier.done(staged)
    released: list[bool] = []
    copier.let_go(update, lambda: released.append(True))
    copier.settle()
    assert released == []  # the copy still reads it
    streams.complete_all()
    copier.settle()
    assert released == [True]
    # The slot comes back after the apply that read it: reused, not made again.
    again = copier.stage(layout, update)
    assert again.flat is staged.flat and copier.slots.made == 1


def test_a_prefetched_update_makes_the_training_stream_wait_only_where_it_is_applied() -> None:
    _model, layouts = mixed_layouts()
    layout = layouts[0]
    update = memoryview(mmap.mmap(-1, layout.raw_bytes))
    copier, streams = staged_copier()
    streams.hold = True
    upload = copier.prefetch(update)
    assert upload is not None and not upload.landed()
    assert streams.main_waited == []  # the copy runs on the side stream while the step does
    streams.complete_all()
    streams.hold = False
    assert upload.landed()
    staged = copier.stage(layout, update, upload)
    assert staged.flat is upload.flat and streams.main_waited == [upload.arrived]
    dropped = copier.prefetch(update)
    assert dropped is not None and dropped.flat is not upload.flat
    copier.discard(dropped)  # never applied: back once its copy is done (it is)
    assert copier.prefetch(update).flat is dropped.flat  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"fragment 1: .* bytes, the layout has"):
        copier.stage(layouts[1], update, upload)


def test_snapshots_reuse_their_slots_and_pin_each_buffer_once() -> None:
    _model, layouts = mixed_layouts()
    layout = layouts[0]
    copier, streams = staged_copier()
    buffers = [memoryview(mmap.mmap(-1, layout.raw_bytes)) for _ in range(3)]
    streams.hold = True
    for buffer in buffers:
        copier.copy_out(layout, lambda _n, b=buffer: b)
    assert copier.slots.made == 3  # three copies in flight at once
    streams.complete_all()
    streams.hold = False
    for _ in range(4):
        for buffer in buffers:
            copier.copy_out(layout, lambda _n, b=buffer: b)
    assert copier.slots.made == 3 and copier.pins.pinned == 3
    copier.close()
    assert copier.pins.pinned == 0


def test_closing_waits_for_every_copy_before_it_unpins_their_memory() -> None:
    _model, layouts = mixed_layouts()
    streams = StandInStreams()
    at_unregister: list[bool] = []
    pins = HostPins(
        lambda _a, _s: 0, lambda _a: at_unregister.append(all(e.completed for e in streams.events)) or 0
    )
    copier = DeviceCopier(CPU, streams, pins)
    streams.hold = True
    buffer = memoryview(mmap.mmap(-1, layouts[0].raw_bytes))
    copier.copy_out(layouts[0], lambda _n: buffer)
    released: list[bool] = []
    copier.stage(layouts[0], buffer)
    copier.let_go(buffer, lambda: released.append(True))
    copier.close()
    assert at_unregister == [True] and released == [True]


# ---------------------------------------------------------------------------- the thread-mode bridge


def test_a_snapshot_dropped_while_its_copy_runs_keeps_its_buffer_until_the_copy_is_done() -> None:
    bridge = Bridge()
    anchor = bridge.update_buffer(64)
    copying = StandInEvent("side", 0.0, completed=False)
    theta = bridge.snapshot_buffer(64)
    first = Snapshot(0, 1, 0, 1, 1, theta, anchor, DeviceCopy(copying))
    bridge.send_snapshot(first, wake=False)
    # A newer request's snapshot replaces it before the network took it: its copy still writes.
    bridge.send_snapshot(Snapshot(0, 2, 0, 1, 1, bridge.snapshot_buffer(64), anchor), wake=False)
    assert bridge.copying == 1
    assert bridge.pool.holders(bridge.pool.id_of(theta) or -1) == 1
    assert bridge.snapshot_buffer(64) is not theta  # not handed out under the copy
    copying.completed = True
    bridge.drain()
    assert bridge.copying == 0 and bridge.pool.holders(bridge.pool.id_of(theta) or -1) == 0


def test_a_discarded_buffer_is_unpinned() -> None:
    bridge = Bridge(page_aligned=True)
    copier, _streams = staged_copier()
    bridge.on_discard = copier.forget
    buffer = bridge.update_buffer(4096)
    assert isinstance(buffer.obj, mmap.mmap)  # a mapping of its own: whole pages
    copier.pins.pin(buffer)
    bridge.update_failed(buffer)
    assert copier.pins.pinned == 0


# ---------------------------------------------------------------------------- the step clock


def test_step_times_are_the_devices_read_a_step_late_and_never_waited_for() -> None:
    streams = StandInStreams()
    clock = DeviceClock(lambda: streams.record_main(timing=True))
    streams.hold = True
    clock.start()
    first = clock.stop()  # nothing measured on the device yet: the host's time
    assert 0 <= first < 5
    streams.clock_ms = 250.0
    clock.start()
    assert clock.stop() == pytest.approx(first, abs=5)  # the second end not reached: still host
    assert not any(e.synchronized for e in streams.events)  # read, never waited for
    streams.complete_all()
    streams.clock_ms = 650.0
    clock.start()
    assert clock.stop() == pytest.approx(0.25)  # step 2: 250 ms on the device (step 3 pending)
    streams.complete_all()
    clock.start()
    assert clock.stop() == pytest.approx(0.40)
    # A host far ahead keeps a bounded queue of ends.
    for _ in range(2 * MAX_PENDING_STEP_EVENTS):
        clock.start()
        clock.stop()
    assert len(clock._ends) <= MAX_PENDING_STEP_EVENTS
