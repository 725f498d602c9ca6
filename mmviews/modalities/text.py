"""Text: BERT-family encoders through ``transformers`` (AutoModel / AutoTokenizer).

Inputs: ``{"text": list[str]}`` (tokenised here, truncated to ``max_length``) or
``{"input_ids": LongTensor[B, L], "attention_mask": LongTensor[B, L]}``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from mmviews.data.synthetic import synthetic_vocabulary

from .base import (
    Adapter,
    AdapterConfig,
    InputCheck,
    check_local_or_hub,
    masked_mean,
    register_adapter,
    require_tensor,
    to_device,
)

@dataclass(frozen=True)
class TextInputCheck(InputCheck):
    """No empty string among the present items of ``text``; ``input_ids`` (when there is no
    ``text``) within the vocabulary ``[0, vocab_size)``."""

    vocab_size: int = 0

    def __call__(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> None:
        texts = inputs.get("text")
        if "text" in inputs:
            if isinstance(texts, (list, tuple)) and all(isinstance(t, str) for t in texts):
                keep = [True] * len(texts) if present is None else present.tolist()
                empty = [i for i, (t, k) in enumerate(zip(texts, keep)) if k and not t.strip()]
                if empty:
                    raise ValueError(f"{self.where}: empty string(s) at batch position(s) {empty[:10]}")
            return
        ids = inputs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.numel():
            low, high = (int(v) for v in torch.aminmax(ids))
            if low < 0 or high >= self.vocab_size:
                raise ValueError(f"{self.where}: token ids outside [0, {self.vocab_size}) (min {low}, max {high}) "
                                 f"in inputs['input_ids'] of shape {tuple(ids.shape)}")


SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# Word lists a config can name instead of copying them (``vocab: synthetic``), so a recipe
# cannot drift out of sync with the data it tokenises.
NAMED_VOCABULARIES: dict[str, Callable[[], list[str]]] = {
    # every word the synthetic text can contain, sorted (the special tokens are added by
    # build_word_vocab)
    "synthetic": lambda: synthetic_vocabulary(special_tokens=False),
}


@dataclass
class TextConfig(AdapterConfig):
    """``model``: hub name or local directory of a transformers checkpoint (AutoModel);
    with ``pretrained=False`` only its architecture is used (random weights).
    Without ``model``: ``bert_config`` (BertConfig keyword arguments, random weights)
    and ``vocab`` for the tokenizer: a word list, the name of a built-in word list
    (:data:`NAMED_VOCABULARIES`: ``synthetic`` = the synthetic data's words; a name wins
    over a file of that name), or a path to a vocab.txt. A named list is replaced by its
    words when the adapter is built, so the saved ``config.json`` holds the words.
    ``pooling``: ``mean`` (masked mean over tokens), ``cls`` or ``pooler``."""

    type = "text"
    model: str | None = None
    pretrained: bool = True
    tokenizer: str | None = None  # defaults to ``model``
    bert_config: dict[str, Any] | None = None
    vocab: list[str] | str | None = None
    pooling: str = "mean"
    max_length: int = 128


def build_word_vocab(words: list[str]) -> dict[str, int]:
    """Token -> id for ``BertTokenizerFast(vocab=...)``: the BERT special tokens first,
    then ``words`` (lower-cased, de-duplicated, in order)."""
    vocab: dict[str, int] = {}
    for w in SPECIAL_TOKENS + [w.lower() for w in words]:
        if w not in vocab:
            vocab[w] = len(vocab)
    return vocab


@register_adapter
class TextAdapter(Adapter):
    """BERT-family text encoder (transformers AutoModel, or a random BertConfig with a word list)."""

    config_class = TextConfig
    default_lora_targets = ["query", "value"]
    config: TextConfig

    def __init__(self, config: TextConfig, *, load_weights: bool = True, saved_dir: Path | None = None) -> None:
        if isinstance(config.vocab, str) and config.vocab in NAMED_VOCABULARIES:
            # Keep the words, not the name, in the config: config.json then rebuilds this
            # exact tokenizer even if the named list changes later.
            config = dataclasses.replace(config, vocab=NAMED_VOCABULARIES[config.vocab]())
        super().__init__(config)
        from huggingface_hub.errors import HFValidationError
        from transformers import AutoConfig, AutoModel, AutoTokenizer, BertConfig, BertModel, BertTokenizerFast

        if config.pooling not in ("mean", "cls", "pooler"):
            raise ValueError(f"text pooling must be 'mean', 'cls' or 'pooler', got {config.pooling!r}")
        if config.max_length < 2:
            raise ValueError(f"text max_length must be >= 2, got {config.max_length}")
        if saved_dir is not None:
            self.backbone = AutoModel.from_config(AutoConfig.from_pretrained(saved_dir / "backbone"))
            self.tokenizer = AutoTokenizer.from_pretrained(saved_dir / "tokenizer")
        elif config.model:
            check_local_or_hub(config.model, "text model")
            try:
                if config.pretrained and load_weights:
                    self.backbone = AutoModel.from_pretrained(config.model)
                else:
                    self.backbone = AutoModel.from_config(AutoConfig.from_pretrained(config.model))
                tok = config.tokenizer or config.model
                check_local_or_hub(tok, "text tokenizer")
                self.tokenizer = AutoTokenizer.from_pretrained(tok)
            except (OSError, HFValidationError) as e:
                raise FileNotFoundError(
                    f"text model {config.model!r}: neither a local checkpoint directory nor a reachable hub model ({e})"
                ) from e
        elif config.bert_config is not None:
            if config.vocab is None:
                raise ValueError("text adapter with bert_config needs 'vocab' (word list or vocab.txt path)")
            if isinstance(config.vocab, str):
                check_local_or_hub(config.vocab, "text vocab")
                if not Path(config.vocab).is_file():
                    raise FileNotFoundError(f"text vocab file {config.vocab!r} does not exist")
                vocab: Any = config.vocab
                n_vocab = sum(1 for _ in open(config.vocab, encoding="utf-8"))
            else:
                vocab = build_word_vocab(list(config.vocab))
                n_vocab = len(vocab)
            # transformers 5 ignores vocab_file=; vocab= takes a path or a dict.
            self.tokenizer = BertTokenizerFast(vocab=vocab, do_lower_case=True)
            bcfg = dict(config.bert_config)
            bcfg.setdefault("vocab_size", n_vocab)
            if bcfg["vocab_size"] < n_vocab:
                raise ValueError(f"bert_config.vocab_size={bcfg['vocab_size']} < tokenizer vocabulary size {n_vocab}")
            bcfg.setdefault("max_position_embeddings", max(config.max_length, 16))
            self.backbone = BertModel(BertConfig(**bcfg))
        else:
            raise ValueError("text adapter needs 'model' (hub name or local dir) or 'bert_config' + 'vocab'")
        if config.pooling == "pooler" and getattr(self.backbone, "pooler", None) is None:
            raise ValueError(f"text pooling='pooler' but {type(self.backbone).__name__} has no pooler layer")
        self.feature_dim = int(self.backbone.config.hidden_size)
        self._finish_init()

    def _save_extra(self, directory: Path) -> None:
        self.backbone.config.save_pretrained(directory / "backbone")
        self.tokenizer.save_pretrained(directory / "tokenizer")

    def backbone_blocks(self) -> list[nn.Module]:
        encoder = getattr(self.backbone, "encoder", None)
        layers = getattr(encoder, "layer", None) or getattr(encoder, "layers", None)
        if layers is None:
            raise NotImplementedError(f"cannot find the layers of {type(self.backbone).__name__} for last_n")
        return list(layers)

    def backbone_tail(self) -> list[nn.Parameter]:
        pooler = getattr(self.backbone, "pooler", None)
        return list(pooler.parameters()) if pooler is not None and self.config.pooling == "pooler" else []

    def preprocess(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> dict[str, Any]:
        device = next(self.backbone.parameters()).device
        if "text" in inputs:
            texts = inputs["text"]
            if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
                raise ValueError("text adapter: inputs['text'] must be a list of strings")
            if len(texts) == 0:
                raise ValueError("text adapter: inputs['text'] is an empty list")
            tok = self.tokenizer(
                list(texts),
                padding=True,
                truncation=True,
                max_length=self.config.max_length,
                return_tensors="pt",
            )
            ids, mask = tok["input_ids"], tok["attention_mask"]
        elif "input_ids" in inputs:
            ids = require_tensor(inputs, "input_ids", "text adapter")
            if ids.dim() != 2:
                raise ValueError(f"text adapter: input_ids must be [B, L], got shape {tuple(ids.shape)}")
            mask = inputs.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask
            if mask.shape != ids.shape:
                raise ValueError(f"text adapter: attention_mask {tuple(mask.shape)} != input_ids {tuple(ids.shape)}")
            ids, mask = ids[:, : self.config.max_length].long(), mask[:, : self.config.max_length].long()
        else:
            raise ValueError(f"text adapter: inputs need 'text' or 'input_ids' (keys: {sorted(inputs)})")
        # Tokenised text is made here, in host memory: its copy must not wait for the device.
        return {"input_ids": to_device(ids, device), "attention_mask": to_device(mask, device)}

    def input_check(self) -> InputCheck:
        return TextInputCheck("text adapter", vocab_size=int(self.backbone.config.vocab_size))

    def encode(self, prepared: dict[str, Any]) -> torch.Tensor:
        mask = self._backbone_attention_mask(prepared["attention_mask"])
        out = self.backbone(input_ids=prepared["input_ids"], attention_mask=mask)
        if self.config.pooling == "cls":
            return out.last_hidden_state[:, 0]
        if self.config.pooling == "pooler":
            return out.pooler_output
        return masked_mean(out.last_hidden_state, prepared["attention_mask"].bool())

    def _backbone_attention_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The padding mask ``[B, L]`` in the 4-D form that the backbone's attention takes as it
        is. Given the 2-D mask, transformers builds that form itself but first reads the mask back
        (``padding_mask.all()``, to drop it when nothing is padded): a device synchronisation at
        every call. Attention kernels other than sdpa and eager get the 2-D mask."""
        keep = mask.bool()[:, None, None, :]  # [B, 1, 1, L], broadcast over heads and queries
        implementation = getattr(self.backbone.config, "_attn_implementation", None)
        if implementation == "sdpa":  # boolean: True where a key may be attended to
            return keep
        if implementation == "eager":  # additive: the most negative value where it may not
            dtype = next(self.backbone.parameters()).dtype
            return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)
        return mask

    def preprocessing_signature(self) -> dict[str, Any]:
        """What the cache key must cover besides the backbone weights."""
        sig = super().preprocessing_signature()
        sig["tokenizer_vocab"] = sorted(self.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        return sig
