"""tierstore's strategies for the Fabric of ``lightning.fabric`` (``pip install lightning``).

::

    import lightning as L

    from tierstore.integrations.lightning.fabric import ModelParallelStrategy

    fabric = L.Fabric(strategy=ModelParallelStrategy(parallelize, tiers="tiers.toml"))

``ModelParallelStrategy`` (FSDP2, tensor parallelism) and ``FSDPStrategy`` (FSDP1) subclass
``lightning.fabric.strategies``' own (:mod:`~tierstore.integrations.lightning.fabric_hooks` says
what ``fabric.save`` and ``fabric.load`` do with them). The Fabric of ``lightning_fabric`` takes
those of :mod:`~tierstore.integrations.lightning.lightning_fabric` instead (this module's,
before ``lightning.fabric`` had strategies here): given one of these, it refuses it with a
message naming the class to use (the strategy's ``repr``).
"""

from __future__ import annotations

from tierstore.integrations.lightning.packages import not_installed

try:
    import lightning.fabric as _package
except ModuleNotFoundError as exc:
    if exc.name not in ("lightning", "lightning.fabric"):
        raise
    raise not_installed("lightning.fabric", exc) from exc

from tierstore.integrations.lightning.fabric_hooks import build

__all__ = ["ModelParallelStrategy", "FSDPStrategy"]

ModelParallelStrategy, FSDPStrategy = build(_package)
