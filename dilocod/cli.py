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
from typing import TYPE_CHECKING, Any, NoReturn

import click

from dilocod import __version__
from dilocod.config import (
    DEFAULT_ENTRY,
    DEFAULT_PORT,
    EX_CONFIG,
    Address,
    ConfigError,
    LearnerConfig,
    SyncerConfig,
    defaults,
    flag_of,
    format_size,
    help_text,
    learner_seed,
    load_config,
    missing,
    parse_address,
    parse_int_list,
    parse_list,
    parse_size,
    require_authentication,
    settings,
    tls_paths,
)
from dilocod.wire.choices import AUTO, CODECS, DEFAULT_CHUNK_BYTES

if TYPE_CHECKING:
    import ssl

    from dilocod.linkbench.client import RunPlan
    from dilocod.syncer.checkpoint import ExportedCheckpoint


def _config_error(message: str) -> NoReturn:
    click.echo(f"dilocod: configuration error: {message}", err=True)
    sys.exit(EX_CONFIG)


def _parsed(parse: Callable[[], Any]) -> Any:
    try:
        return parse()
    except ConfigError as exc:
        _config_error(str(exc))


def _user_traceback(exc: BaseException) -> None:
    """After our one-paragraph message, the traceback of the user's own code that raised, if any."""
    if exc.__cause__ is not None:
        click.echo("", err=True)
        traceback.print_exception(exc.__cause__, file=sys.stderr)


def _credentials(
    secret_file: Path | None,
    insecure: bool,
    address: Address,
    *,
    listening: bool,
    tls: tuple[Path, Path, Path] | None = None,
    tls_flags: bool = True,
) -> tuple[bytes | None, ssl.SSLContext | None]:
    """The shared secret and the mutual-TLS context this command authenticates with. Beyond
    loopback one of them is required unless --insecure is given (exit 78 naming the fix)."""
    from dilocod.transport.credentials import (  # noqa: PLC0415
        CredentialError,
        TlsFiles,
        client_context,
        load_secret,
        server_context,
    )

    _parsed(
        lambda: require_authentication(
            address,
            listening=listening,
            secret=secret_file is not None,
            tls=tls is not None,
            insecure=insecure,
            tls_flags=tls_flags,
        )
    )
    try:
        secret = load_secret(secret_file) if secret_file is not None else None
        context = None
        if tls is not None:
            files = TlsFiles(*tls)
            context = server_context(files) if listening else client_context(files)
    except CredentialError as exc:
        _config_error(str(exc))
    return secret, context


secret_option = click.option(
    "--secret-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the shared secret (at least 16 bytes) for HMAC authentication.",
)
insecure_option = click.option(
    "--insecure", is_flag=True, help="Run without authentication (loopback and trusted networks only)."
)

TLS_FLAGS = (
    ("cert", "Mutual TLS: this end's certificate chain (PEM)."),
    ("key", "Mutual TLS: the private key of --tls-cert (PEM)."),
    ("ca", "Mutual TLS: the CA (PEM) that signs the peers' certificates."),
)


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
        _config_error(f"{flag_of(name)} is required (or set {name} in the --config file)")


def tls_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--tls-cert, --tls-key and --tls-ca: mutual TLS 1.3, all three or none."""
    for name, what in reversed(TLS_FLAGS):
        command = click.option(
            f"--tls-{name}", f"tls_{name}", type=click.Path(path_type=Path, dir_okay=False), help=what
        )(command)
    return command


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dilocod")
def main() -> None:
    """dilocod: Decoupled DiLoCo across data centres that never wait for each other.

    A CPU-only syncer holds the global model in fragments; learners train without blocking on the
    network and exchange one fragment at a time over a chunked, compressed, striped TCP protocol.
    """


@main.group()
def bench() -> None:
    """Measure what a link carries: raw TCP against dilocod fragment streams."""


@bench.command("loopback")
@click.option("--size", default="256MiB", show_default=True, help="Fragment size per transfer.")
@click.option("--streams", default="1,4", show_default=True, help="Data connection counts to try.")
@click.option("--codec", default="none,lz4,zstd", show_default=True, help="Codecs to try.")
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    type=click.IntRange(1, 20),
    help="Timed transfers per combination (the median is reported).",
)
@click.option("--chunk", default=format_size(DEFAULT_CHUNK_BYTES), show_default=True, help="Chunk size.")
@click.option(
    "--shuffle/--no-shuffle", default=True, show_default=True, help="Byte-plane shuffle before compressing."
)
@click.option("--json", "json_out", default=None, metavar="FILE|-", help="Write results as JSON.")
@click.option("--uvloop/--no-uvloop", default=True, show_default=True, help="Use uvloop if installed.")
def bench_loopback(
    size: str,
    streams: str,
    codec: str,
    repeats: int,
    chunk: str,
    shuffle: bool,
    json_out: str | None,
    uvloop: bool,
) -> None:
    """Two real processes on 127.0.0.1: the raw TCP ceiling, then dilocod fragment transfers for
    each codec and stream count, side by side in one run."""
    from dilocod.linkbench.loopback import LoopbackPlan, format_table, run_loopback  # noqa: PLC0415

    plan = LoopbackPlan(
        size_bytes=_parsed(lambda: parse_size(size, key="--size")),
        streams=tuple(_parsed(lambda: parse_int_list(streams, key="--streams", low=1, high=64))),
        codecs=tuple(_parsed(lambda: parse_list(codec, key="--codec", choices=CODECS))),
        repeats=repeats,
        chunk_bytes=_parsed(lambda: parse_size(chunk, key="--chunk")),
        shuffle=shuffle,
        use_uvloop=uvloop,
    )
    result = run_loopback(plan, progress=lambda line: click.echo(line, err=True))
    click.echo(format_table(result), err=json_out == "-")
    if json_out == "-":
        click.echo(json.dumps(result, indent=2))
    elif json_out:
        Path(json_out).write_text(json.dumps(result, indent=2) + "\n")


@bench.command("serve")
@click.option(
    "--listen", default=f"0.0.0.0:{DEFAULT_PORT}", show_default=True, help="HOST:PORT to accept on."
)
@secret_option
@insecure_option
@click.option("--ready-json", is_flag=True, help="Print one JSON line with the bound ports when ready.")
@click.option("--uvloop/--no-uvloop", default=True, show_default=True, help="Use uvloop if installed.")
@click.option(
    "--stall-timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    hidden=True,
    help="Cut off peers that stall mid-frame or in the handshake this fast (for tests).",
)
def bench_serve(
    listen: str,
    secret_file: Path | None,
    insecure: bool,
    ready_json: bool,
    uvloop: bool,
    stall_timeout_s: float | None,
) -> None:
    """The receiving end of `dilocod bench`: accepts fragments and raw TCP until interrupted."""
    from dilocod.linkbench.serve import serve  # noqa: PLC0415
    from dilocod.transport.loop import run  # noqa: PLC0415

    address = _parsed(lambda: parse_address(listen, key="--listen", default_port=DEFAULT_PORT))
    secret, _ = _credentials(secret_file, insecure, address, listening=True, tls_flags=False)

    def ready(info: dict[str, Any]) -> None:
        if ready_json:
            click.echo(json.dumps(info))
        else:
            click.echo(
                f"bench server on {info['host']}:{info['port']} (raw TCP on {info['raw_port']})", err=True
            )
        sys.stdout.flush()

    run(serve(address, secret=secret, ready=ready, stall_timeout_s=stall_timeout_s), use_uvloop=uvloop)


def _run_plan_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """What to measure on each link: shared by `bench run` and `bench local`."""
    options = [
        click.option("--size", default="256MiB", show_default=True, help="Fragment size per transfer."),
        click.option(
            "--streams",
            default="1,2,4,8",
            show_default=True,
            help="Data connection counts to try (1-64); auto is what `dilocod learner --streams auto` "
            "opens without advice at the RTT measured here.",
        ),
        click.option(
            "--codec",
            default="none,lz4,zstd,auto",
            show_default=True,
            help="Codecs to try; auto is the one the tuning model picks for this link and data.",
        ),
        click.option(
            "--duration",
            default="20s",
            show_default=True,
            help="Time budget for the timed transfers of one link (each combination runs at least once).",
        ),
        click.option(
            "--data",
            type=click.Choice(["bf16", "fp32", "random"]),
            default="bf16",
            show_default=True,
            help="Test data: outer-gradient-like bf16 or fp32 values, or incompressible bytes.",
        ),
        click.option(
            "--chunk", default=format_size(DEFAULT_CHUNK_BYTES), show_default=True, help="Chunk size."
        ),
        click.option(
            "--threads",
            type=click.IntRange(1, 256),
            default=None,
            help="Threads each end can spend compressing, for the auto codec's model  "
            "[default: this host's cores; bench local: half, as both ends share them].",
        ),
        click.option(
            "--congestion",
            type=click.Choice(["bbr", "cubic", "reno"]),
            default="bbr",
            show_default=True,
            help="TCP congestion control of the measuring side's sockets, raw and dilocod alike (the "
            "daemons use bbr where the kernel has it; setting another per socket may need root).",
        ),
        click.option(
            "--assumed-rtt",
            default="50ms",
            show_default=True,
            help="WAN round-trip time to check the TCP buffers against (RTT here is far smaller).",
        ),
        click.option("--json", "json_out", default=None, metavar="FILE|-", help="Write results as JSON."),
        click.option(
            "--plot", "plot_out", type=click.Path(path_type=Path), default=None, help="Write a PNG plot."
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _run_plan(
    size: str,
    streams: str,
    codec: str,
    duration: str,
    data: str,
    chunk: str,
    threads: int | None,
    congestion: str,
    assumed_rtt: str,
    vs: str,
) -> RunPlan:
    from dilocod.config import parse_duration  # noqa: PLC0415
    from dilocod.linkbench.client import AUTO_STREAMS, RunPlan  # noqa: PLC0415

    def stream_counts() -> tuple[int, ...]:
        items = parse_list(streams, key="--streams")
        return tuple(
            AUTO_STREAMS if item == AUTO else parse_int_list(item, key="--streams", low=1, high=64)[0]
            for item in items
        )

    return RunPlan(
        size_bytes=_parsed(lambda: parse_size(size, key="--size")),
        streams=_parsed(stream_counts),
        codecs=tuple(_parsed(lambda: parse_list(codec, key="--codec", choices=(*CODECS, AUTO)))),
        duration_s=_parsed(lambda: parse_duration(duration, key="--duration")),
        vs_gloo=vs == "gloo",
        chunk_bytes=_parsed(lambda: parse_size(chunk, key="--chunk")),
        data=data,
        assumed_rtt_s=_parsed(lambda: parse_duration(assumed_rtt, key="--assumed-rtt")),
        threads=threads,
        congestion=congestion,
    )


def _report(
    document: dict[str, Any], json_out: str | None, plot_out: Path | None, *, table: bool = True
) -> None:
    from dilocod.linkbench.report import format_table, plot  # noqa: PLC0415

    if table:
        click.echo(format_table(document), err=json_out == "-")
    if json_out == "-":
        click.echo(json.dumps(document, indent=2))
    elif json_out:
        Path(json_out).write_text(json.dumps(document, indent=2) + "\n")
    if plot_out is not None:
        skipped = plot(document, plot_out)
        click.echo(skipped or f"plot written to {plot_out}", err=True)


class _Bar:
    """A progress bar on stderr for `dilocod bench run` (plain lines when stderr is no terminal)."""

    def __init__(self, steps: int, label: str) -> None:
        self._bar = click.progressbar(
            length=steps, label=label, file=sys.stderr, item_show_func=lambda item: item, show_eta=False
        )
        self._bar.__enter__()

    def note(self, line: str) -> None:
        click.echo(f"\n{line}" if sys.stderr.isatty() else line, err=True)

    def advance(self, label: str) -> None:
        self._bar.update(1, label)
        if not sys.stderr.isatty():
            click.echo(label, err=True)

    def close(self) -> None:
        self._bar.__exit__(None, None, None)


@bench.command("run")
@click.option("--target", required=True, help="HOST:PORT of a `dilocod bench serve` at the other end.")
@secret_option
@insecure_option
@_run_plan_options
@click.option(
    "--vs",
    type=click.Choice(["gloo", "none"]),
    default="none",
    show_default=True,
    help="Also time a torch.distributed gloo broadcast of the same bytes over the same path.",
)
@click.option(
    "--save-advice/--no-save-advice",
    default=True,
    show_default=True,
    help="Save the recommendation where `dilocod learner --streams auto --codec auto` reads it.",
)
@click.option(
    "--advice-for",
    default="",
    metavar="HOST:PORT",
    help="The syncer address learners dial over this link, to save the advice for (a learner takes "
    "the advice saved for its exact --syncer, else the one saved for any syncer).  [default: any]",
)
@click.option("--uvloop/--no-uvloop", default=True, show_default=True, help="Use uvloop if installed.")
@click.option(
    "--table/--no-table", default=True, hidden=True, help="Print the table (bench local's child: no)."
)
def bench_run(
    target: str,
    secret_file: Path | None,
    insecure: bool,
    vs: str,
    save_advice: bool,
    advice_for: str,
    uvloop: bool,
    table: bool,
    json_out: str | None,
    plot_out: Path | None,
    **plan_flags: Any,
) -> None:
    """Measure a link to a `dilocod bench serve`: the raw TCP ceiling beside dilocod fragment pushes
    for every stream count and codec, the RTT, a push-then-update round trip, optionally gloo, the
    host's TCP settings against the bandwidth-delay product, and a recommendation for the learner."""
    from dilocod.linkbench.client import advice_from, figures_of, measure_link  # noqa: PLC0415
    from dilocod.transport.loop import run  # noqa: PLC0415
    from dilocod.tuning.advice import save_advice  # noqa: PLC0415

    address = _parsed(lambda: parse_address(target, key="--target", default_port=DEFAULT_PORT))
    for_syncer = (
        str(_parsed(lambda: parse_address(advice_for, key="--advice-for", default_port=DEFAULT_PORT)))
        if advice_for
        else ""
    )
    secret, _ = _credentials(secret_file, insecure, address, listening=False, tls_flags=False)
    plan = _run_plan(vs=vs, **plan_flags)
    bar = _Bar(plan.steps(), f"bench {address.host}:{address.port}")
    try:
        link = run(
            measure_link(address.host, address.port, plan, secret=secret, progress=bar), use_uvloop=uvloop
        )
    except (OSError, ConnectionError) as exc:
        bar.close()
        click.echo(f"dilocod bench run: cannot measure {target}: {exc}", err=True)
        sys.exit(1)
    bar.close()
    document = {"links": [{"rate": "as found", **link}]}
    _report(document, json_out, plot_out, table=table)
    if save_advice:
        path = save_advice(advice_from(link, figures_of(link), for_syncer))
        click.echo(f"recommendation saved to {path} for {for_syncer or 'any syncer'}", err=True)


@bench.command("local")
@click.option(
    "--rate",
    default="2gbit,5gbit",
    show_default=True,
    help="tc rates of the shaped links to build (e.g. 2gbit,5gbit), or loopback.",
)
@click.option(
    "--rtt",
    default="0ms",
    show_default=True,
    help="Round-trip times to add to every rate (e.g. 30ms,100ms): netem where the kernel has it, "
    "else the emulator of --wan-emulator.",
)
@click.option(
    "--wan-emulator",
    "wan_emulator",
    default=None,
    metavar="PATH",
    help="A WAN emulator for kernels without netem, called as `PATH up RATE RTT_MS` and `PATH down` "
    "(like wanem.sh)  [default: $DILOCOD_WAN_EMULATOR].",
)
@click.option(
    "--loss",
    "loss_pct",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0.0, 50.0),
    help="Random loss each way, in percent of packets (e.g. 0.1), made with the delay of --rtt.",
)
@click.option(
    "--sysctls",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    metavar="FILE",
    help="A sysctl.d file (like systemd/sysctl.d/60-dilocod-wan.conf) to apply inside each link's "
    "namespaces before measuring; keys that are not per namespace are reported, never set on the host.",
)
@_run_plan_options
@click.option(
    "--vs",
    type=click.Choice(["gloo", "none"]),
    default="gloo",
    show_default=True,
    help="Also time a torch.distributed gloo broadcast over each link.",
)
def bench_local(
    rate: str,
    rtt: str,
    wan_emulator: str | None,
    loss_pct: float,
    sysctls: Path | None,
    vs: str,
    json_out: str | None,
    plot_out: Path | None,
    **plan_flags: Any,
) -> None:
    """WAN links reproduced on this host (root needed): per rate (and round-trip time), two network
    namespaces joined by a veth pair shaped with tc tbf (netem with a delay, or an external
    emulator where the kernel has no netem), `bench serve` in one and `bench run` in the other.
    Everything it makes is removed at the end, also on Ctrl-C and on error."""
    from dilocod.linkbench.local import LocalBenchError, parse_rate, parse_rtt, run_local  # noqa: PLC0415

    try:
        rates = [parse_rate(r) for r in parse_list(rate, key="--rate")]
    except (ValueError, ConfigError) as exc:
        _config_error(f"--rate: {exc}")
    try:
        rtts = [parse_rtt(r) for r in parse_list(rtt, key="--rtt")]
    except (ValueError, ConfigError) as exc:
        _config_error(f"--rtt: {exc}")
    plan = _run_plan(vs=vs, **plan_flags)
    try:
        document = run_local(
            rates, plan, rtts=rtts, emulator=wan_emulator, sysctls=sysctls, loss_pct=loss_pct
        )
    except LocalBenchError as exc:
        click.echo(f"dilocod bench local: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("dilocod bench local: interrupted; everything it made is removed", err=True)
        sys.exit(130)
    _report(document, json_out, plot_out)


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

    address = _parsed(lambda: parse_address(target, key="--syncer", default_port=DEFAULT_PORT))
    tls = _parsed(lambda: tls_paths(tls_cert, tls_key, tls_ca))
    secret, context = _credentials(secret_file, insecure, address, listening=False, tls=tls)
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

    config = _parsed(lambda: load_config(SyncerConfig, config_file, flags))
    _required(config)
    tls = _parsed(lambda: tls_paths(config.tls_cert, config.tls_key, config.tls_ca))
    secret, context = _credentials(
        config.secret_file, config.insecure, config.listen, listening=True, tls=tls
    )
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

    config = _parsed(lambda: load_config(LearnerConfig, config_file, flags))
    _required(config)
    assert config.syncer is not None and config.id is not None
    tls = _parsed(lambda: tls_paths(config.tls_cert, config.tls_key, config.tls_ca))
    secret, context = _credentials(
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
    from dilocod.learner.netproc import NetworkProcessError  # noqa: PLC0415
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
