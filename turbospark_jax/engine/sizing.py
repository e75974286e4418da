"""How large a block producer's blocks and states are, checked before anything is built.

The exact prefill's block widths (:func:`prefill_block_widths`) and the ``prefill_width``
a model can honour (:func:`check_prefill_width`), the int32 bound on a state's positions
(:data:`MAX_CAPACITY`), and whether the device holds a state of a given size
(:func:`require_memory`): a :class:`~turbospark_jax.engine.producer.BlockProducer` refuses
a shape it cannot run before it allocates or compiles anything.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from turbospark_jax.core.checks import as_int
from turbospark_jax.errors import BadInputError, ContextOverflowError

__all__ = ["MAX_CAPACITY", "available_bytes", "check_prefill_width", "prefill_block_widths",
           "require_memory"]

#: The largest capacity: positions are int32 inside the programs.
MAX_CAPACITY = 2**31 - 1


def check_prefill_width(prefill_width: int, width: int, widths_agree: bool) -> None:
    """Refuse a ``prefill_width`` that the block program cannot honour exactly.

    Args:
      prefill_width: the most rows an exact-prefill block would hold.
      width: the producer's own width (decode and verify blocks).
      widths_agree: whether the model's programs of different widths agree bitwise
        (:attr:`~turbospark_jax.models.base.BlockModel.widths_agree`).

    Raises:
      BadInputError: ``prefill_width`` below ``width``, or other than ``width`` when the
        widths do not agree; the message says why and what to do instead.
    """
    if prefill_width < width:
        raise BadInputError(
            f"prefill_width={prefill_width} is below width={width}: the exact prefill runs "
            f"in blocks of at least width rows; pass prefill_width >= {width}"
        )
    if prefill_width != width and not widths_agree:
        raise BadInputError(
            f"prefill_width={prefill_width} differs from width={width}, but this model's "
            "programs of different widths do not agree bit for bit: with XLA's kernels they "
            "round differently, so a chunked prefill in wider blocks would no longer equal "
            "token-by-token decoding. Load a dense model with exact=True (its row-invariant "
            f"kernels), or leave prefill_width out (it is then width={width})"
        )


def prefill_block_widths(n_tokens: int, width: int, prefill_width: int) -> list[int]:
    """The block widths an exact prefill of ``n_tokens`` tokens runs in, in order.

    Full blocks of ``prefill_width`` rows, then the rest in one block of the smallest power of
    two that holds it, kept between ``width`` and ``prefill_width``. So a producer compiles
    programs of ``width``, ``prefill_width`` and the powers of two between them only (one
    program when the two are equal). A rest of 904 tokens at ``width=1``,
    ``prefill_width=2048`` runs in a block of 1024 rows.

    Raises:
      BadInputError: ``n_tokens`` below 0, ``width`` below 1, ``prefill_width`` below
        ``width``.
    """
    n_tokens = as_int("n_tokens", n_tokens, low=0)
    width = as_int("width", width, low=1)
    prefill_width = as_int("prefill_width", prefill_width, low=width)
    full, rest = divmod(n_tokens, prefill_width)
    widths = [prefill_width] * full
    if rest:
        widths.append(min(prefill_width, max(width, 1 << (rest - 1).bit_length())))
    return widths


def require_memory(needed: int, what: str) -> None:
    """Refuse, before allocating, ``needed`` bytes that the default device cannot hold.

    The figure to compare with: what the device's allocator reports free
    (``memory_stats()``: ``bytes_limit - bytes_in_use``, GPUs and TPUs); on a CPU, which
    reports nothing, the host's available memory (``MemAvailable`` in ``/proc/meminfo``, else
    all physical pages). A platform that reports neither is not checked.

    Raises:
      ContextOverflowError: naming the bytes needed and available.
    """
    device = jax.local_devices()[0]  # addressable in every process of a multi-host run
    available = available_bytes(device)
    if available is None or needed <= available[0]:
        return
    free, where = available
    raise ContextOverflowError(
        f"{what} needs {needed:,} bytes ({needed / 2**30:.1f} GiB), but {where} has "
        f"{free:,} bytes ({free / 2**30:.1f} GiB) available; use a smaller capacity"
    )


def available_bytes(device: Any) -> tuple[int, str] | None:
    """The bytes ``device`` has free and where (the device, or the host for a CPU), or
    ``None`` on a platform that reports neither."""
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), str(device)
    if device.platform != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "the host"
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the host"
    except (OSError, ValueError):
        return None
