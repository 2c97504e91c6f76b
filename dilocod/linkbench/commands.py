"""`dilocod bench`: its click commands (loopback, serve, run, local), which parse their options and
hand over to the measurements of this package. Heavy imports (torch for gloo, the measurements
themselves) happen inside the commands, so that `dilocod --help` stays fast.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dilocod.config import (
    DEFAULT_PORT,
    ConfigError,
    format_size,
    parse_address,
    parse_int_list,
    parse_list,
    parse_size,
)
from dilocod.ops.commandline import config_error, credentials, insecure_option, parsed, secret_option
from dilocod.wire.choices import AUTO, CODECS, DEFAULT_CHUNK_BYTES

if TYPE_CHECKING:
    from dilocod.linkbench.client import RunPlan


@click.group()
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
        size_bytes=parsed(lambda: parse_size(size, key="--size")),
        streams=tuple(parsed(lambda: parse_int_list(streams, key="--streams", low=1, high=64))),
        codecs=tuple(parsed(lambda: parse_list(codec, key="--codec", choices=CODECS))),
        repeats=repeats,
        chunk_bytes=parsed(lambda: parse_size(chunk, key="--chunk")),
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

    address = parsed(lambda: parse_address(listen, key="--listen", default_port=DEFAULT_PORT))
    secret, _ = credentials(secret_file, insecure, address, listening=True, tls_flags=False)

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
        size_bytes=parsed(lambda: parse_size(size, key="--size")),
        streams=parsed(stream_counts),
        codecs=tuple(parsed(lambda: parse_list(codec, key="--codec", choices=(*CODECS, AUTO)))),
        duration_s=parsed(lambda: parse_duration(duration, key="--duration")),
        vs_gloo=vs == "gloo",
        chunk_bytes=parsed(lambda: parse_size(chunk, key="--chunk")),
        data=data,
        assumed_rtt_s=parsed(lambda: parse_duration(assumed_rtt, key="--assumed-rtt")),
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

    address = parsed(lambda: parse_address(target, key="--target", default_port=DEFAULT_PORT))
    for_syncer = (
        str(parsed(lambda: parse_address(advice_for, key="--advice-for", default_port=DEFAULT_PORT)))
        if advice_for
        else ""
    )
    secret, _ = credentials(secret_file, insecure, address, listening=False, tls_flags=False)
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
        config_error(f"--rate: {exc}")
    try:
        rtts = [parse_rtt(r) for r in parse_list(rtt, key="--rtt")]
    except (ValueError, ConfigError) as exc:
        config_error(f"--rtt: {exc}")
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
