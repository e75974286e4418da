"""Start-up: the engine compiles every program a request can reach before it serves, and
``/health`` answers 503 ``starting`` until it has (requests sent meanwhile wait)."""

import threading

import httpx
import jax
from jax import monitoring

from turbospark_jax.engine.batching import BatchedDecoder
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.server.build import make_server
from turbospark_jax.testing.live_server import running
from turbospark_jax.testing.tokenizers import byte_level_bpe
from turbospark_jax.testing.toy import ToyAttentionModel

NAME = "toy"
TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m.role }}\n{{ m.content }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)

_lowered: list[str] = []


def _listen(name, seconds, **_):
    if name == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        _lowered.append(name)


monitoring.register_event_duration_secs_listener(_listen)


def _server(dim, decoder=BatchedDecoder):
    """A toy server that compiles every program at start."""
    tok = Tokenizer.from_tokenizers(byte_level_bpe(), bos="<|bos|>", eos="<|eos|>",
                                    pad="<|pad|>", chat_template=TEMPLATE)
    model = ToyAttentionModel(vocab=tok.vocab_size, dim=dim)  # a new model: nothing cached
    producer = BlockProducer(model, model.init_params(jax.random.PRNGKey(0)), capacity=96,
                             width=4, steps_per_call=8, donate=True)
    return make_server(producer, tok, model_name=NAME, slots=2, stop_token_ids=(1,),
                       prefill_chunk=8, engine_options={"decoder": decoder}, warm_up=True)


#: Requests that reach every variant: greedy, truncated sampling, log-probabilities, a
#: constraint (masked draws), a prompt over a chunk, and the same prompt again (reuse).
BODIES = [
    ("/v1/completions", {"prompt": "def f(x): return x", "max_tokens": 4, "temperature": 0}),
    ("/v1/completions", {"prompt": "def f(x): return x", "max_tokens": 4, "temperature": 0}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 3, "top_k": 5, "seed": 1}),
    ("/v1/completions", {"prompt": "b", "max_tokens": 3, "logprobs": 2, "top_p": 0.5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 6, "temperature": 0,
                              "response_format": {"type": "json_object"}}),
]


def _lowerings_while_serving(srv, url):
    before = len(_lowered)
    for path, body in BODIES:
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
    return len(_lowered) - before


def test_no_request_compiles_after_warm_up():
    srv = _server(dim=12)
    with running(srv) as url:
        assert srv.engine.wait_ready(600)
        assert _lowerings_while_serving(srv, url) == 0
    before = len(_lowered)  # the control: the count sees a compile
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.ones((7,)))
    assert len(_lowered) > before


class _HeldDecoder(BatchedDecoder):
    """Its warm-up waits until the test releases it (a compile that takes a while)."""

    release = threading.Event()

    def warm_up(self):
        assert self.release.wait(60)  # and compiles nothing: the programs compile lazily


def test_health_is_starting_until_warm_and_requests_wait():
    srv = _server(dim=16, decoder=_HeldDecoder)
    with running(srv) as url:
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "starting"
        assert health.headers["Retry-After"] == "1"
        answer = {}

        def ask():
            answer["r"] = httpx.post(url + "/v1/completions", timeout=120,
                                     json={"prompt": "x", "max_tokens": 2, "temperature": 0})

        thread = threading.Thread(target=ask)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive()  # waiting for the warm-up, not refused
        _HeldDecoder.release.set()
        thread.join(120)
        assert answer["r"].status_code == 200
        assert answer["r"].json()["usage"]["completion_tokens"] == 2
        health = httpx.get(url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
