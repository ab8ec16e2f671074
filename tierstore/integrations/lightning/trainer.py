"""``pytorch_lightning``'s Trainer strategies, under the name of the module that first held them.

The same classes as :mod:`~tierstore.integrations.lightning.pytorch_lightning`, kept here for
code that imports them from this module. New code names the package it uses:
:mod:`~tierstore.integrations.lightning.pytorch` (``lightning.pytorch``) or
:mod:`~tierstore.integrations.lightning.pytorch_lightning`.
"""

from __future__ import annotations

from tierstore.integrations.lightning.pytorch_lightning import FSDPStrategy, ModelParallelStrategy

__all__ = ["ModelParallelStrategy", "FSDPStrategy"]
