"""Text: BERT-family encoders through ``transformers`` (AutoModel / AutoTokenizer).

Inputs: ``{"text": list[str]}`` (tokenised here, truncated to ``max_length``) or
``{"input_ids": LongTensor[B, L], "attention_mask": LongTensor[B, L]}``, optionally with
``"lengths": list[int]`` (the real tokens of each row). Raw text is tokenised by
:class:`TextTokenizer`, which the trainer runs where batches are collated (see
:meth:`TextAdapter.host_preprocessor`) so that the step gets token ids.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from mmviews.data.synthetic import synthetic_vocabulary

from .base import Adapter, register_adapter
from .config import AdapterConfig
from .inputs import HostPreprocessor, InputCheck, masked_mean, require_tensor, to_device
from .remote import check_local_or_hub, check_model_folder
from .checkpointing import enable_transformers_checkpointing
from .dropout import KEYED_ATTENTION


@dataclass(frozen=True)
class TextInputCheck(InputCheck):
    """No empty string among the present items of ``text``; ``input_ids`` (when there is no
    ``text``) within the vocabulary ``[0, vocab_size)``, and ``lengths`` (when given) the real
    tokens of each row of ``attention_mask``."""

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
        mask, lengths = inputs.get("attention_mask"), inputs.get("lengths")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and lengths is not None:
            # forward keeps only the columns the longest row needs: a wrong length drops tokens
            given = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
            real = mask.sum(1).tolist()
            if given != real:
                raise ValueError(f"{self.where}: inputs['lengths'] {given[:10]} are not the real tokens of each row "
                                 f"of inputs['attention_mask'] ({real[:10]})")


@dataclass(frozen=True)
class TextTokenizer:
    """Raw text -> the token-id inputs of the text adapter, exactly as its forward tokenises:
    ``{"text": list[str]}`` becomes ``input_ids`` and ``attention_mask`` ``[B, L]`` (padded to
    the longest text, truncated to ``max_length``) and ``lengths``, each row's real tokens. Other
    inputs come back as they are.

    ``lengths`` is a list, not a tensor: it stays in host memory when the batch is moved to the
    device, so the adapter can drop, without reading the device, the padding columns that the
    items it encodes do not need (collation tokenises every item; forward encodes the present
    ones, and tokenising those alone pads to their own longest).

    Holds the tokenizer, no weights: it pickles for the loader's workers (with its vocabulary,
    about 6 kB for the synthetic word list and 0.85 MB for a 30k-word BERT vocabulary)."""

    tokenizer: Any  # a transformers tokenizer
    max_length: int

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        if "text" not in inputs:
            return dict(inputs)
        ids, mask = self.tokens(inputs["text"])
        rest = {key: value for key, value in inputs.items() if key != "text"}
        return {**rest, "input_ids": ids, "attention_mask": mask, "lengths": mask.sum(1).tolist()}

    def tokens(self, texts: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` and ``attention_mask`` ``[B, L]`` of ``texts`` (a list of strings): the
        one tokenisation of the text adapter, in collation and in forward alike."""
        if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise ValueError("text adapter: inputs['text'] must be a list of strings")
        if len(texts) == 0:
            raise ValueError("text adapter: inputs['text'] is an empty list")
        tokens = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                                return_tensors="pt")
        return tokens["input_ids"], tokens["attention_mask"]


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
            check_model_folder(config.model, "text model")
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

    def enable_gradient_checkpointing(self) -> None:
        enable_transformers_checkpointing(self.backbone, "text adapter")

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
        if "text" in inputs:  # the tokenisation of collation (host_preprocessor)
            ids, mask = self.host_preprocessor().tokens(inputs["text"])
        elif "input_ids" in inputs:
            ids = require_tensor(inputs, "input_ids", "text adapter")
            if ids.dim() != 2:
                raise ValueError(f"text adapter: input_ids must be [B, L], got shape {tuple(ids.shape)}")
            mask = inputs.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask
            if mask.shape != ids.shape:
                raise ValueError(f"text adapter: attention_mask {tuple(mask.shape)} != input_ids {tuple(ids.shape)}")
            if inputs.get("lengths") is not None:
                columns = self._needed_columns(inputs["lengths"], ids.shape)
                ids, mask = ids[:, columns], mask[:, columns]
            ids, mask = ids[:, : self.config.max_length].long(), mask[:, : self.config.max_length].long()
        else:
            raise ValueError(f"text adapter: inputs need 'text' or 'input_ids' (keys: {sorted(inputs)})")
        # Tokenised text is made in host memory: its copy must not wait for the device.
        return {"input_ids": to_device(ids, device), "attention_mask": to_device(mask, device)}

    def _needed_columns(self, lengths: Any, shape: torch.Size) -> slice:
        """The columns of ``input_ids`` ``shape`` that rows with ``lengths`` real tokens need:
        those of the longest row, on the tokenizer's padding side. Token ids made for a larger
        batch (all the items collated, when forward encodes the present ones) then give the
        tensors that tokenising these rows alone gives. ``lengths`` is read on the host: a list
        (a tensor on an accelerator would be a device read)."""
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()
        if not isinstance(lengths, (list, tuple)) or len(lengths) != shape[0]:
            raise ValueError(f"text adapter: inputs['lengths'] must list the real tokens of each of the {shape[0]} "
                             f"rows of input_ids {tuple(shape)}, got {lengths!r:.200}")
        longest = max(lengths, default=0)
        if not isinstance(longest, int) or not 0 <= min(lengths, default=0) <= longest <= shape[1]:
            raise ValueError(f"text adapter: inputs['lengths'] must be ints in [0, {shape[1]}] (the width of "
                             f"input_ids), got {list(lengths)[:10]}")
        if self.tokenizer.padding_side == "left":
            return slice(shape[1] - longest, None)
        return slice(0, longest)

    def host_preprocessor(self) -> HostPreprocessor:
        """Tokenising raw text (:class:`TextTokenizer`, with this adapter's tokenizer and
        ``max_length``): forward takes its output with the same result as the text."""
        return TextTokenizer(self.tokenizer, self.config.max_length)

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
        if implementation in ("sdpa", KEYED_ATTENTION):  # boolean: True where a key may be attended to
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
