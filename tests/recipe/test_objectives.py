"""Training the Qwen3.5 target with its MTP head: the chunked training forward agrees with the
exact one, and a few optimizer steps on a repeating corpus lower both losses."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_recipe.objectives import (
    compute_params,
    cross_entropy,
    head_cross_entropy,
    output_head,
    qwen35_mtp_loss,
)

CONFIG = QC.Qwen35Config(
    vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    layer_types=(QC.LINEAR, QC.FULL), mtp_num_hidden_layers=1, initializer_range=0.1)


def test_training_forward_matches_the_exact_forward() -> None:
    """Three sequences of 150 tokens (three chunks of the delta rule, one partial): the batched
    training pass is each sequence's exact forward, within float32 rounding."""
    model = Q.Qwen35Model(CONFIG, jnp.float32)
    params = model.init_params(jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 150), 0, CONFIG.vocab_size)
    exact = model.forward(params, tokens)
    logits, hidden = jax.jit(model.train_forward)(params, tokens)
    assert hidden.shape == (3, 150, CONFIG.hidden_size)
    assert float(jnp.abs(logits - exact).max()) < 1e-4
    # control: the same pass over rows that are not the tokens' own must differ
    shuffled, _ = jax.jit(model.train_forward)(params, tokens[::-1])
    assert float(jnp.abs(shuffled - exact).max()) > 1e-2


def test_training_mtp_rows_match_the_mtp_block_path() -> None:
    """The MTP head's training rows (one causal pass over the batch) equal its block path's,
    which writes and reads its own KV rows, within float32 rounding."""
    model = Q.Qwen35Model(CONFIG, jnp.float32)
    params = model.init_params(jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 30), 0, CONFIG.vocab_size)
    _, hidden = model.train_forward(params, tokens)
    got = jax.jit(model.mtp_train_hidden)(params, hidden, tokens)
    assert got.shape == (2, 29, CONFIG.hidden_size)
    for b in range(2):
        n = 29
        _, want, _ = model.mtp_block_forward(
            params, model.mtp_init_cache(n), hidden[b, :n], tokens[b, 1:],
            jnp.arange(n, dtype=jnp.int32), jnp.int32(n))
        assert float(jnp.abs(got[b] - want).max()) < 1e-4
    # control: the head reading the hidden state one row late must differ
    late = jax.jit(model.mtp_train_hidden)(params, jnp.roll(hidden, 1, axis=1), tokens)
    assert float(jnp.abs(late - got).max()) > 1e-2


def test_joint_training_lowers_both_losses() -> None:
    model = Q.Qwen35Model(CONFIG, jnp.float32)
    params = model.init_params(jax.random.PRNGKey(0))
    pattern = np.random.default_rng(0).integers(0, CONFIG.vocab_size, 12)
    rows = jnp.asarray(np.stack([np.roll(np.tile(pattern, 4), -i)[:33] for i in range(8)]))
    optimizer = optax.adam(6e-3)
    loss_fn = functools.partial(qwen35_mtp_loss, model, mtp_weight=0.5)

    @jax.jit
    def step(params, opt_state):
        (_, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rows)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, parts

    opt_state = optimizer.init(params)
    params, opt_state, first = step(params, opt_state)
    for _ in range(20):
        params, opt_state, last = step(params, opt_state)
    assert float(last["loss"]) < 0.5 * float(first["loss"])
    assert float(last["mtp_loss"]) < 0.5 * float(first["mtp_loss"])
    assert float(cross_entropy(jnp.zeros((1, 3, 4)), jnp.zeros((1, 3), jnp.int32))) == (
        np.float32(np.log(4)))


def test_the_sliced_head_loss_is_the_whole_head_loss() -> None:
    """Slices of 7 rows over 3 x 10 rows (the last slice padded): loss and gradients as from the
    whole logits; a mask that keeps the padding rows changes the loss (the check can fail)."""
    model = Q.Qwen35Model(CONFIG, jnp.float32)
    params = model.init_params(jax.random.PRNGKey(0))
    hidden = jax.random.normal(jax.random.PRNGKey(2), (3, 10, CONFIG.hidden_size))
    targets = jax.random.randint(jax.random.PRNGKey(3), (3, 10), 0, CONFIG.vocab_size)

    def whole(p, h):
        return cross_entropy(model.head_logits(p, h.reshape(30, -1)), targets.reshape(30))

    def sliced(p, h, rows=7):
        return head_cross_entropy(functools.partial(model.head_logits, p), h, targets, rows)

    want, want_grads = jax.value_and_grad(whole, argnums=(0, 1))(params, hidden)
    for rows in (7, 30, 64):
        got, got_grads = jax.value_and_grad(sliced, argnums=(0, 1))(params, hidden, rows)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    # control: the same slices without dropping the padded rows' terms
    padded = jnp.pad(hidden.reshape(-1, CONFIG.hidden_size), ((0, 5), (0, 0)))
    leaky = cross_entropy(model.head_logits(params, padded),
                          jnp.pad(targets.reshape(-1), (0, 5))) * 35 / 30
    assert abs(float(leaky) - float(want)) > 1e-3


def test_embedding_gradient_sums_in_float32() -> None:
    """A token repeated in every position of a bfloat16 run: the gradient its embedding row
    gets through the loss equals the float32 sum of the rows' gradients. Casting the table
    before the lookup (the control) sums in bfloat16 and stalls far below it."""
    model = Q.Qwen35Model(CONFIG, jnp.bfloat16)
    params = Q.Qwen35Model(CONFIG, jnp.float32).init_params(jax.random.PRNGKey(0))
    tokens = jnp.full((4, 512), 5, jnp.int32)
    probe = jax.random.normal(jax.random.PRNGKey(2), (4, 512, CONFIG.hidden_size)) * 1e-3

    def through(lookup):
        # d/d(table) of <probe, embed(tokens)>: every position adds its probe row to row 5
        return jax.grad(lambda t: jnp.sum(lookup(t).astype(jnp.float32) * probe))(
            params["embed_tokens"])[5]

    # each position's row gradient reaches the lookup in bfloat16 (the rows' dtype)
    want = np.asarray(probe.astype(jnp.bfloat16), np.float64).sum(axis=(0, 1))
    ours = through(lambda t: model._embed(compute_params(model, {**params,
                                                                 "embed_tokens": t}), tokens))
    assert np.abs(np.asarray(ours, np.float64) - want).max() < 1e-5 * np.abs(want).max() + 1e-6
    cast_first = through(lambda t: model._embed({"embed_tokens": t.astype(jnp.bfloat16)},
                                                tokens))
    assert np.abs(np.asarray(cast_first, np.float64) - want).max() > 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("tied", [True, False])
def test_output_head_matches_the_model_head_with_bfloat16_backward_products(tied: bool) -> None:
    """The training head gives the model head's float32 logits bit for bit, its gradients
    agree with float32 ones within bfloat16 rounding, and its backward pass multiplies in
    bfloat16 (no float32 product over the vocabulary)."""
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    model = Q.Qwen35Model(config, jnp.bfloat16)
    params = Q.Qwen35Model(config, jnp.float32).init_params(jax.random.PRNGKey(0))
    key = "embed_tokens" if tied else "lm_head"
    compute = compute_params(model, params)
    hidden = jax.random.normal(jax.random.PRNGKey(3), (6, config.hidden_size), jnp.bfloat16)
    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    assert np.array_equal(output_head(model, compute)(hidden), model.head_logits(bf16, hidden))

    def loss(matrix, h, head_of):
        return jnp.sum(jnp.sin(head_of({**compute, key: matrix})(h)))

    def float32_head(c):
        matrix = c["embed_tokens"] if tied else c["lm_head"].T.astype(jnp.float32)
        return lambda h: jnp.einsum("nd,vd->nv", h, matrix, precision="highest")

    ours = jax.grad(loss, argnums=(0, 1))(params[key], hidden, lambda c: output_head(model, c))
    ref = jax.grad(loss, argnums=(0, 1))(params[key], hidden.astype(jnp.float32), float32_head)
    for got, want in zip(ours, ref, strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.linalg.norm(want) > 0
        assert np.linalg.norm(got - want) < 2e-2 * np.linalg.norm(want)
    backward = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(
        params[key], hidden, lambda c: output_head(model, c))
    products = [e for e in _all_eqns(backward.jaxpr) if e.primitive.name == "dot_general"]
    assert len(products) == 3  # the forward product and the backward pair
    assert all(v.aval.dtype == jnp.bfloat16 for e in products for v in e.invars)
    # control: the model's own head, differentiated as it stands, multiplies in float32
    plain = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(
        bf16[key], hidden, lambda c: functools.partial(model.head_logits, c))
    products = [e for e in _all_eqns(plain.jaxpr) if e.primitive.name == "dot_general"]
    assert any(v.aval.dtype == jnp.float32 for e in products for v in e.invars)


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _all_eqns(sub)
