"""The adapter contract every modality shares (``mmviews.modalities.base``), on a toy adapter type of
this file (Linear blocks and a final LayerNorm: blocks and a tail for ``last_n``) and on the ``mlp``
type: building from a mapping or a config object; which backbone parameters train in each
fine-tuning mode, LoRA included; checked inputs; the head and the L2 normalisation (per frame, then
averaged); a single row in training mode through the head's BatchNorm; absent items as zero rows
that never reach the backbone; optimiser groups; saving and loading with every refusal one line
naming the file; and the registry's lookups. (Two processes joining collectives with no present
item: test_train_multigpu.py.)"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mmviews.data.batch import PresentItems
from mmviews.modalities import base
from mmviews.modalities.base import (
    Adapter,
    adapter_class,
    adapter_registered,
    build_adapter,
    list_adapters,
    register_adapter,
    set_entry_point_loader,
)
from mmviews.modalities.config import AdapterConfig, FinetuneConfig, HeadConfig, LoRAConfig
from mmviews.modalities.inputs import require_tensor
from mmviews.modalities.mlp import MLPAdapter, MLPConfig

TOY = "test_base_toy"


@dataclass
class ToyConfig(AdapterConfig):
    type = TOY
    input_dim: int = 3
    width: int = 4
    depth: int = 3
    activation: str = "relu"


class Block(nn.Module):
    def __init__(self, dim: int, width: int, activation: str) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, width)
        self.act = {"relu": nn.ReLU}[activation]()  # another name: a KeyError, as some backbones raise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class ToyAdapter(Adapter):
    """A toy adapter: ``depth`` Linear blocks and a LayerNorm on ``values [B, D]`` or ``[B, T, D]``."""

    config_class = ToyConfig

    def __init__(self, config: ToyConfig, load_weights: bool = True, saved_dir=None) -> None:
        super().__init__(config)
        self.built_with = {"load_weights": load_weights, "saved_dir": saved_dir}
        self.preprocessed_with: list[Any] = []
        blocks = [Block(config.input_dim if i == 0 else config.width, config.width, config.activation)
                  for i in range(config.depth)]
        self.backbone = nn.Sequential(*blocks, nn.LayerNorm(config.width))
        self.feature_dim = config.width
        self._finish_init()

    def preprocess(self, inputs, present=None):
        self.preprocessed_with.append(present)
        return {"x": require_tensor(inputs, "values", "toy adapter")}

    def encode(self, prepared):
        x = prepared["x"]
        if x.dim() == 3:
            b, t, d = x.shape
            return self.backbone(x.reshape(b * t, d)).reshape(b, t, -1)
        return self.backbone(x)

    def backbone_blocks(self):
        return list(self.backbone)[:-1]

    def backbone_tail(self):
        return list(self.backbone[-1].parameters())

    def _save_extra(self, directory) -> None:
        (directory / "toy_extra.txt").write_text("what rebuilding needs besides config.json")


@pytest.fixture(autouse=True)
def toy_type():
    """The toy type is registered for each test and removed after it (a type left registered
    would reach later tests of the same process)."""
    base._ADAPTERS._entries.pop(TOY, None)
    register_adapter(ToyAdapter)
    yield
    base._ADAPTERS._entries.pop(TOY, None)


def _toy(**config: Any) -> ToyAdapter:
    torch.manual_seed(0)
    return ToyAdapter(ToyConfig(**config))


def _trains(params) -> list[bool]:
    return [p.requires_grad for p in params]


# --------------------------------------------------------------------------- registry and building


def test_registering_a_type_twice_is_refused_and_the_registry_answers_lookups():
    with pytest.raises(ValueError, match=rf"^adapter type '{TOY}' is registered twice$"):
        register_adapter(ToyAdapter)
    assert adapter_class(TOY) is ToyAdapter and adapter_registered(TOY) and not adapter_registered("no_such")
    described = list_adapters()
    assert described[TOY] == "A toy adapter: ``depth`` Linear blocks and a LayerNorm on ``values [B, D]`` or ``[B, T, D]``."
    assert list(described) == sorted(described) and "mlp" in described
    with pytest.raises(ValueError, match=r"^unknown adapter type 'test_base_tyo' \(did you mean 'test_base_toy'\?\)"):
        adapter_class("test_base_tyo")


def test_the_entry_point_loader_is_asked_only_for_unregistered_names():
    asked: list[object] = []

    def loader(name: str) -> bool:
        asked.append(name)
        return False

    original = base._entry_point_loader
    set_entry_point_loader(loader)
    try:
        assert adapter_class(TOY) is ToyAdapter and adapter_class("mlp") is MLPAdapter
        assert not adapter_registered("from_a_package")
        assert asked == []
        with pytest.raises(ValueError, match="unknown adapter type 'from_a_package'"):
            adapter_class("from_a_package")
        with pytest.raises(ValueError, match="unknown adapter type None"):
            adapter_class(None)  # a missing type: nothing to look up
        assert asked == ["from_a_package"]
    finally:
        set_entry_point_loader(original)
    assert base._entry_point_loader is original


def test_an_adapter_is_built_from_a_mapping_or_a_config_object():
    mapping = {"type": "mlp", "input_dim": 2, "hidden_dim": 3}
    for built in (Adapter.from_config(mapping), MLPAdapter.from_config(mapping), build_adapter(mapping),
                  Adapter.from_config(MLPConfig(input_dim=2, hidden_dim=3)),
                  MLPAdapter.from_config(MLPConfig(input_dim=2, hidden_dim=3)),
                  build_adapter(MLPConfig(input_dim=2, hidden_dim=3))):
        assert type(built) is MLPAdapter and built.config == MLPConfig(input_dim=2, hidden_dim=3)
    assert type(Adapter.from_config({"type": TOY})) is ToyAdapter
    assert type(ToyAdapter.from_config({"width": 5})) is ToyAdapter  # a subclass needs no type
    with pytest.raises(ValueError, match=r"^config of type 'mlp' given to ToyConfig"):
        ToyAdapter.from_config(mapping)


@pytest.mark.parametrize("config", [[("type", "mlp")], "mlp", {"input_dim": 2}])
def test_build_adapter_needs_a_mapping_with_a_type(config):
    with pytest.raises(ValueError) as caught:
        build_adapter(config)
    assert str(caught.value) == (f"adapter config must be a dict with a 'type' key (one of {base._ADAPTERS.names()}), "
                                 f"got {config!r}")


def test_gradient_checkpointing_must_be_a_bool_and_supported():
    with pytest.raises(ValueError) as caught:
        ToyAdapter(ToyConfig(gradient_checkpointing="yes"))
    assert str(caught.value) == f"'{TOY}' adapter: gradient_checkpointing must be true or false, got 'yes'"
    with pytest.raises(ValueError) as caught:
        ToyAdapter(ToyConfig(gradient_checkpointing=True))
    message = str(caught.value)
    start = f"'{TOY}' adapter does not support gradient_checkpointing (adapter types that do: "
    end = "); remove the key or set it to false"
    assert message.startswith(start) and message.endswith(end)
    supported = message[len(start):-len(end)].split(", ")
    assert {"small_cnn", "text", "hf_vision", "timm"} <= set(supported) and supported == sorted(supported)
    assert TOY not in supported and "mlp" not in supported
    assert not ToyAdapter.supports_gradient_checkpointing() and not MLPAdapter.supports_gradient_checkpointing()
    assert adapter_class("small_cnn").supports_gradient_checkpointing()
    assert not _toy(gradient_checkpointing=False).config.gradient_checkpointing


# --------------------------------------------------------------------------- fine-tuning modes


def test_full_fine_tuning_trains_the_whole_backbone_and_frozen_none():
    full = _toy()
    assert all(_trains(full.backbone.parameters())) and not full.backbone_frozen
    frozen = _toy(finetune=FinetuneConfig(mode="frozen"))
    assert not any(_trains(frozen.backbone.parameters())) and frozen.backbone_frozen
    assert all(_trains(frozen.head.parameters()))
    frozen.train()
    assert frozen.training and frozen.head.training and not frozen.backbone.training  # dropout off, stats fixed
    full.train()
    assert full.backbone.training
    assert full.train(False) is full and not full.backbone.training and not full.head.training


@pytest.mark.parametrize(("last_n", "trained"), [(0, []), (1, [2]), (2, [1, 2]), (3, [0, 1, 2])])
def test_last_n_trains_the_last_blocks_and_the_tail(last_n, trained):
    adapter = _toy(finetune=FinetuneConfig(mode="last_n", last_n=last_n))
    blocks = adapter.backbone_blocks()
    assert [all(_trains(b.parameters())) for b in blocks] == [i in trained for i in range(3)]
    assert [any(_trains(b.parameters())) for b in blocks] == [i in trained for i in range(3)]
    assert _trains(adapter.backbone_tail()) == [last_n > 0] * 2
    assert adapter.backbone_frozen == (last_n == 0)


@pytest.mark.parametrize("last_n", [-1, 4])
def test_last_n_out_of_range_is_refused(last_n):
    with pytest.raises(ValueError) as caught:
        _toy(finetune=FinetuneConfig(mode="last_n", last_n=last_n))
    assert str(caught.value) == f"finetune.last_n must be in [0, 3] for this backbone, got {last_n}"


def test_a_bad_mode_and_a_backbone_without_blocks_are_refused():
    with pytest.raises(ValueError) as caught:
        _toy(finetune=FinetuneConfig(mode="partial"))
    assert str(caught.value) == "finetune.mode must be 'full', 'frozen' or 'last_n', got 'partial'"
    with pytest.raises(NotImplementedError) as caught:
        MLPAdapter(MLPConfig(finetune=FinetuneConfig(mode="last_n", last_n=1)))
    assert str(caught.value) == "MLPAdapter does not support finetune.mode='last_n'"
    assert MLPAdapter(MLPConfig()).backbone_tail() == []


def test_lora_needs_targets_and_trains_its_matrices_on_any_mode():
    pytest.importorskip("peft", reason="peft (the optional 'lora' extra) is not installed")
    with pytest.raises(ValueError) as caught:
        _toy(finetune=FinetuneConfig(mode="frozen", lora=LoRAConfig(r=2)))
    assert str(caught.value) == "ToyAdapter has no default LoRA targets; set finetune.lora.target_modules"
    frozen = _toy(finetune=FinetuneConfig(mode="frozen", lora=LoRAConfig(r=2, alpha=4, target_modules=["linear"])))
    trained = {n for n, p in frozen.backbone.named_parameters() if p.requires_grad}
    assert trained == {f"{i}.linear.lora_{ab}.default.weight" for i in range(3) for ab in "AB"}
    lora = frozen.backbone[0].linear
    assert lora.r["default"] == 2 and lora.scaling["default"] == 2.0 and lora.lora_A["default"].in_features == 3
    dropped = _toy(finetune=FinetuneConfig(mode="frozen", lora=LoRAConfig(dropout=0.25, target_modules=["linear"])))
    assert dropped.backbone[1].linear.lora_dropout["default"].p == 0.25
    last = _toy(finetune=FinetuneConfig(mode="last_n", last_n=1, lora=LoRAConfig(target_modules=["linear"])))
    trained = {n for n, p in last.backbone.named_parameters() if p.requires_grad}
    assert {"2.linear.base_layer.weight", "3.weight", "0.linear.lora_A.default.weight"} <= trained
    assert "0.linear.base_layer.weight" not in trained


def test_lora_without_peft_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # as if the extra were not installed
    with pytest.raises(ImportError) as caught:
        _toy(finetune=FinetuneConfig(mode="frozen", lora=LoRAConfig(target_modules=["linear"])))
    assert str(caught.value) == "finetune.lora needs peft: pip install 'mmviews[lora]'"


# --------------------------------------------------------------------------- forward


def test_present_reaches_preprocess_and_the_input_check():
    toy = _toy()
    present = torch.tensor([True, False])
    toy.features({"values": torch.randn(2, 3)}, present)
    assert toy.preprocessed_with == [present]
    mlp = MLPAdapter(MLPConfig(input_dim=2))
    inputs = {"values": torch.randn(2, 1, 2), "lengths": torch.tensor([0, 1])}  # item 0 absent: length 0
    mlp.features(inputs, torch.tensor([False, True]))
    with pytest.raises(ValueError, match=r"^mlp adapter: zero-length sequence at batch position\(s\) \[0\]"):
        mlp.features(inputs)


def test_check_inputs_reaches_every_path_of_forward():
    toy = _toy().eval()
    bad = {"values": torch.tensor([[float("nan")] * 3, [0.0] * 3])}
    for present in (None, torch.tensor([True, True]), torch.tensor([True, False])):
        toy(bad, present=present, check_inputs=False)
        with pytest.raises(ValueError, match="non-finite"):
            toy(bad, present=present)
    partial = PresentItems.from_mask(torch.tensor([True, False]))
    everything = PresentItems.from_mask(torch.tensor([True, True]))
    for items in (partial, everything):
        toy.embed_present(bad, items, check_inputs=False)
        with pytest.raises(ValueError, match="non-finite"):
            toy.embed_present(bad, items)


def test_features_check_the_inputs_unless_told_not_to():
    adapter = _toy()
    bad = {"values": torch.tensor([[float("nan"), 0.0, 0.0]])}
    with pytest.raises(ValueError, match=rf"^{TOY} adapter: 1 non-finite value"):
        adapter.features(bad)
    adapter.features(bad, check_inputs=False)
    adapter.check_inputs = False
    adapter.features(bad)
    adapter(bad)
    with pytest.raises(ValueError, match=rf"^{TOY} adapter: 1 non-finite"):
        adapter.features(bad, check_inputs=True)
    with pytest.raises(ValueError, match=rf"^{TOY} adapter: 1 non-finite"):
        adapter(bad, check_inputs=True)
    assert adapter.input_check().where == f"{TOY} adapter"
    assert adapter.host_preprocessor() is None


def test_a_frozen_backbone_runs_without_autograd():
    values = {"values": torch.randn(4, 3)}
    assert _toy().features(values).requires_grad
    frozen = _toy(finetune=FinetuneConfig(mode="frozen"))
    assert not frozen.features(values).requires_grad
    assert frozen(values).requires_grad  # the head trains


def test_projection_is_the_head_then_l2_normalisation_per_frame_then_of_the_mean():
    adapter = _toy(head=HeadConfig(kind="linear")).eval()
    features = torch.randn(2, 3, 4)
    frames = F.normalize(adapter.head(features.reshape(6, 4)), dim=-1).reshape(2, 3, -1)
    expected = F.normalize(frames.mean(1), dim=-1)
    assert torch.allclose(adapter.project(features), expected, atol=1e-6)
    assert torch.allclose(adapter.project(features[:, 0]), F.normalize(adapter.head(features[:, 0]), dim=-1))
    assert adapter.project(features[:0]).shape == (0, 128)  # no items: no error
    assert torch.allclose(adapter({"values": torch.randn(2, 3, 3)}).norm(dim=-1), torch.ones(2))


def test_one_row_in_training_mode_uses_the_heads_running_statistics():
    adapter = _toy().train()
    norm = adapter.head.net[1]
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
    before = (norm.running_mean.clone(), norm.running_var.clone(), int(norm.num_batches_tracked))
    x = torch.randn(1, 4)
    out = adapter._head(x)
    assert norm.training and adapter.head.training  # back in training mode
    assert torch.equal(norm.running_mean, before[0]) and int(norm.num_batches_tracked) == before[2]
    adapter.head.eval()
    assert torch.allclose(out, adapter.head(x))
    adapter.head.train()
    adapter._head(torch.randn(2, 4))  # two rows: batch statistics, counted
    assert int(norm.num_batches_tracked) == before[2] + 1


def test_one_row_in_training_mode_goes_through_the_whole_adapter():
    adapter = _toy().train()
    z = adapter({"values": torch.randn(1, 3)})
    assert z.shape == (1, 128) and torch.allclose(z.norm(dim=-1), torch.ones(1))


def test_absent_items_are_zero_rows_that_never_reach_the_backbone():
    adapter = _toy().eval()
    values = torch.randn(5, 3)
    seen: list[int] = []
    adapter.backbone.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    mask = torch.tensor([True, False, True, True, False])
    z = adapter({"values": values}, present=mask)
    assert seen == [3]
    assert z.shape == (5, 128) and not z[~mask].any()
    assert torch.allclose(z[mask], adapter({"values": values[mask]}), atol=1e-6)
    assert torch.equal(adapter({"values": values}, present=torch.tensor([1, 0, 1, 1, 0])), z)  # 0/1 mask
    # every item present: the plain forward; none: zeros, nothing run
    assert torch.equal(adapter({"values": values}, present=torch.ones(5, dtype=torch.bool)), adapter({"values": values}))
    seen.clear()
    heads: list[int] = []
    adapter.head.register_forward_hook(lambda module, args, out: heads.append(args[0].shape[0]))
    none = adapter({"values": values}, present=torch.zeros(5, dtype=torch.bool))
    assert none.shape == (5, 128) and not none.any() and seen == [] and heads == []
    assert not none.requires_grad  # plain zeros: no collective to join on one process
    # the same given as host items
    items = PresentItems.from_mask(mask)
    assert torch.equal(adapter.embed_present({"values": values}, items), z)
    # list inputs are picked by the host positions
    assert items.positions == (0, 2, 3)


def test_absent_items_under_autocast_are_zero_rows_of_the_parameters_dtype():
    adapter = _toy().eval()
    values = torch.randn(4, 3)
    mask = torch.tensor([False, True, True, False])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = adapter({"values": values}, present=mask)
    assert z.dtype == torch.float32 and not z[~mask].any() and z[mask].abs().sum() > 0


def test_absent_items_do_not_shift_batch_norm_statistics():
    adapter = _toy().train()
    values = torch.randn(4, 3)
    values[1] = 1000.0  # an absent slot's filling
    present = torch.tensor([True, False, True, True])
    adapter({"values": values}, present=present)
    reference = _toy().train()
    reference({"values": values[present]})
    assert torch.allclose(adapter.head.net[1].running_mean, reference.head.net[1].running_mean)


def test_joining_collectives_alone_is_the_head_on_zero_rows():
    adapter = _toy().train()
    out = adapter.join_collectives({"values": torch.randn(3, 3)}, 3)
    assert out.shape == (0, 128) and out.requires_grad
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in adapter.head.parameters())
    assert all(p.grad is None for p in adapter.backbone.parameters())


# --------------------------------------------------------------------------- the rest of the contract


def test_the_preprocessing_signature_leaves_out_what_only_the_head_and_training_read():
    adapter = _toy(embed_dim=8, head=HeadConfig(kind="linear"), finetune=FinetuneConfig(mode="frozen"),
                   gradient_checkpointing=False)
    assert adapter.preprocessing_signature() == {"type": TOY, "input_dim": 3, "width": 4, "depth": 3,
                                                 "activation": "relu"}
    assert adapter.config.to_dict()["embed_dim"] == 8  # the config itself keeps them


def test_parameter_groups_split_backbone_and_head_and_decay_only_matrices():
    adapter = _toy(finetune=FinetuneConfig(mode="last_n", last_n=1))
    groups = adapter.param_groups(backbone_lr=0.1, head_lr=0.2, weight_decay=0.3)
    assert [(g["name"], g["lr"], g["weight_decay"]) for g in groups] == [
        ("backbone_no_decay", 0.1, 0.0), ("backbone", 0.1, 0.3), ("head_no_decay", 0.2, 0.0), ("head", 0.2, 0.3)]
    by_name = {g["name"]: g["params"] for g in groups}
    last = adapter.backbone[2].linear
    assert by_name["backbone"] == [last.weight]
    assert by_name["backbone_no_decay"] == [last.bias, *adapter.backbone_tail()]
    assert by_name["head"] == [p for p in adapter.head.parameters() if p.ndim >= 2]
    assert by_name["head_no_decay"] == [p for p in adapter.head.parameters() if p.ndim < 2]
    assert sum(p.numel() for ps in by_name.values() for p in ps) == adapter.num_parameters(trainable_only=True)
    assert adapter.num_parameters() == sum(p.numel() for p in adapter.parameters())
    assert adapter.num_parameters() > adapter.num_parameters(trainable_only=True)
    frozen = _toy(finetune=FinetuneConfig(mode="frozen"), head=HeadConfig(kind="linear"))
    assert [g["name"] for g in frozen.param_groups(0.1, 0.2)] == ["head_no_decay", "head"]
    assert all(g["weight_decay"] == 0.0 for g in frozen.param_groups(0.1, 0.2))  # the default decay


def test_the_repr_names_type_width_and_mode():
    assert _toy(embed_dim=8).extra_repr() == f"type='{TOY}', embed_dim=8, finetune='full'"


# --------------------------------------------------------------------------- saving and loading


def test_a_saved_adapter_loads_with_the_same_outputs(tmp_path):
    adapter = _toy(embed_dim=8, finetune=FinetuneConfig(mode="last_n", last_n=2)).train()
    adapter({"values": torch.randn(4, 3)})  # moves the head's running statistics
    adapter.eval()
    folder = adapter.save_pretrained(tmp_path / "deep" / "toy")
    assert folder == tmp_path / "deep" / "toy"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "toy_extra.txt"]
    text = (folder / "config.json").read_text()
    assert json.loads(text) == adapter.config.to_dict() and text.startswith('{\n  "type": ')
    for loader in (Adapter, ToyAdapter):
        loaded = loader.from_pretrained(folder).eval()
        assert type(loaded) is ToyAdapter and loaded.config == adapter.config
        values = {"values": torch.randn(3, 3)}
        assert torch.equal(loaded(values), adapter(values))
        assert _trains(loaded.backbone.parameters()) == _trains(adapter.backbone.parameters())
        # rebuilt from the saved folder, no pretrained weights fetched
        assert loaded.built_with == {"load_weights": False, "saved_dir": folder}
    adapter.save_pretrained(str(folder))  # again, over the same folder


@pytest.fixture
def saved(tmp_path):
    folder = _toy().save_pretrained(tmp_path / "toy")
    return folder, folder / "config.json", folder / "model.safetensors"


def test_a_missing_file_is_named(saved, tmp_path):
    folder, config, weights = saved
    with pytest.raises(FileNotFoundError) as caught:
        Adapter.from_pretrained(tmp_path / "nothing")
    assert str(caught.value) == f"no saved adapter at {tmp_path / 'nothing'}: missing config.json"
    weights.unlink()
    with pytest.raises(FileNotFoundError) as caught:
        Adapter.from_pretrained(folder)
    assert str(caught.value) == f"no saved adapter at {folder}: missing model.safetensors"


def _rewrite(config_path, **changes) -> None:
    data = json.loads(config_path.read_text())
    data.update(changes)
    config_path.write_text(json.dumps(data))


def test_a_config_that_does_not_build_is_named_with_its_file(saved):
    folder, config, _ = saved
    _rewrite(config, type="no_such_type")
    with pytest.raises(ValueError, match=rf"^{config}: unknown adapter type 'no_such_type'"):
        Adapter.from_pretrained(folder)
    _rewrite(config, type=TOY, widht=4)
    with pytest.raises(ValueError, match=rf"^{config}: '{TOY}' adapter config: unknown key 'widht' \(did you mean"):
        Adapter.from_pretrained(folder)
    _rewrite(config, type=TOY, widht=None)
    data = json.loads(config.read_text())
    del data["widht"]
    data["activation"] = "tanh"  # the backbone's own KeyError: told by its key, not repr'd
    config.write_text(json.dumps(data))
    with pytest.raises(ValueError) as caught:
        Adapter.from_pretrained(folder)
    assert str(caught.value) == f"{config}: tanh"
    config.write_text("[1]")
    with pytest.raises(ValueError, match=rf"^{config}: expected a JSON object, got list"):
        Adapter.from_pretrained(folder)


def test_an_adapter_of_another_class_is_refused(saved):
    folder, config, _ = saved
    with pytest.raises(ValueError) as caught:
        MLPAdapter.from_pretrained(folder)
    assert str(caught.value) == f"{config} holds a '{TOY}' adapter, not a MLPAdapter"


def test_weights_that_do_not_fit_or_are_damaged_are_named(saved):
    from mmviews.data.safe_pickle import CorruptFileError

    folder, config, weights = saved
    _rewrite(config, width=5)
    with pytest.raises(ValueError) as caught:
        Adapter.from_pretrained(folder)
    message = str(caught.value)
    assert message.startswith(f"{weights}: does not fit the adapter of {config} (") and "\n" not in message
    _rewrite(config, width=4, depth=2)  # the same shapes, one block fewer: keys missing and left over
    with pytest.raises(ValueError) as caught:
        Adapter.from_pretrained(folder)
    assert str(caught.value) == (f"{weights}: does not fit the adapter of {config} "
                                 "(Error(s) in loading state_dict for ToyAdapter:)")
    _rewrite(config, depth=3)
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CorruptFileError) as caught:
        Adapter.from_pretrained(folder)
    assert str(caught.value).startswith(f"{weights}: not a readable safetensors file (")
    assert str(caught.value).endswith("): truncated or corrupt")
