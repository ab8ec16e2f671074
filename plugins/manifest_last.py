"""Commit protocol ``manifest-last``, for object stores (no rename, or rename = re-upload).

Files are written in place under ``<id>/`` next to a marker object ``.tierstore-pending`` naming
the save; the commit confirms every data object (present, right size) from one listing, deletes
what the listing holds beyond them (an overwritten checkpoint's or an interrupted save's
objects that this save did not replace), then writes the manifest object last (an object PUT is
atomic) and removes the marker. Readers treat a prefix without a matching manifest as absent;
``gc`` removes prefixes that still carry a marker and no manifest. Overwriting an id deletes its
manifest first, so the old checkpoint disappears before any of its objects is replaced.

Beginning deletes nothing but that manifest: every rank writing a shared prefix begins it, in
any order, while others may already be writing their objects there, so a begin that emptied the
prefix would delete a faster rank's part of the same save.
"""

from __future__ import annotations

from typing import Callable, Collection

from tierstore.plugin import (MANIFEST_NAME, Backend, CommitError, CommitProtocol, hookimpl,
                              Manifest, Phase)
from tierstore_plugins.leases import LEASE_PREFIX

MARKER = ".tierstore-pending"
#: hidden objects a save's begin leaves in place (the manifest is deleted on its own, first)
_KEPT_AT_BEGIN = (MARKER, MANIFEST_NAME, ".metadata")


class ManifestLastCommit(CommitProtocol):
    """Publish a checkpoint by writing its manifest object after all data objects."""

    def begin(self, backend: Backend, checkpoint_id: str, token: str) -> str:
        try:
            current = backend.read_bytes(f"{checkpoint_id}/{MARKER}").decode()
        except FileNotFoundError:
            current = None
        if current != token:
            # An old checkpoint being overwritten, or what an interrupted save left: its
            # manifest goes first, so it is invisible before any object changes. Its data
            # objects stay until the commit (this save overwrites most of them; the commit
            # deletes the rest), but its hidden bookkeeping goes now (a node's pending mark, a
            # drain's part reports): no rank of this save has written any yet, and a stale one
            # would be taken for this save's. Writers' leases stay: a faster rank of this save
            # may hold one here already.
            backend.delete(f"{checkpoint_id}/{MANIFEST_NAME}")
            for name in backend.list(checkpoint_id):
                if name.startswith(".") and name not in _KEPT_AT_BEGIN \
                        and not name.startswith(LEASE_PREFIX):
                    backend.delete(f"{checkpoint_id}/{name}")
            backend.makedirs(checkpoint_id)
            backend.write_bytes(f"{checkpoint_id}/{MARKER}", token.encode())
        return checkpoint_id

    def commit(self, backend: Backend, checkpoint_id: str, staging: str, manifest: bytes,
               announce: Callable[[str], None]) -> None:
        files = Manifest.from_own_json(manifest).files
        held = _held_objects(backend, staging, files)
        wrong = [f"{rel} ({'missing' if size is None else f'{size} bytes'}, expected {e.size})"
                 for rel, e in sorted(files.items()) if (size := held.get(rel)) != e.size]
        if wrong:
            raise CommitError(
                f"checkpoint '{checkpoint_id}' at {backend.describe()} cannot be committed: "
                f"objects not confirmed: {', '.join(wrong[:5])}" + (" ..." if len(wrong) > 5 else "")
            )
        # What the listing holds beyond the save's files: an overwritten checkpoint's or an
        # interrupted save's data objects (deleted before the manifest makes the prefix a
        # checkpoint), and the leases of this save's writers and of writers killed here
        # before (deleted after it: until then they keep gc in other processes away).
        strays = sorted(set(held) - set(files))
        for stray in strays:
            if not stray.startswith("."):
                backend.delete(f"{staging}/{stray}")
        announce(Phase.PUBLISH)
        backend.write_bytes(f"{staging}/{MANIFEST_NAME}", manifest)
        backend.delete(f"{staging}/{MARKER}")
        for lease in strays:
            if lease.startswith(LEASE_PREFIX):
                backend.delete(f"{staging}/{lease}")

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


def _held_objects(backend: Backend, staging: str, files: Collection[str]) -> dict[str, int]:
    """What ``staging`` holds, by path relative to it, with sizes: one listing where the
    backend has one (an object store: a LIST, not a request per object), else the manifest's
    files one by one plus the names directly under ``staging``."""
    listed = backend.inventory(staging)
    if listed is not None:
        return listed
    held = {rel: size for rel in files if (size := backend.size(f"{staging}/{rel}")) is not None}
    for name in backend.list(staging):
        if name not in held and (size := backend.size(f"{staging}/{name}")) is not None:
            held[name] = size
    return held


@hookimpl
def tierstore_register_commit_protocols(register):
    register("manifest-last", ManifestLastCommit)
