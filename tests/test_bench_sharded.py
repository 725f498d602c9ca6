"""``mmviews bench train --sharded``: the base-sizes case's recipe and the per-process byte counts
(the measurement itself starts real processes and takes minutes: run by hand, see
docs/distributed.md)."""

from __future__ import annotations

import torch

from mmviews.bench.sharded import format_sharded, held_bytes, local_bytes
from mmviews.bench.train_cases import base_sizes_config
from mmviews.modalities.presets import realistic_config


def test_base_sizes_case_has_the_full_size_backbones():
    config = base_sizes_config()
    kinds = {a["type"]: a for a in config.adapters.values()}
    assert kinds["text"]["bert_config"] == realistic_config("text")["bert_config"] == {}  # BERT-base defaults
    assert kinds["hf_audio"]["backbone_config"] == {"model_type": "hubert"}  # HuBERT-base defaults
    assert kinds["open_clip"]["model"] == "ViT-B-32" and "model_overrides" not in kinds["open_clip"]
    assert config.data.batch_size == 4 and config.optimisation.encode_chunk_size == 2
    assert any((v.get("params") or {}).get("size") == 224 for v in config.views)
    assert all("finetune" in a for a in config.adapters.values())  # the finetune recipe's LoRA / last_n kept


def test_held_bytes_counts_parameters_gradients_and_optimizer_state():
    model = torch.nn.Linear(10, 4)  # 44 float32 parameters
    optimizer = torch.optim.AdamW(model.parameters())
    assert held_bytes(model, optimizer) == {"parameters": 176, "gradients": 0, "optimizer_state": 0}
    model(torch.randn(3, 10)).sum().backward()
    optimizer.step()
    held = held_bytes(model, optimizer)
    assert held["gradients"] == 176 and held["optimizer_state"] >= 2 * 176  # exp_avg, exp_avg_sq (+ steps)
    assert local_bytes([None, torch.zeros(3, dtype=torch.bfloat16)]) == 6
    row = {"parameters": 2**20, "gradients": 2**20, "optimizer_state": 2**21, "step_s": 1.0}
    table = format_sharded([{"case": "c", "setups": [{"processes": 1, "sharding": "none", **row}],
                             "ratios": {"parameters_sharded_over_unsharded": 0.5}}])
    assert "1 process, sharding none" in table and "parameters 0.500" in table


def test_each_setup_is_estimated_for_its_process_count_and_sharding(monkeypatch):
    """The sharded bench asks --check's estimate for each setup's own process count and sharding
    (a fresh process: the hidden --estimate-processes and a --set of the sharding), on the
    workers' thread count, and prints estimate / peak beside the measured peak."""
    import mmviews.bench.train as bench_train
    from mmviews.bench import sharded, train_report

    asked = []

    def fake_estimate(case, argv):
        asked.append((case, argv))
        return type("E", (), {"step": 300 * 2**20})()

    monkeypatch.setattr(bench_train, "estimate_in_subprocess", fake_estimate)
    monkeypatch.setattr(train_report, "estimate_parts_mb", lambda estimate: {"step": estimate.step / 2**20})
    monkeypatch.setattr(sharded, "measure_setup", lambda argv, n, sharding: {
        "processes": n, "sharding": sharding, "parameters": 2**20 // n, "gradients": 2**20, "optimizer_state": 2**21,
        "step_s": 1.0, "peak_memory_mb": 250.0 if sharding == "fsdp" else 400.0})
    result = sharded.run_sharded("finetune-small", ["--device", "cpu"])
    assert [argv[argv.index("--estimate-processes") + 1] for _, argv in asked] == ["1", "2", "2"]
    assert [argv[argv.index("--set") + 1] for _, argv in asked] == [
        "distributed.sharding=none", "distributed.sharding=none", "distributed.sharding=fsdp"]
    assert all(argv[argv.index("--threads") + 1] == "1" for _, argv in asked)  # the workers' default
    assert [row["estimate_over_peak"] for row in result["setups"]] == [0.75, 0.75, 1.2]
    table = format_sharded([result])
    assert "est/peak" in table and "    1.20" in table.splitlines()[3]
    # base-sizes has no estimate (too slow to measure on full-size backbones): no column
    asked.clear()
    assert "est/peak" not in format_sharded([sharded.run_sharded("base-sizes", [])]) and not asked
