"""``loops.bounded_while``: a data-stopped loop of known most iterations gives the
``while_loop``'s result bit for bit within its bound, cuts the loop at it, and lowers to one
loop whose trip count is a constant."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.speculative.bounded_loops import bounded_while


def collatz(c):
    """A loop whose trip count is data: steps of the Collatz map with a float riding along."""
    n, steps, acc = c
    n = jnp.where(n % 2 == 0, n // 2, 3 * n + 1)
    return n, steps + 1, acc * 1.0001 + jnp.float32(n) * 1e-3


def running(c):
    return c[0] != 1


def start(n):
    return jnp.int32(n), jnp.int32(0), jnp.float32(0.5)


def test_within_its_bound_it_is_the_while_loop_bitwise():
    for n in (1, 6, 7, 27):
        want = jax.jit(lambda c: jax.lax.while_loop(running, collatz, c))(start(n))
        got = jax.jit(lambda c: bounded_while(running, collatz, c, 120))(start(n))
        for a, b in zip(want, got, strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert int(want[1]) == 111  # 27 takes 111 steps, inside the bound


def test_past_its_bound_it_stops_there():
    got = jax.jit(lambda c: bounded_while(running, collatz, c, 10))(start(27))
    assert int(got[1]) == 10 and int(got[0]) != 1  # control: the loop was cut


def test_it_lowers_to_a_loop_of_constant_trip_count():
    text = jax.jit(lambda c: bounded_while(running, collatz, c, 16)).lower(start(7)).as_text()
    assert len(re.findall(r"stablehlo\.while\b", text)) == 1
    # the loop's condition: its counter below a constant
    bound = re.search(r"cond \{\n\s*%\S+ = stablehlo\.constant dense<(\d+)> : tensor<i32>\n"
                      r"\s*%\S+ = stablehlo\.compare\s+LT, %iterArg,", text)
    assert bound is not None and bound.group(1) == "16"


def test_loop_within_is_the_while_loop_in_either_form():
    from turbospark_jax.speculative.bounded_loops import loop_within

    def cond(c):
        return c[0] < c[1]

    def body(c):
        return c[0] + 1, c[1], c[2] * 1.5 + c[0]

    init = (jnp.int32(0), jnp.int32(5), jnp.float32(0.25))
    want = jax.lax.while_loop(cond, body, init)
    for bounded in (False, True):
        got = jax.jit(lambda c, b=bounded: loop_within(cond, body, c, 8, b))(init)
        assert [np.asarray(g).tobytes() for g in got] == [np.asarray(w).tobytes() for w in want]
    text = jax.jit(lambda c: loop_within(cond, body, c, 8, False)).lower(init).as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text  # a plain loop
    text = jax.jit(lambda c: loop_within(cond, body, c, 8, True)).lower(init).as_text()
    assert "stablehlo.case" in text or "stablehlo.if" in text  # conditionals in a loop
