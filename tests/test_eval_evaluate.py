"""`mmviews/eval/evaluate.py`, the one evaluation entry: which split is evaluated and under which
keys, what `metrics.json` records about the evaluation, the retrieval pairs it takes by default,
the probes' keys and chances (the validation split's own numbers when it is the evaluated one),
the spectra named by view, and the halves that stand in for a missing validation split. The
figures are computed here from the fixture's labels or by the probes on the same embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mixed_splits import MixedSplit, mixed_loader
from test_eval_report import Clusters, collate, encoder
from torch.utils.data import DataLoader, Dataset

from mmviews.eval import evaluate_encoder
import mmviews.eval.evaluate as evaluate
from mmviews.eval.evaluate import _halves, _label, _on, _retrieval_pairs, _spectra_by_view_name
from mmviews.eval.extract import Embeddings
from mmviews.eval.metrics import ACC2_CONVENTIONS
from mmviews.eval.tasks import parse_tasks


def embeddings(n: int, names: list[str], modalities: list[str] | None = None, index: bool = True) -> Embeddings:
    views = torch.arange(n * len(names) * 2, dtype=torch.float32).reshape(n, len(names), 2)
    return Embeddings(views, torch.ones(n, len(names), dtype=torch.bool), views.reshape(n, -1),
                      {"class": torch.arange(n) % 2}, names, torch.arange(10, 10 + n) if index else None,
                      modalities or [])


# --- the parts --------------------------------------------------------------------------------


def test_default_retrieval_pairs_are_the_first_view_of_each_modality() -> None:
    task = parse_tasks(["retrieval"])[0]
    assert _retrieval_pairs(embeddings(2, ["a0", "b0", "b1", "c0"], ["a", "b", "b", "c"]), task) == [
        (0, 1), (0, 3), (1, 3)]
    # one modality: every pair of its views; no modalities recorded: each view stands for its own
    assert _retrieval_pairs(embeddings(2, ["a0", "a1", "a2"], ["a", "a", "a"]), task) == [(0, 1), (0, 2), (1, 2)]
    assert _retrieval_pairs(embeddings(2, ["x", "y", "z"]), task) == [(0, 1), (0, 2), (1, 2)]


def test_retrieval_pairs_named_by_the_task_and_an_unknown_view() -> None:
    emb = embeddings(2, ["a0", "b0", "b1"], ["a", "b", "b"])
    named = parse_tasks([{"kind": "retrieval", "pairs": [["b1", "a0"], ["b0", "b1"]]}])[0]
    assert _retrieval_pairs(emb, named) == [(2, 0), (1, 2)]
    unknown = parse_tasks([{"kind": "retrieval", "pairs": [["a0", "zz"]]}])[0]
    with pytest.raises(ValueError, match=r"^retrieval view 'zz' is not one of the views \['a0', 'b0', 'b1'\]$"):
        _retrieval_pairs(emb, unknown)


def test_spectra_are_named_by_view_where_the_position_is_a_view() -> None:
    data = {"spectrum/view0": 0, "spectrum/view2": 2, "spectrum/view3": 3, "spectrum/viewx": "x",
            "spectrum/fused": "f", "sim_pos": "p", "spectrum/abcd1": "not a view's"}
    assert _spectra_by_view_name(data, ["t", "a", "b"]) == {
        "spectrum/t": 0, "spectrum/b": 2, "spectrum/view3": 3, "spectrum/viewx": "x", "spectrum/fused": "f",
        "sim_pos": "p", "spectrum/abcd1": "not a view's"}


def test_a_missing_label_names_the_labels_the_batches_carry() -> None:
    emb = embeddings(2, ["a"])
    emb.labels["sentiment"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"^label 'y' is not in the test batches; they carry \['class', 'sentiment'\]$"):
        _label(emb, "y", "test")
    emb.labels.clear()
    with pytest.raises(ValueError, match="^label 'y' is not in the val batches; they carry no labels$"):
        _label(emb, "y", "val")


def test_embeddings_moved_to_a_device_keep_every_field() -> None:
    """The probes' device (the meta device here: no GPU needed to see where a tensor goes)."""
    emb = embeddings(3, ["a", "b"], ["a", "b"])
    moved = _on(emb, torch.device("meta"))
    assert all(t.device.type == "meta" for t in (moved.views, moved.mask, moved.fused, moved.labels["class"]))
    assert moved.views.shape == emb.views.shape and moved.labels["class"].shape == (3,)
    assert moved.index is emb.index and moved.view_names == ["a", "b"] and moved.view_modalities == ["a", "b"]


def test_retrieval_runs_on_the_device_asked_for(monkeypatch) -> None:
    seen = []

    def where(views, mask, a, b, ks):  # what the retrieval is given, and a result of the form it returns
        seen.append((views.device.type, mask.device.type, a, b, tuple(ks)))
        return {"n": 4, "a2b/R@1": 0.5, "b2a/R@1": 0.25}

    monkeypatch.setattr(evaluate, "cross_view_retrieval", where)
    metrics = evaluate_encoder(encoder, None, None, mixed_loader("test"), [{"kind": "retrieval", "ks": [1, 3]}],
                               device="meta", progress=False)
    assert seen == [("meta", "meta", 0, 1, (1, 3))]
    assert metrics["test/retrieval/text_0->audio_0/R@1"] == 0.5 and metrics["test/retrieval/audio_0->text_0/R@1"] == 0.25


@pytest.mark.parametrize("index", [True, False])
def test_halves_split_every_field_of_the_samples(index: bool) -> None:
    emb = embeddings(5, ["a", "b"], ["a", "b"], index=index)
    first, second = _halves(emb)
    for part, rows in ((first, slice(0, 2)), (second, slice(2, 5))):
        assert torch.equal(part.views, emb.views[rows]) and torch.equal(part.mask, emb.mask[rows])
        assert torch.equal(part.fused, emb.fused[rows]) and torch.equal(part.labels["class"], emb.labels["class"][rows])
        assert part.index is None if not index else torch.equal(part.index, emb.index[rows])
        assert part.view_names == ["a", "b"] and part.view_modalities == ["a", "b"]


# --- evaluate_encoder ---------------------------------------------------------------------------


def test_metrics_json_records_what_was_evaluated(tmp_path: Path) -> None:
    metrics = evaluate_encoder(
        encoder, mixed_loader("train"), mixed_loader("valid"), mixed_loader("test"),
        [{"kind": "knn", "k": 3}, "msa:mosi", "retrieval"], tmp_path, fuse="mean",
        meta={"objective": "mv_dhel", "num_views": 4}, progress=False, plots=False)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["meta"] == {
        "eval_split": "test", "eval_num_views": 3, "views": "text_0, audio_0, audio_1", "fuse": "mean",
        "tasks": "knn:class, msa:mosi, retrieval", "n_test": 16, "n_train": 24, "n_val": 12, "embedding_dim": 8,
        "acc2_conventions": dict(ACC2_CONVENTIONS), "objective": "mv_dhel", "num_views": 4, "plots": []}
    assert saved["metrics"] == pytest.approx(metrics)
    # the default pairs: text_0 and audio_0 (the first audio view), both directions, one n
    assert {k.split("/")[2] for k in metrics if k.startswith("test/retrieval/")} == {"text_0->audio_0", "audio_0->text_0"}
    assert metrics["test/retrieval/text_0->audio_0/n"] == metrics["test/retrieval/audio_0->text_0/n"] == 16
    assert not any("/mean/" in k for k in metrics)  # one pair: no mean
    assert metrics["test/knn/class/top1"] == 1.0 and metrics["chance/test/knn/class/top1"] == pytest.approx(6 / 16)
    assert {k for k in metrics if "msa/" in k} >= {"test/msa/mosi/Has0_acc_2", "test/msa/mosi/Corr",
                                                    "msa/mosi/weight_decay"}
    # a report without msa carries no Acc-2 conventions, and only the splits it read
    evaluate_encoder(encoder, None, None, mixed_loader("test"), ["retrieval"], tmp_path / "r", progress=False,
                     plots=False)
    meta = json.loads((tmp_path / "r" / "metrics.json").read_text())["meta"]
    assert "acc2_conventions" not in meta and "n_train" not in meta and "n_val" not in meta and meta["n_test"] == 16


class Relabelled(Dataset):
    """A split of mixed_splits with every class label moved on by one: a probe trained on the
    training split scores 0 on it, and a tenth of the training split held out scores well."""

    def __init__(self, split: str) -> None:
        self.inner = MixedSplit(split)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        x, y, s, index = self.inner[i]
        return x, (y + 1) % 3, s, index


def test_the_validation_split_evaluated_in_place_of_a_test_split_keeps_its_own_accuracy(tmp_path: Path) -> None:
    """Without a test split the validation split is the evaluated one: `val/linear/.../acc` is the
    probe's accuracy on it (not the held-out tenth of the training split that picked the weight
    decay), beside its chance."""
    valid = DataLoader(Relabelled("valid"), batch_size=8, collate_fn=collate)
    metrics = evaluate_encoder(
        encoder, mixed_loader("train"), valid, None, [{"kind": "linear", "weight_decays": [1e-2]}, "retrieval"],
        tmp_path, progress=False, plots=False)
    assert metrics["val/linear/class/acc"] == 0.0
    # classes moved on by one: the training majority (class 2) is labelled 0 there, 4 of 12
    assert metrics["chance/val/linear/class/acc"] == pytest.approx(4 / 12)
    assert "val/retrieval/text_0->audio_0/R@1" in metrics
    assert not any(k.startswith("test/") for k in metrics)
    saved = json.loads((tmp_path / "metrics.json").read_text())["meta"]
    assert saved["eval_split"] == "val" and saved["n_val"] == 12 and saved["n_train"] == 24


def test_linear_probe_keys_with_a_validation_split(tmp_path: Path) -> None:
    metrics = evaluate_encoder(encoder, mixed_loader("train"), mixed_loader("valid"), mixed_loader("test"),
                               [{"kind": "linear", "weight_decays": [1e-2]}], progress=False)
    assert set(metrics) == {"test/linear/class/acc", "chance/test/linear/class/acc", "val/linear/class/acc",
                            "chance/val/linear/class/acc", "linear/class/weight_decay"}
    assert metrics["linear/class/weight_decay"] == 1e-2
    # without one, the validation score is of a held-out tenth of train and has no chance beside it
    alone = evaluate_encoder(encoder, mixed_loader("train"), None, mixed_loader("test"),
                             [{"kind": "linear", "weight_decays": [1e-2]}], progress=False)
    assert "val/linear/class/acc" in alone and "chance/val/linear/class/acc" not in alone


def test_regression_keys_and_chance(tmp_path: Path) -> None:
    metrics = evaluate_encoder(encoder, mixed_loader("train"), mixed_loader("valid"), mixed_loader("test"),
                               [{"kind": "regression", "weight_decays": [1e-2]}], progress=False)
    names = {f"{p}test/regression/sentiment/{m}" for p in ("", "chance/") for m in ("mae", "mse", "r2")}
    assert set(metrics) == names | {"regression/sentiment/weight_decay"}


def test_evaluate_needs_a_split_to_evaluate_and_a_training_split_for_probes() -> None:
    with pytest.raises(ValueError, match="^evaluate_encoder needs a test or a validation loader to evaluate on$"):
        evaluate_encoder(encoder, mixed_loader("train"), None, None, ["knn"], progress=False)
    with pytest.raises(ValueError, match=r"^tasks \['knn', 'linear'\] need a train_loader$"):
        evaluate_encoder(encoder, None, None, mixed_loader("test"), ["linear", "retrieval", "knn", "linear"],
                         progress=False)


def test_prototypes_skip_a_direction_without_queries_or_prototypes(tmp_path: Path) -> None:
    """audio_1 is absent from every fourth sample: a test split of samples 0, 4, 8, 12 only has no
    audio_1 queries, so that direction is skipped (the pair's other direction, after it, is still
    scored); the mean then is of what was scored."""
    test = DataLoader(torch.utils.data.Subset(MixedSplit("test"), [0, 4, 8, 12]), batch_size=8, collate_fn=collate)
    metrics = evaluate_encoder(
        encoder, mixed_loader("train"), None, test,
        [{"kind": "prototype", "pairs": [["text_0", "audio_0"], ["audio_1", "text_0"]]}], progress=False)
    scored = sorted(k for k in metrics if not k.startswith("chance/"))
    assert scored == [f"test/prototype/class/{d}/acc" for d in
                      ("audio_0->text_0", "mean", "text_0->audio_0", "text_0->audio_1")]
    accuracies = [metrics[k] for k in scored if "/mean/" not in k]
    assert metrics["test/prototype/class/mean/acc"] == pytest.approx(sum(accuracies) / 3)
    # the 4 samples: classes 2, 2, 2, 2 (mixed_splits.TEST_CLASSES at 0, 4, 8, 12): the training majority
    assert metrics["chance/test/prototype/class/mean/acc"] == 1.0
    assert all(metrics["chance/" + k] == 1.0 for k in scored)



class Scrambled(Dataset):
    """test_eval_report's clusters with labels that their embeddings do not separate (each
    sample's class moved on by its index): what a probe learns, and so its held-out score, then
    depends on which samples it is fitted on."""

    def __init__(self) -> None:
        self.inner = Clusters(120, 0)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        x, y, s, index = self.inner[i]
        return x, (y + i // 2) % 3, s + 0.3 * (i % 3), index


def test_every_probe_gets_the_tasks_parameters_and_the_seed_and_its_numbers_are_kept() -> None:
    """The numbers are the probes' own, called here on the same embeddings with the parameters
    and the seed the tasks give (the seed picks the held-out tenth without a validation split)."""
    from mmviews.eval.extract import extract_embeddings
    from mmviews.eval.metrics import msa_metrics
    from mmviews.eval.probes import knn_accuracy, linear_probe_classification, linear_probe_regression
    from mmviews.eval.retrieval import cross_view_retrieval

    scrambled = DataLoader(Scrambled(), batch_size=8, collate_fn=collate)
    grid = [1e-3, 1.0]
    metrics = evaluate_encoder(
        encoder, scrambled, None, mixed_loader("test"),
        [{"kind": "linear", "weight_decays": grid}, {"kind": "regression", "weight_decays": grid},
         {"kind": "msa", "dataset": "mosi", "weight_decays": grid}, {"kind": "knn", "k": 10, "temperature": 5.0},
         {"kind": "retrieval", "pairs": [["text_0", "audio_1"]], "ks": [2]}],
        seed=5, progress=False)
    train, test = (extract_embeddings(encoder, loader, progress=False) for loader in (scrambled, mixed_loader("test")))
    y, yt = train.labels["class"], test.labels["class"]
    s, st = train.labels["sentiment"], test.labels["sentiment"]

    linear = linear_probe_classification(train.fused, y, None, None, test.fused, yt, seed=5, weight_decays=grid)
    assert linear.val_score != linear_probe_classification(train.fused, y, None, None, test.fused, yt, seed=0,
                                                           weight_decays=grid).val_score  # the seed shows
    assert metrics["test/linear/class/acc"] == linear.metrics["test_acc"]
    assert metrics["val/linear/class/acc"] == linear.val_score
    assert metrics["linear/class/weight_decay"] == linear.weight_decay

    ridge = linear_probe_regression(train.fused, s, None, None, test.fused, st, seed=5, weight_decays=grid)
    assert ridge.metrics["test_mae"] != linear_probe_regression(train.fused, s, None, None, test.fused, st, seed=0,
                                                                weight_decays=grid).metrics["test_mae"]
    for name in ("mae", "mse", "r2"):
        assert metrics[f"test/regression/sentiment/{name}"] == ridge.metrics[f"test_{name}"]
    assert metrics["regression/sentiment/weight_decay"] == ridge.weight_decay
    for name, value in msa_metrics(ridge.predictions, st, "mosi").items():
        assert metrics[f"test/msa/mosi/{name}"] == pytest.approx(value, nan_ok=True), name
    assert metrics["msa/mosi/weight_decay"] == ridge.weight_decay

    knn = knn_accuracy(train.fused, y, test.fused, yt, k=10, temperature=5.0)
    assert knn != knn_accuracy(train.fused, y, test.fused, yt)  # the parameters show
    assert metrics["test/knn/class/top1"] == knn

    retrieval = cross_view_retrieval(test.views, test.mask, 0, 2, ks=[2])
    assert retrieval["n"] == 12  # audio_1 absent from 4 of the 16
    assert {k: v for k, v in metrics.items() if "/retrieval/" in k} == {
        "test/retrieval/text_0->audio_1/n": 12, "test/retrieval/audio_1->text_0/n": 12,
        **{f"test/retrieval/text_0->audio_1/{k[4:]}": v for k, v in retrieval.items() if k.startswith("a2b/")},
        **{f"test/retrieval/audio_1->text_0/{k[4:]}": v for k, v in retrieval.items() if k.startswith("b2a/")}}
    assert "test/retrieval/text_0->audio_1/R@2" in metrics and "test/retrieval/text_0->audio_1/R@1" not in metrics


def without_class(items):
    batch = collate(items)
    del batch.labels["class"]
    return batch


@pytest.mark.parametrize("tasks, missing_in, named", [
    (["linear"], "val", "val"), (["linear"], "test", "test"), (["knn"], "train", "train"),
    (["regression:class"], "val", "val"), (["prototype"], "train", "train"), (["knn"], "test", "test"),
    (["prototype"], "test", "test"),
])
def test_a_label_missing_from_one_split_names_that_split(tasks, missing_in: str, named: str) -> None:
    def split(name: str) -> DataLoader:
        return DataLoader(MixedSplit("valid" if name == "val" else name), batch_size=8, collate_fn=without_class if name == missing_in else collate)

    with pytest.raises(ValueError, match=rf"^label 'class' is not in the {named} batches; they carry \['sentiment'\]$"):
        evaluate_encoder(encoder, split("train"), split("val"),
                         split("test"), tasks, progress=False)


def test_retrieval_and_prototypes_over_several_pairs_give_their_mean_and_its_chance() -> None:
    pairs = [["text_0", "audio_0"], ["text_0", "audio_1"]]
    metrics = evaluate_encoder(encoder, mixed_loader("train"), None, mixed_loader("test"),
                               [{"kind": "retrieval", "pairs": pairs}], progress=False)
    directions = ("text_0->audio_0", "audio_0->text_0", "text_0->audio_1", "audio_1->text_0")
    recalls = [metrics[f"test/retrieval/{d}/R@1"] for d in directions]
    assert len(set(recalls)) > 1  # a mean that tells the directions apart
    assert metrics["test/retrieval/mean/R@1"] == pytest.approx(sum(recalls) / 4)
    # n = 16 pairs with audio_0, 12 with audio_1 (absent from every fourth sample)
    assert metrics["chance/test/retrieval/mean/R@1"] == pytest.approx((1 / 16 + 1 / 16 + 1 / 12 + 1 / 12) / 4)
    # the default ks
    assert {k.rsplit("/", 1)[1] for k in metrics if k.startswith("test/retrieval/text_0->audio_0/")} == {
        "n", "R@1", "R@5", "R@10", "MedR", "MeanR"}


def test_diagnostics_get_the_mask_the_seed_and_the_tasks_parameters(tmp_path: Path) -> None:
    from mmviews.eval.diagnostics import representation_diagnostics
    from mmviews.eval.extract import extract_embeddings

    task = {"kind": "diagnostics", "kappa": 5.0, "max_samples": 10}
    metrics = evaluate_encoder(encoder, None, None, mixed_loader("test"), [task], tmp_path, seed=5, progress=False,
                               plots=False)
    test = extract_embeddings(encoder, mixed_loader("test"), progress=False)
    expected, _ = representation_diagnostics(test.views, test.mask, test.fused, kappa=5.0, max_samples=10, seed=5)
    assert metrics == {f"test/diag/{k}": v for k, v in expected.items()}
    assert expected != representation_diagnostics(test.views, test.mask, test.fused, kappa=5.0, max_samples=10)[0]
    assert expected != representation_diagnostics(test.views, None, test.fused, kappa=5.0, max_samples=10, seed=5)[0]
    assert expected != representation_diagnostics(test.views, test.mask, test.fused, seed=5)[0]
    # plots: false draws no spectrum, the report says which plots it has
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json", "summary.md"]


def test_identifiability_fits_on_the_validation_split_else_on_half_of_the_evaluated_one() -> None:
    from test_eval_identifiability import _loader, _Unmixing

    from mmviews.data import build_dataset
    from mmviews.eval.extract import extract_embeddings
    from mmviews.eval.identifiability import identifiability_metrics

    val = build_dataset("identifiability", split="valid", num_samples=96, num_modalities=2, seed=5)
    test = build_dataset("identifiability", split="test", num_samples=64, num_modalities=2, seed=5)
    encode = _Unmixing(val, slice(0, 5))
    task = {"kind": "identifiability", "blocks": ["content"], "fit_samples": 48}
    fit, score = (extract_embeddings(encode, _loader(ds), progress=False) for ds in (val, test))
    with_val = evaluate_encoder(encode, None, _loader(val), _loader(test), [task], progress=False)
    assert with_val == identifiability_metrics(fit, score, "test", blocks=["content"], fit_samples=48)
    alone = evaluate_encoder(encode, None, None, _loader(test), [task], progress=False)
    assert alone == identifiability_metrics(*_halves(score), "test", blocks=["content"], fit_samples=48)
    assert alone != with_val


def test_a_progress_bar_names_each_split_unless_asked_not_to(capsys) -> None:
    evaluate_encoder(encoder, mixed_loader("train"), mixed_loader("valid"), mixed_loader("test"), ["knn"])
    shown = capsys.readouterr().err
    assert all(f"embeddings ({split})" in shown for split in ("train", "val", "test")), shown
    evaluate_encoder(encoder, mixed_loader("train"), mixed_loader("valid"), None, ["knn"])
    assert "embeddings (val)" in capsys.readouterr().err
    evaluate_encoder(encoder, mixed_loader("train"), mixed_loader("valid"), mixed_loader("test"), ["knn"],
                     progress=False)
    assert "embeddings" not in capsys.readouterr().err


def test_the_default_seed_is_0() -> None:
    from mmviews.eval.extract import extract_embeddings
    from mmviews.eval.probes import linear_probe_classification

    scrambled = DataLoader(Scrambled(), batch_size=8, collate_fn=collate)
    metrics = evaluate_encoder(encoder, scrambled, None, mixed_loader("test"),
                               [{"kind": "linear", "weight_decays": [1e-3, 1.0]}], progress=False)
    train, test = (extract_embeddings(encoder, loader, progress=False) for loader in (scrambled, mixed_loader("test")))
    probe = {seed: linear_probe_classification(train.fused, train.labels["class"], None, None, test.fused,
                                               test.labels["class"], seed=seed, weight_decays=[1e-3, 1.0])
             for seed in (0, 1)}
    assert probe[0].val_score != probe[1].val_score
    assert metrics["val/linear/class/acc"] == probe[0].val_score


def test_the_probes_take_the_views_fused_as_asked() -> None:
    from mmviews.eval.extract import extract_embeddings
    from mmviews.eval.probes import knn_accuracy

    scrambled = DataLoader(Scrambled(), batch_size=8, collate_fn=collate)
    task = {"kind": "knn", "k": 10, "temperature": 5.0}
    metrics = evaluate_encoder(encoder, scrambled, None, mixed_loader("test"), [task], fuse="mean", progress=False)
    knn = {fuse: knn_accuracy(*(t for loader in (scrambled, mixed_loader("test"))
                                for e in [extract_embeddings(encoder, loader, fuse=fuse, progress=False)]
                                for t in (e.fused, e.labels["class"])), k=10, temperature=5.0)
           for fuse in ("mean", "concat")}
    assert knn["mean"] != knn["concat"]
    assert metrics["test/knn/class/top1"] == knn["mean"]


# --- the labels the tasks read, checked before any split is embedded -------------------------------


class _Samples(Dataset):
    """Samples of the mmviews form (a ``labels`` mapping); reading one is counted."""

    def __init__(self, labels: dict | None, n: int = 3) -> None:
        self.labels, self.n, self.read = labels, n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self.read += 1
        return {"x": torch.zeros(2)} if self.labels is None else {"x": torch.zeros(2), "labels": dict(self.labels)}


def _loader(dataset: Dataset) -> DataLoader:
    return DataLoader(dataset, batch_size=2)


def test_a_label_one_split_lacks_is_named_with_the_split_the_hint_and_the_labels_there_are():
    loaders = {"train": _loader(_Samples({"class": 1, "sentiment": 0.5})),
               "test": _loader(_Samples({"sentiment": 0.5, "clas": 0}))}
    with pytest.raises(ValueError) as caught:
        evaluate.check_task_labels(parse_tasks(["retrieval", "knn:class"]), loaders)
    assert str(caught.value) == ("task 'knn:class' reads the label 'class', which the samples of the test split do "
                                 "not carry (did you mean 'clas'?); they carry ['clas', 'sentiment']")
    # a split without a label at all says so
    with pytest.raises(ValueError, match=r"^task 'linear:class' reads the label 'class', which the samples of the "
                                         r"train split do not carry; they carry no labels$"):
        evaluate.check_task_labels(parse_tasks(["linear"]), {"train": _loader(_Samples({}))})


def test_labels_every_split_carries_pass_and_only_the_first_sample_is_read():
    train, test = _Samples({"class": 1, "sentiment": 0.5}), _Samples({"class": 0, "sentiment": 0.1})
    evaluate.check_task_labels(parse_tasks(["linear", "regression", "knn:class"]),
                               {"train": _loader(train), "test": _loader(test)})
    assert (train.read, test.read) == (1, 1)


def test_tasks_without_labels_and_samples_of_another_form_read_or_check_nothing():
    unread = _Samples({"sentiment": 0.5})
    evaluate.check_task_labels(parse_tasks(["retrieval", "diagnostics"]), {"test": _loader(unread)})
    assert unread.read == 0  # no task reads a label: no sample is read
    # samples without a labels mapping (a caller's collator adds the labels) are not checked
    evaluate.check_task_labels(parse_tasks(["knn:class"]), {"test": _loader(_Samples(None))})

    class Tuples(_Samples):
        def __getitem__(self, i: int):
            return torch.zeros(2), 1

    evaluate.check_task_labels(parse_tasks(["knn:class"]), {"test": _loader(Tuples({}))})

    class Endless(torch.utils.data.IterableDataset):  # a caller's iterable split, without a length
        def __iter__(self):
            yield {"labels": {}}

    evaluate.check_task_labels(parse_tasks(["knn:class"]), {"test": _loader(Endless()), "val": object()})


def test_a_split_that_cannot_be_checked_leaves_the_next_ones_checked():
    class Tuples(_Samples):
        def __getitem__(self, i: int):
            return torch.zeros(2), 1

    class Endless(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"labels": {}}

    lacking = _loader(_Samples({"sentiment": 0.5}))
    for first in (object(), _loader(Endless()), _loader(Tuples({})), _loader(_Samples(None))):
        with pytest.raises(ValueError, match=r"^task 'knn:class' reads the label 'class', which the samples of the "
                                             r"test split do not carry"):
            evaluate.check_task_labels(parse_tasks(["knn:class"]), {"train": first, "test": lacking})
