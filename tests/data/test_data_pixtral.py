"""Pixtral image sizes, tokens and pixel values against transformers' own Pixtral processor."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from magistral_cli.data.pixtral import (
    ImageSettings,
    image_token_ids,
    limit_pixels,
    load_image_settings,
    load_pixel_values,
    open_image_size,
    plan_image,
)
from magistral_cli.errors import UserError

SETTINGS = ImageSettings(min_pixels=1024, max_pixels=262144)


@pytest.mark.parametrize(
    "size",
    [(56, 84), (97, 61), (640, 480), (1000, 700), (2000, 30), (20, 20), (1600, 1600), (28, 1500)],
)
def test_pixels_match_transformers_pixtral_processor(tmp_path, size):
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    rng = np.random.default_rng(size[0] * 7 + size[1])
    array = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    path = tmp_path / "img.png"
    Image.fromarray(array).save(path)

    # The seed's path: LLaMA-Factory's pixel limits, then the processor (patch 14 x merge 2).
    with Image.open(path) as image:
        limited = limit_pixels(image.width, image.height, SETTINGS.min_pixels, SETTINGS.max_pixels)
        image = image.resize(limited) if limited != image.size else image.copy()
    processor = PixtralImageProcessorPil(size={"longest_edge": 1540}, patch_size={"height": 28, "width": 28})
    expected = processor(image, return_tensors="np")

    ours = load_pixel_values(path, SETTINGS)
    plan = plan_image(*size, SETTINGS)
    assert [plan.height, plan.width] == list(expected["image_sizes"][0])
    assert ours.shape == (3, plan.height, plan.width)
    np.testing.assert_allclose(ours, expected["pixel_values"][0], rtol=0, atol=1e-5)


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
