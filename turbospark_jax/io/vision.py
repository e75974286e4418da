"""Images into a prompt: preprocessing, the vision tower, placeholder spans, one injection.

:class:`VisionEncoder` is what a ``gemma4`` folder with a ``vision_config`` adds to its text
model: the tower's params, the image token ids from ``config.json`` and the per-image
soft-token budget. :meth:`VisionEncoder.prompt` turns a prompt with one image token per image
(what a user or a chat template writes) and the images into the ids the model reads (each
image token expanded to ``boi, image * n, eoi``, as the ``transformers`` processor expands it)
and the :class:`~turbospark_jax.core.injection.Injection` that fills the spans. A prompt whose
spans are already expanded is taken as it is. The tower runs once per distinct image: its
output is kept by content identity, so a chat that shows the same picture every turn encodes
it once.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from turbospark_jax.core.injection import Injection, placeholder_spans, span_injection
from turbospark_jax.errors import BadInputError
from turbospark_jax.io import images as image_ops
from turbospark_jax.models.gemma4.vision import Gemma4Vision

#: Encoded images a :class:`VisionEncoder` keeps (by identity), newest last.
CACHED_IMAGES = 32


@dataclasses.dataclass(frozen=True)
class ImageTokens:
    """The ids that frame and fill an image span (``config.json``'s ``image_token_id``,
    ``boi_token_id``, ``eoi_token_id``; the frame ids may be ``None``)."""

    image: int
    begin: int | None = None
    end: int | None = None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ImageTokens:
        return cls(image=int(d.get("image_token_id", 258_880)),
                   begin=d.get("boi_token_id", 255_999), end=d.get("eoi_token_id", 258_882))


@dataclasses.dataclass(eq=False)
class VisionEncoder:
    """A vision tower ready to turn images into prompt injections.

    Attributes:
      tower: the tower and ``embed_vision`` (:class:`Gemma4Vision`).
      params: its params.
      tokens: the image token ids.
      max_soft_tokens: soft tokens an image may fill at most (the processor's budget).
    """

    tower: Gemma4Vision
    params: Any
    tokens: ImageTokens
    max_soft_tokens: int = 280
    _cache: collections.OrderedDict[int, np.ndarray] = dataclasses.field(
        default_factory=collections.OrderedDict, repr=False)

    def prepare(self, source: Any) -> image_ops.PreparedImage:
        """Decode and preprocess one image with this tower's settings.

        Raises:
          BadInputError: the image cannot be read.
        """
        c = self.tower.config
        return image_ops.prepare(source, patch_size=c.patch_size,
                                 pooling_kernel_size=c.pooling_kernel_size,
                                 max_soft_tokens=self.max_soft_tokens)

    def embed(self, image: image_ops.PreparedImage) -> np.ndarray:
        """The image's soft tokens in the text embedding space, ``[n, D_text]`` (cached by
        identity)."""
        key = image.identity
        if key not in self._cache:
            out = self.tower.compiled_encode(self.params, jnp.asarray(image.patches),
                                             jnp.asarray(image.positions))
            self._cache[key] = np.asarray(out[: image.soft_tokens])
            while len(self._cache) > CACHED_IMAGES:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self._cache[key]

    def forget(self) -> None:
        """Drop the cached tower outputs (the next :meth:`embed` of any image runs the tower)."""
        self._cache.clear()

    def expand(self, prompt_ids: Sequence[int],
               prepared: Sequence[image_ops.PreparedImage]) -> list[int]:
        """``prompt_ids`` with each lone image token grown into its image's framed span.

        Each image token stands for one image (adjacent ones too) when there are as many
        as images; a prompt with none gets one per image at its start. A prompt whose
        image-token runs already have the images' lengths is returned as it is; any other
        mismatch is left for :func:`~turbospark_jax.core.injection.span_injection`
        to name.
        """
        ids = [int(t) for t in prompt_ids]
        image = self.tokens.image
        spans = placeholder_spans(ids, image)
        if not spans and prepared:
            ids = [image] * len(prepared) + ids
        elif len(spans) == len(prepared) and all(
                n == p.soft_tokens for (_, n), p in zip(spans, prepared, strict=True)):
            return ids
        if ids.count(image) != len(prepared):
            return ids
        out: list[int] = []
        images = iter(prepared)
        for i, t in enumerate(ids):
            if t != image:
                out.append(t)
                continue
            if self.tokens.begin is not None and (i == 0 or ids[i - 1] != self.tokens.begin):
                out.append(self.tokens.begin)
            out += [image] * next(images).soft_tokens
            if self.tokens.end is not None and (i + 1 == len(ids) or
                                                ids[i + 1] != self.tokens.end):
                out.append(self.tokens.end)
        return out

    def prompt(self, prompt_ids: Sequence[int],
               sources: Sequence[Any]) -> tuple[list[int], Injection | None]:
        """The prompt ids with the images' spans and the injection that fills them.

        Args:
          prompt_ids: the prompt, with one image token (or one already expanded span) per
            image, in the images' order.
          sources: the images (paths, bytes, Pillow images or prepared images).

        Raises:
          BadInputError: an unreadable image, or spans that do not match the images in count
            or length (checked before the tower runs).
        """
        prepared = [s if isinstance(s, image_ops.PreparedImage) else self.prepare(s)
                    for s in image_ops.as_list(sources)]
        ids = self.expand(prompt_ids, prepared)
        # The spans are checked with placeholders first, so a mismatch costs no tower run.
        span_injection(ids, self.tokens.image,
                       [(np.empty((p.soft_tokens, 0)), p.identity) for p in prepared])
        return ids, span_injection(ids, self.tokens.image,
                                   [(self.embed(p), p.identity) for p in prepared])


def require_vision(vision: VisionEncoder | None, count: int) -> None:
    """Refuse images for a model without a vision tower."""
    if count and vision is None:
        raise BadInputError(
            f"{count} image(s) given, but this model has no vision tower (a text-only "
            "folder); load a gemma4 folder with a vision_config, or leave the images out"
        )
