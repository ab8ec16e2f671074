"""Tiers: one backend with its commit protocol and the TOML's rules (:mod:`.tier`), which ranks
share a tier's directory (:mod:`.layout`), building the tiers of a store from its config,
replica tiers included (:mod:`.build`), and the plain data reported about stored checkpoints
(:mod:`.reports`).

Layer: tiers, above ``tierstore.config``. ``Tier`` is the only code that talks to a commit
protocol. It may import config, plugin, format, transport and the foundation.
"""
