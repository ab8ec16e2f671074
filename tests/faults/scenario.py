"""A trial's job, drawn from its seed: the tiers, the saves, and what the job does around them.

Every choice comes from ``random.Random(seed)``, so a seed names one job exactly. The tiers are
a fast first tier (``memory`` or ``local``) and a slower second tier (``local``, or an S3 bucket
through ``fsspec`` or ``obstore``, :data:`S3_BACKENDS`) with varied ``every`` and ``keep``; the
slow tier may compress (``zstd``: drains re-encode every item). The job saves a few steps
(plain or ``dcp.async_save``), maybe an emergency save, and may first be killed half-way and
restarted (``restart_after``), so that resumed drains and leftovers of a dead process are part
of it.

A *variant* (:data:`VARIANTS`) bends the drawn job towards one kind of trial: ``keep1`` (``keep =
1`` on every tier), ``cli`` (``keep = 1``, a wait after every save, so that a drain held at its
fault point leaves every tier still while a ``tierstore`` command runs beside it), ``stall``
(ten saves 0.4 s apart while a drain's eviction on the slow tier stalls), ``ops`` (S3 slow
tier; after the saves a copy is corrupted, then ``scrub --repair`` and ``promote`` run against
the object store), ``dedup`` (``dedup = true`` and ``keep = 1`` on both tiers, and a part of
the state that every save shares: chunks that outlive the checkpoints that wrote them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Place", "S3_BACKENDS", "Scenario", "VARIANTS"]

#: The variants of a drawn job (see the module docstring); "" is the job as drawn.
VARIANTS = ("keep1", "cli", "stall", "ops", "dedup")
#: The backends an S3 slow tier is tried on: the same URL, options and retries on each (the
#: first is the default, and a trial's spec names only the others). A seed draws the same job
#: whichever it is.
S3_BACKENDS = ("fsspec", "obstore")


@dataclass(frozen=True)
class Place:
    """Where one trial's tiers and records live."""

    fast: str                         # directory of the first tier
    slow: str                         # directory of the second tier, or an s3:// URL
    journal: str                      # what the job did, one line per step (see workload)
    log: str                          # stdout and stderr of the trial's processes
    s3_options: dict | None = None    # options of an S3 ``slow`` (fsspec's terms: both take them)
    mount: str | None = None          # the small tmpfs holding both tiers (tmpfs-full trials)
    server_pid: int | None = None     # the S3 server's pid (server-death trials)


@dataclass(frozen=True)
class Scenario:
    """One job: its tiers' settings and its sequence of saves (see the module docstring)."""

    seed: int
    s3: bool
    fast_backend: str          # "memory" or "local"
    fast_every: int
    fast_keep: int | None
    slow_every: int
    slow_keep: int | None
    saves: int                 # step-1 .. step-<saves>
    async_saves: bool
    wait_each: bool            # store.wait() after every save, or only at the end
    emergency: bool            # one more save through store.preemption() at the end
    restart_after: int | None  # a first process saves up to this step and is killed in it
    prepare_kill: str | None   # the row (see inject.row_of) of that step where it dies
    slow_zstd: bool = False    # the slow tier compresses: drains re-encode every item
    variant: str = ""          # one of VARIANTS, or "" (see the module docstring)
    s3_backend: str = "fsspec"  # the S3 tier's backend, one of S3_BACKENDS (with ``s3``)
    dedup: bool = False        # both tiers store data files as shared chunks

    @classmethod
    def from_seed(cls, seed: int, s3: bool = False, variant: str = "", *,
                  s3_backend: str = "fsspec") -> "Scenario":
        """The job of ``seed`` (``s3``: the second tier is an S3 bucket, through
        ``s3_backend``), bent by ``variant``."""
        if s3_backend not in S3_BACKENDS:
            raise ValueError(f"unknown S3 backend {s3_backend!r}")
        drawn = cls._drawn(seed, s3, s3_backend if s3 else "fsspec")
        if not variant:
            return drawn
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}")
        import dataclasses

        change: dict = {"variant": variant, "fast_keep": 1, "slow_keep": 1}
        if variant == "cli":
            change.update(wait_each=True)
        elif variant == "dedup":
            change.update(dedup=True)
        elif variant == "stall":
            change.update(fast_every=1, slow_every=1, saves=10, wait_each=False,
                          restart_after=None, prepare_kill=None, emergency=False)
        elif variant == "ops":
            # step-2 reaches the slow tier, step-3 only the first one (promoted later).
            change.update(fast_every=1, slow_every=2, fast_keep=2, saves=3, wait_each=True,
                          restart_after=None, prepare_kill=None, emergency=False)
        return dataclasses.replace(drawn, **change)

    @classmethod
    def _drawn(cls, seed: int, s3: bool, s3_backend: str) -> "Scenario":
        rng = random.Random(seed)
        fast_every = rng.choice([1, 1, 1, 2])
        # The contract asks for a tier with every = 1; with the fast one at 2, odd steps go
        # straight to the slow tier.
        slow_every = 1 if fast_every == 2 else rng.choice([1, 2])
        saves = rng.choice([2, 3, 3])
        restart = rng.random() < 0.4
        restart_after = rng.randint(1, saves) if restart else None
        kills = ["save/write_file", "save/publish"]
        if restart_after is not None and restart_after % fast_every == 0 \
                and restart_after % slow_every == 0:  # step-<restart_after> is drained
            kills += ["drain/drain_file", "drain/drain_commit"]
        return cls(
            seed=seed,
            s3=s3,
            fast_backend=rng.choice(["memory", "local"]),
            fast_every=fast_every,
            fast_keep=rng.choice([None, 1, 2]),
            slow_every=slow_every,
            slow_keep=rng.choice([None, None, 2]),
            saves=saves,
            async_saves=rng.random() < 0.5,
            wait_each=rng.random() < 0.5,
            emergency=rng.random() < 0.35,
            restart_after=restart_after,
            prepare_kill=rng.choice(kills) if restart else None,
            slow_zstd=rng.random() < 0.3,
            s3_backend=s3_backend,
        )

    # -- ids -------------------------------------------------------------------------------------
    def save_ids(self) -> list[str]:
        """The ids of the job's regular saves, in order."""
        return [f"step-{i}" for i in range(1, self.saves + 1)]

    def emergency_id(self) -> str:
        """The id of the emergency save (when the job makes one)."""
        return f"step-{self.saves + 1}"

    def all_ids(self) -> list[str]:
        """Every id the job may save, in order."""
        return self.save_ids() + ([self.emergency_id()] if self.emergency else [])

    def first_tier_saves(self) -> list[str]:
        """The ids a trial's job (the process after a restart) saves to the first tier: the
        regular saves it makes that the fast tier takes, then the emergency save."""
        ids = self.save_ids()[self.restart_after or 0:]
        return [cid for cid in ids if int(cid.split("-")[1]) % self.fast_every == 0] \
            + ([self.emergency_id()] if self.emergency else [])

    def recovery_id(self) -> str:
        """The id of the checker's save: newer than any of the job's, taken by every tier."""
        step = self.saves + 2
        while step % self.fast_every or step % self.slow_every:
            step += 1
        return f"step-{step}"

    # -- tiers -----------------------------------------------------------------------------------
    def tiers(self, place: Place, *, faulty: bool) -> list[dict]:
        """The ``[[tier]]`` tables; ``faulty`` uses the backends that announce gc's deletes
        (inject.FAULTY_BACKENDS), which the faulty job needs and the checker must not use."""
        prefix = "faults-" if faulty else ""
        fast = {"name": "fast", "backend": prefix + self.fast_backend, "path": place.fast,
                "every": self.fast_every}
        if self.fast_keep is not None:
            fast["keep"] = self.fast_keep
        if self.s3:
            # Few, short retries: a dead server must fail a drain in about a second, not two
            # minutes, or the matrix would spend its time waiting.
            slow = {"name": "slow", "backend": prefix + self.s3_backend, "url": place.slow,
                    "options": place.s3_options or {}, "max_attempts": 2, "retry_seconds": 2}
        else:
            slow = {"name": "slow", "backend": prefix + "local", "path": place.slow}
        slow["every"] = self.slow_every
        if self.slow_zstd:
            slow["codecs"] = ["zstd"]
        if self.slow_keep is not None:
            slow["keep"] = self.slow_keep
        if self.dedup:
            fast["dedup"] = slow["dedup"] = True
        return [fast, slow]

    def config(self, place: Place, *, faulty: bool) -> dict:
        """The whole store config (several data files per save: ``io_threads = 2``)."""
        return {"store": {"io_threads": 2}, "tier": self.tiers(place, faulty=faulty)}

    def slow_kind(self) -> str:
        """What the slow tier is, for reports: ``local``, ``s3`` (fsspec) or ``s3/obstore``."""
        if not self.s3:
            return "local"
        return "s3" if self.s3_backend == S3_BACKENDS[0] else f"s3/{self.s3_backend}"

    def describe(self) -> str:
        """One line for reports."""
        keep = f"keep {self.fast_keep}/{self.slow_keep}"
        return ((f"[{self.variant}] " if self.variant else "") + f"{self.fast_backend}(every {self.fast_every}) -> "
                f"{self.slow_kind()}(every {self.slow_every}"
                f"{', zstd' if self.slow_zstd else ''}), {keep}, "
                f"{self.saves} {'async ' if self.async_saves else ''}saves"
                f"{', wait each' if self.wait_each else ''}"
                f"{', emergency save' if self.emergency else ''}"
                + (f", killed at {self.prepare_kill} of step-{self.restart_after} and restarted"
                   if self.restart_after else "")
                + (", then corrupt a copy, scrub --repair, promote" if self.variant == "ops"
                   else ""))
