"""A store's configuration: reading a TOML file or dict and validating it completely, against the
core's keys and the keys the chosen plugins declare, before anything is written
(:mod:`.validate`); and how to open the same store again in another process (:mod:`.spec`).

Layer: config, above ``tierstore.plugin`` (it asks the plugin host which names and keys exist).
It may import the plugin layer and everything below it.
"""
