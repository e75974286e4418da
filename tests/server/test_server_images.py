"""Images in chat messages (``image_url`` parts with ``data:`` URLs), served by the tiny Gemma 4
model with a vision tower: the greedy reply is the one ``tsj.generate`` gives for the same
prompt and image; a prompt with another image never reuses the first one's rows; text and
image prompts prefilled side by side are each what they are alone; and every bad image is a
400 that touches no slot."""

import base64

import httpx
import numpy as np
import pytest

import turbospark_jax as tsj
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.generation.completion import CompletionRequest
from turbospark_jax.server.build import make_server
from turbospark_jax.server.engine import Engine
from turbospark_jax.server.requests import Done, ServeRequest
from turbospark_jax.testing.live_server import running
from turbospark_jax.testing.vision import IMAGE_TOKEN, picture, save_tiny_vision_folder

NAME, SLOTS, CONTEXT = "tiny-vision", 3, 512
SIZE = (20, 28)  # 63 soft tokens an image


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = save_tiny_vision_folder(tmp_path_factory.mktemp("model") / "tiny")
    return tsj.load(folder, context=CONTEXT, width=4)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pictures")
    return [picture(folder / f"p{i}.png", SIZE, seed=i) for i in range(3)]


def producer(model):
    p = model.producer
    return BlockProducer(p.model, p.params, capacity=CONTEXT, width=4, donate=True)


@pytest.fixture(scope="module")
def server(model):
    srv = make_server(producer(model), model.tokenizer, model_name=NAME, slots=SLOTS,
                      stop_token_ids=model.stop_token_ids, prefill_chunk=16,
                      vision=model.vision)
    with running(srv) as url:
        yield srv, url


def data_url(path, kind="png"):
    with open(path, "rb") as f:
        return f"data:image/{kind};base64," + base64.b64encode(f.read()).decode()


def chat(url, image_urls, text=" what is this?", **extra):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    body = {"model": NAME, "max_tokens": 8, "temperature": 0, **extra,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def reference(model, srv, images, text=" what is this?", max_tokens=8):
    """``tsj.generate`` on the prompt the server renders (the chat template over the same
    message, an image token where each image part stands)."""
    content = IMAGE_TOKEN * len(images) + text
    rendered = model.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                   add_generation_prompt=True)
    ids = model.tokenizer.encode(rendered, add_special_tokens=False)
    return tsj.generate(model, ids, images=list(images), max_tokens=max_tokens, temperature=0,
                        stop_token_ids=srv.config.chat_stop_token_ids)


def test_the_reply_is_what_generate_gives_for_the_same_image(model, server, pictures):
    srv, url = server
    r = chat(url, [data_url(pictures[0])])
    assert r.status_code == 200, r.text
    ref = reference(model, srv, pictures[:1])
    assert r.json()["choices"][0]["token_ids"] == list(ref.token_ids)
    assert r.json()["usage"]["prompt_tokens"] == ref.usage.prompt_tokens
    other = chat(url, [data_url(pictures[1])])  # the control: another picture
    assert other.json()["choices"][0]["token_ids"] == list(
        reference(model, srv, pictures[1:2]).token_ids)
    lp = [chat(url, [data_url(p)], logprobs=True).json()["choices"][0]["logprobs"]
          for p in pictures[:2]]
    assert lp[0] != lp[1]


def test_another_image_never_reuses_the_first_ones_rows(model, server, pictures):
    srv, url = server
    session = {"session_id": "pictures"}
    first = chat(url, [data_url(pictures[0])], **session).json()
    again = chat(url, [data_url(pictures[0])], **session).json()
    prompt = first["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    # Another session with the same picture starts from a copy of those rows.
    elsewhere = chat(url, [data_url(pictures[0])], session_id="elsewhere").json()
    assert elsewhere["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert elsewhere["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    # A picture no slot has fed (any slot's rows of the same picture would be shared): the
    # same ids, but nothing is reused from the image on.
    swapped = chat(url, [data_url(pictures[2])], **session).json()
    image_at = next(i for i, t in enumerate(_prompt_ids(model, srv))
                    if t == model.vision.tokens.image)
    assert swapped["usage"]["prompt_tokens_details"]["cached_tokens"] <= image_at
    assert swapped["choices"][0]["token_ids"] == list(
        reference(model, srv, pictures[2:3]).token_ids)


def _prompt_ids(model, srv):
    content = IMAGE_TOKEN + " what is this?"
    rendered = model.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                   add_generation_prompt=True)
    ids = model.tokenizer.encode(rendered, add_special_tokens=False)
    return model.vision.expand(ids, [model.vision.prepare(np.zeros((*SIZE, 3), np.uint8))])


def test_several_choices_with_an_image(model, server, pictures):
    _, url = server
    r = chat(url, [data_url(pictures[0])], n=2, temperature=0.9, seed=3)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    alone = chat(url, [data_url(pictures[0])], temperature=0.9, seed=3).json()
    assert r.json()["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]


def test_text_and_image_prompts_side_by_side_are_each_what_they_are_alone(model, pictures):
    """Engine level: an image prompt's chunks run the prefill with embeddings, a text
    prompt's the plain one, never mixed in one call; each request is bitwise (tokens and
    logits) what it is served alone."""
    ids = model.tokenizer.encode("<|image|> hi there, what is in it?", add_special_tokens=False)
    image_ids, injection = model.vision.prompt(ids, [pictures[0]])

    def req(prompt, injection=None, seed=0):
        return ServeRequest(CompletionRequest(prompt_ids=list(prompt), max_tokens=6, seed=seed,
                                              injection=injection, record_logits=True))

    text = req(list(range(40, 75)), seed=1)
    image = req(image_ids, injection, seed=2)

    def serve(requests):
        eng = Engine(producer(model), slots=SLOTS, prefill_rows=2, prefill_chunk=16,
                     warm_up=False)
        events = [[] for _ in requests]
        for r, sink in zip(requests, events, strict=True):
            eng.submit(r, sink.append)
        while not eng.idle:
            eng.run_once()
        out = [e[-1] for e in events]
        assert all(isinstance(d, Done) for d in out)
        return [d.completion for d in out]

    together = serve([text, image])
    alone = [serve([text])[0], serve([image])[0]]
    for t, a in zip(together, alone, strict=True):
        assert t.token_ids == a.token_ids and np.array_equal(t.logits, a.logits)
    # The control: the same text with another image differs.
    _, other = model.vision.prompt(ids, [pictures[1]])
    changed = serve([req(image_ids, other, seed=2)])[0]
    assert not np.array_equal(changed.logits, alone[1].logits)


def test_bad_images_are_400s_that_touch_no_slot(server, pictures):
    srv, url = server
    before = [(s.owner, s.fed_ids, s.last_used) for s in srv.engine.slots]
    good = data_url(pictures[0])
    cases = [
        (["https://example.com/cat.png"], "unsupported_image_url", "does not fetch remote"),
        (["data:text/plain;base64,aGk="], "unsupported_image_url", "data:image/"),
        (["data:image/png;base64,%%%not base64"], "invalid_image", "base64"),
        (["data:image/png;base64," + base64.b64encode(b"not a picture").decode()],
         "invalid_image", "cannot read"),
        ([good] * 9, "too_many_images", "at most 8"),
    ]
    for urls, code, words in cases:
        r = chat(url, urls)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == (code, "messages") and words in err["message"]
    assert [(s.owner, s.fed_ids, s.last_used) for s in srv.engine.slots] == before
    assert chat(url, [good]).status_code == 200  # the control


def test_an_image_for_a_text_only_model_is_refused(model, pictures):
    text_only = make_server(producer(model), model.tokenizer, model_name=NAME, slots=1)
    with running(text_only) as url:
        r = chat(url, [data_url(pictures[0])])
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "images_not_supported"
        body = {"model": NAME, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
        assert httpx.post(url + "/v1/chat/completions", json=body,
                          timeout=60).status_code == 200
