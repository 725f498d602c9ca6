"""Parquet shards of an hf dataset keep every column as the source gives it (issue 28): token ids,
``[D]`` (of any or a fixed length), ``[1, D]``, ``[L, D]`` and fixed ``Array2D`` arrays with absent
values, images, audio, text and labels decode to the same tensors map-style and streamed; the
shards' Parquet schema keeps each array column's rank and fixed lengths; shards written flat by an
older mmviews are refused by column with the command that rewrites them; ``prepare hf --format
parquet --recipe`` writes the recipe's columns, labels and splits and speaks in flags; a
streamed recipe is checked through its stream (``train --check``, ``prepare hf --recipe``)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from crafted_files import cli
from test_data_hf import png_bytes, wav_bytes
from test_data_shards import as_list, prepare

from mmviews.data import build_dataset
from mmviews.data.shards import SHARDS_META
from mmviews.data.streaming import StreamLoader

ROWS = 7
D = 4
# modality -> column of the source; the kind each stands for, as the cards list them
COLUMNS = {"ids": "ids", "vec": "vec", "pair": "pair", "row": "row", "seq": "seq", "fixed": "fixed", "image": "img",
           "audio": "snd", "text": "sentence"}
LABELS = {"class": "label", "score": "score"}
# The shape each array modality must come back with (row i); None: absent in that row.
SHAPES = {"ids": lambda i: (3 + i % 2,), "vec": lambda i: (D,), "pair": lambda i: (D,),
          "row": lambda i: None if i == 3 else (1, D),
          "seq": lambda i: None if i == 5 else (1 + i % 3, D), "fixed": lambda i: (2, D)}


def source_split(rows: int, offset: int):
    import datasets

    rng = np.random.default_rng(offset)
    feats = datasets.Features({
        "ids": datasets.List(datasets.Value("int64")),                    # token ids, varying length
        "vec": datasets.List(datasets.Value("float32")),                  # [D]
        "pair": datasets.List(datasets.Value("float32"), length=D),       # [D], its length fixed by the source
        "row": datasets.Array2D(shape=(1, D), dtype="float32"),            # [1, D], one absent
        "seq": datasets.List(datasets.List(datasets.Value("float64"))),    # [L, D] varying L, one absent
        "fixed": datasets.Array2D(shape=(2, D), dtype="float64"),          # fixed [2, D]
        "img": datasets.Image(), "snd": datasets.Value("binary"), "sentence": datasets.Value("string"),
        "label": datasets.ClassLabel(names=["neg", "pos"]), "score": datasets.Value("float32"),
    })
    data = {
        "ids": [list(range(100 + i, 103 + i + i % 2)) for i in range(rows)],
        "vec": [rng.standard_normal(D).astype(np.float32) for _ in range(rows)],
        "pair": [rng.standard_normal(D).astype(np.float32) for _ in range(rows)],
        "row": [None if i == 3 else rng.standard_normal((1, D)).astype(np.float32) for i in range(rows)],
        "seq": [None if i == 5 else rng.standard_normal((1 + i % 3, D)).tolist() for i in range(rows)],
        "fixed": [rng.standard_normal((2, D)) for _ in range(rows)],
        "img": [{"bytes": png_bytes(30 * i + offset, (4 + i % 2, 5)), "path": None} for i in range(rows)],
        "snd": [wav_bytes(200 + 10 * i) for i in range(rows)],
        "sentence": [f"sentence {offset} {i}" for i in range(rows)],
        "label": [i % 2 for i in range(rows)], "score": [0.25 * i - 1 for i in range(rows)],
    }
    return datasets.Dataset.from_dict(data, features=feats)


def pairs(mapping: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in mapping.items())


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """The source (train and test splits), its shards (3 rows per shard), and every train
    sample read from the source, the map-style shards and the streamed shards."""
    import datasets

    folder = tmp_path_factory.mktemp("kinds")
    root, out = folder / "src", folder / "src-parquet"
    datasets.DatasetDict({"train": source_split(ROWS, 0), "test": source_split(3, 50)}).save_to_disk(str(root))
    r = prepare("hf", str(root), "--format", "parquet", "--shard-rows", "3", "--columns", pairs(COLUMNS),
                "--labels", pairs(LABELS))
    assert r.returncode == 0, r.stdout + r.stderr
    options = {"columns": COLUMNS, "labels": LABELS}
    ref = build_dataset("hf", root=str(root), split="train", **options)
    mapped = build_dataset("hf", root=str(out), split="train", **options)
    stream = build_dataset("hf", root=str(out), split="train", streaming=True, **options)
    streamed = {s["index"]: s for b in StreamLoader(stream, 2, as_list, drop_last=False) for s in b}
    assert len(stream.shards.files) == 3 and sorted(streamed) == list(range(ROWS))
    return {"root": root, "out": out, "ref": [ref[i] for i in range(ROWS)], "mapped": [mapped[i] for i in range(ROWS)],
            "streamed": [streamed[i] for i in range(ROWS)]}


def same_value(x, y) -> bool:
    if x is None or y is None:
        return x is None and y is None
    if isinstance(x, str):
        return x == y
    return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("modality", list(COLUMNS))
def test_every_column_kind_decodes_to_the_source_tensors(written, modality):
    for i in range(ROWS):
        x = written["ref"][i]["modalities"][modality]
        if modality in SHAPES:  # the source itself gives the shape the card promises
            expected = SHAPES[modality](i)
            assert (None if x is None else tuple(x.shape)) == expected, (modality, i)
        for reader in ("mapped", "streamed"):
            y = written[reader][i]["modalities"][modality]
            assert same_value(x, y), f"{reader} row {i} {modality}: {x!r} != {y!r}"


def test_labels_and_indices_round_trip(written):
    for reader in ("mapped", "streamed"):
        for i in range(ROWS):
            assert written[reader][i]["labels"] == written["ref"][i]["labels"] and written[reader][i]["index"] == i
    assert written["streamed"][1]["labels"] == {"class": 1, "score": -0.75}


def test_shapes_are_recorded(written):
    meta = json.loads((written["out"] / SHARDS_META).read_text())
    assert meta["shapes"] == {"ids": [None], "vec": [None], "pair": [D], "row": [1, D], "seq": [None, None],
                              "fixed": [2, D]}
    assert meta["splits"]["test"]["rows"] == 3


def arrow_dims(arrow_type: pa.DataType) -> tuple[list[int | None], pa.DataType]:
    """The nesting of an Arrow list column as per-sample dims (a fixed-size list's size, None for a
    list of any length) and the leaf type."""
    dims: list[int | None] = []
    while pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        dims.append(arrow_type.list_size if pa.types.is_fixed_size_list(arrow_type) else None)
        arrow_type = arrow_type.value_type
    return dims, arrow_type


# The per-sample dims each array column of the fixture must have in the Parquet schema.
ARROW_DIMS = {"ids": [None], "vec": [None], "pair": [D], "row": [1, D], "seq": [None, None], "fixed": [2, D]}


def check_shard_schema(out: Path, columns: list[str]) -> None:
    """The guard: every shard of every split stores each array column as float32 lists nested to
    the column's rank, with the source's fixed lengths as fixed-size lists (what any Parquet reader
    sees, whatever mmviews_shards.json says), the varying dimensions as plain lists."""
    files = sorted(out.glob("*/*.parquet"))
    assert {f.parent.name for f in files} == {"train", "test"}
    for file in files:
        schema = pq.read_schema(file)
        for column in columns:
            assert arrow_dims(schema.field(column).type) == (ARROW_DIMS[column], pa.float32()), (
                file.name, column, schema.field(column).type)


def test_shard_schema_keeps_each_columns_rank_and_fixed_lengths(written):
    check_shard_schema(written["out"], list(ARROW_DIMS))


def test_schema_check_fails_when_fixed_lengths_are_dropped(written, tmp_path, monkeypatch):
    """Mutation test (tests/README.md): array columns written as lists of any length."""
    from mutations import apply_break

    apply_break("shards_drop_fixed_lengths", monkeypatch.setattr)
    out = tmp_path / "no-fixed-lengths"
    r = prepare("hf", str(written["root"]), "--format", "parquet", "--columns", "pair=pair,fixed=fixed",
                "--output", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    with pytest.raises(AssertionError, match="pair"):
        check_shard_schema(out, ["pair", "fixed"])


def test_flat_shards_of_an_older_mmviews_are_refused_by_column(written, tmp_path):
    """Shards as the writer before this fix left them (arrays flattened, no recorded shape): opening
    them names the column and gives the command that writes them again; that command works."""
    old = tmp_path / "old"
    meta = json.loads((written["out"] / SHARDS_META).read_text())
    del meta["shapes"]
    (old / "train").mkdir(parents=True)
    (old / SHARDS_META).write_text(json.dumps(meta))
    for shard in meta["splits"]["train"]["shards"]:
        table = pq.read_table(written["out"] / "train" / shard["file"])
        flat = pa.array([None if v is None else np.asarray(v, np.float32).reshape(-1).tolist()
                         for v in table.column("row").to_pylist()], pa.list_(pa.float32()))
        pq.write_table(table.set_column(table.schema.get_field_index("row"), "row", flat), old / "train" / shard["file"])
    with pytest.raises(ValueError) as info:
        build_dataset("hf", root=str(old), split="train", columns={"row": "row"})
    message = str(info.value)
    assert "column 'row' was written flat" in message and "\n" not in message
    command = shlex.split(message.split("write the shards again: ", 1)[1])
    assert command[:3] == ["mmviews", "prepare", "hf"] and "--overwrite" in command
    r = prepare(*command[2:])
    assert r.returncode == 0, r.stdout + r.stderr
    again = build_dataset("hf", root=str(old), split="train", columns={"row": "row"})
    assert again[0]["modalities"]["row"].shape == (1, D)


def test_prepare_parquet_uses_the_recipe_and_speaks_in_flags(written, tmp_path):
    recipe = {"name": "r", "data": {"name": "hf", "root": "elsewhere", "train_split": "train", "val_split": None,
                                    "test_split": None, "options": {"format": "parquet", "columns": {"feature": "row"},
                                                                    "labels": {"grade": "score"}}},
              "views": [{"modality": "feature"}, {"modality": "feature"}], "encoder": {"embed_dim": 8},
              "adapters": {"feature": {"type": "mlp", "input_dim": D}}, "objective": {"name": "mv_dhel"}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "from-recipe"
    r = prepare("hf", str(written["root"]), "--format", "parquet", "--recipe", str(path), "--output", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    meta = json.loads((out / SHARDS_META).read_text())
    assert meta["columns"] == {"row": "array"} and meta["labels"] == {"grade": "score"}
    assert list(meta["splits"]) == ["train"]  # the recipe's splits only (no test split in it)
    # A wrong column in the recipe names its key; on the command line, the flag. Never Python syntax.
    recipe["data"]["options"]["columns"] = {"feature": "nope"}
    path.write_text(yaml.safe_dump(recipe))
    r = prepare("hf", str(written["root"]), "--format", "parquet", "--recipe", str(path), "--output", str(tmp_path / "x"))
    assert r.returncode == 2 and f"key 'data.options.columns' of {path}" in r.stderr and "'nope'" in r.stderr
    r = prepare("hf", str(written["root"]), "--format", "parquet", "--output", str(tmp_path / "y"))  # no image/audio/text
    assert r.returncode == 2 and "--columns MODALITY=COLUMN" in r.stderr and "no modality columns" in r.stderr
    assert "={" not in r.stderr and "columns=" not in r.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()  # nothing half-written
    r = prepare("mosi", str(path), "--format", "parquet", "--recipe", str(path))
    assert r.returncode == 2 and "--recipe reads the data options of an hf recipe" in r.stderr


def test_streamed_recipe_is_checked_through_its_stream(written, tmp_path, capsys):
    """``train --check`` and ``prepare hf --recipe`` on a ``data.streaming: true`` recipe read a batch
    through the stream (a ShardStream cannot be indexed) and report in lines, no traceback."""
    recipe = {"name": "s", "seed": 0, "cpu": True,
              "data": {"name": "hf", "root": str(written["out"]), "streaming": True, "batch_size": 4, "val_split": None,
                       "test_split": "test", "options": {"columns": {"row": "row"}}},
              "views": [{"modality": "row"}, {"modality": "row"}], "encoder": {"embed_dim": 8},
              "adapters": {"row": {"type": "mlp", "input_dim": D, "head": {"kind": "linear"}}},
              "objective": {"name": "mv_dhel"}, "optimisation": {"epochs": 1}, "evaluation": {"tasks": []}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(recipe))
    rc, out, err = cli(capsys, "train", str(path), "--check")
    assert rc == 0 and "Traceback" not in err, err
    assert out.splitlines()[0] == f"{path}: OK (2 views: row_0, row_1; objective mv_dhel; {ROWS} training samples)"
    assert "activations" in out and "(measured)" in out  # a batch of the stream went through the encoder
    rc, out, err = cli(capsys, "prepare", "hf", str(written["out"]), "--recipe", str(path))
    assert rc == 0 and "Traceback" not in err, out + err
    assert "decoded: 7 of the first 7 rows (read through the stream)" in out
    assert "decoded: 3 of the first 3 rows (read through the stream)" in out  # the test split

