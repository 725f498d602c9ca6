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


# --- the shared content, judged against the definition (not the dataset's own fields) ----------

import math  # noqa: E402
import statistics  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mmviews.data import synthetic  # noqa: E402

PLACES = ["kitchen", "garden", "office", "harbour", "village", "station", "mountain", "island"]  # eighths of u
COLOURS = ["crimson", "orange", "golden", "olive", "emerald", "teal", "navy", "violet"]  # eighths of v


def _decoded_text(text: str) -> tuple[int, int]:
    """The eighths of u and v a text says: the word after "in the", and the one colour word."""
    words = text.split()
    at = [i for i in range(len(words) - 2) if words[i:i + 2] == ["in", "the"] and words[i + 2] in PLACES]
    colours = [w for w in words if w in COLOURS]
    assert len(at) == 1 and len(colours) == 1, text
    return PLACES.index(words[at[0] + 2]), COLOURS.index(colours[0])


def _decoded_pan(flow: torch.Tensor) -> tuple[float, float]:
    """The camera pan's direction (as u: angle / (0.9 * 2 pi)) and speed (as v: (speed - 0.5) / 2)
    from the background's flow: each step's most common flow vector (the square covers at most a
    tenth of the frame), summed over the steps."""
    total = np.zeros(2)
    for step in flow:
        vectors, counts = np.unique(step.reshape(2, -1).T.numpy(), axis=0, return_counts=True)
        total += vectors[counts.argmax()]
    steps = flow.shape[0]
    angle = math.atan2(total[1], total[0]) % (2 * math.pi)
    return angle / (0.9 * 2 * math.pi), (float(np.hypot(*total)) / steps - 0.5) / 2.0


def test_each_sample_has_content_of_its_own_uniform_in_the_unit_square():
    ds = synthetic.SyntheticMultimodal(400, seed=7, modalities=("text",))
    labels = [ds[i]["labels"] for i in range(len(ds))]
    for key in ("content_u", "content_v"):
        values = [row[key] for row in labels]
        assert 0 <= min(values) and max(values) < 1
        # uniform on [0, 1): mean 1/2, std 1/sqrt(12) = 0.289 (400 draws: +-0.03 and +-0.02 at 2 sigma)
        assert abs(statistics.fmean(values) - 0.5) < 0.045, key
        assert abs(statistics.stdev(values) - 12 ** -0.5) < 0.03, key
        assert len(set(values)) == 400
    assert abs(np.corrcoef([r["content_u"] for r in labels], [r["content_v"] for r in labels])[0, 1]) < 0.15


def test_text_says_the_samples_content_place_for_u_and_colour_for_v():
    ds = synthetic.SyntheticMultimodal(300, seed=3, modalities=("text", "image"))
    seen_u, seen_v = set(), set()
    for i in range(len(ds)):
        item = ds[i]
        place, colour = _decoded_text(item["modalities"]["text"])
        assert place == int(8 * item["labels"]["content_u"]), item
        assert colour == int(8 * item["labels"]["content_v"]), item
        seen_u.add(place)
        seen_v.add(colour)
    assert seen_u == seen_v == set(range(8))


def test_the_labels_are_the_content_and_factors_each_modality_renders():
    """Labels against what the modalities show, decoded by the test: the text's words (content,
    class topic words, sentiment level) and the video's camera pan (the content's u and v)."""
    ds = synthetic.SyntheticMultimodal(60, seed=11, num_classes=8)
    topics = synthetic._TOPICS  # the class's words, as data_cards/synthetic.md says (topic words of the class)
    for i in range(len(ds)):
        item = ds[i]
        labels, text = item["labels"], item["modalities"]["text"]
        words = text.split()
        u, v = labels["content_u"], labels["content_v"]
        assert _decoded_text(text) == (int(8 * u), int(8 * v))
        said = {w for k, w in enumerate(words) if w in topics[labels["class"]] and (k == 0 or words[k - 1] != "not")}
        assert said, (labels, text)
        level = min(4, int((labels["sentiment"] + 1) * 2.5))
        grades = [g for g, group in enumerate(synthetic._SENTIMENT) for w in group if w in words]
        negated = any(words[k - 1] == "not" for k, w in enumerate(words)
                      if k and any(w in group for group in synthetic._SENTIMENT))
        assert grades == [4 - level if negated else level], (labels, text)
        pan_u, pan_v = _decoded_pan(item["modalities"]["flow"])
        # rounding to whole pixels: the pan over 5 frames is 2.5-12.5 px, so a few hundredths
        assert abs(pan_u - u) < 0.06 and abs(pan_v - v) < 0.12, (u, v, pan_u, pan_v)


def test_splits_are_disjoint_draws_and_seeds_differ():
    """train, valid and test of one seed (and one split of two seeds) share no sample content;
    each split's draw is that of its own seed (1000 * seed + 0, 1, 2)."""
    contents = {}
    for seed in (0, 1):
        for split in ("train", "valid", "test"):
            ds = build_dataset("synthetic", split=split, num_samples=64, seed=seed, modalities=("text",))
            contents[seed, split] = {(ds[i]["labels"]["content_u"], ds[i]["labels"]["content_v"]) for i in range(64)}
            assert len(contents[seed, split]) == 64
            direct = synthetic.SyntheticMultimodal(64, seed=1000 * seed + {"train": 0, "valid": 1, "test": 2}[split],
                                                   modalities=("text",))
            assert [direct[i]["modalities"]["text"] for i in range(8)] == [ds[i]["modalities"]["text"] for i in range(8)]
    keys = list(contents)
    for a in range(len(keys)):
        for b in range(a + 1, len(keys)):
            assert not contents[keys[a]] & contents[keys[b]], (keys[a], keys[b])
    assert len(build_dataset("synthetic", split="valid")) == 512 and len(build_dataset("synthetic")) == 2048
    assert len(build_dataset("synthetic", split="test")) == 512


@pytest.mark.parametrize("options, message, option", [
    ({"split": "validation"}, "synthetic: unknown split 'validation'; choose from ['test', 'train', 'valid']", "split"),
    ({"num_samples": -1}, "num_samples must be >= 0, got -1", "num_samples"),
    ({"num_classes": 1}, "num_classes must be in [2, 8], got 1", "num_classes"),
    ({"num_classes": 9}, "num_classes must be in [2, 8], got 9", "num_classes"),
    ({"modalities": ("text", "smell")}, "unknown modalities ['smell']; choose from ('text', 'audio', 'image', 'video', 'flow')",
     "modalities"),
    ({"modalities": ()}, "unknown modalities []; choose from ('text', 'audio', 'image', 'video', 'flow')", "modalities"),
    ({"num_frames": 1}, "num_frames must be >= 2 (flow needs two frames)", "num_frames"),
    ({"missing_rate": 1.0}, "missing_rate for 'text' must be in [0, 1), got 1.0", "missing_rate"),
    ({"missing_rate": {"audio": -0.1}}, "missing_rate for 'audio' must be in [0, 1), got -0.1", "missing_rate"),
])
def test_bad_options_name_themselves(options, message, option):
    with pytest.raises(ValueError) as raised:
        build_dataset("synthetic", **options)
    assert str(raised.value) == message and raised.value.option == option


def test_sizes_and_shapes_follow_the_options():
    ds = synthetic.SyntheticMultimodal(3, seed=0, num_classes=2, sample_rate=8000, image_size=20, num_frames=3,
                                       modalities=("flow", "audio", "video", "image"))
    assert ds.modalities == ("audio", "image", "video", "flow") and len(ds) == 3
    assert ds.modality_info() == {"audio": {"kind": "waveform", "shape": (None,), "sample_rate": 8000},
                                  "image": {"kind": "image", "shape": (3, 20, 20)},
                                  "video": {"kind": "video", "shape": (3, 3, 20, 20)},
                                  "flow": {"kind": "flow", "shape": (2, 2, 20, 20)}}
    item = ds[-1]
    assert item["index"] == 2 and set(item["modalities"]) == {"audio", "image", "video", "flow"}
    m = item["modalities"]
    assert m["image"].shape == (3, 20, 20) and m["video"].shape == (3, 3, 20, 20) and m["flow"].shape == (2, 2, 20, 20)
    assert 0.4 * 8000 <= m["audio"].shape[0] <= 0.6 * 8000
    assert set(ds.classes.tolist()) <= {0, 1}
    assert m["audio"].dtype == m["image"].dtype == m["video"].dtype == m["flow"].dtype == torch.float32
    for bad in (3, -4):
        with pytest.raises(IndexError, match=f"index {bad} out of range for 3 samples"):
            ds[bad]
    assert len(synthetic.SyntheticMultimodal(0)) == 0


def test_a_missing_video_takes_its_flow_and_the_other_modalities_keep_their_draws():
    full = synthetic.SyntheticMultimodal(200, seed=4)
    some = synthetic.SyntheticMultimodal(200, seed=4, missing_rate={"video": 0.5, "text": 0.3})
    assert (some.present[:, 4] <= some.present[:, 3]).all() and not some.present[:, 3].all()
    assert not some.present[:, 0].all() and some.present[:, 1:3].all()
    for i in range(20):
        a, b = full[i]["modalities"], some[i]["modalities"]
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["audio"], b["audio"])
        if b["video"] is not None:
            assert torch.equal(a["video"], b["video"]) and torch.equal(a["flow"], b["flow"])
        else:
            assert b["flow"] is None
    # a sample left with nothing is given one modality back; a flow given back brings its video
    flow_only = synthetic.SyntheticMultimodal(200, seed=1, modalities=("video", "flow"), missing_rate=0.9)
    assert flow_only.present.any(axis=1).all() and (flow_only.present[:, 1] <= flow_only.present[:, 0]).all()
    assert flow_only.present[:, 1].sum() > 0
    nothing_lost = synthetic.SyntheticMultimodal(50, seed=2, modalities=("text", "image"), missing_rate=0.9)
    assert nothing_lost.present.any(axis=1).all()


def test_vocabulary_file_and_special_tokens(tmp_path):
    words = synthetic.synthetic_vocabulary(False)
    assert words == sorted(words) and "not" in words and set(PLACES + COLOURS) <= set(words)
    with_special = synthetic.synthetic_vocabulary()
    assert with_special[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and with_special[5:] == words
    path = synthetic.write_vocabulary(tmp_path / "vocab.txt")
    assert path.read_text() == "\n".join(with_special) + "\n" and not list(tmp_path.glob("*.tmp"))


# Recorded from this implementation (seed 5, samples 0-2; numpy's PCG64 Generator): the data the
# data card's numbers were measured on. A change to any generator changes them; if numpy changes
# one of its Generator's methods, record them again and say so in data_cards/synthetic.md.
RECORDED = [
    ("soup of it pizza thing some honestly golden in the garden not nice not coach",
     (8776, 1.8374207816295893, 1122.3342284373439, 670.6981709407119, 349.5945870653138, 8680.356174703396, 8535.0, 8535.0)),
    ("museum dreadful they not soup had in the island is crimson it well still but",
     (9224, -4.5208687135655055, 1416.289941253448, 1709.3140204534866, 1216.592450608384, 9441.619199651992, 1753.0, 5525.0)),
    ("orange not pleasant think got not train in the office race after team again and we before",
     (8946, -1.0595644090399219, 987.9701148042341, 1367.0108409395907, 900.1628289899954, 9252.065101946471, 3153.0, 5201.0)),
]


def test_the_recorded_draws_are_reproduced():
    ds = synthetic.SyntheticMultimodal(3, seed=5)
    for i, (text, numbers) in enumerate(RECORDED):
        m = ds[i]["modalities"]
        a, img, vid, flow = (m[k].double() for k in ("audio", "image", "video", "flow"))
        got = (a.shape[0], float(a.sum()), float(a.abs().sum()), float(img.sum()), float((img ** 2).sum()),
               float(vid.sum()), float(flow.sum()), float(flow.abs().sum()))
        assert m["text"] == text
        assert got == pytest.approx(numbers, rel=1e-6, abs=1e-4), i


def test_content_guards_fail_when_every_sample_shares_one_content(monkeypatch):
    from mutations import apply_break

    apply_break("synthetic_shared_content", monkeypatch.setattr)
    for guard in (test_each_sample_has_content_of_its_own_uniform_in_the_unit_square,
                  test_splits_are_disjoint_draws_and_seeds_differ):
        with pytest.raises(AssertionError):
            guard()
