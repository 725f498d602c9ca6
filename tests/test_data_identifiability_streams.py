"""The ``identifiability`` dataset's samples are exactly the documented counter-based draws, and its
arguments and indices are checked at their exact bounds.

The samples are a function of (seed, split, index) through SplitMix64: a reference written here
in plain Python integers (checked against SplitMix64's published first outputs for state 0)
recomputes every latent block of a few samples from the stream layout (content stream 0, style 1,
for modality i >= 2 the perturbation mask 8 + 4i, its noise 9 + 4i, modality i's specific block
10 + 4i) and must agree with the dataset to the last bit: a change to the hash, a key or a
stream would silently change every dataset a recorded result was trained on. Then the argument
checks: the smallest allowed value of each option passes, the one below fails with its exact
message; index bounds at -N, N - 1 and N; non-integer indices are refused."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mmviews.data.identifiability import (
    IdentifiabilityData,
    _mix64,
    _well_conditioned,
    hashed_normal,
    hashed_uniform,
    label_key,
)

MASK = (1 << 64) - 1


def splitmix(x: int) -> int:
    """SplitMix64's output for state ``x`` (the state advanced by the golden gamma, then mixed)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def uniform(key: int, index: int, column: int) -> float:
    bits = splitmix(splitmix(splitmix(key & MASK) ^ index) ^ column)
    return ((bits >> 11) + 0.5) / 2.0 ** 53


def normal(key: int, index: int, width: int) -> np.ndarray:
    """Box-Muller: the first ``width`` uniforms give the radius, the next ``width`` the angle."""
    return np.array([math.sqrt(-2.0 * math.log(uniform(key, index, j))) * math.cos(2.0 * math.pi * uniform(key, index, width + j))
                     for j in range(width)])


def key(seed: int, split: int, stream: int) -> int:
    return splitmix(((seed * 1_000_003 + split) * 64 + stream) & MASK)


def test_mix64_is_splitmix64():
    # SplitMix64 from state 0: its first two outputs are these (the generator's published values)
    assert splitmix(0) == 0xE220A8397B1DCDAF and splitmix(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    values = [0, 1, 2, 12345, 0x9E3779B97F4A7C15, (1 << 63) + 7, MASK - 3, MASK]
    mixed = _mix64(np.array(values, dtype=np.uint64))
    assert mixed.dtype == np.uint64
    assert [int(v) for v in mixed] == [splitmix(v) for v in values]


def test_hashed_uniform_and_normal_are_the_documented_draws():
    index = np.array([0, 1, 5, 1 << 40, (1 << 62) + 3])
    for k in (0, 7, -3, 1 << 70):  # keys wrap to 64 bits
        u = hashed_uniform(k, index, 3)
        assert u.shape == (5, 3) and u.dtype == np.float64
        assert u.tolist() == [[uniform(k, int(i), j) for j in range(3)] for i in index]
        z = hashed_normal(k, index, 3)
        assert z.shape == (5, 3)
        np.testing.assert_allclose(z, np.stack([normal(k, int(i), 3) for i in index]), rtol=1e-12, atol=1e-12)
    # strictly inside (0, 1): the smallest and largest 53-bit values map half a step from the ends
    assert 0.0 < hashed_uniform(1, np.arange(4096), 8).min() and hashed_uniform(1, np.arange(4096), 8).max() < 1.0


@pytest.mark.parametrize(("seed", "split", "p"), [(3, 2, 0.5), (0, 1, 0.75)])
def test_latents_are_the_documented_streams(seed, split, p):
    ds = IdentifiabilityData(1 << 50, seed, split, num_modalities=3, content_dim=2, style_dim=3, specific_dim=2,
                             style_change_prob=p)
    proc = ds.process
    index = [0, 9, (1 << 50) - 1]
    z = ds.latents(index)
    for row, i in enumerate(index):
        c = proc.chol["content"] @ normal(key(seed, split, 0), i, 2)
        s = proc.chol["style"] @ normal(key(seed, split, 1), i, 3) + proc.shift[0] @ c + proc.shift[1]
        np.testing.assert_allclose(z["content"][row], c, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(z["style_x1"][row], s, rtol=1e-12, atol=1e-12)
        for m in range(3):
            specific = proc.chol[f"specific_x{m + 1}"] @ normal(key(seed, split, 10 + 4 * m), i, 2)
            np.testing.assert_allclose(z[f"specific_x{m + 1}"][row], specific, rtol=1e-12, atol=1e-12)
            if m:
                changed = np.array([uniform(key(seed, split, 8 + 4 * m), i, j) < p for j in range(3)])
                noise = proc.chol["style_noise"] @ normal(key(seed, split, 9 + 4 * m), i, 3)
                np.testing.assert_allclose(z[f"style_x{m + 1}"][row], s + changed * noise, rtol=1e-12, atol=1e-12)


def test_indices_beyond_float_precision_stay_exact():
    """Index 2^53 + 1 is its own sample (an index passed through float64 would become 2^53)."""
    ds = IdentifiabilityData(1 << 60, num_modalities=2)
    big = (1 << 53) + 1
    z = ds.latents(np.array([big, big - 1], dtype=np.int64))
    np.testing.assert_allclose(z["content"][0], ds.process.chol["content"] @ normal(key(0, 0, 0), big, 5),
                               rtol=1e-12, atol=1e-12)
    assert not np.array_equal(z["content"][0], z["content"][1])


def test_defaults_are_seed_0_split_0_two_modalities():
    plain = IdentifiabilityData(16)
    explicit = IdentifiabilityData(16, 0, 0, num_modalities=2, content_dim=5, style_dim=5, specific_dim=5)
    assert plain.modalities == ("x1", "x2") and plain.process is explicit.process
    for name, value in explicit.latents(range(16)).items():
        np.testing.assert_array_equal(plain.latents(range(16))[name], value)
    np.testing.assert_array_equal(plain.latents([3])["content"][0],
                                  plain.process.chol["content"] @ normal(key(0, 0, 0), 3, 5))


def test_smallest_allowed_sizes_are_accepted():
    assert len(IdentifiabilityData(0)) == 0
    ds = IdentifiabilityData(4, content_dim=1, style_dim=0, specific_dim=0, num_modalities=2, mixing_layers=1)
    z = ds.latents(range(4))
    assert z["content"].shape == (4, 1) and z["style_x2"].shape == (4, 0) and z["specific_x1"].shape == (4, 0)
    assert ds.modality_info() == {"x1": {"kind": "sequence", "shape": (1, 1)}, "x2": {"kind": "sequence", "shape": (1, 1)}}


@pytest.mark.parametrize(("option", "value", "low"), [
    ("num_samples", -1, 0), ("num_modalities", 1, 2), ("content_dim", 0, 1), ("style_dim", -1, 0),
    ("specific_dim", -1, 0), ("mixing_layers", 0, 1), ("specific_dim", True, 0), ("style_dim", 1.0, 0),
])
def test_each_size_below_its_bound_is_refused_with_its_exact_message(option, value, low):
    kwargs = {"num_samples": 4, option: value}
    with pytest.raises(ValueError) as err:
        IdentifiabilityData(**kwargs)
    assert str(err.value) == f"identifiability: {option} must be an integer >= {low}, got {value!r}"
    assert err.value.option == option


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_style_change_prob_bounds_are_inclusive(p):
    ds = IdentifiabilityData(256, style_change_prob=p)
    z = ds.latents(range(256))
    changed = z["style_x2"] != z["style_x1"]
    assert changed.all() if p == 1.0 else not changed.any()


@pytest.mark.parametrize("p", [-0.01, 1.01])
def test_style_change_prob_outside_0_1_is_refused(p):
    with pytest.raises(ValueError) as err:
        IdentifiabilityData(4, style_change_prob=p)
    assert str(err.value) == f"identifiability: style_change_prob must be in [0, 1], got {p!r}"
    assert err.value.option == "style_change_prob"


def test_index_bounds_of_getitem():
    ds = IdentifiabilityData(4)
    first, last = ds[0], ds[3]
    assert ds[-4]["index"] == 0 and ds[-4]["labels"] == first["labels"]
    assert ds[-1]["labels"] == last["labels"]
    for bad in (4, -5):
        with pytest.raises(IndexError) as err:
            ds[bad]
        assert str(err.value) == f"index {bad} out of range for 4 samples"


@pytest.mark.parametrize("bad", [[4], [-1], [-1, 2], [0, 4]])
def test_latents_refuse_indices_outside_the_split(bad):
    ds = IdentifiabilityData(4)
    assert ds.latents([0, 3])["content"].shape == (2, 5)
    with pytest.raises(IndexError) as err:
        ds.latents(bad)
    assert str(err.value) == "identifiability: index out of range for 4 samples"


def test_latents_refuse_non_integer_indices():
    ds = IdentifiabilityData(4)
    with pytest.raises(TypeError) as err:
        ds.latents([0.5, 1.0])
    assert str(err.value) == "identifiability: sample indices must be integers, got float64 (np.float64(0.5))"
    with pytest.raises(TypeError) as err:
        ds.latents(np.array([[2.5, 1.0], [0.0, 3.0]], dtype=np.float32))
    assert str(err.value) == "identifiability: sample indices must be integers, got float32 (np.float32(2.5))"
    with pytest.raises(TypeError, match="got bool"):
        ds.latents([True, False])
    assert ds.latents([])["content"].shape == (0, 5)
    assert ds.latents(np.array([[1, 2], [3, 0]]))["content"].shape == (4, 5)


def test_label_key_names_the_blocks():
    assert label_key("content", "x2") == "content" and label_key("style", "x2") == "style_x2"
    with pytest.raises(ValueError) as err:
        label_key("noise", "x1")
    assert str(err.value) == "unknown latent block 'noise'; blocks are content, style, specific"


def test_well_conditioned_accepts_a_condition_number_equal_to_the_threshold():
    """The first candidate whose condition number is <= the threshold: at equality it is taken."""
    from mmviews.data.identifiability import _CANDIDATES, _unit_columns

    first = _unit_columns(np.random.default_rng(11).uniform(-1.0, 1.0, size=(_CANDIDATES, 3, 3)))
    conds = np.linalg.cond(first)
    k = int(np.argmin(conds))
    picked = _well_conditioned(np.random.default_rng(11), 3, float(conds[k]))
    np.testing.assert_array_equal(picked, first[k])


def test_a_style_coordinate_is_perturbed_when_its_uniform_is_below_p_strictly():
    """p set to the very uniform that decides coordinate 0 of sample 0 in modality x2: at p equal
    to it the coordinate is kept, at the next double above it is perturbed."""
    u = uniform(key(0, 0, 8 + 4), 0, 0)
    kept = IdentifiabilityData(4, style_change_prob=u).latents([0])
    assert kept["style_x2"][0, 0] == kept["style_x1"][0, 0]
    moved = IdentifiabilityData(4, style_change_prob=float(np.nextafter(u, 1.0))).latents([0])
    assert moved["style_x2"][0, 0] != moved["style_x1"][0, 0]
