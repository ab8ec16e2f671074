"""The ranks of a gathered copy (each rank uploads its own files of a node-local checkpoint to
a shared tier, rank 0 commits) wait for the committing rank's begin through its word in the
job's key-value store, not by looking at the shared tier: a look there reads every
checkpoint's markers (on an object store, requests), and every rank of the job waits."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tierstore.engine import drain
from tierstore.engine.drain import Drainer, DrainJob
from tierstore.transport.collectives import post

TOKEN = "0123456789abcdef"


class SharedTier:
    """The shared target, as the wait sees it: its looks counted; ``begun``: whether it holds
    the committing rank's work in progress of save ``TOKEN``."""

    name = "s3"

    def __init__(self, begun: bool):
        self.begun, self.looks = begun, 0

    def leftovers(self, protect=()):
        self.looks += 1
        return [f"step-2.{TOKEN}"] if self.begun and TOKEN not in protect else []


def _waiting_rank() -> Drainer:
    """A drainer of a non-committing rank, with only what the wait uses."""
    waiting = Drainer.__new__(Drainer)
    waiting._part_timeout = 30.0
    waiting._exit_deadline = None
    waiting._context = SimpleNamespace(groups=SimpleNamespace(main=None))
    return waiting


def _job() -> DrainJob:
    return DrainJob(checkpoint_id="step-2", source=None, targets=[], token=TOKEN, all_files={})


def test_the_word_of_the_begin_is_enough_and_no_look_at_the_tier_is_made(one_rank_group):
    tier = SharedTier(begun=True)
    post(drain._drain_key(TOKEN, tier.name, "begun"), b"1")
    started = time.monotonic()
    _waiting_rank()._wait_for_begin(_job(), tier)
    assert tier.looks == 0
    assert time.monotonic() - started < drain._LOOK_EVERY_S


def test_without_the_word_the_tier_is_looked_at_once_a_second(one_rank_group):
    # (a committing rank that could not leave its word: the begin on the tier still counts)
    tier = SharedTier(begun=True)
    started = time.monotonic()
    _waiting_rank()._wait_for_begin(_job(), tier)
    assert tier.looks == 2  # leftovers with and without the save's token: one look
    assert time.monotonic() - started >= drain._LOOK_EVERY_S


def test_without_a_key_value_store_the_tier_is_looked_at_at_once():
    tier = SharedTier(begun=True)
    started = time.monotonic()
    _waiting_rank()._wait_for_begin(_job(), tier)
    assert tier.looks == 2
    assert time.monotonic() - started < drain._LOOK_EVERY_S


def test_a_begin_that_never_comes_ends_the_wait_with_an_error_naming_the_tier(one_rank_group):
    waiting = _waiting_rank()
    waiting._part_timeout = 1.5
    with pytest.raises(drain.DrainError, match="did not begin the shared copy on tier 's3'"):
        waiting._wait_for_begin(_job(), SharedTier(begun=False))
