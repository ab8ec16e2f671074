"""PyTorch Lightning checkpointing through tierstore (``pip install 'tierstore[lightning]'``).

Lightning's sharded strategies call ``dcp.save(state, checkpoint_id=path)`` with no storage
writer, so its ``CheckpointIO`` plugins never see those checkpoints. These strategies are
Lightning's own with their checkpoint hooks taken over: the same states go through a tierstore
store's writer and reader, Lightning's side file (``meta.pt``) goes into the checkpoint itself,
and ``ModelCheckpoint`` keeps working (``save_top_k``, ``every_n_train_steps``,
``ckpt_path="last"``). The Trainer's, with the ``lightning`` package::

    import lightning as L

    from tierstore.integrations.lightning.pytorch import ModelParallelStrategy

    trainer = L.Trainer(strategy=ModelParallelStrategy(tiers="tiers.toml"), ...)
    trainer.fit(model, ckpt_path="last")

Lightning's two package names (``lightning.pytorch`` and ``pytorch_lightning``, and
``lightning.fabric`` and ``lightning_fabric``) are two class hierarchies, and a Trainer or a
Fabric takes only strategies of its own: import them from the module named after the one you
import Lightning from (:mod:`~tierstore.integrations.lightning.packages`). Each offers
``ModelParallelStrategy`` (FSDP2, tensor parallelism) and ``FSDPStrategy`` (FSDP1).

- :mod:`~tierstore.integrations.lightning.pytorch`: the Trainer of ``lightning.pytorch``.
- :mod:`~tierstore.integrations.lightning.pytorch_lightning`: the Trainer of
  ``pytorch_lightning``. This package's own ``ModelParallelStrategy`` and ``FSDPStrategy``
  are these, as they have always been (and so are those of ``.trainer``).
- :mod:`~tierstore.integrations.lightning.fabric`: the Fabric of ``lightning.fabric``.
- :mod:`~tierstore.integrations.lightning.lightning_fabric`: the Fabric of ``lightning_fabric``.
- :mod:`~tierstore.integrations.lightning.paths`: Lightning's checkpoint paths (directory and
  file name) and tierstore's ids, one to one (:func:`checkpoint_id`, :func:`checkpoint_path`).

A strategy given to the other package's Trainer or Fabric is refused by Lightning, with the
strategy's ``repr`` in the message: it names the class to use instead. Nothing of Lightning is
imported until a strategy is asked for.
"""

from __future__ import annotations

from typing import Any

from tierstore.integrations.lightning.paths import checkpoint_id, checkpoint_path

__all__ = ["ModelParallelStrategy", "FSDPStrategy", "checkpoint_id", "checkpoint_path"]


def __getattr__(name: str) -> Any:
    # Lightning's import takes seconds: only on demand. These names were pytorch_lightning's
    # before lightning.pytorch had strategies here, and stay so for the code that uses them.
    if name in ("ModelParallelStrategy", "FSDPStrategy"):
        from tierstore.integrations.lightning import pytorch_lightning

        return getattr(pytorch_lightning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
