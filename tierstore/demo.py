"""``make demo`` / ``tierstore demo``: a small training job checkpointing through a RAM tier and
a local-disk tier, then restoring from the fastest copy that is left. Runs on embedded defaults
(temporary directories, no server) and prints what it did."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tierstore

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

CONFIG = """\
# Every save goes to RAM; every 2nd is copied to the local disk in the background.
[[tier]]
name = "ram"
backend = "memory"
path = "{root}/shm/{{node}}"
keep = 2

[[tier]]
name = "nvme"
backend = "local"
path = "{root}/nvme/{{node}}"
every = 2
keep = 2
"""


def build_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small transformer and its AdamW optimizer (a few MB of weights and moments)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(1000, 128),
                          nn.TransformerEncoderLayer(128, 4, 512, batch_first=True),
                          nn.TransformerEncoderLayer(128, 4, 512, batch_first=True),
                          nn.Linear(128, 1000))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optim: torch.optim.Optimizer) -> float:
    tokens = torch.randint(0, 1000, (8, 32))
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss.item()


def app_state(model, optim, step):
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def snapshot(sd):
    """A deep copy of a state dict (the originals change as training goes on)."""
    if isinstance(sd, dict):
        return {k: snapshot(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(snapshot(v) for v in sd)
    return sd.detach().clone() if isinstance(sd, torch.Tensor) else sd


def same_bytes(a, b) -> bool:
    """Nested state dicts with bitwise-equal tensors."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_bytes(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def run(root: str, steps: int) -> None:
    config_path = os.path.join(root, "tiers.toml")
    with open(config_path, "w") as f:
        f.write(CONFIG.format(root=root))
    print(f"tierstore {tierstore.__version__} demo, torch {torch.__version__}")
    print(f"config {config_path}:\n" + "".join(f"    {line}\n" for line in CONFIG.format(root=root).splitlines()))

    model, optim = build_model(seed=0)
    saved = {}
    with tierstore.open(config_path) as store:
        for step in range(1, steps + 1):
            loss = train_step(model, optim)
            sd = app_state(model, optim, step)
            started = time.perf_counter()
            dcp.save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{step}")
            took = time.perf_counter() - started
            saved[step] = snapshot(sd)
            drains = ", ".join(p.tier for p in store.pending()) or "none"
            print(f"step {step}: loss {loss:.3f}, saved step-{step} in {took * 1000:.0f} ms "
                  f"(drains pending: {drains})")

        started = time.perf_counter()
        store.wait()
        print(f"store.wait(): drains finished in {(time.perf_counter() - started) * 1000:.0f} ms")
        for tier, figures in store.stats().items():
            print(f"    {tier:<5} {figures}")
        print("\ncheckpoints (newest first):")
        for info in store.list():
            print(f"    {info.id:<8} on {', '.join(info.tiers):<5} {info.size_bytes / 1e6:6.2f} MB")
        latest = store.latest()
        print(f"latest(): {latest}")

        fresh_model, fresh_optim = build_model(seed=1)
        train_step(fresh_model, fresh_optim)  # optimizer state must exist to be loaded into
        target = app_state(fresh_model, fresh_optim, 0)
        started = time.perf_counter()
        dcp.load(target, storage_reader=store.reader(), checkpoint_id=latest)
        set_state_dict(fresh_model, fresh_optim, model_state_dict=target["model"],
                       optim_state_dict=target["optim"])
        step = int(latest.split("-")[1])
        ok = same_bytes(app_state(fresh_model, fresh_optim, target["step"]), saved[step])
        print(f"loaded {latest} into a fresh model and optimizer in "
              f"{(time.perf_counter() - started) * 1000:.0f} ms: "
              f"{'bitwise equal' if ok else 'MISMATCH'}")
        if not ok:
            raise SystemExit("demo failed: loaded state differs from the saved state")

        report = store.verify(latest)
        print(f"verify({latest}): {report}")

        print("\nthe node reboots and RAM is gone ...")
        shutil.rmtree(os.path.join(root, "shm"))
        latest = store.latest()
        print(f"latest(): {latest} (from '{store.list()[0].tiers[0]}')")
        target = app_state(fresh_model, fresh_optim, 0)
        dcp.load(target, storage_reader=store.reader(), checkpoint_id=latest)
        ok = same_bytes(target, saved[int(latest.split("-")[1])])
        print(f"loaded {latest}: {'bitwise equal' if ok else 'MISMATCH'}")

        stock = {"model": get_state_dict(fresh_model, fresh_optim)[0]}
        dcp.load(stock, checkpoint_id=os.path.join(root, "nvme", "0", latest))
        ok = ok and same_bytes(stock["model"], saved[int(latest.split("-")[1])]["model"])
        print(f"stock dcp.load(checkpoint_id='{root}/nvme/0/{latest}') without tierstore: "
              f"{'bitwise equal' if ok else 'MISMATCH'}")
        if not ok:
            raise SystemExit("demo failed: loaded state differs from the saved state")
    print("\ndemo finished: every load was bitwise equal to what was saved")


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m tierstore.demo`` and ``tierstore demo``."""
    parser = argparse.ArgumentParser(prog="tierstore demo", description=__doc__)
    parser.add_argument("--dir", help="keep the demo's tiers in a new directory inside this one "
                                      "(default: a temporary directory, removed at the end)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (one save each)")
    args = parser.parse_args(argv)
    if args.dir:
        # A directory of its own inside --dir: the demo writes a config and tiers there and
        # deletes its RAM tier to show a reboot, so it must not share a name with anything
        # the user keeps in --dir.
        os.makedirs(args.dir, exist_ok=True)
        root = tempfile.mkdtemp(prefix="tierstore-demo-", dir=os.path.abspath(args.dir))
        run(root, args.steps)
        print(f"the demo's config and tiers are kept in {root}")
        return
    root = tempfile.mkdtemp(prefix="tierstore-demo-")
    try:
        run(root, args.steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
