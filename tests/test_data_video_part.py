"""Video folders (UCF-101 / HMDB-51 layouts): PyAV frames and audio, flow images, bad files."""

from fractions import Fraction

import numpy as np
import pytest
import torch
from PIL import Image

from mmviews.data import ViewSetCollator, ViewSpec, build_dataset
from mmviews.data.video import decode_flow_image, encode_flow_image


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
