"""Count the host synchronisations a piece of code would make on an accelerator, on the CPU.

On a GPU or NPU every read of a device value on the host (``.item()``, ``.tolist()``,
``bool(t)``, ``float(t)``, a data-dependent shape such as ``nonzero`` or a boolean index) waits
for the device to finish all queued work: a stall that a bare training loop does not pay. On CUDA
``torch.cuda.set_sync_debug_mode`` reports them; on the CPU every tensor is a host tensor, so this
module tells device values from host values by their *lineage*:

- **host** values: tensors registered as host data (the data loader's micro-batches), tensors
  made by a factory (``torch.zeros``, ``torch.tensor``, ...) without a ``device`` argument, and
  every result of an operation whose tensor inputs are all host values;
- **device** values: everything else: parameters, gradients, buffers, the results of
  ``.to(device)`` and of factories given a ``device``, and every result that a device value
  flowed into.

Unknown lineage counts as device, so the count errs on the high side. ``HostSyncCounter`` is a
``TorchFunctionMode``: it sees every tensor operation of the Python code it wraps (transformers'
too) and records each host read of a device value with the line that made it.
"""

from __future__ import annotations

import sys
import traceback
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

#: Tensor methods that copy a device value to the host and wait for it.
_READS = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "numpy",
    "cpu",
}
#: Operations whose output shape depends on device values (the host must learn it).
_DATA_DEPENDENT = {
    "nonzero",
    "masked_select",
    "unique",
    "unique_consecutive",
    "argwhere",
    "equal",
    "allclose",
}
#: Factories: a result without a ``device`` argument is host data.
_FACTORIES = {
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "linspace",
    "rand",
    "randn",
    "randint",
    "randperm",
    "eye",
}


def _name(func: Any) -> str:
    return getattr(func, "__name__", str(func))


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as counter: ...``; then ``counter.count`` and ``counter.sites``."""

    def __init__(self, host: Iterable[torch.Tensor] = ()):
        super().__init__()
        # id -> weak reference: a WeakSet would compare tensors with ==, which is elementwise.
        self._host: dict[int, weakref.ref] = {}
        self.sites: Counter[str] = Counter()
        self.mark_host(host)

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def mark_host(self, tensors: Iterable[Any]) -> None:
        """Register host data (the loader's batches): their reads cost nothing on a device."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        self._host[id(t)] = weakref.ref(t)

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _record(self, what: str) -> None:
        # The first frame outside torch and this module: the line that asked for the value.
        for frame in reversed(traceback.extract_stack()[:-2]):
            if "/torch/" not in frame.filename and not frame.filename.endswith("host_sync.py"):
                self.sites[f"{what} at {frame.filename.rsplit('/', 2)[-2:][-1]}:{frame.lineno}"] += 1
                return
        self.sites[what] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        device_inputs = [t for t in tensors if not self._is_host(t)]
        if device_inputs and _inside_torch_optim():
            # torch.optim keeps the step counters of a non-capturable, non-fused optimizer on the
            # host by design and reads them there; a fused or capturable one reads none.
            device_inputs = []
        if name in _READS and device_inputs or name in _DATA_DEPENDENT and device_inputs:
            self._record(name)
        elif name == "__getitem__" and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool and not self._is_host(a) for a in flat[1:]
        ):
            self._record("boolean index")
        result = func(*args, **kwargs)
        outputs = [r for r in tree_flatten(result)[0] if isinstance(r, torch.Tensor)]
        if name in _FACTORIES or name.endswith("_like"):
            host = kwargs.get("device") is None and (not name.endswith("_like") or not device_inputs)
        elif name == "to" and _moves_to_a_device(args, kwargs):
            host = False
            if outputs and any(o is t for o in outputs for t in tensors):
                # On the CPU .to(cpu) returns its input; a device copy is a new tensor.
                result = result.clone()
                outputs = [result]
        else:
            host = not device_inputs
        for out in outputs:
            if host:
                self._add(out)
            elif self._is_host(out):
                del self._host[id(out)]
        return result


def _inside_torch_optim() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if "/torch/optim/" in filename:
            return True
        if "/torch/" not in filename and not filename.endswith("host_sync.py"):
            return False
        frame = frame.f_back
    return False


def _moves_to_a_device(args, kwargs) -> bool:
    if "device" in kwargs:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args[1:])
