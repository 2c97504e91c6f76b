"""`dilocod demo`: a syncer and N learners as real processes on loopback, training the embedded
byte-level language model (dilocod.examples.charlm) on the Python standard library's sources, with
live progress, optional chaos (a random learner killed with -9 and restarted every ~30 s), and at
the end the eval loss of the syncer's global model and a loss-versus-tokens plot.

It only orchestrates: the daemons are the same `dilocod syncer` and `dilocod learner` a user runs,
started as child processes; everything it shows comes from their JSON log lines and from
`dilocod status`. Children are always stopped on the way out, also on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dilocod.config import DEFAULT_ENTRY, Address
from dilocod.ops.processes import read_ready_line, stop_process
from dilocod.ops.status import describe_quorum_sizes, fetch_status
from dilocod.transport.loop import run

SHOW_EVERY_S = 5.0
#: How long the processes may take to start and merge the first round (a busy host's worst).
START_TIMEOUT_S = 300.0
CHAOS_EVERY_S = 30.0
CHAOS_DOWN_S = 3.0
#: With K = 1 the others merge rounds within seconds; no merge in this long is a stall.
CHAOS_MAX_DOWN_S = 20.0

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class DemoPlan:
    learners: int = 4
    minutes: float = 3.0
    chaos: bool = False
    plot: Path | None = None
    state_dir: Path | None = None
    entry: str = DEFAULT_ENTRY
    seed: int = 0
    chaos_every_s: float = CHAOS_EVERY_S


@dataclass
class Child:
    """One daemon process and what its JSON log lines told us."""

    name: str
    command: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    last: dict[str, Any] = field(default_factory=dict)
    losses: list[tuple[int, float]] = field(default_factory=list)  # (tokens so far, training loss)
    tokens_before: int = 0  # tokens of earlier incarnations of this learner (chaos restarts)
    restarts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert self.process.stderr is not None
        threading.Thread(target=self._follow, args=(self.process.stderr,), daemon=True).start()

    def _follow(self, stream: IO[bytes]) -> None:
        with self.log_path.open("ab") as copy:
            for raw in stream:
                copy.write(raw)
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("event") == "progress":
                    with self.lock:
                        self.last = record
                        if record.get("loss") is not None:
                            tokens = self.tokens_before + int(record.get("tokens", 0))
                            self.losses.append((tokens, float(record["loss"])))

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        return None if self.process is None else stop_process(self.process, sig)


def _read_ready(child: Child) -> dict[str, Any]:
    assert child.process is not None
    return read_ready_line(child.process, f"{child.name} (see {child.log_path})")


def run_demo(plan: DemoPlan, say: Say) -> dict[str, Any]:
    """Run the demo; returns the numbers it printed (eval loss, rounds, restarts)."""
    with contextlib.ExitStack() as stack:
        work = plan.state_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="dilocod-demo-"))
        )
        work.mkdir(parents=True, exist_ok=True)
        # One torch thread per daemon: N learners and a syncer already share the machine's cores.
        env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
        python = [sys.executable, "-m", "dilocod"]
        syncer = Child(
            "syncer",
            [
                *python,
                *("syncer", "--listen", "127.0.0.1:0", "--insecure", "--entry", plan.entry),
                *("--state-dir", str(work / "syncer"), "--checkpoint-every-s", "30", "--ready-json"),
            ],
            work / "syncer.log",
        )
        stack.callback(_stop_all, [syncer])
        kept = "" if plan.state_dir else " (removed at the end; --state-dir DIR keeps them)"
        say(f"demo: {plan.learners} learners and a syncer on 127.0.0.1, {plan.minutes:g} min")
        say(f"demo: logs in {work}{kept}")
        syncer.start(env)
        address = Address("127.0.0.1", int(_read_ready(syncer)["port"]))
        learners = [
            Child(
                f"learner-{m}",
                [
                    *python,
                    *("learner", "--syncer", str(address), "--insecure", "--entry", plan.entry),
                    *("--id", f"learner-{m}", "--seed", str(m), "--device", "cpu"),
                    *("--state-dir", str(work / f"learner-{m}"), "--progress-every-s", "2"),
                    *("--save-every-s", "20"),
                ],
                work / f"learner-{m}.log",
            )
            for m in range(plan.learners)
        ]
        stack.callback(_stop_all, learners)  # callbacks run last-in first-out: learners, then syncer
        for learner in learners:
            learner.start(env)
        result = _watch(plan, syncer, learners, address, env, say)
        say("demo: stopping the learners, then the syncer (it writes a checkpoint)")
        for learner in learners:
            learner.stop()
        if syncer.stop() != 0:
            raise RuntimeError(f"the syncer did not stop cleanly; see {syncer.log_path}")
        scored = _evaluate(work / "syncer", plan.entry)
        result["eval_loss"] = scored.final
        result["initial_eval_loss"] = scored.initial
        say(scored.summary(plan.minutes))
        if plan.plot is not None:
            _plot(plan.plot, learners, scored.final, say)
        return result


def _stop_all(children: list[Child]) -> None:
    for child in children:
        if child.alive():
            with contextlib.suppress(Exception):
                child.stop()


def _status(address: Address) -> dict[str, Any] | None:
    try:
        return run(fetch_status(address, secret=None, timeout_s=10.0))
    except (OSError, ConnectionError, TimeoutError):
        return None


def _watch(
    plan: DemoPlan, syncer: Child, learners: list[Child], address: Address, env: dict[str, str], say: Say
) -> dict[str, Any]:
    rng = random.Random(plan.seed)
    started = time.monotonic()
    # The --minutes of training count from the first merged round: starting the processes
    # (importing torch, building the model, the first heal) takes seconds on a quiet host and
    # much longer on a busy one, and is not training. Chaos starts then too: a learner killed
    # before any round merged would show an outage that stopped nothing.
    deadline = started + START_TIMEOUT_S
    training = False
    next_show = started + SHOW_EVERY_S
    next_chaos = float("inf")
    outages: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        if not syncer.alive():
            raise RuntimeError(f"the syncer exited; see {syncer.log_path}")
        now = time.monotonic()
        if now >= next_chaos:
            outages.append(_chaos(rng, learners, address, env, say))
            next_chaos = time.monotonic() + plan.chaos_every_s * rng.uniform(0.7, 1.3)
        if now >= next_show:
            status = _status(address)
            if not training and status is not None and status["rounds_merged"] > 0:
                training = True
                deadline = now + plan.minutes * 60
                say(f"demo: first round merged after {now - started:.0f} s; training {plan.minutes:g} min")
                if plan.chaos:
                    next_chaos = now + plan.chaos_every_s * rng.uniform(0.7, 1.3)
            _show(status, learners, now - started, say)
            next_show = now + SHOW_EVERY_S
        # The demo's own pacing (it only looks at the children): not a wait for an event.
        time.sleep(0.2)
    if not training:
        raise RuntimeError(
            f"no round merged within {START_TIMEOUT_S:.0f} s of the start; logs in {syncer.log_path.parent}"
        )
    status = _status(address) or {}
    never_stopped = all(o["rounds_during"] > 0 for o in outages)
    if plan.chaos:
        say(
            f"chaos: {len(outages)} learners killed with -9 and restarted; rounds merged while one was down: "
            f"{[o['rounds_during'] for o in outages]}; training "
            + ("never stopped" if never_stopped else "STALLED during an outage")
        )
    return {
        "rounds_merged": status.get("rounds_merged"),
        "learners": plan.learners,
        "minutes": plan.minutes,
        "restarts": len(outages),
        "training_never_stopped": never_stopped,
    }


def _chaos(
    rng: random.Random, learners: list[Child], address: Address, env: dict[str, str], say: Say
) -> dict[str, Any]:
    victim = rng.choice(learners)
    before = (_status(address) or {}).get("rounds_merged", 0)
    say(f"chaos: kill -9 {victim.name}")
    victim.stop(signal.SIGKILL)
    down_at = time.monotonic()
    with victim.lock:
        victim.tokens_before += int(victim.last.get("tokens", 0))
        victim.last = {}
    # The outage: CHAOS_DOWN_S, longer while no round has merged (a busy host can take seconds to
    # merge one), up to CHAOS_MAX_DOWN_S; the others must go on meanwhile.
    time.sleep(CHAOS_DOWN_S)
    during = (_status(address) or {}).get("rounds_merged", 0) - before
    while during <= 0 and time.monotonic() - down_at < CHAOS_MAX_DOWN_S:
        time.sleep(0.5)
        during = (_status(address) or {}).get("rounds_merged", 0) - before
    victim.restarts += 1
    victim.start(env)
    say(
        f"chaos: {victim.name} restarted (it heals from the syncer); {during} rounds merged while it was "
        f"down for {time.monotonic() - down_at:.0f} s"
    )
    return {"learner": victim.name, "rounds_during": during}


def _show(status: dict[str, Any] | None, learners: list[Child], elapsed_s: float, say: Say) -> None:
    lines = [f"--- {elapsed_s:5.0f} s"]
    for learner in learners:
        with learner.lock:
            last = dict(learner.last)
        state = "running" if learner.alive() else "down"
        if last:
            loss = last.get("loss")
            shown_loss = "-" if loss is None else f"{loss:.3f}"
            lines.append(
                f"{learner.name:<12} {state:<8} step {last.get('step', 0):>6}  "
                f"{last.get('steps_per_s', 0):6.2f} steps/s  loss {shown_loss}  "
                f"syncer {last.get('syncer', '?')}  last round {last.get('last_round_s')} s"
            )
        else:
            lines.append(f"{learner.name:<12} {state:<8} starting")
    if status is None:
        lines.append("syncer: no answer")
    else:
        minutes = max(status["uptime_s"], 1e-9) / 60
        versions = sum(f["version"] for f in status["fragments"])
        lines.append(
            f"syncer: {status['rounds_merged']} rounds merged ({status['rounds_merged'] / minutes:.0f}/min), "
            f"fragment versions {versions}; quorum: {describe_quorum_sizes(status['quorum_sizes'])}"
        )
    say("\n".join(lines))


@dataclass(frozen=True, slots=True)
class Scored:
    """The global model's eval loss at the end and before training, in the entry's own terms."""

    final: float
    initial: float
    #: The entry module's EVAL_LOSS_UNIT ("nats per byte") and EVAL_LOSS_MEANING, if it has them.
    unit: str = ""
    meaning: str = ""

    def summary(self, minutes: float) -> str:
        unit = f" {self.unit}" if self.unit else ""
        # 4 significant digits: a small task can end near 1e-5.
        lines = [
            f"eval loss: {self.final:.4g}{unit} (the syncer's global model on held-out data after "
            f"{minutes:g} min; {self.initial:.4g} before training)"
        ]
        if self.meaning:
            lines.append(f"  {self.meaning}")
        return "\n".join(lines)


def _evaluate(syncer_state: Path, entry: str) -> Scored:
    """The eval loss of the syncer's global model, read from its newest checkpoint, and of the
    model the syncer started from (the factory's, at the syncer's default seed)."""
    from dilocod.contract import LearnerContext  # noqa: PLC0415 - torch only at the end
    from dilocod.model.entry import resolve_factory  # noqa: PLC0415
    from dilocod.model.params import model_entries  # noqa: PLC0415
    from dilocod.syncer.checkpoint import load_latest_checkpoint  # noqa: PLC0415

    loaded = load_latest_checkpoint(syncer_state)
    if loaded is None:
        raise RuntimeError(f"the syncer left no checkpoint in {syncer_state}")
    module = sys.modules[resolve_factory(entry).__module__]
    evaluate = getattr(module, "evaluate", None)
    if evaluate is None:
        raise RuntimeError(f"{entry}: its module has no evaluate(model) to score the global model")
    trainer = resolve_factory(entry)(LearnerContext("demo", "syncer", "cpu", 0, 1, None, 0))
    initial = float(evaluate(trainer.model))
    # The checkpoint names a tied parameter once; the module may list it under a second name.
    result = trainer.model.load_state_dict(loaded.state.params, strict=False)
    trained = {entry.name for entry in model_entries(trainer.model)}
    if result.unexpected_keys or trained & set(result.missing_keys):
        raise RuntimeError(f"the syncer's checkpoint does not fit {entry}'s model: {result}")
    return Scored(
        final=float(evaluate(trainer.model)),
        initial=initial,
        unit=str(getattr(module, "EVAL_LOSS_UNIT", "")),
        meaning=str(getattr(module, "EVAL_LOSS_MEANING", "")),
    )


def _plot(path: Path, learners: list[Child], eval_loss: float, say: Say) -> None:
    try:
        import matplotlib  # noqa: PLC0415 - optional extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        say("plot: matplotlib is not installed (pip install 'dilocod[plot]'); no plot written")
        return
    figure, axes = plt.subplots(figsize=(8, 5))
    total = 0
    for learner in learners:
        if learner.losses:
            tokens, losses = zip(*learner.losses, strict=True)
            axes.plot(tokens, losses, label=f"{learner.name} (training)", linewidth=1)
            total += tokens[-1]
    axes.axhline(eval_loss, color="black", linestyle="--", label=f"global model, eval {eval_loss:.3f}")
    axes.set_xlabel("tokens (per learner)")
    axes.set_ylabel("loss (nats per byte)")
    axes.set_title("dilocod demo: Decoupled DiLoCo on the Python standard library")
    axes.legend()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    say(f"plot: wrote {path}")
