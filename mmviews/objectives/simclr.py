"""SimCLR's NT-Xent loss (Chen et al., ICML 2020), the pairwise baseline.

Shapes: ``z`` ``[K, 2, d]`` (exactly two views), optional ``mask`` ``[K, 2]``.

With ``S[i,a,j,b] = <u_ia, u_jb> / tau`` (u the L2-normalised z), each of the 2K anchors
(i, a) has the positive (i, b), b != a, and the 2(K - 1) negatives (j, a), (j, b), j != i:

    L = mean_{i, a} [ LSE({S[i,a,i,b]} U {S[i,a,j,g] : j != i, g in {0, 1}}) - S[i,a,i,b] ]

This is the two-view case of geometric poly-view contrastive learning, and is computed by it.
``critic="squared_l2"`` scores the unnormalised embeddings by ``S[i,a,j,b] = -||z_ia - z_jb||^2 / tau``
instead (the critic of Daunhawer et al., ICLR 2023; see :mod:`.geometric_pvc`), with the encoder's
output left unnormalised (an adapter's ``l2_normalize: false``).
"""

from __future__ import annotations

from ._base import register_objective
from .geometric_pvc import GeometricPVC


@register_objective("simclr", "SimCLR's NT-Xent loss, exactly two views (Chen et al., 2020)")
class SimCLR(GeometricPVC):
    exact_views = 2
    # The poly-view bound is declared for the M-view objectives only (the trainer logs it for
    # them); at M = 2 it is InfoNCE's log(2K - 1) - L.
    poly_view_bound = False
