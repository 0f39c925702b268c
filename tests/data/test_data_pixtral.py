"""Pixtral image sizes, tokens and pixel values against transformers' own Pixtral processor."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

from magistral_cli.data.pixtral import (
    ImageSettings,
    image_token_ids,
    load_image_settings,
    load_pixel_values,
    open_image_size,
    plan_image,
)
from magistral_cli.errors import UserError

SETTINGS = ImageSettings(min_pixels=1024, max_pixels=262144)
TRANSFORMERS_GRID = ImageSettings(min_pixels=1024, max_pixels=262144, grid="transformers")
SIZES = [
    (56, 84),
    (97, 61),
    (300, 200),
    (640, 480),
    (1000, 700),
    (2000, 30),
    (20, 20),
    (1600, 1600),
    (28, 1500),
]


def _random_image(tmp_path, size, mode="RGB"):
    rng = np.random.default_rng(size[0] * 7 + size[1])
    array = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    path = tmp_path / f"img_{size[0]}x{size[1]}.png"
    Image.fromarray(array).convert(mode).save(path)
    return path


def _llamafactory_preprocess(image, max_pixels=262144, min_pixels=1024, resample=Image.Resampling.NEAREST):
    """LLaMA-Factory's ``_preprocess_image`` as MindSpeed-MM ships it (``resample=True``), written out."""
    if image.width * image.height > max_pixels:
        factor = math.sqrt(max_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)), resample=resample)
    if image.width * image.height < min_pixels:
        factor = math.sqrt(min_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)), resample=resample)
    return image.convert("RGB") if image.mode != "RGB" else image.copy()


def _processor(patch):
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    return PixtralImageProcessorPil(size={"longest_edge": 1540}, patch_size={"height": patch, "width": patch})


@pytest.mark.parametrize("size", SIZES)
def test_pixels_match_transformers_pixtral_processor(tmp_path, size):
    """Default grid: the seed's pre-resize, then the Pixtral processor on the 28-pixel grid (how
    ``PixtralProcessor`` calls its image processor, and mistral-common's sizes)."""
    path = _random_image(tmp_path, size)
    with Image.open(path) as image:
        expected = _processor(28)(_llamafactory_preprocess(image), return_tensors="np")

    ours = load_pixel_values(path, SETTINGS)
    plan = plan_image(*size, SETTINGS)
    assert [plan.height, plan.width] == list(expected["image_sizes"][0])
    assert ours.shape == (3, plan.height, plan.width)
    np.testing.assert_allclose(ours, expected["pixel_values"][0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("size", SIZES)
def test_transformers_grid_pixels_are_the_seeds(tmp_path, size):
    """``image_grid: transformers``: LLaMA-Factory calls the image processor on its own, with its
    configured patch size (14): sizes and pixel values as the seed's collator passes them."""
    path = _random_image(tmp_path, size)
    with Image.open(path) as image:
        expected = _processor(14)(_llamafactory_preprocess(image), return_tensors="np")

    ours = load_pixel_values(path, TRANSFORMERS_GRID)
    plan = plan_image(*size, TRANSFORMERS_GRID)
    assert [plan.height, plan.width] == list(expected["image_sizes"][0])
    assert ours.shape == (3, plan.height, plan.width)
    np.testing.assert_allclose(ours, expected["pixel_values"][0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["RGB", "L", "P"])
def test_pre_resize_uses_nearest_like_llamafactory(tmp_path, mode):
    """A 640x480 photo-sized image is above image_max_pixels: the seed shrinks it with NEAREST, on
    the image in its own mode, before the conversion to RGB. Pillow's default filter (bicubic)
    gives other pixels, which this test tells apart (Pillow resizes palette images with nearest
    whatever the filter: there both agree)."""
    path = _random_image(tmp_path, (640, 480), mode)
    with Image.open(path) as image:
        nearest = _processor(28)(_llamafactory_preprocess(image), return_tensors="np")["pixel_values"][0]
        bicubic = _llamafactory_preprocess(image, resample=Image.Resampling.BICUBIC)
        bicubic = _processor(28)(bicubic, return_tensors="np")["pixel_values"][0]
    ours = load_pixel_values(path, SETTINGS)
    np.testing.assert_allclose(ours, nearest, rtol=0, atol=1e-5)
    assert (np.abs(ours - bicubic).max() > 0.1) == (mode != "P")


def test_min_pixels_upscale_sizes_match_llamafactory():
    # 20x20 = 400 < 1024: factor sqrt(1024 / 400) = 1.6 -> 32x32; 10x60 = 600 -> factor 1.306 -> 13x78
    for width, height in [(20, 20), (10, 60), (31, 33)]:
        image = Image.new("RGB", (width, height))
        assert plan_image(width, height, SETTINGS).limited == _llamafactory_preprocess(image).size


@pytest.fixture(scope="module")
def image_encoder():
    pytest.importorskip("cv2")  # mistral-common's image encoder resizes with OpenCV
    from mistral_common.tokens.tokenizers.image import ImageConfig, ImageEncoder, SpecialImageIDs

    config = ImageConfig(image_patch_size=14, max_image_size=1540, spatial_merge_size=2)
    return ImageEncoder(config, SpecialImageIDs(img=10, img_break=12, img_end=13))


@pytest.mark.parametrize("size", [(300, 200), (97, 61), (1000, 700), (1600, 1600), (29, 57), (1540, 30)])
def test_default_grid_tokens_are_mistral_commons(image_encoder, size):
    """mistral-common rounds each side up to 28 px: 300x200 is 308x224, 8 rows of 11 [IMG]."""
    from mistral_common.protocol.instruct.chunk import ImageChunk

    settings = ImageSettings(min_pixels=1, max_pixels=10**8)  # no pixel limit: compare the grids alone
    encoding = image_encoder(ImageChunk(image=Image.new("RGB", size, (90, 30, 200))))
    plan = plan_image(*size, settings)
    assert image_token_ids(plan.height, plan.width, 28, 10, 12, 13) == list(encoding.tokens)
    assert (plan.height, plan.width) == encoding.image.shape[1:]


@pytest.fixture(scope="module")
def replace_image_token():
    """transformers' ``PixtralProcessor.replace_image_token`` (its [IMG] expansion of one image).

    ``processing_pixtral`` imports torchvision (not a dependency here), so the method is taken
    from that module's source file and run on a stand-in holding Magistral's processor_config
    values: the method reads only these attributes.
    """
    import ast
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    spec = importlib.util.find_spec("transformers.models.pixtral")
    source = (Path(spec.origin).parent / "processing_pixtral.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    method = next(
        node
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name == "PixtralProcessor"
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and node.name == "replace_image_token"
    )
    namespace: dict = {}
    exec(compile(ast.Module(body=[method], type_ignores=[]), "processing_pixtral.py", "exec"), namespace)
    config = SimpleNamespace(
        patch_size=14,
        spatial_merge_size=2,
        image_token="[IMG]",
        image_break_token="[IMG_BREAK]",
        image_end_token="[IMG_END]",
    )
    return lambda inputs, index: namespace["replace_image_token"](config, inputs, index)


@pytest.mark.parametrize("size", [(300, 200), (97, 61), (640, 480), (1000, 700), (20, 20), (2000, 30)])
def test_transformers_grid_tokens_are_the_seeds(tmp_path, replace_image_token, model_dir, size):
    """The seed's [IMG] layout: the standalone image processor's sizes (14-px grid), expanded as
    PixtralProcessor (and the seed's PixtralPlugin) do it, floor(side / 28) tokens a side."""
    from magistral_cli.data.tokenizer import load_tokenizer

    path = _random_image(tmp_path, size)
    with Image.open(path) as image:
        inputs = _processor(14)(_llamafactory_preprocess(image), return_tensors="np")
    text = replace_image_token(inputs, 0)
    # The seed's tokenizer setting (split_special_tokens: false) reads the expanded [IMG] string.
    tokenizer = load_tokenizer(model_dir, split_special_tokens=False)
    expected = tokenizer.encode(text)
    plan = plan_image(*size, TRANSFORMERS_GRID)
    special = tokenizer.special
    assert (
        image_token_ids(plan.height, plan.width, 28, special.img, special.img_break, special.img_end)
        == expected
    )
    if size == (300, 200):
        assert (plan.height, plan.width) == (210, 308) and expected.count(special.img) == 7 * 11
        assert plan_image(*size, SETTINGS).height == 224  # the default grid: 8 rows


def test_image_grid_is_fingerprinted_and_checked(model_dir):
    default = load_image_settings(model_dir, 1024, 262144)
    seed = load_image_settings(model_dir, 1024, 262144, "transformers")
    assert default.grid == "mistral_common" and seed.grid == "transformers"
    assert default.fingerprint_fields() != seed.fingerprint_fields()
    with pytest.raises(UserError, match="image_grid"):
        load_image_settings(model_dir, 1024, 262144, "qwen")


def test_image_tokens_rows_breaks_and_end():
    ids = image_token_ids(56, 84, 28, img=10, img_break=12, img_end=13)
    assert ids == [10, 10, 10, 12, 10, 10, 10, 13]


def test_settings_from_official_files_and_from_config(tmp_path, model_dir):
    official = load_image_settings(model_dir, 1024, 262144)
    assert (official.patch_size, official.spatial_merge_size, official.token_pixels) == (14, 2, 28)
    assert official.source == "tekken.json"
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / "config.json").write_text((model_dir / "config.json").read_text())
    from_config = load_image_settings(only_config, 1024, 262144)
    assert from_config.source == "config.json" and from_config.token_pixels == 28
    assert from_config.longest_edge == 1540


def test_settings_from_third_party_preprocessor_config(tmp_path, model_dir):
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "patch_size": 14,
                "size": {"longest_edge": 1540},
                "image_mean": [0.5] * 3,
                "image_std": [0.5] * 3,
            }
        )
    )
    (tmp_path / "processor_config.json").write_text(json.dumps({"patch_size": 14, "spatial_merge_size": 2}))
    settings = load_image_settings(tmp_path, 1024, 262144)
    assert settings.source == "preprocessor_config.json"
    assert settings.image_mean == (0.5, 0.5, 0.5) and settings.token_pixels == 28


def test_processor_that_disagrees_with_the_model_is_refused(tmp_path, model_dir):
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"patch_size": 16, "size": {"longest_edge": 1024}})
    )
    (tmp_path / "processor_config.json").write_text(json.dumps({"patch_size": 16, "spatial_merge_size": 1}))
    with pytest.raises(UserError, match="16 pixels per image token but config.json's vision tower uses 28"):
        load_image_settings(tmp_path, 1024, 262144)


def test_truncated_jpeg_is_unreadable(tmp_path):
    path = tmp_path / "x.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(path)
    assert open_image_size(path) == (400, 300)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError):
        open_image_size(path)


def test_image_changed_since_preprocessing_is_an_error(tmp_path):
    path = tmp_path / "x.png"
    Image.new("RGB", (56, 56)).save(path)
    with pytest.raises(RuntimeError, match="changed on disk"):
        load_pixel_values(path, SETTINGS, expected_hw=(28, 28))
