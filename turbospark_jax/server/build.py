"""From a model folder (or a ready producer) to a server: engine, routes and metrics together,
and uvicorn to run them."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from starlette.applications import Starlette

from turbospark_jax.core.checks import as_real
from turbospark_jax.core.compile_cache import ensure_compile_cache
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError, TurbosparkError
from turbospark_jax.io.loading import (
    DEFAULT_TARGET,
    LoadedModel,
    embedded_model_path,
    load_folder,
    serving_plan,
)
from turbospark_jax.io.vision import VisionEncoder
from turbospark_jax.parallel.replicas import check_replica_count, replicas_one_per_device
from turbospark_jax.quant.weights import Quantization
from turbospark_jax.server.app import ServerConfig, build_app
from turbospark_jax.server.engine import Engine
from turbospark_jax.server.metrics import ServerMetrics
from turbospark_jax.server.router import ReplicaRouter
from turbospark_jax.sessions.chat import default_stop_ids
from turbospark_jax.speculative.choice import DrafterChoice, choose_drafter, pair_with_drafter
from turbospark_jax.speculative.pair import SpeculativePair

__all__ = ["DEFAULT_SHUTDOWN_GRACE_S", "Server", "load_server", "make_server"]

#: Seconds the requests in flight get to finish after SIGTERM or SIGINT (``serve
#: --shutdown-grace``).
DEFAULT_SHUTDOWN_GRACE_S = 30.0

#: Seconds uvicorn waits for connections to close once the engine has drained (every reply
#: has ended by then; only idle keep-alive connections remain).
_CLOSE_S = 5.0

#: How often the serving thread looks whether uvicorn still runs.
_POLL_S = 0.5

_log = logging.getLogger("uvicorn.error")


@contextlib.contextmanager
def _caught(event: threading.Event, signals: tuple[int, ...]) -> Iterator[None]:
    """While inside, each of ``signals`` sets ``event`` (main thread only; the handlers before
    are restored on the way out)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda _sig, _frame: event.set()) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

# Speculative requests run outside the batch on the engine's own thread; one replica only.
_SPECULATIVE_REPLICAS = ("speculative decoding is served by one replica only; drop the drafter "
                         "or serve one replica")


@dataclasses.dataclass
class Server:
    """A server's parts: start the engine before serving the app, stop it after.

    Fields:
      engine: the scheduler (``engine.start()`` / ``engine.stop()``); with several replicas,
        the router over their engines.
      app: the ASGI application.
      metrics: its Prometheus collectors.
      config: what the routes were built with.
      drafter: which drafter serves greedy requests and why (``None``: no speculation).
    """

    engine: Engine | ReplicaRouter
    app: Starlette
    metrics: ServerMetrics
    config: ServerConfig
    drafter: DrafterChoice | None = None

    def run(self, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
            on_ready: Callable[[], None] | None = None,
            shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
        """Serve (uvicorn) until SIGTERM or SIGINT, with the engine running meanwhile, then
        shut down gracefully and return.

        The engine compiles its programs first (``GET /health`` answers 503 ``starting``
        until then); ``on_ready`` is called, from another thread, once it has. On the signal
        the server stops admitting (new requests get 503 with ``Retry-After``, ``GET
        /health`` answers 503 ``stopping``), lets the requests in flight finish for up to
        ``shutdown_grace`` seconds, ends the rest (their streams with a ``server_shutdown``
        error event), then stops listening. Signals are caught only when called from the
        main thread; elsewhere it serves until the process ends. (Under the command line,
        Ctrl-C still ends the process at once with status 130:
        :mod:`~turbospark_jax.cli.interrupt` sees SIGINT first.)

        Raises:
          BadInputError: ``shutdown_grace`` is negative.
          TurbosparkError: the HTTP server stopped by itself (it could not listen).
        """
        import uvicorn

        grace = as_real("shutdown_grace", shutdown_grace, low=0.0)
        config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=_CLOSE_S)
        web = uvicorn.Server(config)
        signalled = threading.Event()
        self.engine.start()
        if on_ready is not None:
            def announce() -> None:
                if self.engine.wait_ready() and self.engine.unavailable() is None:
                    on_ready()

            threading.Thread(target=announce, name="turbospark-ready", daemon=True).start()
        thread = threading.Thread(target=web.run, name="uvicorn", daemon=True)
        try:
            with _caught(signalled, (signal.SIGTERM, signal.SIGINT)):
                thread.start()
                while thread.is_alive() and not signalled.wait(_POLL_S):
                    pass
                if signalled.is_set():
                    _log.info("shutting down: the requests in flight have %.0f s to finish",
                              grace)
                    cut = self.engine.drain(grace)
                    if cut:
                        _log.info("shutting down: %d requests cut off", cut)
        finally:
            web.should_exit = True
            thread.join(timeout=_CLOSE_S + 5)
            self.engine.stop()
        if not signalled.is_set():
            raise TurbosparkError(f"the HTTP server on {host}:{port} stopped by itself (could "
                                  f"it listen there?)")


def make_server(
    producer: BlockProducer | Sequence[BlockProducer],
    tokenizer: Any,
    *,
    model_name: str,
    slots: int,
    stop_token_ids: tuple[int, ...] = (),
    speculative: SpeculativePair | None = None,
    max_waiting: int = 64,
    prefill_chunk: int = 64,
    prefill_rows: int = 4,
    engine_options: dict[str, Any] | None = None,
    warm_up: bool = False,
    vision: VisionEncoder | None = None,
) -> Server:
    """A server over a ready producer (the tests build one over a toy model).

    Args:
      producer: the model's :class:`~turbospark_jax.engine.producer.BlockProducer`, or one per
        replica (data parallel: :class:`~turbospark_jax.server.router.ReplicaRouter`).
      tokenizer: its tokenizer (with a chat template for ``/v1/chat/completions``).
      model_name: the id requests must name.
      slots: session slots, which is also the decode batch.
      stop_token_ids: ids that end a completion; end-of-turn ids are added for chat.
      speculative: a speculative pair over ``producer`` for greedy requests (one replica
        only).
      max_waiting: requests that may wait for a slot before more get a 429.
      prefill_chunk: the most tokens of one prompt fed between two decode steps.
      prefill_rows: prompts fed together between two decode steps (one device call).
      engine_options: further :class:`~turbospark_jax.server.engine.Engine` keywords.
      warm_up: compile every program before serving (``GET /health`` is 503 ``starting``
        until then); :func:`load_server` turns it on, a toy server in a test leaves it off.
      vision: the model's vision tower, for chat messages with images (``None``: text only).
        The prefill's variant with image embeddings compiles on the first image.
    """
    metrics = ServerMetrics()
    producers = [producer] if isinstance(producer, BlockProducer) else list(producer)
    if len(producers) > 1 and speculative is not None:
        raise BadInputError(_SPECULATIVE_REPLICAS)
    engines = [Engine(p, slots=slots, tokenizer=tokenizer, max_waiting=max_waiting,
                      speculative=speculative, observer=metrics, prefill_rows=prefill_rows,
                      prefill_chunk=prefill_chunk, warm_up=warm_up, **(engine_options or {}))
               for p in producers]
    engine = engines[0] if len(engines) == 1 else ReplicaRouter(engines)
    chat_stops = tuple(sorted({*stop_token_ids, *default_stop_ids(tokenizer)}))
    config = ServerConfig(model_name=model_name, tokenizer=tokenizer,
                          stop_token_ids=tuple(stop_token_ids),
                          chat_stop_token_ids=chat_stops, prefill_chunk=prefill_chunk,
                          vision=vision)
    return Server(engine=engine, app=build_app(engine, config, metrics), metrics=metrics,
                  config=config)


def load_server(
    path: str | os.PathLike[str] | None = None,
    *,
    slots: int = 4,
    context: int = 2048,
    width: int = 16,
    dtype: str | None = None,
    draft: str | os.PathLike[str] | bool | None = None,
    ngram: int = 0,
    drafter: str | None = None,
    model_name: str | None = None,
    replicas: int = 1,
    quantize: str | Quantization | None = None,
    kv_dtype: str | None = None,
    **options: Any,
) -> Server:
    """A server over a model folder (default: the embedded model).

    Args:
      path: the Hugging Face folder; ``None`` for the embedded default model.
      slots: session slots (the decode batch).
      context: positions each slot's state holds.
      width: rows of a block of the batched prefill (16: a prompt feeds 16 tokens per block
        step; the batched decode feeds one token a row).
      dtype: weights and activations (default: the folder's own).
      draft: a draft model folder (``True``: the model's own, ``<model>-draft`` beside it;
        for the embedded model, the embedded draft model) for speculative decoding of greedy
        requests; ``ngram``: prompt lookup up to this n instead.
      drafter: a drafter by name (:mod:`~turbospark_jax.speculative.choice`: ``"auto"`` picks the
        model's best, as ``generate --speculative`` does); at most one of ``draft``,
        ``ngram`` and ``drafter``.
      model_name: the served id (default: the folder's name).
      replicas: data-parallel replicas, one per local device (the first ``replicas`` of
        them), each a full copy of the weights with ``slots`` slots of its own.
      quantize, kv_dtype: quantized weights and KV caches, as
        :func:`~turbospark_jax.io.loading.load_folder` takes them (checked before loading).
      **options: :func:`make_server` keywords.

    Raises:
      ModelLoadError: the folder cannot be loaded.
      BadInputError: more than one of ``draft``, ``ngram`` and ``drafter``, a drafter the
        model does not have (named, with the reason), or a folder without a tokenizer;
        ``replicas`` below 1 or above the local devices, or with a drafter.
    """
    if sum(bool(x) for x in (draft, ngram, drafter)) > 1:
        raise BadInputError("choose one drafter: a draft model, ngram or a drafter by name")
    check_replica_count(replicas)  # before loading: a wrong count should not cost a load
    if replicas > 1 and (draft or ngram or drafter):
        raise BadInputError(_SPECULATIVE_REPLICAS)
    target = embedded_model_path(DEFAULT_TARGET) if path is None else path
    choice = _drafter_choice(target, draft, ngram, drafter)  # before loading, as the CLI does
    ensure_compile_cache()  # compiled programs persist across restarts (core.compile_cache)
    # The backend's Pallas kernels where it has them (a GPU): the dense family's row-invariant
    # kernels let the decode run in buckets of the busy rows (engine.batching), the other
    # families walk and group on their kernels. Elsewhere XLA's own kernels: the batched
    # programs' guarantee (a request's bits as if alone) rests on their fixed shapes, not on
    # widths agreeing, and the CPU's tiled forms would only be slower.
    plan = serving_plan(target, exact=True)
    loaded = load_folder(target, dtype=dtype, layer_layout="list", quantize=quantize,
                         kv_dtype=kv_dtype, plan=plan if plan.uses_pallas else None)
    if loaded.tokenizer is None:
        raise BadInputError(f"{target} has no tokenizer; the server needs one for text")
    producers = replicas_one_per_device(loaded.model, loaded.params, replicas, capacity=context,
                                        width=width, donate=True)
    speculative = None
    if choice is not None:
        def producer_for(model: LoadedModel) -> BlockProducer:
            return BlockProducer(model.model, model.params, capacity=context, width=width,
                                 donate=True)

        speculative = pair_with_drafter(loaded, choice, producer_for, dtype=dtype)
    stops = set(loaded.generation_config.eos_token_ids)
    if loaded.tokenizer.eos_token_id is not None:
        stops.add(loaded.tokenizer.eos_token_id)
    name = model_name or os.path.basename(os.path.normpath(str(target)))
    options.setdefault("warm_up", True)
    server = make_server(producers, loaded.tokenizer, model_name=name, slots=slots,
                         stop_token_ids=tuple(sorted(stops)), speculative=speculative,
                         vision=loaded.vision, **options)
    return dataclasses.replace(server, drafter=choice)


def _drafter_choice(target: str | os.PathLike[str], draft: Any, ngram: int,
                    drafter: str | None) -> DrafterChoice | None:
    """The drafter :func:`load_server`'s arguments ask for, or ``None``."""
    import jax

    if draft:
        folders = {} if draft is True else {"draft-model": draft}
        return choose_drafter(target, "draft-model", jax.default_backend(), folders=folders)
    if ngram:
        return choose_drafter(target, "ngram", jax.default_backend(), ngram=ngram)
    if drafter:
        return choose_drafter(target, drafter, jax.default_backend())
    return None
