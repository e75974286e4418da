"""State building blocks: the fed record, by-value split, live comparison."""

import jax.numpy as jnp
import numpy as np

from turbospark_jax.core.state import (
    FedRecord,
    HostFedRecord,
    by_value,
    copy_state,
    live_equal,
    restore_by_value,
    tree_bitwise_equal,
)
from turbospark_jax.testing.toy import ToyKVCache


def test_fed_record_append_drops_padding_rows():
    rec = FedRecord.empty(6).append(jnp.array([4, 5, 6]), jnp.int32(2))
    assert int(rec.count) == 2
    assert list(np.asarray(rec.ids)) == [4, 5, 0, 0, 0, 0]
    assert rec.to_host() == HostFedRecord(ids=(4, 5), injected=(0, 0))


def _state(count):
    cache = ToyKVCache(k=jnp.arange(2 * 6 * 3, dtype=jnp.float32).reshape(2, 6, 3),
                       v=jnp.ones((2, 6, 3)))
    return cache, FedRecord.from_ids(list(range(6))).moved_to(count)


def test_by_value_keeps_only_small_leaves_and_restores():
    _, fed = _state(4)
    small = by_value(fed)
    assert small.ids is None and int(small.count) == 4
    moved = fed.moved_to(6)
    assert int(restore_by_value(moved, small).count) == 4


def test_live_equal_ignores_dead_rows_only():
    from turbospark_jax.engine.program import BlockState

    cache, fed = _state(3)
    a = BlockState(cache=cache, fed=fed)
    dead = BlockState(cache=cache.replace(k=cache.k.at[:, 4].set(-1.0)), fed=fed)
    live = BlockState(cache=cache.replace(k=cache.k.at[:, 1].set(-1.0)), fed=fed)
    assert live_equal(a, dead)
    assert not live_equal(a, live)
    assert not tree_bitwise_equal(a, dead)


def test_copy_state_is_independent():
    cache, _ = _state(2)
    c = copy_state(cache)
    assert tree_bitwise_equal(c, cache) and c.k is not cache.k


def test_lineage_tells_ancestors_from_strangers():
    base = FedRecord.from_ids([5, 6, 7, 8], capacity=8)
    point = by_value(base.moved_to(2))  # a checkpoint after two positions
    assert base.descends_from(point)
    assert base.descends_from(by_value(base))
    assert base.descends_from(by_value(FedRecord.empty(8)))
    # the same length, another history: not an ancestor
    other = FedRecord.from_ids([5, 9, 7, 8], capacity=8)
    assert not other.descends_from(point)
    # a checkpoint past the cursor is never an ancestor
    assert not base.moved_to(1).descends_from(point)
    # moving back and feeding something else breaks the lineage past the move
    rewritten = base.moved_to(1).append(jnp.array([9, 7, 8]), jnp.int32(3))
    assert not rewritten.descends_from(by_value(base.moved_to(3)))
    assert rewritten.descends_from(by_value(base.moved_to(1)))
    # another owner: refused whatever the ids
    assert not FedRecord.empty(8, owner=7).append(
        jnp.array([5, 6]), jnp.int32(2)).descends_from(point)


def test_digest_is_the_same_however_the_ids_were_blocked():
    whole = FedRecord.from_ids([1, 2, 3, 4, 5], capacity=8)
    pieces = FedRecord.empty(8).append(jnp.array([1, 2, 0]), jnp.int32(2)).append(
        jnp.array([3, 4, 5]), jnp.int32(3))
    assert tree_bitwise_equal(whole, pieces)
    assert int(whole.moved_to(3).digest) == int(FedRecord.from_ids([1, 2, 3]).digest)
