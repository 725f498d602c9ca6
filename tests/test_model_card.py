"""The model card written into a trained encoder folder (``<run>/encoder/README.md``): its
front matter is YAML in the Hugging Face layout with the run's numbers, its evaluation table
holds the trained and the random-initialisation numbers, its command trains the same recipe
again, and ``MultiViewEncoder.from_pretrained`` still loads the folder."""

from __future__ import annotations

import argparse
import json
import re
import shlex

import torch
import yaml
from test_train_utils import tiny_config, write_recipe

from mmviews.cli.train import add_arguments
from mmviews.config import load_config, resolve_recipe
from mmviews.modalities import MultiViewEncoder
from mmviews.run import list_checkpoints
from mmviews.train import train
from mmviews.train.model_card import render_model_card, reproduce_command


def _front_matter(card: str) -> tuple[dict, str]:
    match = re.match(r"---\n(.*?)\n---\n(.*)", card, re.S)
    assert match, card[:200]
    return yaml.safe_load(match.group(1)), match.group(2)


def _command_config(command: str):
    """The config ``mmviews train ...`` would train, parsed by the command's own parser."""
    argv = shlex.split(command)
    assert argv[:2] == ["mmviews", "train"], argv
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv[2:])
    return load_config(resolve_recipe(args.recipe), args.overrides)


def test_trained_encoder_folder_has_a_model_card(tmp_path):
    raw = tiny_config(num_samples=48, batch_size=16, epochs=2, image=False,
                      tasks=["linear:class", "regression:sentiment"])
    recipe = write_recipe(tmp_path / "tiny.yaml", raw)
    config = load_config(recipe, ["objective.params.temperature=0.3", "optimisation.lr=0.004"])
    run = tmp_path / "run"
    train(config, run, source=str(recipe))
    results = json.loads((run / "results.json").read_text())

    card = (run / "encoder" / "README.md").read_text()
    front, body = _front_matter(card)
    assert front["library_name"] == "mmviews"
    assert {"mmviews", "mv_dhel", "text"} <= set(front["tags"])
    (entry,) = front["model-index"]
    by_split = {r["dataset"]["split"]: {m["type"]: m["value"] for m in r["metrics"]} for r in entry["results"]}
    assert by_split["test"]["linear/class/acc"] == round(results["eval"]["test/linear/class/acc"], 6)
    assert by_split["test"]["regression/sentiment/r2"] == round(results["eval"]["test/regression/sentiment/r2"], 6)
    assert by_split["valid"]["linear/class/acc"] == round(results["eval"]["val/linear/class/acc"], 6)
    # the headline metrics only (those the terminal shows), no counts or per-pair figures
    assert set(by_split["test"]) == {h["metric"].removeprefix("test/") for h in results["headline"]}
    assert not any(name.endswith("/n") for metrics in by_split.values() for name in metrics)

    # The evaluation table: trained and random-initialisation numbers side by side.
    for key in ("test/linear/class/acc", "test/regression/sentiment/mae"):
        split, name = key.split("/", 1)
        trained, random_init = results["eval"][key], results["eval_random"][key]
        row = f"| {split} | {name} | {trained:.4f} | {random_init:.4f} | {trained - random_init:+.4f}"
        assert row in body, (row, body)
    assert "| temperature | 0.3 |" in body and "`text`" in body and "`synthetic`" in body

    # The load example runs as written, embedding one modality alone too.
    (example,) = re.findall(r"```python\n(.*?)\n```", body, re.S)
    assert 'encoder.encode_modality("text", {"text": [' in example
    code = example.replace("path/to/this/folder", str(run / "encoder")).replace("z, mask = encoder(batch)", "#")
    scope: dict = {}
    exec(code, scope)
    z = scope["z_text"]
    assert z.shape == (2, 16) and torch.allclose(z.norm(dim=1), torch.ones(2), atol=1e-5)

    # The command reproduces the run's resolved recipe exactly.
    (command,) = re.findall(r"```bash\n(.*?)\n```", body, re.S)
    assert "--set objective.params.temperature=0.3" in command and "--set optimisation.lr=0.004" in command
    assert _command_config(command).to_dict() == load_config(run / "config.yaml").to_dict()

    # Loading ignores the card: the weights training ended with come back as they are (those
    # of the last checkpoint, written separately by Accelerate, read straight from its file).
    from safetensors.torch import load_file

    loaded = MultiViewEncoder.from_pretrained(run / "encoder")
    assert set(loaded.adapters) == {"text"}
    state = loaded.state_dict()
    at_end = load_file(str(list_checkpoints(run)[-1] / "model.safetensors"))
    assert at_end.keys() == state.keys()
    assert all(torch.equal(state[k], v) for k, v in at_end.items())


def test_command_names_shipped_recipes_and_falls_back_to_the_recipe():
    source = resolve_recipe("quickstart")
    config = load_config(source, ["optimisation.epochs=1", "views.0.copies=2"])
    command = reproduce_command(config, str(source))
    assert command.startswith("mmviews train quickstart --set ")
    assert _command_config(command).to_dict() == config.to_dict()

    # A removed key cannot be expressed with --set: the card gives the whole recipe instead.
    fewer = load_config(source, ["data.options={num_classes: 4}"])
    assert reproduce_command(fewer, str(source)) is None
    card = render_model_card(fewer, {"eval": {}, "eval_random": None}, str(source))
    assert "mmviews train recipe.yaml" in card and "No evaluation was run" in card
    recipe = re.search(r"```yaml\n(.*?)\n```", card, re.S).group(1)
    assert yaml.safe_load(recipe) == fewer.to_dict()
    assert "model-index" not in _front_matter(card)[0]  # no numbers, no model-index
