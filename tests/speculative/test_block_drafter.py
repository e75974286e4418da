"""The block drafter: lossless through the device and the host rounds at every block size,
taps recorded bitwise alike by chunked and token-by-token prefill, its KV rewound and keyed on
what the target fed, a bidirectional block, folders that round-trip, bad pairings refused and
a training step that learns."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from turbospark_jax import CompletionRequest, SamplingConfig, run_raw_completion
from turbospark_jax.core.sampling import History, SamplingParams
from turbospark_jax.core.state import live_equal, tree_bitwise_equal
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.generation.speculative_loop import MAX_DRAFT, run_raw_completion_speculative
from turbospark_jax.io.drafter_folders import load_block_drafter, save_block_drafter
from turbospark_jax.models import block_drafter as BD
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel
from turbospark_jax.speculative.drafters import BlockDrafter
from turbospark_jax.speculative.pair import SpeculativePair
from turbospark_jax.speculative.rounds import judge, point_masses
from turbospark_recipe import block_drafter_training as T

V, D, TAPS = 8, 32, (0, 1)
CONFIG = DenseConfig.from_hf_dict(dict(
    model_type="qwen3", vocab_size=V, hidden_size=D, intermediate_size=48,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
    max_position_embeddings=128, initializer_range=0.3,
))
MODEL = DenseModel(CONFIG, tap_layers=TAPS)
PARAMS = MODEL.init_params(jax.random.PRNGKey(0))
TARGET = BlockProducer(MODEL, PARAMS, capacity=64, width=9, steps_per_call=8)
PROMPT = [5, 1, 2, 6, 5, 3, 5, 7, 2, 4, 3, 0]
GREEDY = CompletionRequest(prompt_ids=PROMPT, max_tokens=20, record_logits=True)
PLAIN = run_raw_completion(TARGET, GREEDY)
# The frozen target's pass over the prompt (jitted once; training and references share it).
BATCH = T.target_batch(MODEL, PARAMS, jnp.asarray([PROMPT]))


def _drafter_config(block_size: int = 4, **changes) -> BD.BlockDrafterConfig:
    values = dict(hidden_size=D, vocab_size=V, target_layer_ids=TAPS,
                  target_num_hidden_layers=2, block_size=block_size, mask_token_id=V - 1,
                  head_dim=8, initializer_range=0.3)
    return BD.BlockDrafterConfig(**{**values, **changes})


def _drafter(block_size: int = 4, **kw) -> BlockDrafter:
    """A random drafter whose residual branches are scaled down, so its proposals lean on
    the mask token's embedding (6, which the target emits often) and are sometimes right:
    rounds then keep proposals as well as reject them."""
    return BlockDrafter(TARGET, _drafter_config(block_size, mask_token_id=6), DRAFTER_PARAMS,
                        **kw)


# The params' shapes do not depend on the block size: one set serves every size.
DRAFTER_PARAMS = BD.init_params(_drafter_config(), jax.random.PRNGKey(1))
for _name in ("o_proj", "down_proj"):
    DRAFTER_PARAMS["layers"][_name] = DRAFTER_PARAMS["layers"][_name] * 0.3


def _check_plain(got):
    assert got.token_ids == PLAIN.token_ids
    assert np.array_equal(got.logits.view(np.uint32), PLAIN.logits.view(np.uint32))
    assert got.fed_ids == PLAIN.fed_ids


@pytest.mark.parametrize("block_size", [2, 3, 4, 5, 6, 7, 8])
def test_greedy_host_rounds_are_plain_greedy_bit_for_bit(block_size):
    pair = SpeculativePair(TARGET, _drafter(block_size), device_rounds=False)
    got = run_raw_completion_speculative(pair, dataclasses.replace(GREEDY,
                                                                   draft_len=block_size - 1))
    assert not got.speculative.on_device
    _check_plain(got)
    assert sum(got.speculative.accepted_by_position) > 0  # rollbacks and commits both ran


@pytest.mark.parametrize("block_size", [8])
def test_greedy_device_rounds_are_plain_greedy_bit_for_bit(block_size):
    pair = SpeculativePair(TARGET, _drafter(block_size))
    got = run_raw_completion_speculative(pair, dataclasses.replace(GREEDY,
                                                                   draft_len=block_size - 1))
    assert got.speculative.on_device
    _check_plain(got)
    assert sum(got.speculative.accepted_by_position) > 0  # rollbacks and commits both ran


def test_device_and_host_rounds_agree_when_sampling():
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=16, record_logits=True, seed=3,
                            sampling=SamplingConfig(temperature=0.9), draft_len=7)
    a = run_raw_completion_speculative(SpeculativePair(TARGET, _drafter(8)), req)
    b = run_raw_completion_speculative(
        SpeculativePair(TARGET, _drafter(8), device_rounds=False), req)
    assert a.token_ids == b.token_ids and a.fed_ids == b.fed_ids
    assert a.speculative.accepted_by_position == b.speculative.accepted_by_position


def test_sampled_first_token_follows_the_target_through_the_rejection_sampler():
    """The drafter's real proposals (point masses) judged against the target's real rows,
    20,000 keys: the first emitted token is distributed as the target's row; the control,
    always keeping the proposal, is far from it."""
    drafter = _drafter()
    state = TARGET.prefill_chunk(TARGET.init_state(), PROMPT[:-1], 0)[1]
    proposals, _ = drafter.block(drafter.init_state(), PROMPT, 3, target=state)
    rows, _ = TARGET.verify(state, [PROMPT[-1], *proposals], len(PROMPT) - 1)
    rows = jnp.zeros((MAX_DRAFT + 1, V)).at[:4].set(rows[:4])
    padded = jnp.zeros((MAX_DRAFT,), jnp.int32).at[:3].set(jnp.asarray(proposals))
    q = point_masses(padded, jnp.int32(3), V)
    params = SamplingParams.make(temperature=1.0)

    def first(key):
        return judge(rows, q, padded, jnp.int32(3), params, History.empty(V), key,
                     jnp.int32(0))[0][0]

    draws = np.asarray(jax.jit(jax.vmap(first))(jax.random.split(jax.random.PRNGKey(0), 20000)))
    emp = np.bincount(draws, minlength=V) / len(draws)
    p0 = np.asarray(jax.nn.softmax(rows[0]))
    assert 0.5 * np.abs(emp - p0).sum() < 0.02
    assert 0.5 * np.abs(np.eye(V)[proposals[0]] - p0).sum() > 0.1  # the control


def test_chunked_prefill_taps_equal_token_by_token_taps_bitwise():
    chunked = TARGET.prefill_chunk(TARGET.init_state(), PROMPT, 0)[1]
    stepped = TARGET.init_state()
    for i, tok in enumerate(PROMPT):
        stepped = TARGET.produce_prefill(stepped, tok, i)
    n = len(PROMPT)
    assert np.array_equal(np.asarray(chunked.cache.taps[:n]).view(np.uint32),
                          np.asarray(stepped.cache.taps[:n]).view(np.uint32))
    assert live_equal(chunked, stepped)
    # Control: one different token changes that row's taps and every later one, not earlier.
    other = TARGET.prefill_chunk(TARGET.init_state(), [*PROMPT[:6], 0, *PROMPT[7:]], 0)[1]
    differs = np.any(np.asarray(other.cache.taps[:n]) != np.asarray(chunked.cache.taps[:n]),
                     axis=(1, 2))
    assert not differs[:6].any() and differs[6:].all()
    # The taps are the tapped layers' outputs: the cache-free forward (another program, so
    # float32 rounding apart: 1.1e-5 measured with jaxlib 0.10.2 on this CPU) agrees within
    # the 1e-4 every cross-program parity check states.
    np.testing.assert_allclose(BATCH.taps[0], chunked.cache.taps[:n], atol=1e-4)


def test_without_tap_layers_nothing_is_recorded():
    plain = DenseModel(CONFIG)
    assert type(plain.init_cache(4)).__name__ == "DenseCache"
    assert not hasattr(plain.init_cache(4), "taps")


def test_proposals_equal_a_reference_pass_over_the_whole_prompt():
    """Reference apart from the drafter's catch-up: the cache-free target forward's taps and
    one pass at the last prompt position."""
    drafter = _drafter(5)
    state = TARGET.prefill_chunk(TARGET.init_state(), PROMPT[:-1], 0)[1]
    got, _ = drafter.block(drafter.init_state(), PROMPT, 4, target=state)
    model = BD.BlockDrafterModel(drafter.config)
    logits = BD.sequence_block_logits(
        model, DRAFTER_PARAMS, BD.shared_weights(PARAMS, CONFIG.tie_word_embeddings),
        BATCH.taps[0],
        jnp.asarray(PROMPT), jnp.asarray([len(PROMPT) - 1]))
    assert got == [int(t) for t in jnp.argmax(logits[0, 1:], axis=-1)]


def test_rewound_drafter_rebuilds_exactly_and_stale_rows_are_dropped():
    drafter = _drafter()
    state = TARGET.prefill_chunk(TARGET.init_state(), PROMPT[:-1], 0)[1]
    fresh_props, full = drafter.block(drafter.init_state(), PROMPT, 3, target=state)
    assert drafter.position(full) == len(PROMPT) - 1
    # Rewind the drafter to 5 positions; drafting again catches up to the same state.
    rewound = drafter.rewind(full, 5, lambda: PROMPT)
    assert drafter.position(rewound) == 5
    again_props, again = drafter.block(rewound, PROMPT, 3, target=state)
    assert again_props == fresh_props and live_equal(again, full)
    # The target rolled back to 6 and fed other tokens: the drafter's rows past 6 are stale
    # (same count, other lineage) and are rebuilt; it ends where a fresh drafter does.
    other = TARGET.prefill_chunk(TARGET.rewind(state, 6), [0, 0, 1, 1, 2], 6)[1]
    props, kept = drafter.block(full, [*PROMPT[:6], 0, 0, 1, 1, 2, 3], 3, target=other)
    want_props, want = drafter.block(drafter.init_state(), [*PROMPT[:6], 0, 0, 1, 1, 2, 3], 3,
                                     target=other)
    assert props == want_props and live_equal(kept, want)
    # Control: the stale state's KV rows really differ from the rebuilt ones past 6.
    assert not tree_bitwise_equal(full.cache.k[:, 6:11], want.cache.k[:, 6:11])
    assert tree_bitwise_equal(full.cache.k[:, :6], want.cache.k[:, :6])


def test_the_block_attends_bidirectionally():
    """With one drafter layer the last row sees the same keys either way (equal logits);
    every earlier row sees later mask rows only when bidirectional (different logits)."""
    config = _drafter_config(5, mask_token_id=6)
    assert config.num_hidden_layers == 1
    shared = BD.shared_weights(PARAMS, CONFIG.tie_word_embeddings)
    anchors = jnp.asarray([len(PROMPT) - 1])  # the reference test's call, so one compile
    both = [BD.sequence_block_logits(BD.BlockDrafterModel(config, bidirectional=b),
                                     DRAFTER_PARAMS, shared, BATCH.taps[0],
                                     jnp.asarray(PROMPT), anchors)
            for b in (True, False)]
    np.testing.assert_allclose(both[0][:, -1], both[1][:, -1], atol=1e-5)
    assert np.all(np.abs(both[0][:, :-1] - both[1][:, :-1]).max(axis=-1) > 1e-4)
    # and the proposals (rows 1 .. B - 1) differ somewhere
    proposals = [np.argmax(np.asarray(x[:, 1:]), axis=-1) for x in both]
    assert not np.array_equal(proposals[0], proposals[1])


def test_folder_round_trip_and_bad_folders(tmp_path):
    config, params = _drafter_config(3), DRAFTER_PARAMS  # the params fit any block size
    save_block_drafter(tmp_path / "d", config, params)
    loaded_config, loaded = load_block_drafter(tmp_path / "d")
    assert loaded_config == config and tree_bitwise_equal(loaded, params)
    _, half = load_block_drafter(tmp_path / "d", dtype="bfloat16")
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(half))
    with pytest.raises(ModelLoadError, match="model_type"):
        load_block_drafter(_write_other(tmp_path))
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_block_drafter(tmp_path / "missing")
    bigger = _zeros(_drafter_config(3, intermediate_size=80))
    with pytest.raises(ModelLoadError, match=r"down_proj|gate_proj|up_proj"):
        save_block_drafter(tmp_path / "e", config, bigger)


def _write_other(tmp_path):
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    return folder


def _zeros(config):
    return jax.tree.map(np.zeros, BD.param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))


def test_bad_pairings_are_refused():
    params = _zeros(_drafter_config())
    with pytest.raises(BadInputError, match="hidden_size"):
        BlockDrafter(TARGET, _drafter_config(hidden_size=16),
                     _zeros(_drafter_config(hidden_size=16)))
    with pytest.raises(BadInputError, match="vocab"):
        BlockDrafter(TARGET, _drafter_config(vocab_size=12), params)
    with pytest.raises(BadInputError, match="tap"):
        BlockDrafter(TARGET, _drafter_config(target_layer_ids=(1,)),
                     _zeros(_drafter_config(target_layer_ids=(1,))))
    untapped = BlockProducer(DenseModel(CONFIG), PARAMS, capacity=16, width=4)
    with pytest.raises(BadInputError, match="tap_layers"):
        BlockDrafter(untapped, _drafter_config(), params)
    with pytest.raises(BadInputError, match="shapes"):
        BlockDrafter(TARGET, _drafter_config(), {"fc": params["fc"]})
    with pytest.raises(BadInputError, match="tap_layers"):
        DenseModel(CONFIG, tap_layers=(0, 2))
    with pytest.raises(BadInputError, match="target_layer_ids"):
        _drafter_config(target_layer_ids=(0, 5))
    with pytest.raises(BadInputError, match="mask_token_id"):
        _drafter_config(mask_token_id=V)
    with pytest.raises(BadInputError, match="block_size"):
        _drafter_config(block_size=10)
    assert BD.evenly_spaced_layers(12, 4) == (0, 4, 7, 11)
    with pytest.raises(BadInputError):
        BD.evenly_spaced_layers(2, 3)


def test_a_few_training_steps_lower_the_loss():
    config = _drafter_config(4)
    model = BD.BlockDrafterModel(config)
    params = BD.init_params(config, jax.random.PRNGKey(5))
    anchors = T.sample_anchors(jax.random.PRNGKey(7), 1, len(PROMPT), 4, config.block_size)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(params)
    step = T.make_train_step(model, optimizer, CONFIG.tie_word_embeddings)
    losses = []
    for _ in range(5):
        params, opt_state, loss = step(params, opt_state, PARAMS, BATCH, anchors)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1, losses
    w = T.position_weights(4, 2.0)
    assert np.isclose(float(w.sum()), 1.0) and bool(jnp.all(w[:-1] > w[1:]))


def test_unrecorded_greedy_device_rounds_run_fixed_and_are_plain_greedy():
    """Without the rows recorded the device rounds run as a loop of known trip count, the
    drafter caught up before the chain's first call (the 12-token prompt is more than one of
    the target's 9-row blocks behind)."""
    from turbospark_jax.speculative.rounds import runs_fixed_rounds

    drafter = _drafter(8)
    device = drafter.on_device()[0]
    assert runs_fixed_rounds(device, True, False) and device.caught_up
    assert not drafter._device.loop_free  # the host loop's form: no bound (control)
    pair = SpeculativePair(TARGET, drafter)
    got = run_raw_completion_speculative(
        pair, dataclasses.replace(GREEDY, draft_len=7, record_logits=False))
    assert got.speculative.on_device
    assert got.token_ids == PLAIN.token_ids and got.fed_ids == PLAIN.fed_ids
