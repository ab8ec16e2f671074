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


class ManifestLastCommit(CommitProtocol):
    """Publish a checkpoint by writing its manifest object after all data objects."""

    def begin(self, backend: Backend, checkpoint_id: str, token: str) -> str:
        try:
            current = backend.read_bytes(f"{checkpoint_id}/{MARKER}").decode()
        except FileNotFoundError:
            current = None
        if current != token:
            # An old checkpoint being overwritten, or what an interrupted save left: its
            # manifest goes first, so it is invisible before any object changes. Its objects
            # stay until the commit (this save overwrites most of them; the rest are strays).
            backend.delete(f"{checkpoint_id}/{MANIFEST_NAME}")
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
        for stray in sorted(set(held) - set(files)):
            if not _is_bookkeeping(stray):
                backend.delete(f"{staging}/{stray}")
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


def _is_bookkeeping(rel: str) -> bool:
    """The save's marker, the manifest, a writer's lease: objects the commit leaves alone."""
    return rel in (MARKER, MANIFEST_NAME) or rel.startswith(LEASE_PREFIX)


@hookimpl
def tierstore_register_commit_protocols(register):
    register("manifest-last", ManifestLastCommit)
