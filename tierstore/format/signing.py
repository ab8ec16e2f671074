"""Signed checkpoints: keyed digests of every file and a MAC over every manifest.

XXH3 checksums and the manifest's XXH3 seal catch bit rot and torn writes, but whoever can write
a tier can recompute them for bytes of their own. With ``[store] signing_key`` set, a store
signs what it writes so that a copy made without the key is refused like a corrupt one:

- every file's digest is a keyed BLAKE3 hash (``blake3k_<key id>:<hex>``): BLAKE3 is a
  cryptographic hash that runs at several GB/s per core, and its keyed mode is a MAC;
- the manifest's seal is a keyed BLAKE3 MAC (``blake3_mac:<hex>``) over every other field, the
  ``signed_by`` field naming the key's public id among them.

Keys are never used as given: each secret is turned into a master key with BLAKE3's key
derivation, and from it one key per purpose (file digests, manifest MACs, the public key id),
so that no output of one use helps forge another. The id is a fingerprint, safe to show.

A manifest is *signed* when it has a MAC and every file digest in it is keyed. A copy never
gains trust its source did not have: a drained, promoted, repaired or re-pinned copy of an
unsigned checkpoint stays unsigned, even when its digests are keyed (copied, say, from a signed
checkpoint by someone who planted it while ``accept_unsigned`` was on); a MAC over them would
vouch for a manifest nobody with the key wrote. With keys configured, an unsigned manifest is
refused unless ``[store] accept_unsigned = true`` (migrating checkpoints written before
signing).
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass, field
from typing import Any

import blake3

from tierstore.format.checksum import ALGORITHM, KEYED_ALGORITHM, KEYED_PREFIX, Hasher
from tierstore.format.manifest_check import SEAL_KEY, ManifestError, canonical_fields, seal_of

__all__ = ["SigningKey", "Keyring", "UNSIGNED", "SIGNED_BY_KEY", "MAC_PREFIX", "SignatureError"]

SIGNED_BY_KEY = "signed_by"
MAC_PREFIX = "blake3_mac:"
#: the shortest secret accepted: 128 bits, whatever its encoding
MIN_SECRET_BYTES = 16

_CONTEXT = "tierstore 2026-11 signing {} v1"
_KEYED_CHECKSUM = re.compile(rf"^{KEYED_PREFIX}([0-9a-f]{{16}}):")
#: a manifest's seal as written: a MAC, or an unsigned XXH3 checksum
_SEAL = re.compile(rf"{re.escape(MAC_PREFIX)}[0-9a-f]{{64}}"
                   rf"|{re.escape(ALGORITHM)}:[0-9a-f]{{32}}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class SignatureError(ManifestError):
    """A manifest's signature is missing where one is required, made with a key this store does
    not hold, or does not match its contents; the copy is treated as corrupt."""


def _derive(purpose: str, material: bytes) -> bytes:
    return blake3.blake3(material, derive_key_context=_CONTEXT.format(purpose)).digest()


@dataclass(frozen=True)
class SigningKey:
    """One signing key, derived from a secret; its ``repr`` shows the public id only."""

    key_id: str
    file_key: bytes = field(repr=False)
    mac_key: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, secret: bytes) -> "SigningKey":
        """The key for ``secret`` (at least :data:`MIN_SECRET_BYTES` bytes; checked by the
        config, which can say where the secret came from)."""
        master = _derive("master key", secret)
        return cls(key_id=_derive("key id", master).hex()[:16],
                   file_key=_derive("file digest", master), mac_key=_derive("manifest MAC", master))

    def __reduce__(self):  # never pickled with its key material by accident
        raise TypeError("a SigningKey is not picklable; open the store from its config again")

    def mac(self, fields: dict[str, Any]) -> str:
        """The MAC of a manifest's fields (the seal excluded)."""
        return MAC_PREFIX + blake3.blake3(canonical_fields(fields), key=self.mac_key).hexdigest()


@dataclass(frozen=True)
class Keyring:
    """The signing keys of a store: the first signs, all verify; plain data, keys hidden.

    ``Keyring()`` (:data:`UNSIGNED`) is a store without keys: it writes XXH3 digests and seals,
    and refuses signed checkpoints, whose digests it cannot check."""

    keys: tuple[SigningKey, ...] = ()
    #: whether an unsigned checkpoint is read although keys are configured (migration)
    accept_unsigned: bool = False

    @property
    def signs(self) -> bool:
        """Whether this store signs what it writes."""
        return bool(self.keys)

    @property
    def key_ids(self) -> tuple[str, ...]:
        """The public ids of the keys, the signing one first."""
        return tuple(k.key_id for k in self.keys)

    def _key(self, key_id: str, what: str) -> SigningKey:
        for key in self.keys:
            if hmac.compare_digest(key.key_id, key_id):
                return key
        if not self.keys:
            raise SignatureError(
                f"{what} is signed (key id {key_id}) and this store has no signing key; set "
                f"[store] signing_key to the key it was written with")
        raise SignatureError(
            f"{what} is signed with key id {key_id}, which is not among this store's signing "
            f"keys ({', '.join(self.key_ids)}); add the key to [store] signing_keys, or the "
            f"copy was not written by this job")

    # -- file digests -----------------------------------------------------------------------
    def new_hasher(self) -> Hasher:
        """A hasher for a file this store writes: keyed by the signing key, else XXH3."""
        if not self.keys:
            return Hasher()
        key = self.keys[0]
        return Hasher(key.file_key, key.key_id)

    def hasher_for(self, checksum: str) -> Hasher:
        """A hasher that computes a digest comparable with ``checksum`` (as a manifest
        records it). SignatureError when it is keyed with a key this store lacks."""
        match = _KEYED_CHECKSUM.match(checksum)
        if match is None:
            return Hasher()
        key = self._key(match.group(1), "the file's digest")
        return Hasher(key.file_key, key.key_id)

    def digest(self, data, like: str | None = None) -> str:
        """Digest of a whole bytes-like object: as ``like`` records it, or as written here."""
        hasher = self.hasher_for(like) if like is not None else self.new_hasher()
        hasher.update(data)
        return hasher.hexdigest()

    # -- manifests --------------------------------------------------------------------------
    def sign_new(self) -> str:
        """The ``signed_by`` a manifest this store writes from its own save starts with: the
        signing key's id ("" without keys). A copy keeps its source's instead (see
        :meth:`seal`)."""
        return self.keys[0].key_id if self.keys else ""

    def seal(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``fields`` (a manifest's, as a dict) with ``checksum_algorithm``, ``signed_by`` and
        the seal set: a MAC when the manifest is to be signed, every digest is keyed and this
        store signs, else an XXH3 seal. The dict is changed in place and returned.

        *To be signed* is what ``signed_by`` says: a save's own manifest starts with the
        signing key's id (:meth:`sign_new`), a manifest read from a tier has the id of the key
        that signed it, or "" when it was not signed. A copy (a drain, promote, repair) or a
        rewrite (a pin) keeps that field, so it never gains trust its source did not have:
        keyed digests alone prove nothing, since anyone can copy them from another signed
        checkpoint into an unsigned manifest that names other files, another step or id."""
        digests = [entry["checksum"] for entry in fields["files"].values()]
        keyed = bool(digests) and all(_KEYED_CHECKSUM.match(d) for d in digests)
        vouched = bool(fields.get(SIGNED_BY_KEY))
        fields.pop(SEAL_KEY, None)
        if vouched and keyed and self.keys:
            fields["checksum_algorithm"] = KEYED_ALGORITHM
            fields[SIGNED_BY_KEY] = self.keys[0].key_id
            fields[SEAL_KEY] = self.keys[0].mac(fields)
        else:
            fields["checksum_algorithm"] = ALGORITHM
            fields[SIGNED_BY_KEY] = ""
            fields[SEAL_KEY] = seal_of(fields)
        return fields

    def open(self, data: dict[str, Any]) -> None:
        """Check the seal of ``data`` (a manifest read from a tier, as a dict) and remove it.

        A MAC must be made by one of this store's keys; an XXH3 seal is an unsigned manifest,
        refused when keys are configured unless ``accept_unsigned``. A manifest with no seal at
        all (written before seals, or stripped of its seal to pass a change) is refused unless
        ``accept_unsigned``: nothing covers its fields. Raises SignatureError (an
        IntegrityError) saying which."""
        seal = data.pop(SEAL_KEY, None)
        signed_by = data.get(SIGNED_BY_KEY, "")
        # Its shape first: compare_digest raises TypeError on a str that is not ASCII.
        if seal is not None and not (isinstance(seal, str) and _SEAL.fullmatch(seal)):
            raise SignatureError(
                f"its seal {_short(seal)} is not one tierstore writes ('{MAC_PREFIX}<64 hex "
                f"digits>' or '{ALGORITHM}:<32 hex digits>'): the manifest was changed or "
                f"damaged after it was written")
        if isinstance(seal, str) and seal.startswith(MAC_PREFIX):
            if not isinstance(signed_by, str) or not re.fullmatch(r"[0-9a-f]{16}", signed_by):
                raise SignatureError("the manifest carries a MAC but no valid 'signed_by' key id")
            key = self._key(signed_by, "the manifest")
            if not hmac.compare_digest(seal, key.mac(data)):
                raise SignatureError(
                    f"the manifest's MAC (key id {signed_by}) does not match its contents: it was "
                    f"changed or written by someone without the signing key")
            return
        if self.keys and not self.accept_unsigned:
            raise SignatureError(
                "the manifest is not signed, and this store requires signed checkpoints (it has "
                "a signing key): it was written without the key, or before signing was set up; "
                "to read checkpoints written before signing, set [store] accept_unsigned = true "
                "while migrating")
        if seal is None:
            if self.accept_unsigned:
                return  # written before seals, read while migrating
            raise SignatureError(
                "the manifest has no seal, so nothing shows its fields are as written (it was "
                "written before manifests were sealed, or its seal was removed); to read "
                "checkpoints from before seals, set [store] accept_unsigned = true while "
                "migrating, then save them again")
        if signed_by:
            raise SignatureError("the manifest names a signing key but carries no MAC")
        if not isinstance(seal, str) or not hmac.compare_digest(seal, seal_of(data)):
            raise SignatureError("its seal does not match its contents: the manifest was "
                                 "changed after it was written")


#: the keyring of a store without signing keys
UNSIGNED = Keyring()
