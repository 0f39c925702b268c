"""FlashAttention 2 / 3 are found by module and distribution, exactly as transformers finds them.

No GPU and no flash package here, so each test puts empty stand-ins on ``sys.path``: a module
directory and, where the case needs one, the ``.dist-info`` that says which distribution
installed it. Nothing is imported from them; detection only looks.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging

import pytest
from transformers import modeling_flash_attention_utils
from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX
from transformers.utils import import_utils

from magistral_cli.ops import attention_kernels as kernels
from magistral_cli.ops.attention import resolve_attention
from magistral_cli.ops.attention_kernels import flash_attention_available
from magistral_cli.ops.vision_attention import vision_attention_backend

pytestmark = pytest.mark.compat  # transformers' own detection changed between 5.17 and 5.23

_patch = None


def _clear_detection_caches(monkeypatch=None) -> None:
    """Our detection cache and transformers': >= 5.23 caches the module -> distribution map in a
    function, 5.17-5.22 in a module constant computed at import (recomputed here, in both modules
    that hold it: the flash-attention matrix's checks read their own imported name)."""
    global _patch
    _patch = monkeypatch or _patch
    flash_attention_available.cache_clear()
    cached = getattr(import_utils, "_package_distribution_mapping", None)
    if cached is not None:
        cached.cache_clear()
    else:
        mapping = importlib.metadata.packages_distributions()
        for module in (import_utils, modeling_flash_attention_utils):
            if hasattr(module, "PACKAGE_DISTRIBUTION_MAPPING"):
                _patch.setattr(module, "PACKAGE_DISTRIBUTION_MAPPING", mapping)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """An empty site directory on sys.path; detection caches (ours and transformers') start cold."""
    for module in ("flash_attn", "flash_attn_interface"):
        assert importlib.util.find_spec(module) is None, f"{module} is really installed here"
    monkeypatch.syspath_prepend(str(tmp_path))
    # These cases are about the flash-attn packages; on a CUDA machine torch's own varlen kernel
    # would answer where they are absent (tests/ops/test_torch_varlen.py covers that choice).
    monkeypatch.setattr(kernels, "torch_varlen_api", lambda *a, **k: None)

    def clear():
        _clear_detection_caches(monkeypatch)

    clear()
    yield tmp_path
    clear()
    monkeypatch.undo()
    clear()


def _install(site, module, distribution=None):
    (site / module).mkdir()
    (site / module / "__init__.py").write_text("")
    if distribution is not None:
        info = site / f"{distribution.replace('-', '_')}-0.0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.0.0\n")
        (info / "top_level.txt").write_text(module + "\n")
    _clear_detection_caches()


def _transformers_finds(version):
    return FLASH_ATTENTION_COMPATIBILITY_MATRIX[version]["pkg_availability_check"]()


def test_fa3_is_flash_attn_interface_from_flash_attn_3(site, caplog):
    _install(site, "flash_attn_interface", "flash-attn-3")
    assert flash_attention_available(3) and _transformers_finds(3)
    assert not flash_attention_available(2) and not _transformers_finds(2)
    assert resolve_attention("flash_attention_3", "cuda") == "flash_attention_3"
    assert "FlashAttention-3" in vision_attention_backend("cuda")
    with caplog.at_level(logging.WARNING, logger="magistral_cli.ops.attention"):
        assert resolve_attention("flash_attention_2", "cuda") == "sdpa"  # FA3 is not FA2
    assert "flash-attn is not installed" in caplog.text


def test_flash_attn_alone_is_fa2_not_fa3(site, caplog):
    _install(site, "flash_attn", "flash-attn")
    assert flash_attention_available(2) and _transformers_finds(2)
    assert not flash_attention_available(3) and not _transformers_finds(3)
    with caplog.at_level(logging.WARNING, logger="magistral_cli.ops.attention"):
        assert resolve_attention("flash_attention_3", "cuda") == "flash_attention_2"
    assert (
        "flash-attn-3 (module flash_attn_interface) is not installed; using flash_attention_2" in caplog.text
    )
    assert resolve_attention("flash_attention_2", "cuda") == "flash_attention_2"
    assert vision_attention_backend("cuda") == "flash_attn.flash_attn_varlen_func"


@pytest.mark.parametrize(
    ("module", "distribution"),
    [("flash_attn_interface", None), ("flash_attn", "flash-attn-4")],
    ids=["interface-without-distribution", "flash-attn-4"],
)
def test_a_module_of_another_distribution_is_not_flash_attention(site, module, distribution):
    _install(site, module, distribution)
    assert importlib.util.find_spec(module) is not None
    for version in (2, 3):
        assert flash_attention_available(version) is _transformers_finds(version) is False
    assert resolve_attention("flash_attention_3", "cuda") == "sdpa"
    assert vision_attention_backend("cuda") == "torch sdpa per image"


def test_nothing_installed_means_sdpa_and_cpu_never_asks(site):
    assert resolve_attention("flash_attention_3", "cuda") == "sdpa"
    _install(site, "flash_attn_interface", "flash-attn-3")
    assert resolve_attention("flash_attention_3", "cpu") == "sdpa"
    with pytest.raises(ValueError, match="flash_attention_3"):
        resolve_attention("flash_attention_4", "cuda")
