"""PyTorch Lightning checkpointing through tierstore (``pip install 'tierstore[lightning]'``).

Lightning's sharded strategies call ``dcp.save(state, checkpoint_id=path)`` with no storage
writer, so its ``CheckpointIO`` plugins never see those checkpoints. These strategies are
Lightning's own with their checkpoint hooks taken over: the same states go through a tierstore
store's writer and reader, Lightning's side file (``meta.pt``) goes into the checkpoint itself,
and ``ModelCheckpoint`` keeps working (``save_top_k``, ``every_n_train_steps``,
``ckpt_path="last"``). The Trainer's::

    from tierstore.integrations.lightning import ModelParallelStrategy

    trainer = Trainer(strategy=ModelParallelStrategy(tiers="tiers.toml"), ...)
    trainer.fit(model, ckpt_path="last")

and Fabric's, from :mod:`tierstore.integrations.lightning.fabric`. Both modules offer
``ModelParallelStrategy`` (FSDP2, tensor parallelism) and ``FSDPStrategy`` (FSDP1).

- :mod:`~tierstore.integrations.lightning.trainer`: the Trainer's strategies (exported here).
- :mod:`~tierstore.integrations.lightning.fabric`: Fabric's strategies.
- :mod:`~tierstore.integrations.lightning.paths`: Lightning's checkpoint paths (directory and
  file name) and tierstore's ids, one to one (:func:`checkpoint_id`, :func:`checkpoint_path`).

Nothing of Lightning is imported until a strategy is asked for.
"""

from __future__ import annotations

from typing import Any

from tierstore.integrations.lightning.paths import checkpoint_id, checkpoint_path

__all__ = ["ModelParallelStrategy", "FSDPStrategy", "checkpoint_id", "checkpoint_path"]


def __getattr__(name: str) -> Any:
    # The Trainer's strategies import pytorch_lightning, which takes seconds: only on demand.
    if name in ("ModelParallelStrategy", "FSDPStrategy"):
        from tierstore.integrations.lightning import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
