"""Tokenizer files and synthetic LLaVA datasets for tests, benchmarks and the quickstart.

The tokenizer is the real Tekken vocabulary that mistral-common ships
(``mistral_common/data/tekken_240911.json``), with two fields set the way
Magistral-Small-2509's own ``tekken.json`` has them: a tokenizer version that writes system
prompts as ``[SYSTEM_PROMPT]`` blocks, and the image section (patch 14, spatial merge 2,
longest edge 1540: one image token per 28x28 pixels). With ``version="v13"`` (Magistral's own)
it also carries Magistral's ``special_tokens`` table, where ``[THINK]`` / ``[/THINK]`` are
control tokens 34 and 35.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

#: Tokenizer version written into the tiny tekken.json: v7 is the first with [SYSTEM_PROMPT]
#: blocks, and the newest that mistral-common accepts without an explicit special-token table.
TINY_TEKKEN_VERSION = "v7"
TINY_IMAGE_SECTION = {"image_patch_size": 14, "max_image_size": 1540, "spatial_merge_size": 2}

#: Magistral-Small-2509's special tokens below 36 (tokenizer v13), by rank; the others up to
#: ``default_num_special_tokens`` (1000) are ``<SPECIAL_n>``. Every one is a control token.
MAGISTRAL_SPECIAL_TOKENS = {
    **dict(
        enumerate(
            [
                "<unk>",
                "<s>",
                "</s>",
                "[INST]",
                "[/INST]",
                "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
                "[TOOL_CALLS]",
                "[IMG]",
                "<pad>",
                "[IMG_BREAK]",
                "[IMG_END]",
                "[PREFIX]",
                "[MIDDLE]",
                "[SUFFIX]",
                "[SYSTEM_PROMPT]",
                "[/SYSTEM_PROMPT]",
                "[TOOL_CONTENT]",
            ]
        )
    ),
    32: "[ARGS]",
    33: "[CALL_ID]",
    34: "[THINK]",
    35: "[/THINK]",
}


def tekken_path() -> Path:
    """The Tekken vocabulary file that mistral-common ships."""
    import mistral_common

    path = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall mistral-common")
    return path


def write_tiny_tokenizer_files(model_dir: str | Path, version: str = TINY_TEKKEN_VERSION) -> Path:
    """Put ``tekken.json`` into ``model_dir`` (which already has config.json); returns its path.

    The processor settings come from tekken.json's image section (and config.json), as with the
    official files: no third-party preprocessor_config.json is needed. ``version`` "v13" writes
    Magistral's special-token table (``[THINK]`` / ``[/THINK]`` among the control tokens), the
    shape of its own tekken.json: ``{"rank", "token_str", "is_control"}`` for every special rank.
    """
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    data = json.loads(tekken_path().read_text(encoding="utf-8"))
    data["config"]["version"] = version
    data["image"] = dict(TINY_IMAGE_SECTION)
    if int(version.lstrip("v")) >= 13:
        data["special_tokens"] = [
            {"rank": i, "token_str": MAGISTRAL_SPECIAL_TOKENS.get(i, f"<SPECIAL_{i}>"), "is_control": True}
            for i in range(data["config"]["default_num_special_tokens"])
        ]
    out = model_dir / "tekken.json"
    out.write_text(json.dumps(data), encoding="utf-8")
    return out


_QUESTIONS = [
    "What is in this picture?",
    "Describe the colors you see.",
    "How many shapes are there?",
    "Is this image bright or dark?",
    "What would you call this pattern?",
]
_ANSWERS = [
    "A synthetic test pattern made of colored rectangles.",
    "Mostly {c} with a few darker stripes.",
    "There are {n} rectangles of different sizes.",
    "It looks fairly {b}, with sharp edges between the regions.",
    "A grid of blocks, like a simple mosaic.",
]


def _image(rng: random.Random, width: int, height: int):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randrange(2, 6)):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = rng.randrange(x0, width + 1), rng.randrange(y0, height + 1)
        draw.rectangle([x0, y0, x1, y1], fill=tuple(rng.randrange(256) for _ in range(3)))
    return image


def write_synthetic_llava_dataset(
    directory: str | Path,
    n_samples: int,
    *,
    broken_rows: bool = False,
    seed: int = 0,
    image_sizes: list[tuple[int, int]] | None = None,
    reasoning_every: int = 0,
) -> Path:
    """Write ``n_samples`` LLaVA-style records (JSON Lines) and their PNG/JPEG images.

    Images have varied sizes (some need resizing, a few are text-only samples, some samples
    have two images or two turns). With ``reasoning_every`` n > 0, every n-th row (rows n - 1,
    2n - 1, ...) gives its last assistant message a ``reasoning_content`` (the layout most
    reasoning datasets use); the other rows, and every row's images and text, stay as without it.
    With ``broken_rows`` these rows are appended, one each:
    an invalid JSON line, a missing image, a placeholder/image count mismatch, an empty
    assistant turn, an unknown role, and an over-long sample whose image would be cut by a
    cutoff_len of 1024. Returns the path of ``data.jsonl``; image paths are relative to
    ``directory`` (the recipe's ``dataset_dir``).
    """
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sizes = image_sizes or [(56, 56), (84, 140), (224, 168), (300, 200), (640, 480), (97, 61), (1000, 700)]
    lines: list[str] = []
    colors = ["red", "green", "blue", "orange", "purple"]
    image_count = 0

    def new_image() -> str:
        nonlocal image_count
        width, height = sizes[rng.randrange(len(sizes))]
        ext = "jpg" if image_count % 3 == 0 else "png"
        name = f"images/{image_count:06d}.{ext}"
        _image(rng, width, height).save(directory / name)
        image_count += 1
        return name

    for i in range(n_samples):
        kind = i % 10
        q = rng.choice(_QUESTIONS)
        a = rng.choice(_ANSWERS).format(
            c=rng.choice(colors), n=rng.randrange(2, 9), b=rng.choice(["bright", "dark"])
        )
        if kind == 9:  # text only, two turns
            record = {
                "messages": [
                    {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                    {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
                    {"role": "user", "content": "And doubled?"},
                    {"role": "assistant", "content": f"That gives {4 * i}."},
                ],
                "images": [],
            }
        elif kind == 7:  # two images in one turn
            record = {
                "messages": [
                    {"role": "user", "content": f"<image><image>\nCompare the two pictures ({i})."},
                    {"role": "assistant", "content": a},
                ],
                "images": [new_image(), new_image()],
            }
        elif kind == 5:  # system prompt and a second turn with an image
            record = {
                "messages": [
                    {"role": "system", "content": "You describe synthetic images briefly."},
                    {"role": "user", "content": f"<image>\n{q}"},
                    {"role": "assistant", "content": a},
                    {"role": "user", "content": "And this one? <image>"},
                    {"role": "assistant", "content": "Another pattern of rectangles."},
                ],
                "images": [new_image(), new_image()],
            }
        else:
            record = {
                "messages": [
                    {"role": "user", "content": f"<image>\n{q}"},
                    {"role": "assistant", "content": a},
                ],
                "images": [new_image()],
            }
        if reasoning_every and i % reasoning_every == reasoning_every - 1:
            # Not drawn from rng: the rows without reasoning stay what they are without the option.
            record["messages"][-1]["reasoning_content"] = (
                f"Row {i} asks for a short answer; the picture or the numbers decide it."
            )
        lines.append(json.dumps(record))

    if broken_rows:
        lines.append('{"messages": [{"role": "user", "content": "unterminated"')  # invalid JSON
        lines.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "<image>\nWhat is this?"},
                        {"role": "assistant", "content": "Nothing."},
                    ],
                    "images": ["images/does_not_exist.png"],
                }
            )
        )
        lines.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "<image><image>\nTwo placeholders, one image."},
                        {"role": "assistant", "content": "Mismatch."},
                    ],
                    "images": [new_image()],
                }
            )
        )
        lines.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "<image>\nSay nothing."},
                        {"role": "assistant", "content": "   "},
                    ],
                    "images": [new_image()],
                }
            )
        )
        lines.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "narrator", "content": "Once upon a time."},
                        {"role": "assistant", "content": "The end."},
                    ],
                    "images": [],
                }
            )
        )
        long_text = " ".join(f"word{k}" for k in range(1500))
        lines.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"{long_text}\n<image>\nSummarize."},
                        {"role": "assistant", "content": "Too long to keep whole."},
                    ],
                    "images": [new_image()],
                }
            )
        )
    out = directory / "data.jsonl"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


#: Rows ``write_synthetic_pair_dataset(broken_rows=True)`` appends, one per bad-pair reason, in order.
BROKEN_PAIR_REASONS = (
    "missing_chosen",
    "missing_rejected",
    "chosen_equals_rejected",
    "answer_not_assistant",
    "answer_not_assistant",
    "image_in_assistant_turn",
    "prompt_not_ending_with_user",
)


def write_synthetic_pair_dataset(
    directory: str | Path,
    n_pairs: int,
    *,
    seed: int = 0,
    image_sizes: list[tuple[int, int]] | None = None,
    broken_rows: bool = False,
) -> Path:
    """Write ``n_pairs`` preference pairs (JSON Lines, LLaMA-Factory's ranking layout) and their images.

    Each row: ``messages`` (the prompt, ending with a user turn), ``chosen`` and ``rejected`` (one
    assistant message each: the chosen answer names the picture's true main color, the rejected
    one another color) and ``images`` (one per ``<image>`` of the prompt). Rows vary as the SFT
    data does: most have one image, every 5th is text only, every 7th has a system message, every
    6th two images, every 9th a two-turn prompt (an earlier answer, then the question). With
    ``broken_rows`` one row per entry of :data:`BROKEN_PAIR_REASONS` is appended (a missing
    chosen, a missing rejected, equal answers, a user-role answer, a two-message answer, an answer
    with ``<image>``, a prompt ending with an assistant turn). Returns the path of ``data.jsonl``;
    image paths are relative to ``directory`` (the recipe's ``dataset_dir``).
    """
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sizes = image_sizes or [(56, 56), (84, 140), (224, 168), (300, 200), (97, 61)]
    colors = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (30, 60, 220), "orange": (250, 150, 20)}
    names = list(colors)
    image_count = 0

    def new_image(color: str) -> str:
        from PIL import Image, ImageDraw

        nonlocal image_count
        width, height = sizes[rng.randrange(len(sizes))]
        image = Image.new("RGB", (width, height), colors[color])
        draw = ImageDraw.Draw(image)
        x0, y0 = rng.randrange(width // 2 + 1), rng.randrange(height // 2 + 1)
        draw.rectangle([x0, y0, x0 + width // 4, y0 + height // 4], fill=(255, 255, 255))
        name = f"images/{image_count:06d}.png"
        image.save(directory / name)
        image_count += 1
        return name

    def answer(text: str) -> dict:
        return {"role": "assistant", "content": text}

    lines: list[str] = []
    for i in range(n_pairs):
        color = rng.choice(names)
        wrong = rng.choice([c for c in names if c != color])
        if i % 5 == 4:  # text only
            a, b = rng.randrange(2, 50), rng.randrange(2, 50)
            record = {
                "messages": [{"role": "user", "content": f"Pair {i}: what is {a} plus {b}?"}],
                "chosen": answer(f"{a} plus {b} is {a + b}."),
                "rejected": answer(f"{a} plus {b} is {a + b + rng.randrange(1, 9)}."),
                "images": [],
            }
        elif i % 6 == 5:  # two images
            other = rng.choice(names)
            record = {
                "messages": [
                    {"role": "user", "content": f"<image><image>\nWhich colors fill the two pictures ({i})?"}
                ],
                "chosen": answer(f"The first is {color}, the second {other}."),
                "rejected": answer(f"Both are {wrong}."),
                "images": [new_image(color), new_image(other)],
            }
        elif i % 9 == 8:  # two-turn prompt
            record = {
                "messages": [
                    {"role": "user", "content": "<image>\nIs there a white square?"},
                    {"role": "assistant", "content": "Yes, one white square."},
                    {"role": "user", "content": "And the background color?"},
                ],
                "chosen": answer(f"The background is {color}."),
                "rejected": answer(f"The background is {wrong}."),
                "images": [new_image(color)],
            }
        else:
            record = {
                "messages": [{"role": "user", "content": f"<image>\nWhat color is the background ({i})?"}],
                "chosen": answer(f"It is {color}, with a white square."),
                "rejected": answer(f"It is {wrong}."),
                "images": [new_image(color)],
            }
        if i % 7 == 6:
            record["messages"].insert(0, {"role": "system", "content": "You name colors briefly."})
        lines.append(json.dumps(record))

    if broken_rows:
        question = [{"role": "user", "content": "What is two plus two?"}]
        good, bad = answer("Four."), answer("Five.")
        broken = [
            {"messages": question, "rejected": bad},
            {"messages": question, "chosen": good, "rejected": ""},
            {"messages": question, "chosen": good, "rejected": answer("Four.")},
            {"messages": question, "chosen": {"role": "user", "content": "Four."}, "rejected": bad},
            {"messages": question, "chosen": [good, answer("Four, really.")], "rejected": bad},
            {"messages": question, "chosen": answer("<image> Four."), "rejected": bad},
            {"messages": [*question, answer("Four.")], "chosen": good, "rejected": bad},
        ]
        lines.extend(json.dumps({**row, "images": []}) for row in broken)
    out = directory / "data.jsonl"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out
