"""The matrix as a table: rows = phase, columns = fault kind, cells = passed/total."""

from __future__ import annotations

from typing import Any

from .inject import FAULTS
from .plan import row_key

__all__ = ["kind_of", "table"]


def kind_of(result: dict[str, Any]) -> str:
    """Which kind of trial (matrix.KINDS) an outcome is."""
    variant = result.get("variant") or ""
    if result["row"].startswith(("backtoback/", "auto/", "pins/", "cotenant/", "fuzz/")):
        return result["row"].split("/", 1)[0]
    if result["row"].startswith("node/"):
        return "multinode"
    if result["row"].startswith("parity/"):
        return "parity"
    if variant == "ops":
        return "ops-s3" if result["s3"] else "ops"
    if result["fault"] in ("corrupt-source", "vanish-source"):
        return "spoil"
    return variant or "classic"


def _s3_table(on_s3: list[dict[str, Any]]) -> list[str]:
    """The trials with an S3 tier: rows = kind and S3 backend, columns = fault."""
    faults = [f for f in FAULTS if any(r["fault"] == f for r in on_s3)]
    cell: dict[tuple[str, str], list[int]] = {}
    for r in on_s3:
        row = f"{kind_of(r)} ({r.get('s3_backend') or 'fsspec'})"
        for key in ((row, r["fault"]), (row, "all")):
            c = cell.setdefault(key, [0, 0])
            c[0] += r["passed"]
            c[1] += 1
    rows = sorted({key[0] for key in cell})
    lines = ["| kind (backend) | " + " | ".join(faults) + " | all |",
             "|---|" + "---:|" * (len(faults) + 1)]
    for row in rows:
        lines.append(f"| {row} | " + " | ".join(
            "{}/{}".format(*cell[(row, f)]) if (row, f) in cell else "-"
            for f in [*faults, "all"]) + " |")
    return lines


def table(results: list[dict[str, Any]], wall_s: float, skipped: list[str]) -> str:
    """The matrix as Markdown: rows = phase, columns = fault, cells = passed/total."""
    rows = sorted({r["row"] for r in results}, key=row_key)
    faults = [f for f in FAULTS if any(r["fault"] == f for r in results)]
    cell: dict[tuple[str, str], list[int]] = {}
    for r in results:
        for key in ((r["row"], r["fault"]), (r["row"], "all"), ("total", r["fault"]),
                    ("total", "all")):
            c = cell.setdefault(key, [0, 0])
            c[0] += r["passed"]
            c[1] += 1

    def fmt(key):
        c = cell.get(key)
        return f"{c[0]}/{c[1]}" if c else "-"

    lines = ["| phase | " + " | ".join(faults) + " | all |",
             "|---|" + "---:|" * (len(faults) + 1)]
    for row in rows + ["total"]:
        name = f"**{row}**" if row == "total" else f"`{row}`"
        lines.append(f"| {name} | " + " | ".join(fmt((row, f)) for f in [*faults, "all"]) + " |")
    failed = sum(not r["passed"] for r in results)
    on_s3 = [r for r in results if r["s3"]]
    notes = [n for r in results for n in r["notes"]]
    leased = sum(n.startswith("kept by a writer's lease") for n in notes)
    lines.append("")
    lines.append(f"{len(results)} trials, {failed} failed, wall time {wall_s:.0f} s "
                 f"({len(results) - len(on_s3)} on memory/local tiers, {len(on_s3)} with an S3 "
                 f"tier, {sum(r['fault'] == 'server-death' for r in on_s3)} of them killing "
                 f"the server; {len(notes) - leased} load(s) refused with a TierstoreError, "
                 f"{leased} leftover(s) kept by a writer's lease until it expired).")
    kinds: dict[str, list[int]] = {}
    for r in results:
        c = kinds.setdefault(kind_of(r), [0, 0])
        c[0] += r["passed"]
        c[1] += 1
    if set(kinds) - {"classic"}:
        lines += ["", "by kind (issue 25: keep1, spoil, cli, stall, ops, ops-s3, multinode; "
                      "parity; races: backtoback, auto, pins):",
                  "", "| kind | passed/run |", "|---|---:|"]
        lines += [f"| {k} | {c[0]}/{c[1]} |" for k, c in kinds.items()]
    if on_s3:
        lines += ["", "with an S3 tier, by kind and backend:", ""] + _s3_table(on_s3)
    rooms = sorted({r["room"] for r in results if r.get("room") is not None})
    if rooms:
        def by(room, backend):
            mine = [r for r in results if r.get("room") == room and r["backend"] == backend]
            return f"{sum(r['passed'] for r in mine)}/{len(mine)}"

        lines += ["", "first-full by the first tier's free space (what the checkpoint takes, "
                      "plus pages):", "",
                  "| room | memory | local |", "|---:|---:|---:|"]
        lines += [f"| {room:+d} | {by(room, 'memory')} | {by(room, 'local')} |" for room in rooms]
    for line in skipped:
        lines.append(f"Not run: {line}.")
    return "\n".join(lines)
