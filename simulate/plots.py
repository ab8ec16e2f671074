"""The simulator's two charts, drawn from :class:`~tierstore_simulate.goodput.ContenderReport`\\ s:

- :func:`draw_timeline`: training progress (step reached) over wall time, one line per
  contender, with each failure marked and each restore shaded;
- :func:`draw_goodput`: one stacked bar per contender, its wall time split into productive time
  and the parts of its badput, with its goodput percentage.

matplotlib is imported inside the functions, so importing this module costs nothing where no
chart is drawn. Figures are built on :class:`matplotlib.figure.Figure` directly, without pyplot:
``savefig`` then renders on the Agg canvas, so no display is touched, no global backend is
switched under the caller, and no figure is left registered in pyplot to close.
"""

from __future__ import annotations

from pathlib import Path

from .goodput import ContenderReport

__all__ = ["draw_all", "draw_goodput", "draw_timeline"]

# Fixed colours per part, so the same part reads the same in every chart: productive in green,
# the badput parts in colours that stay apart from it and from one another.
PARTS = (
    ("productive", "#2ca02c"),
    ("checkpoint stall", "#ff7f0e"),
    ("restart", "#d62728"),
    ("restore", "#9467bd"),
    ("lost progress", "#8c564b"),
    ("other", "#b0b0b0"),
)
# One colour per contender in the timeline: matplotlib's default cycle without green and red,
# which a reader would take for "good" and "bad" rather than for a contender.
CONTENDER_COLOURS = ("#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                     "#bcbd22")


def _check(contenders: list[ContenderReport]) -> None:
    """An empty list is a caller's mistake, said plainly rather than drawn as blank charts."""
    if not contenders:
        raise ValueError("no contenders to draw: pass at least one ContenderReport")


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    # The constrained layout keeps the title, labels and an outside legend from overlapping.
    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def draw_timeline(contenders: list[ContenderReport], path: str | Path) -> None:
    """Draw training progress over wall time to the PNG at ``path``: per contender, the step
    reached (y) against seconds since its first run began (x), each run its own solid segment.
    A failure is an ``x`` at the run's last finished step under a dotted vertical line topped by
    its kind; from there a dotted line drops to the step the next run resumed from and waits
    at it through the restart and restore; each restore (a later run's begin to its first
    step's start) is shaded; an object-store outage is a thick band along the line from the
    step it struck, as long as the store was down. ValueError where ``contenders`` is empty."""
    _check(contenders)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig = _figure(11, 5.5)
    ax = fig.add_subplot()
    # The highest step of any contender (at least 1, so the y range is never empty).
    top = max((s for c in contenders for _, steps in c.timeline for s, _, _ in steps),
              default=0) or 1
    kinds = []  # the failure labels, spread apart once the x range is known
    shaded = outages = False
    for n, c in enumerate(contenders):
        colour = CONTENDER_COLOURS[n % len(CONTENDER_COLOURS)]
        # An empty line still gives a contender without any run its legend entry.
        ax.plot([], [], color=colour, lw=2, label=c.name)
        if not c.timeline:
            continue
        t0 = c.timeline[0][0]
        prev = None  # (x, step) where the previous run stopped
        for i, (begins, steps) in enumerate(c.timeline):
            x_begin = begins - t0
            resumed = steps[0][0] - 1 if steps else (prev[1] if prev else 0)
            if prev is not None:
                # The progress is lost at the failure: drop there, then wait at the resumed
                # step through restart and restore (dotted: no training happens there).
                x_first = steps[0][1] - t0 if steps else x_begin
                ax.plot([prev[0], prev[0], x_first], [prev[1], resumed, resumed],
                        color=colour, lw=1, ls=":")
                if steps:
                    # From the new process's start to its first step: start-up and restore
                    # (the first run's start-up follows no failure, so it is not shaded).
                    ax.axvspan(x_begin, x_first, color=colour, alpha=0.15, lw=0)
                    shaded = True
            if steps:
                xs = [steps[0][1] - t0] + [end - t0 for _, _, end in steps]
                ax.plot(xs, [resumed] + [s for s, _, _ in steps], color=colour, lw=2)
                prev = (xs[-1], steps[-1][0])
            else:
                prev = (x_begin, resumed)  # a run that died before its first step
            if i < len(c.failures):
                kinds.append(_mark_failure(ax, prev, c.failures[i].kind, colour, top))
        for outage in c.outages:
            # Where the line passed the outage's step, a thick band as long as the store was
            # down: the job went on (or not) through it.
            at = next((end for _, steps in c.timeline for s, _, end in steps
                       if s == outage["at_step"]), None)
            if at is not None:
                ax.plot([at - t0, at - t0 + outage["duration_s"]], [outage["at_step"]] * 2,
                        color=colour, lw=7, alpha=0.35, solid_capstyle="butt")
                outages = True
    ax.set_ylim(0, top * 1.25)  # a band above the highest line for the failure labels
    ax.set_xlim(left=0)
    _spread(kinds, ax.get_xlim())
    ax.set_xlabel("wall time since the contender's first run began (s)")
    ax.set_ylabel("training step reached")
    ax.set_title("Training progress under failures")
    ax.grid(alpha=0.3)
    # What the marks drawn mean, in grey, after the contenders; outside the plot so no line is
    # hidden.
    handles, labels = ax.get_legend_handles_labels()
    if kinds:
        handles.append(Line2D([], [], color="grey", marker="x", ls=":", lw=1))
        labels.append("failure (kind), drop to resumed step")
    if shaded:
        handles.append(Patch(color="grey", alpha=0.25, lw=0))
        labels.append("restarted job starting up and restoring (shaded)")
    if outages:
        handles.append(Line2D([], [], color="grey", lw=7, alpha=0.35, solid_capstyle="butt"))
        labels.append("object store down (outage), from the step it struck")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.savefig(path)


def _mark_failure(ax, at: tuple[float, float], kind: str, colour: str, top: float):
    """One failure: an ``x`` where the run stopped, a dotted line up to its kind's label (the
    label's Text is returned)."""
    x, step = at
    ax.plot([x], [step], marker="x", ms=8, mew=2, color=colour)
    ax.plot([x, x], [step, top * 1.03], color=colour, lw=0.8, ls=":", alpha=0.7)
    # Labels stand vertically in the band above the highest line: they cannot cover any
    # progress, and two failures close in time do not run into one another.
    return ax.text(x, top * 1.04, kind, rotation=90, ha="center", va="bottom", fontsize=8,
                   color=colour)


def _spread(labels: list, xlim: tuple[float, float]) -> None:
    """Two failure labels closer than a label's width (of contenders failing at about the same
    time) would touch: the earlier is moved to the left of its line, the later to the right."""
    near = (xlim[1] - xlim[0]) * 0.02
    ordered = sorted(labels, key=lambda t: t.get_position()[0])
    for a, b in zip(ordered, ordered[1:]):
        if b.get_position()[0] - a.get_position()[0] < near:
            a.set_horizontalalignment("right")
            b.set_horizontalalignment("left")


def draw_goodput(contenders: list[ContenderReport], path: str | Path) -> None:
    """Draw to the PNG at ``path`` one horizontal stacked bar per contender (first on top): its
    wall time split into productive time and each badput part (checkpoint stall, restart,
    restore, lost progress, other) in seconds, wide parts labelled with their seconds, and its
    goodput percentage after the bar. ValueError where ``contenders`` is empty."""
    _check(contenders)
    fig = _figure(11, 1.6 + 0.7 * len(contenders))
    ax = fig.add_subplot()
    widest = max(c.wall_s for c in contenders) or 1.0
    rows = range(len(contenders))
    left = [0.0] * len(contenders)
    for part, colour in PARTS:
        widths = [_part_s(c, part) for c in contenders]
        ax.barh(rows, widths, left=left, color=colour, label=part, height=0.6,
                edgecolor="white", linewidth=0.5)
        for row, (x, w) in enumerate(zip(left, widths)):
            # Seconds only inside parts wide enough to hold them; the rest read off the axis.
            if w >= widest * 0.06:
                ax.text(x + w / 2, row, f"{w:.1f} s", ha="center", va="center", fontsize=8,
                        color="white" if part != "other" else "black")
        left = [x + w for x, w in zip(left, widths)]
    for row, c in enumerate(contenders):
        ax.text(left[row] + widest * 0.01, row, f"{c.goodput * 100:.1f}% goodput",
                va="center", fontsize=10, fontweight="bold")
    ax.set_yticks(list(rows), [c.name for c in contenders])
    ax.invert_yaxis()  # first contender on top, in the order given
    ax.set_xlim(0, widest * 1.2)  # room for the goodput text after the longest bar
    ax.set_xlabel("wall time (s)")
    ax.set_title("Where each contender's wall time went")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    # Below the axes, in one row, with the layout making room for it: never over a bar.
    fig.legend(loc="outside lower center", ncol=len(PARTS), frameon=False)
    fig.savefig(path)


def _part_s(c: ContenderReport, part: str) -> float:
    """Seconds of one of :data:`PARTS` in a contender's report."""
    if part == "productive":
        return c.productive_s
    return getattr(c.badput, part.replace(" ", "_") + "_s")


def draw_all(contenders: list[ContenderReport], out_dir: str | Path) -> list[Path]:
    """Draw both charts into ``out_dir`` (made if missing): ``timeline.png`` and
    ``goodput.png``; return their paths in that order. ValueError where ``contenders`` is
    empty (checked before anything is made)."""
    _check(contenders)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "timeline.png", out / "goodput.png"]
    draw_timeline(contenders, paths[0])
    draw_goodput(contenders, paths[1])
    return paths
