"""tierstore's strategies for the Trainer of ``pytorch_lightning`` (``pip install
pytorch-lightning``), Lightning's package before it was named ``lightning``.

::

    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    from tierstore.integrations.lightning.pytorch_lightning import ModelParallelStrategy

    trainer = pl.Trainer(strategy=ModelParallelStrategy(tiers="tiers.toml"),
                         callbacks=[ModelCheckpoint(every_n_train_steps=100)])
    trainer.fit(model, ckpt_path="last")

``ModelParallelStrategy`` (FSDP2, tensor parallelism) and ``FSDPStrategy`` (FSDP1) subclass
``pytorch_lightning.strategies``' own (:mod:`~tierstore.integrations.lightning.trainer_hooks`
says what they change). They are also ``tierstore.integrations.lightning``'s names of the same
(as they were before ``lightning.pytorch`` had strategies of its own here). The Trainer of
``lightning.pytorch`` takes those of :mod:`~tierstore.integrations.lightning.pytorch` instead.
"""

from __future__ import annotations

from tierstore.integrations.lightning.packages import not_installed

try:
    import pytorch_lightning as _package
except ModuleNotFoundError as exc:
    if exc.name != "pytorch_lightning":
        raise
    raise not_installed("pytorch_lightning", exc) from exc

from tierstore.integrations.lightning.trainer_hooks import build

__all__ = ["ModelParallelStrategy", "FSDPStrategy"]

ModelParallelStrategy, FSDPStrategy = build(_package)
