"""The numerical layers every family shares, in their XLA forms and as Pallas kernels, and the
kernel plan (:mod:`~turbospark_jax.kernels.plan`) that picks between them once per model."""
