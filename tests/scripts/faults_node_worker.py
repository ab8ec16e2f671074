"""torchrun worker of the fault matrix's multi-node trials (tests/faults/multinode.py): 2
simulated nodes x 2 ranks, a node-local ``memory`` tier (``{node}`` in its path, one part per
node) and a shared slower ``local`` tier behind it that the parts are drained into (one gathered
copy), ``keep = 1`` on both.

argv: ``CHECK_ROOT JOB_ROOT JOB_SPEC``. Each launch first checks the trial at ``CHECK_ROOT``
(left by an earlier launch: these processes are fresh) and then runs the job of the trial at
``JOB_ROOT`` with the fault of ``JOB_SPEC`` (JSON: ``row`` like ``node/publish``, ``rank``,
``fault``, ``nth``, ``saves``, ``wait_each``; ``fault`` null: a dry run counting what each
rank announces). ``-`` skips either part. So one launch serves two trials, and a trial costs
about one launch.

The job saves ``step-1`` .. ``step-<saves>`` (attempt 1 of each). The fault strikes in rank
``rank`` only, at the ``nth`` announcement of ``row`` there: ``raise``, ``sigkill``, or, at a
drain's ``drain_file``, the node-local source file flipped (``corrupt-source``) or removed
(``vanish-source``). The journal (``JOB_ROOT/journal``) says what returned: ``saved STEP``
(rank 0, once ``dcp.save`` returned), ``spoiled NODE STEP FILE``.

The check, from fresh processes, in every rank: (1) ``latest()`` is not older than the newest
save that returned; (2) it loads, and bitwise one save's data on every rank (nothing mixed:
every rank matched the same attempt); (3) the newest committed checkpoint (or a newer one)
loads bitwise from one tier alone (the node-local tier alone, or the shared tier alone), and
every copy the shared tier lists loads bitwise (a spoiled source part is never gathered into
it);
(4) the next save (attempt 2 of the next step, the same id a restarted job saves again when
the failed save never committed) succeeds on every rank, ``wait()`` and ``gc()`` too, and then
``latest()`` is it and loads as attempt 2 everywhere; (5) after that, no ``.tierstore-`` entry
is left on any tier. Violations go to ``CHECK_ROOT/check.r<rank>`` (one per line) and stdout.
"""

import json
import os
import signal
import sys
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

import tierstore
from tierstore.engine.publish import PENDING_PART

# Whole lines in one write: the ranks share a pipe (see worker_common).
sys.stdout.reconfigure(line_buffering=True, write_through=False)

warnings.filterwarnings("ignore")
OWN = 500
#: Seconds a collective may wait for a rank (a dead one fails the others this fast).
COLLECTIVE_S = 20


def _is_complete_part(directory: str) -> bool:
    """Whether ``directory`` holds a node-local part whose save token is that of a complete
    checkpoint of its id: the coordinator's part (with DCP's ``.metadata``) on node 0's tier
    holds the same token."""
    cid, node_dir = os.path.basename(directory), os.path.dirname(directory)
    coordinator = os.path.join(os.path.dirname(node_dir), "0", cid, "tierstore.json")
    try:
        with open(os.path.join(directory, "tierstore.json")) as f:
            mine = json.load(f)
        with open(coordinator) as f:
            theirs = json.load(f)
    except (OSError, ValueError):
        return False
    return ".metadata" in theirs["files"] and mine["save_token"] == theirs["save_token"]


def parity_job(root: str) -> bool:
    """Whether the job at ``root`` protects its saves with parity (its spec's ``parity``)."""
    return os.path.exists(os.path.join(root, "parity"))


def config(root: str, *, only: str | None = None) -> dict:
    tiers = [{"name": "ram", "backend": "memory", "path": root + "/ram/{node}", "keep": 1},
             {"name": "shared", "backend": "local", "path": root + "/shared", "keep": 1}]
    if parity_job(root):
        # One parity set of the 4 ranks (jump 1: two members per node), 1/3 each.
        tiers.insert(1, {"name": "peer", "backend": "peer", "path": root + "/peer/{node}",
                         "keep": 1, "replication": {"strategy": "erasure", "data": 3,
                                                    "parity": 1, "jump": 1}})
    if only:
        tiers = [{k: v for k, v in t.items() if k != "keep"} for t in tiers if t["name"] == only]
    return {"store": {"collective_timeout": COLLECTIVE_S}, "tier": tiers}


def state(step: int, attempt: int, rank: int, mesh, zero: bool = False) -> dict:
    """What attempt ``attempt`` of ``step-<step>`` saves (this rank's view)."""
    gen = torch.Generator().manual_seed(step * 1000 + attempt)
    full, replicated = torch.randn(64, 32, generator=gen), torch.randn(10, generator=gen)
    mine = torch.randn(OWN, generator=torch.Generator().manual_seed(step * 1000 + attempt * 10
                                                                    + rank + 7))
    if zero:
        full, replicated, mine = map(torch.zeros_like, (full, replicated, mine))
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "replicated": replicated,
            f"rank{rank}": mine}


def same(got: dict, want: dict) -> bool:
    for k, v in want.items():
        a = got[k].to_local() if isinstance(got[k], DTensor) else got[k]
        b = v.to_local() if isinstance(v, DTensor) else v
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            return False
    return True


def step_of(cid: str) -> int:
    return int(cid.rsplit("-", 1)[1])


class Journal:
    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, *words) -> None:
        os.write(self.fd, (" ".join(map(str, words)) + "\n").encode())


class Strike:
    """Counts what this rank announces per row; strikes once at the chosen point."""

    def __init__(self, spec: dict, rank: int, node: int, root: str, journal: Journal):
        self.spec, self.rank, self.node, self.root, self.journal = spec, rank, node, root, journal
        self.counts: dict[str, int] = {}
        self.fired = False

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        if phase == tierstore.Phase.COLLECT:
            return
        row = f"{'parity' if self.spec.get('parity') else 'node'}/{phase}"
        self.counts[row] = self.counts.get(row, 0) + 1
        spec = self.spec
        if (self.fired or spec.get("fault") is None or spec["rank"] != self.rank
                or spec["row"] != row or self.counts[row] != spec["nth"]):
            return
        self.fired = True
        self.journal.write("fired", spec["fault"], row, spec["nth"], "rank", self.rank,
                           checkpoint_id, tier, detail.get("file"))
        fault = spec["fault"]
        if fault == "raise":
            raise RuntimeError(f"injected fault at {row} #{spec['nth']} on rank {self.rank}")
        if fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        if fault in ("corrupt-source", "vanish-source"):
            path = os.path.join(self.root, "ram", str(self.node), checkpoint_id or "-",
                                detail.get("file") or "-")
            try:
                if fault == "vanish-source":
                    os.remove(path)
                else:
                    with open(path, "r+b") as f:
                        size = f.seek(0, 2)
                        f.seek(size // 2)
                        byte = f.read(1)
                        f.seek(size // 2)
                        f.write(bytes([byte[0] ^ 0xFF]))
                self.journal.write("spoiled", self.node, checkpoint_id, detail.get("file"))
            except (OSError, IndexError) as exc:
                self.journal.write("note", f"nothing to spoil at {path}: {exc}")


def run_job(root: str, spec: dict, rank: int, node: int, mesh) -> None:
    if spec.get("parity") and rank == 0:
        open(os.path.join(root, "parity"), "w").close()
    dist.barrier()
    journal = Journal(os.path.join(root, "journal"))
    strike = Strike(spec, rank, node, root, journal)
    store = tierstore.open(config(root), plugins=[strike])
    try:
        for step in range(1, spec["saves"] + 1):
            cid = f"step-{step}"
            if rank == 0:
                journal.write("begin", step)
            dcp.save(state(step, 1, rank, mesh), storage_writer=store.writer(),
                     checkpoint_id=cid, process_group=store.process_group)
            if rank == 0:
                journal.write("saved", step)
            if spec.get("wait_each"):
                store.wait()
        store.wait()
    finally:
        with open(os.path.join(root, f"counts.r{rank}"), "w") as f:
            json.dump(strike.counts, f)
    store.close()


def load_matches(store, cid: str, rank: int, mesh, attempts) -> set[int]:
    """The attempts of ``cid`` whose data this rank loaded bitwise (empty: none)."""
    step = step_of(cid)
    got = state(step, 1, rank, mesh, zero=True)
    try:
        dcp.load(got, storage_reader=store.reader(), checkpoint_id=cid,
                 process_group=store.process_group)
    except BaseException:
        # A failed load leaves every rank's state as it was, whichever rank's read failed.
        if not same(got, state(step, 1, rank, mesh, zero=True)):
            CHANGED_BY_FAILED_LOADS.append(cid)
        raise
    return {a for a in attempts if same(got, state(step, a, rank, mesh))}


#: ids whose failed load left this rank's destination changed (a problem for run_check)
CHANGED_BY_FAILED_LOADS: list[str] = []


def agreed(value, world: int) -> list:
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def run_check(root: str, rank: int, world: int, mesh) -> list[str]:
    problems: list[str] = []
    lines = []
    try:
        with open(os.path.join(root, "journal")) as f:
            lines = [line.split() for line in f.read().splitlines()]
    except FileNotFoundError:
        pass
    saved = [int(w[1]) for w in lines if w and w[0] == "saved"]
    begun = [int(w[1]) for w in lines if w and w[0] == "begin"]
    spoiled = {int(w[2].rsplit("-", 1)[1]) for w in lines if w and w[0] == "spoiled"}
    newest = max((s for s in saved if s not in spoiled), default=0)

    # (1), (2): the store as a restarted job opens it.
    store = tierstore.open(config(root))
    latest = store.latest()
    if newest and (latest is None or step_of(latest) < newest):
        problems.append(f"latest() is {latest}, older than step-{newest}, whose save returned")
    if latest is not None and step_of(latest) not in begun:
        problems.append(f"latest() is {latest}, which the job never saved")
    if latest is not None:
        try:
            mine = load_matches(store, latest, rank, mesh, (1,))
        except (Exception, CheckpointException) as exc:  # noqa: BLE001
            mine = None
            if step_of(latest) not in spoiled:  # (else its only copy may be the damaged one)
                problems.append(f"latest() {latest} does not load: "
                                f"{type(exc).__name__}: {exc}"[:500])
        everyone = agreed(sorted(mine) if mine is not None else None, world)
        if all(m is not None for m in everyone):
            common = set.intersection(*(set(m) for m in everyone))
            if not common:
                problems.append(f"latest() {latest} loads no single save's data: attempts "
                                f"matched per rank {everyone} (mixed or wrong)")
    store.close()

    # (3): the newest committed checkpoint from one tier alone.
    if newest:
        ok_somewhere = False
        for only in ("ram", "shared"):
            single = tierstore.open(config(root, only=only))
            ids = [i.id for i in single.list()] if rank == 0 else []
            ids = agreed(ids, world)[0]
            for cid in ids:
                if step_of(cid) < newest and only == "ram":
                    continue
                try:
                    mine = load_matches(single, cid, rank, mesh, (1,))
                except (Exception, CheckpointException):  # noqa: BLE001
                    mine = set()
                if all(agreed(bool(mine), world)):
                    ok_somewhere = True
                elif only == "shared":
                    # a gathered copy is committed from checked parts only: it loads
                    problems.append(f"{cid} on the shared tier alone does not load bitwise "
                                    f"(rank {rank} matched {sorted(mine)})")
            single.close()
        if not ok_somewhere:
            problems.append(f"the newest committed checkpoint step-{newest} (or a newer one) "
                            f"loads bitwise from no tier alone")

    # (6) parity: every save whose parity all members hold (one token) decodes each member's
    # files to the very bytes its header records; a save whose parity a killed encoding left
    # incomplete is never counted as rebuildable.
    if rank == 0 and parity_job(root):
        problems += check_parity(root)
    dist.barrier()

    # (4): the next save, as a restarted job makes it: attempt 2 of the step after latest().
    nxt = (step_of(latest) if latest else 0) + 1
    cid = f"step-{nxt}"
    store = tierstore.open(config(root))
    try:
        dcp.save(state(nxt, 2, rank, mesh), storage_writer=store.writer(), checkpoint_id=cid,
                 process_group=store.process_group)
        store.wait()
        store.gc()
    except BaseException as exc:  # noqa: BLE001
        problems.append(f"the next save ({cid}, again after the fault) failed on rank {rank}: "
                        f"{type(exc).__name__}: {exc}"[:600])
        raise SystemExit(report(root, rank, problems, fatal=True))
    after = store.latest()
    if after != cid:
        problems.append(f"after the next save ({cid}) latest() is {after}")
    else:
        mine = load_matches(store, cid, rank, mesh, (1, 2))
        everyone = agreed(sorted(mine), world)
        if not all(m == [2] for m in everyone):
            problems.append(f"{cid}, saved again, loads attempts {everyone} per rank, not the "
                            f"new save's data everywhere (mixed with the failed save?)")
    store.close()
    # (5): leftovers
    dist.barrier()
    if rank == 0:
        for d, dirs, names in os.walk(root):
            for n in dirs + names:
                if n.startswith(".tierstore-") and not n.startswith(".tierstore-lease"):
                    if n == PENDING_PART and _is_complete_part(d):
                        # a part of a committed checkpoint the next save confirms
                        # (tierstore.engine.publish); an orphan part is a leftover
                        continue
                    problems.append(f"left after gc(): {os.path.relpath(os.path.join(d, n), root)}")
    problems += [f"a failed load of {cid} left this rank's state dict changed"
                 for cid in CHANGED_BY_FAILED_LOADS]
    CHANGED_BY_FAILED_LOADS.clear()
    return problems


def check_parity(root: str) -> list[str]:
    """Decode every save's parity in this one process, independently of the store's transfer
    path (tierstore.format.parity's reference XOR over packed streams), for each member lost in
    turn, and compare with the digests the set's headers record."""
    from tierstore.tiers.parity_sets import MEMBERS_FILE, PARITY_FILE, read_members, recoverable
    from tierstore.format.checksum import checksum_of
    from tierstore.format.parity import chunk_index, pack

    problems = []
    held: dict[tuple[str, str], dict[int, tuple]] = {}
    if not os.path.isdir(os.path.join(root, "peer")):
        return problems  # nothing reached the peer tier
    nodes = sorted(os.listdir(os.path.join(root, "peer")))
    for node in nodes:
        top = os.path.join(root, "peer", node, ".parity")
        for holder_dir in sorted(os.listdir(top)) if os.path.isdir(top) else []:
            holder = int(holder_dir.rsplit("-", 1)[1])
            for cid in os.listdir(os.path.join(top, holder_dir)):
                d = os.path.join(top, holder_dir, cid)
                try:
                    with open(os.path.join(d, "tierstore.json")) as f:
                        token = json.load(f)["save_token"]
                    with open(os.path.join(d, MEMBERS_FILE), "rb") as f:
                        found = read_members(f.read())
                    with open(os.path.join(d, PARITY_FILE), "rb") as f:
                        chunk = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
                except (OSError, ValueError, KeyError):
                    continue  # not a committed parity checkpoint (a staging leftover)
                held.setdefault((cid, token), {})[holder] = (found, chunk)

    def files_of(member: int, found) -> torch.Tensor | None:
        parts = []
        for rel, entry in found.files(member):
            data = None
            for tier in ("ram", "peer"):
                for node in nodes:
                    path = os.path.join(root, tier, node, cid, rel)
                    if os.path.exists(path):
                        with open(path, "rb") as f:
                            raw = f.read()
                        if len(raw) == entry.size and checksum_of(raw) == entry.checksum:
                            data = raw
            if data is None:
                return None
            parts.append(torch.frombuffer(bytearray(data), dtype=torch.uint8)
                         if data else torch.empty(0, dtype=torch.uint8))
        return pack(parts, found.chunk * (len(found.ranks) - 1))

    for (cid, token), by_holder in sorted(held.items()):
        found = next(iter(by_holder.values()))[0]
        members = found.ranks
        n, streams = len(members), {}
        for m in members:
            streams[m] = files_of(m, found)
        for lost in members:
            # What a load would rebuild: every survivor holds parity of this very save (a
            # killed encoding may have left some members without it: then the load does not
            # count the lost member as held, and nothing is decoded).
            if not recoverable(set(members) - {lost}, {h: members for h in by_holder}):
                continue
            if any(streams[m] is None for m in members if m != lost):
                continue  # the survivors' files are not all here (evicted, spoiled)
            rebuilt = torch.zeros(found.chunk * (n - 1), dtype=torch.uint8)
            for holder in members:
                if holder == lost:
                    continue
                c = chunk_index(members.index(holder), members.index(lost), n)
                piece = by_holder[holder][1].clone()
                for other in members:
                    if other in (holder, lost):
                        continue
                    co = chunk_index(members.index(holder), members.index(other), n)
                    piece ^= streams[other][co * found.chunk:(co + 1) * found.chunk]
                rebuilt[c * found.chunk:(c + 1) * found.chunk] = piece
            at = 0
            for rel, entry in found.files(lost):
                got = rebuilt[at:at + entry.size].numpy().tobytes()
                at += entry.size
                if checksum_of(got) != entry.checksum:
                    problems.append(f"{cid} (save {token[:8]}): the parity of ranks "
                                    f"{list(members)} decodes rank {lost}'s {rel} to wrong "
                                    f"bytes")
    return problems


def report(root: str, rank: int, problems: list[str], fatal: bool = False) -> int:
    with open(os.path.join(root, f"check.r{rank}"), "w") as f:
        f.write("".join(p.replace("\n", " | ") + "\n" for p in problems))
        if not fatal:
            f.write("DONE\n")
    for p in problems:
        print(f"RANK {rank} VIOLATION: {p}", flush=True)
    return 0


def main() -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_S * 2))
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ["GROUP_RANK"])
    mesh = init_device_mesh("cpu", (world,))
    check_root, job_root, spec = sys.argv[1], sys.argv[2], sys.argv[3]
    if check_root != "-":
        try:
            problems = run_check(check_root, rank, world, mesh)
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, SystemExit):
                raise
            problems = [f"the check failed on rank {rank}: "
                        + "".join(traceback.format_exception_only(exc)).strip()[:600]]
            report(check_root, rank, problems, fatal=True)
            raise
        report(check_root, rank, problems)
        dist.barrier()
    if job_root != "-":
        run_job(job_root, json.loads(spec), rank, node, mesh)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
