"""The recipe schema: MindSpeed-MM's FSDP2 YAML format, typed.

Sections and field names follow the seed's configs (``parallel``, ``data``, ``model``,
``features``, ``training``, ``tools``) so that users can bring those files unchanged apart
from machine paths. Fields that the seed format lacks and this project adds are marked
"Addition" in their description (``parallel.device``, ``parallel.nproc_per_node``,
``training.output_dir``, ``training.resume``, ...).

Validation stays next to the field it checks: ranges through ``Field`` bounds, and the few
rules that span fields in the ``model_validator`` of the section that owns them. Rules that
need the world size (which only the launcher knows) live in ``check_world_size``.
"""

from __future__ import annotations

import functools
import typing
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from magistral_cli.errors import UserError

Dtype = Literal["bf16", "fp16", "fp32"]
Device = Literal["auto", "cpu", "cuda", "npu"]


@functools.cache
def _number_kinds(annotation: Any) -> tuple[str | None, str | None]:
    """(kind of the value, kind of a list's items): "an integer" / "a number" / None.

    Looks through Optional / Union; ``bool`` itself is not a number kind.
    """
    if annotation is int:
        return "an integer", None
    if annotation is float:
        return "a number", None
    origin = typing.get_origin(annotation)
    if origin is list:
        (item,) = typing.get_args(annotation) or (Any,)
        return None, _number_kinds(item)[0]
    if origin is Union:
        value = items = None
        for arg in typing.get_args(annotation):
            v, i = _number_kinds(arg)
            value, items = value or v, items or i
        return value, items
    return None, None


_BOOL_HINT = "write the number itself (YAML reads true/false, yes/no and on/off as booleans)"

#: The range of every integer of a recipe: C's 64-bit integer, what torch and NumPy take.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: ``training.seed``: NumPy's legacy generator takes 32 bits, and the synthetic data seeds each
#: sample with ``seed * 1_000_003 + k`` (within torch's 64 bits for every such seed).
SEED_MAX = 2**32 - 1
#: ``cutoff_len`` (and a micro-batch's tokens with packing): the attention kernels' segment
#: offsets (``cu_seqlens``) are int32.
TOKENS_MAX = 2**31 - 1
#: ``model.attn_implementation``: what ``ops.attention.resolve_attention`` accepts (a test keeps the
#: two equal; ops/ knows nothing of recipes).
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "npu_fusion_attention")


class Section(BaseModel):
    """Every recipe section rejects unknown keys (the loader names the nearest valid one).

    Numbers are checked more strictly than pydantic's lax mode, for every field of every
    section: a boolean is not a number (seen: ``train_iters: true`` ran 1 step), and a float
    must be finite (seen: ``lr: .inf`` passed the recipe check; ``allow_inf_nan``). Ints are
    still accepted for floats (``lr: 1``) and strings such as ``2e-5`` still parse.

    The schema's keys are MindSpeed-MM's, ``model_name_or_path`` and ``model_id`` among them: no
    namespace is protected (pydantic before 2.10 warned on every field named ``model_*``).
    """

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, allow_inf_nan=False, protected_namespaces=()
    )

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_are_not_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, bool | list):
            return value
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        if field is None:
            return value
        kind, item_kind = _number_kinds(field.annotation)
        if isinstance(value, bool) and kind is not None:
            raise ValueError(f"got the boolean {str(value).lower()}, which is not {kind}; {_BOOL_HINT}")
        if isinstance(value, list) and item_kind is not None:
            for i, item in enumerate(value):
                if isinstance(item, bool):
                    raise ValueError(
                        f"item {i} is the boolean {str(item).lower()}, not {item_kind}; {_BOOL_HINT}"
                    )
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _integers_fit_64_bits(cls, value: Any) -> Any:
        # Every integer of every section (seen: train_iters: 10**30 passed the dry run, and a seed
        # of 10**30 overflowed inside torch on every rank).
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, int) and not isinstance(item, bool) and not INT64_MIN <= item <= INT64_MAX:
                what = f"item {i} ({item})" if isinstance(value, list) else str(item)
                raise ValueError(
                    f"{what} does not fit in 64 bits (torch and NumPy take C integers); "
                    f"write a number between {INT64_MIN} and {INT64_MAX}"
                )
        return value


# --------------------------------------------------------------------------- parallel


class FSDPPlan(Section):
    apply_modules: list[str] = Field(
        default_factory=lambda: [
            "model.vision_tower.transformer.layers.{*}",
            "model.vision_tower",
            "model.multi_modal_projector",
            "model.language_model.embed_tokens",
            "model.language_model.layers.{*}",
            "model.language_model",
            "lm_head",
        ],
        description="Module patterns wrapped with fully_shard, applied bottom-up in this order; the root is always wrapped last.",
    )
    param_dtype: Optional[Dtype] = Field(
        "bf16",
        description="Dtype of the all-gathered parameters in forward/backward (MixedPrecisionPolicy.param_dtype).",
    )
    reduce_dtype: Optional[Dtype] = Field(
        "fp32", description="Dtype of gradient reduce-scatter (MixedPrecisionPolicy.reduce_dtype)."
    )
    num_to_forward_prefetch: int = Field(
        0,
        ge=0,
        description="FSDP2 units to all-gather ahead in forward (set_modules_to_forward_prefetch), along the "
        "chain of every unit in forward order, as the seed chains them.",
    )
    num_to_backward_prefetch: int = Field(
        0,
        ge=0,
        description="FSDP2 units to all-gather ahead in backward (set_modules_to_backward_prefetch), along "
        "the same chain reversed.",
    )
    use_triton_split_copy: bool = Field(
        False,
        description="Register the Triton kernel for FSDP2's all-gather copy-out (split_with_sizes_copy) in this process.",
    )
    pregather: bool = Field(
        False, description="MindSpeed-MM pre-gather switch; accepted for compatibility, unused."
    )
    reshard_after_forward: Union[bool, Literal["always"]] = Field(
        True,
        description="Free the gathered parameters after forward and gather again in backward (ZeRO-3). "
        "Addition: true keeps the forward's tail (the last decoder layer, the final norm, the head) gathered "
        "until its backward, which starts with it, as FSDP2 keeps its root; 'always' frees every unit, the "
        "tail and the root too (the least memory: about one decoder layer less at the loss, for an all-gather "
        "more); false frees none until its backward.",
    )
    defer_grad_sync: bool = Field(
        False,
        description=(
            "Addition. With gradient accumulation, reduce-scatter only after the last micro-batch. "
            "Saves communication but holds every trainable parameter's gradient unsharded (param_dtype "
            "bytes per trainable parameter on every rank: 43.9 GiB at 24B in bf16). Default: reduce-scatter "
            "after every micro-batch, so ranks hold only their gradient shards."
        ),
    )

    @field_validator("reshard_after_forward", mode="before")
    @classmethod
    def _reshard_values(cls, value):
        if value is True or value is False or value == "always":
            return value
        raise ValueError(f"must be true, false or 'always', got {value!r}")


class Parallel(Section):
    tensor_parallel_size: int = Field(
        1, ge=1, description="Tensor parallelism degree. Only 1 is supported (pure FSDP2)."
    )
    fully_shard_parallel_size: Union[Literal["auto"], int] = Field(
        "auto", description="FSDP degree; 'auto' = world size / context-parallel degree."
    )
    fsdp_plan: FSDPPlan = Field(default_factory=FSDPPlan, description="What FSDP2 wraps and how.")
    ring_attention_size: int = Field(1, ge=1, description="Ring-attention context-parallel degree.")
    ulysses_parallel_size: int = Field(
        1, ge=1, description="Ulysses (all-to-all over heads) context-parallel degree."
    )
    device: Device = Field(
        "auto", description="Addition. Device to train on: auto picks npu, then cuda, then cpu."
    )
    device_memory_gib: Optional[float] = Field(
        None,
        gt=0,
        description="Addition. Memory of one device in GiB for the --dry-run memory plan; null = detected when a device is visible.",
    )
    nproc_per_node: Optional[int] = Field(
        None,
        ge=1,
        description="Addition. Processes per node for `magistral train`; null = one per visible device (1 on the CPU). --nproc-per-node wins.",
    )

    @field_validator("fully_shard_parallel_size")
    @classmethod
    def _positive_fsdp(cls, value):
        if isinstance(value, int) and value < 1:
            raise ValueError("must be 'auto' or a positive integer")
        return value

    @field_validator("tensor_parallel_size")
    @classmethod
    def _no_tp(cls, value):
        if value != 1:
            raise ValueError("tensor parallelism is not supported (pure FSDP2); set tensor_parallel_size: 1")
        return value

    @property
    def cp_size(self) -> int:
        """Context-parallel degree: Ulysses x Ring."""
        return self.ulysses_parallel_size * self.ring_attention_size


# --------------------------------------------------------------------------- data


class DatasetAttr(Section):
    system: Optional[str] = Field(None, description="Column holding the system prompt (ShareGPT style).")
    images: Optional[str] = Field("images", description="Column holding the list of image paths.")
    videos: Optional[str] = Field(
        None, description="Column holding the list of video paths (not supported for Magistral)."
    )
    messages: str = Field("messages", description="Column holding the conversation.")
    role_tag: str = Field("role", description="Key of a message's role.")
    content_tag: str = Field("content", description="Key of a message's text.")
    user_tag: str = Field("user", description="Role value of user turns.")
    assistant_tag: str = Field("assistant", description="Role value of assistant turns.")
    observation_tag: Optional[str] = Field(None, description="Role value of tool results ([TOOL_RESULTS]).")
    function_tag: Optional[str] = Field(None, description="Role value of tool calls.")
    system_tag: Optional[str] = Field(
        None, description="Role value of system messages inside the conversation."
    )
    reasoning_tag: Optional[str] = Field(
        "reasoning_content",
        description="Addition. Key of an assistant message's reasoning, beside its content (encoded as "
        "[THINK]reasoning[/THINK] before the answer; empty or null = none); null reads no such key.",
    )
    chosen: str = Field(
        "chosen",
        description="Addition (LLaMA-Factory's ranking columns). Under training.stage: dpo, the column holding "
        "the preferred answer: one assistant message.",
    )
    rejected: str = Field(
        "rejected",
        description="Addition. Under training.stage: dpo, the column holding the dispreferred answer: one "
        "assistant message.",
    )
    formatting: Literal["alpaca", "sharegpt", "auto"] = Field(
        "auto",
        description="Addition. Record style; auto detects LLaVA 'messages' or ShareGPT 'conversations'.",
    )


#: The seed's video settings (its configs and our defaults). Videos are not supported, so these
#: are the only values accepted: any other would be a setting that silently does nothing.
VIDEO_DEFAULTS: dict[str, Any] = {
    "video_max_pixels": 16384,
    "video_min_pixels": 0,
    "video_fps": 2.0,
    "video_maxlen": 64,
}


class PreprocessParameters(Section):
    model_name_or_path: Optional[str] = Field(
        None, description="Model directory holding the tokenizer and processor files."
    )
    use_fast_tokenizer: bool = Field(
        True,
        description="The tokenizer is always the fast one (a tokenizers.Tokenizer built from tekken.json or "
        "tokenizer.json); true is accepted, false is refused.",
    )
    split_special_tokens: bool = Field(
        True,
        description="Encode control-token strings written in the data ([INST], </s>) as plain text, as "
        "mistral-common does (the default). false is the seed's setting (LLaMA-Factory's): they become "
        "control tokens, which the preprocess report counts and warns about; a sample whose text holds "
        "[IMG], [IMG_BREAK] or [IMG_END] is then dropped (image_token_in_text), as only an image may make those.",
    )
    image_max_pixels: int = Field(
        262144, ge=1, description="Images larger than this many pixels are downscaled."
    )
    image_min_pixels: int = Field(
        1024, ge=0, description="Images smaller than this many pixels are upscaled."
    )
    video_max_pixels: int = Field(
        VIDEO_DEFAULTS["video_max_pixels"],
        ge=0,
        description="Video frame pixel limit. Videos are not supported (rows with videos are dropped), so "
        "only the seed's value is accepted.",
    )
    video_min_pixels: int = Field(
        VIDEO_DEFAULTS["video_min_pixels"],
        ge=0,
        description="Video frame minimum pixels (see video_max_pixels).",
    )
    video_fps: float = Field(
        VIDEO_DEFAULTS["video_fps"], gt=0, description="Video sampling rate (see video_max_pixels)."
    )
    video_maxlen: int = Field(
        VIDEO_DEFAULTS["video_maxlen"],
        ge=0,
        description="Maximum sampled video frames (see video_max_pixels).",
    )
    fix_mistral_regex: bool = Field(
        False,
        description="Repair the pre-tokenizer regex of third-party Mistral tokenizer.json files (false refuses "
        "one whose regex differs from Tekken's). With tekken.json it changes nothing: tekken.json carries "
        "Tekken's own regex, which is what the repair writes.",
    )
    trust_remote_code: bool = Field(
        False,
        description="The data side reads tekken.json / tokenizer.json and runs no code from the model "
        "directory; false is accepted, true is refused (model.trust_remote_code is the model's switch).",
    )
    tokenizer_source: Literal["official", "unsloth", "auto"] = Field(
        "auto",
        description="Addition. official = tekken.json, unsloth = tokenizer.json; auto prefers tekken.json when present.",
    )
    image_grid: Literal["mistral_common", "transformers"] = Field(
        "mistral_common",
        description=(
            "Addition. How an image's sides become [IMG] rows and columns: mistral_common (Mistral's "
            "ImageEncoder, the default) rounds each side up to 28 px, so a 300x200 image is 8 rows of 11; "
            "transformers (the seed's LLaMA-Factory path: PixtralImageProcessor rounds up to 14 px, the patch "
            "merger floors to 28) makes it 7 rows of 11, the seed's tokens and pixels exactly."
        ),
    )

    @field_validator("use_fast_tokenizer")
    @classmethod
    def _fast_only(cls, value):
        if not value:
            raise ValueError(
                "false is not supported: the tokenizer is always the fast one, built from "
                "tekken.json or tokenizer.json (there is no slow implementation to choose); set it to true"
            )
        return value

    @field_validator("trust_remote_code")
    @classmethod
    def _no_data_remote_code(cls, value):
        if value:
            raise ValueError(
                "true is not supported here: preprocessing reads tekken.json or "
                "tokenizer.json and never runs code from the model directory; set it to false "
                "(model.trust_remote_code is the switch for loading the model's config)"
            )
        return value

    @field_validator(*VIDEO_DEFAULTS)
    @classmethod
    def _no_video_settings(cls, value, info: ValidationInfo):
        default = VIDEO_DEFAULTS[info.field_name]
        if value != default:
            raise ValueError(
                f"{value!r} would have no effect: videos are not supported for Magistral "
                f"(rows with videos are dropped and counted in the data report); remove the key or keep the "
                f"seed's value {default!r}"
            )
        return value

    @model_validator(mode="after")
    def _pixels(self):
        if self.image_min_pixels > self.image_max_pixels:
            raise ValueError(
                f"image_min_pixels ({self.image_min_pixels}) is larger than image_max_pixels ({self.image_max_pixels})"
            )
        return self


class BasicParameters(Section):
    cutoff_len: int = Field(
        2048,
        ge=1,
        le=TOKENS_MAX,
        description="Maximum tokens per sample; samples whose image tokens would be cut are dropped.",
    )
    template: str = Field("mistral", description="Chat template name ('mistral', Magistral's own).")

    @field_validator("template")
    @classmethod
    def _known_template(cls, name: str) -> str:
        if name not in TEMPLATES:
            raise ValueError(
                f"template {name!r} is not supported; Magistral uses 'mistral' "
                "(data.dataset_param.basic_parameters.template=mistral)"
            )
        return name

    enable_thinking: bool = Field(
        False,
        description=(
            "Accepted for the seed's configs; like the seed's mistral template it changes no token: the "
            "thinking prompt comes from default_system (true with default_system: '' is refused)."
        ),
    )
    train_on_prompt: bool = Field(False, description="Also train on prompt tokens.")
    train_on_reasoning: bool = Field(
        True,
        description="Addition. Train on the reasoning of assistant turns ([THINK] ... [/THINK], markers "
        "included; tokenizer v13). false masks it: the loss sees only the answer after it.",
    )
    mask_history: bool = Field(False, description="Train on the last assistant turn only.")
    tool_format: Optional[str] = Field(None, description="Tool-call format (unused by the mistral template).")
    dataset_dir: Optional[str] = Field(None, description="Directory that image paths are relative to.")
    allow_outside_dataset_dir: bool = Field(
        True,
        description="Addition. Read images whose path leads outside dataset_dir (absolute, ../ or through a "
        "symlink; the preprocess report counts them). false drops such a sample (image_outside_dataset_dir).",
    )
    dataset: Optional[str] = Field(None, description="Dataset file (LLaVA/ShareGPT JSON or JSONL).")
    cache_dir: str = Field(
        "./cache_dir/", description="Where encoded samples are cached, keyed by a fingerprint."
    )
    overwrite_cache: bool = Field(False, description="Re-encode even when a cache entry exists.")
    preprocessing_batch_size: int = Field(1000, ge=1, description="Rows handed to a worker at a time.")
    preprocessing_num_workers: Optional[int] = Field(
        None, ge=1, description="Worker processes for preprocessing."
    )
    max_samples: Optional[int] = Field(None, ge=1, description="Use only the first N rows.")
    packing: bool = Field(False, description="Concatenate samples up to cutoff_len (causal across samples).")
    neat_packing: bool = Field(
        False,
        description=(
            "Packing in which each sample attends to its own tokens only (and packing: true by default); "
            "the same on every device. Not with context parallelism. Under training.stage: dpo a pack holds "
            "whole pairs, up to 2 x cutoff_len tokens."
        ),
    )
    default_system: Optional[str] = Field(
        None,
        description=(
            "Addition. System prompt for samples that have none: absent or null = the seed template's "
            "default, Magistral's thinking prompt; '' = no system prompt; any other text = that text."
        ),
    )
    streaming: bool = Field(
        False, description="MindSpeed-MM streaming switch (not supported; must stay false)."
    )
    val_size: Union[float, int] = Field(
        0,
        description=(
            "Addition. Validation split, LLaMA-Factory's val_size: a fraction in (0, 1) of the encoded samples "
            "(rounded, at least 1) or a count >= 1 (an integral float such as 200.0 is a count); 0 = no "
            "validation. Split before any shuffling, seeded by training.seed; training reads the rest."
        ),
    )

    @field_validator("streaming")
    @classmethod
    def _no_streaming(cls, value):
        if value:
            raise ValueError("streaming datasets are not supported; preprocess into the cache instead")
        return value

    @field_validator("val_size", mode="before")
    @classmethod
    def _val_size_number(cls, value):
        if isinstance(value, str):  # one clear message instead of one per member of the union
            try:
                return int(value)
            except ValueError:
                pass
            try:
                return float(value)
            except ValueError:
                raise ValueError(
                    f"must be a number, got {value!r}: a fraction such as 0.05 or a count such as 200"
                ) from None
        return value

    @field_validator("val_size")
    @classmethod
    def _val_size(cls, value):
        if value < 0:
            raise ValueError(
                f"must be 0 (no validation), a fraction in (0, 1) or a count >= 1, got {value}; "
                "write a fraction such as 0.05 or a count of samples such as 200"
            )
        if isinstance(value, float) and value >= 1:
            if value == 1:
                raise ValueError(
                    "1.0 as a fraction would take the whole dataset and leave no training sample; write a "
                    "fraction below 1 (0.05) or, for one validation sample, the count 1"
                )
            if not value.is_integer():
                raise ValueError(
                    f"{value} is neither a fraction in (0, 1) nor a whole count of samples; write a fraction "
                    f"such as 0.05 or a count such as {round(value)}"
                )
            return int(value)  # LLaMA-Factory reads val_size > 1 as a count
        return 0 if value == 0 else value

    @model_validator(mode="before")
    @classmethod
    def _neat_packing_packs(cls, data):
        # LLaMA-Factory's rule: neat_packing turns packing on (a neat pack is still a pack).
        if isinstance(data, dict) and data.get("neat_packing") is True and "packing" not in data:
            data = {**data, "packing": True}
        return data

    @model_validator(mode="after")
    def _neat_packing_needs_packing(self):
        if self.neat_packing and not self.packing:
            raise ValueError(
                "neat_packing: true with packing: false; neat_packing packs samples (each attending to "
                "itself only): set packing: true, or neat_packing: false for no packing"
            )
        return self


class SyntheticData(Section):
    """Shape of ``dataset_type: synthetic`` batches (machine checks, tests and benchmarks)."""

    image_every: int = Field(
        2, ge=0, description="Every that many samples (by index) has an image; 0 = text only."
    )
    full_length: bool = Field(
        False,
        description="Every sample is cutoff_len tokens long (default: a random length from half of it), "
        "so a step holds exactly micro_batch_size x cutoff_len tokens, as a benchmark's bare loop does.",
    )


#: ``dataset_type`` of the random batches that check a machine without a dataset.
SYNTHETIC = "synthetic"
#: Chat templates the data pipeline encodes with (Magistral's own).
TEMPLATES = ("mistral",)


class DatasetParam(Section):
    dataset_type: Literal["huggingface", "synthetic"] = Field(
        "huggingface",
        description="Dataset loader kind: 'huggingface' (the LLaVA/ShareGPT JSON reader) or 'synthetic' "
        "(random batches in the loader's format, to check a machine without a dataset).",
    )
    attr: DatasetAttr = Field(
        default_factory=DatasetAttr, description="Column and role names of the dataset."
    )
    preprocess_parameters: PreprocessParameters = Field(
        default_factory=PreprocessParameters, description="Tokenizer and image processing."
    )
    basic_parameters: BasicParameters = Field(
        default_factory=BasicParameters, description="Template, truncation, cache."
    )
    synthetic: SyntheticData = Field(
        default_factory=SyntheticData, description="Batch shape when dataset_type is synthetic."
    )

    @property
    def is_synthetic(self) -> bool:
        return self.dataset_type == SYNTHETIC

    @model_validator(mode="after")
    def _synthetic_val_size(self):
        val_size = self.basic_parameters.val_size
        if self.is_synthetic and isinstance(val_size, float) and val_size > 0:
            raise ValueError(
                f"data.dataset_param.basic_parameters.val_size is the fraction {val_size}, and synthetic data "
                "(dataset_type: synthetic) has no dataset size to take a fraction of: set a count of synthetic "
                "validation samples (val_size: 8)"
            )
        return self


class CollateParam(Section):
    collator_id: str = Field("pixtral", description="Collator name; 'pixtral' pads right and batches images.")
    ignore_pad_token_for_loss: bool = Field(True, description="Labels are -100 on padding.")


class DataloaderParam(Section):
    pin_memory: bool = Field(True, description="Pin host memory of batches.")
    shuffle: bool = Field(
        True,
        description="Shuffle every epoch (BaseRandomBatchSampler by the epoch alone, ignoring the seed).",
    )
    dataloader_mode: str = Field("sampler", description="MindSpeed-MM loader mode; 'sampler' is supported.")
    drop_last: bool = Field(True, description="Drop the last incomplete global batch.")
    sampler_type: str = Field(
        "BaseRandomBatchSampler",
        description=(
            "Sample order: BaseRandomBatchSampler (the seed's: epoch-seeded), SeedRandomBatchSampler (the "
            "seed's: epoch and training.seed), or the addition MagistralRandomBatchSampler (seed + epoch, "
            "drop_last false allowed). Others are refused."
        ),
    )
    infinite_sampler: bool = Field(
        False, description="Continue across epochs in the order of consecutive epochs."
    )
    num_workers: int = Field(0, ge=0, description="Data-loader worker processes per rank.")
    prefetch_factor: Optional[int] = Field(None, ge=1, description="Batches prefetched per worker.")
    persistent_workers: bool = Field(False, description="Keep workers alive across epochs.")
    collate_param: CollateParam = Field(default_factory=CollateParam, description="Collator settings.")
    enable_preload: bool = Field(
        False,
        description="MindSpeed-MM's preload switch. Preloading is not supported: false (the seed's value) is "
        "accepted, true is refused.",
    )

    @field_validator("enable_preload")
    @classmethod
    def _no_preload(cls, value):
        if value:
            raise ValueError(
                "true is not supported: there is no preload stage (samples are encoded into the "
                "cache before the run, and num_workers / prefetch_factor / pin_memory overlap loading with "
                "the steps); set it to false"
            )
        return value


class Data(Section):
    dataset_param: DatasetParam = Field(
        default_factory=DatasetParam, description="What to read and how to encode it."
    )
    dataloader_param: DataloaderParam = Field(
        default_factory=DataloaderParam, description="How batches are loaded."
    )


# --------------------------------------------------------------------------- model


#: ``model.lora.apply_to`` scopes: where a bare Linear-layer name (``q_proj``) looks for layers.
LORA_SCOPES = {
    "language_model": "model.language_model",
    "projector": "model.multi_modal_projector",
    "vision_tower": "model.vision_tower",
}
#: ``model.lora.init_lora_weights`` values (PEFT's that need no base weights or data).
LORA_INITS = (True, False, "gaussian")


class LoraConfig(Section):
    """LoRA adapters (MindSpeed-MM's ``--lora-r / --lora-alpha / --lora-dropout / --lora-target-modules``)."""

    r: int = Field(16, ge=1, description="Addition. LoRA rank (MindSpeed-MM --lora-r).")
    alpha: int = Field(
        32, ge=1, description="Addition. LoRA alpha (--lora-alpha); the update is scaled by alpha / r."
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Addition. Dropout on the adapters' input (--lora-dropout)."
    )
    target_modules: list[str] = Field(
        default_factory=list,
        validate_default=True,
        description=(
            "Addition. Linear layers that get adapters (--lora-target-modules): a bare layer name "
            "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) means every Linear of that name "
            "in the apply_to parts; a dotted module pattern ({*} = one component, as in model.freeze) names "
            "layers anywhere. A name or pattern that matches no Linear layer is an error."
        ),
    )
    apply_to: list[Literal["language_model", "projector", "vision_tower"]] = Field(
        default_factory=lambda: ["language_model"],
        min_length=1,
        description="Addition. Where bare names in target_modules look: language_model, projector, vision_tower.",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description=(
            "Addition. Module patterns trained in full next to the adapters (PEFT's modules_to_save, "
            "e.g. lm_head); saved with the adapters."
        ),
    )
    init_lora_weights: Union[bool, str] = Field(
        True,
        description=(
            "Addition. PEFT's init_lora_weights: true (PEFT's default: A kaiming-uniform, B zero), 'gaussian' "
            "(A normal with std 1/r, B zero) or false (A and B random: the model changes at step 0; for tests)."
        ),
    )

    quantize_base: Literal["none", "nf4"] = Field(
        "none",
        description=(
            "Addition. QLoRA: 'nf4' stores the frozen Linear weights of the decoder layers in 4-bit NormalFloat "
            "(torchao's NF4Tensor: per-block absmax scales, double-quantised as in the QLoRA paper), quantised "
            "per parameter as they load and dequantised per Linear in the forward and backward; norms, "
            "embeddings, the lm_head and (unless quantize_apply_to names them) the projector and the vision "
            "tower stay in param_dtype. Needs "
            "`pip install 'magistral-cli[qlora]'`. 'none': the base in param_dtype (plain LoRA)."
        ),
    )
    quantize_apply_to: list[Literal["language_model", "projector", "vision_tower"]] = Field(
        default_factory=lambda: ["language_model"],
        min_length=1,
        description=(
            "Addition. Where quantize_base quantises the frozen Linear weights: language_model (the decoder "
            "layers' projections), projector, vision_tower. Norms, embeddings and the lm_head never."
        ),
    )
    quantize_block_size: int = Field(
        64,
        ge=2,
        description=(
            "Addition. NF4 block: elements sharing one absmax scale (the QLoRA paper's 64). A quantised weight's "
            "element count must divide by quantize_block_size x quantize_scaler_block_size x the FSDP group size."
        ),
    )
    quantize_scaler_block_size: int = Field(
        256,
        ge=1,
        description=(
            "Addition. NF4 double quantisation: block scales sharing one 8-bit quantisation factor (the QLoRA "
            "paper's 256); smaller only for models too narrow for 64 x 256 (the tiny test model)."
        ),
    )

    @field_validator("quantize_block_size")
    @classmethod
    def _even_block(cls, value: int):
        if value % 2:
            raise ValueError(
                f"{value} is odd; NF4 packs two 4-bit values a byte: use an even size such as 64"
            )
        return value

    @field_validator("target_modules", "modules_to_save")
    @classmethod
    def _names(cls, value: list[str], info: ValidationInfo):
        if not value and info.field_name == "target_modules":
            raise ValueError(
                "is empty; list the Linear layers to adapt, e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, "
                "up_proj, down_proj], or remove model.lora for full fine-tuning"
            )
        for item in value:
            if not item or item != item.strip() or " " in item:
                raise ValueError(
                    f"{item!r} is empty or has spaces; write a layer name (q_proj) or a module pattern "
                    "(model.language_model.layers.{*}.self_attn.q_proj)"
                )
        repeated = sorted({item for item in value if value.count(item) > 1})
        if repeated:
            raise ValueError(f"{repeated[0]!r} is listed twice; list each name once")
        return value

    @field_validator("init_lora_weights", mode="before")
    @classmethod
    def _init(cls, value):
        if isinstance(value, str) and value.lower() == "gaussian":
            return "gaussian"
        if value not in LORA_INITS or not isinstance(value, bool | str):
            raise ValueError(
                f"{value!r} is not supported; use true (PEFT's default: A kaiming-uniform, B zero), 'gaussian' "
                "or false (PEFT's data- or weight-driven inits such as pissa, olora, loftq, eva are not)"
            )
        return value

    @property
    def scaling(self) -> float:
        """The factor of the adapters' update: alpha / r (PEFT's ``scaling`` without rslora)."""
        return self.alpha / self.r


class Model(Section):
    model_id: str = Field(
        "mistral3", description="Model family; only 'mistral3' (Mistral3ForConditionalGeneration)."
    )
    model_name_or_path: Optional[str] = Field(
        None, description="Model directory with config.json (and weights)."
    )
    trust_remote_code: bool = Field(False, description="Allow code from the model directory. Off by default.")
    attn_implementation: str = Field(
        "sdpa",
        description="Language-model attention: sdpa, eager, flash_attention_2 (CUDA with flash-attn; NPU fusion attention).",
    )

    freeze: list[str] = Field(
        default_factory=lambda: ["model.vision_tower", "model.multi_modal_projector"],
        description="Module patterns whose parameters are not trained.",
    )
    compile: bool = Field(
        False,
        description="Addition. Compile each decoder layer with torch.compile (torchtitan's per-block compile): "
        "fused elementwise kernels around the matmuls. Not with packing or context parallelism.",
    )
    lora: Optional[LoraConfig] = Field(
        None,
        description=(
            "Addition. Train LoRA adapters (PEFT) instead of the weights: the base stays frozen, in "
            "fsdp_plan.param_dtype; null = full fine-tuning."
        ),
    )

    @field_validator("model_id")
    @classmethod
    def _mistral3(cls, value):
        if value != "mistral3":
            raise ValueError(f"model_id {value!r} is not supported; this tool trains 'mistral3'")
        return value

    @field_validator("attn_implementation")
    @classmethod
    def _known_attention(cls, value):
        if value not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"{value!r} is not supported; use sdpa, eager, flash_attention_2 or flash_attention_3 (the fused "
                "kernel of the device where it has one, else sdpa)"
            )
        return value

    @model_validator(mode="after")
    def _lora_not_frozen(self):
        # model.freeze runs after the adapters exist and would freeze the adapters of a frozen part.
        if self.lora is None:
            return self
        from magistral_cli.errors import UserError

        from .patterns import compile_pattern

        for part in self.lora.apply_to:
            scope = LORA_SCOPES[part]
            for pattern in self.freeze:
                try:
                    regex = compile_pattern(pattern)
                except UserError:
                    continue  # a malformed pattern is reported where model.freeze is applied
                prefixes = [".".join(scope.split(".")[:i]) for i in range(1, scope.count(".") + 2)]
                if any(regex.match(p) for p in prefixes):
                    raise ValueError(
                        f"lora.apply_to has {part!r} but freeze has {pattern!r}, which would freeze its adapters "
                        f"too; remove {pattern!r} from model.freeze (LoRA freezes the base weights anyway) or "
                        f"{part!r} from model.lora.apply_to"
                    )
        return self


# --------------------------------------------------------------------------- features


class LossCfg(Section):
    loss_type: Literal["default", "per_sample_loss", "per_token_loss"] = Field(
        "default",
        description=(
            "How token losses are reduced, as in MindSpeed-MM: 'default' = each micro-batch's token mean, "
            "averaged over micro-batches and data-parallel ranks; 'per_sample_loss' = each sample's token "
            "mean, averaged over samples; 'per_token_loss' = the global batch's summed token losses over its "
            "target count (independent of how the batch is split)."
        ),
    )


class ModulePlan(Section):
    apply_modules: list[str] = Field(
        default_factory=list, description="Module patterns the feature applies to."
    )


class ChunkLossPlan(Section):
    apply_module: str = Field("lm_head", description="Output projection whose logits are computed in chunks.")
    chunk_size: int = Field(1024, ge=1, description="Tokens per chunk of the chunked loss.")


class Features(Section):
    loss_cfg: LossCfg = Field(default_factory=LossCfg, description="Loss settings.")
    recompute: bool = Field(False, description="Activation checkpointing over recompute_plan.")
    recompute_plan: ModulePlan = Field(
        default_factory=ModulePlan, description="Modules whose activations are recomputed."
    )
    enable_chunk_loss: bool = Field(
        False, description="Compute the loss in chunks without materialising full logits."
    )
    chunkloss_plan: ChunkLossPlan = Field(default_factory=ChunkLossPlan, description="Chunked-loss settings.")
    contiguous_linear_grad_modules: list[str] = Field(
        default_factory=list,
        description="Bias-free Linear modules computing contiguous weight gradients on NPU/CUDA in bf16/fp16.",
    )
    enable_activation_offload: bool = Field(
        False, description="Offload activations to the host (not supported; accepted as false)."
    )
    activation_offload_plan: ModulePlan = Field(
        default_factory=ModulePlan,
        description="Modules for activation offload; read only when enable_activation_offload is true, which "
        "is refused, so the seed's plan is accepted and unused (logged once).",
    )

    @field_validator("enable_activation_offload")
    @classmethod
    def _no_offload(cls, value):
        if value:
            raise ValueError("activation offload is not supported; use recompute instead")
        return value

    @model_validator(mode="after")
    def _recompute_plan(self):
        if self.recompute and not self.recompute_plan.apply_modules:
            raise ValueError(
                "recompute is true but recompute_plan.apply_modules is empty; name the modules to recompute"
            )
        return self


# --------------------------------------------------------------------------- training


#: The seed's ``training.plugin`` paths, and what of ours does their job.
BUILT_IN_PLUGINS = {
    "mindspeed_mm/fsdp/models/mistral3": "model.model_id mistral3",
    "mindspeed_mm/fsdp/data/datasets/huggingface": "data.dataset_param.dataset_type huggingface",
}


def _plugin_key(path: str) -> str:
    """A plugin path as the seed writes it: slashes, no trailing slash or ``.py`` (dots also accepted)."""
    path = path.strip().rstrip("/").removesuffix(".py")
    return path.replace(".", "/") if "/" not in path else path


class DpoConfig(Section):
    """Preference training (``training.stage: dpo``): LLaMA-Factory's ``pref_*`` settings."""

    beta: float = Field(0.1, gt=0, description="Addition. The preference loss's beta (pref_beta).")
    loss: Literal["sigmoid", "ipo", "orpo", "simpo"] = Field(
        "sigmoid",
        description=(
            "Addition. pref_loss: sigmoid (DPO), ipo, orpo or simpo (ops.preference_loss gives each formula); "
            "orpo and simpo use no reference model."
        ),
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Addition. Conservative DPO's label smoothing (sigmoid only); 0 = off."
    )
    ftx: float = Field(
        0.0,
        ge=0,
        description="Addition. Weight of an added SFT loss on the chosen answer (pref_ftx): its mean token NLL.",
    )
    simpo_gamma: float = Field(0.5, ge=0, description="Addition. SimPO's target reward margin gamma.")
    ref_model: Optional[str] = Field(
        None,
        description=(
            "Addition. The reference model: an HF model directory or a DCP checkpoint. null: with LoRA the base "
            "with its adapters switched off (no second model); without LoRA a frozen copy of the starting weights."
        ),
    )
    precompute_ref: bool = Field(
        False,
        description=(
            "Addition. Compute the reference's log-probabilities of every pair once before training and store "
            "them beside the preprocessed cache; training then holds no reference model (sigmoid / ipo only)."
        ),
    )

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference model (sigmoid and ipo do, orpo and simpo do not)."""
        return self.loss in ("sigmoid", "ipo")

    @model_validator(mode="after")
    def _reference_only_when_used(self):
        if self.ref_model is not None and not self.needs_reference:
            raise ValueError(
                f"ref_model is set but loss {self.loss!r} uses no reference model; remove training.dpo.ref_model "
                "or use loss: sigmoid / ipo"
            )
        if self.precompute_ref and not self.needs_reference:
            raise ValueError(
                f"precompute_ref stores the reference model's log-probabilities, but loss {self.loss!r} uses no "
                "reference model; set training.dpo.precompute_ref: false or use loss: sigmoid / ipo"
            )
        if self.label_smoothing and self.loss != "sigmoid":
            raise ValueError(f"label_smoothing applies to loss: sigmoid only, not {self.loss!r}; set it to 0")
        return self


class Training(Section):
    stage: Literal["sft", "dpo"] = Field(
        "sft",
        description=(
            "Addition. sft: supervised fine-tuning; dpo: preference training on (prompt, chosen, rejected) "
            "pairs, set by training.dpo."
        ),
    )
    dpo: DpoConfig = Field(
        default_factory=DpoConfig, description="Addition. Preference training (stage: dpo)."
    )
    micro_batch_size: int = Field(
        1,
        ge=1,
        description=(
            "Samples per rank per micro-batch (stage dpo: pairs, two sequences each); with packing, packs "
            "(stage dpo: of whole pairs)."
        ),
    )
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    seed: int = Field(
        42, ge=0, le=SEED_MAX, description="Seeds every rank (and the data order); 0 to 4294967295."
    )
    lr: float = Field(1.0e-5, gt=0, description="Peak learning rate.")
    min_lr: float = Field(0.0, ge=0, description="Addition. Learning rate at the end of the decay.")
    lr_decay_style: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Schedule after warm-up."
    )
    lr_warmup_ratio: float = Field(
        0.0, ge=0, le=1, description="Fraction of train_iters spent in linear warm-up."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    train_iters: int = Field(..., ge=1, description="Optimizer steps to run.")
    clip_grad: float = Field(
        0.0,
        ge=0,
        description="Clip the global gradient norm to this value; 0 = off (the norm is logged anyway).",
    )
    init_model_with_meta_device: bool = Field(
        True, description="Build the model on the meta device, shard, then materialize."
    )
    optimizer: Literal["adamw", "adamw_swap"] = Field(
        "adamw",
        description="adamw, or adamw_swap (optimizer state held in host memory, streamed for the step).",
    )
    adam_fused: bool = Field(False, description="Use the fused AdamW kernel where the device has one.")
    log_interval: int = Field(1, ge=1, description="Write metrics every N steps.")
    save_interval: int = Field(10000, ge=0, description="Checkpoint every N steps (0 = never).")
    load: Optional[str] = Field(
        None, description="Weights to start from: an HF model directory, a DCP directory or a run checkpoint."
    )
    load_format: Literal["hf", "dcp", "auto"] = Field(
        "auto", description="Format of training.load; auto detects it."
    )
    save: Optional[str] = Field(
        None,
        description=(
            "Checkpoint directory; a relative path is inside the run directory (output_dir). Unset (the "
            "seed's default): no checkpoint is written and the run cannot be resumed."
        ),
    )
    load_strict: bool = Field(True, description="Any missing or unexpected key stops the run before step 1.")
    resume: Literal["auto", "never"] = Field(
        "auto",
        description=(
            "Addition. auto continues from the newest complete and intact checkpoint in the save "
            "directory; never starts fresh, and is refused when the save directory already holds checkpoints."
        ),
    )
    skip_nonfinite_steps: bool = Field(
        False,
        description=(
            "Addition. A non-finite loss or gradient norm skips that step's update (logged) instead of "
            "stopping the run with exit 1."
        ),
    )
    no_load_optim: bool = Field(False, description="Do not restore the optimizer state from the checkpoint.")
    no_load_rng: bool = Field(False, description="Do not restore RNG states from the checkpoint.")
    no_save_optim: bool = Field(False, description="Do not save the optimizer state.")
    no_save_rng: bool = Field(False, description="Do not save RNG states.")
    use_deter_comp: bool = Field(False, description="Deterministic algorithms (slower).")
    manual_gc_interval: int = Field(
        0, ge=0, description="Disable automatic GC and collect every N steps (0 = off)."
    )
    freeze_gc_after_init: bool = Field(
        False, description="Collect once and freeze setup objects; automatic GC stays on for new objects."
    )
    plugin: list[str] = Field(
        default_factory=list,
        description="MindSpeed-MM plugin paths. No plugin is imported: the two the seed lists (the mistral3 "
        "model and the huggingface dataset) are built in, so those are accepted (logged once) and any "
        "other path is refused.",
    )
    output_dir: Optional[str] = Field(
        None, description="Addition. Run directory (default runs/<recipe-name>-<timestamp>)."
    )
    eval_interval: Optional[int] = Field(
        None,
        ge=1,
        description=(
            "Addition. Megatron's eval_interval: compute the validation loss every N steps (and at the end); "
            "null = only at the end of training. Needs data.dataset_param.basic_parameters.val_size."
        ),
    )
    val_interval: int = Field(
        0, ge=0, description="Placeholder kept for old recipes: 0 only; validation runs with eval_interval."
    )

    @field_validator("val_interval")
    @classmethod
    def _val_interval(cls, value):
        if value:
            raise ValueError(
                "validation is set by training.eval_interval (every N steps) with "
                "data.dataset_param.basic_parameters.val_size (the split); remove training.val_interval "
                "or set it to 0"
            )
        return value

    @field_validator("plugin")
    @classmethod
    def _built_in_plugins(cls, value):
        unknown = [path for path in value if _plugin_key(path) not in BUILT_IN_PLUGINS]
        if unknown:
            raise ValueError(
                f"{unknown[0]!r} is not supported: this tool imports no MindSpeed-MM plugins; the ones the seed "
                f"lists ({', '.join(BUILT_IN_PLUGINS)}) are built in. Remove the entry (a model other than "
                "mistral3 or another dataset type cannot be plugged in)"
            )
        return value

    @model_validator(mode="after")
    def _gc(self):
        # The seed's rule: freezing setup objects assumes automatic GC stays enabled.
        if self.freeze_gc_after_init and self.manual_gc_interval > 0:
            raise ValueError(
                "freeze_gc_after_init cannot be combined with manual_gc_interval > 0; set one of them"
            )
        return self


# --------------------------------------------------------------------------- tools


#: ``static_param.level`` values and the ``torch_npu.profiler.ProfilerLevel`` member each selects.
NPU_PROFILER_LEVELS = {"level_none": "Level_none", "level0": "Level0", "level1": "Level1", "level2": "Level2"}
#: ``static_param.aic_metrics_type`` values: ``torch_npu.profiler.AiCMetrics`` member names.
NPU_AIC_METRICS = (
    "AiCoreNone",
    "PipeUtilization",
    "ArithmeticUtilization",
    "Memory",
    "MemoryL0",
    "MemoryUB",
    "ResourceConflictRatio",
    "L2Cache",
    "MemoryAccess",
)


class StaticProfileParam(Section):
    level: str = Field(
        "level1",
        description="torch_npu profiler level (level_none, level0, level1, level2). NPU only: on other "
        "devices a value other than level1 is refused when the profiler runs.",
    )
    with_stack: bool = Field(False, description="Record Python stacks.")
    with_memory: bool = Field(False, description="Record memory events.")
    record_shapes: bool = Field(False, description="Record operator input shapes.")
    with_cpu: bool = Field(True, description="Profile CPU activity.")
    save_path: str = Field(
        "./profiling", description="Output directory (relative paths go under the run directory)."
    )
    start_step: int = Field(10, ge=1, description="First profiled step.")
    end_step: int = Field(11, ge=1, description="Step after the last profiled one.")
    data_simplification: bool = Field(
        False, description="torch_npu profiler data simplification. NPU only, like level."
    )
    aic_metrics_type: str = Field(
        "PipeUtilization",
        description="torch_npu AI-core metrics (an AiCMetrics name: PipeUtilization, ArithmeticUtilization, "
        "...). NPU only, like level.",
    )

    @field_validator("level")
    @classmethod
    def _level(cls, value):
        if value not in NPU_PROFILER_LEVELS:
            raise ValueError(f"unknown profiler level {value!r}; use one of {', '.join(NPU_PROFILER_LEVELS)}")
        return value

    @field_validator("aic_metrics_type")
    @classmethod
    def _aic_metrics(cls, value):
        if value not in NPU_AIC_METRICS:
            raise ValueError(
                f"unknown AI-core metrics type {value!r}; use one of {', '.join(NPU_AIC_METRICS)}"
            )
        return value

    @model_validator(mode="after")
    def _steps(self):
        if self.end_step <= self.start_step:
            raise ValueError(f"end_step ({self.end_step}) must be after start_step ({self.start_step})")
        return self


class Profile(Section):
    enable: bool = Field(False, description="Run the torch profiler.")
    profile_type: str = Field(
        "static",
        description="Only 'static' (the start_step..end_step range); MindSpeed-MM's 'dynamic' is refused.",
    )
    ranks: list[int] = Field(default_factory=lambda: [0], description="Ranks that profile.")
    static_param: StaticProfileParam = Field(
        default_factory=StaticProfileParam, description="Step range and options."
    )

    @field_validator("profile_type")
    @classmethod
    def _static_only(cls, value):
        if value != "static":
            raise ValueError(
                f"profile_type {value!r} is not supported: only 'static' profiling (a fixed step range, "
                "static_param.start_step..end_step); set profile_type: static"
            )
        return value


class MemoryProfile(Section):
    enable: bool = Field(False, description="Record an allocator snapshot (CUDA / NPU).")
    start_step: int = Field(1, ge=1, description="First recorded step.")
    end_step: int = Field(2, ge=1, description="Step at which the snapshot is dumped.")
    save_path: str = Field(
        "./memory_snapshot", description="Output directory (relative paths go under the run directory)."
    )
    dump_ranks: list[int] = Field(default_factory=lambda: [0], description="Ranks that dump a snapshot.")
    stacks: str = Field("all", description="Stack recording: all or python.")
    max_entries: Optional[int] = Field(None, ge=1, description="Maximum recorded allocator events.")
    mem_info: bool = Field(False, description="Print allocator statistics.")


class TensorboardOptions(Section):
    log_dir: str = Field(
        "tensorboard",
        description="Addition. Event file directory (relative paths go under the run directory).",
    )


class WandbOptions(Section):
    project: str = Field("magistral", min_length=1, description="Addition. W&B project.")
    entity: Optional[str] = Field(None, description="Addition. W&B entity (team or user); null = yours.")
    name: Optional[str] = Field(None, description="Addition. Run name; null = the run directory's name.")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="Addition. offline writes the run under dir only (`wandb sync` uploads it later); "
        "online streams it (needs `wandb login` or WANDB_API_KEY).",
    )
    dir: str = Field(
        ".",
        description="Addition. Parent of W&B's wandb/ folder (relative paths go under the run directory).",
    )
    tags: list[str] = Field(default_factory=list, description="Addition. Run tags.")


class Tools(Section):
    profile: Profile = Field(default_factory=Profile, description="Torch profiler.")
    memory_profile: MemoryProfile = Field(default_factory=MemoryProfile, description="Allocator snapshot.")
    logger: Literal["none", "tensorboard", "wandb"] = Field(
        "none",
        description="Addition. Where rank 0 also logs every metrics.jsonl field and the resolved recipe: "
        "tensorboard (pip install 'magistral-cli[tensorboard]'), wandb (pip install 'magistral-cli[wandb]') or none.",
    )
    tensorboard: TensorboardOptions = Field(
        default_factory=TensorboardOptions, description="Addition. Options of tools.logger: tensorboard."
    )
    wandb: WandbOptions = Field(
        default_factory=WandbOptions, description="Addition. Options of tools.logger: wandb."
    )
    peak_tflops: Optional[float] = Field(
        None,
        gt=0,
        description="Addition. Dense bf16 peak TFLOP/s of one device, the denominator of metrics.jsonl's "
        "mfu (= tflops_per_gpu / peak_tflops); null = the device's own from a table of known devices "
        "(H100, H200, A100, Ascend 910B1-B4, A3), and no mfu on the CPU or an unlisted device.",
    )


# --------------------------------------------------------------------------- recipe


class Recipe(Section):
    """A whole training recipe."""

    parallel: Parallel = Field(default_factory=Parallel, description="Parallelism and device.")
    data: Data = Field(default_factory=Data, description="Dataset, preprocessing and loading.")
    model: Model = Field(default_factory=Model, description="The model.")
    features: Features = Field(default_factory=Features, description="Memory and speed features.")
    training: Training = Field(..., description="Optimization, checkpoints and logging.")
    tools: Tools = Field(default_factory=Tools, description="Profilers, loggers and the MFU peak.")

    @model_validator(mode="after")
    def _neat_packing_without_cp(self):
        if self.data.dataset_param.basic_parameters.neat_packing and self.parallel.cp_size > 1:
            raise ValueError(
                "data.dataset_param.basic_parameters.neat_packing with context parallelism "
                f"(ulysses_parallel_size x ring_attention_size = {self.parallel.cp_size}): the Ulysses and Ring "
                "attention are causal over the whole sequence and would let packed samples see each other; "
                "set both CP sizes to 1, or use packing: true (causal across samples) with neat_packing: false"
            )
        return self

    @model_validator(mode="after")
    def _quantized_base_rules(self):
        lora = self.model.lora
        if lora is None or lora.quantize_base == "none":
            return self
        if not self.training.load:
            raise ValueError(
                "model.lora.quantize_base: nf4 quantises the base weights as they load, and training.load is "
                "unset; point training.load at the base model (a model directory or a DCP checkpoint)"
            )
        if self.model.compile:
            raise ValueError(
                "model.compile with model.lora.quantize_base: nf4 is not supported (torchao's NF4 weights "
                "dequantise outside the compiled graph); set model.compile: false"
            )
        if self.features.contiguous_linear_grad_modules:
            raise ValueError(
                "features.contiguous_linear_grad_modules with model.lora.quantize_base: nf4: the kernel multiplies "
                "the weight itself and cannot read a 4-bit one; set features.contiguous_linear_grad_modules: []"
            )
        return self

    @model_validator(mode="after")
    def _compile_without_packing_or_cp(self):
        if not self.model.compile:
            return self
        if self.data.dataset_param.basic_parameters.packing:
            raise ValueError(
                "model.compile with packing: a packed batch's segment offsets change every step and would "
                "recompile the layers each time; set model.compile: false or packing: false"
            )
        if self.parallel.cp_size > 1:
            raise ValueError(
                "model.compile with context parallelism is not supported (the CP attention communicates "
                "inside the layers); set model.compile: false or both CP sizes to 1"
            )
        return self

    @model_validator(mode="after")
    def _context_parallel_rules(self):
        if self.parallel.cp_size == 1:
            return self
        cp = f"context parallelism (ulysses_parallel_size x ring_attention_size = {self.parallel.cp_size})"
        if not self.data.dataloader_param.collate_param.ignore_pad_token_for_loss:
            raise ValueError(
                f"{cp} does not score padding tokens, so data.dataloader_param.collate_param."
                "ignore_pad_token_for_loss: false would train differently from CP=1; set it to true or "
                "set both CP sizes to 1"
            )
        if self.features.loss_cfg.loss_type == "per_sample_loss" and self.training.micro_batch_size > 1:
            raise ValueError(
                f"features.loss_cfg.loss_type per_sample_loss with {cp} needs training.micro_batch_size: 1 "
                "(then it equals 'default'); or use default / per_token_loss"
            )
        return self

    @model_validator(mode="after")
    def _packed_tokens_fit_int32(self):
        basic = self.data.dataset_param.basic_parameters
        # Under stage dpo a pack holds whole pairs: up to 2 x cutoff_len tokens.
        sequences = 2 if self.training.stage == "dpo" else 1
        tokens = self.training.micro_batch_size * basic.cutoff_len * sequences
        if basic.packing and tokens > TOKENS_MAX:
            raise ValueError(
                f"training.micro_batch_size x data.dataset_param.basic_parameters.cutoff_len{' x 2' * (sequences - 1)} "
                f"= {tokens} tokens a packed micro-batch, more than the attention's int32 offsets hold "
                f"({TOKENS_MAX}); lower one of them"
            )
        return self

    @model_validator(mode="after")
    def _dpo_rules(self):
        if self.training.stage != "dpo":
            return self
        basic = self.data.dataset_param.basic_parameters
        if basic.packing and not basic.neat_packing:
            raise ValueError(
                "training.stage: dpo with packing: true lets a pack's sequences attend to each other, mixing a "
                "pair's chosen and rejected answers; set data.dataset_param.basic_parameters.neat_packing: true "
                "(each sequence attends to itself only), or packing: false"
            )
        if self.parallel.cp_size > 1:
            raise ValueError(
                f"training.stage: dpo with context parallelism (cp {self.parallel.cp_size}) is not supported; "
                "set ulysses_parallel_size and ring_attention_size to 1"
            )
        if self.features.loss_cfg.loss_type != "default":
            raise ValueError(
                "training.stage: dpo averages its loss over the step's pairs; features.loss_cfg.loss_type "
                f"{self.features.loss_cfg.loss_type!r} applies to sft only: remove it or set 'default'"
            )
        if self.data.dataset_param.is_synthetic and basic.val_size:
            raise ValueError(
                "training.stage: dpo on synthetic data has no validation pairs; remove "
                "data.dataset_param.basic_parameters.val_size or train on a pair dataset"
            )
        lora, dpo = self.model.lora, self.training.dpo
        if dpo.precompute_ref and self.data.dataset_param.is_synthetic:
            raise ValueError(
                "training.dpo.precompute_ref stores the reference's log-probabilities beside the preprocessed "
                "cache, but synthetic data has no cache; set training.dpo.precompute_ref: false or train on a "
                "pair dataset"
            )
        if lora is not None and lora.modules_to_save and dpo.needs_reference and dpo.ref_model is None:
            raise ValueError(
                "training.stage: dpo with LoRA compares with the base (adapters off), but "
                "model.lora.modules_to_save trains modules of the base itself; set training.dpo.ref_model "
                "to the starting model directory, or remove modules_to_save"
            )
        return self

    @model_validator(mode="after")
    def _eval_needs_a_split(self):
        if self.training.eval_interval is not None and not self.data.dataset_param.basic_parameters.val_size:
            raise ValueError(
                "training.eval_interval needs a validation split: set data.dataset_param.basic_parameters.val_size "
                "(a fraction such as 0.05 or a count such as 200), or remove training.eval_interval"
            )
        return self


def compatibility_notes(recipe: Recipe) -> list[str]:
    """One line per seed key that is accepted because its value means what this tool does anyway.

    The loader logs each once per process, so a run's log says that these keys were read and why
    they change nothing; every other value of them is refused by the schema.
    """
    notes = []
    if recipe.training.plugin:
        notes.append(
            f"training.plugin {recipe.training.plugin}: nothing is imported; these MindSpeed-MM plugins are "
            "built in (" + "; ".join(BUILT_IN_PLUGINS[_plugin_key(p)] for p in recipe.training.plugin) + ")"
        )
    plan = recipe.features.activation_offload_plan.apply_modules
    if plan and not recipe.features.enable_activation_offload:
        notes.append(
            f"features.activation_offload_plan {plan} is not used: activation offload is off "
            "(enable_activation_offload: false) and not supported; recompute_plan saves activation memory"
        )
    return notes


def check_world_size(recipe: Recipe, world_size: int, *, source: str | None = None) -> int:
    """Check that the parallel degrees divide ``world_size``; return the FSDP degree.

    The device mesh is (data parallel = FSDP, context parallel); FSDP shards over both
    dimensions, as the seed does. A mismatch is a ``UserError`` (prefixed with ``source``, the
    recipe's path, where the caller knows it): the launcher's pre-flight and the trainer's mesh
    both call this, so a launch refuses it before any process starts.
    """
    where = f"{source}: " if source else ""
    par = recipe.parallel
    cp = par.cp_size
    if world_size % cp:
        raise UserError(
            f"{where}the context-parallel degree (ulysses_parallel_size {par.ulysses_parallel_size} x "
            f"ring_attention_size {par.ring_attention_size} = {cp}) does not divide the world size {world_size}"
        )
    dp = world_size // cp
    if par.fully_shard_parallel_size != "auto" and par.fully_shard_parallel_size != dp:
        raise UserError(
            f"{where}parallel.fully_shard_parallel_size is {par.fully_shard_parallel_size} but world size {world_size} / "
            f"context-parallel degree {cp} = {dp}; set it to {dp} or 'auto'"
        )
    return dp
