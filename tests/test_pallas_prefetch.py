"""The prefetch programs' reads (:mod:`turbospark_jax.models.pallas_prefetch`): what they
plan within a budget, and that together they read exactly the rows they plan. (That a
kernel's results do not change with them is each kernel's own test.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from turbospark_jax.models import pallas_prefetch


def test_plan_takes_the_first_weight_whole_then_shares_the_rest():
    cols, rows = pallas_prefetch.COLS, pallas_prefetch.ROWS
    first, second, third = (jnp.zeros((64, cols), jnp.bfloat16),
                            jnp.zeros((640, cols), jnp.bfloat16),
                            jnp.zeros((640, cols), jnp.float32))
    budget = (64 + 160) * cols * 2 + 80 * cols * 4
    planned = pallas_prefetch.plan((first, second, third), budget)
    assert planned[0] == 64 and planned[1] % rows == 0 and planned[2] % rows == 0
    assert planned[1] * cols * 2 + planned[2] * cols * 4 <= budget - 64 * cols * 2
    assert planned[1] > 0 and planned[2] > 0
    odd = jnp.zeros((3, 100), jnp.bfloat16)  # not whole tiles: left out
    assert pallas_prefetch.plan((odd, second), budget)[0] == 0
    assert pallas_prefetch.prepare((odd, second), 0) == ((), ())
    views, counts = pallas_prefetch.prepare((odd, second), budget)
    assert len(views) == 1 and views[0].shape == (640, cols) and counts[0] > 0


@pytest.mark.parametrize("rows", [16, 48, 160])
def test_prefetch_reads_exactly_the_rows_it_plans(rows):
    """The prefetch programs together read every one of the first ``rows`` rows of a weight
    and none past them: a marker in the last planned row is seen, a larger one just past it
    is not (the programs' maximum), for program counts that do and do not divide the
    tiles."""
    cols = pallas_prefetch.COLS
    w = np.zeros((rows + 32, cols), np.float32)
    w[rows - 1, 7], w[rows, 3] = 100.0, 1000.0
    for programs in (1, 3, 4):
        def kernel(w_ref, o_ref, programs=programs):
            p = pl.program_id(0)
            pallas_prefetch.store(o_ref, p, pallas_prefetch.warm(p, (w_ref,), (rows,),
                                                                 programs))

        top = pl.pallas_call(kernel, grid=(programs,),
                             in_specs=[pl.BlockSpec(w.shape, lambda p: (0, 0))],
                             out_specs=pl.BlockSpec((programs,), lambda p: (0,)),
                             out_shape=jax.ShapeDtypeStruct((programs,), jnp.float32),
                             interpret=True)(jnp.asarray(w))
        assert float(jnp.max(top)) == 100.0
