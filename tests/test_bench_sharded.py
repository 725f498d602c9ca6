"""``mmviews bench train --sharded``: the base-sizes case's recipe and the per-process byte counts
(the measurement itself starts real processes and takes minutes: run by hand, see
docs/distributed.md)."""

from __future__ import annotations

import torch

from mmviews.bench.sharded import format_sharded, held_bytes, local_bytes
from mmviews.bench.train import base_sizes_config
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
