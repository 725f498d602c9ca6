"""The ``data.options`` of optical flow computed on the training device by torchvision's RAFT
(``flow: raft``): which model, which weights, how many refinement iterations and frame pairs a
call. The dataset checks them when it is built (a bad value is one line naming its key); the step's
RAFT (:mod:`mmviews.modalities.device_flow`) reads them. They live in the data layer so that the
datasets can check them without importing the modality adapters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

RAFT_MODELS = ("raft_small", "raft_large")
#: The ``data.options`` keys read here (the video datasets accept them with ``flow: raft``).
RAFT_OPTIONS = ("raft_model", "raft_weights", "raft_weights_sha256", "raft_iterations", "raft_pairs_per_call")


@dataclass(frozen=True)
class RAFTOptions:
    """The RAFT settings of ``data.options`` (see the module docstring)."""

    model: str = "raft_small"
    weights: str = "DEFAULT"
    weights_sha256: str | None = None
    iterations: int = 12
    pairs_per_call: int = 64

    @classmethod
    def from_data_options(cls, options: Mapping[str, Any]) -> "RAFTOptions | None":
        """The settings when ``options`` asks for ``flow: raft``, else None; a bad value is a
        ``ValueError`` naming its key."""
        if options.get("flow") != "raft":
            return None
        given = {key[len("raft_"):]: options[key] for key in RAFT_OPTIONS if options.get(key) is not None}
        out = cls(**given)
        if out.model not in RAFT_MODELS:
            raise ValueError(f"data.options.raft_model: must be one of {', '.join(RAFT_MODELS)}, got {out.model!r}")
        if not isinstance(out.weights, str) or not out.weights:
            raise ValueError(f"data.options.raft_weights: a weight tag, a file or 'random', got {out.weights!r}")
        for key, value in (("raft_iterations", out.iterations), ("raft_pairs_per_call", out.pairs_per_call)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.options.{key}: must be an integer >= 1, got {value!r}")
        return out
