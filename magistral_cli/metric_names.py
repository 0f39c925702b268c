"""Names of metrics.jsonl fields shared by the writer (the engine) and torch-free readers (``compare``).

Preference training (``training.stage: dpo``) logs trl's names (``DPOTrainer``'s ``rewards/...`` and
``logps/...``, which LLaMA-Factory's logs and the dashboards people keep on them use too), so that people
read them as they read trl's and LLaMA-Factory's logs.
"""

from __future__ import annotations

#: Preference training's per-step (and per-validation) metrics, means over the pairs, in the order
#: ``ops.preference_loss.PreferenceLoss`` stacks them.
PREFERENCE_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)

#: Names that runs of magistral-cli 0.1.0 logged in place of trl's (a metrics.jsonl written before the
#: rename): readers take them as the current name, so ``compare`` still reads those runs.
FORMER_PREFERENCE_NAMES = {
    "rewards/accuracy": "rewards/accuracies",
    "rewards/margin": "rewards/margins",
}
#: The preference metric that is a fraction of the pairs (shown as a percentage).
PREFERENCE_FRACTION = "rewards/accuracies"
