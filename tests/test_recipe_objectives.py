"""Training the Qwen3.5 target with its MTP head: the chunked training forward agrees with the
exact one, and a few optimizer steps on a repeating corpus lower both losses."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from turbospark_jax.models import qwen3_5 as Q
from turbospark_jax.models import qwen3_5_config as QC
from turbospark_jax.recipe.objectives import cross_entropy, qwen35_mtp_loss

CONFIG = QC.Qwen35Config(
    vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    layer_types=(QC.LINEAR, QC.FULL), mtp_num_hidden_layers=1, initializer_range=0.1)


def test_training_forward_matches_the_exact_forward() -> None:
    model = Q.Qwen35Model(CONFIG, jnp.float32)
    params = model.init_params(jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 40), 0, CONFIG.vocab_size)
    exact = model.forward(params, tokens)
    logits, hidden = jax.jit(model.train_forward)(params, tokens)
    assert hidden.shape == (1, 40, CONFIG.hidden_size)
    assert float(jnp.abs(logits - exact).max()) < 1e-4


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
