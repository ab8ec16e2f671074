"""What a checkpoint looks like on a tier, as data: checkpoint ids (:mod:`.ids`), checksums and
the one read-and-hash loop (:mod:`.checksum`), the manifest ``tierstore.json`` (:mod:`.manifest`)
and the layout of DCP items in data files (:mod:`.item_io`).

Layer: format, beside ``tierstore.transport`` at the bottom. It may import only the foundation
(``tierstore.errors``, ``tierstore.events``, ``tierstore.version``), torch and DCP; it knows
nothing of tiers, plugins or stores.
"""
