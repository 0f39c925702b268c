"""``model.compile``: each decoder layer through torch.compile gives the same training (fp32, CPU)."""

from __future__ import annotations

import pytest

from magistral_cli.config.loader import apply_overrides, validate_recipe
from magistral_cli.engine.trainer import Trainer
from magistral_cli.errors import UserError

from .helpers import make_recipe, recipe_dict, write_tiny_model

pytestmark = [pytest.mark.compat, pytest.mark.slow]


def _losses(model_dir, run_dir, compile_: bool) -> tuple[list[float], object]:
    trainer = Trainer(
        make_recipe(model_dir, run_dir, [f"model.compile={str(compile_).lower()}"], train_iters=3)
    )
    try:
        return [r["loss"] for r in trainer.train()], trainer.model
    finally:
        trainer.close()


def test_compiled_layers_train_like_eager_ones(tmp_path):
    write_tiny_model(tmp_path / "model")
    eager, _ = _losses(tmp_path / "model", tmp_path / "eager", False)
    compiled, model = _losses(tmp_path / "model", tmp_path / "compiled", True)
    layers = model.model.language_model.layers
    assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in layers), (
        "layers not compiled"
    )
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.dataset_param.basic_parameters.packing=true"], "model.compile with packing"),
        (["parallel.ulysses_parallel_size=2"], "model.compile with context parallelism"),
    ],
)
def test_compile_is_refused_where_it_cannot_work(tmp_path, overrides, message):
    raw = recipe_dict(tmp_path / "model", tmp_path / "run")
    with pytest.raises(UserError, match=message):
        validate_recipe(apply_overrides(raw, ["model.compile=true", *overrides]))
