"""``mmviews train RECIPE --check`` reports recipe errors by their key before anything is built:
a split name the dataset does not have (``data.train_split`` / ``val_split`` / ``test_split``,
with the dataset's splits) and a tracker in ``output.trackers`` whose package is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
from crafted_files import cli, one_line_error

from mmviews.config import DataConfig
from mmviews.data.loaders import build_dataset_split
from mmviews.train.trackers import tracker_installed

SYNTHETIC_SPLITS = "choose from ['test', 'train', 'valid']"


@pytest.mark.parametrize("key", ["data.train_split", "data.val_split", "data.test_split"])
def test_unknown_split_names_its_key_and_the_splits(capsys: pytest.CaptureFixture[str], key: str) -> None:
    rc, _, err = cli(capsys, "train", "quickstart", "--check", "--set", f"{key}=nope")
    line = one_line_error(err)
    assert rc == 2
    assert f"key '{key}' = 'nope': synthetic: unknown split 'nope'; {SYNTHETIC_SPLITS}" in line


def test_a_split_named_by_two_keys_names_both(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(capsys, "train", "quickstart", "--check", "--set", "data.val_split=nope",
                     "--set", "data.test_split=nope")
    assert rc == 2 and "keys 'data.val_split'/'data.test_split' = 'nope': synthetic: unknown split 'nope'" in one_line_error(err)


def test_a_datasets_key_error_keeps_its_type_and_gains_the_key(tmp_path: Path) -> None:
    """hf datasets report a missing split as a KeyError; callers that catch it still can."""
    import datasets  # a declared dependency: its absence is a failure, not a skip
    root = tmp_path / "disk"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": [[0.0, 1.0]] * 4})}).save_to_disk(str(root))
    data = DataConfig(name="hf", root=str(root), options={"columns": {"x": "x"}}, val_split="dev")
    with pytest.raises(KeyError) as raised:
        build_dataset_split(data, "dev")
    assert raised.type is KeyError
    assert raised.value.args[0].startswith(f"key 'data.val_split' = 'dev': {root}: no split 'dev'; available:")
    assert len(build_dataset_split(data, "train")) == 4  # the split the recipe has still loads


def test_check_reports_a_tracker_that_is_not_installed(capsys: pytest.CaptureFixture[str]) -> None:
    missing = next((n for n in ("aim", "clearml", "swanlab", "dvclive") if not tracker_installed(n)), None)
    if missing is None:
        pytest.skip("every candidate tracker is installed here")
    rc, out, err = cli(capsys, "train", "quickstart", "--check", "--set", f"output.trackers=[{missing}]")
    line = one_line_error(err)
    assert rc == 2 and "OK" not in out
    assert f"key 'output.trackers': tracker '{missing}' is not installed (pip install {missing})" in line
    assert "quickstart.yaml" in line


@pytest.mark.parametrize("tracker, modules", [("tensorboard", ("tensorboard", "tensorboardX")), ("mlflow", ("mlflow",)),
                                               ("wandb", ("wandb",))])
def test_check_names_the_trackers_extra(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                           tracker: str, modules: tuple[str, ...]) -> None:
    """TensorBoard, MLflow and W&B come with the ``mmviews[<tracker>]`` extras: the error says so.
    Their absence is simulated (they are installed in CI) by hiding their modules from ``find_spec``."""
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def find_spec_without_tracker(name: str, *args: object, **kwargs: object) -> object:
        return None if name in modules else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec_without_tracker)
    rc, _, err = cli(capsys, "train", "quickstart", "--check", "--set", f"output.trackers=[{tracker}]")
    assert rc == 2
    assert f"key 'output.trackers': tracker '{tracker}' is not installed (pip install 'mmviews[{tracker}]')" in \
        one_line_error(err)


def test_check_passes_with_an_installed_tracker(capsys: pytest.CaptureFixture[str]) -> None:
    if not tracker_installed("tensorboard"):
        pytest.skip("tensorboard (the mmviews[tensorboard] extra) is not installed")
    rc, out, _ = cli(capsys, "train", "quickstart", "--check", "--set", "output.trackers=[tensorboard]")
    assert rc == 0 and "OK" in out


def test_a_missing_tracker_is_a_config_error_before_the_run_folder(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Without --check, the command stops on the tracker before it builds or writes anything."""
    missing = next((n for n in ("aim", "clearml", "swanlab", "dvclive") if not tracker_installed(n)), None)
    if missing is None:
        pytest.skip("every candidate tracker is installed here")
    import mmviews.cli.train as train_command

    def must_not_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("build_run/train reached although a tracker is missing")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_command, "train", must_not_build)
        patch.setattr(train_command, "build_run", must_not_build)
        rc, _, err = cli(capsys, "train", "quickstart", "--set", f"output.trackers=[{missing}]",
                         "--output", str(tmp_path / "run"))
    assert rc == 2 and "key 'output.trackers'" in one_line_error(err)
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def rows_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import datasets  # a declared dependency: its absence is a failure, not a skip
    root = tmp_path_factory.mktemp("hf_rows") / "disk"
    train = datasets.Dataset.from_dict({"rows": [[0.0, 1.0]] * 4, "label": [0, 1, 0, 1]})
    datasets.DatasetDict({"train": train, "test": train}).save_to_disk(str(root))
    return root


@pytest.mark.parametrize("options,key", [
    ({"columns": {"x": "row"}}, "data.options.columns"),  # a user's case: a wrong column name
    ({"columns": {"x": "rows"}, "labels": {"class": "lable"}}, "data.options.labels"),
    ({"columns": {"x": "rows"}, "format": "parquet-ish"}, "data.options.format"),
    ({"columns": {"x": "rows"}, "on_error": "ignore"}, "data.options.on_error"),
])
def test_a_wrong_dataset_option_is_reported_under_its_own_key(rows_dataset: Path, options: dict, key: str) -> None:
    data = DataConfig(name="hf", root=str(rows_dataset), options=options, test_split="test")
    with pytest.raises((KeyError, ValueError)) as raised:
        build_dataset_split(data, "train")
    message = raised.value.args[0]
    assert message.startswith(f"key '{key}': "), message
    assert "train_split" not in message


def test_option_set_per_split_and_root_errors_name_their_keys() -> None:
    data = DataConfig(name="synthetic", split_options={"train": {"num_classes": 99}})
    with pytest.raises(ValueError, match=r"^key 'data.split_options.train.num_classes': num_classes must be in"):
        build_dataset_split(data, "train")
    data = DataConfig(name="synthetic", options={"modalities": ["smell"]})
    with pytest.raises(ValueError, match=r"^key 'data.options.modalities': unknown modalities \['smell'\]"):
        build_dataset_split(data, "valid")
    with pytest.raises(ValueError, match=r"^key 'data.root' = None: hf: pass root="):
        build_dataset_split(DataConfig(name="hf"), "train")
    with pytest.raises(ValueError, match=r"^key 'data.options.sigma0': gaussian_latents: need"):
        build_dataset_split(DataConfig(name="gaussian_latents", options={"sigma0": -1.0}), "train")


def test_a_dataset_option_of_the_wrong_type_is_one_line_naming_its_key(capsys: pytest.CaptureFixture[str]) -> None:
    """`--set data.options.num_classes=four --check` was a 29-line TypeError traceback
    from inside the dataset; the options are typed by the dataset's own annotations."""
    rc, out, err = cli(capsys, "train", "quickstart", "--check", "--set", "data.options.num_classes=four")
    assert rc == 2 and "OK" not in out and "Traceback" not in err
    assert one_line_error(err) == "mmviews train: error: key 'data.options.num_classes': expected int, got str 'four'"


@pytest.mark.parametrize("data,message", [
    (DataConfig(name="synthetic", split_options={"train": {"num_samples": "many"}}),
     "key 'data.split_options.train.num_samples': expected int, got str 'many'"),
    (DataConfig(name="synthetic", options={"modalities": "text"}),
     "key 'data.options.modalities': expected a list, got str 'text'"),
    (DataConfig(name="synthetic", options={"missing_rate": {"text": "half"}}),
     "key 'data.options.missing_rate': expected float or Mapping, got dict {'text': 'half'}"),
    (DataConfig(name="identifiability", options={"statistical_dependence": "yes please"}),
     "key 'data.options.statistical_dependence': expected bool, got str 'yes please'"),
    (DataConfig(name="hf", root="/", options={"columns": {"x": 3}}),
     "key 'data.options.columns.x': expected str, got int 3"),
])
def test_dataset_options_are_checked_against_the_datasets_annotations(data: DataConfig, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        build_dataset_split(data, "train")
    assert str(raised.value) == message


def test_an_option_left_from_the_recipes_dataset_says_to_drop_it(capsys, tmp_path: Path) -> None:
    """`--set data.name=hf` over the quickstart kept its synthetic split_options
    (num_samples), and the hf dataset failed on them without saying to drop them."""
    root = _image_folder(tmp_path / "images", label_folders=True)
    rc, out, err = cli(capsys, "train", "quickstart", "--check", "--set", "data.name=hf", "--set", f"data.root={root}",
                       "--set", "data.options={format: imagefolder, image_size: 8}")
    line = one_line_error(err)
    assert rc == 2 and "OK" not in out
    assert line.startswith("mmviews train: error: key 'data.split_options.train.num_samples': dataset 'hf' has no "
                           "option 'num_samples' (an option of 'gaussian_latents', 'identifiability', 'synthetic': left "
                           "from the recipe's dataset?); drop it: remove it from the recipe, or replace the section, "
                           "--set data.split_options.train={...} ({} for none); the options of 'hf': audio, "), line
    # a misspelt option gets the spelling instead
    data = DataConfig(name="hf", root=str(root), options={"image_sise": 8})
    with pytest.raises(ValueError, match=r"^key 'data.options.image_sise': dataset 'hf' has no option 'image_sise' "
                                         r"\(did you mean 'image_size'\?\); the options of 'hf': audio, "):
        build_dataset_split(data, "train")


def test_dataset_options_of_the_right_type_reach_the_dataset_as_checked() -> None:
    """Right values pass, per split too; an annotation the recipe types do not cover (the video
    size's tuple) is left to the dataset, which refuses what it cannot take itself."""
    data = DataConfig(name="synthetic", options={"missing_rate": "1e-1", "num_classes": 3},
                      split_options={"valid": {"num_samples": 8}})
    dataset = build_dataset_split(data, "valid")
    assert len(dataset) == 8 and dataset.num_classes == 3


def test_wrong_column_through_the_command_line(capsys: pytest.CaptureFixture[str], rows_dataset: Path,
                                               tmp_path: Path) -> None:
    recipe = tmp_path / "rows.yaml"
    recipe.write_text(f"""name: rows
data: {{name: hf, root: {rows_dataset}, options: {{columns: {{rows: row}}}}, train_split: train, val_split: null,
        test_split: test, batch_size: 4}}
views: [{{modality: rows, copies: 2, augment: seq_noise}}]
adapters: {{rows: {{type: mlp, input_dim: 2}}}}
""")
    rc, _, err = cli(capsys, "train", str(recipe), "--check")
    line = one_line_error(err)
    assert rc == 2 and "key 'data.options.columns': " in line and "has no column 'row' (for 'rows')" in line
    assert "train_split" not in line


# ---------------------------------------------------------------------------------------------
# What training would find in its first step or at its end, --check finds (mmviews.train.preflight):
# each message names the recipe key to change and a value that would work.
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vectors_and_sequences(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved DatasetDict: ``vec`` holds one [2] vector per sample, ``seq`` a [3, 2] sequence."""
    import datasets

    root = tmp_path_factory.mktemp("hf_vec_seq") / "disk"
    rows = datasets.Dataset.from_dict({"vec": [[0.0, 1.0]] * 8, "seq": [[[0.0, 1.0]] * 3] * 8, "label": [0, 1] * 4})
    datasets.DatasetDict({"train": rows, "test": rows}).save_to_disk(str(root))
    return root


def _recipe(tmp_path: Path, root: Path, columns: str, views: str, adapters: str, tasks: str = "[linear:class]") -> Path:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""name: check
data: {{name: hf, root: {root}, options: {{columns: {columns}, labels: {{class: label}}}}, train_split: train,
        val_split: null, test_split: test, batch_size: 4}}
views: {views}
adapters: {adapters}
evaluation: {{tasks: {tasks}}}
""")
    return recipe


SEQUENCE_ADAPTER = "{type: feature_sequence, input_dim: 2}"


def test_check_finds_a_view_whose_modality_has_no_column(capsys, tmp_path: Path, vectors_and_sequences: Path) -> None:
    recipe = _recipe(tmp_path, vectors_and_sequences, "{rows: seq}", "[{modality: rows}, {modality: signal}]",
                     f"{{rows: {SEQUENCE_ADAPTER}, signal: {SEQUENCE_ADAPTER}}}")
    rc, out, err = cli(capsys, "train", str(recipe), "--check")
    line = one_line_error(err)
    assert rc == 2 and "OK" not in out
    assert "key 'views.1.modality' = 'signal': the samples of split 'train' have no modality 'signal'" in line
    assert "they have ['rows']" in line and "data.options.columns: {signal: <column>}" in line


def test_check_finds_a_vector_column_for_a_sequence_adapter(capsys, tmp_path: Path,
                                                            vectors_and_sequences: Path) -> None:
    recipe = _recipe(tmp_path, vectors_and_sequences, "{rows: vec}", "[{modality: rows, copies: 2}]",
                     f"{{rows: {SEQUENCE_ADAPTER}}}")
    rc, out, err = cli(capsys, "train", str(recipe), "--check")
    line = one_line_error(err)
    assert rc == 2 and "OK" not in out
    assert "key 'adapters.rows' (type 'feature_sequence'): the 'rows' inputs of a batch of split 'train' (values [4, 2]" \
        in line
    assert "values must be [B, L, D]" in line and "[[...]], shape [1, 2]" in line
    # the value it names works: the [L, D] column passes
    good = _recipe(tmp_path, vectors_and_sequences, "{rows: seq}", "[{modality: rows, copies: 2}]",
                   f"{{rows: {SEQUENCE_ADAPTER}}}")
    rc, out, _ = cli(capsys, "train", str(good), "--check")
    assert rc == 0 and "OK" in out


def test_check_finds_an_evaluation_label_the_data_lacks(capsys, tmp_path: Path, vectors_and_sequences: Path) -> None:
    recipe = _recipe(tmp_path, vectors_and_sequences, "{rows: seq}", "[{modality: rows, copies: 2}]",
                     f"{{rows: {SEQUENCE_ADAPTER}}}", tasks="[retrieval, 'linear:clas']")
    rc, out, err = cli(capsys, "train", str(recipe), "--check")
    line = one_line_error(err)
    assert rc == 2 and "OK" not in out
    assert "key 'evaluation.tasks.1' = 'linear:clas': task 'linear' reads the label 'clas', which the samples of " \
           "split 'train' do not carry (did you mean 'class'?); they carry ['class']: use e.g. 'linear:class'" in line


@pytest.mark.parametrize("args,expected", [
    (["quickstrat"], "recipe 'quickstrat' not found (did you mean 'quickstart'?)"),
    (["quickstart", "--set", "optimisation.epoch=3"],
     "--set 'optimisation.epoch=3': unknown key 'optimisation.epoch' (did you mean 'epochs'?)"),
    (["quickstart", "--set", "objective.name=mv_dhell"],
     "--set 'objective.name=mv_dhell': key 'objective.name': unknown objective 'mv_dhell' (did you mean 'mv_dhel'?)"),
    (["quickstart", "--set", "optimisation.epochs=0"], "--set 'optimisation.epochs=0': key 'optimisation.epochs': must be >= 1"),
    (["quickstart", "--set", "data.batch_size=4096"], "--set 'data.batch_size=4096': key 'data.batch_size': the 'train' split"),
])
def test_did_you_mean_and_the_set_at_fault(capsys, args: list[str], expected: str) -> None:
    rc, _, err = cli(capsys, "train", *args, "--check")
    line = one_line_error(err)
    assert rc == 2 and expected in line, line
    assert "quickstart.yaml" not in line  # the --set (or the name) is at fault, not the recipe file


def test_an_unknown_key_in_the_file_gets_a_suggestion(tmp_path: Path) -> None:
    from mmviews.config import ConfigError, load_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\noptimisation: {epoch: 3}\n")
    with pytest.raises(ConfigError, match=r"r\.yaml: unknown key 'optimisation\.epoch' \(did you mean 'epochs'\?\)"):
        load_config(recipe)


# ---------------------------------------------------------------------------------------------
# Every split is checked, each with its own samples: a fault in the validation split alone, or in
# the test split alone, is found and named (the training split is fine in each case).
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def three_splits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved DatasetDict with train, valid and test splits, each with a [3, 2] sequence column
    ``seq``, a [2] vector column ``vec`` and a ``label`` column."""
    import datasets

    root = tmp_path_factory.mktemp("hf_three_splits") / "disk"
    rows = datasets.Dataset.from_dict({"vec": [[0.0, 1.0]] * 8, "seq": [[[0.0, 1.0]] * 3] * 8, "label": [0, 1] * 4})
    datasets.DatasetDict({"train": rows, "valid": rows, "test": rows}).save_to_disk(str(root))
    return root


def _split_recipe(tmp_path: Path, root: Path, faulty: str, fault: str, streaming: bool = False) -> Path:
    """Two views of ``seq`` through a sequence adapter and a linear probe of ``class``; the split
    ``faulty`` gets ``fault``'s options: another modality, a vector column, or its label under
    another name. ``streaming``: ``root`` is a Parquet shard folder, read as ``data.streaming: true``."""
    split_fault = {"modality": "{columns: {other: seq}}", "shape": "{columns: {rows: vec}}",
                   "label": "{labels: {grade: label}}"}[fault]
    recipe = tmp_path / f"{faulty}-{fault}.yaml"
    recipe.write_text(f"""name: splits
data: {{name: hf, root: {root}, options: {{columns: {{rows: seq}}, labels: {{class: label}}}}, train_split: train,
        val_split: valid, test_split: test, batch_size: 4, split_options: {{{faulty}: {split_fault}}},
        streaming: {str(streaming).lower()}}}
views: [{{modality: rows, copies: 2}}]
adapters: {{rows: {SEQUENCE_ADAPTER}}}
evaluation: {{tasks: ['linear:class']}}
""")
    return recipe


def test_check_passes_when_every_split_is_sound(capsys, tmp_path: Path, three_splits: Path) -> None:
    recipe = _split_recipe(tmp_path, three_splits, "valid", "label")
    recipe.write_text(recipe.read_text().replace(", split_options: {valid: {labels: {grade: label}}}", ""))
    rc, out, err = cli(capsys, "train", str(recipe), "--check")
    assert rc == 0 and "OK" in out, err


@pytest.mark.parametrize("faulty", ["valid", "test"])
@pytest.mark.parametrize("fault,expected", [
    ("modality", "key 'views.0.modality' = 'rows': the samples of split '{split} (evaluation)' have no modality "
                 "'rows'"),
    ("shape", "key 'adapters.rows' (type 'feature_sequence'): the 'rows' inputs of a batch of split '{split} "
              "(evaluation)' (values [2, 2]"),
    ("label", "key 'evaluation.tasks.0' = 'linear:class': task 'linear' reads the label 'class', which the samples "
              "of split '{split}' do not carry"),
], ids=["modality", "shape", "label"])
def test_check_finds_a_fault_of_one_evaluation_split(capsys, tmp_path: Path, three_splits: Path, faulty: str,
                                                     fault: str, expected: str) -> None:
    rc, out, err = cli(capsys, "train", str(_split_recipe(tmp_path, three_splits, faulty, fault)), "--check")
    line = one_line_error(err)
    assert rc == 2 and "OK" not in out
    assert expected.format(split=faulty) in line, line


def test_split_check_fails_when_only_the_first_split_is_checked(capsys, tmp_path: Path, three_splits: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation test: with the training split alone checked, the test split's fault goes unseen."""
    from mutations import apply_break

    apply_break("check_first_split_only", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        test_check_finds_a_fault_of_one_evaluation_split(capsys, tmp_path, three_splits, "test", "label",
                                                         "of split '{split}' do not carry")


# ---------------------------------------------------------------------------------------------
# A streamed run (data.streaming: true) is checked through its streams: its training split's
# labels (which the final evaluation's probes train on) and its evaluation splits, as above.
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def three_streamed_splits(three_splits: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``three_splits`` written as a Parquet shard folder (``mmviews prepare hf --format parquet``)."""
    from test_data_shards import prepare

    out = tmp_path_factory.mktemp("hf_three_streamed") / "shards"
    r = prepare("hf", str(three_splits), "--format", "parquet", "--columns", "seq=seq,vec=vec", "--labels",
                "label=label", "--output", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_check_passes_on_a_sound_streamed_run(capsys, tmp_path: Path, three_streamed_splits: Path) -> None:
    recipe = _split_recipe(tmp_path, three_streamed_splits, "valid", "label", streaming=True)
    recipe.write_text(recipe.read_text().replace("split_options: {valid: {labels: {grade: label}}}", "split_options: {}"))
    rc, out, err = cli(capsys, "train", str(recipe), "--check")
    assert rc == 0 and "OK" in out, err


@pytest.mark.parametrize("faulty", ["train", "valid", "test"])
def test_check_finds_a_label_a_streamed_split_lacks(capsys, tmp_path: Path, three_streamed_splits: Path,
                                                    faulty: str) -> None:
    """The label fault of one split, the others sound: the same one line as a map-style split's."""
    recipe = _split_recipe(tmp_path, three_streamed_splits, faulty, "label", streaming=True)
    rc, out, err = cli(capsys, "train", str(recipe), "--check")
    line = one_line_error(err)
    assert rc == 2 and "OK" not in out
    assert (f"key 'evaluation.tasks.0' = 'linear:class': task 'linear' reads the label 'class', which the samples of "
            f"split '{faulty}' do not carry; they carry ['grade']: use e.g. 'linear:grade', or map the label to a "
            "dataset column (data.options.labels: {class: <column>})") in line, line


def test_streamed_label_check_fails_when_streamed_splits_are_skipped(capsys, tmp_path: Path,
                                                                       three_streamed_splits: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation test: with the streamed evaluation splits left out (as before), the training
    split's missing label goes unseen."""
    from mutations import apply_break

    apply_break("check_skips_streamed_splits", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        test_check_finds_a_label_a_streamed_split_lacks(capsys, tmp_path, three_streamed_splits, "train")


@pytest.mark.parametrize("state", ["heap", "hold"])
def test_check_says_when_the_estimate_does_not_bound_the_peak(capsys, monkeypatch, tmp_path: Path, three_splits: Path,
                                                              state: str) -> None:
    """``--check`` under ``host_memory: hold`` says that the peak can exceed its estimate (the
    heap fragments); under ``heap`` it says nothing. The process's allocator is not changed
    here: the state is what mmviews.cli.train is told the setting resolved to."""
    import mmviews.cli.train as cli_train
    from mmviews.train import host_memory

    monkeypatch.setattr(cli_train, "configure_host_memory", lambda setting, **_: state)
    recipe = _split_recipe(tmp_path, three_splits, "valid", "label")
    recipe.write_text(recipe.read_text().replace(", split_options: {valid: {labels: {grade: label}}}", ""))
    rc, out, err = cli(capsys, "train", str(recipe), "--check")
    assert rc == 0, err
    assert (f"note: {host_memory.HOLD_NOTE}" in out) is (state == "hold")


def _image_folder(root: Path, label_folders: bool) -> Path:
    from PIL import Image

    for split, n in (("train", 4), ("test", 4)):
        for i in range(n):
            folder = root / split / (f"c{i % 2}" if label_folders else "")
            folder.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(folder / f"{i}.png")
    return root


def _image_recipe(tmp_path: Path, root: Path) -> Path:
    recipe = tmp_path / "images.yaml"
    recipe.write_text(f"""name: images
data: {{name: hf, root: {root}, options: {{format: imagefolder, image_size: 8}}, train_split: train, val_split: null,
        test_split: test, batch_size: 2}}
views: [{{modality: image, copies: 2}}]
adapters: {{image: {{type: small_cnn, channels: [4], embed_dim: 4, head: {{kind: linear}}}}}}
optimisation: {{max_steps: 1}}
evaluation: {{tasks: ['linear:class']}}
output: {{progress_bar: false}}
""")
    return recipe


def test_an_image_folder_without_label_folders_is_refused_saying_where_labels_come_from(capsys, tmp_path: Path) -> None:
    """images straight in ROOT/SPLIT/ got the split's name as their label from datasets
    ('train' rows: None), --check said OK and the run failed at its first evaluation. Both refuse
    it now, the same way, before the run folder is written."""
    recipe = _image_recipe(tmp_path, _image_folder(tmp_path / "flat", label_folders=False))
    expected = ("task 'linear' reads the label 'class', which the samples of split 'train' do not carry; they carry "
                "no labels: use a task without a label, e.g. 'retrieval', or map the label to a dataset column "
                "(data.options.labels: {class: <column>}); an image folder's label 'class' is the name of the folder "
                f"each image is in: ROOT/SPLIT/LABEL/x.png; the images of {tmp_path / 'flat'} lie directly in "
                "ROOT/SPLIT/, with no LABEL/ folders")
    rc, out, err = cli(capsys, "train", str(recipe), "--check", "--output", str(tmp_path / "run"))
    assert rc == 2 and "OK" not in out and expected in one_line_error(err)
    rc, _, err = cli(capsys, "train", str(recipe), "--output", str(tmp_path / "run"))
    assert rc == 2 and expected in one_line_error(err)
    assert not (tmp_path / "run").exists()


def test_an_image_folder_with_label_folders_carries_their_names(capsys, tmp_path: Path) -> None:
    from mmviews.data.hf import HFDataset

    root = _image_folder(tmp_path / "classes", label_folders=True)
    dataset = HFDataset(root, "train", image_size=8)
    assert sorted(dataset[i]["labels"]["class"] for i in range(4)) == [0, 0, 1, 1]
    assert dataset.label_note.startswith("an image folder's label 'class' is the name of the folder")
    assert "no LABEL/ folders" not in dataset.label_note
    rc, out, _ = cli(capsys, "train", str(_image_recipe(tmp_path, root)), "--check", "--output", str(tmp_path / "run"))
    assert rc == 0 and "OK" in out


def test_the_dataset_name_cache_and_root_are_checked_before_the_dataset_is_built(tmp_path: Path) -> None:
    from mmviews.data.registry import list_datasets

    with pytest.raises(ValueError) as raised:
        build_dataset_split(DataConfig(name="synthetc"), "train")
    assert str(raised.value) == f"key 'data.name': unknown dataset 'synthetc'; known: {', '.join(list_datasets())}"
    with pytest.raises(ValueError) as raised:
        build_dataset_split(DataConfig(name="hf", root=str(tmp_path), streaming=True, cache=True), "train")
    assert str(raised.value) == ("keys 'data.streaming'/'data.cache': a streamed split is not kept in memory; "
                                 "set data.cache: false")
    with pytest.raises(FileNotFoundError) as raised:
        build_dataset_split(DataConfig(name="mosi", root=str(tmp_path / "nowhere.pkl")), "train")
    assert str(raised.value) == (f"dataset 'mosi' not found at {tmp_path / 'nowhere.pkl'}, see data_cards/mosi.md "
                                 "(set data.root, e.g. --set data.root=/path/to/mosi)")


def test_a_url_root_reaches_the_dataset_as_written_and_a_home_path_expanded(monkeypatch, tmp_path: Path) -> None:
    """A URL (Parquet shards on a server) is neither checked on the disk nor made a path; `~` is
    the user's home."""
    import mmviews.data.loaders as loaders

    given = []
    monkeypatch.setattr(loaders, "build_dataset", lambda name, **kwargs: given.append(kwargs) or [])
    build_dataset_split(DataConfig(name="hf", root="https://example.org/shards", cache=False), "train")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data").mkdir()
    build_dataset_split(DataConfig(name="hf", root="~/data", cache=False), "valid")
    assert [(g["root"], g["split"]) for g in given] == [("https://example.org/shards", "train"),
                                                         (str(tmp_path / "data"), "valid")]


def test_streaming_is_for_parquet_shards_through_hf() -> None:
    with pytest.raises(ValueError) as raised:
        build_dataset_split(DataConfig(name="synthetic", streaming=True, cache=False), "train")
    assert str(raised.value) == ("key 'data.streaming': streaming reads Parquet shards through data.name: hf, not "
                                 "'synthetic'; write them with `mmviews prepare synthetic ROOT --format parquet`")


@pytest.mark.parametrize("error,expected", [
    # the builder's signature is its list of options
    (TypeError("_build() got an unexpected keyword argument 'sise'"),
     (ValueError, "keys 'data.options'/'data.split_options.train': dataset 'synthetic' has no such option "
                  "(_build() got an unexpected keyword argument 'sise')")),
    # an error about the data itself, tagged with no option: the dataset and the split that was read
    (ValueError("row 3 is damaged"), (ValueError, "dataset 'synthetic', split 'train': row 3 is damaged")),
    (KeyError("no column 'x'"), (KeyError, "dataset 'synthetic', split 'train': no column 'x'")),  # not repr'd
    (ValueError(3), (ValueError, "dataset 'synthetic', split 'train': 3")),  # an argument that is not a string
])
def test_the_datasets_own_errors_keep_their_type_and_gain_where_they_come_from(monkeypatch, error, expected) -> None:
    import mmviews.data.loaders as loaders

    def build(name, **kwargs):
        raise error

    monkeypatch.setattr(loaders, "build_dataset", build)
    kind, message = expected
    with pytest.raises(kind) as raised:
        build_dataset_split(DataConfig(name="synthetic", train_split="train"), "train")
    assert type(raised.value) is kind
    assert (raised.value.args[0] if kind is KeyError else str(raised.value)) == message


def test_a_type_error_of_the_dataset_itself_is_raised_as_it_is(monkeypatch) -> None:
    import mmviews.data.loaders as loaders

    def build(name, **kwargs):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")

    monkeypatch.setattr(loaders, "build_dataset", build)
    with pytest.raises(TypeError, match=r"^unsupported operand type\(s\) for \+: 'int' and 'str'$"):
        build_dataset_split(DataConfig(name="synthetic"), "train")


def test_an_option_left_in_data_options_says_to_replace_that_section(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as raised:
        build_dataset_split(DataConfig(name="hf", root=str(tmp_path), options={"num_samples": 8}), "train")
    assert ("dataset 'hf' has no option 'num_samples' (an option of 'gaussian_latents', 'identifiability', 'synthetic': "
            "left from the recipe's dataset?); drop it: remove it from the recipe, or replace the section, --set "
            "data.options={...} ({} for none); the options of 'hf': ") in str(raised.value)
    assert str(raised.value).startswith("key 'data.options.num_samples': ")


def test_options_after_one_left_to_the_dataset_are_still_checked(monkeypatch) -> None:
    """An option whose annotation the recipe types do not cover (a video's size, int or a pair) is
    left to the dataset, and so is an option a dataset taking **options does not name: the
    options after them are checked all the same."""
    from mmviews.data.loaders import _typed_options

    with pytest.raises(ValueError, match=r"^key 'data.options.num_frames': expected int, got str 'many'$"):
        _typed_options(DataConfig(name="ucf101"), "train", {"size": [112, 112], "num_frames": "many"})
    import mmviews.data.loaders as loaders

    monkeypatch.setattr(loaders, "dataset_takes_other_options", lambda name: True)
    with pytest.raises(ValueError, match=r"^key 'data.options.num_classes': expected int, got str 'four'$"):
        _typed_options(DataConfig(name="synthetic"), "train", {"colour_space": "lab", "num_classes": "four"})
    assert _typed_options(DataConfig(name="synthetic"), "train", {"colour_space": "lab", "num_classes": 4}) == \
        {"num_classes": 4}


def test_data_cache_memoises_the_split_and_its_absence_reads_it_afresh() -> None:
    from mmviews.data.loaders import CachedDataset

    options = {"split_options": {"train": {"num_samples": 4}}}
    cached = build_dataset_split(DataConfig(name="synthetic", cache=True, **options), "train")
    assert isinstance(cached, CachedDataset) and cached[1] is cached[1]  # the same sample object, read once
    plain = build_dataset_split(DataConfig(name="synthetic", cache=False, **options), "train")
    assert not isinstance(plain, CachedDataset) and len(plain) == 4
