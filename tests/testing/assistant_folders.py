"""Gemma 4 assistant folders for tests: random weights in the Hugging Face layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from turbospark_jax.models.gemma4 import assistant as A


def write_assistant_folder(folder: Path, raw: dict[str, Any], seed: int = 0
                           ) -> tuple[A.AssistantConfig, Any, dict[str, np.ndarray]]:
    """Write ``raw`` as ``config.json`` and random params of that config as
    ``model.safetensors`` (Hugging Face tensor names) into a new ``folder``. Returns
    ``(config, params, tensors by name)``."""
    config = A.AssistantConfig.from_hf_dict(raw)
    params = A.init_params(config, jax.random.PRNGKey(seed))
    tensors = {}
    for t in A.hf_tensors(config):
        leaf = params
        for k in t.key:
            leaf = leaf[k]
        tensors[t.name] = t.to_hf(np.asarray(leaf))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(folder / "model.safetensors"))
    return config, params, tensors
