"""A learner's Link with no session: over a real Bridge, with a plan of a small model it has not
adopted yet, for the tests that drive a Link's decisions directly (its updates, its rejoins)."""

from __future__ import annotations

import torch

from dilocod.learner.bridge import Bridge
from dilocod.learner.link import Link, LinkConfig
from dilocod.model.params import model_entries
from dilocod.model.plan import plan_fragments
from dilocod.wire.messages import Plan


def new_link(incarnation: str = "inc", versions: tuple[int, int] = (0, 0)) -> tuple[Link, Bridge, Plan]:
    """A Link over a real Bridge (no session), and a plan of two fragments of a small model that it
    has not adopted yet."""
    module = torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.Linear(40, 7))
    specs = model_entries(module)
    plan = plan_fragments([(s.name, s.shape) for s in specs], 2)
    message = Plan(incarnation, specs, tuple(f.pieces for f in plan.fragments), versions, 4, 1, 1)
    bridge = Bridge()
    link = Link(LinkConfig("127.0.0.1", 7070, "learner-a", None, codec="none"), specs, bridge)
    return link, bridge, message
