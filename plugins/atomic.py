"""Commit protocol ``atomic``: write into a hidden directory, manifest last, rename into place.

Sequence: files go into ``.tierstore-tmp.<id>.<token>/``; the manifest is written last and the
directory fsynced; it is renamed to ``<id>/`` and the root fsynced. A crash at any point leaves
either the old state or the new one; what an interrupted save left starts with ``.tierstore-`` and
is removed by the next save or ``gc``. Needs a backend with atomic rename (POSIX).

Overwriting an id (``[store] overwrite = true``): a directory cannot be renamed over a non-empty
one, so on a local filesystem the new copy and the old one swap names in one step
(``renameat2(RENAME_EXCHANGE)``) and ``<id>`` always names a committed copy; the old copy, left
under the staging name, is then removed (a crash before that leaves it to gc). Where the OS or
the filesystem cannot swap (NFS, FUSE, not Linux, a backend with no local path), the old copy is
moved aside to ``.tierstore-old.<id>.<token>`` first: a crash before the new copy takes its place
leaves ``<id>`` missing, and gc puts the old copy back instead of collecting it.
"""

from __future__ import annotations

from typing import Callable, Collection

from tierstore.plugin import MANIFEST_NAME, Backend, CommitError, CommitProtocol, hookimpl, Phase

from .safe_fs import TierTree

_TMP = ".tierstore-tmp."
_TRASH = ".tierstore-trash."
# An overwritten checkpoint moved aside while the new copy is not in place yet (the two-step
# replace); unlike a trash entry, it is the id's only committed copy when <id> is missing.
_OLD = ".tierstore-old."

#: Announced (through ``announce``) between the two steps of an overwrite: after the swap, before
#: the old copy is removed; or, where no swap is possible, after the old copy was moved aside and
#: before the new one takes its place. Crash tests kill a save there.
PHASE_REPLACE = "publish_replace"


class AtomicRenameCommit(CommitProtocol):
    """Publish a checkpoint with one directory rename (POSIX ``rename(2)`` is atomic)."""

    moves_aside_to_delete = True

    def begin(self, backend: Backend, checkpoint_id: str, token: str) -> str:
        if not backend.supports_rename:
            raise CommitError(
                f"commit protocol 'atomic' needs a backend with atomic rename, and "
                f"{type(backend).__name__} at {backend.describe()} has none; use that backend's "
                f"default commit protocol (remove [store] commit)"
            )
        staging = f"{_TMP}{checkpoint_id}.{token}"
        backend.makedirs(staging)
        return staging

    def commit(self, backend: Backend, checkpoint_id: str, staging: str, manifest: bytes,
               announce: Callable[[str], None]) -> None:
        backend.write_bytes(f"{staging}/{MANIFEST_NAME}", manifest)
        backend.sync_dir(staging)
        announce(Phase.PUBLISH)
        try:
            backend.rename(staging, checkpoint_id)
        except FileExistsError:
            # An old checkpoint being overwritten, or an incomplete copy (even an empty
            # directory) that no reader sees.
            self._replace(backend, checkpoint_id, staging, announce)
            return
        backend.sync_dir("")

    def _replace(self, backend: Backend, checkpoint_id: str, staging: str,
                 announce: Callable[[str], None]) -> None:
        """Put the committed ``staging`` in the place of the existing ``<id>`` so that a crash
        at any point leaves a committed copy that readers or gc find under ``<id>``."""
        root = backend.local_path("")
        if root is not None and TierTree(root).exchange(staging, checkpoint_id):
            backend.sync_dir("")
            announce(PHASE_REPLACE)
            backend.delete(staging)  # the old copy now; gc removes it if this never runs
            return
        aside = f"{_OLD}{checkpoint_id}.{staging.rsplit('.', 1)[-1]}"
        backend.rename(checkpoint_id, aside)
        backend.sync_dir("")
        announce(PHASE_REPLACE)
        backend.rename(staging, checkpoint_id)
        backend.sync_dir("")
        backend.delete(aside)

    def abort(self, backend: Backend, checkpoint_id: str, staging: str) -> None:
        backend.delete(staging)

    def is_leftover(self, name: str) -> bool:
        return name.startswith((_TMP, _TRASH, _OLD))

    def find_leftovers(self, backend: Backend, names: list[str],
                       protect: Collection[str]) -> list[str]:
        """The default's leftovers, except an overwritten copy moved aside whose ``<id>`` is
        missing: a two-step overwrite died between its steps and it is the id's only committed
        copy, so it is renamed back to ``<id>`` (the save it belonged to never reported
        success) and the new copy, still under its staging name, is collected instead."""
        present = set(names)
        out = []
        for name in names:
            if not self.is_leftover(name) or self.token_of(name) in protect:
                continue
            if name.startswith(_OLD):
                checkpoint_id = name[len(_OLD):].rsplit(".", 1)[0]
                if checkpoint_id not in present:
                    try:
                        backend.rename(name, checkpoint_id)
                    except FileExistsError:
                        pass  # a new copy took the id meanwhile: this one is stale now
                    else:
                        backend.sync_dir("")
                        present.add(checkpoint_id)
                        continue
            out.append(name)
        return out

    def trash_name(self, checkpoint_id: str, token: str) -> str:
        return f"{_TRASH}{checkpoint_id}.{token}"

    def token_of(self, name: str) -> str | None:
        return name.rsplit(".", 1)[-1] if self.is_leftover(name) else None

    def update_manifest(self, backend: Backend, checkpoint_id: str, manifest: bytes,
                        token: str) -> None:
        """Replace a committed manifest atomically (pin/unpin): write aside, then rename over."""
        tmp = f"{checkpoint_id}/{MANIFEST_NAME}.{token}.tmp"
        backend.write_bytes(tmp, manifest)
        backend.rename(tmp, f"{checkpoint_id}/{MANIFEST_NAME}", replace=True)
        backend.sync_dir(checkpoint_id)


@hookimpl
def tierstore_register_commit_protocols(register):
    register("atomic", AtomicRenameCommit)
