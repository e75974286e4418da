"""The shared argument checks (turbospark_jax/core/checks.py): ``as_token_ids`` takes a list, tuple,
range or 1-d integer array of ids and gives plain ints, and refuses everything else by name,
whichever of its paths (plain ints, mixed integer types, arrays) the value takes."""

import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.core.checks import as_token_ids
from turbospark_jax.errors import BadInputError

VOCAB = 100


@pytest.mark.parametrize("ids", [
    [3, 0, 99], (3, 0, 99), range(3, 6), [np.int64(3), 0, 99], np.array([3, 0, 99]),
    jnp.array([3, 0, 99], jnp.int32), np.array([5], np.uint8),
])
def test_ids_come_back_as_plain_ints(ids):
    out = as_token_ids("prompt", ids, VOCAB)
    assert out == [int(i) for i in ids] and all(type(i) is int for i in out)


@pytest.mark.parametrize(("ids", "match"), [
    ([1, True, 2], "must hold integer token ids, got True"),
    ((1, 2.0), "must hold integer token ids, got 2.0"),
    ([1, np.bool_(True)], "must hold integer token ids"),
    ([1, "2"], "must hold integer token ids"),
    ([1, -1, 5], "token id -1 is outside the vocabulary"),
    ([1, 100], "token id 100 is outside the vocabulary"),
    ([np.int64(1), 100], "token id 100 is outside the vocabulary"),
    (np.array([1, 100]), "token id 100 is outside the vocabulary"),
    (np.array([1.0, 2.0]), "1-d sequence of integer token ids"),
    (np.array([[1, 2]]), "1-d sequence of integer token ids"),
    ("12", "got str"),
    ({1: 2}, "got a mapping"),
    ([], "is empty"),
])
def test_bad_ids_are_refused_by_name(ids, match):
    with pytest.raises(BadInputError, match=match):
        as_token_ids("prompt", ids, VOCAB)


def test_the_first_id_outside_the_vocabulary_is_the_one_named():
    with pytest.raises(BadInputError, match="token id 150 is outside"):
        as_token_ids("prompt", [1, 2, 150, -3, 7], VOCAB)


def test_empty_allowed_when_asked():
    assert as_token_ids("prompt", [], VOCAB, allow_empty=True) == []
    assert as_token_ids("prompt", np.array([], np.float32), VOCAB, allow_empty=True) == []
