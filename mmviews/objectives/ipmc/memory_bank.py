"""IPMC's memory bank: past embeddings of the dataset, used as negatives instead of the batch.

Shapes: the bank holds ``[size, M, d]`` unit vectors, one row per dataset index; ``index``
``[K]`` are the dataset indices of a batch ``[K, M, d]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def check_index(index: torch.Tensor | None, K: int, size: int, what: str, host_check: bool = True) -> torch.Tensor:
    """``index`` as a LongTensor ``[K]`` with values in ``[0, size)``; ``ValueError`` naming
    ``what`` needed it, the expected shape or the range otherwise.

    ``host_check=False`` (the objective's ``check_inputs`` off, as in training) checks the range
    without reading values back to the host: a device-side assertion, which on CPU raises a
    ``RuntimeError`` at once and on CUDA fails at the next synchronisation."""
    if index is None:
        raise ValueError(f"ipmc: {what} needs the dataset indices of the batch: call objective(z, index=...)")
    if not isinstance(index, torch.Tensor) or index.dtype.is_floating_point or tuple(index.shape) != (K,):
        shape = tuple(index.shape) if isinstance(index, torch.Tensor) else type(index).__name__
        raise ValueError(f"ipmc: index must be an integer tensor of shape [K] = [{K}], got {shape}")
    if K and not host_check:
        torch._assert_async(((index >= 0) & (index < size)).all(),
                            f"ipmc: index values must lie in [0, {size}) (the memory bank / view filter size)")
    elif K and (int(index.min()) < 0 or int(index.max()) >= size):
        raise ValueError(f"ipmc: index values must lie in [0, {size}), got range [{int(index.min())}, {int(index.max())}]")
    return index.long()


class MemoryBank(nn.Module):
    """Past L2-normalised embeddings ``[size, M, d]`` indexed by dataset index (overwritten on update).

    State (``state_dict`` keys): ``embeddings`` ``[size, M, d]`` and ``filled`` ``[size]`` bool.
    """

    def __init__(self, size: int, num_views: int, dim: int) -> None:
        super().__init__()
        if size < 1 or num_views < 2 or dim < 1:
            raise ValueError(f"MemoryBank needs size >= 1, num_views >= 2, dim >= 1; got {size}, {num_views}, {dim}")
        self.register_buffer("embeddings", torch.zeros(size, num_views, dim))
        self.register_buffer("filled", torch.zeros(size, dtype=torch.bool))
        self._full = False  # host-side: every row filled (set by note_if_full, outside the step)

    @property
    def size(self) -> int:
        return self.embeddings.shape[0]

    @torch.no_grad()
    def update(self, u: torch.Tensor, index: torch.Tensor) -> None:
        """Write ``u`` ``[K, M, d]`` (normalised here) at rows ``index`` ``[K]`` (checked by
        the caller with :func:`check_index`)."""
        index = index.to(device=self.embeddings.device, dtype=torch.long)
        self.embeddings[index] = F.normalize(u.detach().to(self.embeddings), dim=-1)
        self.filled[index] = True

    def note_if_full(self) -> None:
        """Read once (e.g. at an epoch's end) whether every row is filled; from then on
        :meth:`sample` draws from all rows without ``nonzero`` (a host synchronisation), with
        the same result."""
        self._full = bool(self.filled.all())

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # a loaded bank may be partly empty
        self._full = False
        super()._load_from_state_dict(*args, **kwargs)

    @torch.no_grad()
    def sample(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices [C], embeddings [C, M, d])``: ``count`` filled entries drawn without
        replacement (all filled entries when ``count <= 0`` or fewer are filled)."""
        if self._full:  # the same indices as nonzero() would give, without its host read
            filled = torch.arange(self.size, device=self.filled.device)
        else:
            filled = self.filled.nonzero().squeeze(1)
        if 0 < count < filled.numel():
            filled = filled[torch.randperm(filled.numel(), device=filled.device)[:count]]
        return filled, self.embeddings[filled]
