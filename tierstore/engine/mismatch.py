"""Why a file on a tier does not match its manifest: read it once more and say what differs.

A file that a drain, a verify or a scrub finds different from its manifest was either changed on
the tier after it was written (in place, or replaced by other bytes), or read wrong (the bytes
the first read saw are not those the tier holds). The two call for different fixes, and a
mismatch that is not explained cannot be fixed, so the error says which: the file is read again
and compared block by block with the digests its writer recorded (``FileEntry.blocks``), which
also tells a few changed blocks (written over in place) from a whole file of other bytes.

This costs one more read of the file, only when a mismatch was already found.
"""

from __future__ import annotations

from tierstore.format.checksum import Hasher, same_digest
from tierstore.format.manifest import FileEntry
from tierstore.tiers.tier import Tier

__all__ = ["explain_mismatch"]

#: read size of the second read
_CHUNK = 8 << 20


def explain_mismatch(tier: Tier, path: str, entry: FileEntry) -> str:
    """A sentence on what file ``path`` of ``tier`` holds now against ``entry`` (the manifest's
    record of it), for the message of an error already raised for a mismatch; never raises."""
    try:
        size, digest, bad = _read_again(tier, path, entry)
    except Exception as exc:  # noqa: BLE001 - the explanation is a courtesy to the error
        return f"read again, it could not be read ({type(exc).__name__}: {exc})"
    if size == entry.size and same_digest(digest, entry.checksum):
        return ("read again, it matches its manifest: the first read saw other bytes than the "
                "tier holds (memory or a reader changed under it), the file is intact")
    if size != entry.size:
        return (f"read again, it is {size:,} bytes where {entry.size:,} were written: it was "
                f"written to after it was closed, or replaced")
    if bad is None:
        return "read again, it still differs (the manifest records no block digests)"
    if len(bad) == len(entry.blocks):
        return (f"read again, all {len(bad)} of its blocks differ: it holds other bytes than "
                f"those written (another file's, or a copy made before it was complete)")
    shown = ", ".join(f"{b} (bytes {b * entry.block_bytes:,}-"
                      f"{min((b + 1) * entry.block_bytes, entry.size):,})" for b in bad[:5])
    return (f"read again, {len(bad)} of its {len(entry.blocks)} blocks differ ({shown}"
            f"{', ...' if len(bad) > 5 else ''}), the others match: it was written over in "
            f"place after it was written")


def _read_again(tier: Tier, path: str, entry: FileEntry) -> tuple[int, str, list[int] | None]:
    """(size, digest, indices of the blocks that differ or None without block digests) of
    file ``path`` on ``tier`` as it is now."""
    keyring = tier.keyring
    whole = keyring.hasher_for(entry.checksum)
    blocks = entry.blocks if entry.blocks and entry.block_bytes else None
    bad: list[int] = []
    size, index, block, in_block = 0, 0, _block_hasher(keyring, blocks, 0), 0
    with tier.backend.open_read(path) as f:
        while chunk := f.read(_CHUNK):
            whole.update(chunk)
            size += len(chunk)
            view = memoryview(chunk)
            while blocks is not None and view:
                take = view[:entry.block_bytes - in_block]
                if block is not None:
                    block.update(take)
                in_block += len(take)
                view = view[len(take):]
                if in_block == entry.block_bytes:
                    if block is None or not same_digest(block.hexdigest(), blocks[index]):
                        bad.append(index)
                    index, in_block = index + 1, 0
                    block = _block_hasher(keyring, blocks, index)
    if blocks is not None and in_block:
        if block is None or not same_digest(block.hexdigest(), blocks[index]):
            bad.append(index)
    return size, whole.hexdigest(), bad if blocks is not None else None


def _block_hasher(keyring, blocks: list[str] | None, index: int) -> Hasher | None:
    """A hasher comparable with block ``index``'s digest (None past the recorded blocks)."""
    if blocks is None or index >= len(blocks):
        return None
    return keyring.hasher_for(blocks[index])
