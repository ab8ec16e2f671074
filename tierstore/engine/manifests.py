"""Building manifests: the one function that makes a :class:`Manifest` for a tier, whether for a
save's commit, a drained copy or a peer replica."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from tierstore.format.manifest import FileEntry, Manifest
from tierstore.tiers.tier import Tier
from tierstore.version import __version__

__all__ = ["build_manifest"]

# What a copy keeps of the manifest it was made from: everything but what it lists and how it
# is stored (the same save, step, times, versions and formats).
_INHERITED = tuple(f.name for f in dataclasses.fields(Manifest)
                   if f.name not in ("checkpoint_id", "files", "plugins"))


def build_manifest(tier: Tier, checkpoint_id: str, files: dict[str, FileEntry], *,
                   like: Manifest | None = None, plugins: dict[str, str] | None = None,
                   **fields: Any) -> Manifest:
    """The manifest of ``checkpoint_id`` on ``tier`` listing ``files``.

    ``like``: the manifest of the copy this one is made from (a drain), whose save, step,
    times and versions it keeps; ``fields`` set or override any other field of
    :class:`Manifest`. ``plugins`` adds to the plugins recorded; the tier's own backend and
    commit protocol are always recorded as they are.

    Whether it is signed follows the same rule: a copy keeps ``like``'s ``signed_by``, so an
    unsigned checkpoint stays unsigned wherever it is copied (tierstore.format.signing); a
    manifest of this store's own save is signed where the store has a key."""
    values: dict[str, Any] = ({name: copy.deepcopy(getattr(like, name)) for name in _INHERITED}
                              if like is not None else
                              {"tierstore_version": __version__,
                               "signed_by": tier.keyring.sign_new()})
    values.update(fields)
    recorded = {**(like.plugins if like is not None else {}), **(plugins or {}),
                "backend": tier.config.backend, "commit": tier.commit_name}
    return Manifest(checkpoint_id=checkpoint_id, files=dict(files), plugins=recorded, **values)
