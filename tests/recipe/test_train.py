"""Training one recipe model on the CPU: the loss falls, resume is bitwise, export loads.

One tiny model and one set of settings are shared, so every training run here reuses the same
compiled step and the module stays well under a minute.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.recipe.data import SEQ_LEN, Setup, recipe_setup
from turbospark_jax.errors import BadInputError
from turbospark_jax.io import loading
from turbospark_jax.models.dense.model import DenseModel
from turbospark_recipe import card, export
from turbospark_recipe import train as rt

TC = rt.TrainConfig(
    steps=12,
    batch_size=8,
    seq_len=SEQ_LEN,
    peak_lr=1e-2,
    warmup_steps=3,
    eval_every=0,
    log_every=4,
)
TINY = (
    ("hidden_size", 32),
    ("num_hidden_layers", 2),
    ("num_attention_heads", 4),
    ("num_key_value_heads", 2),
    ("head_dim", 8),
    ("intermediate_size", 64),
)


@pytest.fixture(scope="module")
def setup() -> Setup:
    return recipe_setup()


@pytest.fixture(scope="module")
def trained(setup: Setup, tmp_path_factory: pytest.TempPathFactory) -> rt.TrainResult:
    config = rt.model_config(TINY, setup.tokenizer)
    return rt.train_model(
        config, TC, setup.train_rows, setup.heldout_rows,
        checkpoint_dir=tmp_path_factory.mktemp("full"), progress=False,
    )


# -- training ----------------------------------------------------------------------------------


def test_training_lowers_the_loss(trained: rt.TrainResult) -> None:
    losses = [h["loss"] for h in trained.history if h["kind"] == "train"]
    assert trained.finished and trained.steps_done == TC.steps
    # 12 steps take off 0.4 nats at least. The corpus is the running Python's standard
    # library, so the figure moves with the version: 0.48 on Python 3.12 (jax 0.11), more on
    # 3.11.
    assert losses[-1] < losses[0] - 0.4
    # Uniform guessing over the vocabulary is the untrained baseline.
    assert trained.eval_loss is not None
    assert trained.eval_loss < np.log(trained.config.vocab_size)
    assert trained.tokens_seen == TC.steps * TC.batch_size * SEQ_LEN


def test_decay_mask_spares_norms(trained: rt.TrainResult) -> None:
    mask = rt._decay_mask(trained.params)
    assert mask["embed_tokens"] and mask["layers"]["q_proj"] and mask["layers"]["down_proj"]
    assert not mask["norm"] and not mask["layers"]["input_layernorm"]
    assert not mask["layers"]["q_norm"]


def _leaves_equal(a: object, b: object) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(
    setup: Setup, trained: rt.TrainResult, tmp_path: Path
) -> None:
    config = trained.config
    ckpt = tmp_path / "ckpt"
    first = rt.train_model(config, TC, setup.train_rows, setup.heldout_rows,
                           checkpoint_dir=ckpt, stop_at_step=5, progress=False)
    assert first.steps_done == 5 and not first.finished
    meta = json.loads((ckpt / rt.CHECKPOINT_META).read_text())
    assert meta["step"] == 5 and meta["samples_seen"] == 5 * TC.batch_size
    resumed = rt.train_model(config, TC, setup.train_rows, setup.heldout_rows,
                             checkpoint_dir=ckpt, resume=True, progress=False)
    assert resumed.steps_done == TC.steps and resumed.finished
    assert _leaves_equal(resumed.params, trained.params)
    train_losses = [h for h in resumed.history if h["kind"] == "train"]
    assert [h["step"] for h in train_losses] == [4, 5, 8, 12]

    # Control: the same resume from a checkpoint with one weight nudged does not match.
    template = jax.eval_shape(lambda: rt.init_state(config, TC))
    state, meta = rt.load_checkpoint(ckpt, template)
    bumped = dict(state.params, norm=state.params["norm"].at[0].add(1e-3))
    meta = {k: v for k, v in meta.items() if k != "step"}
    first_ckpt = tmp_path / "bumped"
    rt.save_checkpoint(first_ckpt, state.replace(step=jnp.int32(5), params=bumped), meta)
    other = rt.train_model(config, TC, setup.train_rows, setup.heldout_rows,
                           checkpoint_dir=first_ckpt, resume=True, progress=False)
    assert not _leaves_equal(other.params, trained.params)


def test_resume_refuses_other_settings(
    setup: Setup, trained: rt.TrainResult, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    rt.train_model(trained.config, TC, setup.train_rows, setup.heldout_rows,
                   checkpoint_dir=ckpt, stop_at_step=1, progress=False)
    other = dataclasses.replace(TC, peak_lr=5e-3)
    with pytest.raises(BadInputError, match="train_config"):
        rt.train_model(trained.config, other, setup.train_rows, setup.heldout_rows,
                       checkpoint_dir=ckpt, resume=True, progress=False)
    with pytest.raises(BadInputError, match="data"):
        rt.train_model(trained.config, TC, setup.train_rows[::-1], setup.heldout_rows,
                       checkpoint_dir=ckpt, resume=True, progress=False)


def test_deadline_stops_cleanly_with_a_checkpoint(
    setup: Setup, trained: rt.TrainResult, tmp_path: Path
) -> None:
    result = rt.train_model(trained.config, TC, setup.train_rows, setup.heldout_rows,
                            checkpoint_dir=tmp_path, deadline=0.0, progress=False)
    assert result.steps_done == 0 and not result.finished
    assert json.loads((tmp_path / rt.CHECKPOINT_META).read_text())["step"] == 0


# -- samples and export ------------------------------------------------------------------------


def test_card_samples_are_greedy_continuations(setup: Setup, trained: rt.TrainResult) -> None:
    tok = setup.tokenizer
    samples = card.card_samples(trained.config, trained.params, tok, max_new_tokens=4)
    assert len(samples) == len(card.CARD_PROMPTS)
    # Oracle: greedy by re-running the plain forward over a fixed window (one compile; causal
    # attention keeps the padding after the last real token out of its logits).
    forward = jax.jit(DenseModel(trained.config, jnp.float32).forward)
    width = 16
    for prompt, sample in zip(card.CARD_PROMPTS, samples, strict=True):
        ids = tok.encode(prompt)
        for _ in range(4):
            window = np.full((1, width), tok.pad_token_id, np.int32)
            window[0, : len(ids)] = ids
            logits = forward(trained.params, jnp.asarray(window))[0, len(ids) - 1]
            token = int(jnp.argmax(logits))
            if token == tok.eos_token_id:
                break
            ids.append(token)
        assert sample == tok.decode(ids, skip_special_tokens=True)
        assert sample.startswith(prompt) and len(sample) > len(prompt)


def test_exported_folder_matches_in_our_loader_and_transformers(
    setup: Setup, trained: rt.TrainResult, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = setup.tokenizer
    samples = card.card_samples(trained.config, trained.params, tok, ["def "], max_new_tokens=4)
    assert samples[0].startswith("def ")
    text_card = card.model_card(
        name="tiny", result=trained, train_config=TC, corpus=setup.corpus.describe(),
        tokens={"train": 1000, "heldout": 100}, samples=samples,
        command=card.command_line(["recipe", "--out", "x"]), save_dtype="float32", role="",
    )
    folder = tmp_path / "model"
    export.export_model(folder, trained, tok, text_card, save_dtype="float32")
    readme = (folder / "README.md").read_text()
    assert "python -m turbospark_recipe recipe --out x" in readme
    assert f"{trained.eval_loss:.4f}" in readme and "```python\ndef " in readme

    loaded = loading.load_folder(folder)
    assert loaded.config == dataclasses.replace(trained.config, dtype="float32")
    assert _leaves_equal(loaded.params, trained.params)
    assert loaded.tokenizer is not None
    text = "import os\nclass Foo:\n    def bar(self): return 'é'\n"
    ids = loaded.tokenizer.encode(text)
    assert ids == tok.encode(text)

    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf_tok(text)["input_ids"] == ids
    assert hf_tok.decode(ids, skip_special_tokens=True) == text
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.eval()
    tokens = np.asarray([ids, setup.heldout_rows[0, : len(ids)].tolist()], np.int32)
    with torch.no_grad():
        want = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(loaded.model.forward(loaded.params, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# -- the Qwen3.5 target with its MTP head -------------------------------------------------------


def test_qwen35_target_trains_with_its_head_and_exports(setup: Setup, tmp_path: Path) -> None:
    """The tiny35 preset: trunk and MTP losses both fall, and the folder loads in our loader
    with the head's weights, ready for the MTP drafter."""
    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.speculative.drafters import MTPDrafter

    config = rt.model_config("tiny35", setup.tokenizer)
    assert config.model_type == "qwen3_5_text" and config.mtp_num_hidden_layers == 1
    tc = dataclasses.replace(TC, steps=8, peak_lr=1e-2)
    result = rt.train_model(config, tc, setup.train_rows, setup.heldout_rows, progress=False)
    train = [h for h in result.history if h["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.3
    assert train[-1]["mtp_loss"] < train[0]["mtp_loss"] - 0.3
    folder = tmp_path / "target35"
    export.export_model(folder, result, setup.tokenizer, "card", save_dtype="float32")
    loaded = loading.load_folder(folder, layer_layout="list")
    assert _leaves_equal(loaded.params["mtp"], result.params["mtp"])
    # The head's drafting is lossless for any weights (tests/speculative/test_mtp_drafter.py); here
    # the
    # drafter only has to accept the exported folder.
    MTPDrafter(BlockProducer(loaded.model, loaded.params, capacity=64, width=4))


# -- a run given in seconds --------------------------------------------------------------------


def test_the_traced_schedule_is_optax_s() -> None:
    """The step's own learning rate (schedule length a traced value) is the warmup-cosine
    schedule optax gives for the same steps."""
    import optax

    for tc in (TC, dataclasses.replace(TC, steps=200, warmup_steps=30), dataclasses.replace(
            TC, steps=3, warmup_steps=5)):
        warmup = tc.effective_warmup
        want = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=tc.peak_lr, warmup_steps=warmup,
            decay_steps=max(tc.steps, warmup + 1), end_value=tc.peak_lr * tc.min_lr_ratio)
        for step in (0, 1, tc.effective_warmup, tc.effective_warmup + 1, tc.steps // 2,
                     tc.steps - 1, tc.steps):
            np.testing.assert_allclose(float(tc.learning_rate(step, tc.steps)),
                                       float(want(step)), rtol=1e-6, atol=1e-9)
            assert float(tc.schedule()(step)) == float(tc.learning_rate(step, tc.steps))


class _Clock:
    """A monotonic clock that advances a fixed amount at every reading."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def monotonic(self) -> float:
        self.now += self.tick
        return self.now


def test_a_run_in_seconds_sets_its_schedule_from_its_step_time(
    setup: Setup, trained: rt.TrainResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed = dataclasses.replace(TC, steps=400, warmup_steps=rt.TRIAL_STEPS + 1, seconds=3600.0)
    # Ample time: the ceiling is the length.
    roomy = rt.train_model(trained.config, dataclasses.replace(timed, steps=30),
                           setup.train_rows, setup.heldout_rows, progress=False)
    assert roomy.scheduled_steps == 30 and roomy.finished
    # A clock on which every step takes a known time: the schedule fits the budget.
    clock = _Clock(5.0)  # every log line and the trial read it: about 1.5 s a step
    monkeypatch.setattr(rt, "time", clock)
    timed = dataclasses.replace(timed, seconds=600.0)
    ckpt = tmp_path / "ckpt"
    first = rt.train_model(trained.config, timed, setup.train_rows, setup.heldout_rows,
                           checkpoint_dir=ckpt, stop_at_step=rt.TRIAL_STEPS + 3, progress=False)
    total = first.scheduled_steps
    assert rt.TRIAL_STEPS + 3 < total < timed.steps and not first.finished
    meta = json.loads((ckpt / rt.CHECKPOINT_META).read_text())
    assert meta["total_steps"] == total and meta["schedule_set"]
    # A resumed run keeps the length it set, whatever the clock says now.
    clock.tick = 50.0
    resumed = rt.train_model(trained.config, timed, setup.train_rows, setup.heldout_rows,
                             checkpoint_dir=ckpt, resume=True, progress=False)
    assert resumed.scheduled_steps == total and resumed.finished
    assert resumed.steps_done == total
    last_lr = [h["lr"] for h in resumed.history if h["kind"] == "train"][-1]
    np.testing.assert_allclose(last_lr, float(timed.learning_rate(total - 1, total)), rtol=1e-6)


def test_a_run_in_seconds_needs_its_trial_inside_the_warmup(
    setup: Setup, trained: rt.TrainResult
) -> None:
    with pytest.raises(BadInputError, match="warmup_steps must be at least"):
        rt.train_model(trained.config, dataclasses.replace(TC, seconds=10.0, warmup_steps=3),
                       setup.train_rows, setup.heldout_rows, progress=False)


# -- a run continued from a trained model --------------------------------------------------------


def test_a_run_starts_from_an_exported_model(
    setup: Setup, trained: rt.TrainResult, tmp_path: Path
) -> None:
    """A warm start begins at the folder's weights (bitwise, float32 export) with fresh
    optimizer moments, trains on from there, names its source in the card, and a resume must
    name the same source."""
    folder = tmp_path / "first"
    export.export_model(folder, trained, setup.tokenizer, "card", save_dtype="float32")
    start = rt.load_warm_start(folder, trained.config)
    state = rt.init_state(trained.config, TC, start)
    assert _leaves_equal(state.params, trained.params)
    fresh = rt.init_state(trained.config, TC)
    assert _leaves_equal(state.opt_state, fresh.opt_state)  # moments start from zero
    assert not _leaves_equal(fresh.params, trained.params)  # control: a fresh init differs

    ckpt = tmp_path / "ckpt"
    tc = dataclasses.replace(TC, steps=4, peak_lr=2e-3)
    result = rt.train_model(trained.config, tc, setup.train_rows, setup.heldout_rows,
                            checkpoint_dir=ckpt, warm_start=start, progress=False)
    assert result.init_source == str(folder) and result.steps_done == 4
    first = next(h for h in result.history if h["kind"] == "train")
    from_scratch = rt.train_model(trained.config, tc, setup.train_rows, setup.heldout_rows,
                                  progress=False)
    scratch_first = next(h for h in from_scratch.history if h["kind"] == "train")
    assert first["loss"] < scratch_first["loss"] - 0.5  # it starts where the first run ended
    text = card.model_card(
        name="tiny", result=result, train_config=tc, corpus=setup.corpus.describe(),
        tokens={"train": 1000, "heldout": 100}, samples=[], command="x",
        save_dtype="float32", role="")
    assert f"the weights of `{folder}`" in text
    with pytest.raises(BadInputError, match="init"):  # resumed without its warm start
        rt.train_model(trained.config, tc, setup.train_rows, setup.heldout_rows,
                       checkpoint_dir=ckpt, resume=True, progress=False)


def test_a_warm_start_refuses_a_model_of_another_shape(
    setup: Setup, trained: rt.TrainResult, tmp_path: Path
) -> None:
    folder = tmp_path / "first"
    export.export_model(folder, trained, setup.tokenizer, "card", save_dtype="float32")
    wider = rt.model_config((*TINY[1:], ("hidden_size", 48)), setup.tokenizer)
    with pytest.raises(BadInputError, match="hidden_size"):
        rt.load_warm_start(folder, wider)
