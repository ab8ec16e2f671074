"""tierstore's failure simulator and goodput accounting: a layer above the store that drives
its public API and reads its events like any user would (the core never imports it).

- :mod:`tierstore_simulate.goodput`: goodput from an events log (``tierstore goodput``);
- :mod:`tierstore_simulate.plots`: the timeline and goodput charts;
- :mod:`tierstore_simulate.scenario`: the scenario TOML (job, failures, contenders) and the
  built-in one;
- :mod:`tierstore_simulate.job`: the training job each rank runs, for every contender;
- :mod:`tierstore_simulate.supervisor`: launches the job, strikes the failures, restarts it;
- :mod:`tierstore_simulate.run`: every contender in turn, the report and the charts
  (``tierstore simulate``).
"""
