"""What `dilocod bench run` and `dilocod bench local` show and write: the table for a person, the
JSON document for machines (and the check that it has the documented shape), and the plot.

The JSON document: {"links": [link, ...]}, one link per measured path, each with at least
    rate (str: the tc rate, "loopback", or "as found" for a real link), raw_gbps (float),
    gloo_gbps (float | null), rtt_ms (float),
    runs: [{codec, streams, gbps, ratio_to_raw, compression_ratio}],
    recommendation: {streams, codec, chunk_bytes}
and more fields that say how it was measured (target, raw per stream count, round trip, codec
figures, TCP settings, warnings; each run's ratio_to_none when uncompressed was measured beside it;
from `bench local --rtt`, emulated_rtt_ms and delay_by: "netem" or the emulator's path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dilocod.wire.choices import AUTO, CODECS

_NUMBER = (int, float)
LINK_FIELDS: dict[str, tuple[type, ...]] = {
    "rate": (str,),
    "raw_gbps": _NUMBER,
    "gloo_gbps": (*_NUMBER, type(None)),
    "rtt_ms": _NUMBER,
    "runs": (list,),
    "recommendation": (dict,),
}
RUN_FIELDS: dict[str, tuple[type, ...]] = {
    "codec": (str,),
    "streams": (int,),
    "gbps": _NUMBER,
    "ratio_to_raw": _NUMBER,
    "compression_ratio": _NUMBER,
}
RECOMMENDATION_FIELDS: dict[str, tuple[type, ...]] = {
    "streams": (int,),
    "codec": (str,),
    "chunk_bytes": (int,),
}


def schema_errors(document: Any) -> list[str]:
    """Everything in document that breaks the documented shape (empty when it conforms)."""
    if not isinstance(document, dict) or not isinstance(document.get("links"), list):
        return ['the document must be an object with a "links" list']
    errors = []
    for i, link in enumerate(document["links"]):
        errors += _fields(link, LINK_FIELDS, f"links[{i}]")
        if not isinstance(link, dict):
            continue
        for j, run in enumerate(link.get("runs") or []):
            errors += _fields(run, RUN_FIELDS, f"links[{i}].runs[{j}]")
        if isinstance(link.get("recommendation"), dict):
            errors += _fields(link["recommendation"], RECOMMENDATION_FIELDS, f"links[{i}].recommendation")
    return errors


def _fields(value: Any, fields: dict[str, tuple[type, ...]], where: str) -> list[str]:
    if not isinstance(value, dict):
        return [f"{where} must be an object"]
    errors = []
    for key, types in fields.items():
        if key not in value:
            errors.append(f"{where}.{key} is missing")
        elif isinstance(value[key], bool) or not isinstance(value[key], types):
            errors.append(f"{where}.{key} has type {type(value[key]).__name__}")
    return errors


def link_name(link: dict[str, Any]) -> str:
    """The rate, the round trip `bench local --rtt` added to it (with what), if any, and the sysctl
    file applied in its namespaces (--sysctls), if any."""
    name = str(link["rate"])
    if "emulated_rtt_ms" in link:
        by = "netem" if link.get("delay_by") == "netem" else "emulator"
        name += f" + {link['emulated_rtt_ms']:g} ms RTT ({by})"
    if link.get("loss_pct"):
        name += f", {link['loss_pct']:g} % loss"
    if link.get("congestion", "bbr") != "bbr":
        name += f", {link['congestion']}"
    if "sysctls" in link:
        name += f" with {link['sysctls'].get('file') or 'sysctls'}"
    return name


def format_link(link: dict[str, Any]) -> str:
    gloo = "not measured" if link["gloo_gbps"] is None else f"{link['gloo_gbps']:.2f} Gbps"
    lines = [
        f"link {link_name(link)} ({link.get('target', '')}): raw TCP {link['raw_gbps']:.2f} Gbps, "
        f"gloo broadcast {gloo}, RTT {link['rtt_ms']:.3f} ms",
    ]
    if "round_trip_ms" in link:
        size = link.get("size_bytes", 0) / 2**20
        what = f"{size:.0f} MiB {link.get('data', '')}"
        lines.append(f"  round trip (push then update) of {what}: {link['round_trip_ms']:.0f} ms")
    lines.append(
        f"  {'streams':>7} {'codec':>10} {'Gbps':>7} {'x raw':>6} {'x none':>6} {'x gloo':>6}"
        f" {'compression':>11}"
    )
    for run in link["runs"]:
        codec = run["codec"] if run["codec"] != AUTO else f"auto:{run.get('chosen', '?')}"
        vs_gloo = f"{run['gbps'] / link['gloo_gbps']:6.2f}" if link["gloo_gbps"] else f"{'-':>6}"
        vs_none = f"{run['ratio_to_none']:6.2f}" if "ratio_to_none" in run else f"{'-':>6}"
        count = f"auto:{run['streams']}" if run.get("streams_auto") else str(run["streams"])
        lines.append(
            f"  {count:>7} {codec:>10} {run['gbps']:>7.2f} {run['ratio_to_raw']:>6.2f} {vs_none} "
            f"{vs_gloo} {run['compression_ratio']:>10.3f}x"
        )
    rec = link["recommendation"]
    chunk = f"{rec['chunk_bytes'] / 2**20:g} MiB"
    why = f" ({rec['why']})" if rec.get("why") else ""
    streams = f"{rec['streams']} stream" + ("s" if rec["streams"] != 1 else "")
    lines.append(f"  recommendation: {streams}, codec {rec['codec']}, chunks of {chunk}{why}")
    lines += [f"  warning: {w}" for w in link.get("warnings", [])]
    return "\n".join(lines)


def format_table(document: dict[str, Any]) -> str:
    return "\n\n".join(format_link(link) for link in document["links"])


def plot(document: dict[str, Any], path: Path) -> str | None:
    """Throughput by streams and codec, one panel per link, with the raw and gloo figures as lines.
    None when written; otherwise why not (matplotlib is an optional extra)."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'dilocod[plot]')"
    links = document["links"]
    figure, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        codecs = sorted({r["codec"] for r in link["runs"]}, key=[*CODECS, AUTO].index)
        streams = sorted({r["streams"] for r in link["runs"]})
        width = 0.8 / len(codecs)
        for k, codec in enumerate(codecs):
            by = {r["streams"]: r["gbps"] for r in link["runs"] if r["codec"] == codec}
            ax.bar(
                [i + k * width for i in range(len(streams))],
                [by.get(s, 0) for s in streams],
                width,
                label=codec,
            )
        ax.axhline(link["raw_gbps"], color="black", linestyle="--", linewidth=1, label="raw TCP")
        if link["gloo_gbps"]:
            ax.axhline(link["gloo_gbps"], color="grey", linestyle=":", linewidth=1, label="gloo")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(streams))], [str(s) for s in streams])
        ax.set_xlabel("data connections")
        ax.set_ylabel("Gbit/s of fragment data")
        ax.set_title(f"link {link_name(link)}")
        ax.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None


def main(argv: list[str] | None = None) -> int:
    """`python -m dilocod.linkbench.report LINKS.json OUT.png`: the plot of a saved run, on any
    machine that has matplotlib (the measuring hosts need not)."""
    import json  # noqa: PLC0415
    import sys  # noqa: PLC0415

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m dilocod.linkbench.report LINKS.json OUT.png", file=sys.stderr)
        return 2
    document = json.loads(Path(args[0]).read_text())
    errors = schema_errors(document)
    if errors:
        print(f"{args[0]}: not a dilocod bench document: {'; '.join(errors)}", file=sys.stderr)
        return 1
    skipped = plot(document, Path(args[1]))
    print(skipped or f"plot written to {args[1]}", file=sys.stderr)
    return 1 if skipped else 0


if __name__ == "__main__":
    raise SystemExit(main())
