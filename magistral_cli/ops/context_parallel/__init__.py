"""Context parallelism for the Mistral3 language model: Ulysses, Ring and Hybrid.

What the trainer calls (in this order):

1. ``meshes = build_cp_mesh(device_type, ulysses_size, ring_size)``: the mesh ``("dp", "ring",
   "ulysses")`` and its flattened ``meshes.cp`` and ``meshes.dp_cp``; FSDP2 shards over
   ``meshes.dp_cp``.
2. ``groups = cp_groups_from_mesh(meshes)``.
3. ``check_cp_model(text_config, ulysses_size)`` before the first step (heads that Ulysses cannot
   split). The rules of the recipe alone (padding scored by the loss, per_sample_loss, neat_packing)
   are the recipe schema's.
4. ``apply_context_parallel(model, groups, loss_fn=None)``: the CP attention for the language
   model only, and ``model(input_ids=..., labels=..., pixel_values=..., image_sizes=...,
   attention_mask=..., position_ids=..., num_items_in_batch=...)`` then returns a loss equal to
   the CP=1 loss. Every CP rank passes the same full batch.
5. FSDP2 over ``meshes.dp_cp`` with its default gradient averaging: the CP loss reduction
   scales each rank's backward by the CP degree, so the average over ``dp x cp`` is the CP=1
   gradient. (Shard inside ``magistral_cli.engine.model.output_capture_survives_wrapping``:
   transformers 5 loses ``_can_record_outputs`` when ``fully_shard`` swaps a PreTrainedModel's
   class.)

On NPU, ``set_attention_backends(local=...)`` plugs ``npu_fusion_attention`` in as the local
attention that Ulysses wraps.
"""

from magistral_cli.ops.context_parallel.attention import (
    ATTENTION_NAME,
    cp_attention,
    disable_cp_attention,
    enable_cp_attention,
    register_cp_attention,
    set_attention_backends,
)
from magistral_cli.ops.context_parallel.groups import (
    ContextParallelError,
    ContextParallelGroups,
    ContextParallelMesh,
    active_cp_groups,
    build_cp_mesh,
    context_parallel,
    cp_communication_count,
    cp_groups_from_mesh,
    forbid_cp_communication,
    mode_sizes,
)
from magistral_cli.ops.context_parallel.layout import (
    gather_from_cp,
    pad_multiple,
    padded_length,
    shard_indices,
    split_for_cp,
)
from magistral_cli.ops.context_parallel.model import (
    ContextParallelOutput,
    apply_context_parallel,
    check_cp_model,
    context_parallel_forward,
    cross_entropy_loss,
    remove_context_parallel,
    validate_cp_batch,
)
from magistral_cli.ops.context_parallel.ring import MathBlockKernel, ring_attention

__all__ = [
    "ATTENTION_NAME",
    "ContextParallelError",
    "ContextParallelGroups",
    "ContextParallelMesh",
    "ContextParallelOutput",
    "MathBlockKernel",
    "active_cp_groups",
    "apply_context_parallel",
    "build_cp_mesh",
    "check_cp_model",
    "context_parallel",
    "context_parallel_forward",
    "cp_attention",
    "cp_communication_count",
    "cp_groups_from_mesh",
    "cross_entropy_loss",
    "disable_cp_attention",
    "enable_cp_attention",
    "forbid_cp_communication",
    "gather_from_cp",
    "mode_sizes",
    "pad_multiple",
    "padded_length",
    "register_cp_attention",
    "remove_context_parallel",
    "ring_attention",
    "set_attention_backends",
    "shard_indices",
    "split_for_cp",
    "validate_cp_batch",
]
