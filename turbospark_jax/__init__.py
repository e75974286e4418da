"""turbospark_jax: LLM inference whose producer protocols are pure functions over state."""

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
from turbospark_jax.protocols import (
    ChunkedPrefillRunner,
    LogitProducer,
    SpeculativeProducer,
    VerifyingTarget,
)

__version__ = "0.1.0"

__all__ = [
    "BadInputError",
    "ChunkedPrefillRunner",
    "ContextOverflowError",
    "LogitProducer",
    "ModelLoadError",
    "ProducerExhaustedError",
    "ProducerFailedError",
    "SessionError",
    "SpeculativeProducer",
    "TurbosparkError",
    "UnsupportedCapabilityError",
    "VerifyingTarget",
    "__version__",
]
