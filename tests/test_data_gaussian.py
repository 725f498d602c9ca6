"""The ``gaussian_latents`` dataset of the poly-view synthetic 1-D Gaussian setting."""

from __future__ import annotations

import pytest
import torch

from mmviews.data import GaussianLatents, ViewSetCollator, ViewSpec, build_dataset


def test_items_hold_the_latent_as_a_one_step_sequence():
    ds = build_dataset("gaussian_latents", split="train", num_samples=5, sigma0=2.0, seed=3)
    assert isinstance(ds, GaussianLatents) and len(ds) == 5
    item = ds[4]
    assert item["index"] == 4 and item["modalities"]["x"].shape == (1, 1)
    assert item["labels"]["latent"] == pytest.approx(float(item["modalities"]["x"][0, 0]))
    assert ds.modality_info() == {"x": {"kind": "sequence", "shape": (1, 1)}}


def test_seeds_and_splits_give_different_draws_of_n0_sigma0():
    a = build_dataset("gaussian_latents", split="train", num_samples=20000, sigma0=2.0, seed=0).latents
    assert torch.equal(a, build_dataset("gaussian_latents", split="train", num_samples=20000, sigma0=2.0).latents)
    assert abs(float(a.mean())) < 0.05 and float(a.std()) == pytest.approx(2.0, rel=0.03)
    others = [build_dataset("gaussian_latents", split="valid", num_samples=20000, sigma0=2.0).latents,
              build_dataset("gaussian_latents", split="train", num_samples=20000, sigma0=2.0, seed=1).latents]
    assert all(not torch.equal(a, b) for b in others)
    assert len(build_dataset("gaussian_latents", split="test")) == 4096
    assert len(build_dataset("gaussian_latents")) == 65536


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        build_dataset("gaussian_latents", split="dev")
    with pytest.raises(ValueError, match="sigma0 > 0"):
        GaussianLatents(4, sigma0=0.0)
    with pytest.raises(ValueError, match="num_samples >= 1"):
        GaussianLatents(0)


def test_seq_noise_views_are_noisy_copies_of_the_latent():
    ds = build_dataset("gaussian_latents", num_samples=64, seed=0)
    spec = ViewSpec.from_config([{"modality": "x", "copies": 4, "augment": "seq_noise", "params": {"std": 0.1}}])
    batch = ViewSetCollator.for_dataset(ds, spec, seed=0)([ds[i] for i in range(64)])
    values = batch.inputs["x"]["values"].reshape(64, 4)  # sample-major: [K * V, 1, 1]
    noise = values - ds.latents[:64, None]
    assert 0.05 < float(noise.std()) < 0.15  # one-step sequence: noise std is ``std`` itself
    assert not torch.equal(values[:, 0], values[:, 1])
