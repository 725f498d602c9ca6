"""Sample-keyed dropout (mmviews.modalities.dropout): masks that depend on the samples, the
micro-batch and the layer, not on how a batch is chunked, ordered or split."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mmviews.data.batch import ViewBatch, ViewInfo
from mmviews.modalities import MultiViewEncoder, build_adapter
from mmviews.modalities.dropout import (
    KEYED_ATTENTION,
    SampleKeyedDropout,
    SampleKeyedMultiheadAttention,
    dropout_rows,
    dropout_step,
    enable_sample_keyed_dropout,
    keyed_uniform_bits,
    salt_sample_keyed_dropout,
    step_key,
)
from mmviews.modalities.dropout.keys import MASK32, mix32
from mmviews.modalities.presets import TINY_HUBERT, example_inputs, tiny_config

NO_BN = {"kind": "mlp", "hidden_dim": 24, "batch_norm": False, "dropout": 0.2}


def _layer(p: float = 0.3, salt: int = 7) -> SampleKeyedDropout:
    return SampleKeyedDropout(p, salt=salt).train()


# --------------------------------------------------------------------------- the layer


def test_keep_rate_and_scale() -> None:
    p = 0.3
    x = torch.ones(512, 64)
    with dropout_rows(torch.arange(512)):
        y = _layer(p)(x)
    kept = y != 0
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
    rate = kept.float().mean().item()
    assert abs(rate - (1 - p)) < 0.01, rate  # 32768 draws: 5 standard deviations is 0.013
    per_column = kept.float().mean(0)  # no position is favoured
    assert per_column.min() > 0.55 and per_column.max() < 0.85, per_column
    # The expectation is kept: mean of y over many draws is x.
    assert abs(y.mean().item() - 1.0) < 0.03


def test_eval_and_p0_are_identity_and_need_no_keys() -> None:
    x = torch.randn(4, 8)
    assert torch.equal(SampleKeyedDropout(0.5).eval()(x), x)
    assert torch.equal(SampleKeyedDropout(0.0).train()(x), x)
    with pytest.raises(RuntimeError, match="without row keys"):
        SampleKeyedDropout(0.5).train()(x)


def test_hash_matches_an_independent_python_reference() -> None:
    """The vectorised hash equals the formula computed element by element in plain Python."""

    def ref_mix(v: int) -> int:  # written out again here, on Python ints
        v &= 0xFFFFFFFF
        v ^= v >> 16
        v = (v * 0x21F0AAAD) % 2**32
        v ^= v >> 15
        v = (v * 0x735A2D97) % 2**32
        return v ^ (v >> 15)

    rows, salt, shape = torch.tensor([5, 2**32 - 1, 123456789]), 99, (3, 2)
    bits = keyed_uniform_bits(rows, salt, shape)
    for r, row in enumerate(rows.tolist()):
        seed = ref_mix(row ^ ref_mix(salt ^ 0x51ED))
        for i in range(3):
            for j in range(2):
                pos = 0x2545F491
                for dim, c in enumerate((i, j)):
                    pos = ref_mix(pos ^ ((c + ((dim + 1) * 0x9E3779B9 & MASK32)) & MASK32))
                assert bits[r, i, j].item() == ref_mix(seed ^ pos)
    assert mix32(12345) == ref_mix(12345)


def test_same_rows_same_masks_whole_chunked_reordered_padded() -> None:
    layer = _layer(0.4)
    keys = torch.tensor([101, 7, 55, 9000, 3, 42])
    x = torch.randn(6, 5, 8)
    with dropout_rows(keys):
        whole = layer(x)
    chunks = []
    for part in (slice(0, 2), slice(2, 6)):
        with dropout_rows(keys[part]):
            chunks.append(layer(x[part]))
    torch.testing.assert_close(torch.cat(chunks), whole, rtol=0, atol=0)
    order = torch.tensor([4, 1, 5, 0, 3, 2])
    with dropout_rows(keys[order]):
        torch.testing.assert_close(layer(x[order]), whole[order], rtol=0, atol=0)
    # Fewer positions (a chunk padded to a shorter length): the same mask where both have one.
    with dropout_rows(keys):
        torch.testing.assert_close(layer(x[:, :3]), whole[:, :3], rtol=0, atol=0)
    # Frames of clips, sample-major [B * T, ...]: frame t of sample b keyed by (b's key, t).
    frames = torch.randn(6 * 3, 8)
    with dropout_rows(keys):
        flat = layer(frames)
    with dropout_rows(keys[2:4]):
        torch.testing.assert_close(layer(frames[6:12]), flat[6:12], rtol=0, atol=0)


def test_masks_differ_between_samples_steps_and_layers() -> None:
    x = torch.ones(2, 4096)

    def mask(salt: int, keys: list[int]) -> torch.Tensor:
        with dropout_rows(torch.tensor(keys)):
            return _layer(0.5, salt)(x) != 0

    base = mask(1, [10, 11])
    assert not torch.equal(base[0], base[1]), "two samples"
    other_layer = mask(2, [10, 11])
    other_step = mask(1, [12, 13])
    for other in (other_layer[0], other_step[0], base[1]):
        agree = (other == base[0]).float().mean().item()
        assert 0.45 < agree < 0.55, agree  # independent masks agree half the time at p = 0.5
    assert step_key(0, 1) != step_key(0, 2) != step_key(1, 1)


def test_gradient_is_the_mask_times_the_scale() -> None:
    x = torch.randn(8, 16, requires_grad=True)
    with dropout_rows(torch.arange(8)):
        y = _layer(0.25)(x)
    y.sum().backward()
    expected = (y != 0).float() / 0.75
    torch.testing.assert_close(x.grad, expected)


# --------------------------------------------------------------------------- converting models


def _rng_untouched(fn):  # runs fn and asserts it drew nothing from the global CPU RNG
    before = torch.get_rng_state()
    out = fn()
    assert torch.equal(torch.get_rng_state(), before), "a global-RNG draw happened: some dropout is not keyed"
    return out


def test_bert_every_dropout_keyed_including_attention() -> None:
    torch.manual_seed(0)
    cfg = tiny_config("text", head=NO_BN)
    cfg["bert_config"] = {**cfg["bert_config"], "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.3}
    adapter = build_adapter(cfg)
    report = enable_sample_keyed_dropout(adapter)
    assert adapter.backbone.config._attn_implementation == KEYED_ATTENTION
    assert not [n for n, m in adapter.named_modules() if type(m) is nn.Dropout], "an nn.Dropout is left"
    assert any("attention" in name for name in report.attention)
    texts = ["the cat sat on the mat", "a dog", "the man reads a book under the tree", "red car"]
    keys = torch.tensor([3, 1, 4, 1000])
    adapter.train()
    with dropout_rows(keys):
        whole = _rng_untouched(lambda: adapter.features({"text": texts}))
    # Attention dropout alone (hidden dropout 0) changes the features: it is applied.
    assert not torch.allclose(whole, adapter.eval().features({"text": texts}), atol=1e-4)
    adapter.train()
    with dropout_rows(keys[[1, 3]]):  # padded to a shorter length than the whole batch
        part = adapter.features({"text": [texts[1], texts[3]]})
    torch.testing.assert_close(part, whole[[1, 3]], rtol=1e-5, atol=1e-6)
    # The saved config still loads without this module's registration (nothing persisted).
    assert "_attn_implementation" not in adapter.backbone.config.to_diff_dict()


def test_hubert_dropout_and_layerdrop_keyed() -> None:
    torch.manual_seed(0)
    cfg = {**tiny_config("hf_audio"), "head": NO_BN,
           "backbone_config": {**TINY_HUBERT, "hidden_dropout": 0.1, "attention_dropout": 0.1,
                               "activation_dropout": 0.1, "feat_proj_dropout": 0.1, "layerdrop": 0.5}}
    adapter = build_adapter(cfg).train()
    report = enable_sample_keyed_dropout(adapter)
    assert report.layerdrop and report.backbones
    assert not [n for n, m in adapter.named_modules() if type(m) is nn.Dropout]
    g = torch.Generator().manual_seed(1)
    wave = {"values": torch.randn(4, 1600, generator=g), "lengths": torch.tensor([1600, 1200, 1600, 900]),
            "sample_rate": 16000}
    keys = torch.tensor([9, 8, 7, 6])
    with dropout_step(0, 3), dropout_rows(keys):
        whole = _rng_untouched(lambda: adapter(wave))
    with dropout_step(0, 3), dropout_rows(keys[2:]):
        part = adapter({k: (v[2:] if torch.is_tensor(v) else v) for k, v in wave.items()})
    torch.testing.assert_close(part, whole[2:], rtol=1e-5, atol=1e-6)
    assert adapter.backbone.config.layerdrop == 0.5, "the config keeps its value (it is saved)"
    # LayerDrop is one decision per micro-batch and layer: over steps, some layers are skipped.
    outs = []
    for step in range(8):
        with dropout_step(0, step), dropout_rows(keys):
            outs.append(adapter(wave))
    assert len({tuple(o[0, :3].tolist()) for o in outs}) > 1


def test_sequence_transformer_attention_keyed() -> None:
    torch.manual_seed(0)
    adapter = build_adapter({**tiny_config("feature_sequence"), "head": NO_BN}).train()
    enable_sample_keyed_dropout(adapter)
    assert all(isinstance(layer.self_attn, SampleKeyedMultiheadAttention) for layer in adapter.backbone.encoder.layers)
    x = {"values": torch.randn(5, 7, 6), "lengths": torch.tensor([7, 3, 5, 7, 1])}
    keys = torch.arange(5) * 17
    with dropout_rows(keys):
        whole = _rng_untouched(lambda: adapter(x))
    with dropout_rows(keys[1:3]):
        part = adapter({"values": x["values"][1:3], "lengths": x["lengths"][1:3]})
    torch.testing.assert_close(part, whole[1:3], rtol=1e-5, atol=1e-6)
    # Eval: the parent class, equal to nn.MultiheadAttention's own result.
    attn = adapter.backbone.encoder.layers[0].self_attn.eval()
    q = torch.randn(2, 4, attn.embed_dim)
    plain = copy.deepcopy(attn)
    plain.__class__ = nn.MultiheadAttention
    torch.testing.assert_close(attn(q, q, q)[0], plain(q, q, q)[0])


@pytest.mark.parametrize("kind", ["open_clip", "flow_clip", "small_cnn", "audio_cnn", "flow_cnn"])
def test_other_adapters_draw_nothing_from_the_global_rng_once_keyed(kind: str) -> None:
    """Head dropout (frames of clips included: ``[B * T, F]`` rows) and whatever the backbone has."""
    torch.manual_seed(0)
    adapter = build_adapter({**tiny_config(kind), "head": NO_BN}).train()
    enable_sample_keyed_dropout(adapter)
    assert not [n for n, m in adapter.named_modules() if type(m) is nn.Dropout]
    for m in adapter.modules():  # the CNNs' BatchNorm: running statistics, so that chunks compare
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    inputs = example_inputs(kind, 4)
    with dropout_rows(torch.arange(4) + 50):
        whole = _rng_untouched(lambda: adapter(inputs))
    with dropout_rows(torch.arange(2, 4) + 50):
        part = adapter({k: (v[2:] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in inputs.items()})
    torch.testing.assert_close(part, whole[2:], rtol=1e-5, atol=1e-6)


def test_unkeyable_randomness_is_an_error() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout2d(0.1))
    with pytest.raises(ValueError, match=r"1: Dropout2d"):
        enable_sample_keyed_dropout(model)
    clip = tiny_config("open_clip")
    clip["model_overrides"] = {**clip["model_overrides"],
                               "vision_cfg": {**clip["model_overrides"]["vision_cfg"], "patch_dropout": 0.2}}
    with pytest.raises(ValueError, match="PatchDropout"):
        enable_sample_keyed_dropout(build_adapter(clip))
    audio = build_adapter({**tiny_config("hf_audio"), "spec_augment": True,
                           "backbone_config": {**TINY_HUBERT, "mask_time_prob": 0.2}})
    with pytest.raises(ValueError, match="SpecAugment"):
        enable_sample_keyed_dropout(audio)
    # A frozen backbone never runs in training mode: nothing there is an error.
    frozen = MultiViewEncoder.from_config({"embed_dim": 16, "modalities": {"audio": {
        **tiny_config("hf_audio"), "spec_augment": True, "finetune": {"mode": "frozen"},
        "backbone_config": {**TINY_HUBERT, "mask_time_prob": 0.2}}}})
    enable_sample_keyed_dropout(frozen)


# --------------------------------------------------------------------------- the encoder


K, WORDS = 6, "the a cat dog sat ran on under mat tree red blue car book".split()


def _sample_batch(ids: list[int]) -> ViewBatch:
    """A batch of the samples ``ids`` made as a collator would (text padded to the batch's longest):
    two text views and one sequence view; sample 3's sequence view is missing."""
    texts, seqs, lengths = [], [], []
    for i in ids:
        g = torch.Generator().manual_seed(i)
        for v in range(2):
            n = 2 + (i * 3 + v) % 6
            texts.append(" ".join(WORDS[int(w)] for w in torch.randint(len(WORDS), (n,), generator=g)))
        seqs.append(torch.randn(7, 6, generator=g))
        lengths.append(0 if i == 3 else 3 + i % 5)
    mask = torch.ones(len(ids), 3, dtype=torch.bool)  # views: text_0, seq_0, text_1
    mask[:, 1] = torch.tensor([i != 3 for i in ids])
    values = torch.stack(seqs) * mask[:, 1, None, None]
    views = [ViewInfo("text_0", "text", 0), ViewInfo("seq_0", "seq", 0),
             ViewInfo("text_1", "text", 1, natural=False, augmentation="x")]
    return ViewBatch(inputs={"text": {"text": texts}, "seq": {"values": values, "lengths": torch.tensor(lengths)}},
                     views=views, mask=mask, index=torch.tensor(ids))


def _encoder() -> MultiViewEncoder:
    torch.manual_seed(0)
    text = tiny_config("text", head=NO_BN)
    text["bert_config"] = {**text["bert_config"], "hidden_dropout_prob": 0.2, "attention_probs_dropout_prob": 0.2}
    enc = MultiViewEncoder.from_config({"embed_dim": 16, "modalities": {
        "text": text, "seq": {**tiny_config("feature_sequence"), "head": NO_BN}}})
    enable_sample_keyed_dropout(enc)
    return enc.train()


# Measured on the test below (CPU, float32): chunking and order change the embeddings by <= 1.5e-7
# and the gradients by <= 2.3e-7 of the largest gradient element (summation order); a wrong mask
# for one sample (encoded under another micro-batch's key) changes its embedding by >= 0.3 and
# the gradients by >= 0.19 of the largest element. The tolerances sit far from both (about 1000x).
EMBEDDING_ATOL = 1e-4
GRADIENT_TOL = 2e-4  # of the largest gradient element, for every element (rtol would let zeros pass at the floor)


def test_encoder_chunks_and_order_give_the_same_embeddings_and_gradients() -> None:
    from test_modalities_dropout_masks import assert_same_masks, keep_masks

    enc = _encoder()
    ids = [10, 3, 25, 4, 17, 8]

    def run(groups: list[list[int]], step: int = 5) -> tuple[dict[int, torch.Tensor], dict[str, torch.Tensor]]:
        enc.zero_grad()
        rows = {}
        with dropout_step(1234, step):
            for group in groups:
                z, _ = enc(_sample_batch(group))
                (z * torch.arange(1.0, 17.0)).sum().backward()  # gradients that depend on every row
                rows.update({i: z[k].detach() for k, i in enumerate(group)})
        return rows, {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}

    whole, grads = _rng_untouched(lambda: run([ids]))
    whole_masks = keep_masks(enc, _sample_batch(ids))  # (layer, sample, view slot) -> keep mask, exactly
    scale = max(g.abs().max().item() for g in grads.values())
    for groups in ([ids[:2], ids[2:]], [ids[::-1]], [[i] for i in ids]):
        masks = {}
        for group in groups:
            masks.update(keep_masks(enc, _sample_batch(group)))
        assert_same_masks(whole_masks, masks, f"groups {groups}")
        rows, chunk_grads = run(groups)
        for i in ids:
            torch.testing.assert_close(rows[i], whole[i], rtol=0, atol=EMBEDDING_ATOL)
        assert chunk_grads.keys() == grads.keys()
        for n, g in grads.items():
            torch.testing.assert_close(chunk_grads[n], g, rtol=0, atol=GRADIENT_TOL * scale,
                                       msg=lambda m, n=n: f"{n}: {m}")
    # Another micro-batch draws other masks; eval has none.
    other, _ = run([ids], step=6)
    assert not torch.allclose(other[10], whole[10], atol=1e-4)
    enc.eval()
    assert not torch.allclose(enc(_sample_batch(ids))[0][0], whole[10], atol=1e-4)


def test_encoder_needs_index_under_a_step() -> None:
    enc = _encoder()
    batch = _sample_batch([1, 2])
    batch.index = None
    with dropout_step(0, 0), pytest.raises(ValueError, match="index"):
        enc(batch)


def test_teacher_copy_is_resalted() -> None:
    enc = _encoder()
    teacher = copy.deepcopy(enc)
    salt_sample_keyed_dropout(teacher, namespace="ema_teacher")
    batch = _sample_batch([1, 2, 5])
    with dropout_step(0, 0):
        a, b = enc(batch)[0], teacher(batch)[0]
    assert not torch.allclose(a, b, atol=1e-4), "the teacher must draw its own masks"


# --------------------------------------------------------------------------- the trainer


def _train_weights(tmp_path, name: str, *, dropout: float = 0.2, keyed: bool = True) -> dict[str, torch.Tensor]:
    from test_train_utils import load_weights, tiny_config as tiny_recipe

    from mmviews.config import config_from_dict
    from mmviews.train import train

    raw = tiny_recipe(image=False, batch_norm=False, dropout=dropout, num_samples=32, batch_size=16, epochs=2)
    raw["cpu"] = True
    raw["optimisation"]["sample_keyed_dropout"] = keyed
    raw["output"]["checkpoint_every"] = 0
    raw["evaluation"]["random_baseline"] = False
    train(config_from_dict(raw), tmp_path / name)
    return load_weights(tmp_path / name / "encoder")


def test_training_keys_each_micro_batch_and_is_deterministic(tmp_path, monkeypatch) -> None:
    import mmviews.train.step as step

    keyed_steps: list[tuple[int | None, int]] = []
    real = step.dropout_step

    def recording(seed: int | None, micro_batch: int):
        keyed_steps.append((seed, micro_batch))
        return real(seed, micro_batch)

    monkeypatch.setattr(step, "dropout_step", recording)
    first = _train_weights(tmp_path, "a")
    # 2 epochs of 2 micro-batches: numbered through the run from the TrainState.
    assert keyed_steps == [(0, 0), (0, 1), (0, 2), (0, 3)]
    again = _train_weights(tmp_path, "b")
    no_dropout = _train_weights(tmp_path, "c", dropout=0.0)
    assert first.keys() == again.keys() == no_dropout.keys()
    for k in first:
        assert torch.equal(first[k], again[k]), k
    assert any(not torch.allclose(first[k], no_dropout[k]) for k in first), "dropout changed nothing"


def test_recipe_key_is_validated_and_unkeyable_layers_stop_the_setup() -> None:
    from mmviews.config import ConfigError, config_from_dict
    from mmviews.train.build import build_run

    raw = {"name": "k", "data": {"name": "synthetic", "options": {"num_samples": 8, "modalities": ["audio"]},
                                 "batch_size": 4, "val_split": None, "test_split": None},
           "views": [{"modality": "audio", "copies": 2}],
           "adapters": {"audio": {**tiny_config("hf_audio"), "spec_augment": True,
                                  "backbone_config": {**TINY_HUBERT, "mask_time_prob": 0.2}}},
           "optimisation": {"sample_keyed_dropout": "yes"}, "cpu": True}
    with pytest.raises(ConfigError, match="optimisation.sample_keyed_dropout"):
        config_from_dict(raw)
    raw["optimisation"]["sample_keyed_dropout"] = True
    with pytest.raises(ConfigError, match=r"(?s)optimisation.sample_keyed_dropout.*SpecAugment"):
        build_run(config_from_dict(raw), with_eval=False)
    raw["adapters"]["audio"]["spec_augment"] = False
    parts = build_run(config_from_dict(raw), with_eval=False)
    assert any(isinstance(m, SampleKeyedDropout) for m in parts.encoder.modules())


def test_keyed_attention_paths_compute_attention_as_torch_and_transformers() -> None:
    """With a vanishing rate (nothing dropped), the explicit attention of the keyed paths equals
    transformers' sdpa kernel (padding mask; causal) and nn.MultiheadAttention (padding mask)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from mmviews.modalities.dropout.hf_attention import _keyed_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 5, 4, generator=g) for _ in range(3))
    module = nn.Module().train()
    module._mmviews_dropout_salt = 1
    pad = torch.ones(3, 1, 5, 5, dtype=torch.bool)
    pad[1, ..., 3:] = False
    for mask, causal in ((pad, False), (None, True)):
        module.is_causal = causal
        with dropout_rows(torch.arange(3)):
            out, _ = _keyed_attention_forward(module, q, k, v, mask, dropout=1e-12)
        ref, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, is_causal=causal)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    mha = nn.MultiheadAttention(8, 2, dropout=1e-12, batch_first=True)
    keyed = copy.deepcopy(mha)
    enable_sample_keyed_dropout(nn.Sequential(keyed))
    x = torch.randn(3, 5, 8, generator=g)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, 2:] = True
    with dropout_rows(torch.arange(3)):
        out = keyed.train()(x, x, x, key_padding_mask=padding)[0]
    torch.testing.assert_close(out, mha.eval()(x, x, x, key_padding_mask=padding)[0], rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_replays_the_keys() -> None:
    """transformers' activation checkpointing recomputes the layers in backward: with
    checkpoint_context the recomputation drops what the forward dropped (same gradients);
    without it the keyed layers have no keys there and say so."""
    from mmviews.modalities.dropout import checkpoint_context

    torch.manual_seed(0)
    cfg = tiny_config("text", head=NO_BN)
    cfg["bert_config"] = {**cfg["bert_config"], "hidden_dropout_prob": 0.3, "attention_probs_dropout_prob": 0.3}
    adapter = build_adapter(cfg)
    enable_sample_keyed_dropout(adapter)
    adapter.train()
    texts = {"text": ["the cat sat on the mat", "a dog", "red car under the tree"]}

    def grads() -> dict[str, torch.Tensor]:
        adapter.zero_grad()
        with dropout_rows(torch.tensor([4, 5, 6])):
            z = adapter(texts)
        z.square().sum().backward()  # outside the keys' context, as the trainer's backward is
        return {n: p.grad.clone() for n, p in adapter.named_parameters() if p.grad is not None}

    plain = grads()
    adapter.backbone.activation_checkpointing_enable({"use_reentrant": False, "context_fn": checkpoint_context})
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys()
    for n in plain:
        torch.testing.assert_close(checkpointed[n], plain[n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    adapter.backbone.activation_checkpointing_enable({"use_reentrant": False})
    with pytest.raises(RuntimeError, match="without row keys"):
        grads()


def test_bench_dropout_runs_every_variant(tmp_path) -> None:
    import argparse
    import json

    from mmviews.bench.cli import VERBS
    from mmviews.bench.dropout import add_arguments, run

    assert VERBS["dropout"][0] == "mmviews.bench.dropout"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--batch-size", "4", "--length", "6", "--width", "16", "--repeats", "1",
                              "--output", str(out)])
    assert run(args) == 0
    rows = json.loads(out.read_text())["rows"]
    seen = {(r["case"], r["variant"]) for r in rows}
    assert seen == {("text", v) for v in ("native", "native_eager", "keyed", "no_dropout")} | {
        ("feature_sequence", v) for v in ("native", "keyed", "no_dropout")}
    assert all(r["s_per_step"] > 0 for r in rows)
    assert all(r["ratio_to_native"] == 1.0 for r in rows if r["variant"] == "native")
