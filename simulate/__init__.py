"""tierstore's failure simulator and goodput accounting: a layer above the store that drives
its public API and reads its events like any user would (the core never imports it).

- :mod:`tierstore_simulate.goodput`: goodput from an events log (``tierstore goodput``);
- :mod:`tierstore_simulate.plots`: the timeline and goodput charts.
"""
