"""The exit statuses of ``tierstore``: one status and one hint per situation, whatever the
command, defined here once. ``tierstore --help`` shows :func:`help_text`, and the operations
page holds :func:`markdown_table` (a test compares the two, so the page cannot drift)."""

from __future__ import annotations

import enum
import textwrap

__all__ = ["Exit", "SITUATIONS", "help_text", "markdown_table"]


class Exit(enum.IntEnum):
    """An exit status of ``tierstore`` (see :data:`SITUATIONS` for when each is given)."""

    #: done, and what it checked is good
    OK = 0
    #: what it checked is bad, or what it did failed
    BAD = 1
    #: the command line or the config is wrong, or the checkpoint id names no checkpoint
    #: (argparse's own usage errors are 2 too)
    USAGE = 2
    #: a tier did not answer: ``ls`` and ``status`` print what the others hold, but a monitor
    #: must not take that for the whole store, nor for a bad checkpoint
    TIER_DOWN = 3
    #: Ctrl-C: 128 + SIGINT, as a shell reports a command the signal ended
    INTERRUPTED = 130
    #: the reader of stdout went away (``| head``): 128 + SIGPIPE, what a shell reports for
    #: ``yes | head``; not 1, which a script would take for a bad checkpoint
    PIPE_CLOSED = 141


#: (status, situation, what stderr says): the rows of the table in docs/operations.md
SITUATIONS: tuple[tuple[Exit, str, str], ...] = (
    (Exit.OK, "done, and what it checked is good", "nothing"),
    (Exit.BAD, "what it checked is bad: a `verify` that found a bad file, a `scrub` that left "
               "a bad copy, a `plan` with files on no tier; or what it did failed (a copy, a "
               "drain, `wait --timeout`)",
     "what is bad, on which tier, in which file; `scrub` adds `tierstore scrub --repair`"),
    (Exit.USAGE, "a usage or config error: a bad flag, a TOML mistake, an unknown plugin, an "
                 "id that is not one",
     "the file, line and key, and the valid choices"),
    (Exit.USAGE, "the checkpoint id is on no tier (`inspect`, `plan`, `verify`, `promote`, "
                 "`export`, `pin`, `unpin`)",
     "the tiers asked, and `` `tierstore ls tiers.toml` shows what is stored ``"),
    (Exit.USAGE, "a Lightning checkpoint file name given as an id (`epoch=0-step=10.ckpt`, "
                 "`last.ckpt`)",
     "the id the store holds it under (`tierstore.integrations.lightning.paths`)"),
    (Exit.TIER_DOWN, "`ls` or `status` with a tier that did not answer (the listing of the "
                     "others is printed all the same)",
     "`tier 's3' is unreachable: ...`: where it was asked, the error, and the option to check "
     "(`endpoint_url` for an object store)"),
    (Exit.INTERRUPTED, "interrupted (Ctrl-C)", "`interrupted`"),
    (Exit.PIPE_CLOSED, "the reader of stdout stopped early (`tierstore ls --json | head`)",
     "nothing"),
)


def markdown_table() -> str:
    """:data:`SITUATIONS` as the Markdown table of docs/operations.md."""
    rows = ["| exit | situation | what stderr says |", "|---:|---|---|"]
    def cell(text: str) -> str:
        return text.replace("|", "\\|")  # a table cell ends at a bare |, code span or not

    rows += [f"| {int(code)} | {cell(situation)} | {cell(hint)} |"
             for code, situation, hint in SITUATIONS]
    return "\n".join(rows)


def help_text() -> str:
    """:data:`SITUATIONS` as plain text for ``--help`` (no Markdown markup)."""
    lines = ["exit status:"]
    for code in Exit:
        text = "; ".join(s for c, s, _ in SITUATIONS if c is code).replace("`", "")
        lines += textwrap.wrap(text, width=94, initial_indent=f"  {int(code):<5}",
                               subsequent_indent=" " * 7)
    return "\n".join(lines)
