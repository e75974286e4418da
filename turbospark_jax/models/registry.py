"""Every model family the loader knows, by ``model_type``."""

from __future__ import annotations

from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.models.dense import model as dense
from turbospark_jax.models.family import Family
from turbospark_jax.models.gemma4 import model as gemma4
from turbospark_jax.models.qwen3_5 import model as qwen3_5

#: The families, in the order their model types are listed in messages.
FAMILIES: tuple[Family, ...] = (dense.FAMILY, qwen3_5.FAMILY, gemma4.FAMILY)


def supported_model_types() -> tuple[str, ...]:
    """Every ``model_type`` some family loads."""
    return tuple(t for f in FAMILIES for t in f.architectures)


def family_of_config(config: object) -> Family:
    """The family whose parsed config ``config`` is.

    Raises:
      BadInputError: ``config`` is no family's config (a dict, say).
    """
    for family in FAMILIES:
        if family.config_type is not object and isinstance(config, family.config_type):
            return family
    kinds = ", ".join(f.config_type.__name__ for f in FAMILIES)
    raise BadInputError(
        f"config must be a family's parsed config ({kinds}), got {type(config).__name__}"
    )


def family_of(model_type: object) -> Family:
    """The family that loads ``model_type``.

    Raises:
      ModelLoadError: no family does; the message lists the supported types.
    """
    for family in FAMILIES:
        if isinstance(model_type, str) and model_type in family.architectures:
            return family
    raise ModelLoadError(
        f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
    )
