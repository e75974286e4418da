"""Writing a trained model out as a Hugging Face folder.

The folder (``model_type`` ``qwen3``, tied embeddings, the tokenizer, a greedy
``generation_config.json``, the model card as ``README.md``) loads in our
:func:`~turbospark_jax.io.loading.load_folder` and in ``transformers`` alike. Weight shards stay
below :data:`SHARD_BYTES` so a folder comes back from the GPU machine, whose returned files
are capped at 16 MiB, without re-splitting.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.io import loading, saving
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_recipe.train import TrainResult

#: Shard limit for the saved weights (kept below the 16 MiB a GPU run returns).
SHARD_BYTES = 15 * 2**20


def export_model(
    folder: Path,
    result: TrainResult,
    tokenizer: Tokenizer,
    card: str,
    save_dtype: str = "bfloat16",
) -> None:
    """Write the trained model as a Hugging Face folder plus its ``README.md``.

    Args:
      folder: the destination.
      result: the training result.
      tokenizer: saved alongside.
      card: the model card text.
      save_dtype: the weights' dtype on disk (``"bfloat16"`` or ``"float32"``).
    """
    dtype = jnp.dtype(save_dtype)
    params = jax.tree.map(lambda p: np.asarray(jax.device_get(p)).astype(dtype), result.params)
    generation = loading.GenerationConfig(
        eos_token_ids=(tokenizer.eos_token_id,),
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        extra={"do_sample": False},
    )
    saving.save_folder(folder, result.config, params, tokenizer=tokenizer,
                       generation_config=generation, max_shard_bytes=SHARD_BYTES)
    (folder / "README.md").write_text(card, encoding="utf-8")
