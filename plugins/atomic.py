"""Commit protocol ``atomic``: write into a hidden directory, manifest last, rename into place.

Sequence: files go into ``.tierstore-tmp.<id>.<token>/``; the manifest is written last and the
directory fsynced; it is renamed to ``<id>/`` and the root fsynced. A crash at any point leaves
either the old state or the new one; what an interrupted save left starts with ``.tierstore-`` and
is removed by the next save or ``gc``. Needs a backend with atomic rename (POSIX).
"""

from __future__ import annotations

from typing import Callable

from tierstore.plugin import MANIFEST_NAME, Backend, CommitError, CommitProtocol, hookimpl, Phase

_TMP = ".tierstore-tmp."
_TRASH = ".tierstore-trash."


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
            # directory) that no reader sees: move it aside so the rename can take its place.
            trash = self.trash_name(checkpoint_id, staging.rsplit(".", 1)[-1])
            backend.rename(checkpoint_id, trash)
            backend.rename(staging, checkpoint_id)
            backend.sync_dir("")
            backend.delete(trash)
            return
        backend.sync_dir("")

    def abort(self, backend: Backend, checkpoint_id: str, staging: str) -> None:
        backend.delete(staging)

    def is_leftover(self, name: str) -> bool:
        return name.startswith(_TMP) or name.startswith(_TRASH)

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
