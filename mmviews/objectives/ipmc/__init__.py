"""IPMC (Li et al., "Information theory-guided heuristic Progressive Multi-view Coding"): the
instance-tier unified loss over set-tier pools, plus the distribution-tier Wasserstein critic.

Shapes: ``z`` ``[K, M, d]``; ``index`` ``[K]`` (dataset indices, needed with a memory bank or
a view filter). No view mask.

Instance tier (eqs. 10-11, Circle-loss form with the paper's optimum choices). With cosine
similarities ``s`` of unit vectors, for each sample i with positive pool P_i and negative pool N_i:

    alpha_p = relu(1 + delta - s_p),  alpha_n = relu(s_n + delta)            (both detached)
    with phi_dec set (default 6, tau_dec 1; sec. 4.3, Fig. 8), both are attenuated:
    alpha -> [alpha^tau_dec / phi_dec + 1]_+   (phi_dec = None: the plain weights above)
    loss_i  = softplus( LSE_{N_i} gamma alpha_n (s_n - delta)
                        + LSE_{P_i} -gamma alpha_p (s_p - (1 - delta)) ) / gamma
    unified = scale * mean_i loss_i

The paper finds that the plain weights make the loss settle too fast in a poor minimum; the
attenuated weights lie in [1, 1 + alpha^tau / phi], so every pair keeps a weight of at least 1
and the hardest pairs gain at most ``(1 + delta)^tau / phi`` over the easiest. ``scale``
(default 16, as in the authors' code, which multiplies the loss by 16 after the division by
gamma; the paper's eq. 11 has none): it only matters for the balance with ``beta * L_DA`` and
for gradient clipping.

Defaults: the measured best, the paper's values one parameter away. ``preset="measured"`` (the
default) sets gamma 4, ``pools="direction"`` and scale 16; ``preset="paper"`` sets the paper's
gamma 64, ``pools="sample"`` and scale 1. A value given explicitly wins over the preset. In a
recipe: ``objective: {name: ipmc, params: {preset: paper}}``.

Choosing gamma. With cosine similarities, ``gamma * alpha`` is an inverse temperature: the
paper's gamma 64 (its best, on CIFAR with AlexNet encoders) is a temperature of about
1/64 per unit weight, so each pool's log-sum-exp rests on its few hardest negatives. Where many
negatives share the anchor's class (cross-modal views that share only a few classes), those are
same-class samples and the loss pushes them apart. On mmviews' synthetic four-modality data
(``recipes/reproduce/ipmc_ablation.py``) gamma 4 with the attenuated weights and
``pools="direction"`` trained best; gamma 16-64 ended below the untrained encoder. Hence the
default; on other data, a gamma near 1 / the temperature of an InfoNCE objective that works
there is a good start.

Set tier, pools (``pools="sample"``, the paper's layout): P_i = the cross-view pairs of sample i,
``(u[i,a], u[i,b])`` for ordered ``a != b`` (each similarity twice, as in the authors' code);
N_i = the cross-view pairs with the candidates ``(u[i,a], v[j,b])``, ordered ``a != b``,
``j != i``. This is the authors' layout: their code builds, for each direction a -> b, a row
per anchor (1 positive and the negatives) and concatenates the directions along the pool
axis, i.e. one pool per sample over all directions. ``pools="direction"`` (the default) keeps the
directions apart instead: one row per ``(i, a, b)``, P = {(u[i,a], u[i,b])}, N = {(u[i,a],
v[j,b]) : j != i}, and the unified loss is the mean over the K M (M - 1) rows. Candidates are the batch
(every rank's, gathered with gradient) or, with ``memory_bank_size > 0``, ``bank_negatives``
entries sampled from a :class:`MemoryBank` of past embeddings (detached; the in-batch
negatives are then not used; the sample's own bank entry is excluded; while the bank is still
empty the batch is used). With no bank, no filter and ``beta = 0`` this is exactly the unified
loss over the in-batch pools. View filter (``view_filter_k > 0``): after ``warmup_epochs`` epochs,
the k candidates most similar to sample i, by similarity averaged over the last ``eta`` epochs
(eq. 7, see :class:`ViewFilter`), move from N_i to P_i (their pairs a != b; with
``pools="direction"``, pair (u[i,a], v[j,b]) moves to the positives of row (i, a, b)).

Distribution tier (eqs. 2, 4): a :class:`WassersteinCritic` with one critic head per unordered
view pair (a < b), each 1-Lipschitz through the WGAN-GP gradient penalty, trained by
``critic_step(z)`` (``critic_steps`` Adam steps, its own optimiser). Then
``L_DA = sum over ordered (a, b), a != b, of W_ab`` with ``W_ab = W_ba = critic_ab(u_a).mean() -
critic_ab(u_b).mean()``, i.e. twice the sum over unordered pairs. (With one critic shared by all
pairs, as in the authors' pseudo-code, the sum over ordered pairs would vanish identically.)
The critic's parameters are used detached in ``L_DA``: the encoder's loss never writes
gradients into the critic.

Total: ``loss = unified + beta * L_DA``. The trainer drives the stateful parts through the
objective hooks: ``on_step_end(z, index)`` after each optimiser step (bank and filter history),
``on_epoch_end(epoch)``, ``critic_step(z)`` before the loss when ``beta > 0``. Bank, filter
history, critic and the critic optimiser are in ``state_dict()`` (the optimiser through
``get_extra_state``), so ``load_state_dict`` restores them, also into a fresh objective.
Contract: ``takes_index`` (the bank and the filter need the dataset indices) and
``takes_dataset_size`` (the filter's history has one row per dataset sample).

Layout: :mod:`.loss` (the :class:`IPMC` objective and its unified loss),
:mod:`.memory_bank` (:class:`MemoryBank`), :mod:`.view_filter` (:class:`ViewFilter`),
:mod:`.critic` (:class:`WassersteinCritic`, its training step and ``L_DA``).
"""

from .critic import WassersteinCritic, distribution_loss, train_critic
from .loss import IPMC
from .memory_bank import MemoryBank, check_index
from .view_filter import ViewFilter

__all__ = ["IPMC", "MemoryBank", "ViewFilter", "WassersteinCritic", "check_index", "distribution_loss", "train_critic"]
