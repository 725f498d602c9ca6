"""ViewSpec, ViewSetCollator (layout, mask, lengths, labels) and the batch-size policy."""

import pytest
import torch

from mmviews.data import ViewSetBatchSampler, ViewSetCollator, ViewSpec, batch_size_for


def _sample(i, audio_len=None, text="a b c", image=True):
    return {
        "index": i,
        "modalities": {
            "text": text,
            "audio": None if audio_len is None else torch.full((audio_len,), float(i + 1)),
            "image": torch.full((3, 4, 4), float(i)) if image else None,
        },
        "labels": {"class": i % 2, "sentiment": 0.5 * i},
    }


def test_from_config_names_slots_and_flags():
    spec = ViewSpec.from_config([
        {"modality": "image"},
        {"modality": "image", "copies": 2, "augment": "simclr"},
        "text",
    ])
    assert [v.name for v in spec.views] == ["image_0", "image_aug_0", "image_aug_1", "text_0"]
    assert [v.slot for v in spec.views] == [0, 1, 2, 0]
    assert [v.natural for v in spec.views] == [True, False, False, True]
    assert spec.views[1].augmentation == "simclr"
    assert spec.modalities == ["image", "text"]
    # augmented copies of a modality without a natural view: the names the evaluation gives its views
    only_augmented = ViewSpec.from_config([{"modality": "image", "copies": 2, "augment": "simclr"}, "text"])
    assert [v.name for v in only_augmented.views] == ["image_0", "image_1", "text_0"]
    from mmviews.data.loaders import eval_view_config

    evaluated = ViewSpec.from_config(eval_view_config(only_augmented))
    assert [v.name for v in evaluated.views] == ["image_0", "text_0"]
    with pytest.raises(ValueError, match=r"^views: unknown key 'views\.0\.copise' \(did you mean 'copies'\?\)"):
        ViewSpec.from_config([{"modality": "text", "copise": 2}])
    with pytest.raises(ValueError, match="copies"):
        ViewSpec.from_config([{"modality": "text", "copies": 0}])


def test_collator_mask_layout_lengths_labels():
    # views: audio x2 (natural), image x1, text x1
    spec = ViewSpec.from_config([{"modality": "audio", "copies": 2}, "image", "text"])
    samples = [_sample(0, audio_len=5), _sample(1, audio_len=None), _sample(2, audio_len=3, image=False)]
    b = ViewSetCollator(spec)(samples)
    expected = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(b.mask, expected)
    a = b.inputs["audio"]
    # sample-major: item k*2+v is view v of sample k
    assert a["values"].shape == (6, 5)
    assert a["lengths"].tolist() == [5, 5, 0, 0, 3, 3]
    assert torch.all(a["values"][0] == 1) and torch.all(a["values"][4, :3] == 3)
    assert torch.all(a["values"][2:4] == 0)  # absent: zero-filled, never passed as present
    assert torch.all(a["values"][4, 3:] == 0)  # padding
    assert a["sample_rate"] == 16000
    assert b.inputs["image"]["values"].shape == (3, 3, 4, 4)
    assert torch.all(b.inputs["image"]["values"][2] == 0)
    assert b.inputs["text"]["text"] == ["a b c"] * 3
    assert b.labels["class"].dtype == torch.long and b.labels["class"].tolist() == [0, 1, 0]
    assert torch.allclose(b.labels["sentiment"], torch.tensor([0.0, 0.5, 1.0]))
    assert b.index.tolist() == [0, 1, 2]
    assert b.views_of("audio") == [0, 1]


def test_collator_all_absent_needs_shape_and_uses_hint():
    spec = ViewSpec.from_config(["image", "text"])
    samples = [_sample(0, image=False), _sample(1, image=False)]
    with pytest.raises(ValueError, match="absent from every sample"):
        ViewSetCollator(spec)(samples)
    b = ViewSetCollator(spec, modality_info={"image": {"kind": "image", "shape": (3, 4, 4)}})(samples)
    assert b.inputs["image"]["values"].shape == (2, 3, 4, 4)
    assert not b.mask[:, 0].any() and b.mask[:, 1].all()


def test_collator_missing_modality_key_is_named():
    spec = ViewSpec.from_config(["video"])
    with pytest.raises(KeyError, match="video"):
        ViewSetCollator(spec)([_sample(0)])


def test_augmented_views_differ_and_are_reproducible():
    spec = ViewSpec.from_config([{"modality": "image", "copies": 2, "augment": "simclr", "params": {"blur_p": 0.0}}])
    img = torch.rand(3, 16, 16)
    samples = [{"index": 7, "modalities": {"image": img}, "labels": {}}]
    b1 = ViewSetCollator(spec, seed=3)(samples)
    b2 = ViewSetCollator(spec, seed=3)(samples)
    assert torch.equal(b1.inputs["image"]["values"], b2.inputs["image"]["values"])
    v = b1.inputs["image"]["values"]
    assert not torch.equal(v[0], v[1])
    col = ViewSetCollator(spec, seed=3)
    col.set_epoch(1)
    assert not torch.equal(col(samples).inputs["image"]["values"], v)


def test_batch_policy_growing_vs_fixed():
    assert batch_size_for(2, 64, "growing") == 64
    assert batch_size_for(8, 64, "growing") == 64
    assert batch_size_for(2, 64, "fixed") == 64
    assert batch_size_for(8, 64, "fixed") == 16  # K*M stays 128
    with pytest.raises(ValueError):
        batch_size_for(2, 64, "other")
    s = ViewSetBatchSampler(100, 16, num_views=4, mode="fixed", seed=1)
    batches = list(s)
    assert len(batches) == len(s) == 100 // 8 and all(len(b) == 8 for b in batches)
    assert len({i for b in batches for i in b}) == 96
    s.set_epoch(1)
    assert list(s) != batches
    with pytest.raises(ValueError, match="empty"):
        ViewSetBatchSampler(0, 4, 2)


def test_the_sampler_draws_torchs_permutation_without_a_list_of_every_index():
    """The epoch's order is torch.randperm seeded by seed and epoch, batch after batch (the same
    order as ever: runs and resumes stay bit-identical); it is kept as one int64 tensor, not a
    list of 2^24 Python ints (0.6 GB on the identifiability recipe)."""
    import tracemalloc

    s = ViewSetBatchSampler(10, 4, num_views=2, seed=3, drop_last=False)
    s.set_epoch(2)
    order = torch.randperm(10, generator=torch.Generator().manual_seed(3 * 1_000_003 + 2)).tolist()
    assert list(s) == [order[:4], order[4:8], order[8:]]
    assert list(ViewSetBatchSampler(10, 4, num_views=2, shuffle=False)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    big = ViewSetBatchSampler(2**22, 1024, num_views=2)
    tracemalloc.start()
    try:
        first = next(iter(big))
        python_bytes = tracemalloc.get_traced_memory()[1]  # the peak of Python objects (a tensor's are not)
    finally:
        tracemalloc.stop()
    assert len(first) == 1024 and python_bytes < 2**20  # a list of every index: 150 MB here
