"""Checkpoints know where they came from: rollback refuses a point that is not an ancestor."""

import pytest

from turbospark_jax.core.state import copy_state, tree_bitwise_equal
from turbospark_jax.errors import BadInputError
from turbospark_jax.testing.toy import toy_attention_producer, toy_recurrent_producer

PRODUCERS = {
    "attention": lambda seed=0: toy_attention_producer(capacity=32, width=4, seed=seed),
    "recurrent": lambda seed=0: toy_recurrent_producer(capacity=32, width=4, seed=seed),
}


def _fed(p, tokens):
    return p.prefill_chunk(p.init_state(), tokens, 0)[1]


@pytest.mark.parametrize("kind", sorted(PRODUCERS))
def test_a_checkpoint_of_a_longer_state_is_refused(kind):
    p = PRODUCERS[kind]()
    a = _fed(p, [1, 2, 3, 4, 5, 6])
    b = _fed(p, [1, 2, 3])
    before = copy_state(b)
    with pytest.raises(BadInputError, match="not an ancestor"):
        p.rollback(b, p.checkpoint(a))
    assert tree_bitwise_equal(b, before)  # nothing touched


@pytest.mark.parametrize("kind", sorted(PRODUCERS))
def test_a_checkpoint_of_another_history_is_refused(kind):
    p = PRODUCERS[kind]()
    a = _fed(p, [1, 2, 3])
    b = _fed(p, [1, 9, 3, 4])
    with pytest.raises(BadInputError, match="not an ancestor"):
        p.rollback(b, p.checkpoint(a))
    with pytest.raises(BadInputError, match="not an ancestor"):
        p.rollback_retaining(b, p.checkpoint(a), 1)


@pytest.mark.parametrize("kind", sorted(PRODUCERS))
def test_a_checkpoint_of_another_producer_is_refused(kind):
    p, q = PRODUCERS[kind](), PRODUCERS[kind]()  # same structure, same weights
    point = q.checkpoint(_fed(q, [1, 2]))
    with pytest.raises(BadInputError, match="another producer"):
        p.rollback(_fed(p, [1, 2, 3]), point)


@pytest.mark.parametrize("kind", sorted(PRODUCERS))
def test_control_ancestors_are_accepted(kind):
    p = PRODUCERS[kind]()
    s = _fed(p, [1, 2, 3])
    point = p.checkpoint(s)
    _, s2 = p.verify(s, [4, 5, 6], 3)
    back = p.rollback(s2, point)
    assert int(back.fed.count) == 3
    kept = p.rollback_retaining(s2, point, 2)
    assert int(kept.fed.count) == 5
    # and again from the restored state: the point is still its ancestor
    assert int(p.rollback(kept, point).fed.count) == 3
