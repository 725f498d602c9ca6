"""Multi-GPU SyncBatchNorm with missing views, under two gloo processes (see
tests/dist_multigpu_worker.py): every rank takes part in every collective, even a rank whose
micro-batch has no present view of a modality, or a single one (and the EMA teacher's copy too).
A rank that skipped one would leave the other waiting: the process group's short timeout turns
that hang into a failure within seconds."""

from __future__ import annotations

import os

import dist_multigpu_worker as W  # tests/ is on sys.path (tests/conftest.py)
import pytest
import torch


@pytest.fixture(scope="module")
def multigpu_dir(tmp_path_factory):
    """The folder of the two ranks' results; the processes are started once for the tests of
    this file: the SyncBatchNorm steps, then (same processes) the process group's timeout of
    :func:`test_recipe_timeout_reaches_the_process_group`."""
    from test_train_sync import gaussian_config
    from test_train_utils import free_port

    port = free_port()  # for the process group of the timeout check
    out_dir = tmp_path_factory.mktemp("multigpu")
    recipe = gaussian_config({"name": "mv_dhel", "params": {}})
    W.launch(str(out_dir), timeout=150.0, then_timeout=(port, recipe))
    return out_dir


@pytest.fixture(scope="module")
def multigpu_results(multigpu_dir):
    """The two ranks' results of the SyncBatchNorm steps."""
    return [torch.load(multigpu_dir / f"rank{r}.pt", weights_only=False) for r in range(W.WORLD)]


def test_every_rank_joins_every_batchnorm_collective(multigpu_results):
    results = multigpu_results
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    counts = [[(s["forward"], s["backward"]) for s in r["steps"]] for r in results]
    assert counts[0] == counts[1], f"collectives per step differ between ranks: {counts}"
    # Every BatchNorm layer (backbone and head) synchronised forward, the student's also backward.
    forward, backward = counts[0][0]
    assert forward > backward > 0, counts
    assert all(c == counts[0][0] for c in counts[0]), f"a step skipped collectives: {counts}"
    # The statistics are shared: both ranks hold the same running mean.
    torch.testing.assert_close(results[0]["running_mean"], results[1]["running_mean"])
    for result in results:
        assert all(torch.isfinite(torch.tensor(s["loss"])) for s in result["steps"])


def test_batch_size_check_reads_the_host_once_per_size_and_still_refuses_unequal_K(multigpu_results):
    for rank, result in enumerate(multigpu_results):
        first, *later = result["reads_per_call"]
        assert any("_distributed.py" in r for r in first), f"rank {rank}: no read of the sizes at the first call"
        assert later == [[], []], f"rank {rank}: host reads after the first call with this K: {later}"
        # Rank 0 had seen K = 4 (device-side assertion), rank 1 had not seen K = 5 (host read).
        message = result["unequal_K"]
        assert message is not None and "same number of samples" in message, f"rank {rank}: {message}"
    assert multigpu_results[1]["unequal_K"].startswith("ValueError") and "[4, 5]" in multigpu_results[1]["unequal_K"]


# ---- optimiser step counters after --resume -------------------------------------------------
def test_resumed_objective_state_keeps_optimiser_step_counters_on_the_host():
    """IPMC's critic optimiser state, restored from a checkpoint for a run on an accelerator (the
    meta device stands in for it here): its moments go to the device, its step counters stay
    on the CPU, where torch.optim reads them without a synchronisation."""
    from mmviews.train.checkpoint import _to_device

    critic = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(critic.parameters())
    critic(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = {"bank.filled": torch.ones(3, dtype=torch.bool),
             "_extra_state": {"critic_optimizer": optimizer.state_dict()}}
    moved = _to_device(state, torch.device("meta"))
    assert moved["bank.filled"].device.type == "meta"
    for per_parameter in moved["_extra_state"]["critic_optimizer"]["state"].values():
        assert per_parameter["step"].device.type == "cpu" and per_parameter["step"].dim() == 0
        assert per_parameter["exp_avg"].device.type == "meta"


def test_host_read_recorder_counts_optimiser_step_reads_of_device_tensors():
    """torch.optim's reads of its step counters are left out only for counters in host memory."""
    from torch.optim.optimizer import _get_value

    from mmviews.bench.host_reads import HostReadRecorder

    with HostReadRecorder() as recorder:
        _get_value(torch.tensor(3.0))
    assert recorder.reads == []
    with HostReadRecorder() as recorder:
        try:
            _get_value(torch.tensor(3.0, device="meta"))  # a counter off the host (meta cannot be read)
        except (NotImplementedError, RuntimeError):
            pass
    assert [r.op for r in recorder.reads] == ["item"], recorder.reads


# ---- the EMA teacher: the student's autocast, foreach updates --------------------------------
def _teacher_encoder():
    from mmviews.modalities import MultiViewEncoder
    from mmviews.modalities.presets import tiny_config

    torch.manual_seed(0)
    return MultiViewEncoder.from_config({"embed_dim": 8, "modalities": {"seq": tiny_config("feature_sequence")}})


def test_ema_teacher_runs_under_the_student_autocast_and_returns_float32():
    from mmviews.train.teacher import EMATeacher

    batch = W.batch(0, 0)
    batch.views, batch.mask = batch.views[:1], batch.mask[:, :1]
    del batch.inputs["image"]
    teacher = EMATeacher(_teacher_encoder(), 0.9, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    dtypes = []
    teacher.module.adapters["seq"].head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    z, _ = teacher(batch)
    assert dtypes == [torch.bfloat16] and z.dtype == torch.float32
    dtypes.clear()
    plain = EMATeacher(_teacher_encoder(), 0.9)
    plain.module.adapters["seq"].head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    plain(batch)
    assert dtypes == [torch.float32]


def test_trainer_gives_the_teacher_the_accelerator_autocast(tmp_path):
    from test_train_sync import gaussian_config

    from mmviews.config import config_from_dict
    from mmviews.train.build import build_run
    from mmviews.train.setup import make_accelerator, prepare_run

    config = config_from_dict(gaussian_config({"name": "er", "params": {}}, ema_teacher=True))
    accelerator = make_accelerator(config, tmp_path, [])
    p = prepare_run(accelerator, build_run(config, 1, "test"))
    assert p.teacher is not None and p.teacher.autocast == accelerator.autocast


def test_ema_update_is_the_moving_average_of_every_parameter_and_copies_buffers():
    from mmviews.train.teacher import EMATeacher

    student = _teacher_encoder()
    teacher = EMATeacher(student, 0.75)
    before = [t.clone() for t in teacher.module.parameters()]
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p))
        for b in student.buffers():
            if b.is_floating_point():
                b.add_(1.0)
    teacher.update(student)
    for t, s, old in zip(teacher.module.parameters(), student.parameters(), before):
        torch.testing.assert_close(t, 0.75 * old + 0.25 * s)
    for t, s in zip(teacher.module.buffers(), student.buffers()):
        assert torch.equal(t, s)


# ---- resuming with another number of visible GPUs --------------------------------------------
def _write_rng_file(path, cuda_states):
    import random

    import numpy as np

    torch.save({"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                "torch_manual_seed": torch.get_rng_state(), "torch_cuda_manual_seed": cuda_states, "step": 0}, path)


def test_cuda_rng_states_saved_with_8_visible_devices_resume_with_1(tmp_path):
    from mmviews.train.checkpoint import _read_rng_states, cuda_rng_state_for_device

    saved = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]  # one per device, told apart
    path = tmp_path / "random_states_3.pkl"
    _write_rng_file(path, saved)
    states = _read_rng_states(path, None, on_cuda=True)
    cuda = states["torch_cuda_manual_seed"]
    # Process 3 of a run where each process saw 8 devices and used device 3; now it sees only its own.
    assert torch.equal(cuda_rng_state_for_device(cuda, 1, 0, 3), saved[3])
    assert torch.equal(cuda_rng_state_for_device(cuda, 8, 5, 5), saved[5])  # the same 8 devices visible
    assert cuda_rng_state_for_device(cuda, 0, 0, 3) is None  # no CUDA here: nothing to restore
    assert cuda_rng_state_for_device(cuda, 1, 0, 9) is None  # no state saved for this process
    one = [torch.full((16,), 7, dtype=torch.uint8)]  # saved with one device per process, now 8 visible
    assert torch.equal(cuda_rng_state_for_device(one, 8, 2, 2), one[0])


@pytest.mark.parametrize("bad", [
    "not a list", [], [torch.zeros(16, dtype=torch.uint8), torch.zeros(16)],
    [torch.zeros(16, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)],
])
def test_malformed_cuda_rng_states_name_the_file(tmp_path, bad):
    from mmviews.data.safe_pickle import CorruptFileError
    from mmviews.train.checkpoint import _read_rng_states

    path = tmp_path / "random_states_0.pkl"
    _write_rng_file(path, bad)
    with pytest.raises(CorruptFileError,
                       match=r"random_states_0\.pkl: not Accelerate's RNG states.*torch_cuda_manual_seed"):
        _read_rng_states(path, None, on_cuda=False)


# ---- process group timeout and determinism ---------------------------------------------------
def test_recipe_timeout_reaches_the_process_group(multigpu_dir):
    for rank in range(W.WORLD):
        result = torch.load(multigpu_dir / f"timeout{rank}.pt")
        assert result == {"num_processes": 2, "timeout_s": 77.0}, (rank, result)


def test_timeout_default_and_bad_values(tmp_path):
    from test_train_sync import gaussian_config

    from mmviews.config import ConfigError, config_from_dict
    from mmviews.train.distributed import process_group_kwargs
    from mmviews.train.setup import make_accelerator

    recipe = gaussian_config({"name": "mv_dhel", "params": {}})
    config = config_from_dict(recipe)
    assert config.distributed.timeout_s == 3600 and process_group_kwargs(config).timeout.total_seconds() == 3600
    handlers = make_accelerator(config, tmp_path, []).init_handler
    assert handlers is not None and handlers.timeout.total_seconds() == 3600
    with pytest.raises(ConfigError, match=r"distributed\.timeout_s must be > 0 seconds, got 0"):
        process_group_kwargs(config_from_dict({**recipe, "distributed": {"timeout_s": 0}}))
    with pytest.raises(ConfigError, match="timeout_s"):
        config_from_dict({**recipe, "distributed": {"timeout_s": "soon"}})


def test_deterministic_recipe_key_turns_on_deterministic_algorithms(monkeypatch):
    from test_train_sync import gaussian_config

    from mmviews.config import config_from_dict
    from mmviews.train.distributed import CUBLAS_WORKSPACE, configure_determinism

    recipe = gaussian_config({"name": "mv_dhel", "params": {}})
    assert config_from_dict(recipe).deterministic is False
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cudnn = torch.backends.cudnn
    before = torch.are_deterministic_algorithms_enabled(), cudnn.benchmark, cudnn.deterministic
    try:
        configure_determinism(False)
        assert torch.are_deterministic_algorithms_enabled() is before[0] and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        configure_determinism(config_from_dict({**recipe, "deterministic": True}).deterministic)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[1], before[2]


# ---- smaller device and autograd fixes -------------------------------------------------------
def test_hand_written_backward_passes_refuse_a_second_derivative():
    """Their backward passes are not themselves differentiable: a double backward must fail
    loudly instead of returning a wrong second derivative."""
    from mmviews.objectives._base import scores_logsumexp
    from mmviews.objectives._streaming import no_exclusion, streamed_logsumexp, streamed_reduce

    g = torch.Generator().manual_seed(0)
    anchors = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    candidates = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    losses = {
        "fused": scores_logsumexp(anchors, candidates, no_exclusion, (6, 6), (1,)),
        "streamed": streamed_logsumexp(anchors.view(1, 6, 1, 4), candidates.view(1, 6, 4), no_exclusion, (6,), (3,), 2),
        "reduce": streamed_reduce(anchors.view(1, 6, 1, 4), candidates.view(1, 6, 4),
                                  lambda s, a, b: torch.logsumexp(s, dim=3), (6,), 2),
    }
    for name, lse in losses.items():
        loss = lse.pow(2).sum()  # the gradient reaching the backward pass depends on the inputs
        (grad,) = torch.autograd.grad(loss, anchors, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            grad.sum().backward()


def test_mlp_adapter_moves_inputs_to_its_device():
    from mmviews.modalities import build_adapter

    adapter = build_adapter({"type": "mlp", "input_dim": 3, "embed_dim": 4}).eval().to("meta")  # a non-CPU device
    z = adapter({"values": torch.randn(5, 2, 3)})  # inputs in host memory
    assert z.device.type == "meta" and z.shape == (5, 4)


def test_reference_circle_loss_stays_on_the_scores_device():
    from mmviews.objectives.reference import unified_reference

    pos = [torch.tensor(0.7, dtype=torch.float64, device="meta")]
    neg = [torch.tensor(0.1, dtype=torch.float64, device="meta"), torch.tensor(0.2, dtype=torch.float64, device="meta")]
    assert unified_reference(pos, neg, gamma=4.0, delta=0.25).device.type == "meta"


def test_raft_flow_runs_where_the_frames_are(tmp_path):
    from torchvision.models.optical_flow import raft_small

    from mmviews.modalities.flow import compute_flow

    torch.manual_seed(0)
    weights = tmp_path / "raft_small.pth"
    torch.save(raft_small(weights=None, progress=False).state_dict(), weights)
    frames = torch.zeros(2, 3, 128, 128, device="meta")  # a device other than the weights' CPU
    flow = compute_flow(frames, method="raft", raft_weights=weights, raft_model="small", clip=None)
    assert flow.device.type == "meta" and flow.shape == (1, 2, 128, 128)


@pytest.mark.parametrize("kind", ["feature_sequence", "small_cnn", "audio_cnn", "flow_cnn", "text", "hf_audio",
                                  "open_clip"])
def test_every_adapter_can_join_the_collectives_with_no_present_view(kind, monkeypatch):
    """A rank with no present view of a modality runs, on zero rows, the parts that synchronise
    (SyncBatchNorm on several processes, simulated here: every BatchNorm counts): the backbone
    when it has BatchNorm (CNNs), else the head; the result is connected to the graph."""
    import mmviews.modalities.base as base
    from mmviews.modalities import build_adapter
    from mmviews.modalities.presets import example_inputs, tiny_config

    monkeypatch.setattr(base, "runs_collectives", lambda module: any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in module.modules()))
    config = {**tiny_config(kind), "vocab": "synthetic"} if kind == "text" else tiny_config(kind)
    adapter = build_adapter(config).train()
    seen: list[str] = []
    adapter.backbone.register_forward_hook(lambda *_: seen.append("backbone"))
    adapter.head.register_forward_hook(lambda *_: seen.append("head"))
    items = base.PresentItems((), 3)
    z = adapter.embed_present(example_inputs(kind, 3), items, check_inputs=False)
    assert z.shape == (3, adapter.config.embed_dim) and not bool(z.any())
    has_batchnorm = kind in ("small_cnn", "audio_cnn", "flow_cnn")
    assert seen == (["backbone", "head"] if has_batchnorm else ["head"]), seen
    z.sum().backward()  # the zero-row pass is in the graph: every head parameter gets a gradient
    assert all(p.grad is not None for p in adapter.head.parameters())


@pytest.mark.parametrize("kind", ["feature_sequence", "small_cnn", "audio_cnn", "flow_cnn", "text", "hf_audio",
                                  "open_clip"])
def test_a_sharded_adapter_with_no_present_view_runs_its_backbone_and_head(kind, monkeypatch):
    """Sharded (FSDP2) adapters gather their parameters in every forward, backbone and head: a
    rank with no present view of the modality runs both on zero rows (simulated here: every
    module counts as taking part in collectives), and the backward reaches every parameter, so
    that the gradients' reduce-scatter runs on this rank too."""
    import mmviews.modalities.base as base
    from mmviews.modalities import build_adapter
    from mmviews.modalities.presets import example_inputs, tiny_config

    monkeypatch.setattr(base, "runs_collectives", lambda module: True)
    config = {**tiny_config(kind), "vocab": "synthetic"} if kind == "text" else tiny_config(kind)
    adapter = build_adapter(config).train()
    seen: list[str] = []
    adapter.backbone.register_forward_hook(lambda *_: seen.append("backbone"))
    adapter.head.register_forward_hook(lambda *_: seen.append("head"))
    z = adapter.embed_present(example_inputs(kind, 3), base.PresentItems((), 3), check_inputs=False)
    assert z.shape == (3, adapter.config.embed_dim) and not bool(z.any())
    assert seen == ["backbone", "head"], seen
    z.sum().backward()
    trainable = [p for p in adapter.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for p in adapter.head.parameters())
