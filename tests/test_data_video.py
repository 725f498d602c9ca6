"""Video folders (:mod:`mmviews.data.video`; UCF-101 / HMDB-51 layouts): the split lists, the frame
and audio windows (the short-clip boundary at ``num_frames`` and one frame below it), the dataset's
options and their one-line errors naming the option or file, and what one sample holds by source
(PyAV frames and audio, flow images, frame folders, bad files). Tiny folders and clips of a few
frames of 8x8 to 32x48 pixels, built in each test."""

from __future__ import annotations

import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmviews.data import ViewSetCollator, ViewSpec, build_dataset
from mmviews.data.video import (
    UNREADABLE,
    VideoFolder,
    audio_window_start,
    clip_window,
    decode_flow_image,
    encode_flow_image,
    find_splits_dir,
    parse_split,
    resize_flow,
    resize_frames,
    scan_video_folder,
)
from mmviews.data.video_store import MANIFEST, default_store_path, prepare_video_store
from mmviews.notices import MMViewsWarning


def write_clip(path, n_frames=10, audio=True, size=(32, 48), shade=0):
    import av

    with av.open(str(path), "w") as out:
        vs = out.add_stream("mpeg4", rate=10)
        vs.width, vs.height, vs.pix_fmt = size[1], size[0], "yuv420p"
        if audio:
            aus = out.add_stream("aac", rate=16000)
            aus.layout = "mono"
        for i in range(n_frames):
            img = np.full((size[0], size[1], 3), (shade + 20 * i) % 255, dtype=np.uint8)
            for p in vs.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(p)
        for p in vs.encode():
            out.mux(p)
        if audio:
            t = np.arange(16000) / 16000
            wave = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None]
            frame = av.AudioFrame.from_ndarray(wave, format="fltp", layout="mono")
            frame.sample_rate = 16000
            frame.pts = 0
            frame.time_base = Fraction(1, 16000)
            for p in aus.encode(frame):
                out.mux(p)
            for p in aus.encode():
                out.mux(p)


@pytest.fixture(scope="module")
def ucf(tmp_path_factory):
    root = tmp_path_factory.mktemp("ucf")
    (root / "Jump").mkdir()
    (root / "Run").mkdir()
    write_clip(root / "Jump" / "v_Jump_g01_c01.mp4", audio=True)
    write_clip(root / "Run" / "v_Run_g01_c01.mp4", audio=False, shade=100)
    (root / "Run" / "v_Run_g02_c01.mp4").write_bytes(b"not a video at all")
    lists = root / "ucfTrainTestlist"
    lists.mkdir()
    (lists / "classInd.txt").write_text("1 Jump\n2 Run\n")
    (lists / "trainlist01.txt").write_text("Jump/v_Jump_g01_c01.mp4 1\nRun/v_Run_g01_c01.mp4 2\n")
    (lists / "testlist01.txt").write_text("Run/v_Run_g02_c01.mp4\n")
    return root


def test_clips_with_and_without_audio(ucf):
    ds = build_dataset("ucf101", root=ucf, split="train", num_frames=4, size=16)
    assert len(ds) == 2 and ds.classes == ["Jump", "Run"]
    a, b = ds[0], ds[1]
    assert a["modalities"]["video"].shape == (4, 3, 16, 16) and b["modalities"]["video"].shape == (4, 3, 16, 16)
    audio = a["modalities"]["audio"]
    assert audio is not None and 0.8 * 16000 < audio.shape[0] <= 16000 + 2048
    spectrum = torch.fft.rfft(audio[2000:12000]).abs()
    assert abs(int(spectrum.argmax()) * 16000 / 10000 - 440) < 10  # the 440 Hz tone survives the round trip
    assert b["modalities"]["audio"] is None  # no audio track -> absent, not silence
    assert a["labels"]["class"] == 0 and b["labels"]["class"] == 1
    # frames are the middle ones, in order (the encoded shade grows 20 per frame)
    means = a["modalities"]["video"].mean(dim=(1, 2, 3)) * 255
    assert torch.all(means[1:] > means[:-1])
    spec = ViewSpec.from_config([{"modality": "video", "augment": "video_default"}, "audio"])
    batch = ViewSetCollator.for_dataset(ds, spec)([a, b])
    assert batch.mask.tolist() == [[True, True], [True, False]]
    assert batch.inputs["audio"]["lengths"][1] == 0


def test_unreadable_clip_raises_or_skips(ucf):
    ds = build_dataset("ucf101", root=ucf, split="test", num_frames=4, size=16)
    with pytest.raises(ValueError, match="v_Run_g02_c01.mp4"):
        ds[0]
    ds = build_dataset("ucf101", root=ucf, split="test", num_frames=4, size=16, on_error="skip")
    with pytest.warns(UserWarning, match="v_Run_g02_c01.mp4"):
        x = ds[0]
    assert x["modalities"]["video"] is None and ds.num_skipped >= 1
    assert "v_Run_g02_c01.mp4" in x["unreadable"]  # the collator drops it from its batch, naming it


def test_missing_split_list(ucf):
    with pytest.raises(FileNotFoundError, match="trainlist03"):
        build_dataset("ucf101", root=ucf, split="train", fold=3)


def test_precomputed_frames_and_flow_hmdb_layout(tmp_path):
    root, frames, flows = tmp_path / "hmdb", tmp_path / "frames", tmp_path / "flow"
    (root / "wave").mkdir(parents=True)
    (root / "wave" / "clip1.avi").write_bytes(b"")  # decoded from frames, not from the video
    (root / "wave_test_split1.txt").write_text("clip1.avi 1\nclip2.avi 2\n")
    d, fd = frames / "wave" / "clip1", flows / "wave" / "clip1"
    d.mkdir(parents=True)
    fd.mkdir(parents=True)
    for i in range(1, 7):
        Image.fromarray(np.full((8, 8, 3), 30 * i, np.uint8)).save(d / f"img_{i:05d}.jpg", quality=100)
    for i in range(1, 6):
        Image.fromarray(np.full((8, 8), encode_flow_image(np.array(4.0 * i)), np.uint8)).save(fd / f"flow_x_{i:05d}.jpg", quality=100)
        Image.fromarray(np.full((8, 8), encode_flow_image(np.array(-3.0)), np.uint8)).save(fd / f"flow_y_{i:05d}.jpg", quality=100)
    ds = build_dataset("hmdb51", root=root, split="train", num_frames=4, size=8, frames_root=frames, flow_root=flows,
                       audio=False)
    x = ds[0]["modalities"]
    assert x["video"].shape == (4, 3, 8, 8) and x["flow"].shape == (3, 2, 8, 8)
    # middle window of 6 frames: frames 2..5 -> flows 2..4 (u = 8, 12, 16), v = -3, up to JPEG/uint8 error (0.16 px/level)
    assert torch.allclose(x["flow"][:, 0, 0, 0], torch.tensor([8.0, 12.0, 16.0]), atol=0.4)
    assert torch.allclose(x["flow"][:, 1], torch.full((3, 8, 8), -3.0), atol=0.4)
    assert decode_flow_image(np.array([0, 255])).tolist() == [-20.0, 20.0]
    # resizing the flow scales the displacements
    ds2 = build_dataset("hmdb51", root=root, split="train", num_frames=4, size=16, frames_root=frames, flow_root=flows,
                        audio=False)
    assert torch.allclose(ds2[0]["modalities"]["flow"][:, 1], torch.full((3, 16, 16), -6.0), atol=0.8)


def test_prepare_video_folder(ucf, tmp_path, capsys):
    import argparse

    from mmviews.data import prepare

    parser = argparse.ArgumentParser()
    prepare.add_arguments(parser)
    rc = prepare.run(parser.parse_args(["ucf101", str(ucf), "--check-only", "--out", str(tmp_path / "index.json")]))
    out = capsys.readouterr().out
    assert rc == 1  # one clip is unreadable: reported, exit status 1
    assert "clips with an audio track: 1" in out and "v_Run_g02_c01.mp4" in out
    assert (tmp_path / "index.json").is_file()


# ---------------------------------------------------------------------------------------------
# Unit guards on tiny folders: split lists, frame and audio windows, options, one sample by source
# ---------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------- helpers


def write_frames(folder: Path, values: list[int], size: tuple[int, int] = (8, 8)) -> None:
    """``img_00001.jpg ...``: frame i a flat grey of ``values[i]`` (flat: JPEG keeps it to +-1)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, v in enumerate(values, start=1):
        Image.fromarray(np.full((*size, 3), v, np.uint8)).save(folder / f"img_{i:05d}.jpg", quality=100)


def write_flow_xy(folder: Path, us: list[float], v: float, size: tuple[int, int] = (8, 8), rgb: bool = False) -> None:
    """``flow_x_/flow_y_0000k.jpg``: flow k is a flat ``(us[k-1], v)`` pixels (grey images, saved
    with three equal channels when ``rgb``, as some extraction tools write them)."""
    folder.mkdir(parents=True, exist_ok=True)
    shape = (*size, 3) if rgb else size
    for i, u in enumerate(us, start=1):
        Image.fromarray(np.full(shape, encode_flow_image(np.array(u)), np.uint8)).save(folder / f"flow_x_{i:05d}.jpg",
                                                                                    quality=100)
        Image.fromarray(np.full(shape, encode_flow_image(np.array(v)), np.uint8)).save(folder / f"flow_y_{i:05d}.jpg",
                                                                                   quality=100)


def one_clip_folder(tmp_path: Path) -> tuple[Path, Path]:
    """An HMDB-51 style folder listing one train clip, ``wave/clip1.avi`` (no video file: its
    frames come from images), and where its frame images go (``frames/wave/clip1``, not made)."""
    root = tmp_path / "hmdb"
    (root / "wave").mkdir(parents=True)
    (root / "wave_test_split1.txt").write_text("clip1.avi 1\n")
    return root, tmp_path / "frames"


def frames_folder(tmp_path: Path, n_frames: int, classes: tuple[str, ...] = ("wave",)) -> tuple[Path, Path]:
    """An HMDB-51 style folder (empty video files; one train clip per class) and its frames:
    frame i of class c is grey ``10 * i + 1`` (+ 100 for the second class)."""
    root, frames = tmp_path / "hmdb", tmp_path / "frames"
    for k, cls in enumerate(classes):
        (root / cls).mkdir(parents=True)
        (root / cls / "clip1.avi").write_bytes(b"")
        (root / f"{cls}_test_split1.txt").write_text("clip1.avi 1\n")
        write_frames(frames / cls / "clip1", [10 * i + 1 + 100 * k for i in range(n_frames)])
    return root, frames


def from_mmviews(warning) -> bool:
    """Whether a warning is attributed to a line of mmviews' video module (it should point at
    the caller: the ``stacklevel``; the exact frame is not checked, since mutmut adds frames)."""
    return Path(warning.filename).as_posix().endswith("mmviews/data/video.py")


def grey_levels(video: torch.Tensor) -> list[int]:
    """Per-frame mean of a ``[T, 3, H, W]`` video in [0, 1], as 0..255 levels."""
    return [round(float(v)) for v in video.mean(dim=(1, 2, 3)) * 255]


# --------------------------------------------------------------------------- windows


def test_clip_window_takes_the_middle_frames():
    # (n - T) // 2 frames before the window: an odd remainder leaves the extra frame after it
    assert clip_window(10, 4).tolist() == [3, 4, 5, 6]
    assert clip_window(9, 4).tolist() == [2, 3, 4, 5]
    assert clip_window(4, 4).tolist() == [0, 1, 2, 3]
    assert clip_window(5, 4).tolist() == [0, 1, 2, 3]


def test_clip_window_short_clip_repeats_its_last_frame_at_the_boundary():
    # num_frames frames: no repeat; one frame fewer: the last one repeated once
    assert clip_window(8, 8).tolist() == list(range(8))
    assert clip_window(7, 8).tolist() == [0, 1, 2, 3, 4, 5, 6, 6]
    assert clip_window(1, 3).tolist() == [0, 0, 0]
    assert clip_window(3, 5).dtype.kind == "i"


def test_audio_window_is_centred_on_the_frames():
    # frames from 2.0 s, 10 frames at 5 fps last 2 s: centre 3.0 s; an odd length puts the
    # extra sample after the centre (first = centre - n // 2)
    first, n = audio_window_start(2.0, 10, 5.0, 1.0, 8001)
    assert (first, n) == (3 * 8001 - 4000, 8001)
    assert isinstance(first, int) and isinstance(n, int)
    assert audio_window_start(0.0, 8, 4.0, 0.5, 16000) == (16000 - 4000, 8000)


# --------------------------------------------------------------------------- split lists


def ucf_lists(folder: Path, fold: int = 1) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"trainlist{fold:02d}.txt").write_text("Jump/a.avi 1\n")
    (folder / f"testlist{fold:02d}.txt").write_text("Jump/b.avi\n")


def test_find_splits_dir_looks_in_order_and_only_for_its_own_lists(tmp_path):
    root = tmp_path / "UCF-101"
    root.mkdir()
    assert find_splits_dir(root, "ucf101") == root  # nothing anywhere: the root (parse_split names the files)
    ucf_lists(tmp_path / "ucfTrainTestlist")  # next to the root, as the archive unpacks
    assert find_splits_dir(root, "ucf101") == tmp_path / "ucfTrainTestlist"
    assert find_splits_dir(root, None) == tmp_path / "ucfTrainTestlist"
    assert find_splits_dir(root, "hmdb51") == root  # not HMDB-51's lists
    ucf_lists(root / "splits")
    assert find_splits_dir(root, "ucf101") == root / "splits"
    ucf_lists(root / "ucfTrainTestlist")
    assert find_splits_dir(root, "ucf101") == root / "ucfTrainTestlist"
    ucf_lists(root)
    assert find_splits_dir(root, "ucf101") == root
    # HMDB-51: its own archive folder, looked for inside and next to the root
    data = tmp_path / "data"
    hmdb = data / "hmdb51"
    hmdb.mkdir(parents=True)
    (data / "testTrainMulti_7030_splits").mkdir()
    (data / "testTrainMulti_7030_splits" / "wave_test_split1.txt").write_text("a.avi 1\n")
    assert find_splits_dir(hmdb, "hmdb51") == data / "testTrainMulti_7030_splits"
    assert find_splits_dir(hmdb, None) == data / "testTrainMulti_7030_splits"
    (hmdb / "testTrainMulti_7030_splits").mkdir()
    (hmdb / "testTrainMulti_7030_splits" / "wave_test_split1.txt").write_text("a.avi 1\n")
    assert find_splits_dir(hmdb, "hmdb51") == hmdb / "testTrainMulti_7030_splits"
    assert find_splits_dir(hmdb, "ucf101") == hmdb
    # a dataset's lists found only in its own archive folder: HMDB-51's list in UCF-101's folder is neither's
    mixed = tmp_path / "mixed" / "root"
    mixed.mkdir(parents=True)
    (mixed / "ucfTrainTestlist").mkdir()
    (mixed / "ucfTrainTestlist" / "wave_test_split1.txt").write_text("a.avi 1\n")
    assert find_splits_dir(mixed, "ucf101") == mixed and find_splits_dir(mixed, "hmdb51") == mixed
    # a plain file with the folder's name is no folder
    other = tmp_path / "elsewhere" / "other"
    other.mkdir(parents=True)
    (other / "splits").write_text("")
    assert find_splits_dir(other, "ucf101") == other


def test_parse_split_all_takes_every_video_of_every_class_folder(tmp_path):
    root = tmp_path / "root"
    for rel in ("Run/b.AVI", "Run/a.mp4", "Jump/c.mkv", "Jump/notes.txt", "Jump/d.avi"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"")
    (root / "top.avi").write_bytes(b"")  # not in a class folder
    assert parse_split(root, root, "all", 1) == [("Jump", "Jump/c.mkv"), ("Jump", "Jump/d.avi"),
                                                 ("Run", "Run/a.mp4"), ("Run", "Run/b.AVI")]


def test_parse_split_ucf_lists(tmp_path):
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "trainlist02.txt").write_text("Jump\\v_Jump_g01.avi 1\n\n   \nRun/v_Run_g02.avi 2\n")
    (lists / "testlist02.txt").write_text("  Run/v_Run_g03.avi  \n")
    assert parse_split(tmp_path, lists, "train", 2, "ucf101") == [("Jump", "Jump/v_Jump_g01.avi"),
                                                                  ("Run", "Run/v_Run_g02.avi")]
    assert parse_split(tmp_path, lists, "test", 2) == [("Run", "Run/v_Run_g03.avi")]
    # HMDB-51 never reads UCF-101's lists
    with pytest.raises(FileNotFoundError) as err:
        parse_split(tmp_path, lists, "train", 2, "hmdb51")
    assert str(err.value) == (f"no split list for split 'train' fold 2 in {lists}: expected *_test_split2.txt (HMDB-51) "
                              "(splits_dir= / --splits-dir names the folder); use split='all' to take every clip")


def test_parse_split_hmdb_lists(tmp_path):
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "wave_test_split1.txt").write_text("w1.avi 1\nw2.avi 2\nw3.avi 0\nlonely\n\nw4.avi 1 extra\n")
    (lists / "brush_hair_test_split1.txt").write_text("b1.avi 2 \nb2.avi 1\n")
    (lists / "wave_test_split2.txt").write_text("w9.avi 1\n")
    assert parse_split(tmp_path, lists, "train", 1, "hmdb51") == [("brush_hair", "brush_hair/b2.avi"),
                                                                  ("wave", "wave/w1.avi"), ("wave", "wave/w4.avi")]
    assert parse_split(tmp_path, lists, "test", 1) == [("brush_hair", "brush_hair/b1.avi"), ("wave", "wave/w2.avi")]
    assert parse_split(tmp_path, lists, "train", 2, "hmdb51") == [("wave", "wave/w9.avi")]
    with pytest.raises(FileNotFoundError) as err:
        parse_split(tmp_path, lists, "train", 1, "ucf101")  # UCF-101 never reads HMDB-51's lists
    assert str(err.value) == (f"no split list for split 'train' fold 1 in {lists}: expected trainlist01.txt (UCF-101) "
                              "(splits_dir= / --splits-dir names the folder); use split='all' to take every clip")


def test_parse_split_errors_name_the_split_and_both_list_kinds(tmp_path):
    with pytest.raises(ValueError) as err:
        parse_split(tmp_path, tmp_path, "val", 1)
    assert str(err.value) == "video folders have splits 'train', 'test' (official lists) or 'all', got 'val'"
    assert err.value.option == "split"
    with pytest.raises(FileNotFoundError) as err:
        parse_split(tmp_path, tmp_path, "test", 3)
    assert str(err.value) == (f"no split list for split 'test' fold 3 in {tmp_path}: expected testlist03.txt (UCF-101) "
                              "or *_test_split3.txt (HMDB-51) (splits_dir= / --splits-dir names the folder); "
                              "use split='all' to take every clip")


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize("options, message, option", [
    ({"on_error": "ignore"}, "on_error must be 'raise' or 'skip', got 'ignore'", "on_error"),
    ({"decode": "fast"}, "decode must be 'seek' or 'full', got 'fast'", "decode"),
    ({"flow": "tvl1"}, "flow must be None, 'precomputed', 'farneback' or 'raft', got 'tvl1'", "flow"),
    ({"flow": "precomputed"}, "flow='precomputed' needs flow_root", "flow_root"),
    ({"flow": "farneback", "num_frames": 1}, "flow needs num_frames >= 2", "num_frames"),
])
def test_option_errors_name_the_option(tmp_path, options, message, option):
    root, _ = frames_folder(tmp_path, 3)
    with pytest.raises(ValueError) as err:
        VideoFolder(root, store=False, **options)
    assert str(err.value) == message and err.value.option == option


def test_folder_and_split_errors(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        VideoFolder(tmp_path / "nowhere")
    assert str(err.value) == f"no such video folder: {tmp_path / 'nowhere'}"
    root, frames = frames_folder(tmp_path, 3)
    with pytest.raises(ValueError) as err:
        VideoFolder(root, splits_dir=tmp_path / "lists")
    assert str(err.value) == f"splits_dir {tmp_path / 'lists'}: no such folder" and err.value.option == "splits_dir"
    (root / "wave_test_split1.txt").write_text("clip1.avi 2\n")  # no train clip left
    with pytest.raises(ValueError) as err:
        VideoFolder(root, "train", store=False)
    assert str(err.value) == f"{root}: split 'train' (fold 1) lists no clips" and err.value.option == "split"
    # a split list naming a class that has no folder
    (root / "jump_test_split1.txt").write_text("j.avi 1\n")
    with pytest.raises(ValueError) as err:
        VideoFolder(root, "train", store=False)
    assert str(err.value) == f"{root}: split lists name classes without a folder: ['jump']"
    with pytest.raises(ValueError) as err:
        build_dataset("hmdb51", split="train")
    assert str(err.value) == "hmdb51: pass root= the folder of class folders (see data_cards/hmdb51.md)"
    assert err.value.option == "root"


def test_defaults_and_what_the_dataset_reports(tmp_path):
    root, frames = frames_folder(tmp_path, 3)
    ds = VideoFolder(root, frames_root=frames)
    assert (ds.num_frames, ds.size, ds.sample_rate, ds.max_audio_seconds) == (8, (112, 112), 16000, 5.0)
    assert (ds.audio, ds.flow, ds.on_error, ds.decode, ds.split) == (True, None, "raise", "seek", "train")
    assert ds.store is None and ds.num_skipped == 0 and ds.num_stale == 0 and not ds.drops_unreadable_samples
    assert ds.modality_info() == {"video": {"kind": "video", "shape": (8, 3, 112, 112)},
                                  "audio": {"kind": "waveform", "shape": (None,), "sample_rate": 16000}}
    assert ds.source_note == f"video folder {root}: 1 clips, split lists from {root}"
    ds = build_dataset("hmdb51", root=root, frames_root=frames)  # the registered builder: train by default
    assert (ds.root, ds.split, ds.dataset) == (root, "train", "hmdb51")
    ds = build_dataset("hmdb51", root=root, split="all", size=(6, 10), num_frames=3, audio=False, sample_rate=8000,
                       flow_root=frames, on_error="skip", max_audio_seconds=2)
    assert ds.flow == "precomputed" and ds.flow_root == frames and ds.drops_unreadable_samples
    assert ds.modality_info() == {"video": {"kind": "video", "shape": (3, 3, 6, 10)},
                                  "flow": {"kind": "flow", "shape": (2, 2, 6, 10)}}
    assert ds.source_note == f"hmdb51 {root}: 1 clips, every clip (split 'all')" and ds.splits_dir is None
    assert (ds.sample_rate, ds.max_audio_seconds) == (8000, 2.0)
    assert isinstance(ds.sample_rate, int) and isinstance(ds.max_audio_seconds, float)


def test_each_dataset_reads_its_own_lists_side_by_side(tmp_path):
    data = tmp_path / "data"
    hmdb = data / "hmdb51"
    (hmdb / "wave").mkdir(parents=True)
    (data / "ucfTrainTestlist").mkdir()
    (data / "ucfTrainTestlist" / "trainlist01.txt").write_text("wave/u.avi\n")
    (data / "testTrainMulti_7030_splits").mkdir()
    (data / "testTrainMulti_7030_splits" / "wave_test_split1.txt").write_text("h.avi 1\n")
    ds = VideoFolder(hmdb, dataset="hmdb51", store=False)
    assert ds.splits_dir == data / "testTrainMulti_7030_splits" and ds.clips == [("wave", "wave/h.avi")]
    # both kinds of list in the folder given: the dataset's own are read
    (data / "ucfTrainTestlist" / "wave_test_split1.txt").write_text("h2.avi 1\n")
    ds = VideoFolder(hmdb, dataset="hmdb51", splits_dir=data / "ucfTrainTestlist", store=False)
    assert ds.clips == [("wave", "wave/h2.avi")]


def test_ucf_class_order_is_class_ind_by_number(tmp_path):
    root = tmp_path / "ucf"
    names = ["Zebra", "Apple", "Mango"]
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "clip.avi").write_bytes(b"")
    lists = tmp_path / "ucfTrainTestlist"
    lists.mkdir()
    # numbered 1, 2, 10: by number Zebra, Apple, Mango (as text "10" would sort before "2")
    (lists / "classInd.txt").write_text("2 Apple\n\n10 Mango\n1 Zebra\n")
    (lists / "trainlist01.txt").write_text("Mango/m.avi\nZebra/z.avi\n")
    ds = VideoFolder(root, dataset="ucf101", store=False)
    assert ds.classes == ["Zebra", "Apple", "Mango"] and ds.class_to_index == {"Zebra": 0, "Apple": 1, "Mango": 2}
    # HMDB-51 has no class index (one in the folder it reads is not its): the class folders, sorted by name
    (root / "classInd.txt").write_text("1 Zebra\n2 Apple\n3 Mango\n")
    ds = VideoFolder(root, dataset="hmdb51", split="all", store=False)
    assert ds.classes == ["Apple", "Mango", "Zebra"]
    # a split list naming classes without a folder: the first five, sorted
    (lists / "trainlist01.txt").write_text("".join(f"C{k}/c.avi\n" for k in range(7, 0, -1)))
    with pytest.raises(ValueError) as err:
        VideoFolder(root, dataset="ucf101", store=False)
    assert str(err.value) == f"{root}: split lists name classes without a folder: ['C1', 'C2', 'C3', 'C4', 'C5']"


# --------------------------------------------------------------------------- samples from frame images


def test_frames_root_sample_takes_the_middle_window(tmp_path):
    root, frames = frames_folder(tmp_path, 7, classes=("brush", "wave"))
    ds = VideoFolder(root, num_frames=4, size=8, frames_root=frames, audio=False, store=False)
    assert [rel for _, rel in ds.clips] == ["brush/clip1.avi", "wave/clip1.avi"]
    sample = ds[1]
    assert sample["index"] == 1 and sample["id"] == "wave/clip1.avi" and sample["labels"] == {"class": 1}
    assert set(sample["modalities"]) == {"video"} and UNREADABLE not in sample
    video = sample["modalities"]["video"]
    assert video.shape == (4, 3, 8, 8) and video.dtype == torch.float32
    # 7 frames, window 4: frames 1..4 (0-based), grey 10 * i + 1 + 100
    levels = grey_levels(video)
    assert all(abs(a - b) <= 1 for a, b in zip(levels, [111, 121, 131, 141], strict=True)), levels
    # a clip one frame shorter than the window repeats its last frame; at the window, none
    ds = VideoFolder(root, num_frames=8, size=8, frames_root=frames, audio=False, store=False)
    levels = grey_levels(ds[0]["modalities"]["video"])
    assert all(abs(a - b) <= 1 for a, b in zip(levels, [1, 11, 21, 31, 41, 51, 61, 61], strict=True)), levels
    ds = VideoFolder(root, num_frames=7, size=8, frames_root=frames, audio=False, store=False)
    levels = grey_levels(ds[0]["modalities"]["video"])
    assert all(abs(a - b) <= 1 for a, b in zip(levels, [1, 11, 21, 31, 41, 51, 61], strict=True)), levels


def test_frames_are_resized_into_zero_one(tmp_path):
    root, frames = one_clip_folder(tmp_path)
    write_frames(frames / "wave" / "clip1", [255, 255, 0], size=(4, 6))
    ds = VideoFolder(root, num_frames=3, size=(8, 12), frames_root=frames, audio=False, store=False)
    video = ds[0]["modalities"]["video"]
    assert video.shape == (3, 3, 8, 12)
    assert float(video.max()) <= 1.0 and float(video.min()) >= 0.0 and float(video[0].min()) > 0.99


def test_missing_frames_raise_or_skip_naming_the_folder(tmp_path):
    root, frames = frames_folder(tmp_path, 3)
    empty = frames / "wave" / "clip1"
    for f in empty.iterdir():
        f.unlink()
    ds = VideoFolder(root, num_frames=2, size=8, frames_root=frames, flow_root=frames, store=False)
    with pytest.raises(FileNotFoundError) as err:
        ds[0]
    assert str(err.value) == f"{empty}: no img_*.jpg frames"
    ds = VideoFolder(root, num_frames=2, size=8, frames_root=frames, flow_root=frames, store=False, on_error="skip")
    with pytest.warns(MMViewsWarning) as caught:
        sample = ds[0]
    # both the frames and the flow were unreadable: two warnings, both counted, one message each
    flow_message = f"{empty}: no flow_x_*.jpg / flow_y_*.jpg or flow_*.jpg images"
    assert [str(w.message) for w in caught] == [
        f"skipped unreadable {m} (sample left out of its batch; data.options.on_error: skip)"
        for m in (f"{empty}: no img_*.jpg frames", flow_message)]
    assert ds.num_skipped == 2 and not any(from_mmviews(w) for w in caught)
    assert sample[UNREADABLE] == f"{empty}: no img_*.jpg frames; {flow_message}"
    assert sample["modalities"] == {"video": None, "flow": None, "audio": None}


# --------------------------------------------------------------------------- flow images


def test_flow_xy_images_follow_the_frame_window(tmp_path):
    root, frames = frames_folder(tmp_path, 8)
    flows = tmp_path / "flow"
    # 7 flows (8 frames): u = 2 * k px for flow k (1-based), v = -5 px
    write_flow_xy(flows / "wave" / "clip1", [2.0 * k for k in range(1, 8)], -5.0, size=(4, 4))
    ds = VideoFolder(root, num_frames=4, size=8, frames_root=frames, flow_root=flows, audio=False, store=False)
    flow = ds[0]["modalities"]["flow"]
    assert flow.shape == (3, 2, 8, 8)
    # window of 8 frames, 4 taken: frames 2..5 (0-based) -> flows 2, 3, 4 (0-based) = u 6, 8, 10;
    # upscaled from 4 to 8 px, displacements double
    assert torch.allclose(flow[:, 0].mean(dim=(1, 2)), torch.tensor([12.0, 16.0, 20.0]), atol=0.5)
    assert torch.allclose(flow[:, 1], torch.full((3, 8, 8), -10.0), atol=0.5)


def test_flow_window_of_an_odd_remainder_and_three_channel_grey_images(tmp_path):
    root, frames = frames_folder(tmp_path, 9)
    flows = tmp_path / "flow"
    write_flow_xy(flows / "wave" / "clip1", [float(k) for k in range(1, 9)], 2.0, rgb=True)  # flow k: u = k px
    ds = VideoFolder(root, num_frames=4, size=8, frames_root=frames, flow_root=flows, audio=False, store=False)
    flow = ds[0]["modalities"]["flow"]
    # 9 frames, window 4: frames 2..5 (0-based; the odd frame left over goes after) -> flows 3, 4, 5 (1-based)
    assert flow.shape == (3, 2, 8, 8)
    assert torch.allclose(flow[:, 0].mean(dim=(1, 2)), torch.tensor([3.0, 4.0, 5.0]), atol=0.3)
    assert torch.allclose(flow[:, 1], torch.full((3, 8, 8), 2.0), atol=0.3)


def test_flow_short_clip_repeats_the_last_flow(tmp_path):
    root, frames = frames_folder(tmp_path, 3)
    flows = tmp_path / "flow"
    write_flow_xy(flows / "wave" / "clip1", [3.0, 7.0], 1.0)
    ds = VideoFolder(root, num_frames=5, size=8, frames_root=frames, flow_root=flows, audio=False, store=False)
    u = ds[0]["modalities"]["flow"][:, 0].mean(dim=(1, 2))
    assert torch.allclose(u, torch.tensor([3.0, 7.0, 7.0, 7.0]), atol=0.3)


@pytest.mark.parametrize("n_frames, num_frames, flows", [
    (5, 3, [2, 3]),  # frames 1..3 (0-based) -> flows 2, 3 (1-based)
    (9, 4, [3, 4, 5]),  # frames 2..5: the odd frame left over goes after the window
    (3, 5, [1, 2, 2, 2]),  # a clip shorter than the window: its last flow repeated
])
def test_three_channel_flow_images(tmp_path, n_frames, num_frames, flows):
    root, frames = frames_folder(tmp_path, n_frames)
    d = tmp_path / "flow" / "wave" / "clip1"
    d.mkdir(parents=True)
    for k in range(1, n_frames):  # flow k: u = k px (red), v = -k px (green), blue unused
        img = np.zeros((8, 8, 3), np.uint8)
        img[..., 0], img[..., 1], img[..., 2] = encode_flow_image(np.array(float(k))), encode_flow_image(
            np.array(-float(k))), 255
        Image.fromarray(img).save(d / f"flow_{k:05d}.jpg", quality=100)
    ds = VideoFolder(root, num_frames=num_frames, size=8, frames_root=frames, flow_root=tmp_path / "flow", audio=False,
                     store=False)
    flow = ds[0]["modalities"]["flow"]
    assert flow.shape == (num_frames - 1, 2, 8, 8)
    assert torch.allclose(flow[:, 0].mean(dim=(1, 2)), torch.tensor(flows, dtype=torch.float32), atol=0.5)
    assert torch.allclose(flow[:, 1].mean(dim=(1, 2)), -torch.tensor(flows, dtype=torch.float32), atol=0.5)


def test_builder_of_each_video_dataset(tmp_path):
    """The registry's ucf101 / hmdb51 entries (made by _video_builder at import, so called here
    directly): root required, split 'train' by default, the dataset's name and options passed on."""
    from mmviews.data.video import _video_builder

    root, frames = frames_folder(tmp_path, 3)
    build = _video_builder("hmdb51")
    with pytest.raises(ValueError) as err:
        build()
    assert str(err.value) == "hmdb51: pass root= the folder of class folders (see data_cards/hmdb51.md)"
    assert err.value.option == "root"
    ds = build(root, frames_root=frames, num_frames=3)
    assert (ds.root, ds.split, ds.dataset, ds.num_frames, ds.frames_root) == (root, "train", "hmdb51", 3, frames)
    assert build(root, "all", frames_root=frames).split == "all"


def test_farneback_flow_from_frame_images_and_none_without_frames(tmp_path):
    root, frames = one_clip_folder(tmp_path)
    d = frames / "wave" / "clip1"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    texture = np.kron(rng.integers(0, 256, (12, 12, 3)), np.ones((4, 4, 1))).astype(np.uint8)
    for i in range(4):  # the texture moves 1 px right per frame
        Image.fromarray(np.ascontiguousarray(texture[8:40, 8 - i:40 - i])).save(d / f"img_{i + 1:05d}.jpg",
                                                                                 quality=100)
    ds = VideoFolder(root, num_frames=4, size=32, frames_root=frames, flow="farneback", audio=False, store=False)
    flow = ds[0]["modalities"]["flow"]
    assert flow.shape == (3, 2, 32, 32)
    assert abs(float(flow[:, 0, 8:24, 8:24].median()) - 1.0) < 0.3
    assert abs(float(flow[:, 1, 8:24, 8:24].median())) < 0.3


# --------------------------------------------------------------------------- resizing


def test_resize_frames_and_flow():
    x = torch.rand(2, 3, 4, 6)
    assert resize_frames(x, (4, 6)) is x  # already that size: untouched
    y = resize_frames(torch.full((2, 3, 4, 6), 0.25), (8, 12))
    assert y.shape == (2, 3, 8, 12) and torch.allclose(y, torch.full_like(y, 0.25))
    flow = torch.stack([torch.full((4, 6), 1.0), torch.full((4, 6), -2.0)])[None].repeat(3, 1, 1, 1)
    assert resize_flow(flow, (4, 6)) is flow
    out = resize_flow(flow, (8, 18))  # heights x2, widths x3: u (x) scaled by 3, v (y) by 2
    assert out.shape == (3, 2, 8, 18)
    assert torch.allclose(out[:, 0], torch.full((3, 8, 18), 3.0)) and torch.allclose(out[:, 1], torch.full((3, 8, 18), -4.0))


# --------------------------------------------------------------------------- samples from video files

FPS = 10  # not the 25 fps a reader falls back to, so that a window placed at the wrong rate shows
RATE = 16000


def write_pcm_clip(path: Path, n_frames: int, audio: bool = True) -> np.ndarray:
    """An mpeg4 video at 10 fps (frame i a flat grey 20 * i + 10) with, when ``audio``, a mono
    PCM track at 16 kHz of the same length: a chirp, so that any two windows differ. PCM is
    stored as written: the track reads back as ``returned / 32768`` exactly."""
    import av

    n = n_frames * RATE // FPS
    t = np.arange(n) / RATE
    wave = (12000 * np.sin(2 * np.pi * (300 * t + 900 * t**2))).astype(np.int16)
    with av.open(str(path), "w") as out:
        video = out.add_stream("mpeg4", rate=FPS)
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        if audio:
            sound = out.add_stream("pcm_s16le", rate=RATE)
            sound.layout = "mono"
        for i in range(n_frames):
            img = np.full((32, 32, 3), 20 * i + 10, np.uint8)
            for packet in video.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
            lo, hi = i * RATE // FPS, (i + 1) * RATE // FPS  # interleaved with the frames, as real files are
            if audio:
                frame = av.AudioFrame.from_ndarray(wave[None, lo:hi].copy(), format="s16", layout="mono")
                frame.sample_rate, frame.pts, frame.time_base = RATE, lo, Fraction(1, RATE)
                for packet in sound.encode(frame):
                    out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
        if audio:
            for packet in sound.encode():
                out.mux(packet)
    return wave


def make_clips(base: Path, store: bool = False) -> dict[str, Path | np.ndarray]:
    """``ucf/`` (Jump: 10 frames with audio; Run: 10 frames silent), with its npy store (no flow,
    short side 16 px) when ``store``, and ``broken/``: the same two clips without a store, plus an
    unreadable one. Made inside each test (not a shared fixture): the work is then part of the
    test's own time, which mutmut's per-mutant time limit is computed from."""
    root = base / "ucf"
    (root / "Jump").mkdir(parents=True)
    (root / "Run").mkdir()
    wave = write_pcm_clip(root / "Jump" / "loud.avi", 10)
    write_pcm_clip(root / "Run" / "quiet.avi", 10, audio=False)
    if store:
        prepare_video_store(root, image_format="npy", size=16, flow=None, workers=0, progress=False)
    broken = base / "broken"
    shutil.copytree(root, broken)
    (broken / "Run" / "bad.avi").write_bytes(b"this is not a video")
    return {"root": root, "broken": broken, "wave": wave, "store": default_store_path(root)}


def lists(folder: Path, train: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainlist01.txt").write_text("".join(f"{rel}\n" for rel in train))
    return folder


def test_video_sample_frames_and_audio_window(tmp_path):
    clips = make_clips(tmp_path / "clips", store=True)
    root, wave = clips["root"], clips["wave"]
    for store in (False, True):  # decoded from the video, or read from the store: the same window
        ds = VideoFolder(root, "all", num_frames=4, size=16, max_audio_seconds=0.5, store=store)
        assert (ds.store is not None) == store
        sample = ds[0]
        assert sample["id"] == "Jump/loud.avi" and sample["labels"] == {"class": 0} and UNREADABLE not in sample
        # 10 frames, window 4: frames 3..6 (grey 70, 90, 110, 130; mpeg4 keeps a flat frame within a few levels)
        levels = grey_levels(sample["modalities"]["video"])
        assert all(abs(a - b) <= 4 for a, b in zip(levels, [70, 90, 110, 130], strict=True)), (store, levels)
        # frames from 0.3 s for 0.4 s: audio centred on 0.5 s, 0.5 s long -> samples 4000..12000
        audio = sample["modalities"]["audio"]
        assert audio.shape == (8000,) and audio.dtype == torch.float32
        assert torch.equal(audio, torch.from_numpy(wave[4000:12000] / 32768).float()), store
        assert ds[1]["modalities"]["audio"] is None  # no audio track: absent


def test_audio_window_shifted_inside_the_track(tmp_path):
    clips = make_clips(tmp_path / "clips")
    root, wave = clips["root"], clips["wave"]
    ds = VideoFolder(root, "all", num_frames=2, size=16, max_audio_seconds=5.0, store=False, decode="full")
    audio = ds[0]["modalities"]["audio"]
    assert torch.equal(audio, torch.from_numpy(wave / 32768).float())  # the whole 1 s track, not 5 s


def test_missing_and_unreadable_videos(tmp_path):
    clips = make_clips(tmp_path / "clips")
    broken = clips["broken"]
    ds = VideoFolder(broken, splits_dir=lists(tmp_path / "a", ["Run/bad.avi"]), size=16, store=False)
    with pytest.raises(ValueError) as err:
        ds[0]
    # PyAV's own error type, named as a ValueError with the file (it must survive a DataLoader worker)
    assert type(err.value) is ValueError and str(err.value).startswith(f"{broken / 'Run/bad.avi'}: cannot read (")
    assert err.value.__cause__ is not None and type(err.value.__cause__).__name__ in str(err.value)
    ds = VideoFolder(broken, splits_dir=lists(tmp_path / "b", ["Run/gone.avi"]), size=16, store=False)
    with pytest.raises(FileNotFoundError) as err:
        ds[0]
    assert str(err.value) == f"{broken / 'Run/gone.avi'}: listed in the split but missing"
    ds = VideoFolder(broken, splits_dir=lists(tmp_path / "c", ["Run/bad.avi"]), size=16, store=False, on_error="skip")
    with pytest.warns(MMViewsWarning) as caught:
        sample = ds[0]
    assert len(caught) == 1 and ds.num_skipped == 1  # the audio of a sample left out is not read
    message = sample[UNREADABLE]
    assert message.startswith(f"{broken / 'Run/bad.avi'}: cannot read (") and message.endswith(")")
    import av

    error_type = message.split("cannot read (", 1)[1].split(":", 1)[0]  # PyAV's error, by its class name
    assert issubclass(getattr(av.error, error_type), av.error.FFmpegError), error_type
    assert str(caught[0].message) == (f"skipped unreadable {message} (sample left out of its batch; "
                                      "data.options.on_error: skip)")
    assert not from_mmviews(caught[0])


def test_audio_of_a_clip_read_from_frame_images_needs_its_video(tmp_path):
    clips = make_clips(tmp_path / "clips")
    root = tmp_path / "ucf"
    (root / "Jump").mkdir(parents=True)
    write_frames(tmp_path / "frames" / "Jump" / "loud", [10, 20, 30])
    ds = VideoFolder(root, splits_dir=lists(tmp_path / "l", ["Jump/loud.avi"]), num_frames=2, size=8,
                     frames_root=tmp_path / "frames", on_error="skip")
    with pytest.warns(MMViewsWarning):
        sample = ds[0]
    assert sample[UNREADABLE] == f"{root / 'Jump/loud.avi'}: missing (needed for its audio track)"
    assert sample["modalities"]["video"] is not None and sample["modalities"]["audio"] is None
    shutil.copy(clips["root"] / "Jump" / "loud.avi", root / "Jump" / "loud.avi")
    # the frames come from the images (3 of them, at the default 25 fps): window 0..1, audio
    # centred on 0.04 s and shifted to the start of the track
    sample = VideoFolder(root, splits_dir=tmp_path / "l", num_frames=2, size=8, frames_root=tmp_path / "frames",
                         max_audio_seconds=0.25)[0]
    assert torch.equal(sample["modalities"]["audio"], torch.from_numpy(clips["wave"][:4000] / 32768).float())


def test_audio_present_anywhere(tmp_path):
    clips = make_clips(tmp_path / "clips", store=True)
    root, broken = clips["root"], clips["broken"]
    ds = VideoFolder(broken, splits_dir=lists(tmp_path / "a", ["Run/bad.avi", "Run/quiet.avi", "Jump/loud.avi"]),
                     size=16, store=False)
    assert ds.modality_present_anywhere("audio") is True  # after an unreadable and a silent clip
    assert ds.modality_present_anywhere("video") is None
    ds = VideoFolder(broken, splits_dir=lists(tmp_path / "b", ["Run/quiet.avi", "Run/bad.avi"]), size=16, store=False)
    assert ds.modality_present_anywhere("audio") is False
    ds = VideoFolder(broken, splits_dir=tmp_path / "a", size=16, store=False, audio=False)
    assert ds.modality_present_anywhere("audio") is None
    # from the store's record: the silent clip's entry, then the loud one's, videos not opened
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    for video in copy.glob("*/*.avi"):
        video.write_bytes(b"unreadable now")
    store = clips["store"]
    for expected, train in ((True, ["Run/quiet.avi", "Jump/loud.avi"]), (False, ["Run/quiet.avi"])):
        ds = VideoFolder(copy, splits_dir=lists(tmp_path / f"s{expected}", train), size=16, store=store)
        # the changed videos are no longer the store's (their entries are stale) ...
        with pytest.warns(MMViewsWarning, match="changed after the store"):
            assert ds.modality_present_anywhere("audio") is False
        ds = VideoFolder(root, splits_dir=tmp_path / f"s{expected}", size=16, store=store)
        for video in copy.glob("*/*.avi"):
            video.unlink()
        # ... but a store entry whose video is gone is all there is
        ds.root = copy
        assert ds.modality_present_anywhere("audio") is expected
        shutil.copytree(root, copy, dirs_exist_ok=True)
        for video in copy.glob("*/*.avi"):
            video.write_bytes(b"unreadable now")


def test_store_read_failure_names_the_store_folder(tmp_path):
    clips = make_clips(tmp_path / "clips", store=True)
    root = tmp_path / "ucf"
    shutil.copytree(clips["root"], root)
    store = tmp_path / "store"
    shutil.copytree(clips["store"], store)
    (store / "clips" / "Jump" / "loud" / "frames.npy").unlink()
    ds = VideoFolder(root, "all", num_frames=2, size=16, store=store)
    with pytest.raises(FileNotFoundError, match="frames.npy"):  # the store's own file, not the video
        ds[0]
    ds = VideoFolder(root, "all", num_frames=2, size=16, store=store, on_error="skip")
    with pytest.warns(MMViewsWarning, match="frames.npy"):
        assert str(store / "clips" / "Jump" / "loud") in ds[0][UNREADABLE]


def test_stale_store_entry_warns_once_and_counts_each(tmp_path):
    clips = make_clips(tmp_path / "clips", store=True)
    root = tmp_path / "ucf"
    shutil.copytree(clips["root"], root)
    store = clips["store"]
    ds = VideoFolder(root, "all", num_frames=2, size=16, store=store, audio=False)
    assert ds[0]["modalities"]["video"] is not None and ds.num_stale == 0  # a copy: same content, not stale
    for video in root.glob("*/*.avi"):
        write_pcm_clip(video, 12)  # the user replaced the videos
    with pytest.warns(MMViewsWarning) as caught:
        ds[0], ds[1], ds[0]
    assert ds.num_stale == 3
    assert [str(w.message) for w in caught] == [
        f"{root / 'Jump/loud.avi'} changed after the store {store} was made: decoding it instead "
        "(rerun `mmviews prepare` to update the store)"]
    assert not from_mmviews(caught[0])
    assert ds[1]["modalities"]["video"].shape == (2, 3, 16, 16)  # decoded from the new video


def test_store_size_warning_at_the_boundary(tmp_path):
    clips = make_clips(tmp_path / "clips", store=True)
    root, store = clips["root"], clips["store"]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        VideoFolder(root, "all", size=16, store=store)  # stored at 16 px: enough
        VideoFolder(root, "all", size=(16, 40), store=store)  # the short side counts
    with pytest.warns(MMViewsWarning) as caught:
        VideoFolder(root, "all", size=(17, 17), store=store)
    assert [str(w.message) for w in caught] == [
        f"the store {store} holds frames with a short side of 16 px, smaller than size=(17, 17): they are upscaled "
        "(prepare again with --size 17 or more for sharp frames)"]
    assert not from_mmviews(caught[0])


def test_which_store_a_dataset_reads(tmp_path):
    import json

    clips = make_clips(tmp_path / "clips", store=True)
    root, store = clips["root"], clips["store"]
    assert VideoFolder(root, "all", size=16).store.path == store  # True (the default): <root>.mmstore, found
    assert VideoFolder(root, "all", store=None).store is None and VideoFolder(root, "all", store=False).store is None
    other = tmp_path / "other.mmstore"
    shutil.copytree(store, other)
    assert VideoFolder(root, "all", size=16, store=str(other)).store.path == other  # a path names one
    assert VideoFolder(root, "all", size=16).excluded_list is None  # nothing left out: no list named
    # a store of frames as decoded (size 0) is never reported as too small; one of 1 px is
    manifest = json.loads((other / MANIFEST).read_text())
    manifest["options"]["size"] = 0
    (other / MANIFEST).write_text(json.dumps(manifest))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        VideoFolder(root, "all", size=64, store=other)
    manifest["options"]["size"] = 1
    (other / MANIFEST).write_text(json.dumps(manifest))
    with pytest.warns(MMViewsWarning, match="short side of 1 px, smaller than size=\\(2, 2\\)"):
        VideoFolder(root, "all", size=2, store=other)


def test_clips_the_store_found_unreadable_are_left_out(tmp_path):
    clips = make_clips(tmp_path / "clips")
    broken = tmp_path / "broken"
    shutil.copytree(clips["broken"], broken)
    summary = prepare_video_store(broken, image_format="npy", size=16, flow=None, workers=0, progress=False)
    message = summary["failed"]["Run/bad.avi"]
    ds = VideoFolder(broken, "all", size=16)
    assert [rel for _, rel in ds.clips] == ["Jump/loud.avi", "Run/quiet.avi"]
    assert ds.excluded == {"Run/bad.avi": f"failed: {message}"}
    assert ds.excluded_list == str(default_store_path(broken) / MANIFEST)
    assert VideoFolder(clips["broken"], "all", size=16).excluded == {}  # no store: nothing known
    with pytest.raises(ValueError) as err:
        VideoFolder(broken, splits_dir=lists(tmp_path / "l", ["Run/bad.avi"]), size=16)
    assert str(err.value) == (f"{broken}: every clip of split 'train' (fold 1) is listed as unreadable in "
                              f"{default_store_path(broken) / MANIFEST}") and err.value.option == "split"
    # frame images given: the store is not used, nothing is left out
    assert VideoFolder(broken, "all", size=16, frames_root=tmp_path).store is None


def test_scan_video_folder(tmp_path):
    clips = make_clips(tmp_path / "clips")
    broken = clips["broken"]
    (broken / "Run" / "notes.txt").write_text("not a clip")
    summary = scan_video_folder(broken)
    assert {k: summary[k] for k in ("classes", "clips", "with_audio")} == {"classes": 2, "clips": 3, "with_audio": 1}
    [line] = summary["unreadable"]
    assert line.startswith(f"{broken / 'Run/bad.avi'}: ") and "Error" in line.split(": ")[1]
    assert scan_video_folder(broken, extensions=(".mp4",)) == {"classes": 0, "clips": 0, "with_audio": 0,
                                                                "unreadable": []}


def test_frame_images_are_taken_as_25_fps_for_the_audio_window(tmp_path):
    clips = make_clips(tmp_path / "clips")
    root = tmp_path / "ucf"
    (root / "Jump").mkdir(parents=True)
    shutil.copy(clips["root"] / "Jump" / "loud.avi", root / "Jump" / "loud.avi")
    write_frames(tmp_path / "frames" / "Jump" / "loud", [5 * i for i in range(30)], size=(4, 4))
    ds = VideoFolder(root, "all", num_frames=2, size=4, frames_root=tmp_path / "frames", max_audio_seconds=0.25)
    # 30 images, window 2: frames 14, 15 from 14 / 25 s; centred on 0.6 s -> samples 7600..11600
    assert torch.equal(ds[0]["modalities"]["audio"], torch.from_numpy(clips["wave"][7600:11600] / 32768).float())


@pytest.mark.parametrize("decode", ["seek", "full"])
def test_decode_option_picks_the_reader(tmp_path, monkeypatch, decode):
    """``decode="seek"`` decodes only around the window (never the whole video or track);
    ``"full"`` decodes every frame and the whole track. Both give the same frames and samples."""
    clips = make_clips(tmp_path / "clips")
    from mmviews.data import video_io

    full_decodes = []
    real = video_io.read_video_frames
    monkeypatch.setattr(video_io, "read_video_frames", lambda path: full_decodes.append(path) or real(path))
    track = video_io.read_audio_track(clips["root"] / "Jump" / "loud.avi", 8000)  # the reference, read first
    real_track = video_io.read_audio_track
    monkeypatch.setattr(video_io, "read_audio_track", lambda *a, **k: full_decodes.append(a[0]) or real_track(*a, **k))
    ds = VideoFolder(clips["root"], "all", num_frames=4, size=16, sample_rate=8000, max_audio_seconds=0.5, store=False,
                     decode=decode)
    sample = ds[0]["modalities"]
    levels = grey_levels(sample["video"])
    assert all(abs(a - b) <= 4 for a, b in zip(levels, [70, 90, 110, 130], strict=True)), levels
    # at 8 kHz: frames from 0.3 s, audio centred on 0.5 s, 0.5 s long -> samples 2000..6000
    assert torch.equal(sample["audio"], torch.from_numpy(track[2000:6000]))
    assert len(full_decodes) == (2 if decode == "full" else 0)  # frames and audio decoded whole, or neither


def test_audio_window_of_one_sample_and_of_none(tmp_path):
    clips = make_clips(tmp_path / "clips")
    one = VideoFolder(clips["root"], "all", num_frames=4, size=16, max_audio_seconds=1 / 16000, store=False)
    assert one[0]["modalities"]["audio"].shape == (1,)
    none = VideoFolder(clips["root"], "all", num_frames=4, size=16, max_audio_seconds=0, store=False)
    assert none[0]["modalities"]["audio"] is None  # no samples: absent, not an empty waveform


def test_resize_flow_is_bilinear_on_pixel_centres():
    # u = the x coordinate on 4 columns, upscaled to 8: output column c samples x = (c + 0.5) / 2 - 0.5
    # (pixel centres, clamped to the edge columns), then the displacement doubles with the width
    u = torch.arange(4.0).view(1, 1, 1, 4).expand(1, 1, 3, 4)
    flow = torch.cat([u, torch.zeros(1, 1, 3, 4)], dim=1)
    out = resize_flow(flow, (3, 8))
    expected = [2 * min(max((c + 0.5) / 2 - 0.5, 0.0), 3.0) for c in range(8)]
    assert torch.allclose(out[0, 0, 1], torch.tensor(expected), atol=1e-6), out[0, 0, 1]
    assert torch.equal(out[:, 1], torch.zeros(1, 3, 8))


def test_resize_frames_antialiases_when_shrinking():
    # a one-pixel checkerboard shrunk 3x: plain bilinear would pick single pixels (0 or 1);
    # antialiased, each output pixel averages its 3 x 3 block and beyond, near the mean 0.5
    board = ((torch.arange(9).view(9, 1) + torch.arange(9).view(1, 9)) % 2).float()
    out = resize_frames(board.expand(1, 3, 9, 9).contiguous(), (3, 3))
    assert out.shape == (1, 3, 3, 3) and float((out - 0.5).abs().max()) < 0.2


def test_scan_shows_progress_named_after_the_folder(tmp_path, capsys):
    clips = make_clips(tmp_path / "clips")
    scan_video_folder(clips["root"])
    err = capsys.readouterr().err
    assert "scanning ucf: 100%" in err and " 2/2 " in err and "clip/s]" in err


def test_frames_stay_within_zero_one_exactly(tmp_path):
    root, frames = one_clip_folder(tmp_path)
    write_frames(frames / "wave" / "clip1", [255, 255], size=(9, 9))
    ds = VideoFolder(root, num_frames=2, size=9, frames_root=frames, audio=False, store=False)
    assert torch.equal(ds[0]["modalities"]["video"], torch.ones(2, 3, 9, 9))  # 255 is 1.0, not 255 / 256
    # shrinking 9 -> 3 px sums weights that round to a hair above 1 (1 + 2**-23): clamped back
    ds = VideoFolder(root, num_frames=2, size=3, frames_root=frames, audio=False, store=False)
    assert float(ds[0]["modalities"]["video"].max()) == 1.0


def test_grey_frame_images_give_three_channels(tmp_path):
    root, frames = one_clip_folder(tmp_path)
    d = frames / "wave" / "clip1"
    d.mkdir(parents=True)
    for i in range(1, 4):
        Image.fromarray(np.full((8, 8), 51 * i, np.uint8)).save(d / f"img_{i:05d}.jpg", quality=100)  # mode L
    video = VideoFolder(root, num_frames=3, size=8, frames_root=frames, audio=False, store=False)[0]["modalities"]["video"]
    assert video.shape == (3, 3, 8, 8)
    assert torch.allclose(video, torch.tensor([0.2, 0.4, 0.6]).view(3, 1, 1, 1).expand(3, 3, 8, 8), atol=1 / 255)


def test_farneback_flow_comes_from_the_store_when_it_has_one(tmp_path):
    clips = make_clips(tmp_path / "clips")
    root = clips["root"]
    prepare_video_store(root, image_format="npy", size=16, workers=0, progress=False)  # with Farneback flow
    stored = default_store_path(root) / "clips" / "Jump" / "loud" / "flow.npy"
    marker = np.full(np.load(stored).shape, 200, np.uint8)  # 200 -> 200 * 40 / 255 - 20 = 11.37 px everywhere
    np.save(stored, marker)
    write_pcm_clip(root / "Run" / "late.avi", 10)  # added after the store was made: not in it
    ds = VideoFolder(root, "all", num_frames=4, size=16, flow="farneback", audio=False)
    flow = ds[0]["modalities"]["flow"]
    assert flow.shape == (3, 2, 16, 16) and torch.allclose(flow, torch.full_like(flow, 200 * 40 / 255 - 20))
    late = ds[1]["modalities"]["flow"]  # computed from its decoded frames (flat frames: no motion)
    assert ds.clips[1][1] == "Run/late.avi" and late.shape == (3, 2, 16, 16) and float(late.abs().max()) < 1
    stored.unlink()
    with pytest.raises(FileNotFoundError, match="flow.npy"):  # the store's own file is named
        ds[0]
    # a store without flow: computed from the frames it holds
    clips = make_clips(tmp_path / "again", store=True)  # store made with flow=None
    ds = VideoFolder(clips["root"], "all", num_frames=4, size=16, flow="farneback", audio=False)
    flow = ds[0]["modalities"]["flow"]
    assert flow.shape == (3, 2, 16, 16) and float(flow.abs().max()) < 1


def test_farneback_flow_of_an_unreadable_video_is_not_a_second_failure(tmp_path):
    clips = make_clips(tmp_path / "clips")
    ds = VideoFolder(clips["broken"], splits_dir=lists(tmp_path / "l", ["Run/bad.avi"]), num_frames=4, size=16,
                     flow="farneback", store=False, on_error="skip")
    with pytest.warns(MMViewsWarning) as caught:
        sample = ds[0]
    assert len(caught) == 1 and ds.num_skipped == 1 and "; " not in sample[UNREADABLE]
    assert sample["modalities"] == {"video": None, "flow": None, "audio": None}
