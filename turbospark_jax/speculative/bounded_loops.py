"""Device loops that a GPU runs without reading anything back to the host.

XLA runs a ``while_loop`` whose trip count is data by copying its predicate to the host and
waiting, every iteration, unless the loop is recorded as a CUDA graph (``device_flags``: the
package asks for that in row-invariant decode programs and greedy speculative bursts of known
trip count). A call holding such a loop returns to Python only when the loop is done, so
nothing the host does next overlaps it. A loop whose trip count XLA knows (a ``fori_loop``
over constants) reads nothing back, and a ``lax.cond`` inside one runs on the device when its
branches hold no loop (XLA's default command buffers take conditionals, not loops).

:func:`bounded_while` is the second form of the first: a loop of at most ``most``
iterations, each running the body only while the condition holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax

Carry = TypeVar("Carry")


def bounded_while(cond: Callable[[Carry], jax.Array], body: Callable[[Carry], Carry],
                  init: Carry, most: int, unroll: bool = False) -> Carry:
    """``lax.while_loop(cond, body, init)`` for a loop known to stop within ``most``
    iterations, as ``most`` iterations of ``lax.cond(cond(c), body, identity, c)``.

    The body runs on the same carries in the same order, so the result is bitwise the
    ``while_loop``'s whenever that one stops within ``most`` iterations; past them the loop
    simply ends (the caller's bound must hold, or the caller must want the cut). ``most``
    is static. ``unroll``: the iterations written out one after another, no loop at all (a
    conditional holding no loop is one XLA's default command buffers record).
    """
    def iteration(_, c):
        return jax.lax.cond(cond(c), body, lambda c: c, c)

    return jax.lax.fori_loop(0, most, iteration, init, unroll=unroll)


def loop_within(cond: Callable[[Carry], jax.Array], body: Callable[[Carry], Carry],
                init: Carry, most: int, bounded: bool) -> Carry:
    """A loop inside a speculative round, known to stop within ``most`` iterations:
    :func:`bounded_while` when ``bounded`` (the burst runs as a loop of known trip count);
    else ``lax.while_loop`` (in a burst that is itself a ``while_loop`` each of the bounded
    form's conditionals would read its predicate back to the host, ``most`` of them where the
    ``while_loop`` reads one an iteration it runs). The same bits in every form."""
    if bounded:
        return bounded_while(cond, body, init, most)
    return jax.lax.while_loop(cond, body, init)
