"""An OpenAI-compatible HTTP server over the session slots, with batched decoding.

Modules: :mod:`~turbospark_jax.server.slots` (which slot a request takes),
:mod:`~turbospark_jax.server.requests` (what a client submits and the events it hears back),
:mod:`~turbospark_jax.server.engine` (the scheduler: prefill chunks between batched decode
steps) with :mod:`~turbospark_jax.server.jobs` (one request's token work) and
:mod:`~turbospark_jax.server.lifecycle` (the scheduler thread's start, drain and stop),
:mod:`~turbospark_jax.server.router` (data-parallel replicas behind one engine
interface), :mod:`~turbospark_jax.server.wire` (request bodies and error shapes),
:mod:`~turbospark_jax.server.responses` (response objects), :mod:`~turbospark_jax.server.metrics`
(Prometheus), :mod:`~turbospark_jax.server.app` (the routes) and
:mod:`~turbospark_jax.server.build` (from a model folder to a running server).

Needs the ``serve`` extra (starlette, uvicorn, pydantic, prometheus-client).
"""
