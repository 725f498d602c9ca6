"""MultiViewEncoder over ViewBatch, and the feature cache for frozen backbones."""

from __future__ import annotations

import pytest
import torch

from mmviews.data.batch import ViewBatch, ViewInfo
from mmviews.modalities import FeatureCache, MultiViewEncoder, backbone_fingerprint, build_adapter
from mmviews.modalities.presets import tiny_config

K = 4


def _encoder(frozen: bool = False) -> MultiViewEncoder:
    ft = {"mode": "frozen"} if frozen else {"mode": "full"}
    return MultiViewEncoder.from_config(
        {
            "embed_dim": 16,
            "modalities": {
                "seq": {**tiny_config("feature_sequence"), "finetune": ft},
                "image": {**tiny_config("small_cnn"), "finetune": ft},
            },
        }
    )


def _batch(seed: int = 0, index: torch.Tensor | None = None) -> ViewBatch:
    g = torch.Generator().manual_seed(seed)
    # Views interleaved across modalities, and listed out of slot order for "image".
    views = [
        ViewInfo("image_1", "image", 1, natural=False, augmentation="crop"),
        ViewInfo("seq_0", "seq", 0),
        ViewInfo("image_0", "image", 0),
    ]
    lengths = torch.tensor([12, 5, 0, 7])  # sample 2 has no sequence view
    seq = {"values": torch.randn(K, 12, 6, generator=g), "lengths": lengths}
    seq["values"][2] = 0
    images = torch.rand(K * 2, 3, 32, 32, generator=g)  # sample-major: k * 2 + slot
    mask = torch.ones(K, 3, dtype=torch.bool)
    mask[2, 1] = False
    return ViewBatch(inputs={"seq": seq, "image": {"values": images}}, views=views, mask=mask, index=index)


def test_view_order_and_mask() -> None:
    torch.manual_seed(0)
    enc = _encoder().eval()
    batch = _batch()
    z, mask = enc(batch)
    assert z.shape == (K, 3, 16) and torch.equal(mask, batch.mask)
    images = batch.inputs["image"]["values"].reshape(K, 2, 3, 32, 32)
    slot1 = enc.encode_modality("image", {"values": images[:, 1]})
    slot0 = enc.encode_modality("image", {"values": images[:, 0]})
    assert torch.allclose(z[:, 0], slot1, atol=1e-5), "position 0 is image slot 1"
    assert torch.allclose(z[:, 2], slot0, atol=1e-5)
    present = torch.tensor([0, 1, 3])
    seq_in = {k: v[present] for k, v in batch.inputs["seq"].items()}
    assert torch.allclose(z[present, 1], enc.encode_modality("seq", seq_in), atol=1e-5)
    assert torch.all(z[2, 1] == 0), "absent views are zero vectors"
    norms = z.norm(dim=-1)
    assert torch.allclose(norms[mask], torch.ones(int(mask.sum())), atol=1e-5)


def test_gradients_flow_to_every_adapter_and_param_groups() -> None:
    torch.manual_seed(0)
    enc = _encoder().train()
    z, mask = enc(_batch())
    (z[mask] ** 3).sum().backward()
    for name, adapter in enc.adapters.items():
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.backbone.parameters()), name
    names = {g["name"] for g in enc.param_groups(1e-4, 1e-3, 0.01)}
    assert {"seq.backbone", "seq.head", "image.backbone", "image.head"} <= names


def test_save_and_load_whole_encoder(tmp_path) -> None:
    torch.manual_seed(0)
    enc = _encoder().eval()
    batch = _batch()
    enc.save_pretrained(tmp_path / "enc")
    loaded = MultiViewEncoder.from_pretrained(tmp_path / "enc").eval()
    assert torch.allclose(loaded(batch)[0], enc(batch)[0], atol=1e-6)
    with pytest.raises(FileNotFoundError, match="encoder.json"):
        MultiViewEncoder.from_pretrained(tmp_path / "missing")


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="embed_dim"):
        MultiViewEncoder(
            {"a": build_adapter(tiny_config("small_cnn", embed_dim=8)), "b": build_adapter(tiny_config("small_cnn"))}
        )
    enc = _encoder()
    batch = _batch()
    batch.views[1] = ViewInfo("txt", "text", 0)
    with pytest.raises(KeyError, match="no adapter"):
        enc(batch)


def _count_backbone_calls(enc: MultiViewEncoder) -> dict[str, int]:
    calls = {name: 0 for name in enc.adapters}

    def hook(name):
        def fn(*_):
            calls[name] += 1

        return fn

    for name, adapter in enc.adapters.items():
        adapter.backbone.register_forward_hook(hook(name))
    return calls


def test_feature_cache_second_epoch_skips_backbones(tmp_path) -> None:
    torch.manual_seed(0)
    enc = _encoder(frozen=True).eval()
    calls = _count_backbone_calls(enc)
    epoch = [_batch(seed=s, index=torch.arange(K) + K * s) for s in range(2)]
    reference = [enc(b)[0] for b in epoch]
    assert calls == {"seq": 2, "image": 2}
    enc.enable_cache(tmp_path / "cache", split="train")
    first = [enc(b)[0] for b in epoch]
    assert calls == {"seq": 4, "image": 4}
    second = [enc(b)[0] for b in epoch]
    # seq is fully cached; "image" has an augmented view (slot 1), recomputed every epoch.
    assert calls["seq"] == 4, "second epoch reads sequence features from the cache"
    assert calls["image"] == 6
    for a, b, c in zip(reference, first, second):
        assert torch.allclose(a, b, atol=1e-6) and torch.allclose(a, c, atol=1e-6)
    # Only natural, present views are stored: seq misses one absent sample per batch.
    assert len(enc.caches["seq"]) == 2 * K - 2 and len(enc.caches["image"]) == 2 * K
    written = enc.save_cache()
    assert len(written) == 2 and all(p.is_file() for p in written)

    # A new process (fresh encoder with the same weights) reads the files: no backbone call.
    fresh = MultiViewEncoder({n: a for n, a in enc.adapters.items()})
    fresh.enable_cache(tmp_path / "cache", split="train")
    assert fresh.caches["seq"].key == enc.caches["seq"].key
    before = dict(calls)
    out = fresh(epoch[0])[0]
    assert calls["seq"] == before["seq"]
    assert torch.allclose(out, reference[0], atol=1e-6)


def test_changed_backbone_never_reads_a_stale_cache(tmp_path) -> None:
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config("feature_sequence", finetune={"mode": "frozen"})).eval()
    batch = {"values": torch.randn(3, 12, 6), "lengths": torch.tensor([12, 4, 9])}
    ids = torch.arange(3)
    cache = FeatureCache(tmp_path, adapter, split="train")
    cache.features(ids, batch, lambda inp, rows: adapter.features(inp), 3)
    cache.save()
    key = cache.key
    with torch.no_grad():
        adapter.backbone.input_proj.weight.add_(0.1)  # "fine-tuned" backbone: same architecture, new weights
    assert backbone_fingerprint(adapter) != key
    reopened = FeatureCache(tmp_path, adapter, split="train")
    assert len(reopened) == 0, "a changed key must not load the old file"
    computed = []
    out = reopened.features(ids, batch, lambda inp, rows: computed.append(1) or adapter.features(inp), 3)
    assert computed == [1] and torch.allclose(out, adapter.features(batch))
    # Preprocessing is part of the key too.
    other = build_adapter(tiny_config("feature_sequence", pooling="max", finetune={"mode": "frozen"}))
    other.load_state_dict(adapter.state_dict())
    assert backbone_fingerprint(other) != backbone_fingerprint(adapter)


def test_fill_cache_then_training_epoch_makes_no_sequence_backbone_call(tmp_path) -> None:
    torch.manual_seed(0)
    enc = _encoder(frozen=True)
    split = [_batch(seed=s, index=torch.arange(K) + K * s) for s in range(2)]
    with pytest.raises(ValueError, match="enable_cache"):
        enc.fill_cache(split)
    enc.enable_cache(tmp_path, split="train")
    counts = enc.fill_cache(split, progress=False)
    assert counts["seq"] == 2 * K - 2
    assert enc.training, "fill_cache restores the training mode"
    calls = _count_backbone_calls(enc)
    z, mask = enc(split[1])
    (z[mask] ** 3).sum().backward()  # the heads still train on cached features
    assert calls["seq"] == 0
    assert all(p.grad is not None for p in enc.adapters["seq"].head.parameters())


def test_cache_refuses_trainable_backbone(tmp_path) -> None:
    enc = _encoder(frozen=False)
    with pytest.raises(ValueError, match="not frozen"):
        enc.enable_cache(tmp_path, modalities=["seq"])
    assert enc.enable_cache(tmp_path) == {}


def test_absent_views_do_not_reach_the_head_batchnorm() -> None:
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config("feature_sequence", dropout=0.0)).train()
    x = {"values": torch.randn(4, 12, 6), "lengths": torch.tensor([12, 0, 5, 0])}
    present = torch.tensor([True, False, True, False])
    bn = next(m for m in adapter.head.modules() if isinstance(m, torch.nn.BatchNorm1d))
    z = adapter(x, present)
    assert torch.all(z[~present] == 0) and torch.allclose(z[present].norm(dim=-1), torch.ones(2), atol=1e-5)
    stats_with_absent = bn.running_mean.clone()
    torch.manual_seed(0)
    only = build_adapter(tiny_config("feature_sequence", dropout=0.0)).train()
    only({k: v[present] for k, v in x.items()})
    bn_only = next(m for m in only.head.modules() if isinstance(m, torch.nn.BatchNorm1d))
    assert torch.allclose(stats_with_absent, bn_only.running_mean, atol=1e-6)


def test_host_preparation_checks_then_preprocesses_each_modality_once_in_view_order() -> None:
    """Each modality with inputs: its check with its own presence mask (stacked order), then its
    preprocessor's result in place of its inputs; modalities without a check or a preprocessor
    pass through; the batch is marked checked."""
    from mmviews.modalities.multiview import HostBatchPreparation

    calls: list[tuple[str, str, list[bool]]] = []

    def check(name: str):
        return lambda inputs, present: calls.append(("check", name, present.tolist()))

    def tagged(inputs: dict) -> dict:
        calls.append(("preprocess", "seq", []))
        return {**inputs, "tagged": True}

    prepare = HostBatchPreparation({"image": check("image"), "seq": check("seq")}, {"seq": tagged})
    batch = _batch()
    images = batch.inputs["image"]
    out = prepare(batch)
    # image first (its view comes first), once although it has two views; mask [K, 2] stacked sample-major
    assert calls == [("check", "image", [True] * 8), ("check", "seq", [True, True, False, True]),
                     ("preprocess", "seq", [])]
    assert out.inputs_checked and out.inputs["seq"]["tagged"] is True and out.inputs["image"] is images
    calls.clear()
    assert HostBatchPreparation({})(_batch()).inputs_checked and calls == []


def test_host_preparation_skips_absent_inputs_and_frames_for_device_flow() -> None:
    """A modality with views but no inputs is left to the encoder's forward (which names it);
    frames for flow on the device are RAFT's, made in the step: neither is checked, and the
    modalities after them still are."""
    from mmviews.modalities.multiview import HostBatchPreparation

    seen: list[str] = []
    prepare = HostBatchPreparation({m: (lambda inputs, present, m=m: seen.append(m)) for m in ("image", "seq")})
    batch = _batch()
    del batch.inputs["image"]
    assert prepare(batch).inputs_checked and seen == ["seq"]
    seen.clear()
    batch = _batch()
    frames = {"frames": torch.rand(K * 2, 2, 3, 32, 32)}
    batch.inputs["image"] = frames
    assert prepare(batch).inputs["image"] is frames and seen == ["seq"]


def test_host_preparation_names_the_modality_of_a_failed_check_or_preprocessor() -> None:
    from mmviews.modalities.multiview import HostBatchPreparation

    def refuse(*args: object) -> None:
        raise ValueError("values must be finite")

    for prepare in (HostBatchPreparation({"seq": refuse}), HostBatchPreparation({}, {"seq": refuse})):
        with pytest.raises(ValueError) as raised:
            prepare(_batch())
        assert str(raised.value) == "modality 'seq': values must be finite"
        assert raised.value.__cause__ is None and raised.value.__suppress_context__
    # the encoder's own: an adapter's check of input values (a NaN pixel)
    with pytest.raises(ValueError, match=r"^modality 'image': "):
        batch = _batch()
        batch.inputs["image"]["values"][0, 0, 0, 0] = float("nan")
        _encoder().host_preparation()(batch)


def test_flow_from_frames_hands_a_batch_with_frames_to_the_device_flow() -> None:
    """No frames: the same batch, no device flow needed. Frames without a device flow: refused,
    naming the modalities. With one: the batch it converts is the one given, its result returned."""
    from types import SimpleNamespace

    encoder = _encoder()
    plain = _batch()
    assert encoder.flow_from_frames(plain) is plain
    batch = _batch()
    batch.inputs["image"] = {"frames": torch.rand(K * 2, 2, 3, 32, 32)}
    with pytest.raises(ValueError, match=r"^modalities \['image'\] carry frames for flow computed on the device"):
        encoder.flow_from_frames(batch)
    given: list[ViewBatch] = []
    converted = _batch(seed=1)
    encoder.device_flow = SimpleNamespace(convert=lambda b: (given.append(b), converted)[1])
    assert encoder.flow_from_frames(batch) is converted and given == [batch] and given[0] is batch


def test_push_to_hub_uploads_what_save_pretrained_writes_with_the_card_in_one_commit(monkeypatch, tmp_path) -> None:
    """huggingface_hub's own upload path (HfApi.create_repo, HfApi.upload_folder), its two network
    calls answered here: the repository made if needed, then one commit of the saved folder, with
    ``model_card`` as its README.md; the temporary folder is gone after."""
    import json
    from pathlib import Path

    from huggingface_hub import HfApi

    calls: list[tuple[str, dict]] = []
    uploaded: dict[str, str] = {}

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", {"token": self.token, "repo_id": repo_id, **kwargs}))

    def upload_folder(self, **kwargs):
        calls.append(("upload_folder", {"token": self.token, **kwargs}))
        folder = Path(kwargs["folder_path"])
        uploaded.update({str(p.relative_to(folder)): p.read_text() for p in folder.glob("*") if p.is_file()})
        return "commit-info"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    enc = _encoder()
    enc.objective_info = {"name": "mv_dhel", "temperature": 0.25}
    result = enc.push_to_hub("someone/tiny", model_card="# card\n", commit_message="first", private=True,
                             token="tok", revision="dev")
    assert result == "commit-info"
    folder = calls[1][1]["folder_path"]
    assert calls == [
        ("create_repo", {"token": "tok", "repo_id": "someone/tiny", "repo_type": "model", "private": True,
                         "exist_ok": True}),
        ("upload_folder", {"token": "tok", "repo_id": "someone/tiny", "folder_path": folder, "repo_type": "model",
                           "commit_message": "first", "revision": "dev"}),
    ]
    assert uploaded["README.md"] == "# card\n"
    assert json.loads(uploaded["encoder.json"]) == {"modalities": ["seq", "image"],
                                                    "objective": {"name": "mv_dhel", "temperature": 0.25}}
    assert not Path(folder).exists() and Path(folder).name.startswith("mmviews-push-")
    calls.clear()
    uploaded.clear()
    assert enc.push_to_hub("someone/tiny") == "commit-info"  # the defaults: no card, a commit message of its own
    assert calls[0][1] == {"token": None, "repo_id": "someone/tiny", "repo_type": "model", "private": None,
                           "exist_ok": True}
    assert calls[1][1]["commit_message"] == "Upload mmviews encoder" and calls[1][1]["revision"] is None
    assert "README.md" not in uploaded and "encoder.json" in uploaded


def test_from_config_takes_both_forms_and_fills_the_embed_dim_only_where_missing() -> None:
    """``{"embed_dim", "modalities"}`` or the modalities directly; a top-level embed_dim fills the
    adapters that set none; an AdapterConfig is built as it is; config_dict gives back the first
    form, which builds the same encoder."""

    image = tiny_config("small_cnn")
    del image["embed_dim"]
    enc = MultiViewEncoder.from_config({"embed_dim": 12, "modalities": {"image": image}})
    assert enc.embed_dim == 12 and enc.adapters["image"].config.embed_dim == 12
    direct = MultiViewEncoder.from_config({"image": tiny_config("small_cnn", embed_dim=6)})
    assert list(direct.adapters) == ["image"] and direct.embed_dim == 6
    resolved = build_adapter(tiny_config("small_cnn", embed_dim=6)).config  # an AdapterConfig of its type
    assert MultiViewEncoder.from_config({"embed_dim": 12, "modalities": {"image": resolved}}).embed_dim == 6
    with pytest.raises(ValueError, match="all adapters must share embed_dim"):  # its own embed_dim is kept
        MultiViewEncoder.from_config({"embed_dim": 12, "modalities": {"image": image, "seq": tiny_config("feature_sequence")}})
    config = enc.config_dict()
    assert config == {"embed_dim": 12, "modalities": {"image": enc.adapters["image"].config.to_dict()}}
    again = MultiViewEncoder.from_config(config)
    assert again.config_dict() == config


@pytest.mark.parametrize(("config", "message"), [
    ({"embed_dim": 8, "modalities": {"image": tiny_config("small_cnn")}, "heads": 2},
     "unknown encoder config key(s) ['heads']; allowed: embed_dim, modalities"),
    ({"embed_dim": 8, "modalities": {}}, "encoder config needs a non-empty mapping modality -> adapter config"),
    ({"embed_dim": 8}, "encoder config needs a non-empty mapping modality -> adapter config"),
    ({"modalities": ["image"]}, "encoder config needs a non-empty mapping modality -> adapter config"),
    ({"modalities": {"image": "small_cnn"}}, "encoder config for modality 'image' must be a dict, got 'small_cnn'"),
])
def test_a_malformed_encoder_config_is_named(config, message) -> None:
    with pytest.raises(ValueError) as raised:
        MultiViewEncoder.from_config(config)
    assert str(raised.value) == message


def test_encode_modality_embeds_one_modalitys_inputs_or_names_the_missing_adapter() -> None:
    torch.manual_seed(0)
    enc = _encoder().eval()
    images = torch.rand(3, 3, 32, 32)
    present = torch.tensor([True, False, True])
    z = enc.encode_modality("image", {"values": images}, present)
    assert torch.equal(z, enc.adapters["image"]({"values": images}, present))
    assert z.shape == (3, 16)
    with pytest.raises(KeyError) as raised:
        enc.encode_modality("text", {"text": ["a"]})
    assert raised.value.args[0] == "no adapter for modality 'text'; have ['image', 'seq']"


def test_disable_cache_forgets_the_caches(tmp_path) -> None:
    enc = _encoder(frozen=True)
    caches = enc.enable_cache(tmp_path / "cache")
    assert sorted(caches) == ["image", "seq"] and enc.caches == caches
    enc.disable_cache()
    assert enc.caches == {}
    with pytest.raises(ValueError, match="call enable_cache"):
        enc.fill_cache([])


def test_caches_are_named_by_modality_and_split_and_filled_with_a_progress_bar(tmp_path, capsys) -> None:
    """One cache per frozen modality, its file named by modality and split (``train`` unless
    given); fill_cache runs the split once in eval mode under a progress bar (none when asked),
    needs dataset indices, and leaves the encoder in the mode it was in."""
    enc = _encoder(frozen=True).train()
    caches = enc.enable_cache(tmp_path)
    assert {name: (c.name, c.split) for name, c in caches.items()} == {"seq": ("seq", "train"), "image": ("image", "train")}
    assert caches["image"].path.name.startswith("image-train-")
    valid = enc.enable_cache(tmp_path, split="valid", modalities=["image"])
    assert list(valid) == ["image"] and valid["image"].split == "valid" and valid["image"].path.name.startswith("image-valid-")
    enc.enable_cache(tmp_path)
    with pytest.raises(ValueError) as raised:
        enc.fill_cache([_batch()], progress=False)
    assert str(raised.value) == "fill_cache: batches need 'index' (dataset indices) to key the cache"
    assert enc.training  # put back after the failed pass too
    capsys.readouterr()
    rows = enc.fill_cache([_batch(index=torch.arange(K))])
    assert rows == {"seq": 3, "image": 4} and enc.training  # natural views only; sample 2 has no sequence view
    assert "caching backbone features" in capsys.readouterr().err
    enc.enable_cache(tmp_path / "again")
    enc.fill_cache([_batch(index=torch.arange(K))], progress=False)
    assert "caching backbone features" not in capsys.readouterr().err
    enc.disable_cache()
    with pytest.raises(ValueError) as raised:
        enc.fill_cache([])
    assert str(raised.value) == "fill_cache: call enable_cache(directory, split) first"


def test_param_groups_are_the_adapters_prefixed_by_modality_without_decay_by_default() -> None:
    enc = _encoder()
    groups = {g["name"]: g for g in enc.param_groups(1e-4, 1e-3)}
    assert {"seq.backbone", "seq.head", "image.backbone", "image.head"} <= set(groups)
    assert all(g["weight_decay"] == 0.0 for g in groups.values())
    assert groups["image.backbone"]["lr"] == 1e-4 and groups["image.head"]["lr"] == 1e-3
    decayed = {g["name"]: g for g in enc.param_groups(1e-4, 1e-3, 0.05)}
    assert decayed["image.head"]["weight_decay"] == 0.05 and decayed["seq.backbone"]["weight_decay"] == 0.05


def test_host_preparation_holds_every_adapters_check_and_the_text_tokenizer() -> None:
    enc = MultiViewEncoder.from_config({"embed_dim": 16, "modalities": {"text": tiny_config("text"),
                                                                        "image": tiny_config("small_cnn")}})
    prepare = enc.host_preparation()
    assert sorted(prepare.checks) == ["image", "text"] and list(prepare.preprocessors) == ["text"]
    assert enc.input_check().preprocessors == {}


def test_forward_refuses_a_malformed_batch_naming_what_is_wrong() -> None:
    enc = _encoder()
    batch = _batch()
    batch.mask = torch.ones(K, 2, dtype=torch.bool)
    with pytest.raises(ValueError) as raised:
        enc(batch)
    assert str(raised.value) == "batch.mask has shape (4, 2), expected [K, M] with M=3 views"
    batch = _batch()
    del batch.inputs["seq"]
    with pytest.raises(KeyError) as raised:
        enc(batch)
    assert raised.value.args[0] == "batch.inputs has no entry for modality 'seq'"
    batch = _batch()
    batch.inputs["image"]["values"][0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError) as raised:
        enc(batch)
    assert str(raised.value).startswith("modality 'image': ") and isinstance(raised.value.__cause__, ValueError)
    assert str(raised.value) == f"modality 'image': {raised.value.__cause__}"
    one = ViewBatch(inputs={"image": {"values": torch.rand(K, 3, 32, 32)}}, views=[ViewInfo("image_0", "image", 0)],
                    mask=torch.ones(K, 1, dtype=torch.bool))
    z, mask = enc(one)  # one view is a batch too (evaluation embeds one view per modality)
    assert z.shape == (K, 1, 16) and mask.all()


def test_a_batch_checked_on_the_host_is_not_checked_again() -> None:
    """``inputs_checked`` (the trainer's host preparation ran): the adapters skip their own check
    of input values, so a value it would refuse gets through; unmarked, it is refused."""
    enc = _encoder().eval()
    batch = _batch()
    batch.inputs["image"]["values"][0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^modality 'image': "):
        enc(batch)
    batch.inputs_checked = True
    z, _ = enc(batch)  # not refused: the NaN reaches the embedding of sample 0's image view
    assert z.shape == (K, 3, 16) and torch.isnan(z[0, 2]).any() and not torch.isnan(z[1:]).any()
