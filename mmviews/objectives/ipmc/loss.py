"""The ``ipmc`` objective: IPMC's unified instance-tier loss over set-tier pools, with the
memory bank, view filter and Wasserstein critic wired in (see the package docstring for the
formulas).

Memory: the pools' ``[K, M, C, M]`` cross-sample scores are streamed over blocks of anchor
samples when they (counted with 4 working copies) exceed ``score_budget_mb``, or when
``chunk_size`` is given; each block's pool log-sum-exps are recomputed with autograd in
backward, tile by tile, the weights alpha being functions of the detached scores (see the memory model in
``docs/objectives.md``)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F

from .. import _distributed as distributed
from .._base import (
    DEFAULT_SCORE_BUDGET_MB,
    MultiViewObjective,
    ObjectiveOutput,
    ViewSet,
    check_embeddings,
    check_finite,
    masked_logsumexp,
    register_objective,
    similarity_metrics,
)
from .critic import WassersteinCritic, distribution_loss, make_critic_optimizer, train_critic
from .memory_bank import MemoryBank, check_index
from .view_filter import ViewFilter

# The settings ``preset`` selects for the parameters left unset (an explicit value wins).
# "measured" (the default): the best setting of recipes/reproduce/ipmc_ablation.py on mmviews'
# synthetic data (natural, augmented and colour views): gamma 4 (best of 2, 4, 8, 16, 64),
# per-direction pools (+0.09 accuracy over per-sample pools at gamma 4) and the authors' loss
# scale 16 (needed for beta * L_DA to stay in balance: at scale 1 the distribution tier costs
# 0.22-0.29 accuracy). There the paper's values (gamma 64, per-sample pools) ended 0.10 below
# the untrained encoder on the natural views.
# "paper": Li et al.'s values: gamma 64 (their best, CIFAR with AlexNet encoders), one pool per
# sample (the authors' code), no loss scale (the paper's eq. 11).
PRESETS: dict[str, dict[str, object]] = {
    "measured": {"gamma": 4.0, "pools": "direction", "scale": 16.0},
    "paper": {"gamma": 64.0, "pools": "sample", "scale": 1.0},
}


@register_objective(
    "ipmc", "IPMC: Circle-loss instance tier, memory bank, view filter and Wasserstein critic (Li et al.)"
)
class IPMC(MultiViewObjective):
    """IPMC's objective; see :mod:`mmviews.objectives.ipmc` for the formulas and the parameters.

    Defaults and where they come from: ``gamma``, ``pools`` and ``scale`` come from ``preset``
    (``"measured"``, the default: gamma 4, ``pools="direction"``, scale 16, the best setting of
    ``recipes/reproduce/ipmc_ablation.py``; ``preset="paper"``: the paper's gamma 64, per-sample
    pools, scale 1); a value given explicitly overrides the preset. ``delta`` 0.35, ``phi_dec``
    6 and ``tau_dec`` 1: the paper's optimum (sec. 4.3, Fig. 8), which also trained best here
    (delta 0.20 / 0.45 within the seed spread; the attenuated weights +0.16 at gamma 4).
    ``beta`` 0 and ``view_filter_k`` 0 (distribution tier and view filter off): in the ablation
    the critic was neutral at scale 16 and the view filter lowered accuracy in every setting.
    ``memory_bank_size`` 0 (in-batch negatives): a bank lowered accuracy in a short run
    (0.64 -> 0.37). ``eta`` 10: the paper's (eq. 7, "firmly set to 10"); ``bank_negatives``
    4096: the paper's pool size (sec. 5.1). ``warmup_epochs`` 10: the paper says only "after a
    few starting epochs"; ours, equal to eta, not measured. ``critic_hidden`` 256: smaller than
    the paper's first layer of 1000 units, for cost; not measured. ``critic_steps`` 5,
    ``gp_weight`` 10, ``critic_lr`` 1e-4 (Adam, betas (0, 0.9)): WGAN-GP's settings (Gulrajani
    et al., 2017), which the paper's critic follows.

    ``state_dict`` keys: ``_shape`` (``(M, d)`` once built, else zeros), ``bank.*``,
    ``filter.*``, ``critic.*`` for the parts in use, and ``_extra_state`` (the critic
    optimiser's state)."""

    supports_mask = False
    presets: ClassVar[dict[str, dict[str, object]]] = PRESETS  # read by `mmviews list objectives`
    # block-sized buffers of the pools at once (scores, logits, their weights and gradients)
    WORKING_COPIES: ClassVar[int] = 4
    takes_index = True  # needed with a memory bank or a view filter, optional otherwise
    takes_dataset_size = True  # the view filter keeps a history row per dataset sample

    def __init__(
        self,
        gamma: float | None = None,
        delta: float = 0.35,
        beta: float = 0.0,
        phi_dec: float | None = 6.0,
        tau_dec: float = 1.0,
        scale: float | None = None,
        pools: str | None = None,
        preset: str = "measured",
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
        chunk_size: int | None = None,
        score_budget_mb: float = DEFAULT_SCORE_BUDGET_MB,
        num_views: int | None = None,
        dim: int | None = None,
    ) -> None:
        super().__init__()
        if preset not in PRESETS:
            raise ValueError(f"ipmc: invalid preset = {preset!r} (one of {', '.join(map(repr, PRESETS))})")
        self.preset = preset
        gamma = PRESETS[preset]["gamma"] if gamma is None else gamma
        scale = PRESETS[preset]["scale"] if scale is None else scale
        pools = PRESETS[preset]["pools"] if pools is None else pools
        checks = {
            "gamma": (gamma, float(gamma) > 0 and math.isfinite(float(gamma))),
            "delta": (delta, 0 <= float(delta) < 1),
            "beta": (beta, float(beta) >= 0 and math.isfinite(float(beta))),
            "phi_dec": (phi_dec, phi_dec is None or (float(phi_dec) > 0 and math.isfinite(float(phi_dec)))),
            "tau_dec": (tau_dec, float(tau_dec) > 0 and math.isfinite(float(tau_dec))),
            "scale": (scale, float(scale) > 0 and math.isfinite(float(scale))),
            "pools": (pools, pools in ("sample", "direction")),
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
                raise ValueError(
                    f"ipmc: invalid {name} = {value!r} (gamma, critic_lr, tau_dec, scale > 0; phi_dec > 0 or None; "
                    "0 <= delta < 1; eta >= 1; counts >= 0; pools 'sample' or 'direction')"
                )
        self.gamma, self.delta, self.beta = float(gamma), float(delta), float(beta)
        self.phi_dec = None if phi_dec is None else float(phi_dec)
        self.tau_dec, self.scale, self.pools = float(tau_dec), float(scale), str(pools)
        self.memory_bank_size, self.bank_negatives = int(memory_bank_size), int(bank_negatives)
        self.view_filter_k, self.warmup_epochs, self.eta = int(view_filter_k), int(warmup_epochs), int(eta)
        self.dataset_size = int(dataset_size) if dataset_size is not None else self.memory_bank_size
        if self.view_filter_k > 0 and self.dataset_size < 1:
            raise ValueError("ipmc: the view filter (view_filter_k > 0) needs dataset_size (or memory_bank_size) >= 1")
        self.set_streaming(chunk_size, score_budget_mb)
        self.critic_steps, self.critic_hidden = int(critic_steps), int(critic_hidden)
        self.gp_weight, self.critic_lr = float(gp_weight), float(critic_lr)
        self.bank: MemoryBank | None = None
        self.filter: ViewFilter | None = None
        self.critic: WassersteinCritic | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.register_buffer("_shape", torch.zeros(2, dtype=torch.long))  # (M, d) once built
        # Host copies, so that the per-step hooks read no device value back (a synchronisation
        # on an accelerator): of _shape with the buffer's identity and in-place version, and
        # whether the bank has ever held an entry (entries are only ever added).
        self._shape_cache: tuple[torch.Tensor, int, tuple[int, int]] | None = None
        self._bank_used = False
        if num_views is not None and dim is not None:
            self.build(int(num_views), int(dim))

    # ---- components ----------------------------------------------------------------------
    def build(self, num_views: int, dim: int) -> None:
        """Create bank, filter and critic for ``M = num_views`` views of dimension ``dim``.

        They are built lazily (on the first call) because their shapes depend on M and d."""
        built = self._built_shape()
        if built[0] > 0:
            if built != (num_views, dim):
                raise ValueError(f"ipmc: built for [*, {built[0]}, {built[1]}] embeddings, got M = {num_views}, d = {dim}")
            return
        device = self._shape.device
        if self.memory_bank_size > 0:
            self.bank = MemoryBank(self.memory_bank_size, num_views, dim).to(device)
        if self.view_filter_k > 0:
            self.filter = ViewFilter(self.dataset_size, dim, self.view_filter_k, self.eta, self.warmup_epochs).to(device)
        if self.beta > 0:
            self.critic = WassersteinCritic(num_views, dim, self.critic_hidden).to(device)
            self.critic_optimizer = make_critic_optimizer(self.critic, self.critic_lr)
        self._shape.copy_(torch.tensor([num_views, dim]))

    def _built_shape(self) -> tuple[int, int]:
        """``(M, d)`` once built, else ``(0, 0)``; reads the ``_shape`` buffer back only when it
        is a new tensor or was changed in place (build, ``load_state_dict``) since the last read."""
        tensor, cached = self._shape, self._shape_cache
        if cached is None or cached[0] is not tensor or cached[1] != tensor._version:
            cached = self._shape_cache = (tensor, tensor._version, (int(tensor[0]), int(tensor[1])))
        return cached[2]

    def _bank_has_entries(self) -> bool:
        """Whether the memory bank holds any entry; a host read only until it does."""
        if not self._bank_used:
            self._bank_used = self.bank.has_entries()
        return self._bank_used

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
        self._bank_used = False  # the loaded bank may be empty: read it again

    def _units(self, z: torch.Tensor) -> torch.Tensor:
        """Detached unit vectors of ``z`` ``[K, M, d]`` for the hooks, which the trainer may
        call outside :meth:`compute` (the critic step runs before it): same checks as ``prepare``."""
        prefix = f"objective {self.name!r}:"
        check_embeddings(z, prefix)
        if self.check_inputs:
            check_finite(z, prefix)
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
        index = check_index(index, u.shape[0], size, "on_step_end", host_check=self.check_inputs).to(u.device)
        u, index = distributed.gather_no_grad(u.contiguous()), distributed.gather_no_grad(index)
        if self.bank is not None:
            self.bank.update(u, index)
        if self.filter is not None:
            self.filter.record(u, index)

    def on_epoch_end(self, epoch: int | None = None) -> None:
        """End of an epoch (``epoch`` counted from 0): advances the filter's window."""
        if self.bank is not None:
            self.bank.note_if_full()  # once full, sampling needs no host read (see MemoryBank.sample)
        if self.filter is not None:
            self.filter.next_epoch()
            if epoch is not None:
                self.filter.epoch.fill_(int(epoch) + 1)
            self.filter.read_epoch()  # read back here, at the epoch's end, rather than in the next step

    def critic_step(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """Train the critics ``critic_steps`` times on the (detached) batch; returns metrics
        (none when there is no critic, i.e. ``beta = 0``).

        Under torch.distributed every rank trains its critic on the whole global batch (every
        rank's, gathered): the critic's random draws (the gradient penalty's shuffle and
        interpolation weights) are then those of one process over the same batch, and so is what
        they take from the random stream, which the memory bank's sampling draws from next. On
        local batches each rank drew for K / N samples, and from the next bank sample on the run
        parted from the one-process run."""
        u = self._units(z)
        self.build(u.shape[1], u.shape[2])
        if self.critic is None or self.critic_steps == 0:
            return {}
        u = distributed.gather_no_grad(u.contiguous())
        return train_critic(self.critic, self.critic_optimizer, u, self.critic_steps, self.gp_weight)

    def distribution_loss(self, z: torch.Tensor) -> torch.Tensor:
        """``L_DA`` of ``z`` ``[K, M, d]`` (normalised here) with the critic detached; see
        :func:`mmviews.objectives.ipmc.critic.distribution_loss`."""
        u = F.normalize(z.to(torch.float64 if z.dtype == torch.float64 else torch.float32), dim=-1)
        self.build(u.shape[1], u.shape[2])
        return distribution_loss(self.critic, u)

    # ---- loss -----------------------------------------------------------------------------
    def _logits(self, s: torch.Tensor, positive: bool) -> torch.Tensor:
        """Positive: ``-gamma alpha_p (s - (1 - delta))``; negative: ``gamma alpha_n (s - delta)``,
        with the weights alpha detached (computed without a graph, gamma folded in). With
        ``phi_dec`` set, each alpha is attenuated to ``[alpha^tau_dec / phi_dec + 1]_+`` (sec. 4.3)."""
        with torch.no_grad():
            weight = (1.0 + self.delta - s) if positive else (s + self.delta)
            weight = weight.clamp_(min=0.0)
            if self.phi_dec is not None:
                # alpha >= 0, so alpha^tau / phi + 1 >= 1: the paper's [.]_+ never binds for phi > 0
                weight = weight.pow_(self.tau_dec).div_(self.phi_dec).add_(1.0)
            weight = weight.mul_(-self.gamma if positive else self.gamma)
        return (s - (1.0 - self.delta if positive else self.delta)) * weight

    @staticmethod
    def _masked_lse(
        logits: torch.Tensor, sample_keep: torch.Tensor, view_keep: torch.Tensor, dim: tuple[int, ...] = (1, 2, 3)
    ) -> torch.Tensor:
        """LSE of ``logits`` ``[K, M, C, M]`` over ``dim`` (``(1, 2, 3)``: ``[K]``; ``(2,)``:
        ``[K, M, M]``) over entries kept by both broadcast masks (``[K, 1, C, 1]`` and
        ``[1, M, 1, M]``), filling in place rather than building the full mask. A row with no kept
        entry gives about ``finfo.min`` (finite), i.e. it adds nothing after a ``logaddexp``."""
        fill = torch.finfo(logits.dtype).min
        logits = logits.masked_fill_(~sample_keep, fill).masked_fill_(~view_keep, fill)
        return torch.logsumexp(logits, dim=dim)

    def loss(self, views: ViewSet, index: torch.Tensor | None = None) -> ObjectiveOutput:
        K, M, d = views.u.shape
        self.build(M, d)
        device, dtype = views.u.device, views.u.dtype
        off_diagonal = ~torch.eye(M, dtype=torch.bool, device=device)
        if self.bank is not None or self.filter is not None:
            size = self.bank.size if self.bank is not None else self.dataset_size
            index = check_index(index, K, size, "the memory bank / view filter", host_check=self.check_inputs).to(device)

        # candidates: the bank's sampled entries (detached) or every rank's batch
        use_bank = self.bank is not None and self._bank_has_entries()
        if use_bank:
            candidate_index, candidates, valid = self.bank.sample(self.bank_negatives)
            candidate_index, candidates = candidate_index.to(device), candidates.to(device=device, dtype=dtype)
            if valid is not None:  # empty rows drawn from a bank not yet full: left out by is_self,
                valid = valid.to(device)  # and looked up (view filter) as row 0, which the bank may exceed
                candidate_index = torch.where(valid, candidate_index, torch.zeros_like(candidate_index))

            def is_self(start: int, stop: int) -> torch.Tensor:  # [k, C]: candidate is the anchor's own entry
                own = candidate_index[None, :] == index[start:stop, None]
                return own if valid is None else own | ~valid[None, :]  # (or an empty row: not a candidate)
        else:
            candidates = views.U
            candidate_index = distributed.gather_no_grad(index) if index is not None else None

            def is_self(start: int, stop: int) -> torch.Tensor:
                return ~views.other_sample_rows(start, stop)

        # [K, C] candidates moved from the negatives to the positives by the view filter (None: none)
        moved: torch.Tensor | None = None
        if self.filter is not None and self.filter.active:
            moved = self.filter.select(index, candidate_index, ~is_self(0, K)).to(device)
            # Not dropped when empty: testing moved.any() would read the device back every
            # step, and an empty moved pool's LSE (about finfo.min) leaves logaddexp unchanged.

        view_keep = off_diagonal[None, :, None, :]  # cross-view pairs only
        # pools "sample": one row per sample i (all its directions a -> b in one pool, [K]);
        # "direction": one row per (i, a, b) with its own positive(s) and negatives ([K, M, M]).
        per_direction = self.pools == "direction"
        lse_dims = (2,) if per_direction else (1, 2, 3)

        def pools(cross: torch.Tensor, start: int, stop: int) -> torch.Tensor:
            """Cross-sample scores ``[k, M, C, M]`` of anchor samples start:stop -> the LSE of the
            negative pool, and of the moved positives if any, stacked on dim 1."""
            negative_keep = ~is_self(start, stop) if moved is None else ~is_self(start, stop) & ~moved[start:stop]
            negative = self._masked_lse(self._logits(cross, False), negative_keep[:, None, :, None], view_keep, lse_dims)
            if moved is None:
                return negative[:, None]
            positive = self._masked_lse(self._logits(cross, True), moved[start:stop, None, :, None], view_keep, lse_dims)
            return torch.stack([negative, positive], dim=1)

        # the [K, M, C, M] scores, whole or streamed over blocks of anchor samples (score_budget_mb)
        pool_lse = views.pairs_reduce(pools, candidates=candidates, working_copies=self.WORKING_COPIES)
        # built after the cross-sample scores: u's gradient then sums in the order it had before
        # streaming existed (bitwise the same training run)
        own = views.within_sample(1.0)  # [K, M, M]
        if per_direction:
            positive_lse = self._logits(own, True)  # the single positive of row (i, a, b)
        else:
            positive_lse = masked_logsumexp(self._logits(own, True), views.pair_valid, dim=(1, 2))  # [K]

        negative_lse = pool_lse[:, 0]
        if moved is not None:
            positive_lse = torch.logaddexp(positive_lse, pool_lse[:, 1])
        terms = F.softplus(negative_lse + positive_lse) / self.gamma
        # per direction, rows a == b are not pairs: masked out of the mean rather than dropped
        # by boolean indexing, which would read the device back (a synchronisation) every step
        rows = off_diagonal.expand_as(terms) if per_direction else None
        # scale: the authors' code multiplies the unified loss by 16 (after the 1 / gamma)
        unified = self.scale * views.mean(terms, rows)

        metrics = similarity_metrics(views)
        moved_count = torch.zeros((), dtype=dtype, device=device) if moved is None else moved.sum().to(dtype)
        metrics.update(unified=unified.detach(), moved_to_positive=moved_count)
        loss = unified
        if self.beta > 0:
            distribution = self.distribution_loss(views.u)
            metrics["distribution"] = distribution.detach()
            loss = unified + self.beta * distribution
        return ObjectiveOutput(loss, metrics)
