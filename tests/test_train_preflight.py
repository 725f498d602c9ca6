"""Unit guards of mmviews.train.preflight (``mmviews train RECIPE --check``), in process on a
real built run (:func:`mmviews.train.build_run` of a tiny saved DatasetDict, and of the same
written as Parquet shards and streamed): which splits are checked, with which samples and
collators and under which recipe key, and the whole one-line messages of the checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmviews.config import ConfigError, load_config
from mmviews.train import build_run
from mmviews.train import preflight

SEQUENCE_ADAPTER = "{type: feature_sequence, input_dim: 2}"


@pytest.fixture(scope="module")
def splits_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train, valid and test splits, 8 rows each: ``seq`` a [3, 2] sequence, ``vec`` a [2]
    vector, ``label`` a class, ``nan`` a [3, 2] sequence with a NaN in its first row; each
    split's first ``seq`` row starts with the split's number (0, 1, 2), so that a test can tell
    which split's samples it got."""
    import datasets

    def rows(first: float) -> datasets.Dataset:
        seq = [[[first, 1.0]] * 3] + [[[0.5, 1.0]] * 3] * 7
        nan = [[[float("nan"), 1.0]] * 3] + [[[0.5, 1.0]] * 3] * 7
        return datasets.Dataset.from_dict({"vec": [[0.0, 1.0]] * 8, "seq": seq, "nan": nan, "label": [0, 1] * 4})

    root = tmp_path_factory.mktemp("preflight_splits") / "disk"
    datasets.DatasetDict({"train": rows(0.0), "valid": rows(1.0), "test": rows(2.0)}).save_to_disk(str(root))
    return root


def built(tmp_path: Path, root: Path, *, val_split: str | None = "valid", options: str = "",
          split_options: str = "{}", tasks: str = "['linear:class']", views: str = "[{modality: rows, copies: 2}]",
          adapters: str = f"{{rows: {SEQUENCE_ADAPTER}}}", data: str = "") -> Any:
    """The built run of a recipe over ``root`` (``options`` adds to the dataset's options,
    ``data`` to the ``data`` section)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""name: preflight
data: {{name: hf, root: {root}, options: {{columns: {{rows: seq}}, labels: {{class: label}}{options}}},
        train_split: train, val_split: {val_split or 'null'}, test_split: test, batch_size: 4,
        split_options: {split_options}{data}}}
views: {views}
adapters: {adapters}
evaluation: {{tasks: {tasks}}}
""")
    return build_run(load_config(recipe), source=str(recipe))


def error_of(check: preflight.Check, parts: Any) -> str:
    """The one-line message of the ConfigError ``check`` raises on ``parts`` (recipe ``r.yaml``)."""
    with pytest.raises(ConfigError) as raised:
        check(parts, "r.yaml")
    return str(raised.value)


def first_value(sample: dict[str, Any]) -> float:
    return float(torch.as_tensor(sample["modalities"]["rows"])[0, 0])


# ---------------------------------------------------------------------------------------------
# Which splits are checked, with what
# ---------------------------------------------------------------------------------------------
def test_every_split_is_checked_with_its_own_samples_collator_and_key(tmp_path: Path, splits_root: Path) -> None:
    parts = built(tmp_path, splits_root)
    splits = list(preflight._splits(parts))
    assert [(name, key) for name, key, _, _ in splits] == [
        ("train", "data.train_split"), ("train (evaluation)", "data.train_split"),
        ("valid (evaluation)", "data.val_split"), ("test (evaluation)", "data.test_split")]
    # the training split through the training collator, the others through their loaders' own
    assert splits[0][2] is parts.datasets["train"] and splits[0][3] is parts.collator
    for (_, _, dataset, collate), role in zip(splits[1:], ("train", "val", "test")):
        assert dataset is parts.eval_loaders[role].dataset and collate is parts.eval_loaders[role].collate_fn
    # each split's own samples: the first rows start with 0 (train), 1 (valid), 2 (test)
    assert [first_value(preflight._first_samples(dataset)[0]) for _, _, dataset, _ in splits] == [0.0, 0.0, 1.0, 2.0]
    assert len(preflight._first_samples(splits[2][2])) == preflight.CHECK_BATCH_SAMPLES == 2


def test_a_recipe_without_a_validation_split_checks_the_others(tmp_path: Path, splits_root: Path) -> None:
    parts = built(tmp_path, splits_root, val_split=None)
    assert [name for name, _, _, _ in preflight._splits(parts)] == ["train", "train (evaluation)", "test (evaluation)"]


@pytest.fixture(scope="module")
def streamed_root(splits_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``splits_root`` as a Parquet shard folder (``mmviews prepare hf --format parquet``), for
    ``data.streaming: true``."""
    from test_data_shards import prepare

    out = tmp_path_factory.mktemp("preflight_streamed") / "shards"
    r = prepare("hf", str(splits_root), "--format", "parquet", "--columns", "seq=seq,vec=vec,nan=nan",
                "--labels", "label=label", "--output", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_a_streamed_run_checks_every_split_through_its_stream(tmp_path: Path, streamed_root: Path) -> None:
    """Streamed splits cannot be indexed: each is read through its stream, the training split
    (whose labels the probes train on) under its evaluation loader too."""
    parts = built(tmp_path, streamed_root, data=", streaming: true")
    splits = list(preflight._splits(parts))
    assert [(name, key) for name, key, _, _ in splits] == [
        ("train", "data.train_split"), ("train (evaluation)", "data.train_split"),
        ("valid (evaluation)", "data.val_split"), ("test (evaluation)", "data.test_split")]
    assert all(getattr(dataset, "streamed", False) for _, _, dataset, _ in splits)
    assert splits[0][2] is parts.datasets["train"] and splits[0][3] is parts.collator
    for (_, _, dataset, collate), role in zip(splits[1:], ("train", "val", "test")):
        assert dataset is parts.eval_loaders[role].dataset and collate is parts.eval_loaders[role].collate_fn
    firsts = [preflight._first_samples(dataset) for _, _, dataset, _ in splits]
    assert [first_value(samples[0]) for samples in firsts] == [0.0, 0.0, 1.0, 2.0]
    assert [len(samples) for samples in firsts] == [preflight.CHECK_BATCH_SAMPLES] * 4
    assert all(samples[0]["labels"] == {"class": 0} for samples in firsts)
    preflight.run_checks(parts, "r.yaml")  # the default checks pass on a sound streamed recipe


def test_the_checks_run_in_order_and_run_checks_takes_its_own_list(tmp_path: Path, splits_root: Path) -> None:
    assert preflight.CHECKS == [preflight.check_view_modalities, preflight.check_batches_forward,
                                preflight.check_evaluation_labels]
    parts = built(tmp_path, splits_root)
    calls: list[tuple[Any, str]] = []
    preflight.run_checks(parts, "r.yaml", [lambda p, s: calls.append((p, s))])
    assert calls == [(parts, "r.yaml")]
    preflight.run_checks(parts, "r.yaml")  # the default checks pass on a sound recipe


# ---------------------------------------------------------------------------------------------
# The messages, whole
# ---------------------------------------------------------------------------------------------
def test_a_label_no_sample_carries_names_a_task_without_one(tmp_path: Path, splits_root: Path) -> None:
    parts = built(tmp_path, splits_root, split_options="{test: {labels: {}}}")
    assert error_of(preflight.check_evaluation_labels, parts) == (
        "r.yaml: key 'evaluation.tasks.0' = 'linear:class': task 'linear' reads the label 'class', which the samples "
        "of split 'test' do not carry; they carry no labels: use a task without a label, e.g. 'retrieval', or map the "
        "label to a dataset column (data.options.labels: {class: <column>})")


def test_a_recipe_without_tasks_checks_no_labels(tmp_path: Path, splits_root: Path) -> None:
    parts = built(tmp_path, splits_root, split_options="{test: {labels: {}}}", tasks="[]")
    preflight.check_evaluation_labels(parts, "r.yaml")  # nothing to read, nothing to report


def test_a_modality_missing_from_a_split_names_the_view_and_the_split(tmp_path: Path, splits_root: Path) -> None:
    parts = built(tmp_path, splits_root, split_options="{valid: {columns: {other: seq}}}")
    assert error_of(preflight.check_view_modalities, parts) == (
        "r.yaml: key 'views.0.modality' = 'rows': the samples of split 'valid (evaluation)' have no modality 'rows'; "
        "they have ['other']: use one of them, or map a dataset column to it (data.options.columns: {rows: <column>})")


def test_a_bare_string_view_and_a_mistyped_modality(tmp_path: Path, splits_root: Path) -> None:
    parts = built(tmp_path, splits_root, views="[rows, rows]", split_options="{valid: {columns: {other: seq}}}")
    assert error_of(preflight.check_view_modalities, parts).startswith(
        "r.yaml: key 'views.0' = 'rows': the samples of split 'valid (evaluation)' have no modality 'rows'; they have "
        "['other']")
    parts = built(tmp_path, splits_root, views="[{modality: row, copies: 2}]", adapters=f"{{row: {SEQUENCE_ADAPTER}}}")
    assert error_of(preflight.check_view_modalities, parts) == (
        "r.yaml: key 'views.0.modality' = 'row': the samples of split 'train' have no modality 'row' (did you mean "
        "'rows'?); they have ['rows']: use one of them, or map a dataset column to it (data.options.columns: "
        "{row: <column>})")


def test_a_vector_column_for_a_sequence_adapter_gets_the_shape_hint(tmp_path: Path, splits_root: Path) -> None:
    parts = built(tmp_path, splits_root, split_options="{test: {columns: {rows: vec}}}")
    parts.encoder.train()
    message = error_of(preflight.check_batches_forward, parts)
    assert message.startswith("r.yaml: key 'adapters.rows' (type 'feature_sequence'): the 'rows' inputs of a batch of "
                              "split 'test (evaluation)' (values [2, 2]")
    assert message.endswith(
        "; the column behind 'rows' holds one [D] = [2] vector per sample, read as a waveform, whereas adapter type "
        "'feature_sequence' reads an [L, D] sequence per sample: store each value as a list of rows ([[...]], shape "
        "[1, 2]), or map an [L, D] column in data.options.columns")
    assert parts.encoder.training  # the check puts the encoder back in the mode it found
    parts.encoder.eval()
    assert error_of(preflight.check_batches_forward, parts) == message
    assert not parts.encoder.training


def test_a_training_batch_the_adapters_input_check_rejects_names_the_training_split(tmp_path: Path,
                                                                                   splits_root: Path) -> None:
    """The training batch goes through the encoder's host preparation (the adapters' input checks),
    as the trainer's loader does: a NaN there is the training split's, not the adapter's."""
    parts = built(tmp_path, splits_root, split_options="{train: {columns: {rows: nan}}}")
    assert error_of(preflight.check_batches_forward, parts) == (
        "r.yaml: key 'data.train_split' = 'train': a batch of its first 2 samples cannot be collated: modality "
        # the first sample's 3 NaNs (one per row), in each of its 2 views; 2 samples x 2 views = 4 rows
        "'rows': feature_sequence adapter: 6 non-finite value(s) (NaN/inf) in inputs['values'] of shape (4, 3, 2)")


def test_an_evaluation_batch_is_checked_by_the_adapter_itself(tmp_path: Path, splits_root: Path) -> None:
    """An evaluation loader's batch has no host preparation: the adapter's own input check runs
    on it (a NaN would otherwise pass the check and spoil the final evaluation)."""
    parts = built(tmp_path, splits_root, split_options="{test: {columns: {rows: nan}}}")
    assert error_of(preflight.check_batches_forward, parts) == (
        "r.yaml: key 'adapters.rows' (type 'feature_sequence'): the 'rows' inputs of a batch of split 'test "
        # one view per sample in evaluation: the first sample's 3 NaNs, in a [2, 3, 2] batch (and a length each)
        "(evaluation)' (values [2, 3, 2], lengths [2]) fail in the adapter: feature_sequence adapter: 3 non-finite value(s) "
        "(NaN/inf) in inputs['values'] of shape (2, 3, 2)")


def test_an_adapter_error_without_a_message_is_named_by_its_type(tmp_path: Path, splits_root: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    parts = built(tmp_path, splits_root)

    def fail_without_message(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError()

    monkeypatch.setattr(parts.encoder.adapters["rows"], "embed_present", fail_without_message)
    assert error_of(preflight.check_batches_forward, parts) == (
        "r.yaml: key 'adapters.rows' (type 'feature_sequence'): the 'rows' inputs of a batch of split 'train' "
        "(values [4, 3, 2], lengths [4]) fail in the adapter: RuntimeError")


def test_describe_inputs_lists_tensors_and_lists() -> None:
    inputs = {"values": torch.zeros(4, 3, 2), "text": ["a", "b"], "mask": None}
    assert preflight._describe_inputs(inputs) == "values [4, 3, 2], text: list of 2"
    assert preflight._describe_inputs({"mask": None}) == "no tensors"
    assert preflight._describe_inputs(torch.zeros(2)) == "Tensor"


@pytest.mark.parametrize("adapter_type", ["mlp", "feature_sequence"])
def test_shape_hint_for_vectors_given_to_a_sequence_adapter(adapter_type: str) -> None:
    hint = preflight._shape_hint("rows", adapter_type, {"values": torch.zeros(4, 3)})
    assert hint == (f"; the column behind 'rows' holds one [D] = [3] vector per sample, read as a waveform, whereas "
                    f"adapter type {adapter_type!r} reads an [L, D] sequence per sample: store each value as a list of "
                    "rows ([[...]], shape [1, 3]), or map an [L, D] column in data.options.columns")


@pytest.mark.parametrize("adapter_type,inputs", [
    ("small_cnn", {"values": torch.zeros(4, 3)}),  # an adapter that does not read sequences
    ("mlp", {"values": torch.zeros(4, 5, 3)}),  # already [B, L, D]
    ("mlp", {"ids": torch.zeros(4, 3)}),  # no values
    ("mlp", {"values": [[0.0] * 3] * 4}),  # not a tensor
    ("mlp", torch.zeros(4, 3)),  # not a dict of inputs
])
def test_no_shape_hint_otherwise(adapter_type: str, inputs: Any) -> None:
    assert preflight._shape_hint("rows", adapter_type, inputs) == ""


def test_an_empty_split_is_passed_over_and_the_next_one_checked(tmp_path: Path) -> None:
    """A split with no samples has nothing to check; the split after it still is checked (here
    the test split, whose samples lack the audio of a view)."""
    from test_train_utils import tiny_config, write_recipe

    raw = tiny_config(text=False, num_samples=8, batch_size=4)
    raw["views"] = [{"modality": "image"}, {"modality": "image"}, {"modality": "audio"}]  # no augmentation to import
    raw["data"].update(val_split="valid", test_split="test")
    raw["data"]["split_options"] = {"valid": {"num_samples": 0}, "test": {"num_samples": 4, "modalities": ["image"]}}
    parts = build_run(load_config(write_recipe(tmp_path / "r.yaml", raw)))
    assert [len(dataset) for _, _, dataset, _ in preflight._splits(parts)] == [8, 8, 0, 4]
    assert error_of(preflight.check_view_modalities, parts).startswith(
        "r.yaml: key 'views.2.modality' = 'audio': the samples of split 'test (evaluation)' have no modality 'audio'")
    collated = error_of(preflight.check_batches_forward, parts)
    assert collated.startswith("r.yaml: key 'data.test_split' = 'test': a batch of its first 2 samples cannot be "
                               "collated: ") and "sample 0 has no modality 'audio'" in collated
