"""turbospark_jax: LLM inference whose producer protocols are pure functions over state.

The short way in::

    import turbospark_jax as tsj

    model = tsj.load()                        # the embedded default model (or a folder path)
    print(tsj.generate(model, "def fibonacci(n):", max_tokens=64).text)

The protocols, the request and result types and the errors are re-exported here; the
packages hold the rest (``engine.producer``, ``speculative.drafters``, ``sessions``, ...), one
concern each, layered as docs/design.md draws them.
"""

from turbospark_jax.api import Model, generate, load, stream
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
from turbospark_jax.generation.completion import Completion, CompletionRequest, FinishReason, Usage
from turbospark_jax.generation.driver import run_raw_completion, stream_completion
from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative

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
]
