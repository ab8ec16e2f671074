"""Bar charts of the benchmarks' ``--json`` output: tierstore against each baseline of the same
run, one PNG per benchmark, and the headline ratios the charts print.

Every chart function takes the JSON document a benchmark wrote (``save_load.py``,
``staging.py``, ``pipeline.py``) and an output path, so a chart can be redrawn from saved JSON::

    .venv/bin/python benchmarks/charts.py DIR    # DIR/<name>.png from every DIR/<name>.json

Only matplotlib is needed (no torch): figures are drawn on the Agg canvas, without pyplot, so no
display is ever touched.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import textwrap
from dataclasses import dataclass
from typing import Callable

from matplotlib.figure import Figure

GB = 1e9

# tierstore in one colour, stock DCP in another, the "what the machine allows" limits in grey:
# the reader finds tierstore's bar and the kind of each baseline without reading the legend.
TIERSTORE = "#1f77b4"
TIERSTORE_LIGHT = "#8fbbd9"
STOCK = "#ff7f0e"
LIMIT = "#8c8c8c"
ROUND_DOT = "#222222"
TITLE_WIDTH = 115  # characters per title line at the figures' 10-inch width


# -- headline ratios -----------------------------------------------------------------------------
# Keys name the figure compared: "_gbps_" ratios are throughput (tierstore / baseline, above 1 =
# tierstore faster), "_s_" ratios are seconds (tierstore / baseline, below 1 = tierstore faster).

def save_load_ratios(doc: dict) -> dict[str, float]:
    """Headline ratios of a ``save_load.py`` JSON document: tierstore's save and load GB/s over
    the best stock writer's, the raw write's and the stock reader's."""
    save, load = doc["save"], doc["load"]
    ts = save["tierstore"]["gbps"]
    return {
        "save_gbps_vs_best_stock_writer": ts / save[doc["best_stock_writer"]]["gbps"],
        "save_gbps_vs_raw_write": ts / save["raw-write"]["gbps"],
        "load_gbps_vs_stock_reader": load["tierstore"]["gbps"] / load["dcp-fs-reader"]["gbps"],
    }


def staging_ratios(doc: dict) -> dict[str, float]:
    """Headline ratios of a ``staging.py`` JSON document: tierstore's median ``async_save`` stall
    over one plain copy's and over stock DCP's (seconds: below 1 is a shorter stall)."""
    f = doc["figures"]
    ts = f["tierstore"]["median_stall_s"]
    return {"stall_s_vs_copy": ts / f["copy"]["median_stall_s"],
            "stall_s_vs_stock": ts / f["stock"]["median_stall_s"]}


def pipeline_ratios(doc: dict) -> dict[str, float]:
    """Headline ratios of a ``pipeline.py`` JSON document: the 3-tier pipeline's save seconds
    over the memory tier's alone, and the tier-2 drain's GB/s over each raw copy's."""
    f = doc["figures"]
    drain = f["drain-t2"]["gbps"]
    return {"save_s_vs_memory_alone": f["pipeline"]["median_s"] / f["alone"]["median_s"],
            "drain_t2_gbps_vs_copy_seq": drain / f["copy-seq"]["gbps"],
            "drain_t2_gbps_vs_copy_par4": drain / f["copy-par4"]["gbps"]}


# -- drawing helpers -----------------------------------------------------------------------------

@dataclass
class Bar:
    """One horizontal bar: its label, median value, per-round values (drawn as dots), colour,
    and the text printed beside it (value, ratio)."""

    label: str
    value: float
    rounds: list[float]
    color: str
    text: str


def _new_figure(height: float) -> Figure:
    """A 10-inch-wide figure whose layout engine keeps labels and titles from overlapping."""
    return Figure(figsize=(10, height), dpi=110, layout="constrained")


def _title(fig: Figure, title: str, doc: dict, date: str, setup: str) -> None:
    """The title (benchmark), a line naming the machine, versions and date, and one with the
    run's set-up."""
    m = doc.get("machine", {})
    machine = (f"{m.get('cpus', '?')} CPUs, {m.get('platform', '?')}, "
               f"torch {m.get('torch', '?')}, tierstore {m.get('tierstore', '?')}, {date}")
    # Wrapped: a long platform string or set-up line would otherwise run off the image.
    lines = [title] + textwrap.wrap(machine, TITLE_WIDTH) + textwrap.wrap(setup, TITLE_WIDTH)
    fig.suptitle("\n".join(lines), fontsize=10.5, linespacing=1.5)


def _verdicts_footer(fig: Figure, doc: dict) -> None:
    """The benchmark's own acceptance targets and outcomes under the chart, so the ratios on
    the bars can be read against what they are meant to reach."""
    lines = []
    for v in doc.get("verdicts", []):
        outcome = "met" if v.get("pass") else "missed"
        lines.append(f"target {outcome}: {v['target']}: {v['ratio']:.2f}x")
    for v in doc.get("informational", []):
        lines.append(f"for information: {v['target']}: {v['ratio']:.2f}x")
    if lines:
        fig.supxlabel("\n".join(lines), fontsize=8.5, x=0.01, ha="left", linespacing=1.4,
                      color="#333333")


def _run_setup(doc: dict, extra: str) -> str:
    """The run's set-up line: state dict size, rounds and warm-up (what the bars and dots
    are), then ``extra`` (the benchmark's own settings)."""
    c = doc.get("config", {})
    return (f"{c.get('size_mib', '?')} MiB fp32 in {c.get('tensors', '?')} tensors; bars: median "
            f"of {_count(c.get('repeat', '?'), 'round')} after {c.get('warmup', '?')} warm-up, "
            f"dots: each round; {extra}")


def _count(n, noun: str) -> str:
    """'1 round', '3 rounds', '262,144 page faults'."""
    shown = f"{n:,}" if isinstance(n, int) else str(n)
    return f"{shown} {noun}" if n == 1 else f"{shown} {noun}s"


def _draw_bars(ax, bars: list[Bar], xlabel: str, title: str) -> None:
    """Horizontal bars, top to bottom in list order, each round as a dot on its bar, and the
    bars' texts in one column right of the plot, where no bar or dot can run into them."""
    ys = list(range(len(bars)))[::-1]
    ax.barh(ys, [b.value for b in bars], color=[b.color for b in bars], height=0.62,
            edgecolor="white")
    ax.set_yticks(ys, [b.label for b in bars], fontsize=9)
    right = max(max([b.value] + b.rounds) for b in bars) or 1.0
    # x in axes fractions, y in data: the column sits just outside the plot on each bar's row;
    # the layout engine counts these texts and narrows the plot to make room for them.
    column = ax.get_yaxis_transform()
    for y, b in zip(ys, bars):
        if b.rounds:
            ax.scatter(b.rounds, [y] * len(b.rounds), s=12, color=ROUND_DOT, zorder=3,
                       linewidths=0)
        ax.text(1.02, y, b.text, transform=column, va="center", ha="left", fontsize=8.5,
                clip_on=False)
    ax.set_xlim(0, right * 1.04)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _gbps_rounds(fig: dict, payload: float | None = None) -> list[float]:
    """A contender's per-round GB/s, of ``payload`` bytes or else of the figure's ``bytes``
    (the JSON keeps only the median of the bytes moved per round; they are the same every
    round, the checkpoint's size)."""
    moved = fig["bytes"] if payload is None else payload
    return [moved / s / GB for s in fig["seconds"]]


def _ratio_text(value: str, ratio: float, what: str = "tierstore") -> str:
    """'<value>' over '<what> ÷ this = <ratio>x', the ratio in bold (mathtext): two short lines
    leave the bars more of the figure's width than one long one."""
    return f"{value}\n{what} ÷ this = $\\mathbf{{{ratio:.2f}x}}$"


# -- the three charts ----------------------------------------------------------------------------

SAVE_LABELS = {
    "tierstore": "tierstore (local tier)",
    "dcp-fs-t1": "stock FileSystemWriter, 1 thread",
    "dcp-fs-t4": "stock FileSystemWriter, 4 threads",
    "torch.save": "torch.save + fsync",
    "raw-write": "raw os.write + fsync",
}
LOAD_LABELS = {"tierstore": "tierstore reader", "dcp-fs-reader": "stock FileSystemReader"}


def draw_save_load(doc: dict, out_path: str, date: str | None = None) -> str:
    """Chart of a ``save_load.py`` JSON document into ``out_path`` (PNG): save and load GB/s of
    every contender, each baseline's bar carrying tierstore's GB/s over its own. Returns
    ``out_path``."""
    date = date or _today()
    payload = doc["config"]["bytes"]
    best = doc["best_stock_writer"]

    def bars(figs: dict, labels: dict, stock: set[str]) -> list[Bar]:
        out = []
        ts = figs["tierstore"]["gbps"]
        for name, label in labels.items():
            f = figs[name]
            value = f"{f['gbps']:.2f} GB/s"
            if name == "tierstore":
                color, text = TIERSTORE, value
            else:
                color = STOCK if name in stock else LIMIT
                text = _ratio_text(value, ts / f["gbps"])
            if name == best:
                label += "\n(best stock writer)"
            out.append(Bar(label, f["gbps"], _gbps_rounds(f, payload), color, text))
        return out

    fig = _new_figure(7.2)
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [5, 2.4]})
    unit = ("GB/s of tensor payload (10⁹ bytes/s), higher is better\n"
            "ratios: tierstore's GB/s ÷ the bar's; above 1 = tierstore faster")
    _draw_bars(top, bars(doc["save"], SAVE_LABELS, {"dcp-fs-t1", "dcp-fs-t4"}), unit,
               "dcp.save until durable (fsync), fresh directory each")
    _draw_bars(bottom, bars(doc["load"], LOAD_LABELS, {"dcp-fs-reader"}), unit,
               "dcp.load from the page cache into preallocated tensors")
    c = doc["config"]
    _title(fig, "save_load: tierstore vs stock DCP, torch.save and a raw write", doc, date,
           _run_setup(doc, f"dir on {c.get('fs_type', '?')}"))
    _verdicts_footer(fig, doc)
    fig.savefig(out_path)
    return out_path


STAGING_LABELS = {
    "tierstore": "tierstore async_save\n(buffers reused)",
    "stock": "stock DCP async_save\n(fresh buffers)",
    "copy": "one plain copy_\n(the one-copy limit)",
}


def draw_staging(doc: dict, out_path: str, date: str | None = None) -> str:
    """Chart of a ``staging.py`` JSON document into ``out_path`` (PNG): the median stall of
    ``dcp.async_save`` (tierstore, stock DCP) and of one plain copy, in ms, with each round's
    stall, the page faults taken during it, and tierstore's stall over each baseline's.
    Returns ``out_path``."""
    date = date or _today()
    f = doc["figures"]
    ts = f["tierstore"]["median_stall_s"]
    colors = {"tierstore": TIERSTORE, "stock": STOCK, "copy": LIMIT}
    bars = []
    for name, label in STAGING_LABELS.items():
        s = f[name]
        # The fault count is printed because it, unlike the time, is free of noise: it tells a
        # save into fresh memory from one into reused buffers.
        value = (f"{s['median_stall_s'] * 1e3:.3g} ms, "
                 f"{_count(round(s['median_faults']), 'page fault')}")
        text = value if name == "tierstore" else _ratio_text(value, ts / s["median_stall_s"])
        bars.append(Bar(label, s["median_stall_s"] * 1e3, [x * 1e3 for x in s["stall_s"]],
                        colors[name], text))
    fig = _new_figure(4.8)
    ax = fig.subplots()
    _draw_bars(ax, bars,
               "stall in ms (until async_save returns), lower is better\n"
               "ratios: tierstore's stall ÷ the bar's; below 1 = tierstore stalls less",
               "how long dcp.async_save keeps training waiting")
    c = doc["config"]
    _title(fig, "staging: async_save stall of tierstore vs stock DCP vs one plain copy", doc,
           date, _run_setup(doc, f"executor {c.get('executor', '?')}, tierstore staging "
                                 f"'{c.get('tierstore_staging', '?')}', dir on "
                                 f"{c.get('fs_type', '?')}"))
    _verdicts_footer(fig, doc)
    fig.savefig(out_path)
    return out_path


PIPELINE_SAVE_LABELS = {"pipeline": "3-tier pipeline\nmemory → local → local",
                        "alone": "memory tier alone"}
PIPELINE_DRAIN_LABELS = {
    "drain-t2": "tierstore drain, tier 2\n(memory → local)",
    "drain-t3": "tierstore drain, tier 3\n(memory → local)",
    "drain-wall": "both drains, wall time\n(save return → wait(), 2x bytes)",
    "copy-seq": "raw copyfile + fsync,\nsequential",
    "copy-par4": "raw copyfile + fsync,\n4 threads",
}


def draw_pipeline(doc: dict, out_path: str, date: str | None = None) -> str:
    """Chart of a ``pipeline.py`` JSON document into ``out_path`` (PNG): the pipeline's save
    seconds against the memory tier's alone, and the drains' GB/s against raw file copies, each
    baseline's bar carrying the ratio it is judged by. Returns ``out_path``."""
    date = date or _today()
    f = doc["figures"]

    save_bars = []
    for name, label in PIPELINE_SAVE_LABELS.items():
        s = f[name]
        value = f"{s['median_s']:.3g} s"
        text = (value if name == "pipeline"
                else _ratio_text(value, f["pipeline"]["median_s"] / s["median_s"], "pipeline"))
        save_bars.append(Bar(label, s["median_s"], s["seconds"],
                             TIERSTORE if name == "pipeline" else LIMIT, text))

    drain_bars = []
    t2 = f["drain-t2"]["gbps"]
    colors = {"drain-t2": TIERSTORE, "drain-t3": TIERSTORE_LIGHT, "drain-wall": TIERSTORE_LIGHT,
              "copy-seq": LIMIT, "copy-par4": LIMIT}
    for name, label in PIPELINE_DRAIN_LABELS.items():
        s = f[name]
        # Both GB/s and seconds: the wall figure moves twice the bytes of the others, so only
        # GB/s compares across all bars, while seconds are what the drain costs.
        value = f"{s['gbps']:.2f} GB/s ({s['median_s']:.3g} s)"
        text = value if name.startswith("drain") else _ratio_text(value, t2 / s["gbps"],
                                                                  "tier-2 drain")
        drain_bars.append(Bar(label, s["gbps"], _gbps_rounds(s), colors[name], text))

    fig = _new_figure(8.0)
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [2.2, 5]})
    _draw_bars(top, save_bars,
               "seconds until dcp.save returns, lower is better\n"
               "ratio: the pipeline's seconds ÷ the bar's; below 1 = pipeline faster",
               "save: the pipeline's drain runs after dcp.save returns")
    _draw_bars(bottom, drain_bars,
               "GB/s of checkpoint files (10⁹ bytes/s), higher is better\n"
               "ratios: tier-2 drain's GB/s ÷ the bar's; above 1 = drain faster",
               "drain: memory tier → disk tiers, against raw copies of the same files")
    c = doc["config"]
    _title(fig, "pipeline: drain time of the tier pipeline vs raw file copies", doc, date,
           _run_setup(doc, f"memory tier on {c.get('shm_fs_type', '?')}, disk tiers on "
                           f"{c.get('fs_type', '?')}"))
    _verdicts_footer(fig, doc)
    fig.savefig(out_path)
    return out_path


# -- registry and redrawing ----------------------------------------------------------------------

#: benchmark name (its script's and JSON file's stem) -> (chart function, ratios function)
CHARTS: dict[str, tuple[Callable[..., str], Callable[[dict], dict[str, float]]]] = {
    "save_load": (draw_save_load, save_load_ratios),
    "staging": (draw_staging, staging_ratios),
    "pipeline": (draw_pipeline, pipeline_ratios),
}


def _today() -> str:
    """Today's date, ISO format."""
    return datetime.date.today().isoformat()


def _saved_date(out_dir: str, json_path: str) -> str:
    """The date of a saved run: summary.json's date when there is one, else the JSON file's
    modification date (the benchmarks' JSON carries no date of its own)."""
    try:
        with open(os.path.join(out_dir, "summary.json")) as f:
            return str(json.load(f)["date"])[:10]
    except (OSError, ValueError, KeyError):
        return datetime.date.fromtimestamp(os.path.getmtime(json_path)).isoformat()


def redraw(out_dir: str) -> list[str]:
    """Redraw ``out_dir/<name>.png`` from every ``out_dir/<name>.json`` of a known benchmark.
    Returns the paths written."""
    written = []
    for name, (draw, _ratios) in CHARTS.items():
        src = os.path.join(out_dir, f"{name}.json")
        if not os.path.exists(src):
            continue
        with open(src) as f:
            doc = json.load(f)
        written.append(draw(doc, os.path.join(out_dir, f"{name}.png"), _saved_date(out_dir, src)))
    return written


def main(argv: list[str] | None = None) -> int:
    """``charts.py DIR``: redraw every chart in DIR; exit 1 when there was nothing to draw."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: charts.py DIR   (redraws DIR/<name>.png from DIR/<name>.json for "
              f"{', '.join(CHARTS)})", file=sys.stderr)
        return 2
    written = redraw(argv[0])
    for path in written:
        print(path)
    if not written:
        print(f"no benchmark JSON ({', '.join(f'{n}.json' for n in CHARTS)}) in {argv[0]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
