"""IPMC's memory bank: past embeddings of the dataset, used as negatives instead of the batch.

Shapes: the bank holds ``[size, M, d]`` unit vectors, one row per dataset index; ``index``
``[K]`` are the dataset indices of a batch ``[K, M, d]``.
"""

from __future__ import annotations

from typing import Any

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
        self._has_entries = False  # host-side: some row filled (set by update, known from its shape)

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
        self._has_entries = self._has_entries or index.numel() > 0

    def has_entries(self) -> bool:
        """Whether some row is filled; known on the host (no read of ``filled``)."""
        return self._has_entries

    def note_if_full(self) -> None:
        """Read once (e.g. at an epoch's end) whether every row is filled; from then on
        :meth:`sample` draws from all rows without the validity mask, with the same result."""
        self._full = bool(self.filled.all())

    # The host flag _full is saved as "<prefix>known_full" (a 0-dim bool): sampling draws
    # differently once it is set, so a resumed run needs it as the uninterrupted one had it.
    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "known_full"] = torch.tensor(self._full)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        known_full = state_dict.get(prefix + "known_full")
        rest = {k: v for k, v in state_dict.items() if k != prefix + "known_full"}
        super()._load_from_state_dict(rest, prefix, *args, **kwargs)
        # read here, when a checkpoint is loaded, rather than in a training step; a state from
        # before "known_full" gives False (sampling then reads nothing either)
        self._full = bool(known_full) if known_full is not None else False
        self._has_entries = bool(self.filled.any())

    @torch.no_grad()
    def sample(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(indices [C], embeddings [C, M, d], valid [C] bool or None)``: ``count`` rows drawn
        without replacement (every row when ``count <= 0`` or ``count >= size``), filled rows
        first. ``valid`` marks the filled ones; None when the bank is known to be full
        (:meth:`note_if_full`), i.e. every row is.

        The number of rows drawn never depends on how many are filled: drawing among the filled
        rows only (``filled.nonzero()``) would make the output size depend on values, a host
        synchronisation at every step until the bank is full, forever when the bank is larger
        than the dataset. Unfilled rows drawn when fewer than ``count`` are filled are marked
        invalid, and the loss leaves them out."""
        size = self.size
        c = size if count <= 0 else min(count, size)
        device = self.filled.device
        if self._full:
            rows = torch.arange(size, device=device) if c == size else torch.randperm(size, device=device)[:c]
            return rows, self.embeddings[rows], None
        # random keys in [0, 1) for filled rows and [1, 2) for empty ones: the c smallest are a
        # uniform draw among the filled rows, completed with empty ones when too few are filled
        keys = torch.rand(size, device=device) + (~self.filled).to(torch.float32)
        rows = keys.topk(c, largest=False, sorted=False).indices if c < size else torch.arange(size, device=device)
        return rows, self.embeddings[rows], self.filled[rows]
