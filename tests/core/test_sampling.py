"""Tests for turbospark_jax.core.sampling: filters, penalties, determinism, one program for all."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.core.sampling import (
    History,
    SamplingParams,
    distribution,
    draw,
    draw_processed,
    needs_truncation,
    probabilities,
    process_logits,
    request_key,
    sample,
    token_key,
)
from turbospark_jax.errors import BadInputError

# sample, probabilities and process_logits are jitted by the module; shapes stay fixed here so
# the whole file compiles a handful of programs.
# Many keys, one logits vector: draws N samples in one call.
_draws = jax.jit(jax.vmap(sample, in_axes=(None, None, None, 0)))
# Many logits vectors with a key each.
_rows = jax.jit(jax.vmap(sample, in_axes=(0, None, None, 0)))

N_DRAWS = 4000
_KEYS = jax.vmap(lambda i: token_key(request_key(1234), i))(jnp.arange(N_DRAWS))


def draws(logits: np.ndarray, params: SamplingParams, history: History | None = None) -> np.ndarray:
    """N_DRAWS samples of ``sample`` for one logits vector, as a host array."""
    history = History.empty(len(logits)) if history is None else history
    return np.asarray(_draws(jnp.asarray(logits, jnp.float32), params, history, _KEYS))


def support(x: np.ndarray) -> set[int]:
    return {int(i) for i in np.flatnonzero(x)}


#: Vocabulary of every hand-made case: one shape, so the jitted programs compile once.
V = 8


def padded(values: list[float], fill: float = -np.inf) -> np.ndarray:
    """``values`` padded to length V with ids that can never be picked (or with ``fill``)."""
    return np.array(values + [fill] * (V - len(values)), np.float32)


# Probabilities 1/2, 1/4, 1/8, 1/8: every filter threshold below sits well away from a boundary.
HALVES = padded(np.log([0.5, 0.25, 0.125, 0.125]).tolist())
HAND = np.array([1.0, 3.0, 2.0, 0.5, 2.5, -1.0, 0.0, 1.5], np.float32)
EMPTY = History.empty(V)


def test_top1_equals_greedy_on_random_logits() -> None:
    logits = jax.random.normal(jax.random.key(0), (64, 50)) * 3.0
    history = History.from_prompt([3, 7, 7, 11], 50).add(jnp.int32(5))
    keys = _KEYS[:64]
    for penalties in ({}, {"repetition_penalty": 1.3, "presence_penalty": 0.4}):
        top1 = SamplingParams.make(temperature=0.8, top_k=1, **penalties)
        greedy = SamplingParams.make(**penalties)
        got = np.asarray(_rows(logits, top1, history, keys))
        want = np.asarray(_rows(logits, greedy, history, keys))
        np.testing.assert_array_equal(got, want)
    # Control: without the filter the same keys do not reproduce the greedy tokens.
    free = np.asarray(_rows(logits, SamplingParams.make(temperature=0.8), history, keys))
    assert not np.array_equal(free, want)


def test_top1_is_greedy_under_ties() -> None:
    logits = padded([1.0, 3.0, 3.0, 0.0, 3.0])
    params = SamplingParams.make(temperature=1.0, top_k=1)
    assert set(draws(logits, params).tolist()) == {1}
    assert int(sample(logits, SamplingParams.greedy(), EMPTY, _KEYS[0])) == 1


@pytest.mark.parametrize(
    ("top_k", "allowed"),
    [(1, {1}), (3, {1, 4, 2}), (5, {1, 4, 2, 7, 0}), (8, set(range(8))), (500, set(range(8)))],
)
def test_top_k_picks_only_from_the_k_best(top_k: int, allowed: set[int]) -> None:
    params = SamplingParams.make(temperature=1.0, top_k=top_k)
    picked = set(draws(HAND, params).tolist())
    assert picked == allowed  # inside the set, and every member reachable
    assert support(np.asarray(probabilities(HAND, params, EMPTY))) == allowed


def test_top_k_larger_than_vocab_is_off() -> None:
    history = EMPTY
    off = np.asarray(probabilities(HAND, SamplingParams.make(temperature=0.7), history))
    big = np.asarray(
        probabilities(HAND, SamplingParams.make(temperature=0.7, top_k=10**12), history)
    )
    np.testing.assert_array_equal(off, big)


def test_top_k_ties_rank_lower_id_first() -> None:
    logits = padded([1.0, 2.0, 2.0, 2.0, 0.0])
    params = SamplingParams.make(temperature=1.0, top_k=2)
    assert support(np.asarray(probabilities(logits, params, EMPTY))) == {1, 2}


@pytest.mark.parametrize(
    ("top_p", "allowed"),
    [
        (0.05, {0}),
        (0.4, {0}),
        (0.6, {0, 1}),
        (0.8, {0, 1, 2}),
        (0.9, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_picks_only_from_the_nucleus(top_p: float, allowed: set[int]) -> None:
    params = SamplingParams.make(temperature=1.0, top_p=top_p)
    assert set(draws(HALVES, params).tolist()) == allowed
    assert support(np.asarray(probabilities(HALVES, params, EMPTY))) == allowed


def test_top_p_applies_to_the_top_k_survivors() -> None:
    # After top-k=2 the masses are 2/3 and 1/3, so a 0.6 nucleus holds only the first id;
    # over the full distribution (1/2, 1/4, ...) the same 0.6 nucleus holds two.
    both = SamplingParams.make(temperature=1.0, top_k=2, top_p=0.6)
    assert support(np.asarray(probabilities(HALVES, both, EMPTY))) == {0}
    only_p = SamplingParams.make(temperature=1.0, top_p=0.6)
    assert support(np.asarray(probabilities(HALVES, only_p, EMPTY))) == {0, 1}


@pytest.mark.parametrize(
    ("min_p", "allowed"),
    [(0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2, 3}), (0.3, {0, 1}), (0.6, {0}), (1.0, {0})],
)
def test_min_p_keeps_ids_near_the_top(min_p: float, allowed: set[int]) -> None:
    params = SamplingParams.make(temperature=1.0, min_p=min_p)
    assert set(draws(HALVES, params).tolist()) == allowed
    assert support(np.asarray(probabilities(HALVES, params, EMPTY))) == allowed


def test_min_p_keeps_tied_values_together() -> None:
    logits = padded([2.0, 2.0, 0.0])
    params = SamplingParams.make(temperature=1.0, min_p=1.0)
    assert support(np.asarray(probabilities(logits, params, EMPTY))) == {0, 1}


def test_temperature_zero_is_argmax() -> None:
    logits = jax.random.normal(jax.random.key(1), (64, 50))
    got = np.asarray(_rows(logits, SamplingParams.greedy(), History.empty(50), _KEYS[:64]))
    np.testing.assert_array_equal(got, np.argmax(np.asarray(logits), axis=-1))
    # Greedy ignores the filters and the key.
    filt = SamplingParams.make(top_k=3, top_p=0.1, min_p=0.9)
    again = np.asarray(_rows(logits, filt, History.empty(50), _KEYS[100:164]))
    np.testing.assert_array_equal(again, got)


def test_greedy_probabilities_are_one_hot_at_the_lowest_tied_id() -> None:
    logits = padded([1.0, 3.0, 3.0, 0.0])
    probs = np.asarray(probabilities(logits, SamplingParams.greedy(), EMPTY))
    np.testing.assert_array_equal(probs, padded([0.0, 1.0, 0.0, 0.0], fill=0.0))


def _penalty_case() -> tuple[np.ndarray, History]:
    # Prompt [0, 1]; generated 2, 2, 2, 3.
    history = History.from_prompt([0, 1], V)
    for token in (2, 2, 2, 3):
        history = history.add(jnp.int32(token))
    return padded([2.0, -2.0, 1.0, 0.5, 1.0], fill=-9.0), history


def test_history_bookkeeping() -> None:
    _, history = _penalty_case()
    np.testing.assert_array_equal(history.counts, [0, 0, 3, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(history.seen, [True] * 4 + [False] * 4)
    # Out-of-range tokens write nothing (negative ids must not wrap around to the end).
    same = history.add(jnp.int32(-1)).add(jnp.int32(V))
    np.testing.assert_array_equal(same.counts, history.counts)
    np.testing.assert_array_equal(same.seen, history.seen)


@pytest.mark.parametrize(
    ("kwargs", "want"),
    [
        ({}, [2.0, -2.0, 1.0, 0.5, 1.0]),
        # Seen ids 0..3: positive / 2, negative * 2. Id 4 was never seen.
        ({"repetition_penalty": 2.0}, [1.0, -4.0, 0.5, 0.25, 1.0]),
        # Generated ids 2 and 3 lose 0.5 once each.
        ({"presence_penalty": 0.5}, [2.0, -2.0, 0.5, 0.0, 1.0]),
        # Id 2 (3 times) loses 0.75, id 3 (once) 0.25.
        ({"frequency_penalty": 0.25}, [2.0, -2.0, 0.25, 0.25, 1.0]),
        # All three, in the documented order: repetition, presence, frequency.
        (
            {"repetition_penalty": 2.0, "presence_penalty": 0.5, "frequency_penalty": 0.25},
            [1.0, -4.0, -0.75, -0.5, 1.0],
        ),
        # A negative presence penalty rewards repeats.
        ({"presence_penalty": -1.0}, [2.0, -2.0, 2.0, 1.5, 1.0]),
    ],
)
def test_penalties_exact(kwargs: dict[str, float], want: list[float]) -> None:
    logits, history = _penalty_case()
    want32 = padded(want, fill=-9.0)
    got = np.asarray(process_logits(logits, SamplingParams.make(**kwargs), history))
    np.testing.assert_array_equal(got, want32)
    # The sampled path shifts the maximum to 0 and divides by the temperature.
    hot = np.asarray(
        process_logits(logits, SamplingParams.make(temperature=2.0, **kwargs), history)
    )
    np.testing.assert_array_equal(hot, (want32 - want32.max()) / np.float32(2.0))


def test_penalties_steer_greedy() -> None:
    logits, history = _penalty_case()
    assert int(sample(logits, SamplingParams.greedy(), history, _KEYS[0])) == 0
    params = SamplingParams.make(repetition_penalty=4.0)
    assert int(sample(logits, params, history, _KEYS[0])) == 4


SETTINGS = [
    SamplingParams.greedy(),
    SamplingParams.make(temperature=1.0),
    SamplingParams.make(temperature=0.7, top_k=5),
    SamplingParams.make(temperature=1.3, top_p=0.8),
    SamplingParams.make(temperature=0.9, min_p=0.1),
    SamplingParams.make(
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=0.1,
    ),
]


_outer = jax.jit(lambda *args: sample(*args))  # the module's own jit inlined into another


@pytest.mark.parametrize("params", SETTINGS)
def test_seeded_determinism(params: SamplingParams) -> None:
    logits = jax.random.normal(jax.random.key(2), (50,)) * 2.0
    history = History.from_prompt([1, 2, 3], 50).add(jnp.int32(4))
    tokens = []
    for index in range(4):
        key = token_key(request_key(7), index)
        token = int(sample(logits, params, history, key))
        assert token == int(sample(logits, params, history, key))
        assert token == int(_outer(logits, params, history, key))
        tokens.append(token)
    if not params.is_greedy:  # control: different keys do draw different tokens
        assert len(set(tokens)) > 1


def test_jit_equals_op_by_op_execution() -> None:
    params = SETTINGS[-1]  # every stage on
    logits = jax.random.normal(jax.random.key(2), (50,)) * 2.0
    history = History.from_prompt([1, 2, 3], 50).add(jnp.int32(4))
    key = token_key(request_key(7), 3)
    with jax.disable_jit():
        token = int(sample(logits, params, history, key))
        eager = np.asarray(probabilities(logits, params, history))
    assert token == int(sample(logits, params, history, key))
    np.testing.assert_array_equal(eager, np.asarray(probabilities(logits, params, history)))


@pytest.mark.parametrize("params", SETTINGS)
def test_probabilities_are_a_distribution_zero_exactly_where_sample_never_lands(
    params: SamplingParams,
) -> None:
    logits = np.array([0.3, 2.0, -1.0, 1.2, 0.0, 1.9, -3.0, 0.8], np.float32)
    history = History.from_prompt([1, 3], V).add(jnp.int32(5))
    probs = np.asarray(probabilities(logits, params, history))
    assert abs(float(probs.sum()) - 1.0) < 1e-6
    assert np.all(probs >= 0.0)
    # Zero exactly where the processed logits are -inf (for the sampled path).
    if not params.is_greedy:
        processed = np.asarray(process_logits(logits, params, history))
        np.testing.assert_array_equal(probs == 0.0, np.isneginf(processed))
    picked = set(draws(logits, params, history).tolist())
    assert picked <= support(probs)


def _tv(samples: np.ndarray, probs: np.ndarray) -> float:
    freq = np.bincount(samples, minlength=len(probs)) / len(samples)
    return 0.5 * float(np.abs(freq - probs).sum())


def test_empirical_frequencies_match_probabilities() -> None:
    logits = padded([0.5, 1.5, -0.5, 1.0, 0.0, 2.0, -2.0])
    history = History.from_prompt([5], V).add(jnp.int32(1))
    params = SamplingParams.make(
        temperature=0.9, top_k=6, top_p=0.97, min_p=0.02, repetition_penalty=1.5
    )
    probs = np.asarray(probabilities(logits, params, history))
    samples = draws(logits, params, history)
    # Expected TV for 4000 draws over ~6 ids is about 0.01.
    assert _tv(samples, probs) < 0.03
    # Control: the same draws are far from a different setting's distribution.
    other = np.asarray(
        probabilities(logits, SamplingParams.make(temperature=0.9, top_k=3), history)
    )
    assert _tv(samples, other) > 0.06


def test_tiny_temperature_stays_finite() -> None:
    logits = padded([0.1, 0.3, 0.2])
    params = SamplingParams.make(temperature=1e-30)
    probs = np.asarray(probabilities(logits, params, EMPTY))
    np.testing.assert_array_equal(probs, padded([0.0, 1.0, 0.0], fill=0.0))


def test_one_program_serves_every_setting() -> None:
    traces: list[int] = []

    @jax.jit
    def counted(logits, params, history, key):  # type: ignore[no-untyped-def]
        traces.append(1)  # runs only while tracing
        return sample(logits, params, history, key), probabilities(logits, params, history)

    logits = jnp.linspace(-1.0, 1.0, 50)
    history = History.from_prompt([1, 2], 50)
    for params in SETTINGS:
        counted(logits, params, history, _KEYS[0])
    counted(logits, SETTINGS[1], History.empty(50).add(jnp.int32(3)), _KEYS[1])
    assert len(traces) == 1


def _primitives_by_cond_depth(jaxpr: jax.extend.core.Jaxpr, depth: int = 0) -> list:
    """``(primitive name, cond-nesting depth)`` of every equation in ``jaxpr``, sub-jaxprs
    included."""
    found = []
    for eqn in jaxpr.eqns:
        found.append((eqn.primitive.name, depth))
        inner = depth + (eqn.primitive.name == "cond")
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += _primitives_by_cond_depth(sub.jaxpr, inner)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += _primitives_by_cond_depth(sub, inner)
    return found


def _sorts_by_cond_depth(jaxpr: jax.extend.core.Jaxpr) -> list[int]:
    """The cond-nesting depth of every sort in ``jaxpr``."""
    return [depth for name, depth in _primitives_by_cond_depth(jaxpr) if name == "sort"]


def test_vocabulary_sort_sits_behind_two_conds() -> None:
    # Greedy (outer cond) and "top-k and top-p off" (inner cond) never reach the sort.
    closed = jax.make_jaxpr(sample)(
        jnp.zeros(50), SamplingParams.greedy(), History.empty(50), _KEYS[0]
    )
    depths = _sorts_by_cond_depth(closed.jaxpr)
    assert depths and min(depths) >= 2


def _batched_draw(truncate: bool):  # type: ignore[no-untyped-def]
    return jax.jit(jax.vmap(functools.partial(draw, truncate=truncate), in_axes=(0, 0, None, 0)))


def test_draw_without_truncation_is_bitwise_the_same_for_rows_that_need_none() -> None:
    """The batched programs' variant without the sort: greedy, plain-temperature, min-p and
    penalised rows draw exactly what the full sampler draws, rows side by side (under vmap the
    full sampler runs the sort branch as a select)."""
    untruncated = [SamplingParams.make(), SamplingParams.make(temperature=0.8),
                   SamplingParams.make(temperature=1.3, min_p=0.05, top_k=50),
                   SamplingParams.make(temperature=0.6, repetition_penalty=1.2)]
    assert not any(needs_truncation(p, 50) for p in untruncated)
    truncated = SamplingParams.make(temperature=1.0, top_k=3)
    assert needs_truncation(truncated, 50) and not needs_truncation(
        SamplingParams.make(top_k=3), 50)  # greedy never sorts
    logits = jax.random.normal(jax.random.key(1), (64, 50)) * 2.0
    history = History.from_prompt([3, 4], 50)
    keys = _KEYS[:64]

    def stacked(params_list):  # type: ignore[no-untyped-def]
        return jax.tree.map(lambda *x: jnp.stack(x * (64 // len(x))), *params_list)

    light, full = _batched_draw(False), _batched_draw(True)
    for params in (stacked(untruncated), stacked(untruncated[1:2])):
        assert np.array_equal(light(logits, params, history, keys),
                              full(logits, params, history, keys))
    # Control: a row that needs the sort does draw differently without it.
    params = stacked([truncated])
    assert not np.array_equal(light(logits, params, history, keys),
                              full(logits, params, history, keys))


@jax.jit
def _from_processed(logits, params, history, keys):  # type: ignore[no-untyped-def]
    """Each row processed once inside a loop, as the speculative rounds do, and both its
    distribution and its draw taken from the result."""

    def row(x, key):  # type: ignore[no-untyped-def]
        processed = process_logits(x, params, history)
        return distribution(processed, params), draw_processed(processed, params, key)

    return jax.lax.map(lambda a: row(*a), (logits, keys))


@pytest.mark.parametrize("params", SETTINGS)
def test_distribution_and_draw_of_processed_logits_are_bitwise_the_samplers(
    params: SamplingParams,
) -> None:
    logits = jax.random.normal(jax.random.key(4), (64, 50)) * 3.0
    logits = logits.at[::4].set(jnp.round(logits[::4]))  # ties, for the stable sort's order
    history = History.from_prompt([1, 2, 3], 50).add(jnp.int32(4)).add(jnp.int32(4))
    keys = _KEYS[:64]
    probs, tokens = _from_processed(logits, params, history, keys)
    want_probs = jax.vmap(probabilities, in_axes=(0, None, None))(logits, params, history)
    want_tokens = _rows(logits, params, history, keys)
    assert np.array_equal(np.asarray(probs).view(np.uint32),
                          np.asarray(want_probs).view(np.uint32))
    assert np.array_equal(tokens, want_tokens)
    if not params.is_greedy:  # control: the comparison sees a one-bit change of a logit
        top = int(jnp.argmax(logits[0]))
        bumped = logits.at[0, top].set(jnp.nextafter(logits[0, top], jnp.inf))
        got = np.asarray(_from_processed(bumped, params, history, keys)[0])
        assert not np.array_equal(got.view(np.uint32), np.asarray(probs).view(np.uint32))


def test_token_key_is_fold_in_of_the_index() -> None:
    base = request_key(3)
    a = jax.random.key_data(token_key(base, 5))
    np.testing.assert_array_equal(a, jax.random.key_data(jax.random.fold_in(base, 5)))
    assert not np.array_equal(a, jax.random.key_data(token_key(base, 6)))
    traced = jax.jit(token_key)(base, jnp.int32(5))
    np.testing.assert_array_equal(a, jax.random.key_data(traced))


def test_request_key_keeps_high_seed_bits() -> None:
    def data(seed: int) -> np.ndarray:
        return np.asarray(jax.random.key_data(request_key(seed)))

    assert not np.array_equal(data(5), data(2**32 + 5))
    assert not np.array_equal(data(0), data(2**63))
    np.testing.assert_array_equal(data(5), jax.random.key_data(jax.random.key(5)))


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, "7", True])
def test_request_key_rejects_bad_seeds(seed: object) -> None:
    with pytest.raises(BadInputError, match="seed"):
        request_key(seed)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"presence_penalty": float("inf")}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ],
)
def test_make_rejects_invalid_settings(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(BadInputError, match=name):
        SamplingParams.make(**kwargs)  # type: ignore[arg-type]


def test_make_builds_fixed_dtypes() -> None:
    params = SamplingParams.make(temperature=1, top_k=np.int64(3), top_p=0.5)
    assert params.top_k.dtype == jnp.int32
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        leaf = getattr(params, name)
        assert leaf.dtype == jnp.float32 and leaf.shape == () and not leaf.weak_type
    assert SamplingParams.greedy().is_greedy and not params.is_greedy


def test_history_and_logits_validation() -> None:
    with pytest.raises(BadInputError, match="vocabulary"):
        History.from_prompt([1, 9], 5)
    with pytest.raises(BadInputError, match="vocabulary"):
        History.from_prompt([-1], 5)
    with pytest.raises(BadInputError, match="vocab_size"):
        History.empty(0)
    assert not bool(History.from_prompt([], 5).seen.any())
    with pytest.raises(BadInputError, match="vocabulary of 5"):
        sample(jnp.zeros(6), SamplingParams.greedy(), History.empty(5), _KEYS[0])
    with pytest.raises(BadInputError, match="1-d"):
        sample(jnp.zeros((2, 5)), SamplingParams.greedy(), History.empty(5), _KEYS[0])


# -- the top-k / top-p filter from the best candidates ------------------------------------------

@pytest.mark.parametrize("spread", [0.3, 3.0, 12.0])
@pytest.mark.parametrize("rounded", [False, True])
def test_candidate_filter_keeps_what_the_whole_sort_keeps(spread: float, rounded: bool) -> None:
    """Over a vocabulary of 1,000 ids the filter ranks only the best candidates (with a
    fallback to the whole sort when they cannot decide): the same keep mask as the sort, for
    top-k below, at and above the candidates, top-p cuts near and far, and ties (rounded
    logits: many equal values, the lower id first)."""
    from turbospark_jax.core.sampling import _candidate_filters, _sort_filters, candidates

    count = candidates()
    assert count == 64

    rng = np.random.default_rng(int(spread * 10) + rounded)
    logits = rng.standard_normal(1000) * spread
    if rounded:
        logits = np.round(logits * 2) / 2
    scaled = jnp.asarray(logits - logits.max(), jnp.float32)
    candidate, whole = jax.jit(_candidate_filters), jax.jit(_sort_filters)
    for top_k in (0, 1, 5, 50, count, count + 1, 200, 1000):
        for top_p in (1.0, 0.99, 0.9, 0.5, 0.1):
            if top_k in (0, 1000) and top_p == 1.0:
                continue  # nothing to filter: the sampler never calls either
            params = SamplingParams.make(temperature=1.0, top_k=top_k, top_p=top_p)
            got, want = np.asarray(candidate(scaled, params)), np.asarray(whole(scaled, params))
            assert np.array_equal(got, want), (top_k, top_p)


def test_control_the_candidate_check_sees_one_id_more() -> None:
    from turbospark_jax.core.sampling import _candidate_filters, _sort_filters

    scaled = jnp.asarray(np.random.default_rng(0).standard_normal(1000), jnp.float32)
    got = np.asarray(_candidate_filters(scaled, SamplingParams.make(temperature=1.0, top_k=50)))
    assert got.sum() == 50
    want = np.asarray(_sort_filters(scaled, SamplingParams.make(temperature=1.0, top_k=49)))
    assert not np.array_equal(got, want)


@pytest.mark.parametrize("top_k", [10, 0])
def test_draws_among_the_candidates_follow_the_distribution(top_k: int) -> None:
    """Over 1,000 ids, once top-k (10) or top-p (a peaked row) leaves at most the candidate
    count possible, the Gumbel noise is drawn for the candidates alone: the frequencies still
    follow ``probabilities``; every draw is a possible id. (Control: the same draws are far
    from the distribution top-k = 2 would give.)"""
    rng = np.random.default_rng(5)
    logits = np.asarray(rng.standard_normal(1000) * (1.0 if top_k else 6.0), np.float32)
    history = History.empty(1000)
    params = SamplingParams.make(temperature=1.0, top_k=top_k, top_p=0.9 if not top_k else 1.0)
    probs = np.asarray(probabilities(logits, params, history))
    assert 0 < (probs > 0).sum() <= 16  # within the candidates
    samples = draws(logits, params, history)
    assert np.all(probs[samples] > 0)
    assert _tv(samples, probs) < 0.05
    other = SamplingParams.make(temperature=1.0, top_k=2)
    assert _tv(samples, np.asarray(probabilities(logits, other, history))) > 0.1


@pytest.mark.parametrize("block", [1024, 128, 4096])
@pytest.mark.parametrize("n", [1025, 5000, 128256])
def test_blocked_top_is_one_top_k(n: int, block: int, monkeypatch) -> None:
    """The GPU's candidate search (best 64 of each block of ``TOP_BLOCK`` ids, 1,024 by
    default, level by level) gives ``lax.top_k``'s values and ids bit for bit, whatever the
    block (``rowinv_model --top-block`` times others): with many ties (rounded logits; the
    lower id first), impossible ids (-inf) and the best ids bunched into one block."""
    from turbospark_jax.core import sampling
    from turbospark_jax.core.sampling import _blocked_top

    monkeypatch.setattr(sampling, "TOP_BLOCK", block)

    rng = np.random.default_rng(n)
    x = np.round(rng.standard_normal(n) * 4) / 4
    x[rng.random(n) < 0.3] = -np.inf
    x[2048 % n : 2048 % n + 100] += 10.0  # a block holding more than a block's share
    x = jnp.asarray(x, jnp.float32)
    got, want = jax.jit(lambda v: _blocked_top(v, 64))(x), jax.lax.top_k(x, 64)
    assert np.array_equal(np.asarray(got[0]).view(np.uint32), np.asarray(want[0]).view(np.uint32))
    assert np.array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_control_fewer_than_the_count_per_block_misses_bunched_ids() -> None:
    """Why each block keeps the full count: keeping 16 a block (XLA's fast top-k) loses ids
    when one block holds more of the best 64, which the comparison above would see."""
    x = np.zeros(4096, np.float32)
    x[:40] = 5.0 + np.arange(40)  # 40 of the best in block 0
    x[1024::37] = 1.0
    x = jnp.asarray(x)
    blocks = x.reshape(4, 1024)
    best16, at = jax.lax.top_k(blocks, 16)
    ids16 = (at + jnp.arange(4)[:, None] * 1024).reshape(-1)
    _, pick = jax.lax.top_k(best16.reshape(-1), 64)
    whole = jax.lax.top_k(x, 64)[1]
    assert set(np.asarray(ids16[pick]).tolist()) != set(np.asarray(whole).tolist())


def test_off_a_cpu_the_candidates_come_from_blocks(monkeypatch) -> None:
    """Off a CPU the filter and the draw rank their candidates with the blocked search (no
    sort of the whole vocabulary, whose GPU form is about thirty kernels): the filter keeps
    what the whole sort keeps, and a ``"top_k"`` draw plan sorts nothing longer than a block.
    (On a CPU the filter takes ``lax.top_k`` itself: its own kernel there.)"""
    from turbospark_jax.core import sampling
    from turbospark_jax.core.sampling import _candidate_filters, _sort_filters

    def sorted_lengths(fn, *args) -> list[int]:
        # a fresh function each time: a cached trace would hide the backend's change
        closed = jax.make_jaxpr(lambda *a: fn(*a))(*args)
        out = []

        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                if eqn.primitive.name in ("sort", "top_k"):
                    out.append(eqn.invars[0].aval.shape[-1])
                for value in eqn.params.values():
                    for sub in value if isinstance(value, tuple | list) else (value,):
                        if isinstance(sub, jax.extend.core.ClosedJaxpr):
                            walk(sub.jaxpr)
                        elif isinstance(sub, jax.extend.core.Jaxpr):
                            walk(sub)

        walk(closed.jaxpr)
        return out

    rng = np.random.default_rng(3)
    scaled = jnp.asarray(np.round(rng.standard_normal(5000) * 3) / 2, jnp.float32)
    scaled = scaled - jnp.max(scaled)
    params = SamplingParams.make(temperature=1.0, top_k=40, top_p=0.9)
    assert sorted_lengths(lambda x: sampling._top(x, 64), scaled) == [5000]  # lax.top_k
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    lengths = sorted_lengths(
        lambda x, p, h, k: sampling.draw_as("top_k", x, p, h, k),
        scaled, params, History.empty(5000), _KEYS[0])
    assert lengths and max(lengths) <= sampling.TOP_BLOCK
    for top_k, top_p in ((40, 0.9), (64, 1.0), (0, 0.5), (200, 0.9)):
        p = SamplingParams.make(temperature=1.0, top_k=top_k, top_p=top_p)
        got = np.asarray(jax.jit(lambda x, p: _candidate_filters(x, p))(scaled, p))
        want = np.asarray(_sort_filters(scaled, p))
        assert np.array_equal(got, want), (top_k, top_p)
