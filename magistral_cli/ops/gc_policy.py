"""Process-lifetime garbage-collector policy (``training.freeze_gc_after_init``).

After the model, optimizer and data loader are built, millions of long-lived objects sit in
the GC's generations, and every full collection during training walks them again.
:func:`freeze_after_init` collects once and moves them to the permanent generation; automatic
GC stays on and still collects cycles among objects created later. A frozen object is never
collected, so this supports one training run per process (the rank processes torchrun starts).
"""

from __future__ import annotations

import gc

from magistral_cli.errors import UserError

_frozen = False


def freeze_after_init() -> int:
    """Collect, freeze the surviving objects, and return how many were frozen.

    Raises UserError when automatic GC is off (``training.manual_gc_interval`` turns it off;
    the two options exclude each other) and RuntimeError on a second call in this process.
    """
    global _frozen
    if _frozen:
        raise RuntimeError(
            "freeze_after_init was already called in this process: it supports one training run per process"
        )
    if not gc.isenabled():
        raise UserError(
            "training.freeze_gc_after_init needs automatic garbage collection, which is disabled in this process "
            "(training.manual_gc_interval > 0 disables it): use one of the two options"
        )
    _frozen = True
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_at_exit() -> None:
    """Hand the frozen objects back to the collector when the training run ends.

    Objects left in the permanent generation are never finalized, and native extensions that
    count their live objects at interpreter exit (triton's nanobind bindings, which transformers
    imports) then print pages of "leaked" warnings. The run is over, so nothing is lost.
    """
    if _frozen:
        gc.unfreeze()
