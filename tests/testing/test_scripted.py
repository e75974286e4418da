"""The scripted producer: replay, one step per chunk, clear errors."""

import numpy as np
import pytest

from turbospark_jax.core.state import tree_bitwise_equal
from turbospark_jax.errors import BadInputError, ProducerExhaustedError
from turbospark_jax.testing import conformance
from turbospark_jax.testing.scripted import ScriptedLogitProducer


def _steps(n, v=4):
    return [np.arange(v, dtype=np.float32) * (i + 1) for i in range(n)]


def test_replays_in_order_and_records_fed_ids():
    p = ScriptedLogitProducer(_steps(3))
    s = p.init_state()
    a, s = p.produce(s, 7, 0)
    b, s = p.produce(s, 8, 1)
    np.testing.assert_array_equal(np.asarray(a), _steps(3)[0])
    np.testing.assert_array_equal(np.asarray(b), _steps(3)[1])
    assert s.fed.to_host().ids == (7, 8) and s.cursor == 2


def test_old_state_values_stay_valid():
    p = ScriptedLogitProducer(_steps(2))
    s0 = p.init_state()
    a, _ = p.produce(s0, 1, 0)
    again, _ = p.produce(s0, 1, 0)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(again))


def test_one_scripted_step_per_chunk():
    p = ScriptedLogitProducer(_steps(2))
    logits, s = p.prefill_chunk(p.init_state(), [1, 2, 3], 0)
    np.testing.assert_array_equal(np.asarray(logits), _steps(2)[0])
    assert s.cursor == 1 and s.fed.to_host().ids == (1, 2, 3)


def test_exhausted():
    p = ScriptedLogitProducer(_steps(1))
    _, s = p.produce(p.init_state(), 0, 0)
    with pytest.raises(ProducerExhaustedError, match="all 1 scripted steps"):
        p.produce(s, 0, 1)


def test_step_length_mismatch_names_the_step():
    p = ScriptedLogitProducer([np.zeros(4), np.zeros(5)])
    _, s = p.produce(p.init_state(), 0, 0)
    with pytest.raises(BadInputError, match="scripted step 1 has 5 logits, expected 4"):
        p.produce(s, 0, 1)


def test_empty_chunk():
    p = ScriptedLogitProducer(_steps(1))
    with pytest.raises(BadInputError, match="empty chunk"):
        p.prefill_chunk(p.init_state(), [], 0)


def test_reset_and_reuse_defaults():
    p = ScriptedLogitProducer(_steps(3))
    _, s = p.produce(p.init_state(), 1, 0)
    assert p.reset(s).cursor == 0
    n, fresh = p.try_reuse_prefix(s, [1, 2])
    assert n == 0 and tree_bitwise_equal(fresh, p.init_state())


def test_conformance_where_the_contract_applies():
    conformance.check_prefill_matches_produce(ScriptedLogitProducer(_steps(4)), [1, 2, 3])
    with pytest.raises(conformance.ConformanceError):
        conformance.check_prefill_matches_produce(
            conformance.perturbed(ScriptedLogitProducer(_steps(4)), "prefill_corrupts_state"),
            [1, 2, 3],
        )
