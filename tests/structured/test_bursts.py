"""Optimistic bursts for constrained greedy requests: the tokens, finish reasons and usage
equal the token-by-token path's exactly, for schema, regex and grammar constraints, on a model
that rewinds and on models that roll back to a checkpoint (the embedded recurrent one and a
toy), including constraints the model breaks often and ends (a stop id, the constraint's own
end) inside a burst; a control where a forbidden token is taken differs; sampled, recorded and
host-only requests keep the token-by-token path."""

import numpy as np
import pytest

import turbospark_jax as tsj
from turbospark_jax.core.constraints import ConstraintSpec
from turbospark_jax.core.sampling import SamplingParams
from turbospark_jax.generation import driver
from turbospark_jax.generation.completion import CompletionRequest, FinishReason
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.testing.tokenizers import byte_level_bpe
from turbospark_jax.testing.toy import toy_attention_producer, toy_recurrent_producer

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SPECS = {
    "schema": ConstraintSpec.json_schema(PERSON),
    "regex": ConstraintSpec.regex("[a-z_ ]+"),
    "digits": ConstraintSpec.regex("[0-9]+"),  # may end anywhere: the stop id is allowed
    "short": ConstraintSpec.regex("[a-z]{3,9}"),  # the constraint ends by itself
    # what the embedded model writes after "def f(x):" fits: it ends inside a burst
    "upto": ConstraintSpec.regex("[a-z0-9_ \n()*+=,:]{1,24}"),
    "grammar": ConstraintSpec.grammar('start: "yes" | "no" | ("maybe " NAME)\nNAME: /[a-z]+/'),
}


@pytest.fixture(scope="module")
def embedded():
    return tsj.load()


def complete(producer, tokenizer, spec, prompt_ids, max_tokens, stop_ids, *, optimistic,
             monkeypatch, **extra):
    """One constrained completion; ``optimistic=False`` forces the token-by-token path."""
    with monkeypatch.context() as m:
        if not optimistic:
            m.setattr(driver, "optimistic", lambda *a: False)
        req = CompletionRequest(prompt_ids=list(prompt_ids), max_tokens=max_tokens,
                                stop_token_ids=tuple(stop_ids), constraint=spec, **extra)
        return tsj.run_raw_completion(producer, req, tokenizer=tokenizer)


def assert_same(a, b):
    assert np.array_equal(np.asarray(a.token_ids), np.asarray(b.token_ids))
    assert a.finish_reason is b.finish_reason
    assert a.usage == b.usage
    assert a.text == b.text


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("prompt", ["def f(x):", "# one person as JSON\n", "n = "])
def test_embedded_bursts_equal_token_by_token(embedded, monkeypatch, name, prompt):
    ids = embedded.tokenizer.encode(prompt, add_special_tokens=False)
    for max_tokens in (3, 37):
        args = (embedded.producer, embedded.tokenizer, SPECS[name], ids, max_tokens,
                embedded.stop_token_ids)
        want = complete(*args, optimistic=False, monkeypatch=monkeypatch)
        got = complete(*args, optimistic=True, monkeypatch=monkeypatch)
        assert_same(got, want)
        assert got.fed_ids == want.fed_ids or got.finish_reason is not FinishReason.LENGTH


@pytest.fixture(scope="module")
def toy_tokenizer():
    return Tokenizer.from_tokenizers(byte_level_bpe(300), bos="<|bos|>", eos="<|eos|>",
                                     pad="<|pad|>")


@pytest.mark.parametrize("make", [toy_attention_producer, toy_recurrent_producer],
                         ids=["rewinds", "rolls_back"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_toy_bursts_equal_token_by_token(toy_tokenizer, monkeypatch, make, name):
    """Random toy weights break every constraint often; ids past the tokenizer are never
    allowed. The stop id is the tokenizer's end of text."""
    producer = make(vocab=300, capacity=128, steps_per_call=16, seed=3)
    assert producer.can_rewind is (make is toy_attention_producer)
    stop = (toy_tokenizer.eos_token_id,)
    for seed, max_tokens in ((0, 5), (1, 40), (2, 60)):
        prompt = [int(x) for x in np.random.default_rng(seed).integers(3, 259, 6)]
        args = (producer, toy_tokenizer, SPECS[name], prompt, max_tokens, stop)
        want = complete(*args, optimistic=False, monkeypatch=monkeypatch)
        got = complete(*args, optimistic=True, monkeypatch=monkeypatch)
        assert_same(got, want)
        if producer.can_rewind:
            assert got.fed_ids == want.fed_ids


def test_bursts_are_taken_and_refused(embedded, monkeypatch):
    """The speed case's constraint: bursts run, the model breaks the constraint inside some
    of them (a masked draw from a burst's row), and the tokens still agree."""
    calls = {"decode": 0, "refused": 0}
    follow = driver.Constraint.follow

    def counting(self, tokens):
        calls["decode"] += 1
        taken = follow(self, tokens)
        calls["refused"] += taken < len(tokens)
        return taken

    monkeypatch.setattr(driver.Constraint, "follow", counting)
    ids = embedded.tokenizer.encode("def f(x):", add_special_tokens=False)
    args = (embedded.producer, embedded.tokenizer, SPECS["regex"], ids, 48, ())
    got = complete(*args, optimistic=True, monkeypatch=monkeypatch)
    assert calls["decode"] > 0 and calls["refused"] > 0
    want = complete(*args, optimistic=False, monkeypatch=monkeypatch)
    assert_same(got, want)


def test_control_taking_a_forbidden_token_differs(embedded, monkeypatch):
    """Control: a follow that takes the whole burst, forbidden tokens included, gives other
    tokens than the token-by-token path (so the comparisons above can fail)."""
    ids = embedded.tokenizer.encode("def f(x):", add_special_tokens=False)
    args = (embedded.producer, embedded.tokenizer, SPECS["regex"], ids, 24, ())
    want = complete(*args, optimistic=False, monkeypatch=monkeypatch)

    def greedy_everything(self, tokens):
        return len(tokens)

    monkeypatch.setattr(driver.Constraint, "follow", greedy_everything)
    got = complete(*args, optimistic=True, monkeypatch=monkeypatch)
    assert not np.array_equal(np.asarray(got.token_ids), np.asarray(want.token_ids))


def test_allows_agrees_with_the_mask(embedded):
    c = SPECS["digits"].bind(embedded.tokenizer, embedded.producer.vocab_size,
                             embedded.stop_token_ids)
    for token in embedded.tokenizer.encode("12", add_special_tokens=False):
        mask = c.allowed_mask()
        assert [c.allows(t) for t in range(len(mask))] == mask.tolist()
        c.advance(token)
    mask = c.allowed_mask()  # accepting now: the stop ids are allowed
    assert all(mask[t] for t in embedded.stop_token_ids)
    assert [c.allows(t) for t in range(len(mask))] == mask.tolist()
    assert not c.allows(-1) and not c.allows(len(mask))


def no_bursts(monkeypatch):
    calls = []
    monkeypatch.setattr(driver.ConstrainedSteps, "_burst",
                        lambda self, state, run: calls.append(1))
    return calls


@pytest.mark.parametrize("extra", [{"sampling": tsj.SamplingConfig(temperature=0.8), "seed": 2},
                                   {"record_logits": True}, {"logprobs": 2}])
def test_sampled_and_recorded_requests_take_the_token_by_token_path(embedded, monkeypatch,
                                                                    extra):
    calls = no_bursts(monkeypatch)
    ids = embedded.tokenizer.encode("n = ", add_special_tokens=False)
    req = CompletionRequest(prompt_ids=ids, max_tokens=12, constraint=SPECS["digits"],
                            stop_token_ids=embedded.stop_token_ids, **extra)
    c = tsj.run_raw_completion(embedded.producer, req, tokenizer=embedded.tokenizer)
    assert c.token_ids and not calls


def test_a_model_that_cannot_go_back_takes_the_token_by_token_path(toy_tokenizer,
                                                                    monkeypatch):
    """A device decoder that neither rewinds nor rolls back, and a host-only producer."""
    producer = toy_recurrent_producer(vocab=300, capacity=64, steps_per_call=8)
    req = CompletionRequest(prompt_ids=[5], max_tokens=2)
    assert driver.optimistic(producer, req, SamplingParams.greedy())

    class NoGoingBack:
        """The toy seen without its checkpoints (a plain, non-rewinding decoder)."""

    monkeypatch.setattr(driver, "VerifyingTarget", NoGoingBack)
    assert not driver.optimistic(producer, req, SamplingParams.greedy())
    calls = no_bursts(monkeypatch)
    req = CompletionRequest(prompt_ids=[40, 41, 42], max_tokens=10, constraint=SPECS["regex"],
                            stop_token_ids=(toy_tokenizer.eos_token_id,))
    c = tsj.run_raw_completion(producer, req, tokenizer=toy_tokenizer)
    assert c.token_ids and not calls


def _gemma4_ring(vocab: int):
    """A tiny Gemma 4 whose sliding layers keep a ring of window 3 + 8 slots, decoding in
    bursts of up to 32 steps: a burst runs past what the ring lets a rewind reach."""
    import jax
    import jax.numpy as jnp

    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.models.gemma4 import config as GC
    from turbospark_jax.models.gemma4 import model as G

    s, f = GC.SLIDING, GC.FULL
    config = GC.Gemma4Config.from_hf_dict(dict(
        model_type="gemma4_text", vocab_size=vocab, hidden_size=32, intermediate_size=48,
        num_hidden_layers=3, layer_types=[s, f, s], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=3,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab,
        num_kv_shared_layers=0, initializer_range=0.1))
    model = G.Gemma4Model(config, jnp.float32, ring_margin=8)
    params = model.init_params(jax.random.PRNGKey(4))
    return BlockProducer(model, params, capacity=128, width=4, steps_per_call=32,
                         donate=True)


@pytest.mark.parametrize("pattern", ["[^q]+", "[^qz]+", "[^x]+"])
def test_a_sliding_window_ring_keeps_its_bursts_within_reach(toy_tokenizer, monkeypatch,
                                                             pattern):
    """A ring that keeps a sliding window's last rows can take a state back only so far, so
    an optimistic burst stays within that reach (``step_back_limit``): the tokens equal the
    token-by-token path's."""
    producer = _gemma4_ring(toy_tokenizer.vocab_size)
    assert producer.can_rewind and producer.step_back_limit == 9
    prompt = toy_tokenizer.encode("ab ", add_special_tokens=False)
    went_back = []
    real = driver._go_back

    def spy(p, state, mark, count):
        went_back.append(count)
        return real(p, state, mark, count)

    monkeypatch.setattr(driver, "_go_back", spy)
    # a constraint the random model keeps for long stretches: bursts grow, refusals come late
    args = (producer, toy_tokenizer, ConstraintSpec.regex(pattern), prompt, 100, ())
    want = complete(*args, optimistic=False, monkeypatch=monkeypatch)
    got = complete(*args, optimistic=True, monkeypatch=monkeypatch)
    assert_same(got, want)
    assert went_back, "no burst was taken back"


def test_control_a_burst_past_the_rings_reach_cannot_go_back(toy_tokenizer, monkeypatch):
    """Without the limit, a refusal late in a long burst lies further back than the ring
    holds rows for, and going back fails: the limit is what the test above relies on."""
    from turbospark_jax.errors import BadInputError

    producer = _gemma4_ring(toy_tokenizer.vocab_size)
    monkeypatch.setattr(type(producer), "step_back_limit", property(lambda self: None))
    prompt = toy_tokenizer.encode("ab ", add_special_tokens=False)
    args = (producer, toy_tokenizer, ConstraintSpec.regex("[^x]+"), prompt, 100, ())
    with pytest.raises(BadInputError, match="sliding-window"):
        complete(*args, optimistic=True, monkeypatch=monkeypatch)
