"""Commit protocol ``manifest-last``, for object stores (no rename, or rename = re-upload).

Files are written in place under ``<id>/`` next to a marker object ``.tierstore-pending`` naming
the save; the commit confirms every data object (present, right size), then writes the
manifest object last (an object PUT is atomic) and removes the marker. Readers treat a prefix
without a matching manifest as absent; ``gc`` removes prefixes that still carry a marker and no
manifest. Overwriting an id deletes its manifest first, so the old checkpoint disappears before
any of its objects is replaced.
"""

from __future__ import annotations

from typing import Callable, Collection

from tierstore.plugin import (MANIFEST_NAME, Backend, CommitError, CommitProtocol, hookimpl,
                              Manifest, Phase)

MARKER = ".tierstore-pending"


class ManifestLastCommit(CommitProtocol):
    """Publish a checkpoint by writing its manifest object after all data objects."""

    def begin(self, backend: Backend, checkpoint_id: str, token: str) -> str:
        try:
            current = backend.read_bytes(f"{checkpoint_id}/{MARKER}").decode()
        except FileNotFoundError:
            current = None
        if current != token:
            # Not a part of this same save arriving (node-local groups share the prefix): what
            # is there is an old checkpoint being overwritten or what an interrupted save left.
            # Its manifest goes first, so it is invisible before any object changes.
            backend.delete(f"{checkpoint_id}/{MANIFEST_NAME}")
            backend.delete(checkpoint_id)
            backend.makedirs(checkpoint_id)
            backend.write_bytes(f"{checkpoint_id}/{MARKER}", token.encode())
        return checkpoint_id

    def commit(self, backend: Backend, checkpoint_id: str, staging: str, manifest: bytes,
               announce: Callable[[str], None]) -> None:
        files = Manifest.from_own_json(manifest).files
        wrong = [f"{rel} ({'missing' if size is None else f'{size} bytes'}, expected {e.size})"
                 for rel, e in sorted(files.items())
                 if (size := backend.size(f"{staging}/{rel}")) != e.size]
        if wrong:
            raise CommitError(
                f"checkpoint '{checkpoint_id}' at {backend.describe()} cannot be committed: "
                f"objects not confirmed: {', '.join(wrong[:5])}" + (" ..." if len(wrong) > 5 else "")
            )
        announce(Phase.PUBLISH)
        backend.write_bytes(f"{staging}/{MANIFEST_NAME}", manifest)
        backend.delete(f"{staging}/{MARKER}")

    def begin_delete(self, backend: Backend, checkpoint_id: str) -> None:
        backend.write_bytes(f"{checkpoint_id}/{MARKER}", b"deleting")

    def abort(self, backend: Backend, checkpoint_id: str, staging: str) -> None:
        if backend.size(f"{staging}/{MANIFEST_NAME}") is None:  # never a committed checkpoint
            backend.delete(staging)

    def is_leftover(self, name: str) -> bool:
        return False  # decided per prefix in find_leftovers (it needs to look inside)

    def find_leftovers(self, backend: Backend, names: list[str],
                       protect: Collection[str]) -> list[str]:
        out = []
        for name in names:
            if name.startswith(".") or backend.size(f"{name}/{MARKER}") is None:
                continue
            if backend.size(f"{name}/{MANIFEST_NAME}") is not None:
                continue
            try:
                token = backend.read_bytes(f"{name}/{MARKER}").decode()
            except FileNotFoundError:
                continue
            if token not in protect:
                out.append(name)
        return out

    def update_manifest(self, backend: Backend, checkpoint_id: str, manifest: bytes,
                        token: str) -> None:
        backend.write_bytes(f"{checkpoint_id}/{MANIFEST_NAME}", manifest)


@hookimpl
def tierstore_register_commit_protocols(register):
    register("manifest-last", ManifestLastCommit)
