"""recipes/reproduce/identifiability_tune.py (its squared-L2 critic is the library's ``simclr``
``critic: squared_l2``, tested in test_objectives_squared_l2.py): its block scores against known embeddings (the true content scores 1,
a block the embedding lacks 0), the screen and curve stages at --smoke size (the tables hold the
settings and the steps asked for), and the authors' stage against a stand-in checkout whose
main_mlp.py calls the two functions the stage hooks (the scored steps are the optimiser steps
done); the protocol stage: saved encoders load back to the same embedding, its protocols use
the samples they name, the paper-size refit equals the task's kernel ridge, the oracle inputs
hold the content, and the content directions an input lacks score near 0."""

from __future__ import annotations

import csv
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPRO = Path(__file__).resolve().parents[1] / "recipes" / "reproduce"


@pytest.fixture(scope="module")
def tune():
    spec = importlib.util.spec_from_file_location("reproduce_identifiability_tune", REPRO / "identifiability_tune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_score_blocks_find_the_block_an_embedding_holds(tune) -> None:
    rng = np.random.default_rng(0)
    n = 600

    def latents() -> dict[str, np.ndarray]:
        return {"content": rng.standard_normal((n, 3)), "style_x1": rng.standard_normal((n, 3)),
                "style_x2": rng.standard_normal((n, 3)), "specific_x1": rng.standard_normal((n, 3)),
                "specific_x2": rng.standard_normal((n, 3))}

    fit, score = latents(), latents()
    # x1 holds the content (through a monotone warp), x2 holds its own specific block
    emb_fit = {"x1": np.tanh(fit["content"]), "x2": fit["specific_x2"]}
    emb_score = {"x1": np.tanh(score["content"]), "x2": score["specific_x2"]}
    row = tune.score_blocks(emb_fit, fit, emb_score, score, fit=300)
    assert row["x1_content"] > 0.95 and row["x2_specific"] > 0.95
    assert abs(row["x1_specific"]) < 0.05 and abs(row["x2_content"]) < 0.05 and abs(row["x1_style"]) < 0.05
    assert row["content"] == pytest.approx((row["x1_content"] + row["x2_content"]) / 2)
    assert 0.8 < row["x1_content_lin"] < row["x1_content"]  # the warp costs the linear fit, not the kernel


def test_log_steps(tune) -> None:
    steps = tune.log_steps(12000)
    assert steps[0] == 0 and steps[-1] == 12000 and steps == sorted(set(steps)) and len(steps) >= 5


@pytest.mark.slow
def test_screen_and_curve_smoke(tune, tmp_path: Path) -> None:
    assert tune.main(["--smoke", "--stage", "screen", "--settings", "cheap", "wide_l2_d5", "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "screen.csv")
    assert [(r["setting"], r["step"]) for r in rows] == [("cheap", "3"), ("cheap", "6"), ("wide_l2_d5", "3"), ("wide_l2_d5", "6")]
    assert {r["critic"] for r in rows} == {"cosine", "l2"} and {r["embed_dim"] for r in rows if r["critic"] == "l2"} == {"5"}
    for r in rows:
        assert all(math.isfinite(float(r[k])) for k in ("content", "specific", "style", "content_lin", "train_cpu_s"))
    cpu = [float(r["train_cpu_s"]) for r in rows]
    assert cpu[0] <= cpu[1] and cpu[2] <= cpu[3]  # training CPU accumulates within a run

    assert tune.main(["--smoke", "--stage", "curve", "--settings", "candidate", "--seeds", "0", "1",
                      "--out", str(tmp_path)]) == 0
    curve = _rows(tmp_path / "curve.csv")
    assert [(r["seed"], r["step"]) for r in curve] == [("0", "3"), ("0", "6"), ("1", "3"), ("1", "6")]
    assert curve[0]["content"] != curve[2]["content"]  # each seed its own process and initialisation
    png = tmp_path / "curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


STAND_IN = '''
import numpy as np, torch
def train_step(data, h1, h2, loss_func, optimizer, params):
    return 0.0
def generate_data(latent_space, h1, h2, device, num_batches=1, batch_size=4096, loss_func=None, permuted_content=False):
    g = torch.Generator().manual_seed(batch_size)
    c = torch.randn(batch_size, 2)
    out = {"c": c.numpy(), "s": torch.randn(batch_size, 2).numpy(), "s~": torch.randn(batch_size, 2).numpy(),
           "m1": torch.randn(batch_size, 2).numpy(), "m2": torch.randn(batch_size, 2).numpy()}
    out["hz1"] = out["hz2"] = (c * 2).numpy()
    return out
def main():
    import sys
    args = sys.argv
    steps = int(args[args.index("--train-steps") + 1]); every = int(args[args.index("--log-steps") + 1])
    for step in range(1, steps + 1):
        train_step(None, None, None, None, object(), None)
        if step % every == 1 or step == steps:
            generate_data(None, None, None, "cpu", loss_func=object())
'''


def test_authors_stage_scores_each_log_step(tune, tmp_path: Path) -> None:
    code = tmp_path / "checkout"
    code.mkdir()
    (code / "main_mlp.py").write_text(STAND_IN)
    try:
        assert tune.main(["--smoke", "--stage", "authors", "--authors-code", str(code), "--out", str(tmp_path)]) == 0
    finally:
        sys.modules.pop("main_mlp", None)
        sys.path.remove(str(code.resolve()))
    rows = _rows(tmp_path / "authors.csv")
    assert [r["step"] for r in rows] == ["1", "4", "6"]  # after its steps 1, 4 and the last (6), as logged
    assert all(float(r["content"]) > 0.95 and abs(float(r["specific"])) < 0.1 for r in rows)


def test_authors_stage_needs_a_checkout(tune, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="authors-code"):
        tune.main(["--stage", "authors", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no main_mlp.py"):
        tune.main(["--stage", "authors", "--authors-code", str(tmp_path), "--out", str(tmp_path)])


def test_saved_encoders_load_back_to_the_same_embedding(tune, tmp_path: Path) -> None:
    """--save-encoders keeps what --stage protocol scores: the loaded encoders embed as the trained
    ones did, with their setting and seed; a file that does not fit its setting is refused."""
    from mmviews.modalities import build_adapter

    setting = {**tune.candidate_setting(), **tune.CURVES["l2_d5_lr3e-3"], "hidden": 8}
    torch.manual_seed(3)
    adapters = torch.nn.ModuleList(build_adapter(tune._adapter_spec(setting)) for _ in tune.MODALITIES)
    path = tune.save_encoders(adapters, setting, 7, tmp_path / "enc" / "run.safetensors")
    loaded, got_setting, seed = tune.load_encoders(path)
    assert seed == 7 and got_setting == setting and not loaded.training
    x = torch.randn(10, 1, 15)
    for a, b in zip(adapters, loaded):
        out = b({"values": x})
        assert out.shape == (10, 5) and not torch.allclose(out.norm(dim=-1), torch.ones(10))  # the L2 critic's: unnormalised
        torch.testing.assert_close(a({"values": x}), out, rtol=0, atol=0)
    assert not torch.equal(loaded[0]({"values": x}), loaded[1]({"values": x}))  # each modality its own weights
    wrong = tmp_path / "enc" / "run.json"
    wrong.write_text(wrong.read_text().replace('"hidden": 8', '"hidden": 16'))
    with pytest.raises(SystemExit, match="weights of x1 do not fit"):
        tune.load_encoders(path)
    with pytest.raises(SystemExit, match="needs the weights file"):
        tune.load_encoders(tmp_path / "missing.safetensors")


def test_score_protocol_reads_the_block_an_input_holds_under_its_sizes(tune) -> None:
    rng = np.random.default_rng(1)

    def latents(n: int) -> dict[str, np.ndarray]:
        return {k: rng.standard_normal((n, 2)) for k in ("content", "style_x1", "style_x2", "specific_x1", "specific_x2")}

    fit, score = latents(400), latents(300)
    inputs_fit = {"x1": np.tanh(fit["content"]), "x2": fit["specific_x2"]}
    inputs_score = {"x1": np.tanh(score["content"]), "x2": score["specific_x2"]}
    protocol = {"fit": 240, "score": 200, **tune.TASK_GRID}
    row = tune.score_protocol(inputs_fit, fit, inputs_score, score, protocol)
    assert row["x1_content"] > 0.97 and row["x2_specific"] > 0.97 and abs(row["x2_content"]) < 0.05
    assert row["content"] == pytest.approx((row["x1_content"] + row["x2_content"]) / 2)
    assert row["x1_alpha"] in tune.TASK_GRID["alphas"] and row["x1_gamma"] in tune.TASK_GRID["gammas"]
    # the protocol's sizes are the samples it uses: the same sizes, whatever lies beyond them
    longer_fit = {k: np.concatenate([v, rng.standard_normal(v.shape)]) for k, v in fit.items()}
    longer_in = {m: np.concatenate([v, rng.standard_normal(v.shape)]) for m, v in inputs_fit.items()}
    assert tune.score_protocol(longer_in, longer_fit, inputs_score, score, protocol) == row
    fewer = tune.score_protocol(inputs_fit, fit, inputs_score, score, {**protocol, "fit": 60})
    assert fewer["x1_content"] < row["x1_content"]


def test_oracle_inputs(tune) -> None:
    from mmviews.data.identifiability import IdentifiabilityData

    data = IdentifiabilityData(500, 0, 1)
    lat = data.latents(np.arange(500))
    obs = data.observations(lat)
    c = lat["content"]
    np.testing.assert_array_equal(tune.oracle_inputs("content", lat, obs, "x1", data.process), c)
    np.testing.assert_array_equal(tune.oracle_inputs("observation", lat, obs, "x2", data.process), obs["x2"])
    warped = tune.oracle_inputs("content_tanh", lat, obs, "x1", data.process)
    assert warped.shape == c.shape and np.abs(warped).max() < 1 and np.abs(warped).max() > 0.99  # it saturates
    mixed = [tune.oracle_inputs("content_mix", lat, obs, m, data.process) for m in tune.MODALITIES]
    assert mixed[0].shape == (500, 15) and not np.allclose(mixed[0], mixed[1])  # each modality's own mixing
    # the modality's own mixing of (c, 0, 0): unmixed, it gives the content back and zeros
    unmixed = data.process.unmix(0, mixed[0])
    np.testing.assert_allclose(unmixed[:, :5], c, atol=1e-8)
    np.testing.assert_allclose(unmixed[:, 5:], 0, atol=1e-8)
    with pytest.raises(ValueError, match="oracle input 'nope'"):
        tune.oracle_inputs("nope", lat, obs, "x1", data.process)


@pytest.mark.slow
def test_protocol_stage_scores_a_saved_run(tune, tmp_path: Path) -> None:
    assert tune.main(["--smoke", "--stage", "curve", "--settings", "l2_d5_lr3e-3", "--seeds", "2", "--save-encoders",
                      "--out", str(tmp_path)]) == 0
    encoders = tmp_path / "encoders" / "l2_d5_lr3e-3_seed2.safetensors"
    assert tune.main(["--smoke", "--stage", "protocol", "--encoders", str(encoders), "--protocols", "task", "wide",
                      "--oracles", "embedding", "content", "--directions", "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "protocol.csv")
    assert [(r["input"], r["protocol"]) for r in rows] == [("embedding", "task"), ("embedding", "wide"),
                                                          ("content", "task"), ("content", "wide")]
    assert all(r["seed"] == "2" for r in rows)
    assert float(rows[2]["content"]) > 0.95 > float(rows[0]["content"])  # the true content against a 6-step encoder
    directions = _rows(tmp_path / "protocol_directions.csv")
    variances = [float(r["variance"]) for r in directions]
    assert [r["direction"] for r in directions] == ["0", "1", "2", "3", "4"] and variances == sorted(variances)
    assert {r["protocol"] for r in directions} == {"task"} and all(math.isfinite(float(r["x2"])) for r in directions)
    with pytest.raises(SystemExit, match="--protocols nope"):
        tune.main(["--stage", "protocol", "--encoders", str(encoders), "--protocols", "nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs --encoders"):
        tune.main(["--stage", "protocol", "--out", str(tmp_path)])


def test_refit_is_the_kernel_ridge_of_the_whole_fit_set(tune) -> None:
    """The paper's-size refit (one kernel, built in place, scored in chunks) gives what the task's
    kernel ridge gives when its grid holds only that alpha and gamma; and a protocol with fewer CV
    samples than fit samples is scored by it."""
    from mmviews.eval.identifiability import kernel_ridge_r2

    rng = np.random.default_rng(2)
    x_fit, x_score = torch.as_tensor(rng.standard_normal((300, 3))), torch.as_tensor(rng.standard_normal((250, 3)))
    y_fit, y_score = torch.sin(x_fit[:, :2] * 2), torch.sin(x_score[:, :2] * 2)
    for alpha, gamma in ((0.01, 0.5), (1.0, 3.0)):
        want = kernel_ridge_r2(x_fit, {"y": y_fit}, x_score, {"y": y_score}, [alpha], [gamma]).r2["y"]
        got = tune.refit_r2(x_fit, y_fit, x_score, y_score, alpha, gamma, chunk=64)
        assert got == pytest.approx(want, abs=1e-10)
    lat = {k: rng.standard_normal((300, 2)) for k in ("content", "style_x1", "style_x2", "specific_x1", "specific_x2")}
    inputs = {"x1": np.sin(lat["content"]), "x2": np.sin(lat["content"])}
    full = tune.score_protocol(inputs, lat, inputs, lat, {"fit": 300, "score": 300, **tune.TASK_GRID})
    small_cv = tune.score_protocol(inputs, lat, inputs, lat, {"fit": 300, "score": 300, "cv_samples": 60, **tune.TASK_GRID})
    cv_only = tune.score_protocol(inputs, lat, inputs, lat, {"fit": 60, "score": 300, **tune.TASK_GRID})
    assert small_cv["x1_content"] > cv_only["x1_content"]  # refitted on all 300, not on the CV's 60
    assert small_cv["x1_content"] == pytest.approx(full["x1_content"], abs=0.02)
    assert small_cv["x1_style"] != cv_only["x1_style"]  # every block refitted by default
    content_only = tune.score_protocol(inputs, lat, inputs, lat, {"fit": 300, "score": 300, "cv_samples": 60,
                                                                  "refit_blocks": ("content",), **tune.TASK_GRID})
    assert content_only["x1_content"] == small_cv["x1_content"]
    # the style keeps the CV set's fit (standardised on all 300, so near, not equal to, the 60-sample protocol's)
    assert content_only["x1_style"] != small_cv["x1_style"]
    assert content_only["x1_style"] == pytest.approx(cv_only["x1_style"], abs=0.01)


def test_direction_r2_finds_the_content_direction_an_input_lacks(tune) -> None:
    """An input that holds the content along its large-variance axis but not along its small one
    scores near 1 on the first and near 0 on the second, rows ordered by variance."""
    rng = np.random.default_rng(4)
    rotation = np.linalg.qr(rng.standard_normal((2, 2)))[0]
    covariance = rotation @ np.diag([0.3, 9.0]) @ rotation.T

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        c = rng.standard_normal((n, 2)) @ np.linalg.cholesky(covariance).T
        strong = c @ rotation[:, 1]  # the coordinate along the large-variance axis
        return c, np.stack([np.tanh(strong / 3), rng.standard_normal(n)], axis=1)

    c_fit, x_fit = draw(400)
    c_score, x_score = draw(300)
    rows = tune.direction_r2({"x1": x_fit}, c_fit, {"x1": x_score}, c_score, covariance,
                             {"fit": 300, "score": 300, **tune.TASK_GRID})
    assert [r["direction"] for r in rows] == [0, 1]
    assert rows[0]["variance"] == pytest.approx(0.3) and rows[1]["variance"] == pytest.approx(9.0)
    assert abs(rows[0]["x1"]) < 0.05 and rows[1]["x1"] > 0.97


def test_sweep_setting_holds_the_inputs_per_step_and_names_the_critic(tune) -> None:
    for M, K in ((2, 256), (3, 171), (4, 128)):  # K * M = 512 encoded inputs a step, rounded
        s = tune.sweep_setting("mv_dhel", M)
        assert (s["M"], s["K"], s["objective"], s["critic"], s["embed_dim"], s["steps"]) == (M, K, "mv_dhel", "cosine", 16, 3000)
    l2 = tune.sweep_setting("geometric_pvc_l2", 3, steps=50, inputs=90)
    assert (l2["objective"], l2["critic"], l2["embed_dim"], l2["lr"], l2["K"], l2["steps"]) == ("geometric_pvc", "l2", 5, 3e-3, 30, 50)


def test_objective_of_passes_the_temperature_and_the_critic(tune) -> None:
    base = {"tau": 0.3, "critic": "cosine"}
    simclr = tune.objective_of(base)
    assert type(simclr).__name__ == "SimCLR" and simclr.temperature == pytest.approx(0.3) and simclr.critic == "cosine"
    l2 = tune.objective_of({**base, "objective": "geometric_pvc", "critic": "l2"})
    assert type(l2).__name__ == "GeometricPVC" and l2.critic == "squared_l2"
    fmicl = tune.objective_of({**base, "objective": "fmicl"})  # its own defaults: no temperature passed
    assert type(fmicl).__name__ == "FMICL" and fmicl.temperature == pytest.approx(0.1)
    with pytest.raises(ValueError, match="unknown parameter 'critic'"):
        tune.objective_of({**base, "objective": "mv_dhel", "critic": "l2"})


def test_data_options_default_to_the_papers_hardest_setting(tune) -> None:
    assert tune.data_options({}) == {"num_modalities": 2, "style_change_prob": 0.75, "statistical_dependence": True,
                                     "content_dependent_style": True}
    assert tune.data_options({"M": 4, "p": 0.25, "statistical": False, "content_style": False}) == {
        "num_modalities": 4, "style_change_prob": 0.25, "statistical_dependence": False, "content_dependent_style": False}


def test_sweep_and_settings_smoke(tune, tmp_path: Path) -> None:
    """The sweep scores every modality of each M (the encoder as initialised once per seed, M and
    encoder shape); the settings stage trains each named setting beside its initialisation."""
    assert tune.main(["--smoke", "--stage", "sweep", "--seeds", "0", "--Ms", "2", "3",
                      "--objectives", "multi_crop", "mv_dhel", "geometric_pvc_l2", "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "sweep.csv")
    assert [(r["objective"], r["M"], r["encoder"]) for r in rows] == [
        ("random_init", "2", "d16_cosine"), ("multi_crop", "2", "d16_cosine"), ("mv_dhel", "2", "d16_cosine"),
        ("random_init", "2", "d5_l2"), ("geometric_pvc_l2", "2", "d5_l2"),
        ("random_init", "3", "d16_cosine"), ("multi_crop", "3", "d16_cosine"), ("mv_dhel", "3", "d16_cosine"),
        ("random_init", "3", "d5_l2"), ("geometric_pvc_l2", "3", "d5_l2")]
    assert {r["K"] for r in rows if r["M"] == "2"} == {"8"} and {r["K"] for r in rows if r["M"] == "3"} == {"5"}
    for r in rows:
        modalities = [f"x{i + 1}" for i in range(int(r["M"]))]
        for block in ("content", "style", "specific"):
            # the block's R^2 is the mean over every modality of the run, x3 included at M = 3
            mean = sum(float(r[f"{m}_{block}"]) for m in modalities) / len(modalities)
            assert float(r[block]) == pytest.approx(mean, abs=2e-4)  # the table rounds to 4 decimals
        assert f"x{int(r['M']) + 1}_content" not in r or r[f"x{int(r['M']) + 1}_content"] == ""
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(r["style_residual"] for r in rows)  # the style less the content's share, scored in every row
    assert tune.main(["--smoke", "--stage", "sweep", "--seeds", "2", "--Ms", "4", "--objectives", "er",
                      "--table", "sweep_style", "--out", str(tmp_path)]) == 0
    assert [(r["objective"], r["M"], r["seed"]) for r in _rows(tmp_path / "sweep_style.csv")] == [
        ("random_init", "4", "2"), ("er", "4", "2")]
    assert len(_rows(tmp_path / "sweep.csv")) == len(rows)  # the other table is left as it was
    assert (tmp_path / "sweep_style.png").is_file()

    assert tune.main(["--smoke", "--stage", "settings", "--seeds", "1", "--settings", "independent", "both_p0.25",
                      "--out", str(tmp_path)]) == 0
    settings = _rows(tmp_path / "settings.csv")
    assert [(r["setting"], r["trained"], r["p"], r["statistical"], r["content_style"]) for r in settings] == [
        ("independent", "False", "0.7500", "False", "False"), ("independent", "True", "0.7500", "False", "False"),
        ("both_p0.25", "False", "0.2500", "True", "True"), ("both_p0.25", "True", "0.2500", "True", "True")]
    assert settings[0]["content"] != settings[2]["content"]  # each setting its own process
    assert (tmp_path / "settings.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        tune.main(["--stage", "settings", "--settings", "nope", "--out", str(tmp_path)])


def test_style_residual_is_the_style_the_content_does_not_determine(tune) -> None:
    """With content-dependent style the style is largely a function of the content; its residual
    (less B c + a) is not, and equals the style where the style does not depend on the content."""
    from mmviews.data.identifiability import IdentifiabilityData
    from mmviews.eval.identifiability import linear_r2

    data = IdentifiabilityData(4096, 0, 1, num_modalities=3)
    latents = tune.style_residuals(data.latents(np.arange(4096)), data.process)
    assert {"style_residual_x1", "style_residual_x2", "style_residual_x3"} <= latents.keys()
    c = torch.as_tensor(latents["content"])
    half = slice(0, 2048), slice(2048, 4096)

    def r2_from_content(key: str) -> float:
        y = torch.as_tensor(latents[key])
        return linear_r2(c[half[0]], y[half[0]], c[half[1]], y[half[1]])

    for m in ("x1", "x2", "x3"):
        assert r2_from_content(f"style_{m}") > 0.5 and abs(r2_from_content(f"style_residual_{m}")) < 0.01, m
    b, a = data.process.shift
    np.testing.assert_allclose(latents["style_x2"] - latents["style_residual_x2"], latents["content"] @ b.T + a)

    free = IdentifiabilityData(64, 0, 1, content_dependent_style=False)
    plain = tune.style_residuals(free.latents(np.arange(64)), free.process)
    np.testing.assert_array_equal(plain["style_residual_x2"], plain["style_x2"])
    # score_blocks scores the residual where the latents hold it, and only then
    emb = {m: torch.as_tensor(latents["content"]) for m in ("x1", "x2")}
    row = tune.score_blocks(emb, latents, emb, latents, fit=256)
    assert row["style_residual"] < 0.2 < row["style"] and row["content"] > 0.95
    bare = {k: v for k, v in latents.items() if not k.startswith("style_residual")}
    assert "style_residual" not in tune.score_blocks(emb, bare, emb, bare, fit=256)


def test_confirm_trains_the_recipe_with_the_overrides_given(tune, tmp_path: Path) -> None:
    """--stage confirm runs the recipe through the trainer; --set reaches the run's config and
    --name keeps the runs and the table apart from the recipe's own."""
    import yaml

    assert tune.main(["--smoke", "--stage", "confirm", "--seeds", "1", "--set", "encoder.embed_dim=5",
                      "--set", "optimisation.lr=0.002", "--name", "probe", "--out", str(tmp_path)]) == 0
    run = tmp_path / "confirm" / "probe_seed1"
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["encoder"]["embed_dim"] == 5 and config["optimisation"]["lr"] == pytest.approx(0.002)
    assert config["seed"] == 1 and config["data"]["options"]["seed"] == 1
    rows = _rows(tmp_path / "confirm_probe.csv")
    assert [(r["name"], r["seed"], r["steps"], r["status"]) for r in rows] == [("probe", "1", "3", "ok")]
    assert all(math.isfinite(float(rows[0][k])) for k in ("content", "specific", "random_content", "random_specific"))
    assert not (tmp_path / "confirm.csv").exists()
