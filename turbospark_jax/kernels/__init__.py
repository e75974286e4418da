"""The numerical layers every family shares, in their XLA forms and as Pallas kernels, and the
per-row dispatch between them."""
