"""A backbone of one's own: ``register_backbone`` in the user's code, or an installed package's
``mmviews.adapters`` entry point, makes an adapter type a recipe names; it trains, saves and
loads like a built-in one. A recipe never names code to import."""

from __future__ import annotations

import math
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn

from mmviews.modalities import (
    ENTRY_POINT_GROUP,
    Adapter,
    AdapterConfig,
    MultiViewEncoder,
    build_adapter,
    list_adapters,
    register_adapter,
    register_backbone,
)
from mmviews.modalities.inputs import require_tensor


# Adapter types the tests below register (in a test, or by loading an entry point): each test
# starts without them and leaves none behind, so that the file runs again in one process (as
# mutation testing runs it).
TYPES_REGISTERED_IN_TESTS = (
    "test_flat_output", "test_recording_net", "test_not_a_module", "test_x", "test_described-net_x",
    "test_undocumented", "test_plugin_net", "test_broken_net", "test_plugin_adapter", "test_plugin_wrong",
    "test_plugin_other", "test_plugin_self_registered", "test_multiline_doc", "test_partial_net", "test_declared_width",
    "test_tuple_output", "test_no_blocks",
)


@pytest.fixture(autouse=True)
def _registered_in_the_test_only():
    """Types a test registers are gone before and after it: a type left registered would
    reach later tests of the same worker (e.g. the registry's every-type-is-described check)."""
    from mmviews.modalities import base

    def forget() -> None:
        for name in TYPES_REGISTERED_IN_TESTS:
            base._ADAPTERS._entries.pop(name, None)

    forget()
    yield
    forget()


@register_backbone("test_tiny_convnet")
class TinyConvNet(nn.Module):
    """Two conv stages and a global average (a user's own module)."""

    def __init__(self, width: int = 8, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.stage = nn.Sequential(nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.ReLU())

    def blocks(self) -> list[nn.Module]:
        return [self.stem, self.stage]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.stage(self.stem(images)).mean(dim=(2, 3))


def test_a_registered_module_is_an_adapter_type(tmp_path):
    assert list_adapters()["test_tiny_convnet"] == "Two conv stages and a global average (a user's own module)."
    adapter = build_adapter({"type": "test_tiny_convnet", "args": {"width": 4}, "embed_dim": 8, "image_size": 16})
    assert adapter.feature_dim == 8  # measured by one forward: 2 * width
    assert isinstance(adapter.backbone, TinyConvNet) and adapter.backbone.stem[0].out_channels == 4
    images = torch.rand(5, 3, 24, 24)  # resized and centre-cropped to 16
    adapter.eval()
    with torch.no_grad():
        z = adapter({"values": images})
        expected = adapter.backbone((nn.functional.interpolate(images, size=16, mode="bilinear", antialias=True)
                                     .clamp(0, 1) - 0.5) / 0.25)
        torch.testing.assert_close(adapter.features({"values": images}), expected, rtol=1e-4, atol=1e-5)
    assert z.shape == (5, 8) and torch.allclose(z.norm(dim=-1), torch.ones(5))
    adapter.save_pretrained(tmp_path / "saved")
    loaded = Adapter.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded({"values": images}), z)

    last = build_adapter({"type": "test_tiny_convnet", "finetune": {"mode": "last_n", "last_n": 1}})
    assert [p.requires_grad for p in last.backbone.stem.parameters()] == [False] * 4
    assert all(p.requires_grad for p in last.backbone.stage.parameters())
    one_channel = build_adapter({"type": "test_tiny_convnet", "args": {"in_channels": 1}, "in_channels": 1})
    assert one_channel({"values": torch.rand(2, 1, 8, 8)}).shape == (2, 128)


def test_registration_and_config_errors_are_clear():
    with pytest.raises(ValueError, match="adapter type 'test_tiny_convnet' is registered twice"):
        register_backbone("test_tiny_convnet")(TinyConvNet)
    with pytest.raises(ValueError, match=r"test_tiny_convnet adapter: args\.width must be a number, string or list"):
        build_adapter({"type": "test_tiny_convnet", "args": {"width": {"nested": 1}}})
    with pytest.raises(TypeError, match="unexpected keyword argument 'depth'"):
        build_adapter({"type": "test_tiny_convnet", "args": {"depth": 3}})
    with pytest.raises(ValueError, match=r"unknown adapter type 'test_tiny_convnt' \(did you mean 'test_tiny_convnet'\?\)"):
        build_adapter({"type": "test_tiny_convnt"})

    @register_backbone("test_flat_output")
    def flat(width: int = 4) -> nn.Module:
        return nn.Conv2d(3, width, 3)

    with pytest.raises(ValueError, match=r"test_flat_output adapter: the backbone must return features \[N, F\], "
                                         r"got \(2, 4, 30, 30\)"):
        build_adapter({"type": "test_flat_output"})


def test_the_documented_example_trains_its_own_backbone(tmp_path, monkeypatch, capsys):
    """docs/examples/own_backbone.py, run as a user runs it: it registers its module, trains the
    recipe that names it, and the saved encoder loads with that module as its image backbone."""
    import runpy

    example = Path(__file__).resolve().parents[1] / "docs" / "examples" / "own_backbone.py"
    monkeypatch.setattr(sys, "argv", [str(example), str(tmp_path / "run")])
    namespace = runpy.run_path(str(example), run_name="__main__")
    assert "test/linear/class/acc trained" in capsys.readouterr().out
    encoder = MultiViewEncoder.from_pretrained(tmp_path / "run" / "encoder")
    assert type(encoder.adapters["image"].backbone) is namespace["MyConvNet"]
    assert encoder.adapters["image"].config.to_dict()["args"] == {"width": 16}


def _install_package(root, name: str, body: str, entry: str) -> None:
    """A package installed the way pip leaves one: its module and a dist-info with entry points."""
    (root / f"{name}.py").write_text(textwrap.dedent(body))
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{entry}\n")


def test_an_installed_entry_point_is_loaded_only_for_a_type_nothing_registered(tmp_path, monkeypatch):
    _install_package(tmp_path, "mmviews_test_plugin", """
        from torch import nn

        class PluginNet(nn.Module):
            \"\"\"A backbone from an installed package.\"\"\"
            feature_dim = 6

            def __init__(self, width: int = 6):
                super().__init__()
                self.conv = nn.Conv2d(3, width, 1)

            def forward(self, images):
                return self.conv(images).mean(dim=(2, 3))
        """, "test_plugin_net = mmviews_test_plugin:PluginNet\ntest_broken_net = mmviews_test_missing:Net")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mmviews_test_plugin", raising=False)

    build_adapter({"type": "test_tiny_convnet"})  # a registered type: no entry point is looked at
    from mmviews.cli.list import adapter_rows

    listed = {name: description for name, description, _ in adapter_rows()}  # listed, not imported
    assert listed["test_plugin_net"] == ("installed entry point mmviews_test_plugin:PluginNet (mmviews.adapters), "
                                         "loaded when a config names it")
    assert "mmviews_test_plugin" not in sys.modules
    adapter = build_adapter({"type": "test_plugin_net", "embed_dim": 4})
    assert "mmviews_test_plugin" in sys.modules and type(adapter.backbone).__name__ == "PluginNet"
    assert adapter.feature_dim == 6 and adapter({"values": torch.rand(3, 3, 8, 8)}).shape == (3, 4)
    assert "test_plugin_net" in list_adapters()
    with pytest.raises(ValueError, match=r"adapter type 'test_broken_net': entry point 'mmviews_test_missing:Net' "
                                         r"\(mmviews\.adapters\) failed to load: No module named 'mmviews_test_missing'"):
        build_adapter({"type": "test_broken_net"})


@dataclass
class PitchCNNConfig(AdapterConfig):
    """CREPE's capacity (``tiny`` or ``full``) and whether to load its published weights."""

    type: ClassVar[str] = "test_crepe_pitch"
    capacity: str = "tiny"
    pretrained: bool = True


@register_adapter
class PitchCNNAdapter(Adapter):
    """CREPE's pitch CNN (torchcrepe) on 1024-sample frames of 16 kHz audio: a user's own adapter
    for inputs other than images (an Adapter subclass registered with @register_adapter)."""

    config_class = PitchCNNConfig
    config: PitchCNNConfig

    def __init__(self, config: PitchCNNConfig, *, load_weights: bool = True, saved_dir: Path | None = None) -> None:
        super().__init__(config)
        import torchcrepe

        self.backbone = torchcrepe.Crepe(config.capacity)
        if config.pretrained and load_weights and saved_dir is None:  # the weights torchcrepe ships
            file = Path(torchcrepe.__file__).parent / "assets" / f"{config.capacity}.pth"
            self.backbone.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))
        self.backbone.eval()
        with torch.no_grad():
            self.feature_dim = int(self.backbone.embed(torch.zeros(2, 1024)).flatten(1).shape[1])
        self._finish_init()

    def preprocess(self, inputs, present=None):
        frames = require_tensor(inputs, "values", "test_crepe_pitch adapter").float()
        if frames.dim() != 2 or frames.shape[1] != 1024:
            raise ValueError(f"test_crepe_pitch adapter: values must be [B, 1024], got {tuple(frames.shape)}")
        centred = frames - frames.mean(1, keepdim=True)
        return {"frames": centred / centred.std(1, keepdim=True).clamp_min(1e-8)}  # as torchcrepe normalises

    def encode(self, prepared):
        return self.backbone.embed(prepared["frames"]).flatten(1)


def test_an_adapter_subclass_of_ones_own_loads_crepes_pitch_weights_which_beat_random_init():
    """Real pretrained audio weights (CREPE's, shipped inside the torchcrepe package) through a
    user's own adapter type: on the pitch class of harmonic tones in noise (12 semitones, three
    octaves, 1024 samples at 16 kHz) the linear probe of the pretrained features beats random
    initialisation (measured: 1.00 against 0.73; chance 0.08)."""
    pytest.importorskip("torchcrepe")  # the test-models extra
    from mmviews.eval.probes import linear_probe_classification

    g = torch.Generator().manual_seed(0)
    n = 300
    labels = torch.randint(12, (n,), generator=g)
    f0 = 110 * 2 ** (torch.randint(0, 3, (n,), generator=g) + labels / 12)
    t = torch.arange(1024) / 16000
    phase = torch.rand(n, 1, generator=g) * 2 * math.pi
    tones = sum(0.6 ** k * torch.sin(2 * math.pi * (k + 1) * f0[:, None] * t + (k + 1) * phase) for k in range(4))
    tones = tones + 0.3 * torch.randn(n, 1024, generator=g)
    accuracy = {}
    for pretrained in (True, False):
        torch.manual_seed(0)
        adapter = build_adapter({"type": "test_crepe_pitch", "pretrained": pretrained, "finetune": {"mode": "frozen"}})
        with torch.no_grad():
            features = adapter.eval().features({"values": tones})
        probe = linear_probe_classification(features[:200], labels[:200], test_x=features[200:], test_y=labels[200:])
        accuracy[pretrained] = probe.metrics["test_acc"]
    assert accuracy[True] >= 0.9 and accuracy[True] >= accuracy[False] + 0.15, accuracy


def test_the_width_probe_leaves_batchnorm_statistics_and_the_training_mode_alone():
    """Measuring the backbone's width runs one forward of blank images in eval mode: the
    BatchNorm running statistics stay those of a fresh layer, and the mode is restored."""
    adapter = build_adapter({"type": "test_tiny_convnet", "args": {"width": 4}, "image_size": 8})
    norm = adapter.backbone.stem[1]
    assert adapter.feature_dim == 8
    assert torch.equal(norm.running_mean, torch.zeros(4)) and torch.equal(norm.running_var, torch.ones(4))
    assert int(norm.num_batches_tracked) == 0
    assert adapter.backbone.training
    # the probe's images: two blank ones of the configured side and channels (a backbone that records them)
    seen = []

    @register_backbone("test_recording_net")
    class Recording(nn.Module):
        def forward(self, images):
            seen.append((tuple(images.shape), float(images.abs().sum()), self.training, torch.is_grad_enabled()))
            return images.mean(dim=(2, 3))

    build_adapter({"type": "test_recording_net", "in_channels": 2, "mean": [0.5, 0.5], "std": [0.2, 0.2],
                   "image_size": 12})
    assert seen == [((2, 2, 12, 12), 0.0, False, False)]
    seen.clear()
    build_adapter({"type": "test_recording_net"})
    assert seen == [((2, 3, 32, 32), 0.0, False, False)]  # no image_size: 32
    seen.clear()
    assert build_adapter({"type": "test_recording_net", "feature_dim": 5}).feature_dim == 5 and seen == []


def test_a_factory_must_give_a_module_and_be_callable():
    @register_backbone("test_not_a_module")
    def not_a_module() -> int:
        return 3

    with pytest.raises(ValueError, match=r"^test_not_a_module adapter: the registered factory returned int, not an nn\.Module$"):
        build_adapter({"type": "test_not_a_module"})
    with pytest.raises(ValueError, match=r"^register_backbone\('test_x'\): 3 is not callable$"):
        register_backbone("test_x")(3)


def test_a_backbones_description_and_adapter_class():
    from mmviews.modalities import custom

    @register_backbone("test_described-net_x", "said here")
    class Described(nn.Module):
        feature_dim = 3

        def forward(self, images):
            return images.mean(dim=(2, 3))

    @register_backbone("test_undocumented")
    def undocumented() -> nn.Module:
        return Described()

    listed = list_adapters()
    assert listed["test_described-net_x"] == "said here" and listed["test_undocumented"] == "backbone test_undocumented"
    adapter = build_adapter({"type": "test_described-net_x"})
    assert type(adapter).__name__ == "TestDescribedNetXAdapter" and type(adapter).__module__ == __name__
    assert type(adapter.config).__name__ == "TestDescribedNetXConfig" and adapter.config.type == "test_described-net_x"
    assert adapter.feature_dim == 3 and adapter.channels() == 3
    assert custom._class_name("__") == "Custom"


PLUGIN_ADAPTERS = """
    from dataclasses import dataclass
    from typing import ClassVar

    from mmviews.modalities import Adapter, AdapterConfig, register_backbone


    @dataclass
    class RightConfig(AdapterConfig):
        type: ClassVar[str] = "test_plugin_adapter"


    class RightAdapter(Adapter):
        config_class = RightConfig


    @dataclass
    class WrongConfig(AdapterConfig):
        type: ClassVar[str] = "test_plugin_other"


    class WrongAdapter(Adapter):
        config_class = WrongConfig


    @register_backbone("test_plugin_self_registered")
    def self_registered():
        raise AssertionError("not built here")
    """


def test_an_entry_points_adapter_must_have_the_entry_points_type(tmp_path, monkeypatch):
    """An ``Adapter`` subclass offered under another type than its own is refused and left
    unregistered; one of its own type is registered; a package that registers its type when
    imported is taken as it is."""
    from mmviews.modalities.base import adapter_registered
    from mmviews.modalities.custom import load_entry_point_adapter, unloaded_entry_points

    _install_package(tmp_path, "mmviews_test_adapters", PLUGIN_ADAPTERS,
                     "test_plugin_adapter = mmviews_test_adapters:RightAdapter\n"
                     "test_plugin_wrong = mmviews_test_adapters:WrongAdapter\n"
                     "test_plugin_self_registered = mmviews_test_adapters:self_registered")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mmviews_test_adapters", raising=False)
    waiting = unloaded_entry_points()
    assert {k: waiting[k] for k in ("test_plugin_adapter", "test_plugin_wrong")} == {
        "test_plugin_adapter": "mmviews_test_adapters:RightAdapter", "test_plugin_wrong": "mmviews_test_adapters:WrongAdapter"}
    assert "test_tiny_convnet" not in waiting  # registered: no entry point of that name would be loaded
    with pytest.raises(ValueError, match=r"^adapter type 'test_plugin_wrong': entry point 'mmviews_test_adapters:WrongAdapter' "
                                         r"gives an adapter of type 'test_plugin_other'$"):
        load_entry_point_adapter("test_plugin_wrong")
    assert not adapter_registered("test_plugin_wrong") and not adapter_registered("test_plugin_other")
    assert adapter_registered("test_plugin_self_registered")  # the import registered it
    assert load_entry_point_adapter("test_plugin_self_registered") is True
    assert load_entry_point_adapter("test_plugin_adapter") is True
    assert adapter_registered("test_plugin_adapter")
    assert "test_plugin_adapter" not in unloaded_entry_points()
    assert load_entry_point_adapter("test_no_such_entry_point") is False


def test_width_probe_guard_fails_when_the_probe_runs_in_train_mode(monkeypatch):
    from mutations import apply_break

    apply_break("width_probe_in_train_mode", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        test_the_width_probe_leaves_batchnorm_statistics_and_the_training_mode_alone()


def test_a_backbones_declared_width_description_and_module_are_kept():
    from mmviews.modalities.custom import CustomBackboneConfig

    @register_backbone("test_multiline_doc")
    class Documented(nn.Module):
        """First line of the doc.

        More that the listing leaves out."""

        feature_dim = 5  # declared: the width probe is not run

        def forward(self, images):
            raise AssertionError("no forward while building")

    adapter = build_adapter({"type": "test_multiline_doc"})
    assert adapter.feature_dim == 5 and list_adapters()["test_multiline_doc"] == "First line of the doc."
    assert type(adapter).__doc__ == "First line of the doc."  # the adapter class's doc: the first line
    assert type(adapter.config).__doc__ == CustomBackboneConfig.__doc__
    class Anonymous:  # a callable factory that names no module (a C-level callable may not)
        @property
        def __module__(self):
            raise AttributeError("__module__")

        def __call__(self, **kwargs):
            return TinyConvNet(width=2)

    register_backbone("test_partial_net")(Anonymous())
    partial = build_adapter({"type": "test_partial_net"})
    assert type(partial).__module__ == "mmviews.modalities.custom" and partial.feature_dim == 4


def test_a_backbone_must_return_a_feature_tensor_and_blocks_are_optional():
    @register_backbone("test_tuple_output")
    class Pair(nn.Module):
        def forward(self, images):
            return images.mean(dim=(2, 3)), images

    with pytest.raises(ValueError, match=r"^test_tuple_output adapter: the backbone must return features \[N, F\], "
                                         r"got tuple for images of shape \(2, 3, 32, 32\)$"):
        build_adapter({"type": "test_tuple_output"})

    @register_backbone("test_no_blocks")
    class Flat(nn.Module):
        def forward(self, images):
            return images.mean(dim=(2, 3))

    with pytest.raises(NotImplementedError, match="does not support finetune.mode='last_n'"):
        build_adapter({"type": "test_no_blocks"}).backbone_blocks()
