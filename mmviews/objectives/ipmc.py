"""IPMC (Li et al., "Information theory-guided heuristic Progressive Multi-view Coding"): the
instance-tier unified loss over set-tier pools, plus the distribution-tier Wasserstein critic.

Shapes: ``z`` ``[K, M, d]``; ``index`` ``[K]`` (dataset indices, needed with a memory bank or
a view filter). No view mask.

Instance tier (eqs. 10-11, Circle-loss form with the paper's optimum choices). With cosine
similarities ``s`` of unit vectors, for each sample i with positive pool P_i and negative pool N_i:

    alpha_p = relu(1 + delta - s_p),  alpha_n = relu(s_n + delta)            (both detached)
    loss_i  = softplus( LSE_{N_i} gamma alpha_n (s_n - delta)
                        + LSE_{P_i} -gamma alpha_p (s_p - (1 - delta)) ) / gamma
    unified = mean_i loss_i

(The authors' code further multiplies by a constant 16; we do not.)

Set tier, pools: P_i = the cross-view pairs of sample i, ``(u[i,a], u[i,b])`` for ordered
``a != b`` (each similarity twice, as in the authors' code); N_i = the cross-view pairs with
the candidates ``(u[i,a], v[j,b])``, ordered ``a != b``, ``j != i``. Candidates are the batch
(every rank's, gathered with gradient) or, with ``memory_bank_size > 0``, ``bank_negatives``
entries sampled from a :class:`MemoryBank` of past embeddings (detached; the in-batch
negatives are then not used; the sample's own bank entry is excluded; while the bank is still
empty the batch is used). With no bank, no filter and ``beta = 0`` this is exactly the unified
loss over the in-batch pools. View filter (``view_filter_k > 0``): after ``warmup_epochs`` epochs,
the k candidates most similar to sample i, by similarity averaged over the last ``eta`` epochs
(eq. 7, see :class:`ViewFilter`), move from N_i to P_i (their pairs a != b).

Distribution tier (eqs. 2, 4): a :class:`WassersteinCritic` with one critic head per unordered
view pair (a < b), each 1-Lipschitz through the WGAN-GP gradient penalty, trained by
``critic_step(z)`` (``critic_steps`` Adam steps, its own optimiser). Then
``L_DA = sum over ordered (a, b), a != b, of W_ab`` with ``W_ab = W_ba = critic_ab(u_a).mean() -
critic_ab(u_b).mean()``, i.e. twice the sum over unordered pairs. (With one critic shared by all
pairs, as in the authors' pseudo-code, the sum over ordered pairs would vanish identically.)
The critic's parameters are used detached in ``L_DA``: the encoder's loss never writes
gradients into the critic.

Total: ``loss = unified + beta * L_DA``. The trainer drives the stateful parts:
``on_step_end(z, index)`` after each optimiser step (bank and filter history),
``on_epoch_end(epoch)``, ``critic_step(z)`` before the loss when ``beta > 0``. Bank, filter
history, critic and the critic optimiser are in ``state_dict()`` (the optimiser through
``get_extra_state``), so ``load_state_dict`` restores them, also into a fresh objective.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import _distributed as distributed
from ._base import MultiViewObjective, ObjectiveOutput, ViewSet, masked_logsumexp, register_objective, similarity_metrics


def _check_index(index: torch.Tensor | None, K: int, size: int, what: str) -> torch.Tensor:
    if index is None:
        raise ValueError(f"ipmc: {what} needs the dataset indices of the batch: call objective(z, index=...)")
    if not isinstance(index, torch.Tensor) or index.dtype.is_floating_point or tuple(index.shape) != (K,):
        shape = tuple(index.shape) if isinstance(index, torch.Tensor) else type(index).__name__
        raise ValueError(f"ipmc: index must be an integer tensor of shape [K] = [{K}], got {shape}")
    if K and (int(index.min()) < 0 or int(index.max()) >= size):
        raise ValueError(f"ipmc: index values must lie in [0, {size}), got range [{int(index.min())}, {int(index.max())}]")
    return index.long()


class MemoryBank(nn.Module):
    """Past L2-normalised embeddings ``[size, M, d]`` indexed by dataset index (overwritten on update)."""

    def __init__(self, size: int, num_views: int, dim: int) -> None:
        super().__init__()
        if size < 1 or num_views < 2 or dim < 1:
            raise ValueError(f"MemoryBank needs size >= 1, num_views >= 2, dim >= 1; got {size}, {num_views}, {dim}")
        self.register_buffer("embeddings", torch.zeros(size, num_views, dim))
        self.register_buffer("filled", torch.zeros(size, dtype=torch.bool))

    @property
    def size(self) -> int:
        return self.embeddings.shape[0]

    @torch.no_grad()
    def update(self, u: torch.Tensor, index: torch.Tensor) -> None:
        """Write ``u`` ``[K, M, d]`` (normalised here) at rows ``index`` ``[K]``."""
        index = _check_index(index, u.shape[0], self.size, "the memory bank").to(self.embeddings.device)
        self.embeddings[index] = F.normalize(u.detach().to(self.embeddings), dim=-1)
        self.filled[index] = True

    @torch.no_grad()
    def sample(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices [C], embeddings [C, M, d])``: ``count`` filled entries drawn without
        replacement (all filled entries when ``count <= 0`` or fewer are filled)."""
        filled = self.filled.nonzero().squeeze(1)
        if 0 < count < filled.numel():
            filled = filled[torch.randperm(filled.numel(), device=filled.device)[:count]]
        return filled, self.embeddings[filled]


class ViewFilter(nn.Module):
    """Finds fake negatives by similarity averaged over the last ``eta`` epochs (eq. 7).

    Keeps one snapshot per epoch of each sample's view-averaged embedding ``m_i = mean_a u[i,a]``
    (``[eta, size, d]``; memory eta * size * d floats). The similarity of samples i and j at
    epoch e is ``<m_i^e, m_j^e>`` (the mean over view pairs of the cosine similarities), and the
    filter averages it over the epochs of the window in which both were seen.
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

    @property
    def active(self) -> bool:
        return int(self.epoch) >= self.warmup_epochs

    @torch.no_grad()
    def record(self, u: torch.Tensor, index: torch.Tensor) -> None:
        slot = int(self.epoch) % self.eta
        index = index.to(self.snapshots.device)
        self.snapshots[slot, index] = F.normalize(u.detach().to(self.snapshots), dim=-1).mean(dim=1)
        self.seen[slot, index] = True

    @torch.no_grad()
    def next_epoch(self) -> None:
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


class WassersteinCritic(nn.Module):
    """One MLP critic per unordered view pair (four linear layers, three ReLUs, as in the
    paper's appendix), evaluated for all pairs at once with batched weights ``[P, in, out]``."""

    def __init__(self, num_views: int, dim: int, hidden: int = 256) -> None:
        super().__init__()
        if num_views < 2 or dim < 1 or hidden < 1:
            raise ValueError(f"WassersteinCritic needs num_views >= 2, dim >= 1, hidden >= 1; got {num_views}, {dim}, {hidden}")
        pairs = torch.triu_indices(num_views, num_views, offset=1)
        self.register_buffer("pair_a", pairs[0].clone(), persistent=False)
        self.register_buffer("pair_b", pairs[1].clone(), persistent=False)
        P = pairs.shape[1]
        sizes = [dim, hidden, hidden, hidden, 1]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            bound = 1.0 / math.sqrt(fan_in)  # nn.Linear's default initialisation
            self.weights.append(nn.Parameter(torch.empty(P, fan_in, fan_out).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(torch.empty(P, 1, fan_out).uniform_(-bound, bound)))

    @property
    def num_pairs(self) -> int:
        return self.pair_a.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[P, B, d]`` -> critic values ``[P, B]`` (head p applied to ``x[p]``)."""
        for layer, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            x = torch.baddbmm(bias, x, weight)
            if layer < len(self.weights) - 1:
                x = torch.relu(x)
        return x.squeeze(-1)

    def pair_inputs(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``u`` ``[K, M, d]`` -> ``(u_a, u_b)``, each ``[P, K, d]``, for the pairs a < b."""
        return u[:, self.pair_a].transpose(0, 1), u[:, self.pair_b].transpose(0, 1)

    def distances(self, u: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``[P]`` estimates ``W_ab = critic_ab(u_a).mean() - critic_ab(u_b).mean()``."""
        u_a, u_b = self.pair_inputs(u)
        both = torch.cat([u_a, u_b], dim=1)
        values = self(both) if params is None else torch.func.functional_call(self, params, (both,))
        return values[:, : u.shape[0]].mean(dim=1) - values[:, u.shape[0] :].mean(dim=1)

    def gradient_penalty(self, u_a: torch.Tensor, u_b: torch.Tensor) -> torch.Tensor:
        """``[P]`` WGAN-GP penalty ``E (||grad critic(x_hat)|| - 1)^2`` on random interpolates."""
        shuffled = u_b[:, torch.randperm(u_b.shape[1], device=u_b.device)]
        eps = torch.rand(u_a.shape[0], u_a.shape[1], 1, device=u_a.device, dtype=u_a.dtype)
        x_hat = (eps * u_a + (1 - eps) * shuffled).requires_grad_(True)
        (grad,) = torch.autograd.grad(self(x_hat).sum(), x_hat, create_graph=True)
        return ((grad.norm(dim=-1) - 1.0) ** 2).mean(dim=1)


@register_objective("ipmc")
class IPMC(MultiViewObjective):
    supports_mask = False

    def __init__(
        self,
        gamma: float = 64.0,
        delta: float = 0.35,
        beta: float = 0.0,
        memory_bank_size: int = 0,
        bank_negatives: int = 4096,
        view_filter_k: int = 0,
        dataset_size: int | None = None,
        warmup_epochs: int = 10,
        eta: int = 10,
        critic_steps: int = 5,
        critic_hidden: int = 256,
        gp_weight: float = 10.0,
        critic_lr: float = 1e-4,
        num_views: int | None = None,
        dim: int | None = None,
    ) -> None:
        super().__init__()
        checks = {
            "gamma": (gamma, float(gamma) > 0 and math.isfinite(float(gamma))),
            "delta": (delta, 0 <= float(delta) < 1),
            "beta": (beta, float(beta) >= 0 and math.isfinite(float(beta))),
            "memory_bank_size": (memory_bank_size, int(memory_bank_size) >= 0),
            "bank_negatives": (bank_negatives, int(bank_negatives) >= 0),
            "view_filter_k": (view_filter_k, int(view_filter_k) >= 0),
            "warmup_epochs": (warmup_epochs, int(warmup_epochs) >= 0),
            "eta": (eta, int(eta) >= 1),
            "critic_steps": (critic_steps, int(critic_steps) >= 0),
            "critic_hidden": (critic_hidden, int(critic_hidden) >= 1),
            "gp_weight": (gp_weight, float(gp_weight) >= 0 and math.isfinite(float(gp_weight))),
            "critic_lr": (critic_lr, float(critic_lr) > 0 and math.isfinite(float(critic_lr))),
        }
        for name, (value, ok) in checks.items():
            if not ok:
                raise ValueError(f"ipmc: invalid {name} = {value!r} (gamma, critic_lr > 0; 0 <= delta < 1; eta >= 1; counts >= 0)")
        self.gamma, self.delta, self.beta = float(gamma), float(delta), float(beta)
        self.memory_bank_size, self.bank_negatives = int(memory_bank_size), int(bank_negatives)
        self.view_filter_k, self.warmup_epochs, self.eta = int(view_filter_k), int(warmup_epochs), int(eta)
        self.dataset_size = int(dataset_size) if dataset_size is not None else self.memory_bank_size
        if self.view_filter_k > 0 and self.dataset_size < 1:
            raise ValueError("ipmc: the view filter (view_filter_k > 0) needs dataset_size (or memory_bank_size) >= 1")
        self.critic_steps, self.critic_hidden = int(critic_steps), int(critic_hidden)
        self.gp_weight, self.critic_lr = float(gp_weight), float(critic_lr)
        self.bank: MemoryBank | None = None
        self.filter: ViewFilter | None = None
        self.critic: WassersteinCritic | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.register_buffer("_shape", torch.zeros(2, dtype=torch.long))  # (M, d) once built
        if num_views is not None and dim is not None:
            self.build(int(num_views), int(dim))

    # ---- components ----------------------------------------------------------------------
    def build(self, num_views: int, dim: int) -> None:
        """Create bank, filter and critic for ``M = num_views`` views of dimension ``dim``."""
        if int(self._shape[0]) > 0:
            if (int(self._shape[0]), int(self._shape[1])) != (num_views, dim):
                built = (int(self._shape[0]), int(self._shape[1]))
                raise ValueError(f"ipmc: built for [*, {built[0]}, {built[1]}] embeddings, got M = {num_views}, d = {dim}")
            return
        device = self._shape.device
        if self.memory_bank_size > 0:
            self.bank = MemoryBank(self.memory_bank_size, num_views, dim).to(device)
        if self.view_filter_k > 0:
            self.filter = ViewFilter(self.dataset_size, dim, self.view_filter_k, self.eta, self.warmup_epochs).to(device)
        if self.beta > 0:
            self.critic = WassersteinCritic(num_views, dim, self.critic_hidden).to(device)
            # WGAN-GP's Adam settings (Gulrajani et al., 2017)
            self.critic_optimizer = torch.optim.Adam(self.critic.parameters(), lr=self.critic_lr, betas=(0.0, 0.9))
        self._shape.copy_(torch.tensor([num_views, dim]))

    def get_extra_state(self) -> dict:
        return {"critic_optimizer": None if self.critic_optimizer is None else self.critic_optimizer.state_dict()}

    def set_extra_state(self, state: dict) -> None:
        if state.get("critic_optimizer") is not None and self.critic_optimizer is not None:
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # A fresh objective builds its components from the saved shape before they are loaded
        # (children are loaded after this method runs).
        shape = state_dict.get(prefix + "_shape")
        if shape is not None and int(shape[0]) > 0 and int(self._shape[0]) == 0:
            self.build(int(shape[0]), int(shape[1]))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _units(self, z: torch.Tensor) -> torch.Tensor:
        if not isinstance(z, torch.Tensor) or z.ndim != 3 or not z.is_floating_point():
            raise ValueError(f"ipmc: z must be a float tensor [K, M, d], got {getattr(z, 'shape', type(z).__name__)}")
        if not torch.isfinite(z).all():
            raise ValueError("ipmc: z has non-finite values")
        dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
        return F.normalize(z.detach().to(dtype), dim=-1)

    # ---- trainer hooks --------------------------------------------------------------------
    @torch.no_grad()
    def on_step_end(self, z: torch.Tensor, index: torch.Tensor) -> None:
        """After an optimiser step: write the batch into the bank and the filter's history
        (every rank's batch, so that the replicas stay identical)."""
        u = self._units(z)
        self.build(u.shape[1], u.shape[2])
        if self.bank is None and self.filter is None:
            return
        size = self.bank.size if self.bank is not None else self.dataset_size
        index = _check_index(index, u.shape[0], size, "on_step_end").to(u.device)
        u, index = distributed.gather_no_grad(u.contiguous()), distributed.gather_no_grad(index)
        if self.bank is not None:
            self.bank.update(u, index)
        if self.filter is not None:
            self.filter.record(u, index)

    def on_epoch_end(self, epoch: int | None = None) -> None:
        """End of an epoch (``epoch`` counted from 0): advances the filter's window."""
        if self.filter is not None:
            self.filter.next_epoch()
            if epoch is not None:
                self.filter.epoch.fill_(int(epoch) + 1)

    def critic_step(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """Train the critics ``critic_steps`` times on the (detached) batch; returns metrics."""
        u = self._units(z)
        self.build(u.shape[1], u.shape[2])
        if self.critic is None or self.critic_steps == 0:
            return {}
        u = u.to(self.critic.weights[0].dtype)
        with torch.enable_grad(), torch.autocast(device_type=u.device.type, enabled=False):
            for _ in range(self.critic_steps):
                u_a, u_b = self.critic.pair_inputs(u)
                distance = self.critic.distances(u)
                penalty = self.critic.gradient_penalty(u_a, u_b)
                cost = (-distance + self.gp_weight * penalty).sum()
                self.critic_optimizer.zero_grad(set_to_none=True)
                cost.backward()
                if distributed.world_size() > 1:  # keep the replicas' critics identical
                    for parameter in self.critic.parameters():
                        torch.distributed.all_reduce(parameter.grad, op=torch.distributed.ReduceOp.SUM)
                        parameter.grad /= distributed.world_size()
                self.critic_optimizer.step()
            # leave no gradient behind for another optimiser that might hold these parameters
            self.critic_optimizer.zero_grad(set_to_none=True)
        return {"critic_distance": distance.detach().sum(), "gradient_penalty": penalty.detach().mean()}

    def distribution_loss(self, z: torch.Tensor) -> torch.Tensor:
        """``L_DA`` = twice the sum over pairs a < b of the critics' W_ab estimates, with the
        critic's parameters detached (gradient flows into ``z`` only). ``z`` ``[K, M, d]``."""
        u = F.normalize(z.to(torch.float64 if z.dtype == torch.float64 else torch.float32), dim=-1)
        self.build(u.shape[1], u.shape[2])
        params = {name: p.detach().to(u.dtype) for name, p in self.critic.named_parameters()}
        return 2.0 * self.critic.distances(u, params).sum()

    # ---- loss -----------------------------------------------------------------------------
    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None, index: torch.Tensor | None = None) -> torch.Tensor:
        return self.compute(z, mask, index=index).loss

    def _logits(self, s: torch.Tensor, positive: bool) -> torch.Tensor:
        """Positive: ``-gamma alpha_p (s - (1 - delta))``; negative: ``gamma alpha_n (s - delta)``,
        with the weights alpha detached (computed without a graph, gamma folded in)."""
        with torch.no_grad():
            if positive:
                weight = (1.0 + self.delta - s).clamp_(min=0.0).mul_(-self.gamma)
            else:
                weight = (s + self.delta).clamp_(min=0.0).mul_(self.gamma)
        return (s - (1.0 - self.delta if positive else self.delta)) * weight

    @staticmethod
    def _masked_lse(logits: torch.Tensor, sample_keep: torch.Tensor, view_keep: torch.Tensor) -> torch.Tensor:
        """``[K]`` LSE of ``logits`` ``[K, M, C, M]`` over entries kept by both broadcast masks
        (``[K, 1, C, 1]`` and ``[1, M, 1, M]``), filling in place rather than building the full mask."""
        fill = torch.finfo(logits.dtype).min
        logits = logits.masked_fill_(~sample_keep, fill).masked_fill_(~view_keep, fill)
        return torch.logsumexp(logits, dim=(1, 2, 3))

    def loss(self, views: ViewSet, index: torch.Tensor | None = None) -> ObjectiveOutput:
        K, M, d = views.u.shape
        self.build(M, d)
        device, dtype = views.u.device, views.u.dtype
        off_diagonal = ~torch.eye(M, dtype=torch.bool, device=device)
        if self.bank is not None or self.filter is not None:
            size = self.bank.size if self.bank is not None else self.dataset_size
            index = _check_index(index, K, size, "the memory bank / view filter").to(device)

        # candidates: the bank's sampled entries (detached) or every rank's batch
        use_bank = self.bank is not None and bool(self.bank.filled.any())
        if use_bank:
            candidate_index, candidates = self.bank.sample(self.bank_negatives)
            candidate_index, candidates = candidate_index.to(device), candidates.to(device=device, dtype=dtype)
            is_self = candidate_index[None, :] == index[:, None]  # [K, C]
        else:
            candidates = views.U
            candidate_index = distributed.gather_no_grad(index) if index is not None else None
            is_self = ~views.other_sample
        C = candidates.shape[0]
        cross = (views.u.reshape(K * M, d) @ candidates.reshape(C * M, d).T).view(K, M, C, M)  # [K, M, C, M]

        moved = torch.zeros(K, C, dtype=torch.bool, device=device)
        if self.filter is not None and self.filter.active:
            moved = self.filter.select(index, candidate_index, ~is_self).to(device)

        own = views.within_sample(1.0)  # [K, M, M]
        positive_lse = masked_logsumexp(self._logits(own, True), views.pair_valid, dim=(1, 2))  # [K]
        view_keep = off_diagonal[None, :, None, :]  # cross-view pairs only
        if bool(moved.any()):
            moved_lse = self._masked_lse(self._logits(cross, True), moved[:, None, :, None], view_keep)
            positive_lse = torch.logaddexp(positive_lse, moved_lse)
        negative_keep = (~is_self & ~moved)[:, None, :, None]
        negative_lse = self._masked_lse(self._logits(cross, False), negative_keep, view_keep)  # [K]
        unified = views.mean(F.softplus(negative_lse + positive_lse) / self.gamma)

        metrics = similarity_metrics(views)
        metrics.update(unified=unified.detach(), moved_to_positive=moved.sum().to(dtype))
        loss = unified
        if self.beta > 0:
            distribution = self.distribution_loss(views.u)
            metrics["distribution"] = distribution.detach()
            loss = unified + self.beta * distribution
        return ObjectiveOutput(loss, metrics)
