"""What would synchronise an accelerator in a training step: the host reading tensor values.

:class:`HostReadRecorder` records each read (Python's ``item``/``bool``/``tolist``/``cpu``...,
aten operations whose output size depends on values, boolean-mask indexing) with the source
line that made it; ``mmviews bench train --count-host-reads N`` reports them per step, and the
tests of the training step use it on their own (:mod:`mmviews.bench.train_measure` runs the
steps under it).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: Tensor methods that hand a value to Python (a device-to-host copy and a wait on CUDA).
HOST_READ_METHODS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__",
                               "numpy", "equal", "allclose", "is_nonzero"})
#: aten operations whose output size depends on tensor values: the host must wait for them.
VALUE_SIZED_OPS = frozenset({"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
                             "argwhere", "nonzero_numpy", "repeat_interleave"})


@dataclass
class HostRead:
    """One read: ``op`` (method or aten operation), ``where`` (innermost mmviews source line,
    else the innermost Python frame) and the ``step`` label current when it happened."""

    op: str
    where: str
    step: Any = None


#: Reads of tensors that live in host memory whatever the training device, recognised by the
#: function making them (``path suffix``, ``function``): torch.optim keeps its step counters
#: on the CPU (unless ``capturable``/``fused``) and reads them with ``.item()``. Such a read is
#: left out only when the tensor read is in host memory: a step counter on the accelerator
#: (e.g. restored there from a checkpoint) is a synchronisation per parameter, and recorded.
HOST_RESIDENT_READS = ((f"torch{os.sep}optim{os.sep}optimizer.py", "_get_value"),)


def _origin(host_tensor: bool = True) -> str | None:
    """``path:line (function)`` of the innermost frame in the mmviews package other than this
    module; else of the innermost frame outside torch. None for a read of host-resident state
    (:data:`HOST_RESIDENT_READS`) of a tensor in host memory (``host_tensor``)."""
    frame = sys._getframe(2)
    fallback = None
    here = os.path.abspath(__file__)
    package = os.path.dirname(os.path.dirname(here))
    first = True
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != here:
            if first and host_tensor and any(path.endswith(suffix) and frame.f_code.co_name == name
                             for suffix, name in HOST_RESIDENT_READS):
                return None
            first = False
            if path.startswith(package + os.sep):
                return f"mmviews/{os.path.relpath(path, package)}:{frame.f_lineno} ({frame.f_code.co_name})"
            if fallback is None and f"{os.sep}torch{os.sep}" not in path:
                fallback = f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return fallback or "<no Python frame>"


class _FunctionReads(TorchFunctionMode):
    def __init__(self, recorder: "HostReadRecorder") -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        read = name in HOST_READ_METHODS or (name in ("cpu", "to") and _leaves_device(args, kwargs))
        if not read:
            return func(*args, **(kwargs or {}))
        self.recorder._record(name, not (args and isinstance(args[0], torch.Tensor)) or args[0].device.type == "cpu")
        self.recorder._inside_read += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.recorder._inside_read -= 1


def _leaves_device(args: Sequence[Any], kwargs: Any) -> bool:
    """``tensor.cpu()`` / ``tensor.to("cpu")`` of a tensor that is not on the CPU."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type == "cpu":
        return False
    targets = [*args[1:], *(kwargs or {}).values()]
    return not targets or any(str(t).startswith("cpu") for t in targets if isinstance(t, (str, torch.device)))


class _DispatchReads(TorchDispatchMode):
    def __init__(self, recorder: "HostReadRecorder") -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            if not self.recorder._inside_read:  # a scalar read not seen by the function mode
                self.recorder._record("_local_scalar_dense", args[0].device.type == "cpu")
        elif name in VALUE_SIZED_OPS and not (name == "repeat_interleave" and (kwargs or {}).get("output_size")):
            self.recorder._record(name)
        elif name in ("index", "index_put", "index_put_") and _has_bool_index(args):
            self.recorder._record(f"{name} (boolean mask)")
        return func(*args, **(kwargs or {}))


def _has_bool_index(args: Sequence[Any]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()) if i is not None)


class HostReadRecorder:
    """Records reads of tensor values by the host while active (a context manager).

    Two torch modes: a ``TorchFunctionMode`` sees Python's reads (``item``, ``bool(t)``,
    ``int(t)``, ``float(t)``, ``t.tolist()``, ``t.cpu()`` of a device tensor...) with the line
    that made them; a ``TorchDispatchMode`` sees the aten operations whose output size depends
    on values (``nonzero``, boolean-mask indexing, ``unique``...) and scalar reads made inside
    torch's own Python code. On CUDA each is a synchronisation. :meth:`paused` suspends
    recording (e.g. around the loader's ``next``, whose collation reads host tensors only);
    :attr:`step` labels the reads that follow."""

    def __init__(self) -> None:
        self.reads: list[HostRead] = []
        self.step: Any = None
        self._paused = 0
        self._inside_read = 0
        self._modes: tuple[_FunctionReads, _DispatchReads] | None = None

    def _record(self, op: str, host_tensor: bool = True) -> None:
        if not self._paused:
            where = _origin(host_tensor)
            if where is not None:
                self.reads.append(HostRead(op, where, self.step))

    def __enter__(self) -> "HostReadRecorder":
        self._modes = (_FunctionReads(self), _DispatchReads(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._modes is not None
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = None

    def paused(self) -> "_Paused":
        return _Paused(self)

    def summary(self) -> dict[str, int]:
        """``"op at where" -> count``, most frequent first."""
        return dict(Counter(f"{r.op} at {r.where}" for r in self.reads).most_common())


class _Paused:
    def __init__(self, recorder: HostReadRecorder) -> None:
        self.recorder = recorder

    def __enter__(self) -> None:
        self.recorder._paused += 1

    def __exit__(self, *exc: Any) -> None:
        self.recorder._paused -= 1
