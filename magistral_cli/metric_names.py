"""Names of metrics.jsonl fields shared by the writer (the engine) and torch-free readers (``compare``).

Preference training (``training.stage: dpo``) logs trl's names, so that people read them as they
read trl's and LLaMA-Factory's logs.
"""

from __future__ import annotations

#: Preference training's per-step (and per-validation) metrics, means over the pairs, in the order
#: ``ops.preference_loss.PreferenceLoss`` stacks them.
PREFERENCE_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracy",
    "rewards/margin",
    "logps/chosen",
    "logps/rejected",
)
