"""The rest of Lightning's checkpoint, inside the DCP state.

Lightning's own sharded strategies give DCP the model and optimizer states and have rank 0
``torch.save`` everything else (epoch, global step, the loops' progress, callbacks' states,
hyper-parameters, LR schedulers, ...) into a side file, ``meta.pt``, that a resume unpickles
with whatever code it names. The adapter puts that dictionary into the DCP state instead, under
:data:`KEY`, on rank 0 only (DCP would otherwise keep some other rank's copy): one checkpoint,
committed and checked as a whole, and read back with tierstore's rules for non-tensor values
(torch's ``weights_only`` allow-list, widened by ``[store] trusted_pickles``), so that a load
never runs code from a tier.

It goes in as one tuple, ``(FORMAT, VERSION, checkpoint)``, not as a dict: DCP flattens dicts
and lists into one item per leaf, which would lose the empty dicts Lightning's loop states hold
and turn integer keys into strings; a tuple is one item, pickled whole, and comes back as it was.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KEY", "FORMAT", "VERSION", "pack", "unpack"]

#: the DCP state key of Lightning's checkpoint dictionary
KEY = "lightning"
#: what the record says it is
FORMAT = "tierstore.integrations.lightning"
VERSION = 1


def pack(checkpoint: dict[str, Any]) -> tuple[str, int, dict[str, Any]]:
    """The record of ``checkpoint`` (Lightning's dictionary without model and optimizer
    states) to save under :data:`KEY`."""
    return (FORMAT, VERSION, checkpoint)


def unpack(value: Any, checkpoint_id: str) -> dict[str, Any]:
    """Lightning's dictionary back from the value loaded under :data:`KEY`; ValueError naming
    ``checkpoint_id`` when it holds none (a checkpoint saved by other code)."""
    if value is None:
        raise ValueError(
            f"checkpoint '{checkpoint_id}' holds no Lightning state (no '{KEY}' entry): it was "
            f"not saved by a tierstore.integrations.lightning strategy, so the trainer cannot "
            f"resume from it; load it with dcp.load and the store's reader instead")
    if (not isinstance(value, tuple) or len(value) != 3 or value[0] != FORMAT
            or not isinstance(value[2], dict)):
        raise ValueError(f"checkpoint '{checkpoint_id}': its '{KEY}' entry is not the record "
                         f"this adapter writes ({type(value).__name__})")
    if value[1] != VERSION:
        raise ValueError(f"checkpoint '{checkpoint_id}' was saved with record version "
                         f"{value[1]!r} of {FORMAT}; this version reads {VERSION}: upgrade "
                         f"tierstore")
    return dict(value[2])
