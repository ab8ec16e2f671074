"""tierstore's strategies for the Trainer of ``lightning.pytorch`` (``pip install lightning``).

::

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tierstore.integrations.lightning.pytorch import ModelParallelStrategy

    trainer = L.Trainer(strategy=ModelParallelStrategy(tiers="tiers.toml"),
                        callbacks=[ModelCheckpoint(every_n_train_steps=100)])
    trainer.fit(model, ckpt_path="last")

``ModelParallelStrategy`` (FSDP2, tensor parallelism) and ``FSDPStrategy`` (FSDP1) subclass
``lightning.pytorch.strategies``' own (:mod:`~tierstore.integrations.lightning.trainer_hooks`
says what they change). ``pytorch_lightning``'s Trainer takes those of
:mod:`~tierstore.integrations.lightning.pytorch_lightning` instead.
"""

from __future__ import annotations

from tierstore.integrations.lightning.packages import not_installed

try:
    import lightning.pytorch as _package
except ModuleNotFoundError as exc:
    if exc.name not in ("lightning", "lightning.pytorch"):
        raise
    raise not_installed("lightning.pytorch", exc) from exc

from tierstore.integrations.lightning.trainer_hooks import build

__all__ = ["ModelParallelStrategy", "FSDPStrategy"]

ModelParallelStrategy, FSDPStrategy = build(_package)
