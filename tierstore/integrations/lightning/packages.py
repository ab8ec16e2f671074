"""Which of the adapter's modules serves which Lightning package.

Lightning ships under two names: the ``lightning`` package (``lightning.pytorch``,
``lightning.fabric``) and the older ``pytorch_lightning`` and ``lightning_fabric``, which
``pip install lightning`` installs as well. They hold the same code as two class hierarchies:
a Trainer from ``lightning.pytorch`` refuses a strategy subclassing ``pytorch_lightning``'s, and
the other way round, and nothing in a strategy's construction says which Trainer it is meant
for. So the choice is the user's, by the module they import the strategies from, named after
the Lightning module whose classes they subclass (:data:`MODULES`). A strategy's ``repr``
names the package it is for and the class to use with the other, which Lightning's refusal
prints.
"""

from __future__ import annotations

__all__ = ["MODULES", "counterpart", "runner", "not_installed"]

#: the Lightning module a strategy subclasses -> the adapter's module offering it
MODULES = {
    "lightning.pytorch": "tierstore.integrations.lightning.pytorch",
    "pytorch_lightning": "tierstore.integrations.lightning.pytorch_lightning",
    "lightning.fabric": "tierstore.integrations.lightning.fabric",
    "lightning_fabric": "tierstore.integrations.lightning.lightning_fabric",
}

# the other spelling of each, for the hints below
_OTHER = {"lightning.pytorch": "pytorch_lightning", "pytorch_lightning": "lightning.pytorch",
          "lightning.fabric": "lightning_fabric", "lightning_fabric": "lightning.fabric"}

# what provides each (the ``lightning`` distribution installs the other two too)
_DISTRIBUTION = {"lightning.pytorch": "lightning", "lightning.fabric": "lightning",
                 "pytorch_lightning": "pytorch-lightning", "lightning_fabric": "lightning-fabric"}


def counterpart(package: str) -> tuple[str, str]:
    """The other spelling of Lightning module ``package`` and the adapter's module for it."""
    other = _OTHER[package]
    return other, MODULES[other]


def runner(package: str) -> str:
    """What takes the strategies of Lightning module ``package``: ``"Trainer"`` or
    ``"Fabric"``."""
    return "Trainer" if package in ("lightning.pytorch", "pytorch_lightning") else "Fabric"


def not_installed(package: str, error: ModuleNotFoundError) -> ImportError:
    """The error for importing the adapter's module for ``package`` without it installed
    (``error``, its own ``ModuleNotFoundError``): what to install, or what to import instead."""
    other, module = counterpart(package)
    takes = runner(package)
    return ImportError(
        f"{MODULES[package]} holds tierstore's strategies for {package}'s {takes}, and "
        f"{error.name!r} is not installed: pip install '{_DISTRIBUTION[package]}>=2.6'. With "
        f"{other}'s {takes}, import the strategies from {module}")
