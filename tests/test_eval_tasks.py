"""The evaluation tasks' schema (``mmviews.eval.tasks``): every entry of ``evaluation.tasks``
resolves to a typed :class:`EvalTask` or fails with one line naming the entry (and, for a recipe,
its key path), a did-you-mean hint for a misspelt kind or parameter and the type a parameter
needed; the table of kinds agrees with the functions that run them."""

from __future__ import annotations

import inspect
import re

import pytest

from mmviews.eval.evaluate import TASK_FUNCTIONS
from mmviews.eval.tasks import TASK_KINDS, TASK_PARAMS, TASKS, EvalTask, parse_tasks, task_description
from mmviews.schema import ConfigError


def test_mapping_parameters_are_checked_and_kept_typed():
    knn, retrieval, diagnostics = parse_tasks([{"kind": "knn", "k": 20, "temperature": 1}, {"kind": "retrieval",
                                              "ks": (1, 5), "pairs": [["text_0", "audio_0"]]},
                                              {"kind": "diagnostic", "max_samples": None}])
    assert knn == EvalTask("knn", "class", None, {"k": 20, "temperature": 1.0})
    assert isinstance(knn.params["temperature"], float)  # an int where a float is expected is widened
    assert retrieval.params == {"ks": [1, 5], "pairs": [["text_0", "audio_0"]]} and not retrieval.needs_train
    assert diagnostics.kind == "diagnostics" and diagnostics.params == {"max_samples": None}
    assert knn.needs_train and parse_tasks("prototype")[0].needs_train


def test_a_parameter_of_the_wrong_type_names_the_task_or_the_key_path():
    with pytest.raises(ValueError, match=r"^task \{'kind': 'knn', 'k': '20'\}: key 'k': expected int, got str '20'$"):
        parse_tasks([{"kind": "knn", "k": "20"}])
    with pytest.raises(ConfigError, match=r"^r.yaml: key 'evaluation.tasks.1.ks': expected a list, got int 5$"):
        parse_tasks(["linear", {"kind": "retrieval", "ks": 5}], "r.yaml")
    with pytest.raises(ConfigError, match=r"^r.yaml: key 'evaluation.tasks.0.ks.1': expected int, got str 'x'$"):
        parse_tasks([{"kind": "retrieval", "ks": [1, "x"]}], "r.yaml")
    with pytest.raises(ValueError, match=r"label must be a string, got 3"):
        parse_tasks([{"kind": "knn", "label": 3}])


def test_misspelt_kinds_and_parameters_get_a_hint():
    with pytest.raises(ConfigError, match=r"^r.yaml: key 'evaluation.tasks.0': unknown evaluation task 'linaer' "
                                          r"\(did you mean 'linear'\?\); kinds are linear, knn"):
        parse_tasks(["linaer"], "r.yaml")
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['temprature'\]; knn accepts \['k', "
                                         r"'temperature'\] \(did you mean 'temperature'\?\)$"):
        parse_tasks([{"kind": "knn", "temprature": 0.1}])
    with pytest.raises(ValueError, match=r"must be a string or a mapping, got 3"):
        parse_tasks([3])
    with pytest.raises(ValueError, match="no evaluation tasks given"):
        parse_tasks([])


def test_every_kind_has_a_function_a_description_and_the_function_s_parameters():
    assert set(TASK_KINDS) == set(TASKS) == set(TASK_FUNCTIONS) == set(TASK_PARAMS)
    for kind in TASK_KINDS:
        assert task_description(kind)
        accepted = set(inspect.signature(TASK_FUNCTIONS[kind]).parameters)
        # "pairs" chooses the views the function is called on; every other parameter is the function's
        assert TASK_PARAMS[kind] - {"pairs"} <= accepted, kind


@pytest.mark.parametrize("tasks,has_val,has_test,splits", [
    (["linear:class"], True, True, ("train", "val", "test")),  # fits on train, selects on val, scores on test
    (["knn"], True, True, ("train", "val", "test")),
    (["retrieval", "diagnostics"], True, True, ("test",)),  # the evaluated split alone
    (["identifiability"], True, True, ("val", "test")),  # fits on valid: never the training split
    (["identifiability", "retrieval"], True, True, ("val", "test")),
    (["linear:class"], True, False, ("train", "val")),  # val is the evaluated split: extracted once
    (["linear:class"], False, True, ("train", "test")),
    (["identifiability"], False, True, ("test",)),  # fits and scores on halves of test
    (["identifiability"], True, False, ("val",)),
    (["retrieval"], True, False, ("val",)),
])
def test_extracted_splits_are_the_ones_the_tasks_embed(tasks, has_val, has_test, splits):
    """What the evaluation embeds, and so what ``--check`` counts."""
    from mmviews.eval.tasks import extracted_splits

    assert extracted_splits(parse_tasks(tasks), has_val=has_val, has_test=has_test) == splits


def test_extracted_splits_need_a_split_to_evaluate_on():
    from mmviews.eval.tasks import extracted_splits

    with pytest.raises(ValueError, match="^an evaluation needs a test or a validation split to evaluate on$"):
        extracted_splits(parse_tasks(["linear:class"]), has_val=False, has_test=False)


def test_string_and_mapping_forms_resolve_label_and_dataset():
    """``KIND:ARG`` names the label, except for msa where it names the dataset; the mapping form
    names them as keys; a task that names no label reads its kind's default."""
    assert parse_tasks(["knn:label2", "knn", "msa:mosi", "msa:MOSI", "retrieval"]) == [
        EvalTask("knn", "label2"), EvalTask("knn", "class"), EvalTask("msa", "sentiment", "mosi"),
        EvalTask("msa", "sentiment", "MOSI"), EvalTask("retrieval")]
    assert parse_tasks([{"kind": "msa", "dataset": "sims"}, {"kind": "linear_probe", "label": "colour"}]) == [
        EvalTask("msa", "sentiment", "sims"), EvalTask("linear", "colour")]
    # only msa reads a dataset; another kind's string form never sets one
    assert parse_tasks("regression:score")[0].dataset is None


@pytest.mark.parametrize("spec", ["msa", "msa:", "msa:iemocap", {"kind": "msa"}, {"kind": "msa", "dataset": "cmu"}])
def test_msa_without_a_known_dataset_is_refused_naming_the_three(spec):
    with pytest.raises(ValueError, match=rf"^task {re.escape(repr(spec))}: msa needs a dataset among 'mosi', "
                                         r"'mosei', 'sims' \(e\.g\. 'msa:mosi'\)$"):
        parse_tasks([spec])


def test_errors_name_the_task_alone_without_a_recipe_and_the_key_path_with_one():
    spec = {"kind": "knn", "depth": 3}
    with pytest.raises(ValueError) as caught:
        parse_tasks([spec])
    assert type(caught.value) is ValueError  # not a recipe's ConfigError: no file to name
    assert str(caught.value) == f"task {spec!r}: unknown parameter(s) ['depth']; knn accepts ['k', 'temperature']"
    with pytest.raises(ConfigError) as caught:
        parse_tasks(["knn", spec], "r.yaml")
    assert str(caught.value) == (f"r.yaml: key 'evaluation.tasks.1': task {spec!r}: unknown parameter(s) "
                                 "['depth']; knn accepts ['k', 'temperature']")


def test_a_mapping_without_a_kind_says_so():
    with pytest.raises(ValueError, match=r"^task \{'label': 'class'\}: a task mapping needs a 'kind', one of "
                                         r"linear, knn, regression, msa, retrieval, prototype, diagnostics, "
                                         r"identifiability$"):
        parse_tasks([{"label": "class"}])


def test_unknown_parameters_are_listed_even_when_a_yaml_key_is_not_a_string():
    # YAML reads `3: x` as an int key: the list still sorts (by the keys' text) and names both
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \[3, 'kk'\]; knn accepts"):
        parse_tasks([{"kind": "knn", "kk": 1, 3: "x"}])


@pytest.mark.parametrize("field", ["label", "dataset"])
def test_a_label_or_dataset_that_is_not_a_string_is_named(field):
    spec = {"kind": "knn", field: 3}
    with pytest.raises(ValueError, match=rf"^task {re.escape(repr(spec))}: {field} must be a string, got 3$"):
        parse_tasks([spec])


def test_an_empty_task_list_is_refused():
    with pytest.raises(ValueError, match="^no evaluation tasks given$"):
        parse_tasks([])
