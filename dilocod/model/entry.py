"""Loading and validating the user's entry (docs/design.md §6): "module:attr" or the name of an entry
point in the group `dilocod.trainers`, called with a LearnerContext, checked to return a Trainer.

Every failure is an EntryError whose message is one paragraph naming the entry and what to fix;
when the user's own code raised, the exception is chained so the user's traceback can follow.
Both daemons call this before they open any connection, so a typo costs seconds, not a join.
A step that raises is a StepFailed (not a configuration error: a restart may get past it), whose
chained exception carries the user's frames only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from types import TracebackType
from typing import Any

from dilocod.contract import LearnerContext, StepResult, Trainer

ENTRY_POINT_GROUP = "dilocod.trainers"


class EntryError(Exception):
    """The entry cannot be used; the message says which entry and why."""


class StepFailed(Exception):
    """The user's step raised: one line of context; the user's exception is the __cause__."""


def step_failed(spec: str, step_index: int, exc: BaseException) -> StepFailed:
    """A StepFailed for `exc`, whose traceback is cut to start at the user's own code: the frames of
    dilocod's loop in front of it tell the user nothing about their bug."""
    exc.with_traceback(_user_frames(exc.__traceback__))
    return StepFailed(
        f"--entry {spec!r}: step({step_index}) raised {type(exc).__name__}: {exc} (its traceback follows)"
    )


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """tb without its leading frames of dilocod's own modules (the examples are the user's code)."""
    first = tb
    while first is not None and _dilocod_module(first.tb_frame.f_globals.get("__name__", "")):
        first = first.tb_next
    return first if first is not None else tb


def _dilocod_module(name: str) -> bool:
    return (name == "dilocod" or name.startswith("dilocod.")) and not name.startswith("dilocod.examples.")


def resolve_factory(spec: str) -> Callable[[LearnerContext], Any]:
    """The factory named by spec, without calling it."""
    if not spec or spec != spec.strip():
        raise EntryError(f"--entry {spec!r} is empty or has surrounding spaces: use module:function")
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
        if not module_name or not attr_path:
            raise EntryError(f"--entry {spec!r} must be module:function, e.g. mypkg.train:make_trainer")
        target = _import(spec, module_name)
        for part in attr_path.split("."):
            try:
                target = getattr(target, part)
            except AttributeError:
                raise EntryError(
                    f"--entry {spec!r}: module {module_name!r} has no attribute {attr_path!r} "
                    f"(it defines: {_public_names(_import(spec, module_name))})"
                ) from None
    else:
        target = _entry_point(spec)
    if not callable(target):
        raise EntryError(
            f"--entry {spec!r} names a {type(target).__name__}, not a callable: it must be a "
            "function make_trainer(ctx: dilocod.LearnerContext) -> dilocod.Trainer"
        )
    return target


def load_trainer(spec: str, ctx: LearnerContext) -> Trainer:
    """Resolve the factory, call it with ctx and validate what it returns."""
    factory = resolve_factory(spec)
    try:
        trainer = factory(ctx)
    except Exception as exc:
        raise EntryError(
            f"--entry {spec!r}: the factory raised {type(exc).__name__}: {exc} (its traceback follows; "
            f"it was called with role {ctx.role!r} on device {ctx.device!r})"
        ) from exc
    check_trainer(spec, trainer, ctx)
    return trainer


def check_trainer(spec: str, trainer: object, ctx: LearnerContext) -> None:
    """What the factory returned must be a usable Trainer for ctx.role."""
    import torch  # noqa: PLC0415 - validating a Trainer needs torch; the CLI's help does not

    if not isinstance(trainer, Trainer):
        raise EntryError(
            f"--entry {spec!r} returned a {type(trainer).__name__}, not a dilocod.Trainer: return "
            "dilocod.Trainer(model=..., optimizer=..., step=...)"
        )
    if not isinstance(trainer.model, torch.nn.Module):
        raise EntryError(
            f"--entry {spec!r}: Trainer.model is a {type(trainer.model).__name__}, not a torch.nn.Module"
        )
    if not any(True for _ in trainer.model.parameters()):
        raise EntryError(f"--entry {spec!r}: Trainer.model has no parameters to train")
    if ctx.role == "learner" and not isinstance(trainer.optimizer, torch.optim.Optimizer):
        raise EntryError(
            f"--entry {spec!r}: Trainer.optimizer is a {type(trainer.optimizer).__name__}, not a "
            "torch.optim.Optimizer (a learner needs its inner optimizer to save and restore it)"
        )
    if not callable(trainer.step):
        raise EntryError(
            f"--entry {spec!r}: Trainer.step is not callable: it must be step(step_index) -> StepResult"
        )
    hooks = (trainer.state_dict is None, trainer.load_state_dict is None)
    if hooks[0] != hooks[1]:
        raise EntryError(
            f"--entry {spec!r}: give both Trainer.state_dict and Trainer.load_state_dict, or neither"
        )
    for name in ("state_dict", "load_state_dict"):
        hook = getattr(trainer, name)
        if hook is not None and not callable(hook):
            raise EntryError(f"--entry {spec!r}: Trainer.{name} is not callable")


def check_step_result(spec: str, step_index: int, result: object) -> StepResult:
    """What one call of Trainer.step returned must be a StepResult with sane numbers."""
    if not isinstance(result, StepResult):
        raise EntryError(
            f"--entry {spec!r}: step({step_index}) returned a {type(result).__name__}, not a "
            "dilocod.StepResult(tokens=..., loss=...)"
        )
    if type(result.tokens) is not int or result.tokens < 0:
        raise EntryError(
            f"--entry {spec!r}: step({step_index}) reported tokens={result.tokens!r}: a count >= 0"
        )
    if result.loss is not None and not (
        isinstance(result.loss, int | float) and not isinstance(result.loss, bool)
    ):
        hint = " (a tensor: report loss.item())" if hasattr(result.loss, "item") else ""
        raise EntryError(
            f"--entry {spec!r}: step({step_index}) reported loss={_short(result.loss)}: a float or None{hint}"
        )
    # A non-finite loss is allowed through: divergence is reported as progress, and the syncer's
    # guard keeps a diverged outer gradient out of the global model.
    return result


def _short(value: object) -> str:
    """repr(value) on one line and not too long (a tensor's repr spans lines)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else f"{text[:77]}..."


def _import(spec: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(f"{exc.name}.")):
            raise EntryError(
                f"--entry {spec!r}: no module named {exc.name!r} (is the package installed in this "
                "environment, or its directory on PYTHONPATH?)"
            ) from None
        raise EntryError(f"--entry {spec!r}: importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise EntryError(
            f"--entry {spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc} "
            "(its traceback follows)"
        ) from exc


def _entry_point(spec: str) -> Any:
    found = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
    if not found:
        names = sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})
        known = ", ".join(names) if names else "none are installed"
        raise EntryError(
            f"--entry {spec!r} is neither module:function nor an installed entry point of the group "
            f"{ENTRY_POINT_GROUP!r} ({known})"
        )
    if len(found) > 1:
        raise EntryError(
            f"--entry {spec!r}: several installed packages define this entry point: "
            + ", ".join(sorted(ep.value for ep in found))
        )
    try:
        return found[0].load()
    except Exception as exc:
        raise EntryError(
            f"--entry {spec!r}: loading entry point {found[0].value!r} raised {type(exc).__name__}: {exc}"
        ) from exc


def _public_names(module: Any) -> str:
    names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None)))
    return ", ".join(names[:12]) + (", ..." if len(names) > 12 else "") if names else "no callables"
