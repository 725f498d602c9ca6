"""What :func:`mmviews.train.build.build_run` makes of a recipe, and its objective
(:func:`~mmviews.train.build.build_objective`): the parts of a run (split, view set, collator,
sampler, loaders, seeds; a streamed split's loader), and every refusal with the key it names
(``objective.name``, ``objective.params``, ``objective.ema_teacher``, ``data.batch_size``, ``views``,
``adapters``, ``data.options.on_error``, ``optimisation.grad_accum_steps``) and the run's source.
The recipes are tiny (4 views of a 1-D latent, a 12-row Parquet folder, an empty video folder);
nothing trains."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from mmviews.config import ConfigError, config_from_dict
from mmviews.train.build import build_objective
from test_train_sync import gaussian_config


def _config(name: str, params: dict[str, Any] | None = None, **objective: Any) -> Any:
    raw = gaussian_config({"name": name, "params": dict(params or {})})
    raw["objective"].update(objective)
    return config_from_dict(raw)


def _refusal(config: Any, num_views: int, *args: Any, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        build_objective(config, num_views, *args, **kwargs)
    return caught.value


def test_an_objective_parameter_the_objective_refuses_names_objective_params() -> None:
    error = _refusal(_config("mv_dhel", {"temp": 0.2}), 4)
    assert isinstance(error.__cause__, (TypeError, ValueError))
    assert str(error) == f"recipe: key 'objective.params': {error.__cause__}"  # the recipe by default
    assert "'temp'" in str(error.__cause__)
    error = _refusal(_config("mv_dhel", {"temperature": -1.0}), 4, "runs/x/config.yaml")
    assert str(error) == f"runs/x/config.yaml: key 'objective.params': {error.__cause__}"


def test_an_unknown_objective_names_objective_name() -> None:
    """A name no objective has (the recipe's own check runs first; a config changed after loading
    reaches build_objective): ``objective.name``, even when a dataset size is given."""
    config = _config("mv_dhel")
    config = dataclasses.replace(config, objective=dataclasses.replace(config.objective, name="nope"))
    for dataset_size in (None, 100):
        error = _refusal(config, 4, dataset_size=dataset_size)
        assert isinstance(error.__cause__, ValueError) and "unknown objective 'nope'" in str(error.__cause__)
        assert str(error) == f"recipe: key 'objective.name': {error.__cause__}"


def test_a_view_count_the_objective_does_not_take_names_objective_name_and_m() -> None:
    error = _refusal(_config("simclr"), 3)
    assert isinstance(error.__cause__, ValueError) and "M = 3" in str(error.__cause__)
    assert str(error) == f"recipe: key 'objective.name': {error.__cause__}; the recipe's views give M = 3"
    assert build_objective(_config("simclr"), 2).name == "simclr"


def test_a_teacher_for_an_objective_without_one_names_objective_ema_teacher() -> None:
    error = _refusal(_config("mv_dhel", ema_teacher=True), 4, "r.yaml")
    assert str(error) == ("r.yaml: key 'objective.ema_teacher': objective 'mv_dhel' takes no teacher embeddings "
                          "(its loss has no 'teacher' argument)")
    objective = build_objective(_config("er", ema_teacher=True), 4)  # ER's loss takes the teacher's
    assert objective.takes_teacher and objective.name == "er"


def test_the_dataset_size_fills_only_an_objective_that_takes_one_and_only_when_the_recipe_leaves_it_out() -> None:
    """IPMC's view filter keeps a row per dataset sample: build_run gives the training split's
    size; a recipe's own value wins; objectives without such a parameter never get it."""
    ipmc = {"view_filter_k": 1}
    assert build_objective(_config("ipmc", ipmc), 4, dataset_size=100).dataset_size == 100
    assert build_objective(_config("ipmc", {**ipmc, "dataset_size": 50}), 4, dataset_size=100).dataset_size == 50
    # without a size from the run, the recipe's (or the constructor's refusal) decides
    assert build_objective(_config("ipmc", {**ipmc, "dataset_size": 50}), 4).dataset_size == 50
    with pytest.raises(ConfigError, match=r"^recipe: key 'objective.params': .*needs dataset_size"):
        build_objective(_config("ipmc", ipmc), 4)
    assert build_objective(_config("mv_dhel"), 4, dataset_size=100).name == "mv_dhel"  # takes none: not passed


def _recipe(seed: int = 7, num_samples: int = 60, batch_size: int = 16, **data: Any) -> dict[str, Any]:
    """gaussian_config's tiny run (4 views of a 1-D latent), a seed other than the default 0 and a
    split that is no multiple of K (drop_last shows), a validation split."""
    raw = gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}}, num_samples=num_samples,
                          batch_size=batch_size)
    raw["seed"] = seed
    raw["data"].update({"val_split": "valid", **data})
    raw["data"]["split_options"]["valid"] = {"num_samples": 16}
    return raw


def _build_refusal(raw: dict[str, Any], num_processes: int = 1) -> ConfigError:
    from mmviews.train.build import build_run

    with pytest.raises(ConfigError) as caught:
        build_run(config_from_dict(raw), num_processes, "r.yaml")
    return caught.value


def test_build_run_gives_the_parts_the_recipe_asks_for() -> None:
    """The training split, its view set and collator (seeded by the recipe), K-sample batches
    drawn shuffled with the short last one dropped, the loader's own generator seeded by the
    recipe, and the evaluation loaders (none when not asked)."""
    from mmviews.data.loaders import EpochCollator, GlobalBatchSampler
    from mmviews.train.build import build_run

    config = config_from_dict(_recipe())
    parts = build_run(config)
    train = parts.datasets["train"]
    assert list(parts.datasets) == ["train"] and len(train) == 60 and parts.view_spec is config.view_spec
    assert isinstance(parts.collator, EpochCollator) and parts.collator.collator.seed == 7
    assert parts.collator.collator.modality_info == train.modality_info() == {"x": {"kind": "sequence", "shape": (1, 1)}}
    assert parts.train_loader.collate_fn is parts.collator and parts.train_loader.dataset is train
    assert isinstance(parts.sampler, GlobalBatchSampler) and parts.train_loader.batch_sampler is parts.sampler
    inner = parts.sampler.inner
    assert (inner.num_samples, inner.K, inner.shuffle, inner.drop_last, inner.seed) == (60, 16, True, True, 7)
    assert len(parts.train_loader) == 3  # 60 // 16
    assert parts.loader_generator.initial_seed() == 7 and parts.train_loader.generator is parts.loader_generator
    assert parts.train_loader.pin_memory is False  # cpu: true
    assert sorted(parts.eval_loaders) == ["test", "train", "val"] and parts.eval_loaders["test"] is None
    assert parts.eval_loaders["train"].dataset is train and len(parts.eval_loaders["val"].dataset) == 16
    assert build_run(config, with_eval=False).eval_loaders == {}
    batch = next(iter(parts.train_loader))
    assert batch.num_samples == 16 and batch.num_views == 4


def test_build_run_draws_the_same_weights_and_batches_for_the_same_seed() -> None:
    from mmviews.train.build import build_run

    first, second = build_run(config_from_dict(_recipe())), build_run(config_from_dict(_recipe()))
    for (name, a), b in zip(first.encoder.state_dict().items(), second.encoder.state_dict().values()):
        assert torch.equal(a, b), name
    assert [list(b) for b in first.sampler] == [list(b) for b in second.sampler]
    other = build_run(config_from_dict(_recipe(seed=8)))
    assert any(not torch.equal(a, b) for a, b in zip(first.encoder.state_dict().values(),
                                                      other.encoder.state_dict().values()))


def test_a_fixed_batch_mode_holds_k_times_m_and_k_must_be_at_least_two() -> None:
    """batch_mode fixed: K = batch_size * reference_views // M (here M = 4 views); K = 2 is enough,
    K = 1 is refused naming the key, K, M and the mode."""
    from mmviews.train.build import build_run

    parts = build_run(config_from_dict(_recipe(batch_size=8, batch_mode="fixed", reference_views=2)))
    assert parts.sampler.batch_size == 4 and parts.sampler.inner.K == 4 and len(parts.train_loader) == 15
    parts = build_run(config_from_dict(_recipe(batch_size=4, batch_mode="fixed", reference_views=2)))
    assert parts.sampler.batch_size == 2
    parts = build_run(config_from_dict(_recipe(batch_size=4, batch_mode="fixed", reference_views=4)))
    assert parts.sampler.batch_size == parts.sampler.inner.K == 4  # the recipe's reference, not the default 2
    parts = build_run(config_from_dict(_recipe(batch_size=2, batch_mode="fixed", reference_views=4)))
    assert parts.sampler.batch_size == 2  # K = 2 * 4 // 4 passes the K >= 2 check (with a reference of 2, K = 1)
    error = _build_refusal(_recipe(batch_size=2, batch_mode="fixed", reference_views=2))
    assert str(error) == ("r.yaml: key 'data.batch_size': the batch has K = 1 samples with M = 4 views "
                          "(batch_mode 'fixed'); K must be >= 2")


def test_k_must_split_evenly_between_the_processes() -> None:
    from mmviews.train.build import build_run

    assert build_run(config_from_dict(_recipe(batch_size=15))).sampler.batch_size == 15  # one process by default
    error = _build_refusal(_recipe(), 3)
    assert str(error) == "r.yaml: key 'data.batch_size': K = 16 samples per batch cannot be split evenly between 3 processes"


def test_a_split_smaller_than_one_batch_is_refused() -> None:
    from mmviews.train.build import build_run

    assert len(build_run(config_from_dict(_recipe(num_samples=16))).train_loader) == 1  # exactly one batch
    error = _build_refusal(_recipe(num_samples=12))
    assert str(error) == "r.yaml: key 'data.batch_size': the 'train' split has 12 samples, fewer than one batch of K = 16"


def test_a_view_without_an_adapter_names_the_view_or_the_adapters() -> None:
    """A misspelt modality is the view's fault (with the close adapter name); an unknown one is
    the adapters' (add one, or fix the view); the view's index is the first view that names it."""
    raw = _recipe()
    raw["views"] = [{"modality": "x", "copies": 2, "augment": "seq_noise", "params": {"std": 0.03}},
                    {"modality": "xx", "augment": "seq_noise", "params": {"std": 0.03}}]
    assert str(_build_refusal(raw)) == ("r.yaml: key 'views.1.modality': 'xx' has no adapter (did you mean 'x'?); "
                                        "adapters given: ['x']")
    raw_names = _recipe()
    raw_names["views"] = ["x", "xx"]  # views given by modality name alone
    assert str(_build_refusal(raw_names)) == ("r.yaml: key 'views.1.modality': 'xx' has no adapter (did you mean "
                                              "'x'?); adapters given: ['x']")
    raw["views"][1]["modality"] = "audio"
    raw["views"].append({"modality": "audio"})
    assert str(_build_refusal(raw)) == ("r.yaml: key 'adapters': no adapter for modality 'audio' of 'views.1.modality' "
                                        "(adapters given: ['x']); add 'adapters.audio' or fix the view's modality")


def test_the_views_objective_and_encoder_refusals_name_the_runs_source() -> None:
    raw = _recipe()
    raw["views"][0]["augment"] = "image_crop"
    error = _build_refusal(raw)
    assert isinstance(error.__cause__, (ValueError, KeyError))
    assert str(error) == f"r.yaml: key 'views': {error.__cause__}" and "'image_crop'" in str(error)
    raw = _recipe()
    raw["objective"]["params"] = {"temp": 0.2}
    assert str(_build_refusal(raw)).startswith("r.yaml: key 'objective.params': objective 'mv_infonce': unknown parameter")
    raw = _recipe()
    raw["objective"] = {"name": "ipmc", "params": {"view_filter_k": 1}}
    from mmviews.train.build import build_run

    assert build_run(config_from_dict(raw), with_eval=False).objective.dataset_size == 60  # the split's size
    raw = _recipe()  # the encoder's own check, after the data's
    raw["adapters"]["y"] = {"type": "mlp", "input_dim": 1, "hidden_dim": 16, "head": {"kind": "linear"}, "embed_dim": 4}
    raw["views"].append({"modality": "y"})
    assert str(_build_refusal(raw)) == "r.yaml: keys 'adapters'/'encoder': all adapters must share embed_dim; got {'x': 8, 'y': 4}"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Parquet shard folder (``mmviews prepare hf --format parquet``) of 12 training rows, each a
    [3, 2] sequence, in three shard files of 5, 5 and 2 rows."""
    import datasets
    from test_data_shards import prepare

    root = tmp_path_factory.mktemp("build_streamed")
    rows = datasets.Dataset.from_dict({"seq": [[[float(i), 1.0]] * 3 for i in range(12)]})
    datasets.DatasetDict({"train": rows}).save_to_disk(str(root / "disk"))
    done = prepare("hf", str(root / "disk"), "--format", "parquet", "--columns", "seq=seq", "--shard-rows", "5",
                   "--output", str(root / "shards"))
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "shards"


def _streamed(shards: Path, batch_size: int = 4, num_workers: int = 0, cpu: bool = True, **optimisation: Any) -> Any:
    raw = _recipe(batch_size=batch_size)
    raw["cpu"] = cpu
    raw["data"] = {"name": "hf", "root": str(shards), "options": {"columns": {"rows": "seq"}}, "streaming": True,
                   "batch_size": batch_size, "val_split": None, "test_split": None, "shuffle_buffer": 5,
                   "num_workers": num_workers}
    raw["views"] = [{"modality": "rows", "copies": 2}]
    raw["adapters"] = {"rows": {"type": "feature_sequence", "input_dim": 2}}
    raw["optimisation"].update(optimisation)
    return config_from_dict(raw)


def test_a_streamed_split_is_read_by_a_stream_loader_of_this_processs_rows(shards: Path) -> None:
    """Each process draws K / N rows a batch from the shards, shuffled by the recipe's seed and
    buffer; the loader is also the sampler (it takes set_epoch)."""
    from mmviews.data.streaming import StreamLoader
    from mmviews.train.build import build_run

    parts = build_run(_streamed(shards))
    loader = parts.train_loader
    assert isinstance(loader, StreamLoader) and parts.sampler is loader and loader.collate_fn is parts.collator
    assert (loader.batch_size, loader.seed, loader.shuffle_buffer, loader.rank, loader.world) == (4, 7, 5, 0, 1)
    assert loader.num_workers == 0 and loader.pin_memory is False and len(loader) == 3  # 12 rows / 4
    assert loader.dataset is parts.datasets["train"]
    assert build_run(_streamed(shards, num_workers=1)).train_loader.num_workers == 1  # the recipe's (none started)
    two = build_run(_streamed(shards), 2).train_loader  # this process is rank 0 of 2
    assert (two.batch_size, two.rank, two.world) == (2, 0, 2) and len(two) == 3  # 6 rows a process / 2
    batch = next(iter(loader))
    assert batch.num_samples == 4 and batch.num_views == 2


def test_a_streamed_epoch_must_hold_whole_accumulation_windows(shards: Path) -> None:
    """Accelerate closes a window at a prepared loader's end, a streamed loader is not prepared:
    3 batches an epoch take grad_accum_steps 3 (or 1), not 2."""
    from mmviews.train.build import build_run

    assert len(build_run(_streamed(shards, grad_accum_steps=3)).train_loader) == 3
    with pytest.raises(ConfigError) as caught:
        build_run(_streamed(shards, grad_accum_steps=2), 1, "r.yaml")
    assert str(caught.value) == ("r.yaml: key 'optimisation.grad_accum_steps': a streamed epoch has 3 batches, not a "
                                 "multiple of grad_accum_steps = 2; choose a divisor, or data.batch_size so that it "
                                 "divides the epoch")


def test_a_process_whose_shards_hold_fewer_rows_than_its_batch_is_refused(shards: Path) -> None:
    """Three shard files between three processes: the one given the file of 2 rows cannot fill its
    4 of K = 12 (two processes share the 12 rows, 6 each)."""
    from mmviews.train.build import build_run

    assert len(build_run(_streamed(shards, batch_size=12), 2).train_loader) == 1
    with pytest.raises(ConfigError) as caught:
        build_run(_streamed(shards, batch_size=12), 3, "r.yaml")
    assert isinstance(caught.value.__cause__, ValueError) and "fewest" in str(caught.value.__cause__)
    assert str(caught.value) == f"key 'data.batch_size': {caught.value.__cause__}"


def test_skipping_unreadable_clips_is_refused_on_several_processes(tmp_path: Path) -> None:
    """A dropped sample would leave one process a smaller share of its batch than the others:
    ``on_error: skip`` of a video folder is refused on two processes, naming the option, and not
    on one (nor ``raise`` on two), where the next check speaks (the folder holds one clip)."""
    from test_data_video import frames_folder

    root, frames = frames_folder(tmp_path, 3)

    def recipe(on_error: str) -> dict[str, Any]:
        raw = _recipe()
        raw["data"] = {"name": "hmdb51", "root": str(root), "batch_size": 2, "val_split": None, "test_split": None,
                       "options": {"on_error": on_error, "audio": False, "frames_root": str(frames)}}
        raw["views"] = [{"modality": "video", "copies": 2}]
        raw["adapters"] = {"video": {"type": "torchvision_video", "model": "mc3_18", "image_size": 16}}
        return raw

    assert str(_build_refusal(recipe("skip"), 2)) == (
        "r.yaml: key 'data.options.on_error': 'skip' drops unreadable samples from their batch, which would leave "
        "the 2 processes with unequal shares of it; train with data.options.on_error: raise on several processes "
        "(clips the store lists as unreadable are still left out), or on one process")
    split = "r.yaml: key 'data.batch_size': the 'train' split has 1 samples, fewer than one batch of K = 2"
    assert str(_build_refusal(recipe("skip"), 1)) == split
    assert str(_build_refusal(recipe("raise"), 2)) == split


def test_batches_are_pinned_only_where_the_run_trains_on_cuda(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned host memory lets the copy to a CUDA device overlap the step; a ``cpu: true`` run on
    a machine with CUDA (said so here: this one has none; no loader is iterated) pins nothing."""
    from mmviews.train.build import build_run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cpu in (True, False):
        raw = _recipe()
        raw["cpu"] = cpu
        assert build_run(config_from_dict(raw), with_eval=False).train_loader.pin_memory is not cpu
        assert build_run(_streamed(shards, cpu=cpu)).train_loader.pin_memory is not cpu
