"""Time LLaMA-Factory's preprocessing (the pipeline the seed's data code derives from) on a dataset.

Run by ``preprocess_speed.py --llamafactory-python PY`` with a Python that has ``llamafactory``
installed; prints one JSON line with rows, kept, seconds and samples per second, and writes
the encoded ids to ``WORK/llamafactory_ids.jsonl``. Not part of the package: LLaMA-Factory is
not a dependency.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(work: str, dataset: str, workers: int, cutoff_len: int) -> None:
    os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
    work_dir = Path(work)
    hf_dir = work_dir / "hf_model"
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    data_dir = Path(dataset).parent
    (data_dir / "dataset_info.json").write_text(
        json.dumps(
            {
                "synth": {
                    "file_name": Path(dataset).name,
                    "formatting": "sharegpt",
                    "columns": {"messages": "messages", "images": "images"},
                    "tags": {
                        "role_tag": "role",
                        "content_tag": "content",
                        "user_tag": "user",
                        "assistant_tag": "assistant",
                        "system_tag": "system",
                    },
                }
            }
        )
    )
    args = {
        "model_name_or_path": str(hf_dir),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "full",
        "dataset": "synth",
        "dataset_dir": str(data_dir),
        "template": "pixtral",
        "cutoff_len": cutoff_len,
        "overwrite_cache": True,
        "preprocessing_num_workers": workers if workers > 1 else None,
        "output_dir": str(work_dir / "lf_out"),
        "image_max_pixels": 262144,
        "image_min_pixels": 1024,
        "report_to": "none",
        "trust_remote_code": False,
    }
    model_args, data_args, training_args, _, _ = get_train_args(args)
    tokenizer_module = load_tokenizer(model_args)
    if tokenizer_module.get("processor") is None:
        # transformers' PixtralProcessor class needs torchvision, which has no build for this torch here;
        # LLaMA-Factory only reads these attributes and calls the (PIL) image processor.
        from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

        class Processor:
            image_processor = PixtralImageProcessorPil(
                size={"longest_edge": 1540}, patch_size={"height": 14, "width": 14}
            )
            tokenizer = tokenizer_module["tokenizer"]
            patch_size, spatial_merge_size = 14, 2
            image_token, image_break_token, image_end_token = "[IMG]", "[IMG_BREAK]", "[IMG_END]"

            def __init__(self):
                self.image_processor.patch_size = {"height": 28, "width": 28}

        processor = Processor()
        # what LLaMA-Factory's patch_processor sets on a real processor
        from llamafactory.model.patcher import patch_processor

        patch_processor(processor, tokenizer_module["tokenizer"], model_args)
        tokenizer_module["processor"] = processor
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    started = time.perf_counter()
    module = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
    seconds = time.perf_counter() - started
    rows = sum(1 for line in Path(dataset).read_text().splitlines() if line.strip())
    train = module["train_dataset"]
    kept = len(train)
    with open(work_dir / "llamafactory_ids.jsonl", "w") as handle:
        for ids in train["input_ids"]:
            handle.write(json.dumps(ids) + "\n")
    print(json.dumps({"rows": rows, "kept": kept, "seconds": seconds, "samples_per_s": rows / seconds}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
