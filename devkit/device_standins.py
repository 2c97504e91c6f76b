"""CPU stand-ins for a GPU's streams, events and page-locking (dilocod.learner.device): copies run at
once on the CPU, each event completes when the test says so (at once, unless `hold` is set), and
registrations are recorded against the real addresses of real buffers. So the bookkeeping the CUDA
path shares with nothing else (regions pinned once, slots reused after their last use, host buffers
held by the copies that read them, who waits for whom) runs here exactly as it runs on a GPU; the
copies themselves are checked against the CPU path byte for byte, and on CUDA by tests/gpu/.

Also the small model of three dtypes both check (Mixed) and its two fragments' layouts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from dilocod.learner.device import HostPins
from dilocod.learner.layout import FragmentLayout, layouts_for
from dilocod.model.params import model_entries
from dilocod.wire.messages import Plan


class StandInEvent:
    def __init__(self, stream: str, at_ms: float, completed: bool) -> None:
        self.stream = stream
        self.at_ms = at_ms
        self.completed = completed
        self.synchronized = False

    def query(self) -> bool:
        return self.completed

    def synchronize(self) -> None:
        self.completed = True
        self.synchronized = True

    def elapsed_time(self, end: StandInEvent) -> float:
        assert self.completed and end.completed, "elapsed_time of an event not completed: CUDA raises"
        return end.at_ms - self.at_ms


class StandInStreams:
    """dilocod.learner.device.Streams on the CPU: the work is done when queued; the events say
    when the test lets them."""

    def __init__(self) -> None:
        #: Events recorded while set stay incomplete until complete_all().
        self.hold = False
        #: The stand-in device's clock (ms), read by each event as it is recorded.
        self.clock_ms = 0.0
        self.events: list[StandInEvent] = []
        self.main_waited: list[StandInEvent] = []
        self.side_waited: list[StandInEvent] = []
        self.on_side_now = False

    def _record(self, stream: str) -> StandInEvent:
        event = StandInEvent(stream, self.clock_ms, not self.hold)
        self.events.append(event)
        return event

    def record_main(self, *, timing: bool = False) -> StandInEvent:
        return self._record("main")

    def record_side(self) -> StandInEvent:
        return self._record("side")

    def main_waits(self, event: StandInEvent) -> None:  # type: ignore[override]
        self.main_waited.append(event)

    def side_waits(self, event: StandInEvent) -> None:  # type: ignore[override]
        self.side_waited.append(event)

    @contextmanager
    def on_side(self) -> Iterator[None]:
        self.on_side_now = True
        try:
            yield
        finally:
            self.on_side_now = False

    def synchronize(self) -> None:
        self.complete_all()

    def complete_all(self) -> None:
        for event in self.events:
            event.completed = True


@dataclass
class PinLog:
    """What a HostPins stand-in was asked: (address, size) registered, addresses unregistered."""

    registered: list[tuple[int, int]] = field(default_factory=list)
    unregistered: list[int] = field(default_factory=list)
    #: The code the next registration returns (0: success).
    fail_with: int = 0
    unregister_fails_with: int = 0


def recording_pins() -> tuple[HostPins, PinLog]:
    record = PinLog()

    def register(address: int, size: int) -> int:
        if record.fail_with:
            return record.fail_with
        record.registered.append((address, size))
        return 0

    def unregister(address: int) -> int:
        if record.unregister_fails_with:
            return record.unregister_fails_with
        record.unregistered.append(address)
        return 0

    return HostPins(register, unregister, lambda code: f"stand-in error ({code})"), record


class Mixed(nn.Module):
    """Parameters of three dtypes, one cut into row slices by the plan (tests/gpu/ makes it `scale`
    times larger in every dimension)."""

    def __init__(self, scale: int = 1) -> None:
        super().__init__()
        self.scale = scale
        generator = torch.Generator().manual_seed(7)
        self.wide = nn.Parameter(torch.randn(6 * scale, 5 * scale, generator=generator))
        self.narrow = nn.Parameter(torch.randn(3 * scale, 4 * scale, generator=generator).to(torch.bfloat16))
        self.bias = nn.Parameter(torch.randn(7 * scale, generator=generator).to(torch.float16))


def layouts_of(model: Mixed) -> list[FragmentLayout]:
    n = model.scale
    fragments = ((("wide", 0, 4 * n),), (("wide", 4 * n, 6 * n), ("narrow", 0, 3 * n), ("bias", 0, 7 * n)))
    plan = Plan("inc", model_entries(model), fragments, (0, 0), sync_every=2, overlap=1, quorum=1)
    return layouts_for(plan, model)
