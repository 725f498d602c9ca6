"""``data.options.flow: raft``: the flow view is computed in the step, on the training device, by
torchvision's RAFT from the frames the loader delivers (mmviews.modalities.device_flow).

Real clips written with PyAV (laid out as UCF-101), random-weight RAFT (raft_small) saved to a
file, tiny CNN encoders. The references call torchvision's RAFT themselves, pair by pair."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_utils import own_accelerate_state
from torchvision.models.optical_flow import raft_small
from video_clips import make_ucf101

from mmviews.config import ConfigError, config_from_dict
from mmviews.data.video import VideoFolder
from mmviews.data.views import ViewSetCollator
from mmviews.modalities.device_flow import RAFTFlow, RAFTOptions, holds_frames, raft_input_side
from mmviews.train.build import build_run
from mmviews.train.setup import make_accelerator, prepare_run
from mmviews.train.step import train_step

SIZE = 128  # RAFT's smallest side: frames at it reach RAFT unresized


@pytest.fixture(scope="module")
def raft_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight raft_small state dict, named as torchvision names its files (hash suffix)."""
    torch.manual_seed(7)
    folder = tmp_path_factory.mktemp("raft")
    path = folder / "raft.pth"
    torch.save(raft_small(weights=None).state_dict(), path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    named = folder / f"raft_small_random-{digest[:8]}.pth"
    path.rename(named)
    return named


@pytest.fixture(scope="module")
def ucf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ucf101(tmp_path_factory.mktemp("ucf"), classes=2, train_per_class=2, test_per_class=1, n_frames=6,
                       size=(96, 128), audio=False)


def reference_net(raft_file: Path) -> torch.nn.Module:
    net = raft_small(weights=None)
    net.load_state_dict(torch.load(raft_file, weights_only=True))
    return net.eval()


def reference_flow(net: torch.nn.Module, frames: torch.Tensor, iterations: int = 12) -> torch.Tensor:
    """torchvision's RAFT on the consecutive pairs of ``frames [B, T, 3, H, W]`` (in [0, 1]; RAFT
    reads [-1, 1]), all pairs in one call, listed clip by clip: ``[B, T - 1, 2, H, W]``."""
    B, T = frames.shape[:2]
    first = torch.stack([frames[b, t] for b in range(B) for t in range(T - 1)])
    second = torch.stack([frames[b, t + 1] for b in range(B) for t in range(T - 1)])
    with torch.no_grad():
        flow = net(first * 2 - 1, second * 2 - 1, num_flow_updates=iterations)[-1]
    return torch.stack([torch.stack([flow[b * (T - 1) + t] for t in range(T - 1)]) for b in range(B)])


def test_raft_flow_is_torchvisions_raft_on_each_pair(raft_file: Path) -> None:
    frames = torch.rand(2, 3, 3, SIZE, SIZE)
    reference = reference_flow(reference_net(raft_file), frames, 2)
    flow = RAFTFlow(RAFTOptions(weights=str(raft_file), iterations=2))(frames)
    assert flow.shape == (2, 2, 2, SIZE, SIZE) and flow.dtype == torch.float32
    torch.testing.assert_close(flow, reference, rtol=0, atol=1e-5)
    # in calls of 3 pairs: the same pairs (batching changes the float rounding of the convolutions only)
    chunked = RAFTFlow(RAFTOptions(weights=str(raft_file), iterations=2, pairs_per_call=3))(frames)
    torch.testing.assert_close(chunked, reference, rtol=1e-4, atol=1e-4)


def test_small_frames_run_at_raft_size_and_come_back_scaled(raft_file: Path) -> None:
    assert [raft_input_side(s) for s in (64, 112, 128, 130, 200)] == [128, 128, 128, 136, 200]
    frames = torch.rand(1, 2, 3, 112, 96)
    flow = RAFTFlow(RAFTOptions(weights=str(raft_file), iterations=2))(frames)
    up = torch.nn.functional.interpolate(frames[0], size=(128, 128), mode="bilinear", align_corners=False)
    at_raft = reference_flow(reference_net(raft_file), up[None], 2)[0]
    back = torch.nn.functional.interpolate(at_raft, size=(112, 96), mode="bilinear", align_corners=False)
    back[:, 0] *= 96 / 128
    back[:, 1] *= 112 / 128
    torch.testing.assert_close(flow[0], back, rtol=0, atol=1e-5)


def test_weights_file_is_checked_by_the_hash_in_its_name(raft_file: Path, tmp_path: Path) -> None:
    wrong = tmp_path / "raft_small_x-00000000.pth"
    wrong.write_bytes(raft_file.read_bytes())
    with pytest.raises(ValueError, match=r"raft_small_x-00000000.pth: sha256 .* does not begin with '00000000'"):
        RAFTFlow(RAFTOptions(weights=str(wrong)))
    with pytest.raises(FileNotFoundError, match="data.options.raft_weights: 'C_T_V9' is neither a file nor a weight tag"):
        RAFTFlow(RAFTOptions(weights="C_T_V9"))
    large = tmp_path / "large.pth"
    torch.save({"w": torch.zeros(1)}, large)
    with pytest.raises(ValueError, match="large.pth: not raft_small weights"):
        RAFTFlow(RAFTOptions(weights=str(large)))


@pytest.mark.parametrize("options,message", [
    ({"raft_model": "raft_tiny"}, "data.options.raft_model: must be one of raft_small, raft_large, got 'raft_tiny'"),
    ({"raft_iterations": 0}, "data.options.raft_iterations: must be an integer >= 1, got 0"),
    ({"raft_pairs_per_call": 2.5}, "data.options.raft_pairs_per_call: must be an integer >= 1, got 2.5"),
])
def test_bad_raft_options_name_their_key(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RAFTOptions.from_data_options({"flow": "raft", **options})
    assert RAFTOptions.from_data_options({"flow": "farneback"}) is None


def test_the_dataset_delivers_frames_and_raft_options_need_flow_raft(ucf: Path) -> None:
    data = VideoFolder(ucf, "train", dataset="ucf101", num_frames=3, size=SIZE, flow="raft", audio=False, store=False)
    sample = data[0]
    assert sample["modalities"]["flow"] is sample["modalities"]["video"]  # decoded once, no flow in the worker
    assert data.modality_info()["flow"] == {"kind": "flow_frames", "shape": (3, 3, SIZE, SIZE)}
    with pytest.raises(ValueError, match="raft_model apply with flow='raft', got flow='farneback'"):
        VideoFolder(ucf, "train", dataset="ucf101", flow="farneback", raft_model="raft_small", store=False)


def test_the_augmented_flow_views_frames_share_the_flow_crop(ucf: Path) -> None:
    """flow_default on frames crops and flips them with the numbers it draws for their flow."""
    from mmviews.data.augment import flow_default

    aug = flow_default(num_frames=2, size=64)
    frames = torch.rand(4, 3, 96, 96)
    out = aug(frames, torch.Generator().manual_seed(3))
    assert out.shape == (2, 3, 64, 64)
    flow_out = aug(torch.rand(3, 2, 96, 96), torch.Generator().manual_seed(3))
    assert flow_out.shape == (1, 2, 64, 64)  # the flow of those two frames


def recipe(root: Path, raft_file: Path, **data_options: Any) -> dict[str, Any]:
    head = {"kind": "mlp", "hidden_dim": 16}
    return {
        "name": "raft", "seed": 0, "cpu": True,
        "data": {"name": "ucf101", "root": str(root), "batch_size": 4, "num_workers": 0, "eval_batch_size": 4,
                 "options": {"num_frames": 3, "size": SIZE, "flow": "raft", "audio": False, "store": False,
                             "raft_weights": str(raft_file), "raft_iterations": 3, **data_options}},
        "views": [{"modality": "video"}, {"modality": "flow"},
                  {"modality": "flow", "augment": "flow_default", "params": {"size": SIZE}}],
        "encoder": {"embed_dim": 8},
        "adapters": {"video": {"type": "small_cnn", "channels": [4], "head": head},
                     "flow": {"type": "flow_cnn", "channels": [4], "head": head}},
        "objective": {"name": "mv_dhel", "params": {"temperature": 0.5}},
        "optimisation": {"optimizer": "sgd", "lr": 0.1, "epochs": 1},
        "output": {"log_every": 1, "progress_bar": False},
    }


class FlowSeen:
    """Records the flow inputs the flow adapter receives and counts RAFT's calls."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        self.values: list[torch.Tensor] = []
        self.raft_calls = 0
        adapter = encoder.adapters["flow"]
        features = adapter.features

        def recorded(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            self.values.append(inputs["values"].detach().clone())
            return features(inputs, *args, **kwargs)

        adapter.features = recorded
        encoder.device_flow.net.register_forward_pre_hook(self._raft)

    def _raft(self, module: Any, args: tuple[Any, ...]) -> None:
        self.raft_calls += 1


def one_step(raw: dict[str, Any], tmp: Path, eval_mode: bool = False) -> tuple[float, Any, Any, FlowSeen, Any]:
    """One training step of ``raw`` in this process: (loss, parts, prepared, recorder, first batch)."""
    with own_accelerate_state():
        config = config_from_dict(raw, "raft.yaml")
        parts = build_run(config, with_eval=False)
        seen = FlowSeen(parts.encoder)
        p = prepare_run(make_accelerator(config, tmp), parts)
        batch = next(iter(p.train_loader))
        if eval_mode:  # BatchNorm on running statistics: the same however the batch is chunked
            p.model.eval()
        out, _ = train_step(p, batch, None)
    return float(out.loss.detach()), parts, p, seen, batch


def test_the_flow_adapter_gets_torchvisions_raft_of_the_frames_and_raft_gets_no_gradient(ucf, raft_file, tmp_path):
    before = reference_net(raft_file).state_dict()
    loss, parts, p, seen, batch = one_step(recipe(ucf, raft_file), tmp_path)
    assert torch.isfinite(torch.tensor(loss))
    frames = batch.inputs["flow"]["frames"]  # [K * 2, T, 3, H, W]: the natural and the augmented view's frames
    assert frames.shape == (8, 3, 3, SIZE, SIZE)
    assert len(seen.values) == 1 and seen.raft_calls == 1  # every pair in one call (raft_pairs_per_call 64)
    torch.testing.assert_close(seen.values[0], reference_flow(reference_net(raft_file), frames, 3), rtol=0, atol=1e-5)
    net = parts.encoder.device_flow.net
    assert all(q.grad is None and not q.requires_grad for q in net.parameters())
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k].cpu()) for k in before)  # frozen, buffers too
    optimised = {id(q) for group in p.optimizer.param_groups for q in group["params"]}
    assert not optimised & {id(q) for q in net.parameters()}
    assert not any(k.startswith("device_flow") for k in parts.encoder.state_dict())
    assert copy.deepcopy(parts.encoder).device_flow is parts.encoder.device_flow  # the EMA teacher shares it


def test_the_cached_step_computes_the_flow_once_and_gives_the_plain_loss(ucf, raft_file, tmp_path):
    plain, *_ = one_step(recipe(ucf, raft_file), tmp_path / "plain", eval_mode=True)
    raw = recipe(ucf, raft_file)
    raw["optimisation"]["encode_chunk_size"] = 1
    cached, _, _, seen, _ = one_step(raw, tmp_path / "cached", eval_mode=True)
    assert seen.raft_calls == 1 and len(seen.values) == 8  # RAFT once for the batch; 4 chunks x 2 passes
    assert cached == pytest.approx(plain, rel=1e-5)


def test_a_store_of_exact_frames_gives_the_same_loss(ucf, raft_file, tmp_path):
    """With a store, RAFT reads the store's frames (npy, unresized: the decoded frames), not its flow."""
    from mmviews.data.video_store import prepare_video_store

    store = tmp_path / "ucf.mmstore"
    prepare_video_store(ucf, store, size=0, image_format="npy", flow="farneback", workers=0, progress=False)
    without, *_ = one_step(recipe(ucf, raft_file), tmp_path / "a")
    with_store, parts, *_ = one_step(recipe(ucf, raft_file, store=str(store)), tmp_path / "b")
    assert parts.datasets["train"].store is not None
    assert with_store == pytest.approx(without, rel=1e-6)


def test_a_recipe_with_a_bad_raft_option_fails_at_build(ucf, raft_file):
    raw = recipe(ucf, raft_file, raft_iterations=-1)
    with pytest.raises((ConfigError, ValueError), match="data.options.raft_iterations: must be an integer >= 1"):
        build_run(config_from_dict(raw, "raft.yaml"), with_eval=False)


def test_an_encoder_without_device_flow_names_the_frames(ucf, raft_file):
    config = config_from_dict(recipe(ucf, raft_file), "raft.yaml")
    parts = build_run(config, with_eval=False)
    batch = ViewSetCollator.for_dataset(parts.datasets["train"], parts.view_spec)([parts.datasets["train"][0]] * 2)
    assert holds_frames(batch.inputs["flow"])
    parts.encoder.device_flow = None
    with pytest.raises(ValueError) as raised:
        parts.encoder(batch)
    assert str(raised.value) == ("modalities ['flow'] carry frames for flow computed on the device (data.options.flow: "
                                 "raft) but the encoder has no device_flow: set encoder.device_flow = "
                                 "mmviews.modalities.device_flow.device_flow_for(data options)")


def test_options_defaults_and_values_given() -> None:
    assert RAFTOptions.from_data_options({"flow": "raft"}) == RAFTOptions("raft_small", "DEFAULT", None, 12, 64)
    given = RAFTOptions.from_data_options({"flow": "raft", "raft_model": "raft_large", "raft_weights": "C_T_V2",
                                           "raft_weights_sha256": "abc", "raft_iterations": 3,
                                           "raft_pairs_per_call": 5, "raft_ignored": 1})
    assert given == RAFTOptions("raft_large", "C_T_V2", "abc", 3, 5)
    for bad, message in (({"raft_weights": 5}, "data.options.raft_weights: a weight tag, a file or 'random', got 5"),
                         ({"raft_iterations": True}, "data.options.raft_iterations: must be an integer >= 1, got True")):
        with pytest.raises(ValueError) as raised:
            RAFTOptions.from_data_options({"flow": "raft", **bad})
        assert str(raised.value) == message


def test_random_weights_are_frozen_and_a_tag_without_network_is_one_line(monkeypatch) -> None:
    from urllib.error import URLError

    from torchvision.models import optical_flow

    from mmviews.modalities.device_flow import build_raft

    net = build_raft(RAFTOptions(weights="random"))
    assert not net.training and not any(q.requires_grad for q in net.parameters())
    flow = RAFTFlow(RAFTOptions(weights="random"), net=net)
    assert flow.net is net and repr(flow) == "RAFTFlow(raft_small, weights='random', iterations=12)"
    calls = []

    def offline(weights: object = None, progress: bool = True) -> None:
        calls.append((weights, progress))
        raise URLError("no network")

    monkeypatch.setattr(optical_flow, "raft_small", offline)
    with pytest.raises(OSError) as raised:
        build_raft(RAFTOptions(weights="C_T_V2"))
    assert calls == [("C_T_V2", False)]
    assert str(raised.value) == (
        "data.options.raft_weights: cannot get torchvision's raft_small weights 'C_T_V2' (URLError: <urlopen error no "
        "network>); give a local file (data.options.raft_weights: /path/raft_small_C_T_V2-<hash>.pth, checked by the hex "
        "digits of its name or data.options.raft_weights_sha256)")


def test_bad_frames_and_what_convert_keeps(raft_file: Path) -> None:
    from mmviews.data.batch import ViewBatch, ViewInfo

    flow = RAFTFlow(RAFTOptions(weights=str(raft_file), iterations=1))
    for shape in ((2, 3, SIZE, SIZE), (1, 1, 3, SIZE, SIZE), (1, 2, 2, SIZE, SIZE)):
        with pytest.raises(ValueError, match=r"frames must be \[B, T >= 2, 3, H, W\], got shape"):
            flow(torch.rand(shape))
    assert holds_frames({"frames": 1}) and not holds_frames({"frames": 1, "values": 2}) and not holds_frames([1])
    views = [ViewInfo("video_0", "video", 0), ViewInfo("flow_0", "flow", 0)]
    video = {"values": torch.rand(1, 2, 3, SIZE, SIZE)}
    plain = ViewBatch(inputs={"video": video, "flow": {"values": torch.zeros(1, 1, 2, SIZE, SIZE)}}, views=views,
                      mask=torch.ones(1, 2, dtype=torch.bool))
    assert flow.convert(plain) is plain  # no frames: the same batch
    batch = ViewBatch(inputs={"video": video, "flow": {"frames": video["values"], "extra": 7}}, views=views,
                      mask=torch.ones(1, 2, dtype=torch.bool), inputs_checked=True)
    out = flow.convert(batch)
    assert set(out.inputs["flow"]) == {"values", "extra"} and out.inputs["flow"]["extra"] == 7
    assert out.inputs["video"] is video and out.inputs_checked and holds_frames(batch.inputs["flow"])  # not changed
    torch.testing.assert_close(out.inputs["flow"]["values"], flow(video["values"]), rtol=0, atol=0)


def test_the_edges_of_the_options_and_of_the_weights(raft_file: Path, tmp_path: Path, monkeypatch) -> None:
    from urllib.error import URLError

    from torchvision.models import optical_flow

    from mmviews.modalities.device_flow import build_raft, device_flow_for

    assert RAFTOptions.from_data_options({"flow": "raft", "raft_iterations": 1, "raft_pairs_per_call": 1}).iterations == 1
    with pytest.raises(ValueError, match="data.options.raft_weights: a weight tag, a file or 'random', got ''"):
        RAFTOptions.from_data_options({"flow": "raft", "raft_weights": ""})
    assert device_flow_for({"flow": "farneback"}) is None
    made = device_flow_for({"flow": "raft", "raft_weights": "random", "raft_iterations": 2})
    assert isinstance(made, RAFTFlow) and made.options.iterations == 2
    loose = raft_small(weights=None)  # given trainable: frozen by RAFTFlow
    assert not any(q.requires_grad for q in RAFTFlow(RAFTOptions(weights="random"), net=loose).net.parameters())
    # an explicit sha256 is checked too (the file's name says nothing here)
    plain = tmp_path / "raft.pth"
    plain.write_bytes(raft_file.read_bytes())
    with pytest.raises(ValueError, match=r"raft.pth: sha256 .* does not begin with 'abcd'"):
        build_raft(RAFTOptions(weights=str(plain), weights_sha256="abcd"))
    good = hashlib.sha256(plain.read_bytes()).hexdigest()[:10]
    assert build_raft(RAFTOptions(weights=str(plain), weights_sha256=good)) is not None
    large = tmp_path / "other.pth"
    torch.save({"w": torch.zeros(1)}, large)
    with pytest.raises(ValueError) as raised:
        build_raft(RAFTOptions(weights=str(large)))
    assert str(raised.value).startswith(f"{large}: not raft_small weights (Error(s) in loading state_dict for RAFT:")
    with pytest.raises(FileNotFoundError) as raised:
        build_raft(RAFTOptions(weights="C_T_V9"))
    assert str(raised.value) == ("data.options.raft_weights: 'C_T_V9' is neither a file nor a weight tag of raft_small "
                                 "(C_T_V1, C_T_V2, DEFAULT), nor 'random'")
    calls = []

    def offline(weights: object = None, progress: bool = True) -> None:
        calls.append(weights)
        raise RuntimeError()

    monkeypatch.setattr(optical_flow, "raft_small", offline)
    with pytest.raises(OSError) as raised:
        build_raft(RAFTOptions())  # DEFAULT: torchvision's best weights of the model
    assert calls == ["DEFAULT"]
    assert str(raised.value).startswith("data.options.raft_weights: cannot get torchvision's raft_small weights "
                                        "'DEFAULT' (RuntimeError: ); give a local file")
    assert str(raised.value).endswith("checked by the hex digits of its name or data.options.raft_weights_sha256)")
