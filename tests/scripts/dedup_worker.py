"""torchrun worker (2 ranks, gloo): a model with a frozen base and trainable LoRA-like adapters
(and Adam's state for the adapters), replicated on both ranks as under DDP, saved every step for
10 steps to a RAM tier (``memory``, one directory per node), a disk tier (``local``) and an S3
tier (``fsspec`` on SeaweedFS), all three with ``dedup = true`` (tests/test_dedup_multirank.py).

After each save and its drains (``store.wait(all_ranks=True)``), rank 0 lists every tier and
prints what the save added there, from the tier's own listing::

    BYTES tier=<t> step=<s> changed=<n> chunks=<n> other=<n> manifests=<n> recipes=<n> distcp=<n>

``changed``: the bytes of the state's items whose values differ from the previous save's (every
item at step 1), as DCP writes them: a tensor's bytes, a non-tensor's ``torch.save`` archive.
``chunks``: the bytes of the chunk files that are new in the tier's chunk store. ``manifests``:
the new ``.metadata``, ``tierstore.json`` and recipe files (the ``*.tierstore-chunked.*`` files
standing for the data files). ``other``: every other new or changed file (whole ``.distcp``
files, were the tier not deduplicating). ``recipes`` / ``distcp``: how many recipe files and how
many plain ``.distcp`` files the new checkpoint's directory holds. Before the first save it
prints ``TOTAL bytes=<n>``: what all the state's items take.

Then every rank restores every step from each tier alone (a store opened with only that tier)
into a fresh model and optimizer (a different seed: nothing matches by chance) and compares
every tensor bit for bit with its copy of that step's state. Rank 0 exports every step from the
disk tier with ``store.export(id, "dcp", dir)`` and loads each directory with stock ``dcp.load``
(no tierstore reader), bit for bit; and it writes step 7's state to ``ROOT/expected-step-7.pt``
for the test, which exports step 7 with the ``tierstore`` command.

argv: ROOT S3_URL S3_OPTIONS_JSON
"""

import io
import json
import os
import re
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import tierstore
from worker_common import assert_trees_equal, run_worker, snapshot

problems: list[str] = []

STEPS = 10
LAYERS, WIDTH, R = 4, 512, 16  # 4 frozen 512x512 fp32 layers (1 MiB each), rank-16 adapters
EXPORTED_FOR_THE_TEST = 7

CHUNKS_DIR = ".tierstore-chunks"
RECIPE_MARK = ".tierstore-chunked."
MANIFESTS = (".metadata", "tierstore.json")
# <chunk dir>/<digest kind>/<2 hex>/<hex digest>
_CHUNK = re.compile(rf"(^|/){re.escape(CHUNKS_DIR)}/[a-z0-9_-]+/([0-9a-f]{{2}})/\2[0-9a-f]+$")


class Adapted(nn.Module):
    """A stack of frozen linear layers, each with a trainable low-rank adapter beside it."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.lora_a = nn.ParameterList(nn.Parameter(torch.randn(R, WIDTH) * 0.02)
                                       for _ in range(LAYERS))
        self.lora_b = nn.ParameterList(nn.Parameter(torch.randn(WIDTH, R) * 0.02)
                                       for _ in range(LAYERS))
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for base, a, b in zip(self.base, self.lora_a, self.lora_b):
            x = torch.tanh(base(x) + (x @ a.t()) @ b.t())
        return x


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Adapted(seed)
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optim


def state_dict(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> dict:
    """What is saved: DCP's model and optimizer state dicts (FQN keys; a fresh optimizer's
    state is created, so that a load has somewhere to go) and the step."""
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def leaves(obj, path: str = ""):
    """(path, value) of every tensor and every other non-container value of a state dict."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, obj


def item_bytes(value) -> int:
    """What DCP writes of an item: a tensor's bytes; a non-tensor's torch.save archive."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    buf = io.BytesIO()
    torch.save(value, buf)
    return len(buf.getvalue())


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                b.contiguous().reshape(-1).view(torch.uint8)))
    return type(a) is type(b) and a == b


def changed_bytes(now: dict, before: dict | None) -> int:
    """The bytes of the items of ``now`` whose values differ from ``before``'s (all of them
    without ``before``)."""
    old = dict(leaves(before)) if before is not None else {}
    return sum(item_bytes(v) for k, v in leaves(now) if k not in old or not same(v, old[k]))


# --------------------------------------------------------------------------- tier listings

def local_listing(root: str) -> dict[str, int]:
    out = {}
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            try:
                out[os.path.relpath(path, root)] = os.path.getsize(path)
            except FileNotFoundError:
                pass
    return out


def s3_listing(fs, prefix: str) -> dict[str, int]:
    fs.invalidate_cache()
    try:
        found = fs.find(prefix, detail=True)
    except FileNotFoundError:
        return {}
    return {p[len(prefix) + 1:]: info["size"] for p, info in found.items()
            if info["type"] == "file"}


def added(before: dict[str, int], after: dict[str, int], cid: str) -> dict:
    """What a save added to a tier: the new or changed files' bytes, by kind, and what its
    checkpoint's directory holds."""
    new = {p: s for p, s in after.items() if before.get(p) != s}
    figures = {"chunks": 0, "other": 0, "manifests": 0}
    others = []
    for path, size in new.items():
        name = path.rsplit("/", 1)[-1]
        if _CHUNK.search(path):
            figures["chunks"] += size
        elif name in MANIFESTS or RECIPE_MARK in name:
            figures["manifests"] += size
        else:
            figures["other"] += size
            others.append(f"{path}:{size}")
    in_dir = [p.rsplit("/", 1)[-1] for p in after if p.split("/")[0] == cid]
    figures["recipes"] = sum(RECIPE_MARK in n for n in in_dir)
    figures["distcp"] = sum(n.endswith(".distcp") for n in in_dir)
    figures["other_files"] = others
    return figures


# --------------------------------------------------------------------------- the job

def main() -> int:
    root, url, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tiers = {
        "ram": {"name": "ram", "backend": "memory", "path": f"{root}/ram/{{node}}",
                "dedup": True},
        "disk": {"name": "disk", "backend": "local", "path": f"{root}/disk", "dedup": True},
        "s3": {"name": "s3", "backend": "fsspec", "url": url, "options": options,
               "dedup": True},
    }
    fs = None
    if rank == 0:
        import s3fs
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    bucket_prefix = url.split("://", 1)[1]

    def listings() -> dict[str, dict[str, int]]:
        return {"ram": local_listing(f"{root}/ram/0"), "disk": local_listing(f"{root}/disk"),
                "s3": s3_listing(fs, bucket_prefix)}

    # --- train and save every step --------------------------------------------------------
    model, optim = build(seed=0)
    saved: dict[int, dict] = {}
    started = time.monotonic()
    with tierstore.open({"tier": list(tiers.values())}) as store:
        before = listings() if rank == 0 else None
        for step in range(1, STEPS + 1):
            gen = torch.Generator().manual_seed(1000 + step)  # the same batch on both ranks
            x = torch.randn(32, WIDTH, generator=gen)
            loss = model(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            sd = state_dict(model, optim, step)
            saved[step] = snapshot(sd)
            if step == 1 and rank == 0:
                print(f"TOTAL bytes={changed_bytes(saved[1], None)}", flush=True)
            dcp.save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{step}",
                     process_group=store.process_group)
            store.wait(all_ranks=True)  # every rank's drains to disk and S3 are over
            if rank == 0:
                changed = changed_bytes(saved[step], saved.get(step - 1))
                after = listings()
                for name in tiers:
                    f = added(before[name], after[name], f"step-{step}")
                    print(f"BYTES tier={name} step={step} changed={changed} "
                          f"chunks={f['chunks']} other={f['other']} "
                          f"manifests={f['manifests']} recipes={f['recipes']} "
                          f"distcp={f['distcp']}", flush=True)
                    if f["other_files"]:
                        print(f"OTHER tier={name} step={step} {' '.join(f['other_files'])}",
                              flush=True)
                before = after
            dist.barrier()
        ids = sorted(i.id for i in store.list())
        if ids != sorted(f"step-{s}" for s in range(1, STEPS + 1)):
            problems.append(f"the store lists {ids}, not the 10 steps")
    if rank == 0:
        print(f"SAVES seconds={time.monotonic() - started:.1f}", flush=True)
        torch.save(saved[EXPORTED_FOR_THE_TEST], f"{root}/expected-step-{EXPORTED_FOR_THE_TEST}.pt")

    # --- every step from every tier alone, into a fresh model and optimizer ---------------
    started = time.monotonic()
    for name, tier in tiers.items():
        with tierstore.open({"tier": [tier]}) as store:
            for step in range(1, STEPS + 1):
                fresh_model, fresh_optim = build(seed=99)
                out = state_dict(fresh_model, fresh_optim, 0)
                try:
                    dcp.load(out, storage_reader=store.reader(), checkpoint_id=f"step-{step}",
                             process_group=store.process_group)
                    assert_trees_equal(out, saved[step], f"tier {name} step-{step}")
                except Exception as exc:  # noqa: BLE001 - every step of every tier reports
                    problems.append(f"MISMATCH restoring step-{step} from tier {name}: "
                                    f"{type(exc).__name__}: {exc}")
        if rank == 0:
            print(f"RESTORED tier={name} steps={STEPS}", flush=True)
    if rank == 0:
        print(f"RESTORES seconds={time.monotonic() - started:.1f}", flush=True)

    # --- stock DCP reads the disk tier's checkpoints through export --format dcp ----------
    with tierstore.open({"tier": [tiers["disk"]]}) as store:
        if rank == 0:
            for step in range(1, STEPS + 1):
                out_dir = f"{root}/exported/step-{step}"
                try:
                    store.export(f"step-{step}", "dcp", out_dir)
                    names = os.listdir(out_dir)
                    if any(RECIPE_MARK in n for n in names) or ".metadata" not in names:
                        problems.append(f"the export of step-{step} is no stock checkpoint: "
                                        f"{sorted(names)}")
                    fresh_model, fresh_optim = build(seed=99)
                    out = state_dict(fresh_model, fresh_optim, 0)
                    dcp.load(out, checkpoint_id=out_dir, no_dist=True)  # stock: no tierstore
                    assert_trees_equal(out, saved[step], f"exported step-{step}")
                except Exception as exc:  # noqa: BLE001
                    problems.append(f"MISMATCH in the stock load of the export of step-{step}: "
                                    f"{type(exc).__name__}: {exc}")
            print(f"EXPORTED steps={STEPS}", flush=True)
        dist.barrier()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
