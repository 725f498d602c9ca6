"""Compiled steps (``optimisation.compile``): the compiled encoder gives the eager results within
float rounding, makes no graph after its warm-up step at a fixed batch shape, and the recipe key
compiles a real run. Compile time on CPU is seconds per graph: the models are tiny and the
tests few."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mmviews.train.compiled as compiled_module
from mmviews.modalities import MultiViewEncoder
from mmviews.train.compiled import compile_encoder, compiled_graphs

from mutations import apply_break
from test_train_utils import load_weights, tiny_config, train_in_process, write_recipe

# Inductor fuses and reorders float32 arithmetic. The first step's unit-vector embeddings (same
# weights) differ from eager ones by a few ulps (measured 4.2e-7); each SGD step (lr 0.1) carries
# the rounding into the weights, so later steps differ more (measured 3.1e-5 after 7 steps, the
# weights 1.1e-5 of the largest weight change). The tolerances leave a margin of 2x to 10x.
FIRST_STEP_TOLERANCE = 1e-6
EMBEDDING_TOLERANCE = 1e-4
WEIGHT_TOLERANCE = 1e-4  # relative to the largest weight change of the eager run


def _text_encoder(device: str = "cpu") -> MultiViewEncoder:
    from mmviews.data.synthetic import synthetic_vocabulary

    torch.manual_seed(0)
    return MultiViewEncoder.from_config({"text": {
        "type": "text", "vocab": synthetic_vocabulary(False), "max_length": 12, "embed_dim": 16,
        "bert_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
                        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
        "head": {"kind": "mlp", "hidden_dim": 32, "batch_norm": True},
    }}).to(device)


def _batches(lengths: list[int], rows: int = 8, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    """One batch ``[rows, length]`` per length of ``lengths``: new token ids and padding each step."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for length in lengths:
        ids = torch.randint(5, 60, (rows, length), generator=g)
        real = torch.randint(2, length + 1, (rows,), generator=g)
        mask = (torch.arange(length) < real[:, None]).long()
        batches.append({"input_ids": (ids * mask).to(device), "attention_mask": mask.to(device)})
    return batches


def _steps(encoder: MultiViewEncoder, batches: list[dict[str, torch.Tensor]],
           after_step: list[int] | None = None) -> list[torch.Tensor]:
    """Plain SGD steps of a two-view InfoNCE-like loss (each batch and its reversed rows); the
    embeddings of each step. ``after_step`` collects :func:`compiled_graphs` after each step."""
    adapter = encoder.adapters["text"]
    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.1)
    embeddings = []
    for batch in batches:
        z = adapter(batch, check_inputs=False)
        z2 = adapter({k: v.flip(0) for k, v in batch.items()}, check_inputs=False).flip(0)
        loss = F.cross_entropy(z @ z2.T / 0.1, torch.arange(len(z), device=z.device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        embeddings.append(z.detach())
        if after_step is not None:
            after_step.append(compiled_graphs())
    return embeddings


def _check_compiled_matches_eager(lengths: list[int], device: str = "cpu") -> tuple[list[int], list[float], float]:
    """Runs the same steps eagerly and compiled (on ``device``); returns the graph counts after each compiled
    step, the largest embedding difference of each step and the weights' difference relative to
    the eager run's largest weight change."""
    eager = _text_encoder(device)
    compiled = copy.deepcopy(eager)
    start = {k: v.detach().clone() for k, v in eager.state_dict().items()}
    assert compile_encoder(compiled) == ["text.backbone", "text.head"]
    batches = _batches(lengths, device=device)
    eager_z = _steps(eager, batches)
    counts: list[int] = []
    compiled_z = _steps(compiled, batches, counts)
    z_diff = [float((a - b).abs().max()) for a, b in zip(eager_z, compiled_z)]
    # Module.compile leaves the parameter names as they are: the state dicts line up key by key.
    eager_state, compiled_state = eager.state_dict(), compiled.state_dict()
    assert list(eager_state) == list(compiled_state)
    change = max(float((eager_state[k] - start[k]).abs().max()) for k in start if start[k].is_floating_point())
    w_diff = max(float((eager_state[k] - compiled_state[k]).abs().max())
                 for k in start if start[k].is_floating_point())
    return counts, z_diff, w_diff / change


FIXED, VARYING = [12, 12, 12], [10, 9, 11, 7]  # text lengths of the steps: warm-up + 2 at one shape, then 4 others


def test_compiled_encoder_equals_eager_and_recompiles_only_once_for_new_lengths() -> None:
    """At a fixed batch shape no step after the first makes a graph; the first new text length
    makes graphs with a symbolic length (automatic dynamic shapes), which every later length reuses."""
    torch._dynamo.reset()
    before = compiled_graphs()
    counts, z_diff, w_rel = _check_compiled_matches_eager(FIXED + VARYING)
    fixed, varying = counts[: len(FIXED)], counts[len(FIXED):]
    assert fixed[0] > before, "the first step compiled no graph: the encoder ran eagerly"
    assert fixed == [fixed[0]] * len(fixed), f"graphs after each step {counts}: a fixed-shape step recompiled"
    assert varying == [varying[0]] * len(varying), f"graphs after each step {counts}: a new length recompiled again"
    assert z_diff[0] <= FIRST_STEP_TOLERANCE and max(z_diff) <= EMBEDDING_TOLERANCE, z_diff
    assert w_rel <= WEIGHT_TOLERANCE, w_rel


def test_recompile_check_fails_when_shapes_are_compiled_static(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard above can fail: compiled with ``dynamic=False`` (``compile_static_shapes``),
    every new text length makes new graphs."""
    torch._dynamo.reset()
    apply_break("compile_static_shapes", monkeypatch.setattr)
    # Graphs are counted by dynamo whatever compiles them: aot_eager skips inductor's C++ builds.
    monkeypatch.setitem(compiled_module.COMPILE_OPTIONS, "backend", "aot_eager")
    counts, _, _ = _check_compiled_matches_eager(FIXED[:1] + VARYING[:2])
    assert counts[2] > counts[1] > counts[0], counts


def test_recipe_key_compiles_the_run_and_reaches_the_eager_weights(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``optimisation.compile: true`` compiles the run's encoder (graphs are made; none without it)
    and trains to the eager weights. Inductor's numerics are the first test's: here dynamo's
    graphs run through aot_eager, which skips inductor's C++ builds (minutes on a busy CPU)."""
    torch._dynamo.reset()
    monkeypatch.setattr(compiled_module, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    config = tiny_config(image=False, dropout=0.0, num_samples=32, batch_size=16, epochs=1, tasks=[])
    config["optimisation"].update({"optimizer": "sgd", "lr": 0.1, "momentum": 0.0})
    recipe = write_recipe(tmp_path / "tiny.yaml", config)
    runs = {}
    for name, flag in (("eager", "false"), ("compiled", "true")):
        before = compiled_graphs()
        done = train_in_process(str(recipe), "--output", str(tmp_path / name), "--set", f"optimisation.compile={flag}")
        assert done.returncode == 0, done.stderr[-2000:]
        made = compiled_graphs() - before
        assert (made > 0) == (flag == "true"), f"{name} run made {made} graphs"
        results = json.loads((tmp_path / name / "results.json").read_text())  # says what ran
        assert results["compile"] is (flag == "true") and results["mixed_precision"] == "no"
        runs[name] = load_weights(tmp_path / name / "encoder")
    assert runs["eager"].keys() == runs["compiled"].keys()
    for key, eager in runs["eager"].items():
        torch.testing.assert_close(runs["compiled"][key], eager, rtol=1e-4, atol=1e-5, msg=key)


def test_compile_with_checkpointing_is_refused_only_under_sample_keyed_dropout() -> None:
    """torch.compile fails on the context that replays sample keys in the checkpointed layers'
    recomputation: with sample-keyed dropout the recipe is refused with one line naming the key
    and the adapters, before anything is built; without it the recipe loads."""
    from mmviews.config import ConfigError, config_from_dict

    config = tiny_config(image=False)
    config["adapters"]["text"]["gradient_checkpointing"] = True
    config["optimisation"]["compile"] = True
    assert config_from_dict(config, "tiny").optimisation.compile
    config["optimisation"]["sample_keyed_dropout"] = True
    with pytest.raises(ConfigError, match=r"optimisation\.compile.*gradient_checkpointing \(adapters text\) under "
                                          r"optimisation\.sample_keyed_dropout"):
        config_from_dict(config, "tiny")


def test_checkpointed_encoder_compiles_and_matches_eager() -> None:
    """A text adapter with gradient checkpointing compiles (aot_eager: dynamo and autograd's
    tracing, which reject a checkpoint ``context_fn``, without inductor's minutes) and gives the
    eager step's embeddings and gradients. Break (``checkpoint_with_context_always``): the
    checkpointing passes its sample-key context although no dropout is keyed, as it once did."""
    _check_checkpointed_compile()


def test_checkpointed_compile_fails_when_the_context_is_always_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation test (tests/README.md)."""
    apply_break("checkpoint_with_context_always", monkeypatch.setattr)
    with pytest.raises(Exception, match="context_fn|BackendCompilerFailed|checkpoint"):
        _check_checkpointed_compile()


def _check_checkpointed_compile() -> None:
    import torch._dynamo

    torch._dynamo.reset()  # graphs of earlier tests: not this encoder's
    eager = _text_encoder()
    eager.adapters["text"].enable_gradient_checkpointing()
    compiled = copy.deepcopy(eager)
    compile_encoder(compiled, backend="aot_eager")
    batch = _batches([12])[0]
    grads = []
    for encoder in (eager, compiled):
        z = encoder.adapters["text"](batch, check_inputs=False)
        z.square().sum().backward()
        grads.append((z.detach(), {n: q.grad for n, q in encoder.named_parameters() if q.grad is not None}))
    (z_eager, g_eager), (z_compiled, g_compiled) = grads
    torch.testing.assert_close(z_compiled, z_eager, rtol=0, atol=FIRST_STEP_TOLERANCE)
    # the unused BERT pooler: no gradient in eager mode, a zero one through the compiled graph
    assert g_eager.keys() <= g_compiled.keys() and len(g_eager) > 0, set(g_eager) ^ set(g_compiled)
    assert all(not g_compiled[name].any() for name in g_compiled.keys() - g_eager.keys())
    for name in g_eager:
        torch.testing.assert_close(g_compiled[name], g_eager[name], rtol=1e-5, atol=1e-6, msg=name)


class _CountingBackend:
    """A ``torch.compile`` backend that records the graphs it is given and runs them eagerly."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return graph.forward


def _two_adapters() -> torch.nn.Module:
    """An encoder-shaped module: adapter ``a`` with a backbone and a head, ``b`` with a backbone
    and no head (None), ``c`` with a head that is not a module, ``d`` without a head attribute."""
    class Scale(torch.nn.Module):  # a module of the test's own: dynamo traces it (it skips torch.nn's own layers' files)
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight + 1

    class Adapter(torch.nn.Module):
        def __init__(self, head: object) -> None:
            super().__init__()
            self.backbone = Scale()
            self.head = head

    class BackboneOnly(torch.nn.Module):  # no head attribute at all
        def __init__(self) -> None:
            super().__init__()
            self.backbone = Scale()

    encoder = torch.nn.Module()
    encoder.adapters = torch.nn.ModuleDict({"a": Adapter(Scale()), "b": Adapter(None),
                                            "c": Adapter("not a module"), "d": BackboneOnly()})
    return encoder


def test_compile_encoder_gives_its_options_to_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The options given reach torch.compile (here a backend of the test's, which sees the
    compiled modules' graphs); without options, COMPILE_OPTIONS do."""
    for given in (True, False):
        torch._dynamo.reset()
        backend = _CountingBackend()
        encoder = _two_adapters()
        if given:
            names = compile_encoder(encoder, backend=backend, dynamic=False)
        else:
            monkeypatch.setattr(compiled_module, "COMPILE_OPTIONS", {"backend": backend})
            names = compile_encoder(encoder)
        assert names == ["a.backbone", "a.head", "b.backbone", "c.backbone", "d.backbone"]
        x = torch.randn(4, 3)
        for adapter in encoder.adapters.values():
            adapter.backbone(x)
        encoder.adapters["a"].head(x)
        # the modules share one forward's code: dynamo may reuse one graph for all of them
        assert backend.graphs >= 1, given
    torch._dynamo.reset()


def test_compile_encoder_refuses_a_module_without_adapters() -> None:
    with pytest.raises(TypeError, match="^optimisation.compile: expected a MultiViewEncoder with adapters, got Linear$"):
        compile_encoder(torch.nn.Linear(2, 2))


def test_compiled_graphs_counts_dynamos_graphs_and_reset_forgets_the_compiled_code() -> None:
    """A new function compiles one graph; called again at the same shape, none; after
    reset_compiled the same function compiles again (its compiled code was forgotten)."""
    compiled_module.reset_compiled()

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    function = torch.compile(double, backend="eager")
    before = compiled_graphs()
    function(torch.ones(3))
    assert compiled_graphs() == before + 1
    function(torch.zeros(3))
    assert compiled_graphs() == before + 1
    compiled_module.reset_compiled()
    function(torch.ones(3))
    assert compiled_graphs() in (before + 2, 1)  # counted on, or counted afresh from 0 after the reset
