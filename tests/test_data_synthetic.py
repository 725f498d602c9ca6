"""The embedded synthetic dataset: determinism, shapes, missing modalities, flow, DataLoader."""

import torch
from torch.utils.data import DataLoader

from mmviews.data import SyntheticMultimodal, ViewSetCollator, ViewSpec, build_dataset, list_datasets, synthetic_vocabulary


def test_deterministic_by_seed_and_shapes():
    a, b, c = SyntheticMultimodal(8, seed=1), SyntheticMultimodal(8, seed=1), SyntheticMultimodal(8, seed=2)
    x, y, z = a[3], b[3], c[3]
    for m in ("audio", "image", "video", "flow"):
        assert torch.equal(x["modalities"][m], y["modalities"][m])
    assert x["modalities"]["text"] == y["modalities"]["text"]
    assert not torch.equal(x["modalities"]["image"], z["modalities"]["image"])
    m = x["modalities"]
    assert m["image"].shape == (3, 32, 32) and 0 <= m["image"].min() and m["image"].max() <= 1
    assert m["video"].shape == (6, 3, 32, 32) and m["flow"].shape == (5, 2, 32, 32)
    assert m["audio"].ndim == 1 and 0.4 * 16000 <= m["audio"].shape[0] <= 0.6 * 16000
    assert -1 <= x["labels"]["sentiment"] <= 1 and 0 <= x["labels"]["class"] < 4


def test_flow_matches_motion():
    ds = SyntheticMultimodal(4, seed=0)
    for i in range(4):
        v, f = ds[i]["modalities"]["video"], ds[i]["modalities"]["flow"]
        S = v.shape[-1]
        # Warp frame t+1 back with the flow: where the target stays in the frame, the pixel
        # must reappear there (up to the noise), except where the moving square covers it.
        for t in range(f.shape[0]):
            ys, xs = torch.meshgrid(torch.arange(S), torch.arange(S), indexing="ij")
            ty, tx = ys + f[t, 1].long(), xs + f[t, 0].long()
            ok = (ty >= 0) & (ty < S) & (tx >= 0) & (tx < S)
            diff = (v[t][:, ys[ok], xs[ok]] - v[t + 1][:, ty[ok], tx[ok]]).abs().amax(dim=0)
            assert (diff < 0.2).float().mean() > 0.85
            # and a wrong flow (zero) would not explain frame t+1 as well unless nothing moved
            if f[t].abs().sum() > 0:
                zero = (v[t] - v[t + 1]).abs().amax(dim=0)
                assert (zero < 0.2).float().mean() < (diff < 0.2).float().mean()


def test_missing_rate_marks_absent_and_collator_mask():
    ds = SyntheticMultimodal(400, seed=0, missing_rate=0.3)
    pres = ds.present  # [K, 5] presence drawn from the seed, in MODALITIES order
    assert 0.2 < 1 - pres[:, :4].mean() < 0.4
    assert pres.any(axis=1).all()  # never a sample with nothing
    assert not (pres[:, 4] & ~pres[:, 3]).any()  # flow only with its video
    for i in range(20):  # the items agree with it
        got = [ds[i]["modalities"][m] is not None for m in ("text", "audio", "image", "video", "flow")]
        assert got == pres[i].tolist()
    spec = ViewSpec.from_config([{"modality": "audio", "copies": 2}, "image"])
    b = ViewSetCollator.for_dataset(ds, spec)([ds[i] for i in range(20)])
    assert torch.equal(b.mask[:, 0], torch.tensor(pres[:20, 1])) and torch.equal(b.mask[:, 2], torch.tensor(pres[:20, 2]))
    assert (b.inputs["audio"]["lengths"].view(20, 2)[~b.mask[:, 0]] == 0).all()


def test_vocabulary_covers_text():
    vocab = set(synthetic_vocabulary())
    ds = SyntheticMultimodal(50, seed=3, modalities=("text",))
    assert all(w in vocab for i in range(50) for w in ds[i]["modalities"]["text"].split())
    assert list(ds[0]["modalities"]) == ["text"]


def test_registry_and_dataloader_with_workers():
    assert {"synthetic", "mosi", "mosei", "sims", "ucf101", "hmdb51", "hf"} <= set(list_datasets())
    tr, te = build_dataset("synthetic", split="train", num_samples=16), build_dataset("synthetic", split="test", num_samples=16)
    assert not torch.equal(tr[0]["modalities"]["image"], te[0]["modalities"]["image"])
    spec = ViewSpec.from_config([{"modality": "text", "copies": 2, "augment": "text_default"},
                                 {"modality": "image", "copies": 2, "augment": "simclr"}, "flow"])
    collate = ViewSetCollator.for_dataset(tr, spec, seed=0)
    batches = list(DataLoader(tr, batch_size=8, collate_fn=collate, num_workers=2))
    inproc = [collate([tr[i] for i in range(k, k + 8)]) for k in (0, 8)]
    for b, c in zip(batches, inproc):  # same views whatever process made them
        assert torch.equal(b.inputs["image"]["values"], c.inputs["image"]["values"])
        assert b.inputs["text"]["text"] == c.inputs["text"]["text"]
    assert batches[0].inputs["flow"]["values"].shape == (8, 5, 2, 32, 32)
