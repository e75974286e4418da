"""The block drafter over a Qwen3.5 target (DeltaNet and full-attention layers, tap rows in its
cache): a few steps of the training loop lower the loss, the exported folder loads, and the
loaded drafter is lossless through the host and the device rounds, greedy bit for bit and
sampled alike; bad arguments to the loop are refused."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax import CompletionRequest, SamplingConfig, run_raw_completion
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative
from turbospark_jax.io.drafter_folders import load_block_drafter
from turbospark_jax.models import block_drafter as BD
from turbospark_jax.models.dense.model import DenseModel
from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_jax.speculative.drafters import BlockDrafter
from turbospark_jax.speculative.drafters.block import tapped_target
from turbospark_jax.speculative.pair import SpeculativePair
from turbospark_recipe import block_drafter_training as T

V, B = 8, 5
TARGET_CONFIG = QC.Qwen35Config.from_hf_dict(dict(
    model_type="qwen3_5_text", vocab_size=V, hidden_size=32, intermediate_size=48,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    num_hidden_layers=4, layer_types=[QC.LINEAR, QC.LINEAR, QC.LINEAR, QC.FULL],
    mtp_num_hidden_layers=1, initializer_range=0.3,
))
TARGET_PARAMS = Q.Qwen35Model(TARGET_CONFIG).init_params(jax.random.PRNGKey(0))
DRAFTER_CONFIG = dataclasses.replace(
    T.default_drafter_config(TARGET_CONFIG, block_size=B, mask_token_id=V - 1),
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    intermediate_size=64)
ROWS = np.random.default_rng(0).integers(0, V, size=(24, 20))
PROMPT = [5, 1, 2, 6, 5, 3, 5, 7, 2, 4, 3, 0]
GREEDY = CompletionRequest(prompt_ids=PROMPT, max_tokens=20, record_logits=True)


@pytest.fixture(scope="module")
def trained():
    return T.train_block_drafter(TARGET_CONFIG, TARGET_PARAMS, ROWS[:16], ROWS[16:],
                                 DRAFTER_CONFIG, steps=12, batch_size=4, lr=1e-2, seed=1,
                                 warmup_steps=2, anchors_per_row=6, progress=False)


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bd35")
    T.export_block_drafter(folder, trained.config, trained.params)
    return load_block_drafter(folder, dtype="float32")


@pytest.fixture(scope="module")
def target(exported):
    model = tapped_target(Q.Qwen35Model(TARGET_CONFIG), exported[0])
    return BlockProducer(model, TARGET_PARAMS, capacity=64, width=B, steps_per_call=8)


def test_a_few_steps_lower_the_loss_and_report(trained):
    losses = [h["loss"] for h in trained.history if h["kind"] == "train"]
    assert len(losses) == 12 and trained.finished and trained.steps_done == 12
    assert np.mean(losses[-3:]) < losses[0] - 0.1, losses
    last = trained.last_eval
    assert last is not None and np.isfinite(last["loss"])
    acceptance = last["acceptance"]
    assert len(acceptance) == B - 1 and all(0 <= a <= 1 for a in acceptance)
    assert all(a >= b for a, b in itertools.pairwise(acceptance))
    assert trained.timings["tokens_per_s"] > 0
    # the default shape for the recipe's hidden-384 target stays within its budget
    big = dataclasses.replace(TARGET_CONFIG, hidden_size=384, num_hidden_layers=8,
                              layer_types=(QC.LINEAR,) * 3 + (QC.FULL,) + (QC.LINEAR,) * 3
                              + (QC.FULL,), pad_token_id=3)
    config = T.default_drafter_config(big)
    count = sum(int(np.prod(s)) for s in jax.tree.leaves(
        BD.param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)))
    assert count <= 3_500_000 and config.mask_token_id == 3
    assert config.target_layer_ids == (0, 2, 5, 7)


def test_the_export_loads_as_trained(trained, exported):
    config, params = exported
    assert config == trained.config
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(trained.params), strict=True):
        assert np.array_equal(np.asarray(got),
                              np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32))


@pytest.mark.parametrize("device", [True, False], ids=["device", "host"])
def test_greedy_with_the_trained_drafter_is_plain_greedy_bit_for_bit(target, exported, device):
    plain = run_raw_completion(target, GREEDY)
    pair = SpeculativePair(target, BlockDrafter(target, *exported), device_rounds=device)
    got = run_raw_completion_speculative(pair, dataclasses.replace(GREEDY, draft_len=B - 1))
    assert got.speculative.on_device == device
    assert got.token_ids == plain.token_ids and got.fed_ids == plain.fed_ids
    assert np.array_equal(got.logits.view(np.uint32), plain.logits.view(np.uint32))
    assert sum(got.speculative.accepted_by_position) > 0  # commits and rollbacks both ran
    # Control: the bitwise comparison sees a one-bit change of one logit.
    nudged = plain.logits.copy()
    nudged.view(np.uint32)[0, 0] ^= 1
    assert not np.array_equal(got.logits.view(np.uint32), nudged.view(np.uint32))


def test_device_and_host_rounds_agree_when_sampling(target, exported):
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=16, record_logits=True, seed=3,
                            sampling=SamplingConfig(temperature=0.9), draft_len=B - 1)
    drafter = BlockDrafter(target, *exported)
    a = run_raw_completion_speculative(SpeculativePair(target, drafter), req)
    b = run_raw_completion_speculative(SpeculativePair(target, drafter, device_rounds=False),
                                       req)
    assert a.token_ids == b.token_ids and a.fed_ids == b.fed_ids
    assert a.speculative.accepted_by_position == b.speculative.accepted_by_position


def test_bad_arguments_are_refused(exported):
    config, params = exported
    untapped = BlockProducer(Q.Qwen35Model(TARGET_CONFIG), TARGET_PARAMS, capacity=16, width=B)
    with pytest.raises(BadInputError, match="tap_layers"):
        BlockDrafter(untapped, config, params)
    with pytest.raises(BadInputError, match="layers"):
        tapped_target(Q.Qwen35Model(dataclasses.replace(
            TARGET_CONFIG, num_hidden_layers=3, layer_types=(QC.LINEAR, QC.LINEAR, QC.FULL))),
            config)
    assert tapped_target(Q.Qwen35Model(TARGET_CONFIG), config).tap_layers == \
        config.target_layer_ids
    assert Q.Qwen35Model.can_tap and DenseModel.can_tap
    call = dict(steps=1, batch_size=2, lr=1e-3, progress=False)
    with pytest.raises(BadInputError, match="heldout_rows"):
        T.train_block_drafter(TARGET_CONFIG, TARGET_PARAMS, ROWS, ROWS[:, :3], config, **call)
    with pytest.raises(BadInputError, match="vocabulary"):
        T.train_block_drafter(TARGET_CONFIG, TARGET_PARAMS, ROWS + V, ROWS, config, **call)
    with pytest.raises(BadInputError, match="steps"):
        T.train_block_drafter(TARGET_CONFIG, TARGET_PARAMS, ROWS, ROWS, config,
                              **{**call, "steps": 0})
    with pytest.raises(BadInputError, match="hidden_size"):
        T.train_block_drafter(TARGET_CONFIG, TARGET_PARAMS, ROWS, ROWS,
                              dataclasses.replace(config, hidden_size=16), **call)
    with pytest.raises(BadInputError, match="dtype"):
        T.export_block_drafter("/nonexistent", config, params, dtype="int8")
