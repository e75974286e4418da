"""State building blocks: the fed record, by-value split, live comparison."""

import jax.numpy as jnp
import numpy as np

from turbospark_jax.state import (
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
    fed = FedRecord(ids=jnp.arange(6, dtype=jnp.int32), injected=jnp.zeros(6, jnp.int32),
                    count=jnp.int32(count))
    return cache, fed


def test_by_value_keeps_only_small_leaves_and_restores():
    _, fed = _state(4)
    small = by_value(fed)
    assert small.ids is None and int(small.count) == 4
    moved = fed.replace(count=jnp.int32(6))
    assert int(restore_by_value(moved, small).count) == 4


def test_live_equal_ignores_dead_rows_only():
    from turbospark_jax.block_program import BlockState

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
