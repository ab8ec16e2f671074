"""The second user of the ``cotenant`` kind: a process of its own that plants entries under the
tier roots when the job asks it to (python tests/faults/cotenant_attacker.py BASE).

It models a cotenant who can write where the tiers live (a shared filesystem, a world-writable
parent): every entry it makes belongs to uid/gid 65534 (``nobody``) when it runs as root, so the
job meets foreign-owned directories, world-writable directories and symlinks it did not make.
It reads one JSON request a line on stdin (``action``, ``seed``: a string its choices are drawn
from, ``future``: ids the job has yet to save, ``tiers``: tier name -> root) and answers one JSON
line: what it did (``did``), the paths it pointed links at (``targets``: tier name and id when
the target is another tier's checkpoint) and the checkpoints it replaced itself (``tampered``).
Only the standard library: it starts in tens of milliseconds.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys

NOBODY = 65534
#: The actions (see ``act``); ``pre-*`` only before the store opens (the roots do not exist).
ACTIONS = ("ww-future", "link-ckpt", "link-victim", "link-hidden", "link-file", "hardlink-file",
           "ww-chmod", "link-node-future")
PRE_ACTIONS = ("pre-root-link", "pre-root-foreign", "pre-root-to-tier", "pre-node-link")


def own(path: str) -> None:
    """Give ``path`` (not what a link points at) to ``nobody`` (as root; otherwise as is)."""
    if os.geteuid() == 0:
        os.lchown(path, NOBODY, NOBODY)


def remove(path: str) -> None:
    """Remove ``path`` whatever it is, never following a link."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def link(target: str, path: str) -> None:
    remove(path)
    os.symlink(target, path)
    own(path)


def visible(root: str) -> list[str]:
    """A tier root's checkpoint directories (real ones: not links, not hidden)."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [n for n in names if not n.startswith(".") and os.path.isdir(os.path.join(root, n))
            and not os.path.islink(os.path.join(root, n))]


def act(req: dict) -> dict:
    """Carry out one request (see the module docstring)."""
    rng = random.Random(req["seed"])
    tiers: dict[str, str] = req["tiers"]
    victim: str = req["victim"]
    future: list[str] = req["future"] or ["step-99"]
    names = sorted(tiers)
    a = rng.choice(names)
    others = [n for n in names if n != a]
    b = rng.choice(others)
    root = tiers[a]
    out = {"did": "", "targets": [], "tampered": []}
    action = req["action"]
    linked = [n for n in (a, b) if os.path.realpath(tiers[n]) != os.path.abspath(tiers[n])]
    if linked and not action.startswith("pre-"):
        # A root that is a link (the job's own doing, or an earlier attack) leads outside the
        # tiers: the attacker acts inside the roots only, never on what a link points at.
        out["did"] = f"nothing: the root of {linked[0]} is a link"
        return out
    if action == "pre-root-link":  # a tier's root is a link to the victim, before the job
        link(victim, root)
        out["did"] = f"{a}'s root -> victim"
        out["targets"].append({"path": victim})
    elif action == "pre-root-foreign":  # the root exists already, foreign and world-writable
        os.makedirs(root, exist_ok=True)
        os.chmod(root, 0o777)
        own(root)
        out["did"] = f"{a}'s root made by nobody, mode 777"
    elif action == "pre-root-to-tier":  # a tier's root is a link to another tier's root
        os.makedirs(tiers[b], exist_ok=True)
        link(tiers[b], root)
        out["did"] = f"{a}'s root -> {b}'s root"
        out["targets"].append({"path": tiers[b], "tier": b})
    elif action == "pre-node-link":  # the node directory under a node-local root is a link
        node_root = req.get("node_root")
        if node_root:
            os.makedirs(os.path.dirname(node_root), exist_ok=True)
            link(victim + "/dir", node_root)
            out["did"] = f"node directory {node_root} -> victim/dir"
            out["targets"].append({"path": victim + "/dir"})
    elif action == "ww-future":  # a foreign, world-writable directory where a save will go
        cid = rng.choice(future)
        d = os.path.join(root, cid)
        if not os.path.lexists(d) and os.path.isdir(root):
            os.mkdir(d)
            os.chmod(d, 0o777)
            own(d)
            os.symlink(os.path.join(victim, "secret.txt"), os.path.join(d, "tierstore.json"))
            own(os.path.join(d, "tierstore.json"))
            try:
                os.link(os.path.join(victim, "data.bin"), os.path.join(d, "__0_0.distcp"))
            except OSError:  # another filesystem, or links protected
                pass
            with open(os.path.join(d, ".metadata"), "wb") as f:
                f.write(b"not a pickle")
            own(os.path.join(d, ".metadata"))
            out["did"] = f"{a}/{cid}: a world-writable directory of nobody's (links inside)"
            out["targets"].append({"path": victim})
    elif action in ("link-ckpt", "link-victim"):  # a checkpoint directory becomes a link
        have = visible(root)
        cid = rng.choice(have) if have and rng.random() < 0.7 else rng.choice(future)
        d = os.path.join(root, cid)
        if action == "link-ckpt":
            theirs = visible(tiers[b])
            if not theirs:
                out["did"] = f"nothing to link to on {b}"
                return out
            tid = cid if cid in theirs else rng.choice(theirs)
            target = os.path.join(tiers[b], tid)
            out["targets"].append({"path": target, "tier": b, "cid": tid})
        else:
            target = victim
            out["targets"].append({"path": victim})
        if os.path.isdir(root):
            if cid in have:
                out["tampered"].append([a, cid])
            link(target, d)
            out["did"] = f"{a}/{cid} -> {target}"
    elif action == "link-hidden":  # a staging-like name gc will look at, linked away
        theirs = visible(tiers[b])
        target = os.path.join(tiers[b], theirs[0]) if theirs and rng.random() < 0.5 else victim
        name = f".tierstore-tmp.{rng.choice(future)}.{rng.randrange(1 << 32):08x}"
        if os.path.isdir(root):
            link(target, os.path.join(root, name))
            out["did"] = f"{a}/{name} -> {target}"
            out["targets"].append({"path": target, **({"tier": b, "cid": theirs[0]}
                                                      if target != victim else {})})
    elif action in ("link-file", "hardlink-file"):  # a file of a checkpoint replaced
        have = visible(root)
        if not have:
            out["did"] = f"no checkpoint on {a}"
            return out
        cid = rng.choice(have)
        d = os.path.join(root, cid)
        files = sorted(f for f in os.listdir(d) if os.path.isfile(os.path.join(d, f)))
        if not files:
            return out
        name = rng.choice(files)
        path = os.path.join(d, name)
        source = os.path.join(victim, rng.choice(["secret.txt", "data.bin"]))
        remove(path)
        if action == "link-file":
            os.symlink(source, path)
        else:
            try:
                os.link(source, path)
            except OSError:
                os.symlink(source, path)
        own(path)
        out["did"] = f"{a}/{cid}/{name} {'->' if action == 'link-file' else 'hard link of'} " \
                     f"{source}"
        out["targets"].append({"path": victim})
        out["tampered"].append([a, cid])
    elif action == "ww-chmod":  # a root or checkpoint directory made world-writable
        have = visible(root)
        # (a root given away is refused by the job from then on: rarely, so that the other
        # attacks get their turn)
        d = root if not have or rng.random() < 0.1 else os.path.join(root, rng.choice(have))
        if os.path.isdir(d) and not os.path.islink(d):
            os.chmod(d, 0o777)
            own(d)
            out["did"] = f"{d} made nobody's, mode 777"
    elif action == "link-node-future":  # a future checkpoint is a link to another tier's root
        cid = rng.choice(future)
        if os.path.isdir(root) and not os.path.lexists(os.path.join(root, cid)) \
                and os.path.isdir(tiers[b]):
            link(tiers[b], os.path.join(root, cid))
            out["did"] = f"{a}/{cid} -> {b}'s root"
            out["targets"].append({"path": tiers[b], "tier": b})
    return out


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            answer = act(req)
        except OSError as exc:  # the job's own entries moved under it: nothing was done
            answer = {"did": f"failed: {exc}", "targets": [], "tampered": []}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
