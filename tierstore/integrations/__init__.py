"""Adapters that let a training framework checkpoint through tierstore.

Each adapter is a package of its own here, installed with an optional extra (``pip install
'tierstore[lightning]'``), and sits at the edge: it uses tierstore's public API only, as any
user's code would, and the core never imports it (the import contracts in ``pyproject.toml``,
checked by ``make test``, say so). Importing this package imports no framework.

- :mod:`tierstore.integrations.lightning`: PyTorch Lightning's Trainer and Fabric strategies.
- :mod:`tierstore.integrations.torchtitan`: torchtitan's trainer, through its DCP checkpoint
  manager.
"""
