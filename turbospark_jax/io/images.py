"""Image preprocessing for the Gemma 4 vision tower, in numpy and Pillow.

An image goes from a file (or bytes, or a Pillow image) to what the tower reads:

1. **decode** with Pillow and convert to RGB; transparency is composited onto white, so an
   RGBA image and the same picture flattened onto white give the same pixels;
2. **resize** (bicubic, on the 8-bit image) to the largest size that keeps the aspect ratio,
   holds at most ``max_soft_tokens * k**2`` patches and has both sides a multiple of
   ``k * patch_size`` (``k`` the pooling kernel); a side that would round to nothing gets one
   block, the other side as many as the aspect ratio gives within the budget;
3. **rescale** to ``[0, 1]`` (the tower itself maps to ``[-1, 1]``);
4. **patchify** into rows of ``patch_size * patch_size * 3`` values (row-major patches,
   each patch row-major with channels last) with their ``(x, y)`` grid positions, padded to the
   budget with ``(-1, -1)`` so every image runs through one compiled tower.

The image then fills ``(height / patch) * (width / patch) / k**2`` soft tokens: the length of
its placeholder span in the prompt. :attr:`PreparedImage.identity` is a content hash of what
the tower reads, the identity the fed record keeps for every position the image fills.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import os
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from turbospark_jax.errors import BadInputError

#: Soft-token budgets the Gemma 4 processor accepts per image.
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)

#: Anything :func:`decode` accepts: a path, the encoded bytes, or a Pillow image.
ImageSource = str | os.PathLike | bytes | Image.Image


@dataclasses.dataclass(frozen=True)
class PreparedImage:
    """One image as the vision tower reads it.

    Fields:
      patches:   float32 ``[P, 3 * patch**2]`` pixel values in ``[0, 1]``; rows past the
                 image's own patches are zero.
      positions: int32 ``[P, 2]`` each patch's ``(x, y)``; ``(-1, -1)`` for padding rows.
      soft_tokens: how many soft tokens (placeholder positions) the image fills.
      size: ``(height, width)`` after resizing.
    """

    patches: np.ndarray
    positions: np.ndarray
    soft_tokens: int
    size: tuple[int, int]

    @property
    def identity(self) -> int:
        """A content hash of the patches and positions in ``[1, 2**31)``: equal images give
        equal identities whatever file they came from; 0 is kept for "nothing injected"."""
        digest = hashlib.sha256(self.patches.tobytes() + self.positions.tobytes()).digest()
        return int.from_bytes(digest[:4], "little") % (2**31 - 1) + 1


def decode(source: ImageSource) -> np.ndarray:
    """Decode an image to RGB: uint8 ``[H, W, 3]``, transparency composited onto white.

    Raises:
      BadInputError: the source is of another type, the file is missing or unreadable, or
        it holds no image Pillow can decode.
    """
    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, bytes | str | os.PathLike):
        what = "the image bytes" if isinstance(source, bytes) else f"image {os.fspath(source)!r}"
        try:
            image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
            image.load()
        except FileNotFoundError as e:
            raise BadInputError(f"{what} does not exist") from e
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise BadInputError(f"cannot read {what}: {e}; pass a PNG, JPEG, GIF, BMP or "
                                "WebP file") from e
    else:
        raise BadInputError(f"an image must be a path, bytes or a PIL image, got "
                            f"{type(source).__name__}")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return np.asarray(image.convert("RGB"))


def target_size(height: int, width: int, patch_size: int, max_patches: int,
                pooling_kernel_size: int) -> tuple[int, int]:
    """The ``(height, width)`` an image is resized to (step 2 of the module docstring).

    Raises:
      BadInputError: no size in whole blocks fits the budget.
    """
    block = pooling_kernel_size * patch_size
    scale = math.sqrt(max_patches * patch_size**2 / (height * width))
    h = math.floor(height * scale / block) * block
    w = math.floor(width * scale / block) * block
    longest = (max_patches // pooling_kernel_size**2) * block
    if h == 0 and w == 0:
        raise BadInputError(f"a {height}x{width} image rounds to no {block}-pixel block")
    if h == 0:
        h, w = block, min(math.floor(width / height) * block, longest)
    elif w == 0:
        h, w = min(math.floor(height / width) * block, longest), block
    if h * w > max_patches * patch_size**2:
        raise BadInputError(f"a {height}x{width} image needs more than {max_patches} patches")
    return h, w


def prepare(source: ImageSource | np.ndarray, *, patch_size: int = 16,
            max_soft_tokens: int = 280, pooling_kernel_size: int = 3) -> PreparedImage:
    """Decode, resize, rescale and patchify one image (see the module docstring).

    Args:
      source: as :func:`decode` takes, or an already decoded uint8 ``[H, W, 3]`` array.
      patch_size, pooling_kernel_size: the vision config's.
      max_soft_tokens: the budget per image, one of :data:`SUPPORTED_SOFT_TOKENS`.

    Raises:
      BadInputError: an unreadable image, or a budget the processor does not offer.
    """
    if max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
        raise BadInputError(f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, got "
                            f"{max_soft_tokens!r}")
    rgb = source if isinstance(source, np.ndarray) else decode(source)
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[-1] != 3:
        raise BadInputError(f"a decoded image must be uint8 [H, W, 3], got {rgb.dtype} "
                            f"{list(rgb.shape)}")
    max_patches = max_soft_tokens * pooling_kernel_size**2
    h, w = target_size(rgb.shape[0], rgb.shape[1], patch_size, max_patches, pooling_kernel_size)
    if (h, w) != rgb.shape[:2]:
        rgb = np.asarray(Image.fromarray(rgb).resize((w, h), Image.Resampling.BICUBIC))
    # Through float64, as the reference rescales, so the values round the same way.
    pixels = (rgb.astype(np.float64) * (1 / 255)).astype(np.float32)
    gh, gw = h // patch_size, w // patch_size
    patches = pixels.reshape(gh, patch_size, gw, patch_size, 3).transpose(0, 2, 1, 3, 4)
    patches = patches.reshape(gh * gw, -1)
    gx, gy = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
    positions = np.stack([gx, gy], axis=-1).reshape(-1, 2).astype(np.int32)
    padded = np.zeros((max_patches, patches.shape[1]), np.float32)
    padded[: len(patches)] = patches
    where = np.full((max_patches, 2), -1, np.int32)
    where[: len(positions)] = positions
    return PreparedImage(patches=padded, positions=where,
                         soft_tokens=len(patches) // pooling_kernel_size**2, size=(h, w))


def as_list(sources: Any) -> list[Any]:
    """``sources`` (a sequence of images) as a list, refusing a bare path, bytes or image:
    one path would otherwise be read as a sequence of characters."""
    if isinstance(sources, str | bytes | os.PathLike | Image.Image) or not isinstance(
            sources, list | tuple):
        raise BadInputError(f"images must be a list of paths, bytes or PIL images, got "
                            f"{type(sources).__name__}")
    return list(sources)
