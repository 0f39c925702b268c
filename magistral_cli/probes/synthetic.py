"""The small synthetic Mistral3 that the probes build (the seed's probe model, no weights needed).

Patch size 2 and 16x16-pixel images keep the vision tower tiny (64 patches, 16 image tokens
after the 2x2 spatial merge); the structure is Magistral's: Pixtral tower, projector with
spatial merge, Mistral decoder.
"""

from __future__ import annotations

#: The image token of the synthetic vocabulary (its last id).
IMAGE_TOKEN_ID = 255
VOCAB_SIZE = 256
PATCH_SIZE = 2
#: Image tokens per 16x16 image: (16 / 2 / 2) ** 2.
TOKENS_PER_IMAGE = 16


def probe_mistral3_config():
    """A transformers ``Mistral3Config`` with hidden 128, 2 decoder and 2 vision layers, vocab 256."""
    from transformers import Mistral3Config

    from magistral_cli.model_config import apply_tying_rule

    config = Mistral3Config(
        vision_config={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": PATCH_SIZE,
        },
        text_config={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": 1024,
        },
        image_token_index=IMAGE_TOKEN_ID,
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    config.use_cache = False
    # No tie key anywhere, as in Magistral's config.json: the tying rule makes it untied.
    return apply_tying_rule(config)
