"""Parity of the Gemma 4 vision tower and of image preprocessing with ``transformers``.

* The tower plus ``embed_vision`` (:class:`Gemma4Vision.encode`) against
  ``Gemma4VisionModel`` + ``Gemma4MultimodalEmbedder`` on a tiny random config with clamped
  linears and standardising switched on, CPU float32, within ``ATOL = 1e-4`` (measured ~6e-6);
  the params go through our HF tensor map (``hf_tensors`` / ``HFTensor.to_ours``); a control
  nudges one weight and must move the output past ``ATOL``.
* Preprocessing (:func:`turbospark_jax.io.images.prepare`) against ``Gemma4ImageProcessorPil``
  on image files written here (RGB, RGBA, greyscale, palette GIF, JPEG, 1x1, very wide, very
  tall) for two processor settings: patches, positions and soft-token counts bitwise equal.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from PIL import Image  # noqa: E402
from transformers.models.gemma4 import configuration_gemma4 as hf_config  # noqa: E402
from transformers.models.gemma4 import modeling_gemma4 as hf_model  # noqa: E402
from transformers.models.gemma4.image_processing_pil_gemma4 import (  # noqa: E402
    Gemma4ImageProcessorPil,
)

from turbospark_jax.errors import BadInputError, ModelLoadError  # noqa: E402
from turbospark_jax.io import images  # noqa: E402
from turbospark_jax.models.gemma4 import vision as V  # noqa: E402

ATOL = 1e-4

VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
              position_embedding_size=16, use_clipped_linears=True, standardize=True)
TEXT = dict(hidden_size=24, vocab_size=50, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, global_head_dim=8, intermediate_size=16,
            hidden_size_per_layer_input=0)


def hf_tower(seed: int = 0) -> tuple[Any, Any, V.Gemma4VisionConfig, dict[str, np.ndarray]]:
    """A random reference tower and embedder, our config, and their tensors by HF name."""
    vc, tc = hf_config.Gemma4VisionConfig(**VISION), hf_config.Gemma4TextConfig(**TEXT)
    torch.manual_seed(seed)
    tower = hf_model.Gemma4VisionModel(vc).eval()
    embedder = hf_model.Gemma4MultimodalEmbedder(vc, tc).eval()
    with torch.no_grad():
        for name, p in [*tower.named_parameters(), *embedder.named_parameters()]:
            p.copy_(0.3 * torch.randn(p.shape) + (1.0 if name.endswith("norm.weight") else 0.0))
        for name, b in tower.named_buffers():
            if name.endswith(("input_min", "output_min")):
                b.fill_(-2.0)  # tight enough that some values are clamped
            elif name.endswith(("input_max", "output_max")):
                b.fill_(2.0)
            elif name.endswith("std_bias"):
                b.copy_(torch.randn(b.shape))
            elif name.endswith("std_scale"):
                b.copy_(1.0 + 0.1 * torch.randn(b.shape))
    tensors = {f"model.vision_tower.{k}": v.numpy() for k, v in tower.state_dict().items()}
    tensors.update({f"model.embed_vision.{k}": v.numpy() for k, v in embedder.state_dict().items()})
    config = V.Gemma4VisionConfig.from_hf_dict({"vision_config": vc.to_dict(),
                                               "text_config": tc.to_dict()})
    return tower, embedder, config, tensors


def convert(config: V.Gemma4VisionConfig, tensors: dict[str, np.ndarray]) -> Any:
    shapes = V.param_shapes(config)
    params = jax.tree.map(lambda s: np.zeros(s, np.float32), shapes,
                          is_leaf=lambda x: isinstance(x, tuple))
    declared = V.hf_tensors(config)
    assert {t.name for t in declared} == set(tensors)
    for t in declared:
        assert tensors[t.name].shape == t.hf_shape, t.name
        node, slot = params, shapes
        for k in t.key[:-1]:
            node, slot = node[k], slot[k]
        slot = slot[t.key[-1]][1:] if t.stacked is not None else slot[t.key[-1]]
        value = t.to_ours(tensors[t.name], slot)
        if t.stacked is None:
            node[t.key[-1]] = value
        else:
            node[t.key[-1]][t.stacked] = value
    return jax.tree.map(jnp.asarray, params)


def grid_image(width: int, height: int, padded: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    patches = np.zeros((padded, 3 * VISION["patch_size"] ** 2), np.float32)
    patches[: width * height] = rng.random((width * height, patches.shape[1]))
    gx, gy = np.meshgrid(np.arange(width), np.arange(height), indexing="xy")
    positions = np.full((padded, 2), -1, np.int32)
    positions[: width * height] = np.stack([gx, gy], -1).reshape(-1, 2)
    return patches, positions


@pytest.fixture(scope="module")
def reference():
    return hf_tower()


@pytest.mark.parametrize("grid", [(6, 4), (2, 2), (8, 4)], ids=["6x4", "2x2", "8x4_full"])
def test_tower_matches_transformers(reference, grid):
    tower, embedder, config, tensors = reference
    patches, positions = grid_image(*grid, padded=32, seed=sum(grid))
    with torch.no_grad():
        hidden = tower(pixel_values=torch.tensor(patches[None]),
                       pixel_position_ids=torch.tensor(positions[None]).long()).last_hidden_state
        want = embedder(hidden).numpy()
    ours = V.Gemma4Vision(config)
    got = np.asarray(ours.compiled_encode(convert(config, tensors), jnp.asarray(patches),
                                          jnp.asarray(positions)))
    n = grid[0] * grid[1] // 4
    assert want.shape == (n, TEXT["hidden_size"]) and got.shape == (8, TEXT["hidden_size"])
    np.testing.assert_allclose(got[:n], want, atol=ATOL, rtol=0)


def test_control_a_nudged_weight_is_caught(reference):
    _, _, config, tensors = reference
    patches, positions = grid_image(6, 4, padded=32, seed=1)
    ours = V.Gemma4Vision(config)
    params = convert(config, tensors)
    base = np.asarray(ours.compiled_encode(params, patches, positions))
    nudged = dict(params, layers=dict(params["layers"]))
    nudged["layers"]["k_norm"] = params["layers"]["k_norm"].at[1, 3].add(0.05)
    moved = np.asarray(ours.compiled_encode(nudged, patches, positions))
    assert np.abs(moved[:6] - base[:6]).max() > ATOL


def test_vision_config_refuses_what_it_cannot_run():
    with pytest.raises(ModelLoadError, match="hidden_activation"):
        V.Gemma4VisionConfig.from_hf_dict({"vision_config": {"hidden_activation": "relu"}})
    with pytest.raises(ModelLoadError, match="head_dim"):
        V.Gemma4VisionConfig.from_hf_dict({"vision_config": {"head_dim": 6}})
    assert V.Gemma4VisionConfig.from_hf_dict({"text_config": {}}) is None


def _pixels(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


IMAGES = {
    "rgb.png": lambda: Image.fromarray(_pixels((37, 53, 3), 0)),
    "rgba.png": lambda: Image.fromarray(_pixels((40, 30, 4), 1)),
    "grey.png": lambda: Image.fromarray(_pixels((20, 90), 2)),
    "palette.gif": lambda: Image.fromarray(_pixels((33, 33, 3), 3)).convert("P"),
    "photo.jpg": lambda: Image.fromarray(_pixels((64, 48, 3), 4)),
    "one_pixel.png": lambda: Image.fromarray(_pixels((1, 1, 3), 5)),
    "very_wide.png": lambda: Image.fromarray(_pixels((3, 500, 3), 6)),
    "very_tall.png": lambda: Image.fromarray(_pixels((700, 5, 3), 7)),
}
SETTINGS = [dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70),
            dict(patch_size=16, pooling_kernel_size=3, max_soft_tokens=280)]


@pytest.mark.parametrize("settings", SETTINGS, ids=["tiny", "gemma4"])
@pytest.mark.parametrize("name", list(IMAGES))
def test_preprocessing_matches_transformers(tmp_path, name, settings):
    path = tmp_path / name
    IMAGES[name]().save(path)
    want = Gemma4ImageProcessorPil()(images=[Image.open(path)], return_tensors="np", **settings)
    got = images.prepare(path, **settings)
    np.testing.assert_array_equal(got.patches, want["pixel_values"][0])
    np.testing.assert_array_equal(got.positions, want["image_position_ids"][0])
    assert got.soft_tokens == int(want["num_soft_tokens_per_image"][0])


def test_identity_is_the_content():
    a = Image.fromarray(_pixels((30, 30, 3), 0))
    b = np.asarray(a).copy()
    b[0, 0, 0] ^= 1
    same = images.prepare(a, **SETTINGS[0]).identity
    assert same == images.prepare(np.asarray(a), **SETTINGS[0]).identity > 0
    assert images.prepare(b, **SETTINGS[0]).identity != same


@pytest.mark.parametrize("source, match", [
    (b"not an image", "cannot read"),
    ("/no/such/image.png", "does not exist"),
    (3, "must be a path"),
])
def test_unreadable_images_are_refused(source, match):
    with pytest.raises(BadInputError, match=match):
        images.prepare(source, **SETTINGS[0])
