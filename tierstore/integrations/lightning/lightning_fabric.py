"""tierstore's strategies for the Fabric of ``lightning_fabric`` (``pip install
lightning-fabric``, or ``pytorch-lightning``, which includes it), Lightning's package before it
was named ``lightning``.

::

    from lightning_fabric import Fabric

    from tierstore.integrations.lightning.lightning_fabric import ModelParallelStrategy

    fabric = Fabric(strategy=ModelParallelStrategy(parallelize, tiers="tiers.toml"))

``ModelParallelStrategy`` (FSDP2, tensor parallelism) and ``FSDPStrategy`` (FSDP1) subclass
``lightning_fabric.strategies``' own (:mod:`~tierstore.integrations.lightning.fabric_hooks` says
what ``fabric.save`` and ``fabric.load`` do with them). The Fabric of ``lightning.fabric`` takes
those of :mod:`~tierstore.integrations.lightning.fabric` instead.
"""

from __future__ import annotations

from tierstore.integrations.lightning.packages import not_installed

try:
    import lightning_fabric as _package
except ModuleNotFoundError as exc:
    if exc.name != "lightning_fabric":
        raise
    raise not_installed("lightning_fabric", exc) from exc

from tierstore.integrations.lightning.fabric_hooks import build

__all__ = ["ModelParallelStrategy", "FSDPStrategy"]

ModelParallelStrategy, FSDPStrategy = build(_package)
