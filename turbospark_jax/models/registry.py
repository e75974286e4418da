"""Every model family the loader knows, by ``model_type``."""

from __future__ import annotations

from turbospark_jax.errors import ModelLoadError
from turbospark_jax.models import dense, gemma4, qwen3_5
from turbospark_jax.models.family import Family

#: The families, in the order their model types are listed in messages.
FAMILIES: tuple[Family, ...] = (dense.FAMILY, qwen3_5.FAMILY, gemma4.FAMILY)



def supported_model_types() -> tuple[str, ...]:
    """Every ``model_type`` some family loads."""
    return tuple(t for f in FAMILIES for t in f.architectures)


def family_of(model_type: object) -> Family:
    """The family that loads ``model_type``.

    Raises:
      ModelLoadError: no family does; the message lists the supported types.
    """
    for family in FAMILIES:
        if model_type in family.architectures:
            return family
    raise ModelLoadError(
        f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
    )
