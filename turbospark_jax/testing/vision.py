"""A tiny random Gemma 4 model with a vision tower, for tests, the vision notebook and the
benchmark's ``--tiny`` run: a ``gemma4`` folder (text decoder, tower, byte-level tokenizer
with image and turn tokens, a Gemma-style chat template) that :func:`turbospark_jax.load`
reads like any other. Its text makes no sense; its shapes and code paths are the real ones.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from PIL import Image

from turbospark_jax.io.saving import save_folder
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.io.vision import ImageTokens, VisionEncoder
from turbospark_jax.models.gemma4 import config as gemma4_config
from turbospark_jax.models.gemma4 import model as gemma4
from turbospark_jax.models.gemma4 import vision as gemma4_vision
from turbospark_jax.testing.tokenizers import byte_level_bpe

#: Tokens the tiny tokenizer adds after its byte-level vocabulary.
IMAGE_TOKEN, BEGIN_IMAGE, END_IMAGE = "<|image|>", "<start_of_image>", "<end_of_image>"
TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")

#: A Gemma-style chat template: turns framed by start / end markers, the reply's header last.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

#: The tiny tower's settings: 4-pixel patches, 2x2 pooling, at most 70 soft tokens an image.
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, patch_size=4,
                   pooling_kernel_size=2, position_embedding_size=1024, initializer_range=0.1)


def tiny_tokenizer() -> Tokenizer:
    """A byte-level tokenizer (300 ids) with the image and turn tokens added as specials."""
    backend = byte_level_bpe(300)
    backend.add_special_tokens([IMAGE_TOKEN, BEGIN_IMAGE, END_IMAGE, *TURN_TOKENS])
    return Tokenizer.from_tokenizers(
        backend, bos="<|bos|>", eos="<|eos|>", pad="<|pad|>",
        extra_special_tokens=[IMAGE_TOKEN, BEGIN_IMAGE, END_IMAGE, *TURN_TOKENS],
        chat_template=CHAT_TEMPLATE,
    )


def tiny_vision_model(seed: int = 0) -> tuple[Any, Any, VisionEncoder, Tokenizer]:
    """``(config, params, vision, tokenizer)`` of a tiny random ``gemma4`` model with PLE,
    sliding and full layers and a two-layer tower."""
    tokenizer = tiny_tokenizer()
    ids = {t: tokenizer.token_to_id(t) for t in (IMAGE_TOKEN, BEGIN_IMAGE, END_IMAGE)}
    config = gemma4_config.Gemma4Config(
        model_type="gemma4", vocab_size=tokenizer.vocab_size, hidden_size=32,
        intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
        global_head_dim=16, sliding_window=8, max_position_embeddings=1024,
        layer_types=(gemma4_config.SLIDING, gemma4_config.SLIDING, gemma4_config.FULL),
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=tokenizer.vocab_size,
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    rng = np.random.default_rng(seed)
    params = _random(gemma4.param_shapes(config), config.initializer_range, rng)
    vision_config = gemma4_vision.Gemma4VisionConfig(**TINY_VISION, text_hidden_size=32)
    tower = gemma4_vision.Gemma4Vision(vision_config)
    vision = VisionEncoder(
        tower=tower,
        params=_random(gemma4_vision.param_shapes(vision_config),
                       vision_config.initializer_range, rng),
        tokens=ImageTokens(ids[IMAGE_TOKEN], ids[BEGIN_IMAGE], ids[END_IMAGE]),
        max_soft_tokens=70,
    )
    return config, params, vision, tokenizer


def _random(shapes: Any, scale: float, rng: np.random.Generator) -> Any:
    """Params of ``shapes`` drawn on the host (a jitted initialiser of this many leaves takes
    longer to compile than the model): norms and scales 1, biases 0, clamps open, matrices
    ~ N(0, scale)."""

    def leaf(path: Any, shape: tuple[int, ...]) -> jax.Array:
        name = str(path[-1].key)
        if name.endswith("norm") or name in ("layer_scalar", "std_scale"):
            value = np.ones(shape, np.float32)
        elif name.endswith("bias"):
            value = np.zeros(shape, np.float32)
        elif name.endswith(gemma4_vision.CLIP_BOUNDS):
            value = np.full(shape, -np.inf if name.endswith("min") else np.inf, np.float32)
        else:
            value = (rng.standard_normal(shape) * scale).astype(np.float32)
        return jax.numpy.asarray(value)

    return jax.tree_util.tree_map_with_path(leaf, shapes,
                                            is_leaf=lambda x: isinstance(x, tuple))


def save_tiny_vision_folder(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Write :func:`tiny_vision_model` as a ``gemma4`` folder; return its path."""
    config, params, vision, tokenizer = tiny_vision_model(seed)
    save_folder(path, config, params, tokenizer, vision=vision)
    return os.fspath(path)


def picture(path: str | os.PathLike[str], size: tuple[int, int] = (40, 56),
            seed: int = 0) -> str:
    """Write a random RGB picture of ``size`` (height, width) as a PNG; return its path."""
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return os.fspath(path)
