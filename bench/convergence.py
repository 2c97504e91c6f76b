"""Convergence at equal tokens: data-parallel against (Decoupled) DiLoCo through the real daemons.

Same model (dilocod.examples.charlm defaults: 221,760 parameters, context 128), same data (the
stdlib's sources), same number of training tokens; the number compared is the eval loss
(charlm.evaluate: nats per byte on fixed held-out windows) of the final model.

- **a** data-parallel: ONE process, no dilocod, batch M x 16 on the unsharded training set
  (TrainConfig(batch_size=16 * M, shards=1)), --steps steps: M x steps x 16 x 128 tokens.
- Everything else runs `python -m dilocod syncer` and M x `python -m dilocod learner` as real
  processes on loopback (OMP_NUM_THREADS=1, learner m gets --seed m and so reads shard m) until
  they have trained as many tokens as a. How that budget is spent (--budget):
  - **fleet** (the default): the learners together train M x --steps steps. All of them train on
    until their steps add up to that, then all are sent SIGTERM at once (each finishes its step,
    saves and leaves); the steps actually trained are recorded (a little past the budget: the
    learners report their steps every 0.5 s). A learner that lost time (a kill, a slow host)
    trains fewer steps and the others more, as in a run that does not end.
  - **learner**: each learner runs exactly --steps steps (`dilocod learner --steps`). A learner
    that lost time then finishes last and trains alone for a while at the end, and with K = 1 the
    global model follows that one learner's iterate: in f that lone tail cost 5 % of eval loss in
    10 s (bench/RESULTS.md §7).
  The loss is that of the syncer's global model: the learners stop, the syncer is sent SIGTERM (it
  checkpoints), and the newest checkpoint is loaded into a charlm model and evaluated.
  - **b** lock-step DiLoCo: --quorum M --overlap 0 (every round waits for all M, no overlap).
  - **c** Decoupled DiLoCo: the syncer's defaults (P = H = 24, tau = 2, K = 1, RDA merge).
  - **d** c with --merge mean.
  - **e** c with learner 0 two times slower: its entry is a wrapper module (written to a temp dir,
    put on its PYTHONPATH) that sleeps, after each step, as long as the step itself took.
  - **f** c with learner 0 killed with SIGKILL and restarted (same --id and --state-dir) twice,
    when it has done 1/3 and 2/3 of its steps. It saves its local state every 5 s
    (--save-every-s 5); the steps since the last save are trained again after the restart
    (extra compute, not counted as tokens).
  - **g** c with every learner --apply keep-local (overwrite is c).
  - **h** c with every learner --precision int4 (fp32 is c).
- Extra rows (only with --only): **a2** a with data seed 1 (run-to-run spread of a), **c2** c
  again (the spread of c: the interleaving of rounds differs run to run), **c-mom05** and
  **c-mom07** c with --outer-momentum 0.5 and 0.7, **c-lr04** c with --outer-lr 0.4, **c-avg** c
  with --outer-lr 1 --outer-momentum 0 (the merged outer gradient applied as it is: averaging, no
  momentum), **c-bf16** c with the syncer's --update-precision bf16 (updates rounded to bfloat16),
  **solo** one learner's batch (16) alone for --steps steps, 1/M of the tokens (what the
  M learners would reach without any merging).
- Sweep rows (only with --only): c, e or f, then what they change, in this order: **-lr<η>**,
  **-m<μ>**, **-g<gamma>**, **-kl**, **-due**. E.g. `c-lr1-m0.5-g1-kl` is c with --outer-lr 1
  --outer-momentum 0.5 --grace-factor 1 and every learner --apply keep-local; `f-lr0.5-m0.8` is f
  (one learner killed twice) with --outer-lr 0.5 --outer-momentum 0.8; `c-due` is c with every
  learner --answer due (requests held to their due step; arrival is the default).

Across an emulated WAN (root): `--wan 2gbit,100ms [--wan-emulator PATH]` runs the daemon rows with
the syncer in one network namespace and the learners in the other (netem where the kernel has it,
else the emulator, as `dilocod bench local --rtt` does), keyed e.g. `c@2gbit+100ms`; each row also
records rounds due (by the syncer's clock), skipped and abandoned, the learners' steps per second
and the syncer's heal times, to set beside the same row on loopback.

Usage: python bench/convergence.py [--steps 300] [--learners 4] [--only a,c,d] [--budget fleet|learner]
       [--wan RATE,RTT [--wan-emulator PATH]] [--json] [--out bench/results/convergence.json]
Writes the results as JSON to --out (merged by key into an existing file) and prints a table.
A benchmark: it measures and records, it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
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

import torch

from dilocod.contract import LearnerContext
from dilocod.examples.charlm import CharLM, CharLMConfig, TrainConfig, build_trainer, evaluate, load_held_out
from dilocod.linkbench.local import Link, choose_delay, parse_rate, parse_rtt, shaped_link
from dilocod.ops.processes import read_ready_line, stop_process
from dilocod.syncer.checkpoint import load_latest_checkpoint

BATCH = 16  # charlm's default per-learner batch
CONTEXT = CharLMConfig().context
READY_TIMEOUT_S = 120.0
#: How often the learners log their step (--progress-every-s), and so how far a fleet budget can be
#: overshot: about this long at the fleet's step rate.
PROGRESS_EVERY_S = 0.5
#: The watcher's pacing: how often it looks at the children's steps.
WATCH_EVERY_S = 0.2
BUDGETS = ("fleet", "learner")
#: The syncer's default H (its rounds due per clock step are P / H).
SYNC_EVERY = 24
STOP_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 3600.0
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "convergence.json"

SLOW_ENTRY_MODULE = "convergence_slow_entry"
SLOW_ENTRY_SOURCE = '''
"""charlm's entry, two times slower: after each step, sleep as long as the step took."""
import dataclasses
import time

from dilocod.examples.charlm import make_trainer as charlm_trainer


def make_trainer(ctx):
    trainer = charlm_trainer(ctx)
    if ctx.role == "syncer":
        return trainer
    inner = trainer.step

    def step(index):
        started = time.perf_counter()
        result = inner(index)
        time.sleep(time.perf_counter() - started)
        return result

    return dataclasses.replace(trainer, step=step)
'''


@dataclass(frozen=True, slots=True)
class Variant:
    key: str
    label: str
    syncer_args: tuple[str, ...] = ()
    learner_args: tuple[str, ...] = ()
    slow_learner: bool = False  # learner 0 runs two times slower
    kills: int = 0  # learner 0 is killed with -9 and restarted this many times
    data_parallel: bool = False
    data_seed: int = 0
    solo: bool = False  # data-parallel row with batch 16 (one learner's batch): 1/M of the tokens


VARIANTS = {
    v.key: v
    for v in (
        Variant("a", "data-parallel, 1 process, batch 16·M", data_parallel=True),
        Variant("b", "lock-step DiLoCo (K = M, tau = 0)", syncer_args=("--quorum", "{M}", "--overlap", "0")),
        Variant("c", "Decoupled DiLoCo (P = H = 24, tau = 2, K = 1, RDA)"),
        Variant("d", "c with --merge mean", syncer_args=("--merge", "mean")),
        Variant("e", "c, one learner 2x slower", slow_learner=True),
        Variant("f", "c, one learner kill -9 + restart x2", kills=2),
        Variant("g", "c with --apply keep-local", learner_args=("--apply", "keep-local")),
        Variant("h", "c with --precision int4", learner_args=("--precision", "int4")),
        Variant("a2", "a, data seed 1 (spread of a)", data_parallel=True, data_seed=1),
        Variant("c2", "c again (spread of c)"),
        Variant("c-bf16", "c with --update-precision bf16", syncer_args=("--update-precision", "bf16")),
        Variant("c-mom05", "c with --outer-momentum 0.5", syncer_args=("--outer-momentum", "0.5")),
        Variant("c-mom07", "c with --outer-momentum 0.7", syncer_args=("--outer-momentum", "0.7")),
        Variant("c-lr04", "c with --outer-lr 0.4", syncer_args=("--outer-lr", "0.4")),
        Variant(
            "c-avg",
            "c with --outer-lr 1 --outer-momentum 0 (averaging)",
            syncer_args=("--outer-lr", "1", "--outer-momentum", "0"),
        ),
        Variant("solo", "one learner alone, batch 16 (1/M of the tokens)", data_parallel=True, solo=True),
    )
}
DEFAULT_ONLY = "a,b,c,d,e,f,g,h"
SWEEP_KEY = re.compile(
    r"(?P<base>[cef])(?:-lr(?P<lr>\d+(?:\.\d+)?))?(?:-m(?P<mom>\d+(?:\.\d+)?))?(?:-g(?P<grace>\d+(?:\.\d+)?))?(?P<kl>-kl)?(?P<due>-due)?"
)


def variant_for(key: str) -> Variant | None:
    """The named row, or a sweep row parsed from its key (see the module docstring); None if neither."""
    if key in VARIANTS:
        return VARIANTS[key]
    match = SWEEP_KEY.fullmatch(key)
    if match is None:
        return None
    syncer_args: list[str] = []
    changes: list[str] = []
    if match["lr"] is not None:
        syncer_args += ["--outer-lr", match["lr"]]
        changes.append(f"--outer-lr {match['lr']}")
    if match["mom"] is not None:
        if not float(match["mom"]) < 1:
            return None
        syncer_args += ["--outer-momentum", match["mom"]]
        changes.append(f"--outer-momentum {match['mom']}")
    if match["grace"] is not None:
        syncer_args += ["--grace-factor", match["grace"]]
        changes.append(f"--grace-factor {match['grace']}")
    learner_args: tuple[str, ...] = ()
    if match["kl"]:
        learner_args += ("--apply", "keep-local")
        changes.append("--apply keep-local")
    if match["due"]:
        learner_args += ("--answer", "due")
        changes.append("--answer due")
    base = VARIANTS[match["base"]]
    label = f"{match['base']} with {' '.join(changes)}"
    return dataclasses.replace(
        base, key=key, label=label, syncer_args=tuple(syncer_args), learner_args=learner_args
    )


Say = Callable[[str], None]


@dataclass
class Daemon:
    """One `dilocod` child process; stderr (JSON log lines) is copied to a file and followed."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    #: The step it last reported (after a restart, the step it resumed from and on).
    step: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    follower: threading.Thread | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env
        )
        assert self.process.stderr is not None
        self.follower = threading.Thread(target=self._follow, args=(self.process.stderr,), daemon=True)
        self.follower.start()

    def _follow(self, stream: IO[bytes]) -> None:
        with self.log_path.open("ab") as copy:
            for raw in stream:
                copy.write(raw)
                with contextlib.suppress(ValueError):
                    record = json.loads(raw)
                    if isinstance(record, dict) and isinstance(record.get("step"), int):
                        with self.lock:
                            self.step = record["step"]

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def send_signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Send sig if it still runs, wait for it to exit (killed after STOP_TIMEOUT_S) and read
        its log to the end; its exit status."""
        if self.process is None:
            return None
        code = stop_process(self.process, sig, STOP_TIMEOUT_S)
        if self.follower is not None:
            self.follower.join(timeout=STOP_TIMEOUT_S)  # its last lines: the step it stopped at
        return code

    def wait(self) -> int | None:
        """stop() without a signal, for a process already told to stop (a second SIGTERM would end
        a learner that is saving its state) or already gone."""
        return self.stop(0)  # signal 0 delivers nothing

    def ready_line(self) -> dict[str, Any]:
        assert self.process is not None
        return read_ready_line(self.process, f"{self.name} (see {self.log_path})", READY_TIMEOUT_S)


def global_model_loss(syncer_state: Path, held_out: torch.Tensor) -> tuple[float, int]:
    """Eval loss of the syncer's newest checkpoint, and that checkpoint's sequence number."""
    loaded = load_latest_checkpoint(syncer_state)
    if loaded is None:
        raise RuntimeError(f"the syncer left no checkpoint in {syncer_state}")
    model = CharLM(CharLMConfig())
    result = model.load_state_dict(loaded.state.params, strict=False)
    # The checkpoint names the tied head once; only such a tied alias may be missing.
    named = {name for name, _ in model.named_parameters()}
    if result.unexpected_keys or named & set(result.missing_keys):
        raise RuntimeError(f"the checkpoint does not fit charlm's model: {result}")
    return evaluate(model, held_out=held_out), getattr(loaded, "sequence", -1)


def run_data_parallel(variant: Variant, steps: int, learners: int, held_out: torch.Tensor) -> dict[str, Any]:
    context = LearnerContext("data-parallel", "learner", "cpu", 0, 1, None, variant.data_seed)
    batch = BATCH if variant.solo else BATCH * learners
    trainer = build_trainer(context, None, TrainConfig(batch_size=batch, shards=1))
    tokens = 0
    losses: list[float] = []
    for index in range(steps):
        result = trainer.step(index)
        tokens += result.tokens
        losses.append(float(result.loss or 0.0))
    return {
        "eval_loss": evaluate(trainer.model, held_out=held_out),
        "tokens": tokens,
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
    }


def run_daemons(
    variant: Variant,
    steps: int,
    learners: int,
    held_out: torch.Tensor,
    work: Path,
    say: Say,
    budget: str = "fleet",
    link: Link | None = None,
) -> dict[str, Any]:
    """One row through the daemons: on loopback, or with `link` (--wan) the syncer in the link's
    server namespace and every learner in its client namespace, so all their traffic crosses it."""
    work.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    host = "127.0.0.1" if link is None else link.server_ip

    def inside(namespace: str, argv: list[str]) -> list[str]:
        return argv if link is None else link.exec_in(namespace, argv)

    python = [sys.executable, "-m", "dilocod"]
    syncer_args = [arg.replace("{M}", str(learners)) for arg in variant.syncer_args]
    syncer = Daemon(
        "syncer",
        inside(
            link.server if link else "",
            [
                *python,
                "syncer",
                "--listen",
                f"{host}:0",
                "--insecure",
                "--state-dir",
                str(work / "syncer"),
                "--checkpoint-every-s",
                "600",
                "--ready-json",
                *syncer_args,
            ],
        ),
        env,
        work / "syncer.log",
    )
    slow_env = dict(env)
    if variant.slow_learner:
        (work / "entry").mkdir()
        (work / "entry" / f"{SLOW_ENTRY_MODULE}.py").write_text(SLOW_ENTRY_SOURCE)
        slow_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work / "entry"), env.get("PYTHONPATH")]))
    daemons = [syncer]
    try:
        syncer.start()
        port = int(syncer.ready_line()["port"])
        fleet: list[Daemon] = []
        for m in range(learners):
            slow = variant.slow_learner and m == 0
            entry = ("--entry", f"{SLOW_ENTRY_MODULE}:make_trainer") if slow else ()
            save = ("--save-every-s", "5") if variant.kills and m == 0 else ()
            fleet.append(
                Daemon(
                    f"learner-{m}",
                    inside(
                        link.client if link else "",
                        [
                            *python,
                            "learner",
                            "--syncer",
                            f"{host}:{port}",
                            "--insecure",
                            "--id",
                            f"learner-{m}",
                            "--seed",
                            str(m),
                            "--device",
                            "cpu",
                            "--state-dir",
                            str(work / f"learner-{m}"),
                            "--steps",
                            # Under a fleet budget no learner can train more than all of it.
                            str(steps if budget == "learner" else steps * learners),
                            "--progress-every-s",
                            str(PROGRESS_EVERY_S),
                            *entry,
                            *save,
                            *variant.learner_args,
                        ],
                    ),
                    slow_env if slow else env,
                    work / f"learner-{m}.log",
                )
            )
        daemons += fleet
        started = time.monotonic()
        for learner in fleet:
            learner.start()
        kills_done = 0
        stopped_at_budget = False
        while any(learner.alive() for learner in fleet):
            if not syncer.alive():
                raise RuntimeError(f"the syncer exited; see {syncer.log_path}")
            if time.monotonic() - started > RUN_TIMEOUT_S:
                raise RuntimeError(f"{variant.key}: the learners did not finish in {RUN_TIMEOUT_S:.0f} s")
            victim = fleet[0]
            with victim.lock:
                victim_step = victim.step
            if kills_done < variant.kills and victim_step >= steps * (kills_done + 1) // (variant.kills + 1):
                say(f"  {variant.key}: kill -9 {victim.name} at step {victim_step}")
                victim.stop(signal.SIGKILL)
                time.sleep(2.0)  # the outage: the others train on meanwhile
                victim.start()
                kills_done += 1
            if budget == "fleet" and not stopped_at_budget and sum(d.step for d in fleet) >= steps * learners:
                stopped_at_budget = True
                for learner in fleet:  # all at once: no learner trains on alone
                    learner.send_signal(signal.SIGTERM)
                for learner in fleet:
                    learner.wait()
            # Pacing of this watcher only (it looks at the children), not a wait for an event.
            time.sleep(WATCH_EVERY_S)
        for learner in fleet:
            learner.wait()  # exited already: this reads its log to the end (the step it stopped at)
        codes = [learner.process.returncode for learner in fleet if learner.process is not None]
        wall_s = time.monotonic() - started
        egress = syncer_status(port, host, link.server if link else None)
        if syncer.stop() != 0:
            raise RuntimeError(f"the syncer did not stop cleanly; see {syncer.log_path}")
        loss, _ = global_model_loss(work / "syncer", held_out)
        trained = [d.step for d in fleet]
        return {
            "eval_loss": loss,
            "budget": budget,
            "tokens": sum(trained) * BATCH * CONTEXT,
            "tokens_over_budget": round(sum(trained) / (steps * learners) - 1, 5),
            "learner_steps": trained,
            "learner_exit_codes": codes,
            "learners_wall_s": round(wall_s, 1),
            "rounds_merged": count_rounds(syncer.log_path),
            "contributions": contributions(syncer.log_path),
            "rounds_abandoned": egress.get("rounds_abandoned"),
            "rounds_skipped": egress.get("rounds_skipped"),
            # Rounds due by the syncer's clock (H clock steps per fragment cycle of P rounds).
            "rounds_due": rounds_due(egress),
            "steps_per_s": round(sum(trained) / wall_s, 3),
            "heals_s": heal_times(syncer.log_path),
            # The syncer's update bytes (every send to every learner, heals included) per merged round.
            "syncer_bytes_out": egress["bytes_out"],
            "bytes_out_per_round": round(egress["bytes_out"] / max(1, egress["rounds_merged"])),
            "kills": kills_done,
        }
    finally:
        for daemon in reversed(daemons):
            if daemon.alive():
                with contextlib.suppress(Exception):
                    daemon.stop()


def syncer_status(port: int, host: str = "127.0.0.1", namespace: str | None = None) -> dict[str, Any]:
    """`dilocod status --json` of the syncer at host:port (asked from inside its namespace, if any)."""
    command = [
        sys.executable,
        "-m",
        "dilocod",
        "status",
        "--syncer",
        f"{host}:{port}",
        "--insecure",
        "--json",
    ]
    done = subprocess.run(
        command if namespace is None else ["ip", "netns", "exec", namespace, *command],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)


def rounds_due(status: dict[str, Any], sync_every: int = SYNC_EVERY) -> int | None:
    """Rounds the syncer's clock made due: P fragments every H clock steps (the rows here keep the
    syncer's default H)."""
    try:
        return int(status["clock"]) * len(status["fragments"]) // sync_every
    except (KeyError, TypeError, ValueError):
        return None


def heal_times(log_path: Path) -> list[float]:
    """Seconds of every heal the syncer logged (`learner healed`), in order."""
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == "learner healed":
                out.append(float(record["duration_s"]))
    return out


def count_rounds(log_path: Path) -> int | None:
    """Merged rounds, counted from the syncer's one log line per round."""
    count = 0
    with log_path.open("rb") as lines:
        for raw in lines:
            with contextlib.suppress(ValueError):
                record = json.loads(raw)
                if isinstance(record, dict) and "contributors" in record:
                    count += 1
    return count or None


def contributions(log_path: Path) -> dict[str, float]:
    """The pushes merged, from the syncer's `round merged` lines: fresh (answering the round they
    were merged in) and late (carried from an earlier round of their fragment), and per round."""
    fresh = late = rounds = 0
    with log_path.open("rb") as lines:
        for raw in lines:
            with contextlib.suppress(ValueError):
                record = json.loads(raw)
                if isinstance(record, dict) and record.get("event") == "round merged":
                    rounds += 1
                    for answered in record.get("push_rounds", ()):
                        fresh += answered == record["round"]
                        late += answered != record["round"]
    return {"fresh": fresh, "late": late, "per_round": round((fresh + late) / max(1, rounds), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=300, help="inner steps per learner (and of a)")
    parser.add_argument("--learners", type=int, default=4, help="M")
    parser.add_argument(
        "--only",
        default=DEFAULT_ONLY,
        help=f"comma-separated subset of {', '.join(VARIANTS)}, or sweep rows such as c-lr1-m0.5-kl"
        f" (default {DEFAULT_ONLY})",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file the results are merged into")
    parser.add_argument("--keep", type=Path, default=None, help="keep the daemons' logs and state here")
    parser.add_argument(
        "--budget",
        choices=BUDGETS,
        default="fleet",
        help="fleet: the learners together train M x --steps steps, then all stop at once (default); "
        "learner: each learner trains exactly --steps steps",
    )
    parser.add_argument(
        "--wan",
        default=None,
        metavar="RATE,RTT",
        help="run the daemon rows across an emulated link (root): the syncer in one network "
        "namespace, the learners in the other, e.g. 2gbit,100ms; rows are keyed KEY@RATE+RTT",
    )
    parser.add_argument(
        "--wan-emulator",
        default=None,
        metavar="PATH",
        help="the WAN emulator for kernels without netem (as `dilocod bench local --wan-emulator`)",
    )
    args = parser.parse_args(argv)
    wan: tuple[str, float] | None = None
    if args.wan is not None:
        try:
            rate_text, rtt_text = args.wan.split(",")
            wan = (parse_rate(rate_text), parse_rtt(rtt_text))
        except ValueError as exc:
            parser.error(f"--wan {args.wan!r}: {exc} (like 2gbit,100ms)")
    keys = [key.strip() for key in args.only.split(",") if key.strip()]
    unknown = [key for key in keys if variant_for(key) is None]
    if unknown:
        parser.error(f"unknown configurations {unknown}")
    if len(set(keys)) < len(keys):
        parser.error(f"--only names a row twice ({args.only}): for a second run of c, name c2")
    if args.steps < 1 or args.learners < 1:
        parser.error("--steps and --learners must be >= 1")

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    torch.set_num_threads(1)
    held_out = load_held_out()
    tokens = args.learners * args.steps * BATCH * CONTEXT
    say(f"convergence: M = {args.learners}, {args.steps} steps per learner, {tokens:,} tokens per run")
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        root = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dilocod-conv-")))
        for asked in keys:
            variant = variant_for(asked)
            key = asked
            assert variant is not None  # checked above
            started = time.monotonic()
            if variant.data_parallel:
                row = run_data_parallel(variant, args.steps, args.learners, held_out)
            elif wan is None:
                row = run_daemons(variant, args.steps, args.learners, held_out, root / key, say, args.budget)
            else:
                rate, rtt_ms = wan
                key = f"{key}@{rate}+{rtt_ms:g}ms"
                delay_by = choose_delay([rtt_ms], args.wan_emulator)
                with shaped_link(rate, 0, rtt_ms, delay_by) as link:
                    row = run_daemons(
                        variant, args.steps, args.learners, held_out, root / key, say, args.budget, link
                    )
                row.update(link={"rate": rate, "rtt_ms": rtt_ms, "delay_by": delay_by})
            row.update(label=variant.label, wall_s=round(time.monotonic() - started, 1))
            results[key] = row
            merged = row.get("contributions")
            pushes = f", pushes fresh {merged['fresh']} late {merged['late']}" if merged else ""
            say(
                f"  {key:<8} {variant.label:<52} eval loss {row['eval_loss']:.4f}  "
                f"({row['wall_s']:.0f} s{pushes})"
            )
    document: dict[str, Any] = {}
    if args.out.exists():
        document = json.loads(args.out.read_text())
    document.setdefault("runs", {}).update(results)
    document.update(
        learners=args.learners,
        steps=args.steps,
        tokens=tokens,
        model="charlm defaults (221,760 parameters, context 128)",
        batch_per_learner=BATCH,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    if args.json:
        print(json.dumps(results, indent=2))
    base = results.get("a", document["runs"].get("a"))
    if base is not None:
        for key, row in results.items():
            gap = 100 * (row["eval_loss"] / base["eval_loss"] - 1)
            say(f"  {key:<8} {row['eval_loss']:.4f}  {gap:+.1f} % against data-parallel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
