"""Quantized weights: the stored schemes (int8, int4, fp8), quantizing a model's weights to
them, and dequantizing (:mod:`~turbospark_jax.quant.weights`)."""
