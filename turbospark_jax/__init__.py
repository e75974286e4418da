"""turbospark_jax: LLM inference whose producer protocols are pure functions over state.

The short way in::

    import turbospark_jax as tsj

    model = tsj.load()                        # the embedded default model (or a folder path)
    print(tsj.generate(model, "def fibonacci(n):", max_tokens=64).text)

The protocols, the request and result types and the errors are re-exported here; the
packages hold the rest (``engine.producer``, ``speculative.drafters``, ``sessions``, ...), one
concern each, layered as docs/design.md draws them.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

#: Where each name re-exported here lives. They are imported on first use, so a command that
#: needs no model (``turbospark-jax --help``) never imports JAX.
_HOMES = {
    "Model": "api", "generate": "api", "load": "api", "stream": "api",
    "ChunkedPrefillRunner": "core.protocols", "DeviceDecoder": "core.protocols",
    "LogitProducer": "core.protocols", "SpeculativeProducer": "core.protocols",
    "VerifyingTarget": "core.protocols",
    "SamplingConfig": "core.sampling",
    "Stream": "core.streams", "StreamEvent": "core.streams",
    "BadInputError": "errors", "ContextOverflowError": "errors", "ModelLoadError": "errors",
    "ProducerExhaustedError": "errors", "ProducerFailedError": "errors",
    "SessionError": "errors", "TurbosparkError": "errors",
    "UnsupportedCapabilityError": "errors",
    "Completion": "generation.completion", "CompletionRequest": "generation.completion",
    "FinishReason": "generation.completion", "Usage": "generation.completion",
    "run_raw_completion": "generation.driver", "stream_completion": "generation.driver",
    "run_raw_completion_speculative": "generation.speculative_loop",
    "use_compile_cache": "core.compile_cache",
}

if TYPE_CHECKING:
    from turbospark_jax.api import Model, generate, load, stream
    from turbospark_jax.core.compile_cache import use_compile_cache
    from turbospark_jax.core.protocols import (
        ChunkedPrefillRunner,
        DeviceDecoder,
        LogitProducer,
        SpeculativeProducer,
        VerifyingTarget,
    )
    from turbospark_jax.core.sampling import SamplingConfig
    from turbospark_jax.core.streams import Stream, StreamEvent
    from turbospark_jax.errors import (
        BadInputError,
        ContextOverflowError,
        ModelLoadError,
        ProducerExhaustedError,
        ProducerFailedError,
        SessionError,
        TurbosparkError,
        UnsupportedCapabilityError,
    )
    from turbospark_jax.generation.completion import (
        Completion,
        CompletionRequest,
        FinishReason,
        Usage,
    )
    from turbospark_jax.generation.driver import run_raw_completion, stream_completion
    from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        if importlib.util.find_spec(f"turbospark_jax.{name}") is None:
            raise AttributeError(f"module 'turbospark_jax' has no attribute {name!r}")
        return importlib.import_module(f"turbospark_jax.{name}")  # a subpackage
    value = getattr(importlib.import_module(f"turbospark_jax.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


__version__ = "0.1.0"

__all__ = [
    "BadInputError",
    "ChunkedPrefillRunner",
    "Completion",
    "CompletionRequest",
    "ContextOverflowError",
    "DeviceDecoder",
    "FinishReason",
    "LogitProducer",
    "Model",
    "ModelLoadError",
    "ProducerExhaustedError",
    "ProducerFailedError",
    "SamplingConfig",
    "SessionError",
    "SpeculativeProducer",
    "Stream",
    "StreamEvent",
    "TurbosparkError",
    "UnsupportedCapabilityError",
    "Usage",
    "VerifyingTarget",
    "__version__",
    "generate",
    "load",
    "run_raw_completion",
    "run_raw_completion_speculative",
    "stream",
    "stream_completion",
    "use_compile_cache",
]
