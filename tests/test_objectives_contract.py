"""The objective contract the trainer codes against: class attributes that agree with the
signatures, ``compute`` passing ``index`` / ``teacher`` on only to objectives that take them
(and refusing them otherwise), no-op default hooks, and the public registry functions."""

from __future__ import annotations

import inspect

import pytest
import torch

from mmviews.objectives import (
    MultiViewObjective,
    ObjectiveOutput,
    describe_objectives,
    get_objective,
    list_objectives,
    objective_class,
    register_objective,
)

NAMES = list_objectives()
INPUTS = ("index", "teacher")


def _z(name: str, K: int = 5, d: int = 4) -> torch.Tensor:
    M = objective_class(name).exact_views or 3
    return torch.randn(K, M, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _inputs(z: torch.Tensor) -> dict[str, torch.Tensor]:
    """A valid value of each optional input for the batch ``z``."""
    teacher = torch.randn(z.shape, generator=torch.Generator().manual_seed(1), dtype=z.dtype)
    return {"index": torch.arange(z.shape[0]), "teacher": teacher}


@pytest.mark.parametrize("name", NAMES)
def test_attributes_agree_with_signatures(name):
    cls = objective_class(name)
    loss_parameters = inspect.signature(cls.loss).parameters
    init_parameters = inspect.signature(cls.__init__).parameters
    assert cls.name == name
    assert cls.takes_index == ("index" in loss_parameters)
    assert cls.takes_teacher == ("teacher" in loss_parameters)
    assert cls.takes_dataset_size == ("dataset_size" in init_parameters)
    assert not cls.needs_teacher or cls.takes_teacher
    for attribute in ("supports_mask", "takes_index", "takes_teacher", "needs_teacher", "takes_dataset_size", "poly_view_bound"):
        assert isinstance(getattr(cls, attribute), bool), attribute
    # the attributes the trainer used to probe with getattr are gone for good
    assert not hasattr(cls, "requires_teacher") and not hasattr(cls, "poly_view")


def test_declared_values():
    declared = {
        attribute: {name for name in NAMES if getattr(objective_class(name), attribute)}
        for attribute in ("takes_index", "takes_teacher", "needs_teacher", "takes_dataset_size", "poly_view_bound")
    }
    assert declared == {
        "takes_index": {"ipmc"},
        "takes_teacher": {"er"},
        "needs_teacher": set(),
        "takes_dataset_size": {"ipmc"},
        "poly_view_bound": {"geometric_pvc", "arithmetic_pvc", "sufficient_statistics"},
    }
    assert {name for name in NAMES if objective_class(name).exact_views is not None} == {"simclr"}


@pytest.mark.parametrize("name", NAMES)
def test_compute_passes_on_exactly_the_inputs_the_objective_takes(name):
    objective = get_objective(name)
    z = _z(name)
    given = _inputs(z)
    taken = {key for key in INPUTS if getattr(objective, f"takes_{key}")}
    seen: list[dict] = []

    def spy(views, **kwargs):
        seen.append(kwargs)
        return ObjectiveOutput(views.u.sum() * 0)

    objective.loss = spy  # instance attribute: compute calls it in place of the method
    objective.compute(z, **{key: given[key] for key in taken})
    assert set(seen[-1]) == taken
    assert all(seen[-1][key] is given[key] for key in taken)
    # inputs left out reach a loss that takes them as None (they are optional)
    objective.compute(z)
    assert seen[-1] == {key: None for key in taken}


@pytest.mark.parametrize(("name", "key"), [(name, key) for name in NAMES for key in INPUTS
                                           if not getattr(objective_class(name), f"takes_{key}")])
def test_an_input_the_objective_does_not_take_is_refused(name, key):
    objective = get_objective(name)
    z = _z(name)
    with pytest.raises(ValueError, match=rf"{name}.*does not take {key}="):
        objective.compute(z, **{key: _inputs(z)[key]})
    with pytest.raises(ValueError, match=rf"does not take {key}="):
        objective(z, **{key: _inputs(z)[key]})


def test_taken_inputs_reach_the_loss():
    """Not only passed through but used: er's loss changes with a teacher; ipmc with a memory
    bank needs the index (and refuses a call without it)."""
    z = _z("er")
    er = get_objective("er")
    assert not torch.allclose(er(z), er(z, teacher=_inputs(z)["teacher"]))
    ipmc = get_objective("ipmc", memory_bank_size=10)
    ipmc.on_step_end(z, torch.arange(5) + 5)
    assert torch.isfinite(ipmc(z, index=torch.arange(5)))
    with pytest.raises(ValueError, match="index"):
        ipmc(z)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "ipmc"])
def test_default_hooks_are_no_ops(name):
    objective = get_objective(name)
    cls = type(objective)
    for hook in ("critic_step", "on_step_end", "on_epoch_end"):
        assert getattr(cls, hook) is getattr(MultiViewObjective, hook), f"{name} overrides {hook}"
    z = _z(name)
    before_loss = objective(z)
    before_state = {k: v.clone() for k, v in objective.state_dict().items()}
    assert objective.critic_step(z) == {}
    assert objective.on_step_end(z, torch.arange(z.shape[0])) is None
    assert objective.on_epoch_end(0) is None
    after_state = objective.state_dict()
    assert before_state.keys() == after_state.keys()
    assert all(torch.equal(before_state[k], after_state[k]) for k in before_state)
    torch.testing.assert_close(objective(z), before_loss, rtol=0, atol=0)


def test_ipmc_overrides_every_hook():
    cls = objective_class("ipmc")
    for hook in ("critic_step", "on_step_end", "on_epoch_end"):
        assert getattr(cls, hook) is not getattr(MultiViewObjective, hook)


def test_registration_refuses_attributes_that_disagree_with_signatures():
    class IndexWithoutAttribute(MultiViewObjective):
        def loss(self, views, index=None):  # pragma: no cover - never called
            raise AssertionError

    class AttributeWithoutTeacher(MultiViewObjective):
        takes_teacher = True

        def loss(self, views):  # pragma: no cover - never called
            raise AssertionError

    class NeedsWithoutTakes(MultiViewObjective):
        needs_teacher = True

        def loss(self, views):  # pragma: no cover - never called
            raise AssertionError

    class SizeWithoutParameter(MultiViewObjective):
        takes_dataset_size = True

        def loss(self, views):  # pragma: no cover - never called
            raise AssertionError

    cases = [
        (IndexWithoutAttribute, r"takes_index = False but its loss\(\) has parameter 'index'"),
        (AttributeWithoutTeacher, r"takes_teacher = True but its loss\(\) has no parameter 'teacher'"),
        (NeedsWithoutTakes, r"needs_teacher = True requires takes_teacher"),
        (SizeWithoutParameter, r"takes_dataset_size = True but its __init__\(\) has no parameter 'dataset_size'"),
    ]
    for cls, message in cases:
        with pytest.raises(TypeError, match=message):
            register_objective(f"contract_test_{cls.__name__}")(cls)
        assert f"contract_test_{cls.__name__}" not in list_objectives()


def test_registering_a_name_twice_is_refused():
    class Another(MultiViewObjective):
        def loss(self, views):  # pragma: no cover - never called
            raise AssertionError

    with pytest.raises(ValueError, match="'geometric_pvc' is registered twice"):
        register_objective("geometric_pvc")(Another)
    assert objective_class("geometric_pvc") is not Another


def test_describe_objectives_gives_one_line_per_name():
    descriptions = describe_objectives()
    assert list(descriptions) == NAMES
    for name, line in descriptions.items():
        assert line.strip() and "\n" not in line, name


def test_objective_class_of_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown objective 'nope'.*geometric_pvc"):
        objective_class("nope")
