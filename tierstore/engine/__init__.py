"""The engine: what happens to checkpoints once they are written, and what is known about them.

- :mod:`.context` the narrow context every service gets (config, plugin host, where this process
  sits in the job, the tiers, the process groups): plain data, never the Store;
- :mod:`.saves` saves in flight (one at a time per store; step numbers; tokens gc must spare);
- :mod:`.manifests` building manifests (the one function that does);
- :mod:`.publish` publishing a save's commit;
- :mod:`.retention` the only code that evicts a committed checkpoint, and its rule;
- :mod:`.gc` removing what interrupted saves left;
- :mod:`.health` fault containment: a tier that does not answer is skipped, never fatal;
- :mod:`.jobs` the background-job base under :mod:`.drain` (copies to slower tiers) and
  :mod:`.replication` (peer replicas);
- :mod:`.recovery` queueing the copies an earlier process did not make;
- :mod:`.catalog` queries: coverage, latest, list, verify, pin;
- :mod:`.stats` the built-in observer behind ``store.stats()``.

Layer: engine, above ``tierstore.tiers``. It may import tiers, config, plugin, format,
transport and the foundation; nothing in ``tierstore.dcp`` or above.
"""
