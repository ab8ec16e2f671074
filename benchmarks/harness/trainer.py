"""The CPU training job of the training-loop benchmarks (``training_stall.py``,
``lazy_ordering.py``) and the options it is built from."""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch


def add_mlp_trainer_args(p: argparse.ArgumentParser) -> None:
    """The options :class:`MlpTrainer` is built from: ``--state-mib``, ``--batch``,
    ``--layers``."""
    p.add_argument("--state-mib", type=int, default=1024,
                   help="params + Adam state size in MiB (default 1024: ~89M params)")
    p.add_argument("--batch", type=int, default=320,
                   help="batch rows (default 320: a ~1.1 s step at 1 GiB on 2 cores)")
    p.add_argument("--layers", type=int, default=5, help="Linear layers (default 5)")


class MlpTrainer:
    """Square Linear layers with ReLUs between them, fused Adam (no full-size temporaries, so
    memory stays flat between steps) and one fixed batch, sized so that parameters and Adam's
    two moments take about ``args.state_mib`` MiB. ``forward_backward`` and ``step`` are the
    two halves of a step; ``state_dict`` is what a save takes."""

    def __init__(self, args: argparse.Namespace):
        """The model, its optimizer and the batch, after one step (Adam's state exists)."""
        torch.manual_seed(0)
        n_params = args.state_mib * (1 << 20) / 4 / 3
        self.width = max(64, round(math.sqrt(n_params / args.layers) / 64) * 64)
        mods: list[torch.nn.Module] = []
        for i in range(args.layers):
            mods.append(torch.nn.Linear(self.width, self.width))
            if i < args.layers - 1:
                mods.append(torch.nn.ReLU())
        self.model = torch.nn.Sequential(*mods)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-5, fused=True)
        self.x = torch.randn(args.batch, self.width)
        self.y = torch.randn(args.batch, self.width)
        self.forward_backward()     # Adam's state exists from here on: the layout never changes
        self.step()

    def forward_backward(self) -> None:
        """Forward and backward on the fixed batch (they only read the state)."""
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()

    def step(self) -> None:
        """The optimizer step (changes every parameter and moment in place), gradients zeroed
        in place."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def state_dict(self) -> dict[str, Any]:
        """What a save takes: the model's and the optimizer's state dicts."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state, detached, in state-dict order: the parameters, then per
        parameter its Adam state (step, exp_avg, exp_avg_sq)."""
        out = [t.detach() for t in self.model.state_dict().values()]
        for st in self.optimizer.state.values():
            out.extend(v.detach() for v in st.values() if isinstance(v, torch.Tensor))
        return out

    @property
    def n_params(self) -> int:
        """Parameters of the model."""
        return sum(p.numel() for p in self.model.parameters())
