"""Encoding conversations into token ids and labels, with truncation that never cuts an image.

Truncation to ``cutoff_len`` follows the seed's pipeline (LLaMA-Factory's supervised
processor) token for token, so that a run here sees the same samples as the seed's baseline:
turns are taken in order (last turn first with ``mask_history``) and each (prompt, response)
pair is shortened by ``infer_seqlen``. A sample whose image tokens (``[IMG]``,
``[IMG_BREAK]`` or ``[IMG_END]``) would be cut is dropped (the model would fail with "image
features and image tokens do not match"), as is one with no label left to train on.

Text from the data is plain text unless the recipe sets ``split_special_tokens: false`` (the
seed's setting): then control-token strings in it (``[INST]``, ``</s>``) become control tokens,
counted per sample for the report, and a sample whose text would make ``[IMG]``,
``[IMG_BREAK]`` or ``[IMG_END]`` is dropped: only an image may produce those. Image paths that
lead outside ``dataset_dir`` (``../``, absolute, or through a symlink) are counted, or dropped
with ``allow_outside_dataset_dir: false``.

An assistant turn's reasoning (any of the layouts in ``readers``) is ``[THINK]...[/THINK]`` with
both markers as control tokens, as mistral-common's v13 encodes a ``ThinkChunk``; its labels are
ignored, markers included, with ``train_on_reasoning: false``. Reasoning with a tokenizer that
cannot encode it (older than v13) stops preprocessing with a ``UserError`` naming the row: the
reasoning would otherwise become text the model never learnt to write.

A preference pair (``data/pairs.py``, ``training.stage: dpo``) encodes its prompt once and gives two
samples, the prompt with the chosen answer and with the rejected one (:class:`EncodedPair`); see
``Encoder._pair`` for its truncation.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from magistral_cli.errors import UserError

from . import template
from .pairs import normalize_pair
from .pixtral import ImageSettings, ImageSizeError, image_token_ids, open_image_size, plan_image
from .readers import Conversation, Drop, RecordFormat, RowSource, iter_segments, normalize_record
from .tokenizer import SpecialIds, TekkenTokenizer

IGNORE_INDEX = -100


@dataclass(frozen=True)
class EncodeParams:
    """The preprocessing parameters that change the encoded samples (all are fingerprinted)."""

    cutoff_len: int
    train_on_prompt: bool
    mask_history: bool
    default_system: str  # resolved: "" = no system prompt (see template.resolve_default_system)
    dataset_dir: str
    allow_outside_dataset_dir: bool = True
    train_on_reasoning: bool = True

    @classmethod
    def from_recipe(cls, recipe, dataset_dir: Path) -> EncodeParams:
        basic = recipe.data.dataset_param.basic_parameters
        if basic.enable_thinking and basic.default_system == "":
            raise UserError(
                "enable_thinking: true asks for Magistral's thinking prompt but default_system: '' removes it; "
                "drop one of them (data.dataset_param.basic_parameters)"
            )
        return cls(
            cutoff_len=basic.cutoff_len,
            train_on_prompt=basic.train_on_prompt,
            mask_history=basic.mask_history,
            default_system=template.resolve_default_system(basic.default_system),
            dataset_dir=str(dataset_dir),
            allow_outside_dataset_dir=basic.allow_outside_dataset_dir,
            train_on_reasoning=basic.train_on_reasoning,
        )


@dataclass
class EncodedSample:
    """One training sample: ids, labels (aligned, -100 = not trained), its images."""

    input_ids: np.ndarray  # int32 [L]
    labels: np.ndarray  # int32 [L]
    images: list[str]
    image_sizes: np.ndarray  # int32 [n_images, 2] (height, width) after resizing
    source_index: int
    truncated: bool = False
    # For the report (not stored in the cache): control-token strings in the sample's data text
    # (encoded as control tokens with split_special_tokens false, else kept as text), and how
    # many of its images lie outside dataset_dir.
    text_control_tokens: dict[str, int] = field(default_factory=dict)
    outside_images: int = 0
    reasoning_tokens: int = 0  # tokens of its [THINK] ... [/THINK] spans (markers included), after truncation


@dataclass
class EncodedPair:
    """A preference pair: the prompt with its chosen answer, and the same prompt with the rejected one."""

    chosen: EncodedSample
    rejected: EncodedSample


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """LLaMA-Factory's split of the remaining budget between a turn's prompt and response."""
    if target_len * 2 < cutoff_len:
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target_len = cutoff_len - source_len
    else:
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    max_source_len = max(cutoff_len - new_target_len, 0)
    new_source_len = min(max_source_len, source_len)
    return new_source_len, new_target_len


def truncate_pairs(
    pairs: list[tuple[list[int], list[int]]],
    params: EncodeParams,
    reasoning: list[list[bool]] | None = None,
) -> tuple[list[int], list[int], int]:
    """Join (prompt, response) id pairs into ids and labels within ``cutoff_len``.

    ``reasoning[i][j]``: token ``j`` of response ``i`` is reasoning (its label is ignored unless
    ``train_on_reasoning``). Returns the ids, the labels and how many reasoning tokens were kept.
    """
    input_ids: list[int] = []
    labels: list[int] = []
    total = kept_reasoning = 0
    masks = reasoning if reasoning is not None else [[False] * len(target) for _, target in pairs]
    ordered = list(zip(pairs, masks, strict=True))
    if params.mask_history:  # last turns first
        ordered.reverse()
    for turn, ((source, target), mask) in enumerate(ordered):
        if total >= params.cutoff_len:
            break
        source_len, target_len = infer_seqlen(len(source), len(target), params.cutoff_len - total)
        source, target, mask = source[:source_len], target[:target_len], mask[:target_len]
        total += source_len + target_len
        kept_reasoning += sum(mask)
        turn_labels = _turn_labels(source, target, mask, params, history=params.mask_history and turn != 0)
        if params.mask_history:
            input_ids = source + target + input_ids
            labels = turn_labels + labels
        else:
            input_ids += source + target
            labels += turn_labels
    return input_ids, labels, kept_reasoning


def _turn_labels(
    source: list[int], target: list[int], mask: list[bool], params: EncodeParams, *, history: bool
) -> list[int]:
    """The labels of one (prompt, response) turn: the prompt's ignored unless ``train_on_prompt``;
    the response's ignored in a ``history`` turn, and its reasoning unless ``train_on_reasoning``."""
    source_label = list(source) if params.train_on_prompt else [IGNORE_INDEX] * len(source)
    if history:
        target_label = [IGNORE_INDEX] * len(target)
    elif params.train_on_reasoning:
        target_label = list(target)
    else:
        target_label = [IGNORE_INDEX if masked else token for token, masked in zip(target, mask, strict=True)]
    return source_label + target_label


#: Part of the cache fingerprint: bump it when the same inputs would encode differently, so that
#: entries written before are not reused. 2: an image side never resolves to 0 tokens (a 1x5000
#: image was kept with image_sizes [1540, 0]); JSON Lines are split on bytes, not at U+2028.
#: 3: a sample without a system message gets the seed template's default system prompt.
#: 4: data text is plain text by default; the default system prompt's [THINK] markers are control
#: tokens in both split_special_tokens modes; image tokens from data text drop the sample.
#: 5: an assistant turn's reasoning (reasoning_content, thinking chunks, literal [THINK] markers
#: under tokenizer v13) is [THINK]...[/THINK] with control-token markers.
ENCODER_REVISION = 5

#: What a control-token string looks like (every Tekken control token: ``[INST]``, ``</s>``,
#: ``<SPECIAL_20>``); a match is counted only if the vocabulary has it as a control token.
_CONTROL_SHAPE = re.compile(r"\[/?[A-Za-z_]+\]|<[^<>\s]+>")


class Encoder:
    """Encodes dataset rows; one per process (it holds the tokenizer)."""

    def __init__(
        self,
        tokenizer: TekkenTokenizer,
        settings: ImageSettings,
        params: EncodeParams,
        fmt: RecordFormat,
    ):
        self.tokenizer = tokenizer
        self.special: SpecialIds = tokenizer.special
        self.settings = settings
        self.params = params
        self.fmt = fmt
        self.dataset_dir = Path(params.dataset_dir)
        self._dataset_root = Path(os.path.realpath(self.dataset_dir))
        self._image_ids = (self.special.img, self.special.img_break, self.special.img_end)
        self._control = tokenizer.control_tokens
        self._control_set = frozenset(self._control)
        self._control_names = frozenset(self._control.values())
        # Ids only an image block may hold (the vocabulary's, plus the ids the template inserts).
        self._image_only = frozenset(
            i for i, text in self._control.items() if text in ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
        ) | frozenset(self._image_ids)
        self._text_is_text = tokenizer.split_special_tokens
        self._default_system_ids = template.default_system_ids(tokenizer, params.default_system)
        self._think_ids = tokenizer.think_ids

    # -- data text -----------------------------------------------------------------------------
    def _count_control_strings(self, text: str, found: Counter) -> None:
        """Count the control-token strings of ``text`` that stay plain text (split_special_tokens true)."""
        if "[" not in text and "<" not in text:
            return
        for match in _CONTROL_SHAPE.finditer(text):
            if match.group() in self._control_names:
                found[match.group()] += 1

    def _check_text_ids(self, ids: list[int], where: str, found: Counter) -> Drop | None:
        """Control ids in the ids of a data text: counted, and a sample with an image one dropped."""
        if self._control_set.isdisjoint(ids):
            return None
        if not self._text_is_text:  # with split_special_tokens true, _count_control_strings counts
            for token in ids:
                if token in self._control_set:
                    found[self._control[token]] += 1
        image = next((self._control.get(t, "[IMG]") for t in ids if t in self._image_only), None)
        if image is None:
            return None
        if self._text_is_text:  # a tokenizer.json whose image tokens are not special tokens
            fix = "use the model's own tekken.json (tokenizer_source: official)"
            how = "this tokenizer file turns it into an image token even with split_special_tokens: true"
        else:
            fix = (
                "write <image> where an image goes, or set "
                "data.dataset_param.preprocess_parameters.split_special_tokens=true to keep such strings as text"
            )
            how = "split_special_tokens: false turns it into an image token"
        return Drop(
            "image_token_in_text", f"{where} holds the text {image}: {how} with no image behind it; {fix}"
        )

    def _outside(self, path: str) -> str | None:
        """Where ``path`` really is when that is outside ``dataset_dir`` (symlinks followed), else None."""
        real = os.path.realpath(path)
        return None if Path(real).is_relative_to(self._dataset_root) else real

    # -- images --------------------------------------------------------------------------------
    def _image_size(self, path: str) -> tuple[int, int] | Drop:
        if not Path(path).is_file():
            if Path(path).is_dir():
                return Drop("unreadable_image", f"{path} is a directory, not an image file")
            if Path(path).exists():
                return Drop("unreadable_image", f"{path} is not a regular file")
            return Drop("missing_image", f"{path} does not exist")
        try:
            width, height = open_image_size(path)
        except Exception as exc:  # PIL raises many kinds (UnidentifiedImageError, OSError, SyntaxError)
            return Drop("unreadable_image", f"{path}: {type(exc).__name__}: {exc}")
        try:
            plan = plan_image(width, height, self.settings)
        except ImageSizeError as exc:
            return Drop("unusable_image_size", f"{path}: {exc}")
        return plan.height, plan.width

    # -- rows ----------------------------------------------------------------------------------
    def encode_rows(self, rows: list[RowSource]) -> list[EncodedSample | EncodedPair | Drop]:
        """Encode a batch of rows (text of the whole batch is tokenized in one call): samples, or
        preference pairs when the format has ``pair_columns`` (training.stage: dpo)."""
        markers = self._think_ids is not None
        normalize = normalize_pair if self.fmt.pair_columns is not None else normalize_record
        convs: list[Conversation | Drop] = [
            normalize(row, self.fmt, self.dataset_dir, think_markers=markers) for row in rows
        ]
        sizes: list[list[tuple[int, int]] | Drop | None] = []
        notes: list[tuple[Counter, int] | None] = []
        texts: list[str] = []
        for i, conv in enumerate(convs):
            if isinstance(conv, Drop):
                sizes.append(None)
                notes.append(None)
                continue
            if conv.has_reasoning and not markers:
                raise self._no_reasoning_error(rows[i].index)
            conv_sizes = []
            outside = 0
            for path in conv.images:
                real = self._outside(path)
                if real is not None:
                    if not self.params.allow_outside_dataset_dir:
                        convs[i] = self._outside_drop(path, real)
                        conv_sizes = None
                        break
                    outside += 1
                size = self._image_size(path)
                if isinstance(size, Drop):
                    convs[i] = size
                    conv_sizes = None
                    break
                conv_sizes.append(size)
            sizes.append(conv_sizes)
            found: Counter = Counter()
            notes.append((found, outside))
            if conv_sizes is None:
                continue
            # The record's own system prompt is data text; the default one is encoded once (__init__).
            data_texts = [conv.system] if conv.system else []
            for _, prompt, response in conv.turns:
                data_texts.extend(piece for piece in iter_segments(prompt) if piece is not None)
                data_texts.extend(part.text for part in response)
            data_texts.extend(part.text for part in conv.rejected or ())
            if self._text_is_text:
                for text in data_texts:
                    self._count_control_strings(text, found)
            texts += data_texts
        encoded = iter(self.tokenizer.encode_batch(texts))
        results: list[EncodedSample | Drop] = []
        for row, conv, conv_sizes, note in zip(rows, convs, sizes, notes, strict=True):
            if isinstance(conv, Drop):
                results.append(conv)
            else:
                results.append(self._assemble(row.index, conv, conv_sizes, encoded, *note))
        return results

    def _no_reasoning_error(self, index: int) -> UserError:
        field = f"{self.fmt.reasoning} or a thinking chunk" if self.fmt.reasoning else "a thinking chunk"
        return UserError(
            f"row {index}: an assistant turn carries reasoning ({field}) but the tokenizer "
            f"({self.tokenizer.describe()}) has no [THINK] / [/THINK] control tokens; reasoning needs tokenizer "
            "v13 or later (Magistral-Small-2509's). Use the model's own tekken.json (`magistral fetch`), or "
            "remove the reasoning from the data"
        )

    def _outside_drop(self, path: str, real: str) -> Drop:
        where = path if real == path else f"{path} (really {real})"
        return Drop(
            "image_outside_dataset_dir",
            f"{where} is outside dataset_dir {self._dataset_root}; move the image under it, or set "
            "data.dataset_param.basic_parameters.allow_outside_dataset_dir=true",
        )

    def _assemble(
        self, index: int, conv: Conversation, image_sizes, encoded, found: Counter, outside: int
    ) -> EncodedSample | EncodedPair | Drop:
        special, tp = self.special, self.settings.token_pixels
        # Every text is consumed from ``encoded`` before any return, so that the next sample's
        # texts stay aligned; the first problem found is the sample's drop.
        problem: Drop | None = None

        def data_ids(where: str) -> list[int]:
            nonlocal problem
            ids = next(encoded)
            if not self._text_is_text or not self._image_only.isdisjoint(ids):
                problem = problem or self._check_text_ids(ids, where, found)
            return ids

        system_ids = data_ids("the system prompt") if conv.system else self._default_system_ids
        sizes = iter(image_sizes)
        pairs: list[tuple[list[int], list[int]]] = []
        reasoning: list[list[bool]] = []
        for turn, (role, prompt, response) in enumerate(conv.turns):
            content: list[int] = []
            for piece in iter_segments(prompt):
                if piece is None:
                    height, width = next(sizes)
                    content += image_token_ids(
                        height, width, tp, special.img, special.img_break, special.img_end
                    )
                else:
                    content += data_ids(f"prompt {turn}")
            source = template.prompt_ids(special, role, content)
            if turn == 0:
                source = template.prefix_ids(special, system_ids) + source
            target, in_reasoning = self._response_ids(response, f"assistant turn {turn}", data_ids)
            pairs.append((source, target))
            reasoning.append(in_reasoning)
        rejected = None
        if conv.rejected is not None:
            rejected = self._response_ids(conv.rejected, "the rejected answer", data_ids)
        if problem is not None:
            return problem
        if rejected is not None:
            return self._pair(index, conv, image_sizes, pairs, reasoning, rejected, found, outside)
        return self._sample(index, conv, image_sizes, pairs, reasoning, found, outside)

    def _response_ids(self, response, where: str, data_ids) -> tuple[list[int], list[bool]]:
        """An assistant turn's ids (end-of-sequence included) and which of them are reasoning."""
        target: list[int] = []
        in_reasoning: list[bool] = []
        for part in response:
            if part.thinking:
                ids = template.reasoning_ids(self._think_ids, data_ids(f"{where}'s reasoning"))
            else:
                ids = data_ids(where)
            target += ids
            in_reasoning += [part.thinking] * len(ids)
        target = template.response_ids(self.special, target)
        in_reasoning += [False] * (len(target) - len(in_reasoning))
        return target, in_reasoning

    def _image_tokens_cut(
        self, full: list[int], kept: list[int] | np.ndarray, full_length: int
    ) -> Drop | None:
        """The drop when ``kept`` (a truncation of ``full``) lost image tokens of any kind."""
        full_array = np.asarray(full, dtype=np.int32)
        kept_array = np.asarray(kept, dtype=np.int32)
        # Compare every image token kind: cutting right before [IMG_END] keeps the [IMG] count.
        for token in self._image_ids:
            if int((full_array == token).sum()) != int((kept_array == token).sum()):
                return Drop(
                    "image_tokens_truncated",
                    f"the sample has {full_length} tokens; cutoff_len {self.params.cutoff_len} would cut its "
                    "image tokens (raise cutoff_len or lower image_max_pixels)",
                )
        return None

    def _sample(
        self, index: int, conv: Conversation, image_sizes, pairs, reasoning, found: Counter, outside: int
    ) -> EncodedSample | Drop:
        """One SFT sample from its (prompt, response) id pairs: truncated, checked, labelled."""
        full_length = sum(len(s) + len(t) for s, t in pairs)
        input_ids, labels, reasoning_tokens = truncate_pairs(pairs, self.params, reasoning)
        truncated = len(input_ids) < full_length
        if truncated:
            full = [t for s, tg in pairs for t in (*s, *tg)]
            problem = self._image_tokens_cut(full, input_ids, full_length)
            if problem is not None:
                return problem
        label_array = np.asarray(labels, dtype=np.int32)
        if not (label_array != IGNORE_INDEX).any():
            return Drop(
                "no_label_tokens",
                f"the prompt fills cutoff_len {self.params.cutoff_len}; nothing left to train on",
            )
        return EncodedSample(
            input_ids=np.asarray(input_ids, dtype=np.int32),
            labels=label_array,
            images=list(conv.images),
            image_sizes=np.asarray(image_sizes, dtype=np.int32).reshape(-1, 2),
            source_index=index,
            truncated=truncated,
            text_control_tokens=dict(found),
            outside_images=outside,
            reasoning_tokens=reasoning_tokens,
        )

    def _pair(
        self,
        index: int,
        conv: Conversation,
        image_sizes,
        pairs,
        reasoning,
        rejected,
        found: Counter,
        outside: int,
    ) -> EncodedPair | Drop:
        """A preference pair's two samples: the prompt (every turn before the last response) with
        the chosen answer, and with the rejected one.

        The prompt is one source for both: cutoff_len is split between it and the longer answer
        (``infer_seqlen``, as LLaMA-Factory's pairwise encoding does), so both sides keep the same
        prompt tokens and their answers the same budget. Earlier assistant turns of the prompt are
        context (labels ignored unless ``train_on_prompt``); a one-turn prompt gives each side
        exactly the SFT sample of that conversation when nothing is cut.
        """
        prompt = [t for s, tg in pairs[:-1] for t in (*s, *tg)] + pairs[-1][0]
        answers = {"chosen": (pairs[-1][1], reasoning[-1]), "rejected": rejected}
        longest = max(len(ids) for ids, _ in answers.values())
        prompt_len, answer_len = infer_seqlen(len(prompt), longest, self.params.cutoff_len)
        full_length = len(prompt) + longest
        kept_prompt = prompt[:prompt_len]
        if prompt_len < len(prompt):
            problem = self._image_tokens_cut(prompt, kept_prompt, full_length)
            if problem is not None:
                return problem
        if answer_len == 0:
            return Drop(
                "answer_truncated",
                f"the prompt has {len(prompt)} tokens and the longer answer {longest}; cutoff_len "
                f"{self.params.cutoff_len} would keep no token of the answers (raise cutoff_len or shorten the prompt)",
            )
        sides = {}
        for side, (target, mask) in answers.items():
            target, mask = target[:answer_len], mask[:answer_len]
            labels = _turn_labels(kept_prompt, target, mask, self.params, history=False)
            if all(label == IGNORE_INDEX for label in labels):
                return Drop(
                    "no_label_tokens",
                    f"the {side} answer keeps only reasoning within cutoff_len {self.params.cutoff_len} "
                    "(train_on_reasoning: false): nothing left to train on",
                )
            sides[side] = EncodedSample(
                input_ids=np.asarray(kept_prompt + target, dtype=np.int32),
                labels=np.asarray(labels, dtype=np.int32),
                images=list(conv.images),
                image_sizes=np.asarray(image_sizes, dtype=np.int32).reshape(-1, 2),
                source_index=index,
                truncated=prompt_len < len(prompt) or answer_len < len(answers[side][0]),
                # The row's notes (its texts' control tokens, its images outside dataset_dir) go
                # with the chosen sample alone, so that the report counts each row once.
                text_control_tokens=dict(found) if side == "chosen" else {},
                outside_images=outside if side == "chosen" else 0,
                reasoning_tokens=sum(mask),
            )
        return EncodedPair(**sides)
