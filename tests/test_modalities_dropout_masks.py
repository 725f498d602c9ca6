"""Sample-keyed dropout's masks, compared directly (``optimisation.sample_keyed_dropout``,
:mod:`mmviews.modalities.dropout`, through its public names).

The masks are read exactly: a forward hook on every keyed dropout layer applies the layer once
more, under the same keys, to a tensor of ones (kept elements come out as ``1 / (1 - p)``,
dropped ones as 0), and each row of the mask is filed under (layer, sample, view slot) from the
rows the encoder's adapters encode: the present items of a modality, sample-major. With every
rate at 0.5, two independent masks agree on half of their elements and a mask shared where it
should not be agrees on all of them; a mask that should be the same is compared bit for bit.

Properties: masks differ between samples, between the views of one modality, between layers,
between micro-batches and between an EMA teacher and its student; they are the same for the
same key when the batch is chunked, reordered, padded to another length (text is padded to the
longest text of each call; the feature sequences are cut to the longest of each chunk) and in
another process (another ``PYTHONHASHSEED``). Each guard has a mutation test below
(``tests/mutations.py``, ``tests/README.md``).

``python test_modalities_dropout_masks.py INTACT NAME BROKEN`` is the other process: it writes the
masks of a chunked batch to INTACT, then with the break NAME applied to BROKEN (safetensors)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from mutations import apply_break
from torch import nn

from mmviews.data.batch import ViewBatch, ViewInfo
from mmviews.modalities import MultiViewEncoder
from mmviews.modalities.dropout import SampleKeyedDropout, dropout_step, enable_sample_keyed_dropout
from mmviews.modalities.presets import tiny_config
from mmviews.train.teacher import EMATeacher

SEED, MICRO_BATCH = 1234, 5
RATE = 0.5
IDS = [10, 3, 25, 4, 17, 8]
MISSING_SEQUENCE = 3  # the sample whose sequence view is absent
WORDS = "the a cat dog sat ran on under mat tree red blue car book".split()
INDEPENDENT = 0.75  # agreement above this is a shared mask (independent: 0.5, shared: 1.0)

Masks = dict[tuple[str, int, int], torch.Tensor]  # (layer, sample id, view slot) -> keep mask of the row


def keyed_encoder(modalities: tuple[str, ...] = ("text", "seq")) -> MultiViewEncoder:
    """Tiny BERT text views (two per sample) and a feature-sequence view (one, absent for
    MISSING_SEQUENCE), every dropout at RATE and keyed, in training mode."""
    torch.manual_seed(0)
    head = {"kind": "mlp", "hidden_dim": 24, "batch_norm": False, "dropout": RATE}
    configs = {"seq": {**tiny_config("feature_sequence"), "dropout": RATE, "head": head}}
    if "text" in modalities:
        text = configs["text"] = tiny_config("text", head=head)
        text["bert_config"] = {**text["bert_config"], "hidden_dropout_prob": RATE,
                               "attention_probs_dropout_prob": RATE}
    encoder = MultiViewEncoder.from_config({"embed_dim": 16, "modalities": {m: configs[m] for m in modalities}})
    enable_sample_keyed_dropout(encoder)
    return encoder.train()


def batch_of(ids: list[int], trim_padding: bool = False, modalities: tuple[str, ...] = ("text", "seq")) -> ViewBatch:
    """The samples ``ids`` as a collator makes them (each sample's content depends on its id only).
    Sequences are padded to 7 steps, or with ``trim_padding`` to the longest of these samples."""
    texts, sequences, lengths = [], [], []
    for i in ids:
        g = torch.Generator().manual_seed(i)
        for view in range(2):
            n = 2 + (i * 3 + view) % 6
            texts.append(" ".join(WORDS[int(w)] for w in torch.randint(len(WORDS), (n,), generator=g)))
        sequences.append(torch.randn(7, 6, generator=g))
        lengths.append(0 if i == MISSING_SEQUENCE else 2 + i % 5)
    present = torch.tensor([i != MISSING_SEQUENCE for i in ids])
    mask = torch.ones(len(ids), 3, dtype=torch.bool)  # views: text_0, seq_0, text_1
    mask[:, 1] = present
    values = torch.stack(sequences) * present[:, None, None]
    if trim_padding:
        values = values[:, :max(lengths)]
    views = [ViewInfo("text_0", "text", 0), ViewInfo("seq_0", "seq", 0),
             ViewInfo("text_1", "text", 1, natural=False, augmentation="x")]
    inputs = {"text": {"text": texts}, "seq": {"values": values, "lengths": torch.tensor(lengths)}}
    kept = [k for k, view in enumerate(views) if view.modality in modalities]
    return ViewBatch(inputs={m: inputs[m] for m in modalities}, views=[views[k] for k in kept], mask=mask[:, kept],
                     index=torch.tensor(ids))


def rows_of(ids: list[int]) -> dict[str, list[tuple[int, int]]]:
    """(sample id, view slot) of each row an adapter encodes: its present items, sample-major."""
    return {"text": [(i, slot) for i in ids for slot in (0, 1)],
            "seq": [(i, 0) for i in ids if i != MISSING_SEQUENCE]}


def keep_masks(model: nn.Module, batch: ViewBatch, micro_batch: int = MICRO_BATCH,
               call: Callable[[ViewBatch], Any] | None = None) -> Masks:
    """The keep masks of every keyed dropout layer of ``model`` (an encoder) for each row of
    ``batch``, when ``call`` (default: ``model``) encodes it in micro-batch ``micro_batch``."""
    calls: list[tuple[str, torch.Tensor]] = []

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            calls.append((name, module.forward(torch.ones_like(inputs[0])) != 0))  # forward: no hooks again
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()
               if isinstance(m, SampleKeyedDropout)]
    try:
        with dropout_step(SEED, micro_batch), torch.no_grad():
            (call or model)(batch)
    finally:
        for handle in handles:
            handle.remove()
    rows = rows_of(batch.index.tolist())
    masks: Masks = {}
    for name, mask in calls:
        modality = name.split(".")[1]  # adapters.<modality>.…
        assert mask.shape[0] == len(rows[modality]), f"{name}: {tuple(mask.shape)} for rows {rows[modality]}"
        for (sample, slot), row in zip(rows[modality], mask):
            assert (name, sample, slot) not in masks, f"{name} ran twice"
            masks[name, sample, slot] = row
    assert masks, "no keyed dropout layer ran"
    return masks


def _common(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both masks cut to the positions both have (a row padded to another length)."""
    assert a.dim() == b.dim(), (a.shape, b.shape)
    index = tuple(slice(0, min(x, y)) for x, y in zip(a.shape, b.shape))
    return a[index], b[index]


def assert_same_masks(reference: Masks, other: Masks, what: str) -> None:
    assert reference.keys() == other.keys(), f"{what}: other rows or layers"
    for key, mask in reference.items():
        a, b = _common(mask, other[key])
        assert torch.equal(a, b), f"{what}: the mask of {key} differs ({(a != b).sum().item()} of {a.numel()})"


def assert_independent(pairs: list[tuple[torch.Tensor, torch.Tensor]], what: str) -> None:
    """The masks of each pair agree about as often as independent masks do (half of the elements)."""
    assert pairs, f"{what}: nothing to compare"
    same = total = 0
    for a, b in pairs:
        a, b = _common(a, b)
        same += (a == b).sum().item()
        total += a.numel()
    assert same / total < INDEPENDENT, f"{what}: the masks agree on {same / total:.3f} of {total} elements"


def _layers(masks: Masks) -> list[str]:
    return sorted({layer for layer, _, _ in masks})


# ---- the guards ---------------------------------------------------------------------------------
def check_masks_differ_between_samples() -> None:
    masks = keep_masks(keyed_encoder(), batch_of(IDS))
    for layer in _layers(masks):
        rows = [(s, slot) for (name, s, slot) in masks if name == layer]
        pairs = [(masks[layer, a, slot], masks[layer, b, slot]) for (a, slot), (b, other) in
                 itertools.combinations(rows, 2) if slot == other]
        assert_independent(pairs, f"{layer}, samples")


def check_masks_differ_between_views() -> None:
    masks = keep_masks(keyed_encoder(), batch_of(IDS))
    text_layers = [layer for layer in _layers(masks) if layer.startswith("adapters.text.")]
    assert len(text_layers) >= 4
    for layer in text_layers:
        assert_independent([(masks[layer, i, 0], masks[layer, i, 1]) for i in IDS], f"{layer}, view slots 0 and 1")


def check_masks_differ_between_layers() -> None:
    masks = keep_masks(keyed_encoder(), batch_of(IDS))
    layers = _layers(masks)
    compared = 0
    for a, b in itertools.combinations(layers, 2):
        rows = [(s, slot) for (name, s, slot) in masks if name == a]
        if a.split(".")[1] != b.split(".")[1] or masks[(a, *rows[0])].shape != masks[(b, *rows[0])].shape:
            continue  # other rows (modality) or another shape: nothing to compare position by position
        assert_independent([(masks[(a, *row)], masks[(b, *row)]) for row in rows], f"layers {a} and {b}")
        compared += 1
    assert compared >= 8, compared  # BERT's embedding and hidden dropouts, the sequence layers' dropout1/2


def check_masks_differ_between_micro_batches() -> None:
    encoder, batch = keyed_encoder(), batch_of(IDS)
    first, second = keep_masks(encoder, batch, micro_batch=0), keep_masks(encoder, batch, micro_batch=1)
    for layer in _layers(first):
        assert_independent([(m, second[key]) for key, m in first.items() if key[0] == layer],
                           f"{layer}, micro-batches 0 and 1")


def check_teacher_masks_are_its_own() -> None:
    encoder, batch = keyed_encoder(), batch_of(IDS)
    teacher = EMATeacher(encoder, momentum=0.9)
    student = keep_masks(encoder, batch)
    taught = keep_masks(teacher.module, batch, call=teacher)
    assert student.keys() == taught.keys()
    for layer in _layers(student):
        assert_independent([(m, taught[key]) for key, m in student.items() if key[0] == layer],
                           f"{layer}, student and EMA teacher")


def chunked_masks(encoder: nn.Module, groups: list[list[int]], trim_padding: bool = False,
                  modalities: tuple[str, ...] = ("text", "seq")) -> Masks:
    out: Masks = {}
    for group in groups:
        out.update(keep_masks(encoder, batch_of(group, trim_padding, modalities)))
    return out


def check_masks_equal_chunked_reordered_padded() -> None:
    encoder = keyed_encoder()
    whole = keep_masks(encoder, batch_of(IDS))
    assert_same_masks(whole, chunked_masks(encoder, [IDS[:2], IDS[2:]]), "chunks of 2 and 4")
    assert_same_masks(whole, chunked_masks(encoder, [IDS[::-1]]), "reversed")
    # One sample per call: each text padded to its own length, not the batch's longest.
    assert_same_masks(whole, chunked_masks(encoder, [[i] for i in IDS]), "one sample per call")
    # Sequences cut to the longest of each chunk.
    trimmed = chunked_masks(encoder, [IDS[4:], IDS[:4]], trim_padding=True)
    assert_same_masks(whole, trimmed, "shorter padding")
    layer = "adapters.seq.backbone.encoder.layers.0.dropout1"
    assert {m.shape[0] for key, m in whole.items() if key[0] == layer} == {7}  # the batch pads to 7 steps
    assert {m.shape[0] for key, m in trimmed.items() if key[0] == layer} == {5, 6}  # the chunks to fewer


OTHER_PROCESS = ("text", "seq")  # the modalities the other process encodes
OTHER_PROCESS_GROUPS = [IDS[3:], IDS[:3]]
OTHER_PROCESS_BREAK = "keyed_dropout_salt_from_hash"


def _read_masks(path: Path) -> Masks:
    from safetensors.torch import load_file

    return {(layer, int(sample), int(slot)): mask.bool() for key, mask in load_file(str(path)).items()
            for layer, sample, slot in [key.split("|")]}


@pytest.fixture(scope="module")
def other_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Masks]:
    """The masks of OTHER_PROCESS_GROUPS computed by a new Python process with another hash seed:
    "intact", then (same process) with the break OTHER_PROCESS_BREAK applied, "broken". One
    process for both: its imports (torch, transformers) are most of the cost."""
    from test_train_utils import env

    folder = tmp_path_factory.mktemp("other-process-masks")
    seed = os.environ.get("PYTHONHASHSEED", "")
    other_seed = str(int(seed) + 1) if seed.isdigit() else "1"
    r = subprocess.run([sys.executable, __file__, str(folder / "intact"), OTHER_PROCESS_BREAK, str(folder / "broken")],
                       capture_output=True, text=True, timeout=180, env=env(PYTHONHASHSEED=other_seed))
    assert r.returncode == 0, r.stderr[-3000:]
    return {name: _read_masks(folder / name) for name in ("intact", "broken")}


def check_masks_equal_in_another_process(other: Masks) -> None:
    whole = keep_masks(keyed_encoder(OTHER_PROCESS), batch_of(IDS, modalities=OTHER_PROCESS))
    assert_same_masks(whole, other, "another process")


GUARDS: dict[str, Callable[[], None]] = {
    "samples": check_masks_differ_between_samples,
    "views": check_masks_differ_between_views,
    "layers": check_masks_differ_between_layers,
    "micro_batches": check_masks_differ_between_micro_batches,
    "teacher": check_teacher_masks_are_its_own,
    "same_key": check_masks_equal_chunked_reordered_padded,
}


@pytest.mark.parametrize("name", sorted(GUARDS))
def test_keyed_dropout_masks(name: str) -> None:
    GUARDS[name]()


def test_keyed_dropout_masks_are_the_same_in_another_process(other_process: dict[str, Masks]) -> None:
    check_masks_equal_in_another_process(other_process["intact"])


# ---- the guards fail on the breaks (tests/README.md) ------------------------------------------
@pytest.mark.parametrize("guard,broken", [
    ("samples", "keyed_dropout_ignores_sample"),
    ("views", "keyed_dropout_ignores_view_slot"),
    ("layers", "keyed_dropout_one_salt"),
    ("micro_batches", "keyed_dropout_ignores_micro_batch"),
    ("teacher", "teacher_shares_student_dropout"),
    ("same_key", "key_dropout_by_row"),
])
def test_keyed_dropout_mask_check_fails_on_the_break(guard: str, broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    apply_break(broken, monkeypatch.setattr)
    with pytest.raises(AssertionError, match="agree on 1.000|differs"):
        GUARDS[guard]()


def test_another_process_check_fails_when_salts_come_from_pythons_hash(other_process: dict[str, Masks],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    apply_break(OTHER_PROCESS_BREAK, monkeypatch.setattr)  # in this process; the other one had it too
    with pytest.raises(AssertionError, match="another process: the mask of .* differs"):
        check_masks_equal_in_another_process(other_process["broken"])


def _write_other_process_masks(intact: str, broken_by: str, broken: str) -> None:
    """The other process: the masks of OTHER_PROCESS_GROUPS to ``intact``, then with the break
    ``broken_by`` applied to ``broken`` (safetensors)."""
    from safetensors.torch import save_file

    for out in (intact, broken):
        if out == broken:
            apply_break(broken_by)
        masks = chunked_masks(keyed_encoder(OTHER_PROCESS), OTHER_PROCESS_GROUPS, modalities=OTHER_PROCESS)
        save_file({f"{layer}|{sample}|{slot}": mask.to(torch.uint8).contiguous()
                   for (layer, sample, slot), mask in masks.items()}, out)


if __name__ == "__main__":
    _write_other_process_masks(*sys.argv[1:])
