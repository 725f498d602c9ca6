"""IPMC's view filter: finds fake negatives (other samples that look like the same instance)
from their similarity averaged over recent epochs, so that the loss can treat them as positives.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ViewFilter(nn.Module):
    """Finds fake negatives by similarity averaged over the last ``eta`` epochs (eq. 7).

    Keeps one snapshot per epoch of each sample's view-averaged embedding ``m_i = mean_a u[i,a]``
    (``[eta, size, d]``; memory eta * size * d floats). The similarity of samples i and j at
    epoch e is ``<m_i^e, m_j^e>`` (the mean over view pairs of the cosine similarities), and the
    filter averages it over the epochs of the window in which both were seen. It is
    :attr:`active` once ``warmup_epochs`` epochs have passed.

    State (``state_dict`` keys): ``snapshots`` ``[eta, size, d]``, ``seen`` ``[eta, size]``
    bool, ``epoch`` (0-dim long, the number of completed epochs).
    """

    def __init__(self, size: int, dim: int, k: int = 1, eta: int = 10, warmup_epochs: int = 10) -> None:
        super().__init__()
        if size < 1 or dim < 1 or k < 1 or eta < 1 or warmup_epochs < 0:
            raise ValueError(
                "ViewFilter needs size >= 1, dim >= 1, k >= 1, eta >= 1, warmup_epochs >= 0; "
                f"got {size}, {dim}, {k}, {eta}, {warmup_epochs}"
            )
        self.k, self.eta, self.warmup_epochs = k, eta, warmup_epochs
        self.register_buffer("snapshots", torch.zeros(eta, size, dim))
        self.register_buffer("seen", torch.zeros(eta, size, dtype=torch.bool))
        self.register_buffer("epoch", torch.zeros((), dtype=torch.long))
        self._epoch_cache: tuple[torch.Tensor, int, int] | None = None

    @property
    def completed_epochs(self) -> int:
        """``int(self.epoch)``, read back from the device only when the buffer is a new tensor
        or was changed in place (its version counter) since the last read: the per-step
        :attr:`active` and :meth:`record` then cause no synchronisation."""
        return self.read_epoch()

    def read_epoch(self) -> int:
        """:attr:`completed_epochs`; call it after changing ``epoch`` (at an epoch's end) so that
        the next step does not have to read it back."""
        tensor, cached = self.epoch, self._epoch_cache
        if cached is None or cached[0] is not tensor or cached[1] != tensor._version:
            cached = self._epoch_cache = (tensor, tensor._version, int(tensor))
        return cached[2]

    @property
    def active(self) -> bool:
        return self.completed_epochs >= self.warmup_epochs

    @torch.no_grad()
    def record(self, u: torch.Tensor, index: torch.Tensor) -> None:
        """Store the view means of ``u`` ``[K, M, d]`` for dataset indices ``index`` ``[K]`` in this epoch's slot."""
        slot = self.completed_epochs % self.eta
        index = index.to(self.snapshots.device)
        self.snapshots[slot, index] = F.normalize(u.detach().to(self.snapshots), dim=-1).mean(dim=1)
        self.seen[slot, index] = True

    @torch.no_grad()
    def next_epoch(self) -> None:
        """Advance the window: the slot of the oldest epoch is cleared for the new one."""
        self.epoch += 1
        slot = int(self.epoch) % self.eta  # the oldest epoch leaves the window
        self.snapshots[slot].zero_()
        self.seen[slot] = False

    @torch.no_grad()
    def averaged_similarity(self, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """``[K, C]`` window-averaged similarity; ``-inf`` where the pair was never seen together."""
        query, candidates = query.to(self.snapshots.device), candidates.to(self.snapshots.device)
        sims = torch.bmm(self.snapshots[:, query], self.snapshots[:, candidates].transpose(1, 2))  # [eta, K, C]
        both = self.seen[:, query, None] & self.seen[:, None, candidates]
        count = both.sum(dim=0)
        total = torch.where(both, sims, torch.zeros((), dtype=sims.dtype, device=sims.device)).sum(dim=0)
        return torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, -math.inf))

    @torch.no_grad()
    def select(self, query: torch.Tensor, candidates: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
        """``[K, C]`` bool: the top-k eligible candidates of each query with a history."""
        scores = self.averaged_similarity(query, candidates).to(eligible.device)
        scores = scores.masked_fill(~eligible, -math.inf)
        k = min(self.k, scores.shape[1])
        top_values, top_positions = scores.topk(k, dim=1)
        chosen = torch.zeros_like(eligible)
        chosen.scatter_(1, top_positions, torch.isfinite(top_values))
        return chosen
