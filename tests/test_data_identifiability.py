"""The ``identifiability`` dataset: the latent blocks have the stated dependence structure
(content the same in every modality, each later modality's style coordinates perturbed at rate
p, modality-specific blocks independent across modalities, Wishart covariances, content-dependent
style), each modality's mixing is invertible (its latents are recovered from the observations of
held-out samples by an inverse written here), and everything is deterministic in (seed, split,
index) with the mixing fixed by the seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmviews.data import ViewSetCollator, ViewSpec, build_dataset
from mmviews.data.identifiability import IdentifiabilityData, generative_process, label_key, modality_names

N = 4096


def _latents(ds: IdentifiabilityData, n: int = N) -> dict[str, np.ndarray]:
    return ds.latents(np.arange(n))


def _observations(ds: IdentifiabilityData, n: int) -> dict[str, np.ndarray]:
    items = ds.__getitems__(list(range(n)))
    return {m: np.stack([it["modalities"][m][0].numpy() for it in items]).astype(np.float64) for m in ds.modalities}


def _inverse(weights: tuple[np.ndarray, ...], x: np.ndarray) -> np.ndarray:
    """Undo linear maps with leaky ReLUs (slope 0.2) between them, in torch float64 (written apart
    from the dataset's own ``unmix``)."""
    h = torch.as_tensor(x, dtype=torch.float64)
    for n, w in reversed(list(enumerate(weights))):
        if n < len(weights) - 1:
            h = torch.where(h > 0, h, h * 5.0)
        h = torch.linalg.solve(torch.as_tensor(w), h.T).T
    return h.numpy()


def test_items_are_one_step_sequences_with_the_latent_blocks_as_labels():
    ds = build_dataset("identifiability", split="valid", num_modalities=3, seed=1)
    assert len(ds) == 4096 and ds.modalities == ("x1", "x2", "x3") == modality_names(3)
    assert ds.modality_info() == {m: {"kind": "sequence", "shape": (1, 15)} for m in ds.modalities}
    item = ds[7]
    assert item["index"] == 7 and item["modalities"]["x2"].shape == (1, 15)
    assert item["modalities"]["x2"].dtype == torch.float32
    assert sorted(item["labels"]) == ["content", "specific_x1", "specific_x2", "specific_x3",
                                      "style_x1", "style_x2", "style_x3"]
    assert all(len(v) == 5 for v in item["labels"].values())
    assert label_key("content", "x2") == "content" and label_key("specific", "x2") == "specific_x2"
    with pytest.raises(ValueError, match="unknown latent block 'shape'"):
        label_key("shape", "x1")
    assert len(build_dataset("identifiability")) == 1 << 24  # the training split: fresh samples for any budget
    assert ds[-1]["index"] == 4095
    with pytest.raises(IndexError):
        ds[4096]


def test_the_collator_stacks_the_blocks_into_label_matrices():
    ds = build_dataset("identifiability", split="test", num_samples=16, specific_dim=3)
    spec = ViewSpec.from_config([{"modality": "x1"}, {"modality": "x2"}])
    batch = ViewSetCollator.for_dataset(ds, spec, seed=0)(ds.__getitems__(list(range(16))))
    assert batch.inputs["x1"]["values"].shape == (16, 1, 13)
    assert batch.labels["content"].shape == (16, 5) and batch.labels["specific_x2"].shape == (16, 3)
    expected = ds.latents(np.arange(16))["specific_x2"]
    np.testing.assert_allclose(batch.labels["specific_x2"].numpy(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layers", [1, 3])
def test_each_mixing_is_invertible_on_held_out_samples(layers):
    """The latents (c, s_i, m_i) of every modality come back from its float32 observations of
    the test split, through an inverse of the seed's weights written in this test."""
    ds = build_dataset("identifiability", split="test", num_samples=2000, num_modalities=3, mixing_layers=layers)
    z, x = _latents(ds, 2000), _observations(ds, 2000)
    for i, m in enumerate(ds.modalities):
        truth = np.concatenate([z["content"], z[f"style_{m}"], z[f"specific_{m}"]], axis=1)
        back = _inverse(ds.process.mixing[i], x[m])
        assert np.abs(back - truth).max() < 1e-3 * np.abs(truth).max()
        np.testing.assert_allclose(ds.process.unmix(i, ds.process.mix(i, truth)), truth, atol=1e-9)
        # well conditioned square layers, and a mixing that is not the identity (nor linear with 3 layers)
        assert all(w.shape == (15, 15) and np.linalg.cond(w) < 40 for w in ds.process.mixing[i])
        assert not np.allclose(x[m], truth, atol=0.1)
    assert len(ds.process.mixing[0]) == layers
    assert not np.allclose(ds.process.mixing[0][0], ds.process.mixing[1][0])  # f_1 != f_2


def test_content_is_the_same_in_every_modality():
    ds = build_dataset("identifiability", split="valid", num_samples=500, num_modalities=4)
    x = _observations(ds, 500)
    contents = [_inverse(ds.process.mixing[i], x[m])[:, :5] for i, m in enumerate(ds.modalities)]
    for c in contents[1:]:
        np.testing.assert_allclose(c, contents[0], atol=1e-3)
    np.testing.assert_allclose(contents[0], _latents(ds, 500)["content"], atol=1e-3)


@pytest.mark.parametrize("p", [0.75, 0.3])
def test_later_modalities_see_the_style_perturbed_at_rate_p(p):
    ds = build_dataset("identifiability", split="train", num_samples=N, num_modalities=3, style_change_prob=p)
    z = _latents(ds)
    changed = {m: z[f"style_{m}"] != z["style_x1"] for m in ("x2", "x3")}
    tolerance = 5 * np.sqrt(p * (1 - p) / changed["x2"].size)
    for m in ("x2", "x3"):
        assert abs(changed[m].mean() - p) < tolerance
        assert abs(changed[m].mean(axis=0) - p).max() < 5 * np.sqrt(p * (1 - p) / N)  # every coordinate
    # each modality draws its own perturbation: which coordinates change is independent across modalities
    both = (changed["x2"] & changed["x3"]).mean()
    assert abs(both - p * p) < tolerance
    assert not np.allclose(z["style_x2"][changed["x2"] & changed["x3"]], z["style_x3"][changed["x2"] & changed["x3"]])
    never = build_dataset("identifiability", split="train", num_samples=64, style_change_prob=0.0)
    always = build_dataset("identifiability", split="train", num_samples=64, style_change_prob=1.0)
    assert np.array_equal(_latents(never, 64)["style_x2"], _latents(never, 64)["style_x1"])
    assert (_latents(always, 64)["style_x2"] != _latents(always, 64)["style_x1"]).all()


def _r2_linear(x: np.ndarray, y: np.ndarray) -> float:
    """R^2 (mean over y's columns) of least squares with an intercept, in-sample."""
    design = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    resid = y - design @ np.linalg.lstsq(design, y, rcond=None)[0]
    return float(np.mean(1 - resid.var(axis=0) / y.var(axis=0)))


def test_specific_blocks_are_independent_across_modalities_and_of_the_shared_blocks():
    ds = build_dataset("identifiability", split="train", num_samples=N, num_modalities=3)
    z = _latents(ds)
    bound = 5 / np.sqrt(N)
    for a, b in (("specific_x1", "specific_x2"), ("specific_x2", "specific_x3"), ("specific_x1", "content"),
                 ("specific_x2", "style_x1")):
        cross = np.corrcoef(z[a].T, z[b].T)[:5, 5:]
        assert np.abs(cross).max() < bound, (a, b)
    assert _r2_linear(z["specific_x1"], z["specific_x2"]) < 0.01
    assert not np.allclose(z["specific_x1"], z["specific_x2"])


def test_statistical_dependence_draws_wishart_covariances():
    dependent = build_dataset("identifiability", split="train", num_samples=N, content_dependent_style=False)
    independent = build_dataset("identifiability", split="train", num_samples=N, statistical_dependence=False,
                                content_dependent_style=False)
    for name in ("content", "style_x1", "specific_x2"):
        cov_dep = np.cov(_latents(dependent)[name].T)
        cov_ind = np.cov(_latents(independent)[name].T)
        np.testing.assert_allclose(cov_ind, np.eye(5), atol=6 / np.sqrt(N))
        # the Wishart draw: off-diagonal covariance, and a scale of about the block's size (its mean is 5 I)
        key = {"style_x1": "style", "specific_x2": "specific_x2"}.get(name, name)
        chol = dependent.process.chol[key]
        np.testing.assert_allclose(cov_dep, chol @ chol.T, atol=0.1 * np.abs(chol @ chol.T).max())
        assert np.abs(cov_dep - np.diag(np.diag(cov_dep))).max() > 0.5
    # without dependence the latents are standard normal: mean 0, a symmetric spread
    c = _latents(independent)["content"]
    assert np.abs(c.mean(axis=0)).max() < 5 / np.sqrt(N)
    assert abs(np.mean(np.abs(c) < 1) - 0.6827) < 0.02


def test_content_dependent_style_is_an_affine_map_of_the_content():
    on = build_dataset("identifiability", split="train", num_samples=N, statistical_dependence=False)
    off = build_dataset("identifiability", split="train", num_samples=N, statistical_dependence=False,
                        content_dependent_style=False)
    z_on, z_off = _latents(on), _latents(off)
    b, a = on.process.shift
    np.testing.assert_allclose(z_on["style_x1"] - z_on["content"] @ b.T - a, z_off["style_x1"], atol=1e-12)
    assert _r2_linear(z_on["content"], z_on["style_x1"]) > 0.5
    assert _r2_linear(z_off["content"], z_off["style_x1"]) < 0.01
    assert off.process.shift is None


def test_samples_are_deterministic_per_seed_split_and_index_and_the_mixing_per_seed():
    a = build_dataset("identifiability", split="train", seed=3)
    b = build_dataset("identifiability", split="train", seed=3)
    # sample i is the same alone, in another batch, in another dataset object
    one = a[123]
    batch = b.__getitems__([9, 123, 5])
    assert batch[1]["index"] == 123
    assert torch.equal(one["modalities"]["x1"], batch[1]["modalities"]["x1"])
    assert one["labels"] == batch[1]["labels"]
    # whatever the split's size
    small = build_dataset("identifiability", split="train", num_samples=200, seed=3)
    assert torch.equal(small[123]["modalities"]["x2"], one["modalities"]["x2"])
    # the splits share the mixing, not the samples
    test = build_dataset("identifiability", split="test", seed=3)
    assert all(np.array_equal(u, v) for u, v in zip(test.process.mixing[0], a.process.mixing[0]))
    assert not np.allclose(test.latents([123])["content"], a.latents([123])["content"])
    # another seed: another process
    other = build_dataset("identifiability", split="train", seed=4)
    assert not np.allclose(other.process.mixing[0][0], a.process.mixing[0][0])
    assert not np.allclose(other.latents([123])["content"], a.latents([123])["content"])
    # the process is rebuilt the same (not only cached)
    generative_process.cache_clear()
    again = build_dataset("identifiability", split="train", seed=3)
    assert again.process is not a.process
    assert all(np.array_equal(u, v) for u, v in zip(again.process.mixing[1], a.process.mixing[1]))
    assert torch.equal(again[123]["modalities"]["x2"], one["modalities"]["x2"])


def test_block_sizes_and_switches_change_only_what_they_name():
    ds = build_dataset("identifiability", split="valid", num_samples=8, content_dim=2, style_dim=3, specific_dim=0)
    item = ds[0]
    assert item["modalities"]["x1"].shape == (1, 5)
    assert len(item["labels"]["content"]) == 2 and item["labels"]["specific_x1"] == []
    base = build_dataset("identifiability", split="valid", num_samples=8, content_dependent_style=False)
    shifted = build_dataset("identifiability", split="valid", num_samples=8)
    # the content-dependent style leaves the content and the covariances as they were
    np.testing.assert_array_equal(base.latents(range(8))["content"], shifted.latents(range(8))["content"])
    np.testing.assert_array_equal(base.latents(range(8))["specific_x1"], shifted.latents(range(8))["specific_x1"])


@pytest.mark.parametrize(("options", "key"), [
    ({"num_modalities": 1}, "num_modalities"),
    ({"content_dim": 0}, "content_dim"),
    ({"mixing_layers": 0}, "mixing_layers"),
    ({"style_change_prob": 1.5}, "style_change_prob"),
    ({"num_samples": -1}, "num_samples"),
    ({"style_dim": 2.5}, "style_dim"),
])
def test_bad_options_are_rejected_naming_the_option(options, key):
    with pytest.raises(ValueError, match=key) as err:
        build_dataset("identifiability", split="valid", **options)
    assert err.value.option == key


def test_unknown_split_is_rejected():
    with pytest.raises(ValueError, match="unknown split 'dev'") as err:
        build_dataset("identifiability", split="dev")
    assert err.value.option == "split"


def test_adding_modalities_leaves_the_first_ones_as_they_were():
    """M = 2 and M = 4 share x1 and x2 (mixing, covariances, samples): a sweep over M compares
    the same two modalities with more added, not another process."""
    two = build_dataset("identifiability", split="test", num_samples=32, num_modalities=2)
    four = build_dataset("identifiability", split="test", num_samples=32, num_modalities=4)
    for i in range(2):
        assert all(np.array_equal(u, v) for u, v in zip(two.process.mixing[i], four.process.mixing[i]))
    for name in ("content", "style", "style_noise", "specific_x1", "specific_x2"):
        np.testing.assert_array_equal(two.process.chol[name], four.process.chol[name])
    np.testing.assert_array_equal(two.process.shift[0], four.process.shift[0])
    z2, z4 = two.latents(range(32)), four.latents(range(32))
    for key, value in z2.items():
        np.testing.assert_array_equal(value, z4[key])
    assert torch.equal(two[3]["modalities"]["x2"], four[3]["modalities"]["x2"])
    assert not np.allclose(four.process.mixing[3][0], four.process.mixing[2][0])
