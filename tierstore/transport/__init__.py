"""Moving bytes and objects between ranks over torch.distributed: where this process sits in the
job and the store's own collectives (:mod:`.collectives`), file transfers in pieces
(:mod:`.transfer`) and their ends over files and memory (:mod:`.ends`).

Layer: transport, beside ``tierstore.format`` at the bottom. It may import only the foundation
(``tierstore.errors``, ``tierstore.events``, ``tierstore.version``) and torch; no home-made
network protocol, only torch.distributed.
"""
