"""Drafters for speculative decoding (a target pairs with one in
:class:`~turbospark_jax.speculative.pair.SpeculativePair`, outside this package: the pair runs
the rounds, which import the drafters).

* :class:`~turbospark_jax.speculative.drafters.draft_model.DraftModelDrafter`: any producer
  with the target's vocabulary, drafting step by step (on the device too).
* :class:`~turbospark_jax.speculative.drafters.ngram.NGramDrafter`: prompt lookup, no
  weights, drafting a block in one pass (on the device too).
* :class:`~turbospark_jax.speculative.drafters.mtp.MTPDrafter`: a Qwen3.5 / Qwen3-Next
  target's own MTP head, caught up from the target's hidden rows each round (on the device
  too).
* :class:`~turbospark_jax.speculative.drafters.block.BlockDrafter`: a DFlash-style block
  drafter, a few layers over a dense target's tapped rows proposing a whole block per pass (on
  the device too).
* :class:`~turbospark_jax.speculative.drafters.oracle.OracleDrafter`: right with a chosen
  probability, for measuring the loop apart from drafter quality;
  :class:`~turbospark_jax.speculative.drafters.oracle.CostedOracleDrafter` the same at
  another drafter's cost.
"""

from turbospark_jax.speculative.drafters.base import MAX_DRAFT, DeviceDrafter, Drafter
from turbospark_jax.speculative.drafters.block import BlockDrafter
from turbospark_jax.speculative.drafters.draft_model import DraftModelDrafter
from turbospark_jax.speculative.drafters.mtp import MTPDrafter
from turbospark_jax.speculative.drafters.ngram import NGramDrafter
from turbospark_jax.speculative.drafters.oracle import CostedOracleDrafter, OracleDrafter

__all__ = [
    "MAX_DRAFT",
    "BlockDrafter",
    "CostedOracleDrafter",
    "DeviceDrafter",
    "DraftModelDrafter",
    "Drafter",
    "MTPDrafter",
    "NGramDrafter",
    "OracleDrafter",
]
