"""Images in the prompt: injection into placeholder spans, end to end.

* Parity: a tiny random ``Gemma4ForConditionalGeneration`` with a vision tower, saved by
  ``transformers`` and read by our loader; the logits after a prompt with an image span (our
  preprocessing, tower and injection against the reference's processor-free forward on the
  same pixels) within ``ATOL = 1e-4`` (measured ~4e-6), with a control.
* Chunked prefill with images is bitwise equal to feeding token by token (hypothesis over
  chunk splits and pictures), with a control (one embedding row nudged must differ).
* Every bad input is one row of a table: refused with our error before any work, the state
  and the chat history unchanged.
* Reuse is keyed on the images: the same text with another picture is a miss from the first
  image position, the same picture a hit; reuse then gives bitwise the logits of a fresh
  state. A producer that ignores the identities must fail the same check (the control).
* A multi-turn chat with images, fuzzed: every turn of a session (reusing its slot's state)
  equals the same turn served from a fresh state, tokens and logits bitwise.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark_jax.core.injection import Injection, span_injection
from turbospark_jax.core.kv_prefix import reusable_prefix
from turbospark_jax.core.state import copy_state, live_equal
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.generation.completion import CompletionRequest
from turbospark_jax.generation.driver import stream_completion
from turbospark_jax.models.gemma4 import config as gemma4_config
from turbospark_jax.models.gemma4 import model as gemma4
from turbospark_jax.sessions.chat import ChatSession
from turbospark_jax.testing.toy import ToyAttentionModel
from turbospark_jax.testing.vision import picture, tiny_vision_model

ATOL = 1e-4
SIZE = (20, 28)  # every picture here fills the same span (63 soft tokens)


@pytest.fixture(scope="module")
def tiny():
    config, params, vision, tokenizer = tiny_vision_model(seed=0)
    producer = BlockProducer(gemma4.Gemma4Model(config), params,
                             capacity=512, width=4, steps_per_call=8, donate=False)
    return producer, vision, tokenizer


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pictures")
    return [picture(folder / f"p{i}.png", SIZE, seed=i) for i in range(3)]


def _prompt(vision: Any, images: list[Any], text: tuple[int, ...] = (40, 41)) -> tuple[
        list[int], Injection | None]:
    ids = [1, 30, *([vision.tokens.image] if images else []), *text]
    return vision.prompt(ids, images)


# -- parity with transformers ----------------------------------------------------------------


def test_logits_with_an_image_match_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    hf_config = pytest.importorskip("transformers.models.gemma4.configuration_gemma4")
    hf_model = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    from turbospark_jax.io import images
    from turbospark_jax.io.loading import load_folder

    v = 64
    text = dict(vocab_size=v, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                layer_types=[gemma4_config.SLIDING, gemma4_config.SLIDING, gemma4_config.FULL],
                sliding_window=4, hidden_size_per_layer_input=8, vocab_size_per_layer_input=v,
                initializer_range=0.1, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    tower = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, patch_size=4,
                 pooling_kernel_size=2, position_embedding_size=64, standardize=True)
    config = hf_config.Gemma4Config(text_config=text, vision_config=tower, audio_config=None,
                                    image_token_id=v - 3, boi_token_id=v - 2, eoi_token_id=v - 1)
    torch.manual_seed(0)
    model = hf_model.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            elif "vision" in name:
                p.copy_(0.3 * torch.randn(p.shape))
        for name, b in model.named_buffers():
            if name.endswith("std_bias"):
                b.copy_(torch.randn(b.shape))
            elif name.endswith("std_scale"):
                b.copy_(1.0 + 0.1 * torch.randn(b.shape))
    model.save_pretrained(tmp_path)
    (tmp_path / "processor_config.json").write_text(
        json.dumps({"image_processor": {"max_soft_tokens": 70}}))
    loaded = load_folder(tmp_path, layer_layout="list")
    assert loaded.vision is not None and loaded.vision.max_soft_tokens == 70

    image = images.prepare(picture(tmp_path / "p.png", SIZE, seed=3), patch_size=4,
                           pooling_kernel_size=2, max_soft_tokens=70)
    prompt, injection = loaded.vision.prompt([5, 6, v - 3, 7, 8, 9], [image])
    assert prompt == [5, 6, v - 2, *[v - 3] * image.soft_tokens, v - 1, 7, 8, 9]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([prompt]),
                     pixel_values=torch.tensor(image.patches[None]),
                     image_position_ids=torch.tensor(image.positions[None]).long()
                     ).logits[0, -1].numpy()
    producer = BlockProducer(loaded.model, loaded.params, capacity=128, width=8,
                             steps_per_call=16, donate=False)
    got, _ = producer.prefill_chunk(producer.init_state(), prompt, 0, injection=injection)
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)
    # Control: the same prompt without the picture's rows is far from the reference.
    plain, _ = producer.prefill_chunk(producer.init_state(), prompt, 0)
    assert np.abs(np.asarray(plain) - want).max() > ATOL


# -- chunked == token by token -----------------------------------------------------------


def _sequential(producer: BlockProducer, prompt: list[int], injection: Any) -> tuple[Any, Any]:
    state = producer.init_state()
    for i, t in enumerate(prompt[:-1]):
        state = producer.produce_prefill(state, t, i, injection=injection)
    return producer.produce(state, prompt[-1], len(prompt) - 1, injection=injection)


def _chunked(producer: BlockProducer, prompt: list[int], injection: Any,
             cuts: list[int]) -> tuple[Any, Any]:
    state, logits = producer.init_state(), None
    edges = [0, *sorted(set(c for c in cuts if 0 < c < len(prompt))), len(prompt)]
    for a, b in itertools.pairwise(edges):
        logits, state = producer.prefill_chunk_with_status(
            state, prompt[a:b], a, b == len(prompt), injection=injection)
    return logits, state


_SEQUENTIAL: dict[int, Any] = {}  # picture -> the token-by-token result (the slow side)


@settings(max_examples=4)
@given(which=st.integers(0, 1), cuts=st.lists(st.integers(1, 80), max_size=4))
def test_chunked_prefill_with_images_is_bitwise_token_by_token(tiny, pictures, which, cuts):
    producer, vision, _ = tiny
    prompt, injection = _prompt(vision, [pictures[which]])
    if which not in _SEQUENTIAL:
        _SEQUENTIAL[which] = _sequential(producer, prompt, injection)
    want_logits, want_state = _SEQUENTIAL[which]
    logits, state = _chunked(producer, prompt, injection, cuts)
    assert np.array_equal(np.asarray(logits), np.asarray(want_logits))
    assert live_equal(state, want_state)
    assert tuple(state.fed.to_host().injected) == tuple(
        injection.identity_map().get(i, 0) for i in range(len(prompt)))


def test_control_one_nudged_embedding_row_breaks_bitwise_equality(tiny, pictures):
    producer, vision, _ = tiny
    prompt, injection = _prompt(vision, [pictures[0]])
    embeds = np.array(injection.embeds)
    # One element changed by about 1e-3 of itself: a last-bit change can round away before
    # the logits (it did here with jax 0.10.2), and then the control shows nothing.
    embeds[5, 0] = embeds[5, 0] * np.float32(1 + 2**-10)
    nudged = Injection(injection.positions, embeds, injection.identities)
    a, _ = _chunked(producer, prompt, injection, [17])
    b, _ = _chunked(producer, prompt, nudged, [17])
    assert not np.array_equal(np.asarray(a), np.asarray(b))


# -- bad input, refused before any work ------------------------------------------------------


def _text_only() -> BlockProducer:
    import jax

    model = ToyAttentionModel()
    return BlockProducer(model, model.init_params(jax.random.key(0)), capacity=128, width=4,
                         steps_per_call=4, donate=False)


def _bidirectional(tiny: Any) -> BlockProducer:
    producer = tiny[0]
    config = dataclasses.replace(producer.model.config, use_bidirectional_attention="vision")
    return BlockProducer(gemma4.Gemma4Model(config, ring_margin=16), producer.params,
                         capacity=128, width=4, steps_per_call=8, donate=False)


def _rows(tiny: Any, pictures: list[str]) -> dict[str, tuple[Any, str]]:
    """name -> (a call that must raise BadInputError, what its message must say)."""
    producer, vision, tokenizer = tiny
    image = vision.tokens.image
    prompt, injection = _prompt(vision, [pictures[0]])
    narrow = Injection(injection.positions, np.zeros((len(injection.positions), 8),
                                                     np.float32), injection.identities)
    late = Injection(injection.positions + 200, injection.embeds, injection.identities)
    text_only = _text_only()
    return {
        "more images than spans": (
            lambda: vision.prompt([1, image, 2], [pictures[0], pictures[1]]), "2 image"),
        "more spans than images": (
            lambda: vision.prompt([1, image, 2, image], [pictures[0]]), "1 image"),
        "a span of the wrong length": (
            lambda: vision.prompt([1, *[image] * 5, 2], [pictures[0]]), "5 tokens long"),
        "an unreadable image": (lambda: vision.prompt([1, image], [b"not a png"]), "cannot read"),
        "a missing image file": (
            lambda: vision.prompt([1, image], ["/no/such.png"]), "does not exist"),
        "images not in a list": (lambda: vision.prompt([1, image], pictures[0]), "a list"),
        "an injection for a text-only model": (
            lambda: text_only.prefill_chunk(text_only.init_state(), [1, 2, 3], 0,
                                            injection=injection), "token ids only"),
        "an injection for a text-only model, through generate": (
            lambda: stream_completion(text_only, CompletionRequest(
                prompt_ids=[1] * 80, max_tokens=2, injection=injection)), "token ids only"),
        "an injection for a bidirectional model": (
            lambda: _bidirectional(tiny).prefill_chunk(
                _bidirectional(tiny).init_state(), prompt, 0, injection=injection),
            "bidirectionally"),
        "embeddings of the wrong width": (
            lambda: producer.prefill_chunk(producer.init_state(), prompt, 0,
                                           injection=narrow), "8 wide"),
        "an injection past the prompt": (
            lambda: stream_completion(producer, CompletionRequest(
                prompt_ids=prompt, max_tokens=2, injection=late)), "reaches position"),
        "an injection that is not one": (
            lambda: producer.produce(producer.init_state(), 1, 0, injection={3: 4}),
            "must be an Injection"),
        "images in a chat without a vision tower": (
            lambda: ChatSession(producer, tokenizer, max_tokens=2).send(
                "hi", images=[pictures[0]]), "no vision tower"),
        "an unreadable image in a chat turn": (
            lambda: ChatSession(producer, tokenizer, vision=vision, max_tokens=2).send(
                "hi", images=[b"junk"]), "cannot read"),
        "an identity of 0": (
            lambda: Injection(np.array([0]), np.zeros((1, 32)), np.array([0])), "non-zero"),
    }


ROW_NAMES = [
    "more images than spans", "more spans than images", "a span of the wrong length",
    "an unreadable image", "a missing image file", "images not in a list",
    "an injection for a text-only model", "an injection for a text-only model, through generate",
    "an injection for a bidirectional model", "embeddings of the wrong width",
    "an injection past the prompt", "an injection that is not one",
    "images in a chat without a vision tower", "an unreadable image in a chat turn",
    "an identity of 0",
]


@pytest.mark.parametrize("name", ROW_NAMES)
def test_bad_input_is_refused_before_any_work(tiny, pictures, name):
    producer, vision, _ = tiny
    call, says = _rows(tiny, pictures)[name]
    prompt, injection = _prompt(vision, [pictures[1]])
    _, state = producer.prefill_chunk(producer.init_state(), prompt, 0, injection=injection)
    kept = copy_state(state)
    with pytest.raises(BadInputError, match=says):
        call()
    assert live_equal(state, kept)  # a state made before is untouched (and still usable)


def test_a_refused_chat_turn_leaves_the_history_alone(tiny, pictures):
    producer, vision, tokenizer = tiny
    chat = ChatSession(producer, tokenizer, vision=vision, max_tokens=2)
    chat.send("look", images=[pictures[0]])
    before = chat.messages
    with pytest.raises(BadInputError):
        chat.send("and this", images=["/no/such.png"])
    assert chat.messages == before
    assert chat.send("again").usage.reused_tokens > 63  # the picture's rows still reused


# -- reuse keyed on the images ---------------------------------------------------------------


class IgnoresIdentity(BlockProducer):
    """The control: reuse that compares ids only, as if nothing had been injected."""

    def try_reuse_prefix(self, state, prompt_ids, *, injected=None):
        record = state.fed.to_host()
        n = reusable_prefix(record.ids, None, prompt_ids, None)
        return (n, self._with_count(state, n)) if n else (0, self.init_state())


def reuse_follows_the_images(producer: BlockProducer, vision: Any,
                             pictures: list[str]) -> bool:
    """Whether a state fed with picture 0 is reused up to its image span for the same text
    with picture 1 (a miss from the first image position) and past it for picture 0 again,
    and whether the reused states then give the logits of a fresh state, bitwise."""
    first, inj0 = _prompt(vision, [pictures[0]])
    _, state = producer.prefill_chunk(producer.init_state(), first, 0, injection=inj0)
    start = int(inj0.positions[0])
    for picture_index, expected in ((1, start), (0, len(first))):
        prompt, inj = _prompt(vision, [pictures[picture_index]], text=(40, 41, 42, 43))
        n, reused = producer.try_reuse_prefix(copy_state(state), prompt,
                                              injected=inj.identity_map())
        if n != expected:
            return False
        fresh, _ = producer.prefill_chunk(producer.init_state(), prompt, 0, injection=inj)
        again, _ = producer.prefill_chunk(reused, prompt[n:], n, injection=inj)
        if not np.array_equal(np.asarray(fresh), np.asarray(again)):
            return False
    return True


def test_reuse_is_keyed_on_the_images(tiny, pictures):
    producer, vision, _ = tiny
    assert reuse_follows_the_images(producer, vision, pictures)


def test_control_a_producer_that_ignores_identities_fails(tiny, pictures):
    producer, vision, _ = tiny
    blind = IgnoresIdentity(producer.model, producer.params, capacity=512, width=4,
                            steps_per_call=8, donate=False)
    assert not reuse_follows_the_images(blind, vision, pictures)


def test_same_ids_other_picture_is_another_lineage(tiny, pictures):
    producer, vision, _ = tiny
    a, inj_a = _prompt(vision, [pictures[0]])
    b, inj_b = _prompt(vision, [pictures[1]])
    assert a == b
    _, sa = producer.prefill_chunk(producer.init_state(), a, 0, injection=inj_a)
    _, sb = producer.prefill_chunk(producer.init_state(), b, 0, injection=inj_b)
    assert int(sa.fed.digest) != int(sb.fed.digest)


# -- a multi-turn chat with images, fuzzed -----------------------------------------------------

TURN = st.tuples(st.sampled_from(["what is it", "more", "colours?", "é€ ok"]),
                 st.sampled_from([(), (0,), (1,), (0, 2)]))


@settings(max_examples=3)
@given(turns=st.lists(TURN, min_size=2, max_size=3))
def test_chat_with_images_reuse_equals_fresh(tiny, pictures, turns):
    producer, vision, tokenizer = tiny
    chat = ChatSession(producer, tokenizer, vision=vision, max_tokens=3, record_logits=True,
                       prefill_chunk_size=64)
    for text, shown in turns:
        reply = chat.send(text, images=[pictures[i] for i in shown])
        request = CompletionRequest(prompt_ids=list(reply.prompt_ids), max_tokens=3,
                                    record_logits=True, prefill_chunk_size=64,
                                    stop_token_ids=chat.defaults["stop_token_ids"],
                                    injection=_turn_injection(chat, list(reply.prompt_ids)))
        fresh = stream_completion(producer, request, tokenizer=tokenizer).drain()
        assert reply.token_ids == fresh.token_ids
        assert all(np.array_equal(x, y) for x, y in zip(reply.logits, fresh.logits, strict=True))


def _turn_injection(chat: ChatSession, prompt: list[int]) -> Injection | None:
    """The injection the session's turn used, rebuilt from the images it keeps."""
    shown = [image for turn in chat._images for image in turn]
    if not shown:
        return None
    return span_injection(prompt, chat.vision.tokens.image,
                          [(chat.vision.embed(p), p.identity) for p in shown])


# -- the command line ----------------------------------------------------------------------


def _cli(*argv: str) -> tuple[int, str, str]:
    import io

    from turbospark_jax.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdin=io.StringIO(""), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("turbospark_jax.cli._load", refuse)


@pytest.mark.parametrize("extra, needle", [
    ((), "text-only model"),  # the embedded default model has no tower
    (("--model", "{tiny}", "--ngram", "2"), "without drafting"),
    (("--model", "{tiny}", "--image", "/no/such.png"), "does not exist"),
    (("--model", "{tiny}", "--image", "{junk}"), "cannot read"),
], ids=["text-only model", "with a drafter", "missing file", "not an image"])
def test_cli_refuses_bad_images_before_loading(no_loading, tmp_path, pictures, extra, needle):
    from turbospark_jax.testing.vision import save_tiny_vision_folder

    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not a picture")
    tiny = save_tiny_vision_folder(tmp_path / "tiny") if "{tiny}" in extra else ""
    argv = [a.format(tiny=tiny, junk=junk) for a in extra]
    code, out, err = _cli("generate", "--image", pictures[0], *argv, "<|image|> hi")
    assert code == 1 and out == "" and needle in err and len(err.splitlines()) == 1, err


def test_cli_generates_with_an_image(tmp_path, pictures):
    from turbospark_jax.testing.vision import save_tiny_vision_folder

    folder = save_tiny_vision_folder(tmp_path / "tiny")
    code, _, err = _cli("generate", "--model", folder, "--image", pictures[0], "--image",
                        pictures[1], "<|image|> and <|image|>: compare", "--max-tokens", "2",
                        "--stats")
    assert code == 0, err
    prompt = int(re.search(r"prompt (\d+) tokens", err).group(1))
    assert prompt > 2 * 63  # both spans are in the prompt
