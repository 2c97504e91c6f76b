"""The `dilocod` command line: thin click commands that parse options, build configuration and
hand over to the services. Imports of torch and of the daemons happen inside the commands that
need them, so `dilocod --help` and `dilocod status` answer fast.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dilocod import __version__
from dilocod.config import (
    DEFAULT_ENTRY,
    DEFAULT_PORT,
    EX_CONFIG,
    LearnerConfig,
    SyncerConfig,
    defaults,
    flag_of,
    help_text,
    learner_seed,
    load_config,
    missing,
    parse_address,
    settings,
    tls_paths,
)
from dilocod.linkbench.commands import bench
from dilocod.ops.commandline import (
    config_error,
    credentials,
    insecure_option,
    parsed,
    secret_option,
    tls_options,
)
from dilocod.wire.choices import AUTO

if TYPE_CHECKING:
    from dilocod.syncer.checkpoint import ExportedCheckpoint


def _user_traceback(exc: BaseException) -> None:
    """After our one-paragraph message, the traceback of the user's own code that raised, if any."""
    if exc.__cause__ is not None:
        click.echo("", err=True)
        traceback.print_exception(exc.__cause__, file=sys.stderr)


def config_options(cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """One option per setting of a daemon's configuration (dilocod.config.daemons), in the order
    declared there, with its help and default. Each defaults to None (not given), so that the TOML
    file's value, else the declared default, shows through."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        declared = defaults(cls)
        for name in reversed(list(settings(cls))):
            boolean = isinstance(declared[name], bool)
            command = click.option(
                flag_of(name), name, is_flag=boolean, default=None, help=help_text(cls, name)
            )(command)
        return command

    return decorate


def _required(config: Any) -> None:
    for name in missing(config):
        config_error(f"{flag_of(name)} is required (or set {name} in the --config file)")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dilocod")
def main() -> None:
    """dilocod: Decoupled DiLoCo across data centres that never wait for each other.

    A CPU-only syncer holds the global model in fragments; learners train without blocking on the
    network and exchange one fragment at a time over a chunked, compressed, striped TCP protocol.
    """


@main.command()
@click.option("--syncer", "target", required=True, help="HOST:PORT of the daemon to ask.")
@secret_option
@insecure_option
@tls_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
@click.option("--timeout", "timeout_s", default=10.0, show_default=True, help="Seconds to wait.")
def status(
    target: str,
    secret_file: Path | None,
    insecure: bool,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_ca: Path | None,
    as_json: bool,
    timeout_s: float,
) -> None:
    """Ask a running daemon for its status."""
    from dilocod.ops.status import describe_failure, fetch_status, format_status  # noqa: PLC0415
    from dilocod.transport.loop import run  # noqa: PLC0415

    address = parsed(lambda: parse_address(target, key="--syncer", default_port=DEFAULT_PORT))
    tls = parsed(lambda: tls_paths(tls_cert, tls_key, tls_ca))
    secret, context = credentials(secret_file, insecure, address, listening=False, tls=tls)
    try:
        result = run(fetch_status(address, secret=secret, ssl=context, timeout_s=timeout_s))
    except (OSError, ConnectionError, TimeoutError) as exc:
        click.echo(f"dilocod status: {describe_failure(address, exc, tls=context is not None)}", err=True)
        sys.exit(1)
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else format_status(result))


@main.command()
@click.option(
    "--config", "config_file", type=click.Path(path_type=Path, dir_okay=False), help="TOML file; flags win."
)
@config_options(SyncerConfig)
@click.option("--ready-json", is_flag=True, help="Print one JSON line on stdout once listening.")
@click.option("--uvloop/--no-uvloop", default=True, show_default=True, help="Use uvloop if installed.")
def syncer(config_file: Path | None, ready_json: bool, uvloop: bool, **flags: Any) -> None:
    """The CPU daemon that holds the global model and merges fragments asynchronously.

    Builds the model from --entry (or resumes the newest checkpoint in --state-dir), listens for
    learners, asks them for one fragment's outer gradient per round, merges what arrives (quorum,
    adaptive grace, token-weighted RDA, outer Nesterov) and streams the result back. Every flag is
    also a key of the --config TOML file (sync-every = 24); flags win. SIGTERM checkpoints and exits.
    """
    from dilocod.ops.logging import configure_logging  # noqa: PLC0415

    config = parsed(lambda: load_config(SyncerConfig, config_file, flags))
    _required(config)
    tls = parsed(lambda: tls_paths(config.tls_cert, config.tls_key, config.tls_ca))
    secret, context = credentials(config.secret_file, config.insecure, config.listen, listening=True, tls=tls)
    configure_logging()
    from dilocod.ops.notify import Notifier  # noqa: PLC0415
    from dilocod.syncer.daemon import SetupError, run_syncer  # noqa: PLC0415

    def ready(info: dict[str, Any]) -> None:
        if ready_json:
            click.echo(json.dumps(info))
            sys.stdout.flush()

    from dilocod.ops.statedir import EX_STATE_NOT_SAVED, StateNotSaved  # noqa: PLC0415

    try:
        notifier = Notifier.from_environment(os.environ)
        run_syncer(config, secret, tls=context, ready=ready, use_uvloop=uvloop, notifier=notifier)
    except SetupError as exc:
        click.echo(f"dilocod syncer: {exc}", err=True)
        _user_traceback(exc)
        sys.exit(EX_CONFIG)
    except StateNotSaved as exc:
        click.echo(f"dilocod syncer: {exc}", err=True)
        sys.exit(EX_STATE_NOT_SAVED)


@main.command()
@click.option(
    "--state-dir", required=True, type=click.Path(path_type=Path, file_okay=False), help="The syncer's."
)
@click.option(
    "--out", required=True, type=click.Path(path_type=Path, dir_okay=False), help="safetensors file."
)
def export(state_dir: Path, out: Path) -> None:
    """Write the global model of the newest checkpoint as one safetensors file keyed by parameter
    name (float32), loadable with safetensors.torch.load_file and model.load_state_dict. Creates
    the folder of --out if missing, and says which checkpoint it wrote."""
    from dilocod.syncer.checkpoint import CheckpointError, export_newest  # noqa: PLC0415

    try:
        exported = export_newest(state_dir, out)
    except CheckpointError as exc:
        click.echo(f"dilocod export: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:
        click.echo(f"dilocod export: cannot write {out}: {exc.strerror or exc}", err=True)
        sys.exit(1)
    click.echo(_exported_line(exported), err=True)


def _exported_line(exported: ExportedCheckpoint) -> str:
    """'wrote OUT from checkpoint 42 (saved ..., N min ago), fragment versions 3..10 (sum 120)'."""
    import datetime  # noqa: PLC0415
    import time  # noqa: PLC0415

    saved = datetime.datetime.fromtimestamp(exported.saved_at_unix_s).astimezone()
    age_min = max(0.0, time.time() - exported.saved_at_unix_s) / 60
    versions = exported.versions
    span = f"{min(versions)}..{max(versions)} (sum {sum(versions)})" if versions else "none"
    return (
        f"wrote {exported.path} from checkpoint {exported.sequence} "
        f"(saved {saved.isoformat(sep=' ', timespec='seconds')}, {age_min:.0f} min ago), "
        f"fragment versions {span}"
    )


@main.command()
@click.option(
    "--config", "config_file", type=click.Path(path_type=Path, dir_okay=False), help="TOML file; flags win."
)
@config_options(LearnerConfig)
@click.option("--uvloop/--no-uvloop", default=True, show_default=True, help="Use uvloop if installed.")
def learner(config_file: Path | None, uvloop: bool, **flags: Any) -> None:
    """Train with your own step function and sync with the syncer without ever waiting on it.

    Loads --entry and checks it before connecting anywhere. The training loop runs on the main
    thread; the network in a child process (or, with --network thread, on a thread). At step
    boundaries it copies requested fragments out (their outer gradients are computed off the
    training thread) and applies merged fragments as they arrive. Reconnects with backoff and
    heals from the syncer after any restart. Every flag is also a key of the --config TOML file;
    flags win. SIGTERM saves the local state and exits.
    """
    from dilocod.ops.logging import configure_logging  # noqa: PLC0415

    config = parsed(lambda: load_config(LearnerConfig, config_file, flags))
    _required(config)
    assert config.syncer is not None and config.id is not None
    tls = parsed(lambda: tls_paths(config.tls_cert, config.tls_key, config.tls_ca))
    secret, context = credentials(
        config.secret_file, config.insecure, config.syncer, listening=False, tls=tls
    )
    configure_logging()
    advice = None
    if AUTO in (config.streams, config.codec):
        from dilocod.tuning.advice import load_advice  # noqa: PLC0415

        advice = load_advice(str(config.syncer))  # None (a warning if unusable): the learner measures
    import torch  # noqa: PLC0415 - after the cheap checks, so typos fail fast

    from dilocod.learner.daemon import LearnerSetup, LearnerSetupError, run_learner  # noqa: PLC0415
    from dilocod.learner.island import IslandConfig  # noqa: PLC0415
    from dilocod.learner.link import LinkConfig  # noqa: PLC0415
    from dilocod.learner.runtime import RuntimeConfig  # noqa: PLC0415
    from dilocod.learner.threads import HostCpus  # noqa: PLC0415

    device = config.device if config.device != AUTO else ("cuda" if torch.cuda.is_available() else "cpu")
    # Under torchrun every rank runs this command; rank 0 alone talks to the syncer.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    island = None
    if world_size > 1:
        island = IslandConfig(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))
    setup = LearnerSetup(
        runtime=RuntimeConfig.of(config),
        link=LinkConfig.of(config, secret=secret, tls=context, tls_files=tls, advice=advice),
        device=device,
        seed=config.seed if config.seed is not None else learner_seed(config.id),
        use_uvloop=uvloop,
        island=island,
        network=config.network,
        # For torch's intra-op threads (an explicit OMP_NUM_THREADS is kept).
        cpus=HostCpus(
            len(os.sched_getaffinity(0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            os.environ.get("OMP_NUM_THREADS"),
        ),
    )
    from dilocod.learner.channel import NetworkProcessError  # noqa: PLC0415
    from dilocod.model.entry import StepFailed  # noqa: PLC0415
    from dilocod.ops.notify import Notifier  # noqa: PLC0415
    from dilocod.ops.statedir import EX_STATE_NOT_SAVED, StateNotSaved  # noqa: PLC0415

    try:
        run_learner(setup, Notifier.from_environment(os.environ))
    except StateNotSaved as exc:
        click.echo(f"dilocod learner: {exc}", err=True)
        sys.exit(EX_STATE_NOT_SAVED)
    except LearnerSetupError as exc:
        click.echo(f"dilocod learner: {exc}", err=True)
        _user_traceback(exc)
        sys.exit(EX_CONFIG)
    except StepFailed as exc:
        # The user's code raised: their own frames, not ours, and a restart may get past it.
        click.echo(f"dilocod learner: {exc}", err=True)
        _user_traceback(exc)
        sys.exit(1)
    except NetworkProcessError as exc:
        # Not a configuration error: a restart (systemd's Restart=on-failure) heals from the syncer.
        click.echo(f"dilocod learner: {exc}; the local state is saved", err=True)
        sys.exit(1)


@main.command()
@click.option(
    "--learners", default=4, show_default=True, type=click.IntRange(1, 32), help="Learner processes."
)
@click.option(
    "--minutes",
    default=3.0,
    show_default=True,
    type=click.FloatRange(0.1, 600),
    help="Minutes of training, counted from the first merged round.",
)
@click.option("--chaos", is_flag=True, help="Kill -9 a random learner about every 30 s and restart it.")
@click.option(
    "--plot", type=click.Path(path_type=Path, dir_okay=False), help="Write a loss-versus-tokens plot (PNG)."
)
@click.option(
    "--state-dir", type=click.Path(path_type=Path, file_okay=False), help="Keep logs and state here."
)
@click.option(
    "--entry", default=DEFAULT_ENTRY, show_default=True, help="The model (its module needs evaluate(model))."
)
@click.option("--chaos-every-s", default=30.0, type=click.FloatRange(1, 3600), hidden=True)
def demo(
    learners: int,
    minutes: float,
    chaos: bool,
    plot: Path | None,
    state_dir: Path | None,
    entry: str,
    chaos_every_s: float,
) -> None:
    """A syncer and N learners on loopback training the embedded byte-level language model on the
    Python standard library, with live progress; prints the global model's eval loss at the end."""
    from dilocod.demo import DemoPlan, run_demo  # noqa: PLC0415

    plan = DemoPlan(
        learners=learners,
        minutes=minutes,
        chaos=chaos,
        plot=plot,
        state_dir=state_dir,
        entry=entry,
        chaos_every_s=chaos_every_s,
    )
    try:
        run_demo(plan, say=click.echo)
    except RuntimeError as exc:
        click.echo(f"dilocod demo: {exc}", err=True)
        sys.exit(1)


main.add_command(bench)
