"""Augmentations: determinism by seed, flow flip sign, consistent video/flow crops, colour views."""

import pytest
import torch

from mmviews.data import ViewSetCollator, ViewSpec, get_augmentation, list_augmentations
from mmviews.data.augment import flip_flow, rgb_to_lab


def g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("name,value", [
    ("simclr", torch.rand(3, 24, 24)),
    ("audio_default", torch.randn(4000)),
    ("spec_augment", torch.rand(40, 100)),
    ("text_default", "one two three four five six seven eight nine ten"),
    ("video_default", torch.rand(6, 3, 16, 16)),
    ("flow_default", torch.randn(5, 2, 16, 16)),
    ("sequence_default", torch.randn(30, 8)),
])
def test_same_seed_same_view_other_seed_other_view(name, value):
    aug = get_augmentation(name)
    a, b = aug(value, g(1)), aug(value, g(1))
    outs = [aug(value, g(s)) for s in range(2, 8)]
    if isinstance(value, str):
        assert a == b and any(o != a for o in outs)
    else:
        assert torch.equal(a, b)
        assert any(o.shape != a.shape or not torch.equal(o, a) for o in outs)


def test_registry_lists_names_and_rejects_unknown():
    names = list_augmentations()
    assert {"simclr", "lab_l", "lab_ab", "ydbdr_y", "ydbdr_dbdr", "audio_noise", "token_mask", "flow_default"} <= set(names)
    with pytest.raises(ValueError, match="unknown augmentation"):
        get_augmentation("nope")
    with pytest.raises(ValueError, match="bad parameters"):
        get_augmentation("simclr", strenght=1.0)


def test_flow_flip_negates_u_and_mirrors():
    f = torch.zeros(1, 2, 4, 4)
    f[0, 0, 1, 0] = 3.0  # u = +3 at column 0
    f[0, 1, 1, 0] = -2.0
    y = flip_flow(f)
    assert y[0, 0, 1, 3] == -3.0 and y[0, 1, 1, 3] == -2.0 and y[0, :, 1, 0].abs().sum() == 0
    # flow_default with flip_p=1 and a full crop is exactly that flip
    aug = get_augmentation("flow_default", flip_p=1.0, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    assert torch.allclose(aug(f, g(0)), y)


def test_video_and_flow_share_crop_with_seed_group():
    T, S = 4, 16
    # A horizontal ramp video and a flow equal to the column index: a flip/crop is visible in both.
    cols = torch.arange(S, dtype=torch.float32).view(1, 1, 1, S).expand(T, 3, S, S) / S
    video = cols.clone()
    flow = torch.stack([torch.ones(T - 1, S, S), torch.zeros(T - 1, S, S)], dim=1)
    params = {"seed_group": "clip", "scale": (0.5, 0.5), "ratio": (1.0, 1.0), "flip_p": 0.5}
    spec = ViewSpec.from_config([{"modality": "video", "augment": "video_default", "params": params},
                                 {"modality": "flow", "augment": "flow_default", "params": params}])
    col = ViewSetCollator(spec, seed=0)
    flips = set()
    for i in range(12):
        b = col([{"index": i, "modalities": {"video": video, "flow": flow}, "labels": {}}])
        v, f = b.inputs["video"]["values"][0], b.inputs["flow"]["values"][0]
        flipped_video = bool(v[0, 0, 0, 0] > v[0, 0, 0, -1])
        flipped_flow = bool(f[0, 0].mean() < 0)
        assert flipped_video == flipped_flow
        # a crop of half the area zooms by sqrt(2): u scales with it
        assert torch.allclose(f[0, 0].abs(), torch.full((S, S), S / round(S * 0.5 ** 0.5)), atol=1e-5)
        flips.add(flipped_video)
    assert flips == {True, False}


def test_colour_views():
    white = torch.ones(3, 2, 2)
    lab = rgb_to_lab(white)
    assert torch.allclose(lab[0], torch.full((2, 2), 100.0), atol=0.1) and lab[1:].abs().max() < 0.5
    red = torch.zeros(3, 2, 2)
    red[0] = 1
    lab_red = rgb_to_lab(red)  # reference sRGB red: L 53.2, a 80.1, b 67.2
    assert torch.allclose(lab_red[:, 0, 0], torch.tensor([53.24, 80.09, 67.20]), atol=0.6)
    img = torch.rand(3, 8, 8)
    assert get_augmentation("lab_l")(img, g(0)).shape == (1, 8, 8)
    assert get_augmentation("lab_ab")(img, g(0)).shape == (2, 8, 8)
    assert get_augmentation("lab_l", channels=3)(img, g(0)).shape == (3, 8, 8)
    y = get_augmentation("ydbdr_y")(img, g(0))
    assert torch.allclose(y[0], 0.299 * img[0] + 0.587 * img[1] + 0.114 * img[2], atol=1e-6)



def test_colour_views_with_cmc_crop_and_flip():
    # A horizontal ramp: a crop keeps the ramp's direction, a flip reverses it.
    ramp = torch.linspace(0.0, 1.0, 16).expand(3, 16, 16).clone()
    plain = get_augmentation("lab_l")(ramp, g(0))
    cropped = get_augmentation("lab_l", crop_scale=(0.2, 0.5))
    out = cropped(ramp, g(0))
    assert out.shape == plain.shape == (1, 16, 16)
    assert torch.equal(out, cropped(ramp, g(0)))  # same generator seed, same crop
    assert not torch.equal(out, cropped(ramp, g(1)))  # another seed, another crop
    assert not torch.allclose(out, plain)  # a crop of at most half the area changes the image
    assert (out[0, :, -1] >= out[0, :, 0]).all()  # still increasing left to right
    flipped = get_augmentation("rgb", flip_p=1.0)(ramp, g(0))
    assert torch.equal(flipped, ramp.flip(-1))
    with pytest.raises(ValueError, match="crop_scale"):
        get_augmentation("lab_ab", crop_scale=(0.5, 1.5))
    with pytest.raises(ValueError, match="flip_p"):
        get_augmentation("rgb", flip_p=2.0)

def test_audio_noise_snr_and_speed_length():
    x = torch.sin(torch.linspace(0, 200, 16000))
    noisy = get_augmentation("audio_noise", min_snr_db=10.0, max_snr_db=10.0)(x, g(0))
    snr = 10 * torch.log10(x.pow(2).sum() / (noisy - x).pow(2).sum())
    assert abs(float(snr) - 10.0) < 0.3
    speed = get_augmentation("audio_speed", factors=(0.5,))
    assert abs(speed(x, g(0)).shape[0] - 32000) <= 2  # half speed = twice as long


def test_text_token_dict_keeps_special_tokens():
    ids = {"input_ids": torch.tensor([101, 5, 6, 7, 8, 9, 102]), "attention_mask": torch.ones(7, dtype=torch.long)}
    out = get_augmentation("text_default", mask_p=0.5, delete_p=0.3)(ids, g(0))
    assert out["input_ids"][0] == 101 and out["input_ids"][-1] == 102
    assert out["attention_mask"].shape == out["input_ids"].shape
