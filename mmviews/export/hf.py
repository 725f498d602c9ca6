"""``mmviews export RUN --format hf``: a folder to upload to the Hugging Face Hub as it is.

The folder is the one :meth:`MultiViewEncoder.save_pretrained` writes (``encoder.json``, one
sub-folder per modality with its ``config.json``, ``model.safetensors`` and tokenizer or
feature-extractor files) and a ``README.md`` model card: YAML front matter the Hub reads
(``library_name: mmviews``, ``license``, ``datasets``, tags, the metrics with their values as
``model-index``) followed by the card the run wrote at the end of training (rendered anew from
the run's recipe and ``results.json`` for a checkpoint, which has none).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from mmviews.fileio import atomic_write_text, commit_folder, disk_full, folder_bytes, read_json_object, temporary_folder

__all__ = ["export_hf", "export_space", "hub_model_card", "prepare_output_folder", "finish_output_folder"]


def prepare_output_folder(output: Path) -> Path:
    """A new temporary folder beside ``output`` (which must not exist yet, its parent must):
    the export is written there and renamed to ``output`` when complete."""
    if output.exists():
        raise FileExistsError(f"--output {output} exists: give a new folder")
    if not output.parent.is_dir():
        raise FileNotFoundError(f"--output {output}: folder {output.parent} does not exist")
    return temporary_folder(output)


def export_space(output: Path, tmp: Path, encoder: Any) -> Any:
    """Around the writes of an export into ``tmp``: a full disk (or quota) is one
    :class:`~mmviews.fileio.DiskFullError` naming ``output``'s folder, the bytes the export needs
    (about the encoder's weights, or what was written when more) and the bytes free, the partial
    folder removed (:func:`mmviews.fileio.disk_full`)."""
    from mmviews.train.memory import tensor_bytes

    return disk_full(output.parent, f"the export {output.name}/",
                     lambda: max(tensor_bytes(encoder.state_dict().values()), folder_bytes(tmp)), cleanup=tmp)


def finish_output_folder(tmp: Path, output: Path) -> Path:
    """The complete export renamed to ``output``, durably (:func:`mmviews.fileio.commit_folder`)."""
    return commit_folder(tmp, output)


def hub_model_card(run: str | os.PathLike[str], config: Any, license: str | None) -> str:
    """The ``README.md`` of the exported folder (see the module docstring)."""
    from mmviews.run import ENCODER_DIR, RESULTS_FILE, is_checkpoint, run_dir_of
    from mmviews.train.model_card import MODEL_CARD_FILE, front_matter, render_model_card, replace_front_matter

    path = Path(run)
    run_dir = run_dir_of(path) if is_checkpoint(path) else path
    results = run_dir / RESULTS_FILE
    summary: dict[str, Any] = read_json_object(results) if results.is_file() else {}
    card = run_dir / ENCODER_DIR / MODEL_CARD_FILE
    if not is_checkpoint(path) and card.is_file():
        return replace_front_matter(card.read_text(encoding="utf-8"), front_matter(config, summary, license))
    return render_model_card(config, summary, None, None, license)


def export_hf(run: str | os.PathLike[str], output: str | os.PathLike[str], license: str | None = None) -> Path:
    """Write the Hub-ready folder of ``run`` (a run or checkpoint folder) to ``output`` (a new
    folder); returns it."""
    from mmviews.run import load_trained_encoder
    from mmviews.train.model_card import MODEL_CARD_FILE

    output = Path(output)
    encoder, config = load_trained_encoder(run)
    card = hub_model_card(run, config, license)
    tmp = prepare_output_folder(output)
    try:
        with export_space(output, tmp, encoder):
            encoder.save_pretrained(tmp)
            atomic_write_text(tmp / MODEL_CARD_FILE, card)
            return finish_output_folder(tmp, output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
