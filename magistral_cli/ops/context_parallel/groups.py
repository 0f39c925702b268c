"""Context-parallel process groups, the active CP state, and the guard on CP communication.

The CP degree is ``ulysses_size x ring_size``. Inside one CP group the rank is laid out
ring-major: ``cp_rank = ring_rank * ulysses_size + ulysses_rank``, so that the Ulysses
all-to-all (the heavier, latency-bound collective) runs between neighbouring ranks, which
sit on the same node. The device mesh that matches this layout has the dimensions
``("dp", "ring", "ulysses")`` with ``("ring", "ulysses")`` flattened into ``"cp"`` and all
three into ``"dp_cp"`` (:func:`build_cp_mesh`).

The attention function that transformers calls (``attention.py``) takes its groups from
the *active* state set by :func:`context_parallel`; outside that block it refuses to run.
Every CP collective goes through :func:`record_cp_communication`, which counts calls and
raises inside :func:`forbid_cp_communication` (the vision tower runs in such a block).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from magistral_cli.errors import UserError


class ContextParallelError(UserError, RuntimeError):
    """A batch, model or configuration that context parallelism cannot run correctly (exit 2)."""


@dataclass(frozen=True)
class ContextParallelGroups:
    """The process groups of one CP group, and this rank's place in them.

    ``ring_ranks`` are the *global* ranks of this rank's ring group in ring order (what the
    point-to-point sends address). A size-1 dimension has ``None`` for its group.
    """

    ulysses_size: int
    ring_size: int
    cp_group: Any
    ulysses_group: Any
    ring_group: Any
    ulysses_rank: int
    ring_rank: int
    ring_ranks: tuple[int, ...]

    @property
    def cp_size(self) -> int:
        return self.ulysses_size * self.ring_size

    @property
    def cp_rank(self) -> int:
        return self.ring_rank * self.ulysses_size + self.ulysses_rank

    @property
    def mode(self) -> str:
        if self.ulysses_size > 1 and self.ring_size > 1:
            return "hybrid"
        if self.ring_size > 1:
            return "ring"
        return "ulysses" if self.ulysses_size > 1 else "none"


@dataclass(frozen=True)
class ContextParallelMesh:
    """The device mesh ``("dp", "ring", "ulysses")`` and its flattened views.

    ``dp_cp`` is the mesh FSDP2 shards over (data parallel x CP, as the seed does); ``cp`` is the
    CP group's mesh; ``dp`` the data-parallel one.
    """

    mesh: Any
    dp: Any
    cp: Any
    dp_cp: Any


def build_cp_mesh(
    device_type: str, ulysses_size: int, ring_size: int, world_size: int | None = None
) -> ContextParallelMesh:
    """Build the CP device meshes (every rank must call it, in the same order)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world_size = world_size or dist.get_world_size()
    cp = ulysses_size * ring_size
    if ulysses_size < 1 or ring_size < 1 or world_size % cp:
        raise ContextParallelError(
            f"ulysses_parallel_size {ulysses_size} x ring_attention_size {ring_size} = {cp} must divide "
            f"the world size {world_size}"
        )
    mesh = init_device_mesh(
        device_type, (world_size // cp, ring_size, ulysses_size), mesh_dim_names=("dp", "ring", "ulysses")
    )
    cp = mesh["ring", "ulysses"]._flatten("cp")
    dp_cp = mesh["dp", "ring", "ulysses"]._flatten("dp_cp")
    return ContextParallelMesh(mesh=mesh, dp=mesh["dp"], cp=cp, dp_cp=dp_cp)


def cp_groups_from_mesh(meshes: ContextParallelMesh) -> ContextParallelGroups:
    """The CP groups of the meshes built by :func:`build_cp_mesh`."""
    import torch.distributed as dist

    mesh = meshes.mesh
    names = mesh.mesh_dim_names or ()
    if "ring" not in names or "ulysses" not in names:
        raise ContextParallelError(
            f"the device mesh has dimensions {names}; context parallelism needs 'ring' and 'ulysses' "
            "dimensions (build it with magistral_cli.ops.context_parallel.build_cp_mesh)"
        )
    ring_mesh, ulysses_mesh = mesh["ring"], mesh["ulysses"]
    ring_size, ulysses_size = ring_mesh.size(), ulysses_mesh.size()
    ring_group = ring_mesh.get_group() if ring_size > 1 else None
    ring_ranks = (
        tuple(dist.get_process_group_ranks(ring_group)) if ring_group is not None else (dist.get_rank(),)
    )
    return ContextParallelGroups(
        ulysses_size=ulysses_size,
        ring_size=ring_size,
        cp_group=meshes.cp.get_group() if ring_size * ulysses_size > 1 else None,
        ulysses_group=ulysses_mesh.get_group() if ulysses_size > 1 else None,
        ring_group=ring_group,
        ulysses_rank=ulysses_mesh.get_local_rank() if ulysses_size > 1 else 0,
        ring_rank=ring_mesh.get_local_rank() if ring_size > 1 else 0,
        ring_ranks=ring_ranks,
    )


def mode_sizes(mode: str, cp_size: int) -> tuple[int, int]:
    """``(ulysses_size, ring_size)`` for a mode name and a CP degree (hybrid puts 2 on Ulysses)."""
    if mode == "ulysses":
        return cp_size, 1
    if mode == "ring":
        return 1, cp_size
    if mode == "hybrid":
        if cp_size < 4 or cp_size % 2:
            raise ContextParallelError(f"hybrid needs an even CP degree of at least 4, got {cp_size}")
        return 2, cp_size // 2
    raise ContextParallelError(f"unknown context-parallel mode {mode!r}; use ulysses, ring or hybrid")


# --------------------------------------------------------------------------- active state

_ACTIVE: list[ContextParallelGroups] = []


@contextlib.contextmanager
def context_parallel(groups: ContextParallelGroups) -> Iterator[ContextParallelGroups]:
    """Make ``groups`` the CP state that the registered attention function uses."""
    _ACTIVE.append(groups)
    try:
        yield groups
    finally:
        _ACTIVE.pop()


def active_cp_groups() -> ContextParallelGroups:
    if not _ACTIVE:
        raise ContextParallelError(
            "the context-parallel attention was called outside a CP forward; run the model through "
            "magistral_cli.ops.context_parallel.context_parallel_forward (or inside context_parallel(groups))"
        )
    return _ACTIVE[-1]


# --------------------------------------------------------------------------- communication guard

_CALLS = {"count": 0}
_FORBIDDEN: list[str] = []


def record_cp_communication(kind: str) -> None:
    """Called by every CP collective: counts it, and fails inside :func:`forbid_cp_communication`."""
    if _FORBIDDEN:
        raise ContextParallelError(
            f"context-parallel communication ({kind}) inside {_FORBIDDEN[-1]}: that part of the model is "
            "replicated on every CP rank and must not use the CP attention (check that only "
            "config.text_config uses the context-parallel attention implementation)"
        )
    _CALLS["count"] += 1


def cp_communication_count() -> int:
    """How many CP collectives this process has issued (a monotonic counter)."""
    return _CALLS["count"]


@contextlib.contextmanager
def forbid_cp_communication(where: str) -> Iterator[None]:
    """Any CP collective issued inside this block raises :class:`ContextParallelError`."""
    _FORBIDDEN.append(where)
    try:
        yield
    finally:
        _FORBIDDEN.pop()
