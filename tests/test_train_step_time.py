"""The plain step against sentence-transformers (``mmviews bench train
--against-sentence-transformers``, :mod:`mmviews.bench.text_step`): the two sides run the same
work (threads, attention kernel, dropout, weight decay read from the live objects), the sides'
processes take turns, and what each step costs besides its wall time (CPU time, page faults) is
counted. Timings themselves are the bench's job, not a test's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmviews.bench import text_step
from test_train_utils import own_accelerate_state

# Work that decides a step's time besides K and the tokens: both sides must agree on it.
SHARED_SETUP = ("threads", "attention", "training", "dropout", "weight_decay")


@pytest.fixture(scope="module")
def tiny_text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 32-wide random BERT with a word-list tokenizer, in a folder as
    all-MiniLM-L6-v2's (config, weights, tokenizer), which both sides load."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from mmviews.modalities.text import build_word_vocab

    folder = tmp_path_factory.mktemp("tiny-bert")
    vocab = build_word_vocab(list(text_step.TINY_WORDS))
    BertTokenizerFast(vocab=vocab, do_lower_case=True).save_pretrained(folder)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    return folder


def sentence_transformers_row(model: Path) -> dict:
    with own_accelerate_state():  # one torch thread, as the mmviews side's
        return text_step.sentence_transformers_row(model, K=4, tokens=8, steps=2, warmup=1, ops=True)


@pytest.fixture(scope="module")
def mmviews_row(tiny_text_model: Path) -> dict:
    with own_accelerate_state():
        return text_step.mmviews_row(tiny_text_model, K=4, tokens=8, steps=2, warmup=1, ops=True)


def check_same_setup(ours: dict, theirs: dict) -> None:
    """Same thread count inside each side, sdpa attention, training mode with the checkpoint's
    dropout, no weight decay on either side (the mmviews recipe has none), each side's own
    measurements present (the mmviews side with its phases)."""
    assert {key: ours[key] for key in SHARED_SETUP} == {key: theirs[key] for key in SHARED_SETUP}
    assert ours["attention"] == "sdpa" and ours["training"] is True and ours["dropout"] == [0.1, 0.1]
    assert ours["weight_decay"] == [0.0] and ours["threads"] == 1
    for row in (ours, theirs):
        assert len(row["steps_s"]) == len(row["steps_cpu_s"]) == 2 and row["cpu_s"] > 0 and row["peak_rss_mb"] > 0
    assert set(ours["phase_s"]) == {"data", "flow", "forward", "objective", "backward", "optimiser"}


def test_both_sides_train_with_the_same_setup(tiny_text_model: Path, mmviews_row: dict) -> None:
    """The same setup, and the same matrix work (GFLOP within 5 %: mmviews adds its linear head
    and MV-DHEL's score products), in fewer operator calls: mmviews runs both views of every sample
    through one backbone call, sentence-transformers the anchors and the positives in two."""
    pytest.importorskip("sentence_transformers")
    theirs = sentence_transformers_row(tiny_text_model)
    check_same_setup(mmviews_row, theirs)
    ours_ops, their_ops = mmviews_row["ops"], theirs["ops"]
    assert their_ops["gflop"] > 0 and ours_ops["gflop"] == pytest.approx(their_ops["gflop"], rel=0.05)
    assert ours_ops["calls_by_op"]["aten::addmm"] < their_ops["calls_by_op"]["aten::addmm"]
    assert ours_ops["aten_calls"] < their_ops["aten_calls"]


def test_same_setup_check_fails_when_sentence_transformers_keeps_its_weight_decay(
        tiny_text_model: Path, mmviews_row: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The break: sentence-transformers' AdamW with torch's default weight decay (0.01: the bench's
    old setup, one more pass over every weight per step on that side only)."""
    pytest.importorskip("sentence_transformers")
    default_adamw = torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr, weight_decay: default_adamw(params, lr=lr))
    broken = sentence_transformers_row(tiny_text_model)
    assert broken["weight_decay"] == [0.01]
    with pytest.raises(AssertionError):
        check_same_setup(mmviews_row, broken)


def test_sides_take_turns_round_after_round() -> None:
    """A B, B A, A B: neither side always runs first, so a drifting machine load weighs on both."""
    mm, st = text_step.SIDES
    assert text_step.round_order(1) == [mm, st]
    assert text_step.round_order(3) == [mm, st, st, mm, mm, st]


def test_rounds_merge_into_medians_of_round_medians() -> None:
    rows = [{"side": "mmviews", "step_s": s, "cpu_s": c, "system_s": 0.1, "page_faults": f, "steps_s": [s],
             "steps_cpu_s": [c], "peak_rss_mb": m, "phase_s": {"forward": s / 2}}
            for s, c, f, m in ((3.0, 2.0, 10, 100.0), (1.0, 4.0, 30, 300.0), (2.0, 3.0, 20, 200.0))]
    merged = text_step.merge_rounds(rows)
    assert (merged["step_s"], merged["cpu_s"], merged["page_faults"]) == (2.0, 3.0, 20)
    assert merged["peak_rss_mb"] == 300.0 and merged["phase_s"] == {"forward": 1.0}
    assert merged["steps_s"] == [3.0, 1.0, 2.0] and merged["rounds_cpu_s"] == [2.0, 4.0, 3.0]


def test_timed_steps_count_the_page_faults_of_fresh_memory() -> None:
    """A step that touches 64 MiB of new memory (above glibc's largest mmap threshold, so
    mapped afresh each time) faults at least once per 4 KiB page; a step that rewrites memory
    it already holds faults (almost) never."""
    held = torch.empty(2**24)  # 64 MiB of float32
    held.fill_(1.0)
    fresh = text_step.timed_steps(lambda: torch.ones(2**24).sum(), steps=2, warmup=1)
    reused = text_step.timed_steps(lambda: held.fill_(2.0).sum(), steps=2, warmup=1)
    pages = 2**26 // 4096
    assert min(fresh["page_faults"]) >= 0.9 * pages, fresh["page_faults"]
    assert max(reused["page_faults"]) < 0.05 * pages, reused["page_faults"]
    assert all(cpu >= system >= 0 for cpu, system in zip(fresh["cpu"], fresh["system"]))


def test_table_gives_wall_and_cpu_ratios_and_the_op_counts() -> None:
    row = {"K": 8, "step_s": 2.0, "cpu_s": 3.0, "system_s": 0.5, "page_faults": 1000, "peak_rss_mb": 100.0}
    rows = [{**row, "side": "mmviews", "host_memory": "heap",
             "ops": {"aten_calls": 70, "gflop": 2.5, "calls_by_op": {"aten::mm": 7}}},
            {**row, "side": "sentence-transformers", "step_s": 4.0, "cpu_s": 2.0, "ops": None}]
    result = {"model": "/m/all-MiniLM-L6-v2", "tokens": 32, "threads": 2, "steps": 3, "rounds": 2, "rows": rows,
              "ratios": [{"K": 8, "step_time_ratio": 0.5, "cpu_time_ratio": 1.5, "peak_rss_ratio": 1.0}]}
    table = text_step.format_text_steps(result)
    assert "2 round(s) in turn" in table and "mmviews K = 8: 70 aten calls, 2.5 GFLOP per step" in table
    assert "step time 0.50x (CPU time 1.50x), peak RSS 1.00x" in table
    assert [line.split()[:6] for line in table.splitlines()[2:4]] == [
        ["mmviews", "8", "2.00", "3.00", "0.50", "1000"], ["sentence-transformers", "8", "4.00", "2.00", "0.50", "1000"]]
    # what each side's allocator did (a row without the key: a process mmviews left alone)
    assert [line.split()[-1] for line in table.splitlines()[2:4]] == ["heap", "system"]
    assert table.splitlines()[0].endswith("--host-memory auto")
