"""The model card: rendered from its template, it says what the string-built card said.

``tests/recipe/data_files/model_card_*.md`` are the cards the string-assembly ``model_card`` wrote
(before
the card became a jinja2 template) for the two fixture runs below, with the module's name
updated to ``turbospark_recipe``: one run finished, with evaluations, a corpus subset and a
commit; one cut short, with none of those. The template's card must equal them except for
:data:`INTENDED_CHANGES`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import init_params
from turbospark_recipe import card
from turbospark_recipe.train import TrainConfig, TrainResult

DATA = Path(__file__).parent / "data_files"
COMMAND = "python -m turbospark_recipe recipe --out runs/x --max-files 40"
SAMPLES = ("def foo():\n    return 1", "class A:\n    '''```x```'''", "import os")

#: What differs from the string-built card on purpose: how the samples are made (they come
#: from the runtime's generation loop, from prompts that end on a word, where the string-built
#: card's own decoder "healed" a prompt's trailing space token), and the chat template, which
#: now separates turns (issue 23).
INTENDED_CHANGES = (
    ("Greedy completions (the prompt, then the model's continuation; the prompt's last token "
     "is healed: the model re-picks it among the tokens that start with its text, since a "
     "prompt ending in a space splits a boundary that training text never has):",
     "Greedy completions from the runtime's own generation loop, with the weights as exported "
     "(the prompt, then up to 48 tokens of the model's continuation; each prompt ends on a "
     "whole word, since a prompt ending in a space splits a boundary that training text never "
     "has):"),
    ("Its chat template only concatenates message texts, so a chat request is a plain "
     "completion.",
     "Its chat template renders a conversation as a Python file: each user message becomes a "
     "block of `#` comment lines, each reply follows as code, then a blank line; so a chat "
     "turn asks in a comment and gets code back, and a second turn starts on a line of its "
     "own after the first reply."),
)


def card_inputs(finished: bool) -> dict:
    config = DenseConfig.from_hf_dict({
        "model_type": "qwen3", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "intermediate_size": 64, "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "bos_token_id": 0,
        "eos_token_id": 1, "pad_token_id": 2,
    })
    params = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0), jnp.float32))
    tc = TrainConfig(steps=12, batch_size=8, seq_len=32, peak_lr=1e-2, warmup_steps=3)
    steps = 12 if finished else 7
    history = [
        {"kind": "train", "step": s, "loss": 5.0 - s / 10, "grad_norm": 1.0, "lr": 1e-3,
         "tokens_per_s": (1000.0 * s if finished else 0.0)}
        for s in range(4, steps + 1, 4)
    ]
    if finished:
        history += [{"kind": "eval", "step": 6, "loss": 3.5, "ppl": 33.11545195869231},
                    {"kind": "eval", "step": 12, "loss": 2.345678, "ppl": 10.44}]
    result = TrainResult(
        config=config, params=params, steps_done=steps, finished=finished,
        tokens_seen=steps * 8 * 32, eval_loss=2.345678 if finished else None,
        history=history, timings={},
    )
    corpus = {
        "name": "the fixture library", "root": "/fixture/lib", "python": "3.11.0",
        "train_files": 36, "heldout_files": 4, "train_chars": 1234567, "heldout_chars": 23456,
        "skipped_not_utf8": 1, "heldout_fraction": 0.1, "max_files": 40 if finished else None,
    }
    return dict(
        name="tiny-card", result=result, train_config=tc, corpus=corpus,
        tokens={"train": 345678, "heldout": 6789}, samples=SAMPLES, command=COMMAND,
        save_dtype="bfloat16" if finished else "float32",
        role="It is the target model." if finished else "",
        provenance=card.Provenance("gpu", "NVIDIA H200", "0.0.0-fixture",
                                   "0123abc" if finished else None),
    )


@pytest.mark.parametrize(("finished", "golden"), [(True, "finished"), (False, "cut_short")])
def test_card_equals_the_string_built_card(finished: bool, golden: str) -> None:
    want = (DATA / f"model_card_{golden}.md").read_text(encoding="utf-8")
    for old, new in INTENDED_CHANGES:
        assert want.count(old) == 1
        want = want.replace(old, new)
    assert card.model_card(**card_inputs(finished)) == want


def test_card_keeps_samples_inside_their_code_blocks() -> None:
    text = card.model_card(**card_inputs(True))
    assert "```python\nclass A:\n    '''` ` `x` ` `'''\n```\n" in text
    # Every fence opened is closed: the markdown outside the samples stays markdown.
    assert text.count("```") % 2 == 0


def test_card_of_this_process_names_its_device() -> None:
    inputs = card_inputs(True)
    del inputs["provenance"]
    text = card.model_card(**inputs)
    device = jax.devices()[0]
    assert f"| device | {device.platform} (" in text and f"jax {jax.__version__} |" in text


def test_command_line_is_the_module_form() -> None:
    assert card.command_line(["recipe", "--out", "a b"]) == (
        "python -m turbospark_recipe recipe --out 'a b'"
    )


def test_card_lists_the_packages_their_licences_and_what_was_left_out() -> None:
    inputs = card_inputs(True)
    inputs["corpus"] = {**inputs["corpus"], "packages": {
        "numpy": {"version": "2.4.6", "licence": "BSD-3-Clause", "files": 467, "chars": 8674332},
        "jax": {"version": "0.10.2", "licence": "Apache-2.0", "files": 535, "chars": 10674772}},
        "left_out": {"vendored": 679, "duplicate": 327}, "refused_licences": {"tqdm": "MPL-2.0"}}
    text = card.model_card(**inputs)
    assert "| jax | 0.10.2 | Apache-2.0 | 535 | 10,674,772 |\n" in text
    assert "| numpy | 2.4.6 | BSD-3-Clause | 467 | 8,674,332 |\n" in text
    assert "tqdm (MPL-2.0)" in text and "duplicate: 327, vendored: 679 files" in text
    assert "third-party packages (`site-packages`)" not in text
    plain = card.model_card(**card_inputs(True))
    assert "| distribution |" not in plain and "third-party packages (`site-packages`)" in plain


def test_card_states_mfu_when_the_run_measured_it() -> None:
    inputs = card_inputs(True)
    for h in inputs["result"].history:
        if h["kind"] == "train":
            h["mfu"] = 0.25
    assert "25.0% model FLOPs utilisation" in card.model_card(**inputs)
    assert "model FLOPs utilisation" not in card.model_card(**card_inputs(True))
