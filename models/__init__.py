"""Data package ``turbospark_jax_models``: the embedded model folders (Hugging Face layout)."""
