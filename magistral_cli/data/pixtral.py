"""Pixtral image handling: processor settings, resizing, image tokens and pixel values.

Magistral's vision tower cuts an image into 14x14 patches and merges 2x2 of them into one
language-model token, so one ``[IMG]`` covers 28x28 pixels. An image of (H, W) pixels after
resizing becomes H//28 rows of W//28 ``[IMG]`` tokens, each row followed by ``[IMG_BREAK]``;
the very last token is ``[IMG_END]`` instead.

Resizing happens in two steps, as in the seed's pipeline:

1. ``image_min_pixels`` / ``image_max_pixels`` (LLaMA-Factory's ``_preprocess_image``): an image
   with more pixels than the maximum is scaled down, one with fewer than the minimum is scaled
   up, both keeping the aspect ratio (sizes truncated to integers), with Pillow's *nearest*
   filter as LLaMA-Factory asks for it (``Image.Resampling.NEAREST``);
2. the Pixtral processor: scaled down so that the longest edge fits ``longest_edge`` (1540 for
   Magistral), then each side rounded *up* to the grid of ``image_grid`` and resized (bicubic):

   - ``mistral_common`` (the default): a multiple of 28, as Mistral's ``ImageEncoder`` does, so
     every pixel row belongs to a token (300x200 -> 308x224, 8 rows of 11);
   - ``transformers``: a multiple of 14, as ``PixtralImageProcessor`` does when called on its
     own, which is how LLaMA-Factory (the seed) calls it (300x200 -> 308x210); the patch merger
     then drops an odd last row or column of patches, so the image has floor(side / 28) tokens a
     side (7 rows of 11): the seed's tokens and pixels exactly.

Only the sizes are needed to encode a sample; pixel values are computed in the data-loader
workers (:func:`load_pixel_values`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from magistral_cli.errors import UserError
from magistral_cli.model_config import read_config_json

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageSettings:
    """What turns an image into pixels and tokens (the processor's settings)."""

    patch_size: int = 14
    spatial_merge_size: int = 2
    longest_edge: int = 1540
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    min_pixels: int = 1024
    max_pixels: int = 262144
    grid: str = "mistral_common"
    source: str = "defaults"

    @property
    def token_pixels(self) -> int:
        """Pixels per image token along each side (28 for Magistral)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def size_multiple(self) -> int:
        """What each resized side is rounded up to: a token (mistral_common) or a patch (transformers)."""
        return self.patch_size if self.grid == "transformers" else self.token_pixels

    def fingerprint_fields(self) -> dict:
        fields = asdict(self)
        fields.pop("source")
        return fields


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None


IMAGE_GRIDS = ("mistral_common", "transformers")


def load_image_settings(
    model_dir: str | Path, min_pixels: int, max_pixels: int, grid: str = "mistral_common"
) -> ImageSettings:
    """Processor settings from the model directory.

    Preference: the third-party ``preprocessor_config.json`` (+ ``processor_config.json``) when
    present, else the official ``tekken.json`` image section, else ``config.json``'s vision
    config. Whatever the source, patch size x spatial merge must agree with ``config.json``.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    config = read_config_json(config_path) if config_path.is_file() else {}
    vision = config.get("vision_config") or {}
    model_patch = vision.get("patch_size")
    model_merge = config.get("spatial_merge_size")

    pre_path = model_dir / "preprocessor_config.json"
    tekken_path = model_dir / "tekken.json"
    values: dict = {}
    if pre_path.is_file():
        pre = _read_json(pre_path)
        proc_path = model_dir / "processor_config.json"
        proc = _read_json(proc_path) if proc_path.is_file() else {}
        patch = pre.get("patch_size", proc.get("patch_size"))
        if isinstance(patch, dict):
            # The processor passes patch_size * spatial_merge_size to the image processor itself.
            patch = patch.get("height")
        size = pre.get("size") or {}
        values = {
            "patch_size": proc.get("patch_size", patch),
            "spatial_merge_size": proc.get("spatial_merge_size", model_merge),
            "longest_edge": size.get("longest_edge") or size.get("height"),
            "image_mean": tuple(pre.get("image_mean", CLIP_MEAN)),
            "image_std": tuple(pre.get("image_std", CLIP_STD)),
            "rescale_factor": pre.get("rescale_factor", 1 / 255),
            "source": "preprocessor_config.json",
        }
    elif tekken_path.is_file() and isinstance(image := _read_json(tekken_path).get("image"), dict):
        values = {
            "patch_size": image.get("image_patch_size"),
            "spatial_merge_size": image.get("spatial_merge_size", 1),
            "longest_edge": image.get("max_image_size"),
            "source": "tekken.json",
        }
    elif vision:
        values = {
            "patch_size": model_patch,
            "spatial_merge_size": model_merge,
            "longest_edge": vision.get("image_size"),
            "source": "config.json",
        }
    else:
        raise UserError(
            f"{model_dir} has no image processor settings (preprocessor_config.json, tekken.json 'image' or "
            "config.json 'vision_config'); run `magistral fetch`"
        )
    for key in ("patch_size", "spatial_merge_size", "longest_edge"):
        if not isinstance(values.get(key), int) or values[key] < 1:
            raise UserError(f"{model_dir}/{values['source']}: missing or invalid {key} ({values.get(key)!r})")
    if grid not in IMAGE_GRIDS:
        raise UserError(f"image_grid {grid!r} is not one of {', '.join(IMAGE_GRIDS)}")
    settings = ImageSettings(min_pixels=min_pixels, max_pixels=max_pixels, grid=grid, **values)
    if isinstance(model_patch, int) and isinstance(model_merge, int):
        model_token = model_patch * model_merge
        if settings.token_pixels != model_token:
            raise UserError(
                f"{model_dir}: the processor ({settings.source}) uses {settings.token_pixels} pixels per image token "
                f"but config.json's vision tower uses {model_token} (patch {model_patch} x merge {model_merge})"
            )
    return settings


def limit_pixels(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """LLaMA-Factory's pixel limits: scale down above ``max_pixels``, up below ``min_pixels``.

    A side never scales below 1 pixel: LLaMA-Factory would ask Pillow for a 0-pixel image
    (an error) where a very thin image (1 x 300000) is scaled down.
    """
    if width * height > max_pixels:
        factor = math.sqrt(max_pixels / (width * height))
        width, height = max(1, int(width * factor)), max(1, int(height * factor))
    if width * height < min_pixels:
        factor = math.sqrt(min_pixels / (width * height))
        width, height = max(1, int(width * factor)), max(1, int(height * factor))
    return width, height


def pixtral_size(width: int, height: int, longest_edge: int, multiple: int) -> tuple[int, int]:
    """The Pixtral processor's output (height, width): fit ``longest_edge``, round up to ``multiple``.

    Each side keeps at least one pixel, hence one token, as mistral-common's ``ImageEncoder``
    clamps (``max(round(w / ratio), 1)``): without it a 1 x 5000 image fitted to 1540 pixels
    has a 0-pixel side, so 0 ``[IMG]`` tokens, and the vision tower fails on it in training.
    """
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        # floor, not round: the result must not exceed longest_edge (transformers does the same)
        height = max(1, int(math.floor(height / ratio)))
        width = max(1, int(math.floor(width / ratio)))
    rows = (height - 1) // multiple + 1
    cols = (width - 1) // multiple + 1
    return rows * multiple, cols * multiple


class ImageSizeError(ValueError):
    """An image whose size cannot be turned into image tokens (a reason to drop its row)."""


class ImageChangedError(RuntimeError):
    """An image that no longer has the size preprocessing recorded for it."""


@dataclass(frozen=True)
class ImagePlan:
    """How one source image is resized: the intermediate size and the final (height, width)."""

    limited: tuple[int, int]  # (width, height) after the pixel limits
    height: int
    width: int


def plan_image(width: int, height: int, settings: ImageSettings) -> ImagePlan:
    """Sizes an image of ``width`` x ``height`` goes through.

    Raises :class:`ImageSizeError` if the result would have no image token on a side (which
    the clamping above rules out on the default grid for any image with pixels; on the
    ``transformers`` grid a side resized to 14 px has none, where the seed's Pixtral plugin
    would fail on an empty token list): such a sample must be dropped, never kept with
    ``image_sizes`` that the vision tower cannot take.
    """
    if width < 1 or height < 1:
        raise ImageSizeError(f"image has no pixels ({width}x{height})")
    limited = limit_pixels(width, height, settings.min_pixels, settings.max_pixels)
    h, w = pixtral_size(limited[0], limited[1], settings.longest_edge, settings.size_multiple)
    if h < settings.token_pixels or w < settings.token_pixels:
        raise ImageSizeError(f"image {width}x{height} resizes to {h}x{w}, less than one image token a side")
    return ImagePlan(limited, h, w)


def image_token_ids(
    height: int, width: int, token_pixels: int, img: int, img_break: int, img_end: int
) -> list[int]:
    """``[IMG]`` x cols + ``[IMG_BREAK]`` per row; the last token is ``[IMG_END]``.

    Rows and columns are floored, as the patch merger and the seed's Pixtral plugin count them
    (a side of 210 px is 7 rows, its last 14 px row of patches has no token).
    """
    rows, cols = height // token_pixels, width // token_pixels
    ids = ([img] * cols + [img_break]) * rows
    ids[-1] = img_end
    return ids


def open_image_size(path: str | Path) -> tuple[int, int]:
    """(width, height) of an image, decoding it fully so that a corrupt file is caught here.

    JPEGs are decoded in draft mode (DCT scaling): every compressed byte is still read, so a
    truncated or corrupt file fails, at a fraction of the cost of a full-size decode.
    """
    from PIL import Image

    with Image.open(path) as image:
        size = image.size
        if image.format == "JPEG":
            image.draft("RGB", (max(1, size[0] // 8), max(1, size[1] // 8)))
        image.load()
    return size


def load_pixel_values(
    path: str | Path, settings: ImageSettings, expected_hw: tuple[int, int] | None = None
) -> np.ndarray:
    """Pixel values [3, H, W] float32 of one image, as the Pixtral processor computes them.

    ``expected_hw`` is the size recorded at preprocessing time; an image that changed since
    (a file replaced in place) would no longer match its image tokens, so it is an error.
    """
    from PIL import Image

    with Image.open(path) as source:
        image = source
        plan = plan_image(image.width, image.height, settings)
        if plan.limited != image.size:
            # LLaMA-Factory's filter (MindSpeed-MM's _preprocess_image, resample=True): nearest,
            # on the image in its own mode, before the conversion to RGB.
            image = image.resize(plan.limited, resample=Image.Resampling.NEAREST)
        if image.mode != "RGB":
            image = image.convert("RGB")
        if (plan.width, plan.height) != image.size:
            image = image.resize((plan.width, plan.height), resample=Image.Resampling.BICUBIC)
        array = np.asarray(image, dtype=np.float32)
    if expected_hw is not None and (plan.height, plan.width) != tuple(expected_hw):
        raise ImageChangedError(
            f"it now resizes to {plan.height}x{plan.width} but was {expected_hw[0]}x{expected_hw[1]} "
            "when the dataset was preprocessed: it changed on disk"
        )
    array *= np.float32(settings.rescale_factor)
    array -= np.asarray(settings.image_mean, dtype=np.float32)
    array /= np.asarray(settings.image_std, dtype=np.float32)
    return np.ascontiguousarray(array.transpose(2, 0, 1))
