"""``ReplicationStrategyTests``: what a replication strategy (which ranks keep a copy of whose
files, for ``peer`` tiers) must do.

Every rank computes ``holders`` on its own, so the answer must be a pure function of
``(rank, world_size)``: in range, never the rank itself, no duplicates, the same on every call
and in every copy of the strategy. A strategy that keeps parity instead (``parity_set``) must
split the ranks into sets every member agrees on, on different nodes, and any one lost member
of a set must decode bitwise from the others' files and parity (checked with the core's own
layout, tierstore.engine.parity, on files of uneven sizes).
"""

from __future__ import annotations

import copy
import re

import pytest

from tierstore.plugin import ReplicationStrategy

from ._helpers import assert_options_declared

__all__ = ["ReplicationStrategyTests", "ParityStrategyTests"]


class ReplicationStrategyTests:
    """Conformance tests for a :class:`tierstore.plugin.ReplicationStrategy`.

    Subclass it in a class named ``Test...`` and provide the fixtures ``strategy`` (a
    constructed strategy) and ``world_sizes`` (world sizes it claims to serve, at least one)::

        class TestMyStrategy(ReplicationStrategyTests):
            @pytest.fixture
            def strategy(self):
                return MyStrategy(copies=2)

            @pytest.fixture
            def world_sizes(self):
                return [2, 4, 8, 12]

            @pytest.fixture
            def bad_world_sizes(self):       # optional: sizes it must refuse (default none)
                return [1, 3]

    Set ``covers_every_rank = False`` for a strategy that deliberately leaves some ranks
    without a holder (the kit then checks that some rank really has none).
    """

    #: every rank's files have at least one holder for the world sizes served (world > 1)
    covers_every_rank: bool = True

    # -- fixtures ------------------------------------------------------------------------------
    @pytest.fixture
    def strategy(self) -> ReplicationStrategy:
        """The strategy under test. Subclasses must override it."""
        pytest.fail(f"{type(self).__name__} must provide a 'strategy' fixture: a constructed "
                    f"tierstore.plugin.ReplicationStrategy (see ReplicationStrategyTests)")

    @pytest.fixture
    def world_sizes(self) -> list[int]:
        """World sizes the strategy serves. Subclasses must override it."""
        pytest.fail(f"{type(self).__name__} must provide a 'world_sizes' fixture: the world "
                    f"sizes the strategy serves (see ReplicationStrategyTests)")

    @pytest.fixture
    def bad_world_sizes(self) -> list[int]:
        """World sizes the strategy must refuse (default: none)."""
        return []

    # -- tests ---------------------------------------------------------------------------------
    def test_options_are_declared_with_descriptions(self, strategy):
        """``options`` is a tuple of Option, each described, defaults passing their checks."""
        assert isinstance(strategy, ReplicationStrategy), \
            f"{type(strategy).__name__} does not subclass ReplicationStrategy"
        assert_options_declared(type(strategy))

    def test_world_sizes_served_are_accepted(self, strategy, world_sizes):
        """check_world_size returns None for every size the strategy serves."""
        assert world_sizes, "the 'world_sizes' fixture is empty: name the sizes you serve"
        for world in world_sizes:
            problem = strategy.check_world_size(world)
            assert problem is None, f"{strategy}: world size {world} refused: {problem}"

    def test_bad_world_sizes_are_refused_with_a_sentence(self, strategy, bad_world_sizes):
        """check_world_size returns a sentence naming sizes that work for a refused size."""
        for world in bad_world_sizes:
            problem = strategy.check_world_size(world)
            assert isinstance(problem, str) and len(problem.split()) >= 3, \
                f"{strategy}: world size {world}: check_world_size returned {problem!r}, not a " \
                f"sentence saying why"
            assert re.search(r"\d", problem), \
                f"{strategy}: world size {world}: {problem!r} names no size that works"

    def test_holders_are_other_ranks_in_range_without_duplicates(self, strategy, world_sizes):
        """holders(rank, world) are ints in [0, world), never rank itself, each once."""
        for world in world_sizes:
            for rank in range(world):
                held_by = strategy.holders(rank, world)
                where = f"{strategy}: holders({rank}, {world}) = {held_by!r}"
                assert isinstance(held_by, list), f"{where} is not a list"
                assert all(isinstance(h, int) and not isinstance(h, bool) for h in held_by), \
                    f"{where}: not all ints"
                assert rank not in held_by, f"{where} contains the rank itself"
                assert all(0 <= h < world for h in held_by), f"{where}: out of range"
                assert len(set(held_by)) == len(held_by), f"{where}: duplicates"

    def test_holders_are_deterministic(self, strategy, world_sizes):
        """The same answer on every call, in any order, and from a copy of the strategy (every
        rank's process computes it on its own)."""
        other = copy.deepcopy(strategy)
        for world in world_sizes:
            first = [strategy.holders(r, world) for r in range(world)]
            backwards = [strategy.holders(r, world) for r in reversed(range(world))][::-1]
            copied = [other.holders(r, world) for r in range(world)]
            assert first == backwards == copied, f"{strategy}: holders change between calls " \
                                                 f"at world size {world}"

    def test_every_rank_has_a_holder(self, strategy, world_sizes):
        """With covers_every_rank (the default), every rank's files have a holder when there
        is more than one rank. A class that sets covers_every_rank = False must really leave
        some rank without one (the declaration matches what the strategy does)."""
        bare = {w: [r for r in range(w) if not strategy.holders(r, w)
                    and len(strategy.parity_set(r, w) or ()) < 2]
                for w in world_sizes if w > 1}
        if self.covers_every_rank:
            assert not any(bare.values()), \
                f"{strategy}: ranks without a holder, by world size: {bare} (set " \
                f"covers_every_rank = False in {type(self).__name__} if that is intended)"
        else:
            assert any(bare.values()), \
                f"{type(self).__name__} sets covers_every_rank = False but every rank of " \
                f"{strategy} has a holder at world sizes {world_sizes}: remove the setting"

    def test_str_is_informative(self, strategy):
        """str(strategy) is not the default object repr and shows each option's value."""
        text = str(strategy)
        assert text and " object at 0x" not in text, \
            f"str() of {type(strategy).__name__} is {text!r}: define __str__ (name and options)"
        for opt in type(strategy).options:
            if hasattr(strategy, opt.name):
                value = str(getattr(strategy, opt.name))
                assert value in text, \
                    f"str(strategy) = {text!r} does not show option {opt.name} = {value}"

    def test_replicas_or_parity_for_every_rank_alike(self, strategy, world_sizes):
        """parity_set is None for every rank (a replica strategy) or for none."""
        for world in world_sizes:
            sets = [strategy.parity_set(r, world) for r in range(world)]
            assert all(v is None for v in sets) or all(v is not None for v in sets), \
                f"{strategy}: parity_set is None for some ranks only at world size {world}: " \
                f"{sets}"


class ParityStrategyTests(ReplicationStrategyTests):
    """Conformance tests for a strategy that keeps parity instead of replicas
    (``parity_set``): everything :class:`ReplicationStrategyTests` checks, and that its sets
    split the ranks with every member agreeing, sit on different nodes of
    ``ranks_per_node`` ranks (a fixture to provide, with ``strategy`` and ``world_sizes``),
    and rebuild any one lost member bitwise through the core's layout.
    """

    @pytest.fixture
    def ranks_per_node(self) -> int:
        """Ranks per node the strategy is configured for. Subclasses must override it."""
        pytest.fail(f"{type(self).__name__} must provide a 'ranks_per_node' fixture: the "
                    f"ranks per node its strategy is configured for (see ParityStrategyTests)")

    def _sets(self, strategy, world: int) -> dict[int, list[int]]:
        sets = {r: strategy.parity_set(r, world) for r in range(world)}
        missing = [r for r, v in sets.items() if v is None]
        assert not missing, f"{strategy}: parity_set is None for ranks {missing} at world " \
                            f"size {world}: a parity strategy gives every rank its set"
        return sets

    def test_parity_sets_split_the_ranks_and_every_member_agrees(self, strategy, world_sizes):
        """parity_set(rank, world): the rank's set, itself included, in rank order, at least two
        distinct ranks in range, the same list from every member."""
        for world in world_sizes:
            sets = self._sets(strategy, world)
            for rank, members in sets.items():
                where = f"{strategy}: parity_set({rank}, {world}) = {members!r}"
                assert rank in members, f"{where} does not contain the rank"
                assert members == sorted(set(members)), f"{where}: not sorted, or duplicates"
                assert len(members) >= 2 and all(0 <= m < world for m in members), where
                for m in members:
                    assert sets[m] == members, f"{where}, but rank {m} says {sets[m]}"

    def test_parity_sets_span_nodes(self, strategy, world_sizes, ranks_per_node):
        """With ``ranks_per_node``, no two members of a set are on one node (one lost node
        costs a set one member)."""
        for world in world_sizes:
            sets = self._sets(strategy, world)
            for members in sets.values():
                nodes = [m // ranks_per_node for m in members]
                assert len(set(nodes)) == len(nodes), \
                    f"{strategy}: set {members} puts two members on one node of " \
                    f"{ranks_per_node} ranks (world size {world})"

    def test_any_one_lost_member_decodes_bitwise(self, strategy, world_sizes):
        """Each set's parity, laid out by the core (tierstore.engine.parity) over files of
        uneven sizes, rebuilds any one lost member bit for bit from the others."""
        import torch

        from tierstore.tiers.parity_sets import ParitySet
        from tierstore.format.manifest import FileEntry

        world = world_sizes[0]
        sets = self._sets(strategy, world)
        gen = torch.Generator().manual_seed(7)
        for members in {tuple(v) for v in sets.values()}:
            data = {m: [torch.randint(0, 256, (int(n),), dtype=torch.uint8, generator=gen)
                        for n in torch.randint(0, 5000, (1 + i % 3,), generator=gen)]
                    for i, m in enumerate(members)}
            headers = {m: {"files": {f"f{j}": FileEntry(t.numel(), "-")
                                     for j, t in enumerate(files)}}
                       for m, files in data.items()}
            found = ParitySet.of(list(members), headers)
            file_of = {m: {f"f{j}": t for j, t in enumerate(files)} for m, files in data.items()}
            parity = {h: torch.zeros(found.chunk, dtype=torch.uint8) for h in members}
            for member in members:
                for holder in members:
                    if holder != member:
                        for rel, offset, size, at in found.pieces(member, holder):
                            parity[holder][at:at + size] ^= file_of[member][rel][offset:offset + size]
            for lost in members:
                for holder in members:
                    if holder == lost:
                        continue
                    chunk = parity[holder].clone()
                    for other in members:
                        if other in (holder, lost):
                            continue
                        for rel, offset, size, at in found.pieces(other, holder):
                            chunk[at:at + size] ^= file_of[other][rel][offset:offset + size]
                    for rel, offset, size, at in found.pieces(lost, holder):
                        assert torch.equal(chunk[at:at + size],
                                           file_of[lost][rel][offset:offset + size]), \
                            f"{strategy}: set {members}, member {lost} lost: bytes " \
                            f"{offset}-{offset + size} of its {rel} decode wrong"

