"""A test observer: records every event and every phase a store announces, in order."""

from __future__ import annotations

import tierstore


class Recorder:
    """Pass to ``tierstore.open(config, plugins=[Recorder()])``; read ``events`` and ``phases``
    (``(phase, checkpoint_id, tier, detail)`` tuples) afterwards."""

    def __init__(self):
        self.events, self.phases = [], []

    @tierstore.hookimpl
    def tierstore_event(self, event):
        self.events.append(event)

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, detail):
        self.phases.append((phase, checkpoint_id, tier, dict(detail)))
