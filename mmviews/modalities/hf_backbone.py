"""The ``transformers`` backbone of the adapters that use one (text, HF audio, HF vision): from a
hub name or local checkpoint, from a ``backbone_config``, or from a saved adapter's folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from .remote import check_model_folder


def transformers_backbone(config: Any, *, load_weights: bool, saved_dir: Path | None, what: str,
                          default_type: str) -> nn.Module:
    """The ``transformers.AutoModel`` of an adapter config with ``model`` (hub name or local
    checkpoint folder; ``pretrained=False`` or ``load_weights=False``: its architecture only) or
    ``backbone_config`` (``{"model_type": ..., **config keywords}``, random weights); from a saved
    adapter folder (``saved_dir``), the architecture saved in its ``backbone/`` sub-folder. ``what``
    names the model in errors (``"audio"``: "audio model ..."); ``default_type`` is the model type
    of a ``backbone_config`` without one."""
    from huggingface_hub.errors import HFValidationError
    from transformers import AutoConfig, AutoModel

    if saved_dir is not None:
        return AutoModel.from_config(AutoConfig.from_pretrained(saved_dir / "backbone"))
    if config.model:
        check_model_folder(config.model, f"{what} model")
        try:
            if config.pretrained and load_weights:
                return AutoModel.from_pretrained(config.model)
            return AutoModel.from_config(AutoConfig.from_pretrained(config.model))
        except (OSError, HFValidationError) as e:
            raise FileNotFoundError(
                f"{what} model {config.model!r}: neither a local checkpoint directory nor a reachable hub model ({e})"
            ) from e
    if config.backbone_config is not None:
        keywords = dict(config.backbone_config)
        model_type = keywords.pop("model_type", default_type)
        return AutoModel.from_config(AutoConfig.for_model(model_type, **keywords))
    raise ValueError(f"{config.type} adapter needs 'model' (hub name or local dir) or 'backbone_config'")
