"""The fault matrix: tierstore under injected faults, checked from a fresh process.

Each *trial* runs a small checkpointing job (a few saves through a two-tier store, the drains
behind them, loads, ``verify`` and ``gc``) in a forked child and injects one fault at one named
point of it: an exception, SIGKILL, ENOSPC (raised, or a real tmpfs filled to the brim), EIO, a
slow backend, or the S3 server killed under a drain. Another forked child then opens a fresh
store on the same tiers and checks what a user relies on:

1. ``store.latest()`` is never torn nor older than the last save that returned;
2. every checkpoint ``store.list()`` reports loads bitwise equal to what was saved under its id
   (or the load fails with a ``tierstore.TierstoreError``);
3. the next save, ``store.wait()`` and ``store.gc()`` recover and leave nothing hidden behind;
4. (issue 25) the newest committed checkpoint loads bitwise from some tier alone; nothing is
   ever mixed; nothing that was committed and is within ``keep`` disappears; a spoiled drain
   source is never propagated; a ``tierstore`` command beside a live drain changes nothing; a
   save never waits for a drain's retention stalled on a slow tier.

Besides the matrix as it was (``classic``), ``--kinds`` runs issue 25's kinds: ``keep1``,
``spoil``, ``cli``, ``stall``, ``ops`` (scrub and promote), ``ops-s3`` and ``multinode`` (2
simulated nodes x 2 ranks under torchrun, ``multinode`` and tests/scripts/faults_node_worker.py),
and three *race* kinds with no fault at all, where the library's own concurrency is the adversary
(``races`` and tests/scripts/faults_race_worker.py): ``backtoback`` (2 nodes x 1 rank or 3 x 2,
a node-local RAM tier and a node-local disk tier per node, saves back to back: every checkpoint a
tier keeps is complete there on every node and loads from that tier alone, nothing is collected
as an orphan), ``auto`` (``every = "auto"`` with and without ``overwrite``: every rank takes the
same steps, every committed checkpoint holds its files and loads bitwise) and ``pins`` (pin, unpin
and promote from a second thread while drains and ``keep`` run: nothing pinned is evicted or
left unpinned, nothing unpinned stays pinned, ``keep`` holds for the rest). Two *hostile* kinds
look for security bugs: ``cotenant`` (a second user, a process of its own, plants foreign and
world-writable directories and symlinks under the tier roots between the phases of a job: nothing
outside the roots changes, no tier loses what it keeps, every failure is a ``TierstoreError``)
and ``fuzz`` (one field of a committed checkpoint's ``tierstore.json`` or ``.metadata`` replaced
by a hostile value, signed and unsigned stores: only that checkpoint may be hidden, it loads
bitwise or fails with a ``TierstoreError``, no process dies).

Run it with ``make faults`` (the whole matrix, with a table) or ``python -m tests.faults --help``;
``tests/test_fault_matrix.py`` runs a sample in CI. Modules: ``state`` (state dicts),
``scenario`` (a job from a seed), ``inject`` (where and how faults strike), ``workload`` (the
job a trial runs), ``checks`` (the invariants), ``procs`` (forked children and workers),
``places`` (directories, tmpfs, server), ``plan`` (trials and which to run), ``table`` (the
result), ``multinode`` (the torchrun trials), ``races`` (the race kinds, many trials per launch),
``cotenant``, ``cotenant_attacker`` and ``fuzz`` (the hostile kinds), ``hostile`` (what those
share), ``matrix`` (running it all; the command).
"""
