"""Reading a Mistral3 ``config.json``, and the one rule for tied embeddings.

The published Magistral-Small-2509 ``config.json`` sets ``tie_word_embeddings`` nowhere: not at
the top level, not in ``text_config``. transformers 5's ``Mistral3Config`` defaults the
*top-level* flag to ``True``, and a model built from that config (for example on the meta
device, before loading) ties ``lm_head.weight`` to the token embedding: 23.34 billion unique
parameters instead of 24.01, and a trained head that is silently the embedding. transformers'
own ``save_pretrained`` writes the top-level flag as ``true`` next to ``text_config: false``.

The rule (:func:`apply_tying_rule`): the nested ``text_config`` decides, because the language
model owns both the embedding and the head. Its default (``MistralConfig``) is untied, so the
real config builds untied; a model whose ``text_config`` ties (Ministral-3 3B, say) trains and
exports tied. Every place that builds a model from a config goes through this module: the
engine, ``convert validate`` / export, the probes, the quickstart and the memory plan.

The model-FLOPs count (:func:`training_flops_per_token`, :func:`training_flops`) lives here too:
the trainer's ``tflops_per_gpu`` / ``mfu`` and the tests read it from the same config.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from magistral_cli.errors import UserError

CONFIG_FILE = "config.json"
#: The key of the output head and of the embedding it may be tied to (transformers layout).
HEAD_KEY = "lm_head.weight"
EMBED_KEY = "model.language_model.embed_tokens.weight"


def text_ties(config) -> bool:
    """Whether the language model ties its head to its embedding (``text_config`` decides)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False))


def apply_tying_rule(config):
    """Make the top-level ``tie_word_embeddings`` agree with ``text_config`` (returns ``config``).

    transformers ties by the top-level flag; after this the nested one is what counts.
    """
    tied = text_ties(config)
    config.tie_word_embeddings = tied
    if hasattr(config, "text_config"):
        config.text_config.tie_word_embeddings = tied
    return config


#: The sections of config.json that must be JSON objects when present.
CONFIG_SECTIONS = ("text_config", "vision_config")


def read_config_json(path: str | Path) -> dict:
    """``config.json`` at ``path`` as a dict, or one ``UserError`` naming what is wrong with the file:
    unreadable, not JSON, not a JSON object, or a ``text_config`` / ``vision_config`` that is not one.
    Every reader of the raw file goes through it, so a damaged file is one message, never a traceback."""
    path = Path(path)
    fix = "restore it from the model's original files (magistral fetch --model-dir DIR checks and downloads them)"
    data = _read_json_object(path, fix)
    for key in CONFIG_SECTIONS:
        if key in data and not isinstance(data[key], dict):
            raise UserError(f"{path}: {key} is a {type(data[key]).__name__}, not an object; {fix}")
    return data


def _read_json_object(path: Path, fix: str) -> dict:
    """The JSON object in ``path``, or one ``UserError`` (unreadable, not JSON, not an object) ending
    with ``fix``."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} cannot be read as JSON ({exc}); {fix}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a JSON {type(data).__name__}, not an object; {fix}")
    return data


def read_model_config(model_dir: str | Path, *, trust_remote_code: bool = False, what: str = "model"):
    """The ``Mistral3Config`` of ``model_dir/config.json`` with the tying rule applied; a directory
    of Mistral's native layout without config.json gives its ``params.json`` instead.

    One clear ``UserError`` for a missing, unreadable or non-Mistral3 config (``what`` names the
    setting or argument that pointed here).
    """
    from transformers import AutoConfig

    path = Path(model_dir)
    if not (path / CONFIG_FILE).is_file() and (path / PARAMS_FILE).is_file():
        return read_params_config(path)
    if not (path / CONFIG_FILE).is_file():
        raise UserError(
            f"{what} {path} has no {CONFIG_FILE} (nor Mistral's {PARAMS_FILE}); point it at the model "
            "directory (magistral fetch writes one)"
        )
    read_config_json(path / CONFIG_FILE)
    try:
        config = AutoConfig.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # a value of the wrong type is huggingface_hub's StrictDataclass error, and more
        detail = " ".join(str(exc).split())
        raise UserError(
            f"{path / CONFIG_FILE} cannot be read by transformers ({type(exc).__name__}: {detail[:300]}); "
            "restore it from the model's original files"
        ) from None
    if config.model_type != "mistral3":
        raise UserError(
            f"{path / CONFIG_FILE} describes a {config.model_type!r} model; "
            "magistral works with Mistral3 (Magistral-Small-2509) models only"
        )
    return apply_tying_rule(config)


# --------------------------------------------------------------------------- params.json


#: Mistral's native config file (beside consolidated.safetensors), as mistral-inference and vLLM's
#: ``--config-format mistral`` read it.
PARAMS_FILE = "params.json"
# params.json key -> text config attribute (the names of mistral-inference's TransformerArgs).
_PARAMS_TEXT = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "head_dim": "head_dim",
    "hidden_dim": "intermediate_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
}
# params.json ``vision_encoder`` key -> vision config attribute (Pixtral's VisionEncoderArgs).
_PARAMS_VISION = {
    "hidden_size": "hidden_size",
    "num_channels": "num_channels",
    "image_size": "image_size",
    "max_image_size": "image_size",
    "patch_size": "patch_size",
    "rope_theta": "rope_theta",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
}
#: Magistral's ``[IMG_BREAK]`` and ``[IMG_END]`` ids: params.json names them, config.json does not.
IMAGE_BREAK_TOKEN_ID = 12
IMAGE_END_TOKEN_ID = 13


def _rope_theta(config) -> float:
    """``rope_theta`` of a text or vision config (transformers 5 keeps it in ``rope_parameters``)."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    return float(theta)


def native_problems(config) -> list[str]:
    """What of ``config`` Mistral's native layout cannot say (empty when it can hold the model):
    the native model has a SiLU-gated decoder and vision tower, a GELU projector fed by the last
    vision layer, full attention and no RoPE scaling."""
    text, vision = config.text_config, config.vision_config
    problems = []
    for name, part in (("text_config", text), ("vision_config", vision)):
        if getattr(part, "hidden_act", "silu") != "silu":
            problems.append(f"{name}.hidden_act is {part.hidden_act!r}, not silu")
    if getattr(config, "projector_hidden_act", "gelu") != "gelu":
        problems.append(f"projector_hidden_act is {config.projector_hidden_act!r}, not gelu")
    if getattr(config, "vision_feature_layer", -1) != -1:
        problems.append(f"vision_feature_layer is {config.vision_feature_layer}, not -1")
    if getattr(text, "sliding_window", None) is not None:
        problems.append(f"text_config.sliding_window is {text.sliding_window}")
    rope_type = (getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}).get(
        "rope_type", "default"
    )
    if rope_type != "default":
        problems.append(f"the text rotary embedding is scaled ({rope_type})")
    if (vision.head_dim or 0) * vision.num_attention_heads != vision.hidden_size:
        problems.append("vision_config.head_dim x num_attention_heads is not hidden_size")
    return problems


def params_from_config(config) -> dict:
    """``params.json`` for a Mistral3 config: mistral-inference's names for the decoder at the top
    level and Pixtral's ``vision_encoder`` section (what vLLM's mistral config parser and the
    transformers conversion script read). Refuses a config the native layout cannot express."""
    config = apply_tying_rule(config)
    problems = native_problems(config)
    if problems:
        raise UserError(
            "this model cannot be written in Mistral's native layout: "
            + "; ".join(problems)
            + "; export it with --format hf"
        )
    text, vision = config.text_config, config.vision_config
    params = {key: getattr(text, attr) for key, attr in _PARAMS_TEXT.items() if key != "rope_theta"}
    params["head_dim"] = _head_dim(text)
    params["rope_theta"] = _rope_theta(text)
    params = {key: params[key] for key in _PARAMS_TEXT}  # params.json's own key order
    if text_ties(config):
        params["tied_embeddings"] = True
    encoder = {key: getattr(vision, attr) for key, attr in _PARAMS_VISION.items() if key != "rope_theta"}
    encoder["rope_theta"] = _rope_theta(vision)
    encoder = {key: encoder[key] for key in _PARAMS_VISION}
    encoder.update(
        adapter_bias=bool(config.multimodal_projector_bias),
        mm_projector_id="patch_merge",
        spatial_merge_size=config.spatial_merge_size,
        add_pre_mm_projector_layer_norm=True,
        image_token_id=config.image_token_index,
        image_break_token_id=IMAGE_BREAK_TOKEN_ID,
        image_end_token_id=IMAGE_END_TOKEN_ID,
    )
    params["vision_encoder"] = encoder
    return params


def read_params_config(model_dir: str | Path):
    """``config_from_params`` of ``model_dir/params.json``."""
    path = Path(model_dir) / PARAMS_FILE
    return config_from_params(_read_json_object(path, "download it again"), str(path))


def config_from_params(params: dict, where: str = PARAMS_FILE):
    """The ``Mistral3Config`` a ``params.json`` describes (the tying rule applied), as transformers'
    Mistral3 conversion builds it; a missing key is one ``UserError`` naming ``where``."""
    from transformers import Mistral3Config

    try:
        text = {attr: params[key] for key, attr in _PARAMS_TEXT.items() if key != "max_position_embeddings"}
        text["max_position_embeddings"] = params.get(
            "max_position_embeddings", params.get("max_seq_len", 131072)
        )
        text.update(
            model_type="mistral",
            hidden_act="silu",
            sliding_window=None,
            tie_word_embeddings=bool(params.get("tied_embeddings", False)),
        )
        encoder = params["vision_encoder"]
        vision = {attr: encoder[key] for key, attr in _PARAMS_VISION.items() if key != "max_image_size"}
        # SiLU, as mistral-inference's vision encoder (PixtralVisionConfig's own default is GELU).
        vision.update(
            model_type="pixtral",
            hidden_act="silu",
            head_dim=encoder["hidden_size"] // encoder["num_attention_heads"],
        )
        config = Mistral3Config(
            text_config=text,
            vision_config=vision,
            image_token_index=encoder.get("image_token_id", 10),
            spatial_merge_size=encoder.get("spatial_merge_size", 1),
            multimodal_projector_bias=bool(encoder.get("adapter_bias", False)),
            projector_hidden_act="gelu",
            vision_feature_layer=-1,
        )
    except (KeyError, TypeError) as exc:
        raise UserError(
            f"{where} lacks {exc} or is not a Mistral3 params.json (a decoder with a vision_encoder section)"
        ) from None
    return apply_tying_rule(config)


def tied_aliases(model) -> set[str]:
    """State-dict keys whose tensor an earlier key already holds (a tied head: ``lm_head.weight``).

    A checkpoint of a tied model leaves them out, as tied models ship.
    """
    seen: set[int] = set()
    aliases: set[str] = set()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            aliases.add(key)
        seen.add(id(value))
    return aliases


def unique_parameters(model, frozen_prefixes: list[str] | None = None) -> Iterator[tuple[str, Any, bool]]:
    """``(name, parameter, trains)`` for each parameter of ``model`` once (a tied head is one).

    A parameter trains when its ``requires_grad`` is on and, with ``frozen_prefixes`` (module
    names, as ``apply_freeze`` returns them), it sits under none of them: a meta model that was
    never frozen is split as the recipe would freeze it, and a LoRA model's base (``requires_grad``
    off) counts as frozen either way. Every count of a model's parameters walks this.
    """
    prefixes = tuple(f"{p}." for p in frozen_prefixes or ())
    # named_parameters yields a tensor shared by two modules (a tied head) once.
    for name, param in model.named_parameters(remove_duplicate=True):
        yield name, param, param.requires_grad and not name.startswith(prefixes)


def parameter_counts(model, frozen_prefixes: list[str] | None = None) -> dict[str, int]:
    """Unique parameter counts of ``model``: total, trainable and frozen (:func:`unique_parameters`)."""
    total = trainable = 0
    for _, param, trains in unique_parameters(model, frozen_prefixes):
        n = param.numel()
        total += n
        trainable += n if trains else 0
    return {"total": total, "trainable": trainable, "frozen": total - trainable}


# --------------------------------------------------------------------------- model FLOPs


def _text(config):
    """The decoder's config: ``text_config`` of a Mistral3 config, or the text config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def forward_tail_modules(config) -> tuple[str, ...]:
    """The modules whose forwards run last, in this order: the last decoder layer, the final norm
    and the output head. The backward starts with them, in the reverse order."""
    last = _text(config).num_hidden_layers - 1
    return (f"model.language_model.layers.{last}", "model.language_model.norm", "lm_head")


def in_forward_tail(name: str, tail: tuple[str, ...]) -> bool:
    """Whether the module ``name`` is one of ``tail`` (:func:`forward_tail_modules`) or inside one."""
    return any(name == t or name.startswith(f"{t}.") for t in tail)


def _head_dim(text) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def matmul_parameters(config) -> int:
    """The weights each trained token is multiplied by: q, k, v, o and the gate / up / down
    projections of every decoder layer, plus the output head (tied or not, it is one matmul).

    Not the embedding (a lookup), the norms (elementwise) or the vision tower and projector
    (frozen in the seed's recipes). The sizes are the config's; a model built from it holds
    exactly these weights (``tests/test_model_flops.py`` counts them with :func:`parameter_counts`).
    """
    text = _text(config)
    hidden, heads, kv_heads = text.hidden_size, text.num_attention_heads, text.num_key_value_heads
    head_dim = _head_dim(text)
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    mlp = 3 * hidden * text.intermediate_size  # gate, up, down
    return text.num_hidden_layers * (attention + mlp) + text.vocab_size * hidden


def training_flops_per_token(config, seq_len: int) -> int:
    """Model FLOPs of training one token of a ``seq_len``-token sequence (forward and backward).

    ``6 x matmul_parameters + 6 x layers x heads x head_dim x seq_len``: 2 FLOPs per
    multiply-add, times 3 for the forward and the two backward products; the attention term is
    QK^T and AV over the causal half of the score matrix (Megatron's and PaLM's model-FLOPs count
    with the causal halving). Recompute, padding and the frozen vision tower are not counted: this
    is the work the model needs, not what the device ran (MFU's numerator).
    """
    text = _text(config)
    attention = 6 * text.num_hidden_layers * text.num_attention_heads * _head_dim(text) * int(seq_len)
    return 6 * matmul_parameters(text) + attention


def training_flops(config, lengths) -> int:
    """Model FLOPs of training the sequences of ``lengths`` tokens each (an exact integer):
    the sum of ``6 x matmul_parameters x n + 6 x layers x heads x head_dim x n^2``."""
    text = _text(config)
    lengths = [int(n) for n in lengths]
    per_token = 6 * matmul_parameters(text)
    attention = 6 * text.num_hidden_layers * text.num_attention_heads * _head_dim(text)
    return per_token * sum(lengths) + attention * sum(n * n for n in lengths)
