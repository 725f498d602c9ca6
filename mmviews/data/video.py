"""Video folders in the UCF-101 / HMDB-51 layout: frames, optical flow and the audio track.

Layout (``data_cards/ucf101.md``, ``data_cards/hmdb51.md``)::

    root/ClassName/clip.avi                       one folder per class
    splits_dir/trainlist01.txt, testlist01.txt    UCF-101 ("Class/clip.avi [label]"), classInd.txt
    splits_dir/<class>_test_split1.txt            HMDB-51 ("clip.avi 1|2|0": train|test|unused)
    frames_root/ClassName/clip/img_00001.jpg      optional precomputed frames
    flow_root/ClassName/clip/flow_x_00001.jpg     optional TV-L1 flow (or flow_y_, or 3-channel flow_00001.jpg)
    <root>.mmstore/                               optional store of frames + flow made by ``mmviews prepare``
                                                  (:mod:`mmviews.data.video_store`), used when present

Flow images store ``(f + 20) * 255 / 40`` as uint8 after clipping f to +-20 px; they are
decoded back to pixels. Frames and audio are decoded with PyAV (only the clip's window of
each, found by seeking, :mod:`mmviews.data.video_io`); a clip without an audio stream gives
``audio = None`` (absent, never silence).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

# The file-level readers live in decode and video_io (shared with the prepared store); the names
# are imported here too so that ``mmviews.data.video.read_video_frames`` etc. keep working.
from mmviews.data.decode import (  # noqa: F401
    FLOW_BOUND,
    decode_flow_image,
    encode_flow_image,
    read_image as _read_image,
)
from mmviews.data.registry import dataset_error, dataset_folder, register_dataset
from mmviews.data.video_io import (  # noqa: F401
    VIDEO_EXTENSIONS,
    farneback_flow,
    read_audio_track,
    read_audio_window,
    read_video_frames,
    read_video_window,
)
from mmviews.data.video_store import MANIFEST, VideoStore, known_bad_clips
from mmviews.notices import MMViewsWarning

# The key a sample dict carries when its clip could not be read with on_error="skip": the
# message naming the file. The collator leaves such a sample out of its batch (counted in
# ``ViewBatch.dropped``), so it never enters training or evaluation as an all-absent sample.
UNREADABLE = "unreadable"


# Each dataset's own split files and the folder names its archive unpacks them to: a dataset
# looks only for its own, so UCF-101 and HMDB-51 side by side in one parent folder (the common
# /data layout) do not read each other's lists.
SPLIT_FILES = {"ucf101": ("trainlist0*.txt", "testlist0*.txt"), "hmdb51": ("*_test_split*.txt",)}
SPLIT_FOLDERS = {"ucf101": ("ucfTrainTestlist",), "hmdb51": ("testTrainMulti_7030_splits",)}


def find_splits_dir(root: Path, dataset: str | None = None) -> Path:
    """The folder holding ``dataset``'s split lists (either dataset's when None): the first of
    ``root``, ``root/<archive folder>``, ``root/splits``, ``root/../<archive folder>`` that has
    them, else ``root`` (:func:`parse_split` then names the files it expected)."""
    names = SPLIT_FOLDERS.get(dataset or "", SPLIT_FOLDERS["ucf101"] + SPLIT_FOLDERS["hmdb51"])
    patterns = SPLIT_FILES.get(dataset or "", SPLIT_FILES["ucf101"] + SPLIT_FILES["hmdb51"])
    for cand in (root, *(root / n for n in names), root / "splits", *(root.parent / n for n in names)):
        if cand.is_dir() and any(any(cand.glob(pattern)) for pattern in patterns):
            return cand
    return root


def parse_split(root: Path, splits_dir: Path, split: str, fold: int, dataset: str | None = None) -> list[tuple[str, str]]:
    """``[(class name, relative clip path)]`` of one official split: UCF-101's lists
    (``dataset="ucf101"``), HMDB-51's (``"hmdb51"``), or whichever ``splits_dir`` has (None)."""
    if split == "all":
        clips = []
        for cls in sorted(p for p in root.iterdir() if p.is_dir()):
            clips += [(cls.name, f"{cls.name}/{f.name}") for f in sorted(cls.iterdir()) if f.suffix.lower() in VIDEO_EXTENSIONS]
        return clips
    if split not in ("train", "test"):
        raise dataset_error(ValueError, f"video folders have splits 'train', 'test' (official lists) or 'all', got {split!r}",
                            "split")
    ucf = splits_dir / f"{split}list{fold:02d}.txt"
    if dataset != "hmdb51" and ucf.is_file():
        out = []
        for line in ucf.read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            rel = line.split()[0].replace("\\", "/")
            out.append((rel.split("/")[0], rel))
        return out
    hmdb = sorted(splits_dir.glob(f"*_test_split{fold}.txt")) if dataset != "ucf101" else []
    if hmdb:
        want = "1" if split == "train" else "2"
        out = []
        for f in hmdb:
            cls = re.sub(rf"_test_split{fold}\.txt$", "", f.name)
            for line in f.read_text().splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[1] == want:
                    out.append((cls, f"{cls}/{parts[0]}"))
        return out
    expected = {"ucf101": f"{ucf.name} (UCF-101)", "hmdb51": f"*_test_split{fold}.txt (HMDB-51)"}
    wanted = " or ".join(v for k, v in expected.items() if dataset in (None, k))
    raise FileNotFoundError(f"no split list for split {split!r} fold {fold} in {splits_dir}: expected {wanted} "
                            "(splits_dir= / --splits-dir names the folder); use split='all' to take every clip")


def clip_window(n: int, num_frames: int) -> np.ndarray:
    """Indices of the ``num_frames`` consecutive frames taken from the middle of a clip of ``n``
    frames; a shorter clip repeats its last frame."""
    T = min(num_frames, n)
    start = (n - T) // 2
    return np.clip(np.arange(start, start + num_frames), 0, n - 1)


def audio_window_start(start_time: float, num_frames: int, fps: float, seconds: float, sample_rate: int) -> tuple[int, int]:
    """``(first sample, length)`` of the audio window: ``seconds`` centred on the frame window
    that starts at ``start_time`` (before shifting to fit inside the track)."""
    n = int(seconds * sample_rate)
    centre = int((start_time + num_frames / (2 * fps)) * sample_rate)
    return centre - n // 2, n


class VideoFolder(Dataset):
    """Clips of a UCF-101 / HMDB-51 style folder as sample dicts.

    Modalities: ``video`` FloatTensor[T, 3, H, W] in [0, 1] (T = ``num_frames`` consecutive
    frames from the middle of the clip, resized to ``size``); ``flow`` FloatTensor[T - 1, 2, H, W]
    in pixels when ``flow`` is ``"precomputed"`` (images under ``flow_root``) or ``"farneback"``
    (OpenCV, computed from the decoded frames); with ``"raft"`` the flow sample is the clip's frames
    (``[T, 3, H, W]``, the video's), turned into flow by RAFT on the training device in the step
    (``raft_*`` options: :mod:`mmviews.modalities.device_flow`), so the loader only decodes; ``audio`` FloatTensor[S] mono at
    ``sample_rate`` (at most ``max_audio_seconds`` around the frames) or None for a clip without
    an audio track. Labels: ``class`` (index in ``self.classes``).

    ``on_error="raise"`` raises a ValueError naming the file that cannot be read;
    ``"skip"`` warns with the file name, counts it in ``self.num_skipped`` (per process) and
    marks the sample ``"unreadable"`` (the message): :class:`~mmviews.data.views.ViewSetCollator`
    drops it from its batch (counted there), it is not a sample with every modality absent.

    Clips the prepared store's manifest records as bad (``failed``, see
    :func:`~mmviews.data.video_store.known_bad_clips`) are left out of the split when the store is
    used: ``self.excluded`` ``{clip: reason}``, listed in ``self.excluded_list`` (the manifest).

    Where frames come from, first match wins: ``frames_root`` images; the prepared store
    (``store``: True looks for ``<root>.mmstore`` made by ``mmviews prepare``, a path names one,
    False/None never uses one; a clip missing from it, or whose video changed since, is decoded
    instead); the video file, decoded with ``decode="seek"`` (only the frames of the window, see
    :func:`mmviews.data.video_io.read_video_window`) or ``"full"`` (every frame, the old path).
    With ``flow="farneback"`` a store's flow is used when it has one (computed at the store's
    size, stored as uint8 +-20 px), else Farneback runs on the frames read.
    """

    def __init__(self, root: str | os.PathLike[str], split: str = "train", *, dataset: str | None = None, fold: int = 1,
                 splits_dir: str | os.PathLike[str] | None = None, num_frames: int = 8, size: int | tuple[int, int] = 112,
                 frames_root: str | os.PathLike[str] | None = None, flow_root: str | os.PathLike[str] | None = None,
                 flow: str | None = None, audio: bool = True, sample_rate: int = 16000, max_audio_seconds: float = 5.0,
                 on_error: str = "raise", decode: str = "seek", store: bool | str | os.PathLike[str] | None = True,
                 raft_model: str | None = None, raft_weights: str | None = None, raft_weights_sha256: str | None = None,
                 raft_iterations: int | None = None, raft_pairs_per_call: int | None = None) -> None:
        self.root = dataset_folder(root, "a folder of class folders of videos")
        if not self.root.is_dir():
            raise FileNotFoundError(f"no such video folder: {self.root}")
        if on_error not in ("raise", "skip"):
            raise dataset_error(ValueError, f"on_error must be 'raise' or 'skip', got {on_error!r}", "on_error")
        if decode not in ("seek", "full"):
            raise dataset_error(ValueError, f"decode must be 'seek' or 'full', got {decode!r}", "decode")
        if flow is None and flow_root is not None:
            flow = "precomputed"
        if flow not in (None, "precomputed", "farneback", "raft"):
            raise dataset_error(ValueError, f"flow must be None, 'precomputed', 'farneback' or 'raft', got {flow!r}", "flow")
        raft = {"raft_model": raft_model, "raft_weights": raft_weights, "raft_weights_sha256": raft_weights_sha256,
                "raft_iterations": raft_iterations, "raft_pairs_per_call": raft_pairs_per_call}
        if flow != "raft" and any(v is not None for v in raft.values()):
            given = sorted(k for k, v in raft.items() if v is not None)
            raise dataset_error(ValueError, f"{', '.join(given)} apply with flow='raft', got flow={flow!r}", given[0])
        if flow == "raft":  # the options' own check (the step's RAFT reads them, mmviews.modalities.device_flow)
            from mmviews.data.flow_options import RAFTOptions

            RAFTOptions.from_data_options({"flow": "raft", **raft})
        if flow == "precomputed" and flow_root is None:
            raise dataset_error(ValueError, "flow='precomputed' needs flow_root", "flow_root")
        if num_frames < 2 and flow is not None:
            raise dataset_error(ValueError, "flow needs num_frames >= 2", "num_frames")
        self.dataset = dataset
        self.num_frames = int(num_frames)
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.frames_root = Path(frames_root) if frames_root is not None else None
        self.flow_root = Path(flow_root) if flow_root is not None else None
        self.flow = flow
        self.audio = audio
        self.sample_rate = int(sample_rate)
        self.max_audio_seconds = float(max_audio_seconds)
        self.on_error = on_error
        self.num_skipped = 0
        self.decode = decode
        self.store: VideoStore | None = None
        if frames_root is None and store is not None and store is not False:
            self.store = VideoStore.find(self.root) if store is True else VideoStore(store)
        self.num_stale = 0  # clips decoded because their video changed after the store was made (per process)
        if splits_dir is not None and not Path(splits_dir).is_dir():
            raise dataset_error(ValueError, f"splits_dir {splits_dir}: no such folder", "splits_dir")
        sdir = Path(splits_dir) if splits_dir is not None else find_splits_dir(self.root, dataset)
        self.splits_dir = None if split == "all" else sdir  # the split lists read (None: every clip of the folder)
        self.split = split
        self.clips = parse_split(self.root, sdir, split, fold, dataset)
        if not self.clips:
            raise dataset_error(ValueError, f"{self.root}: split {split!r} (fold {fold}) lists no clips", "split")
        # Clips `mmviews prepare` found unreadable: left out before training, not decoded again.
        self.excluded: dict[str, str] = {}
        self.excluded_list: str | None = None
        if self.store is not None:
            bad = known_bad_clips(self.store.path)
            self.excluded = {rel: bad[rel] for _, rel in self.clips if rel in bad}
            if self.excluded:
                self.clips = [(cls, rel) for cls, rel in self.clips if rel not in self.excluded]
                self.excluded_list = str(self.store.path / MANIFEST)
                if not self.clips:
                    raise dataset_error(ValueError, f"{self.root}: every clip of split {split!r} (fold {fold}) is "
                                        f"listed as unreadable in {self.excluded_list}", "split")
        class_ind = sdir / "classInd.txt"
        if dataset != "hmdb51" and class_ind.is_file():  # UCF-101's class order; HMDB-51 has none
            pairs = [ln.split() for ln in class_ind.read_text().splitlines() if ln.strip()]
            self.classes = [name for _, name in sorted(pairs, key=lambda p: int(p[0]))]
        else:
            self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.class_to_index = {c: i for i, c in enumerate(self.classes)}
        unknown = sorted({c for c, _ in self.clips if c not in self.class_to_index})
        if unknown:
            raise ValueError(f"{self.root}: split lists name classes without a folder: {unknown[:5]}")
        if self.store is not None and 0 < int(self.store.options["size"]) < min(self.size):
            warnings.warn(f"the store {self.store.path} holds frames with a short side of {self.store.options['size']} px, "
                          f"smaller than size={self.size}: they are upscaled (prepare again with --size "
                          f"{min(self.size)} or more for sharp frames)", MMViewsWarning, stacklevel=2)

    @property
    def source_note(self) -> str:
        """One line saying what was read: the folder and the split lists (printed at train start)."""
        lists = f"split lists from {self.splits_dir}" if self.splits_dir is not None else "every clip (split 'all')"
        return f"{self.dataset or 'video folder'} {self.root}: {len(self.clips)} clips, {lists}"

    def __len__(self) -> int:
        return len(self.clips)

    def modality_info(self) -> dict[str, dict[str, Any]]:
        H, W = self.size
        info: dict[str, dict[str, Any]] = {"video": {"kind": "video", "shape": (self.num_frames, 3, H, W)}}
        if self.flow == "raft":  # the frames, turned into flow in the step (mmviews.modalities.device_flow)
            info["flow"] = {"kind": "flow_frames", "shape": (self.num_frames, 3, H, W)}
        elif self.flow is not None:
            info["flow"] = {"kind": "flow", "shape": (self.num_frames - 1, 2, H, W)}
        if self.audio:
            info["audio"] = {"kind": "waveform", "shape": (None,), "sample_rate": self.sample_rate}
        return info

    @property
    def drops_unreadable_samples(self) -> bool:
        """True with ``on_error="skip"``: a sample that cannot be read is dropped from its batch."""
        return self.on_error == "skip"

    def modality_present_anywhere(self, modality: str) -> bool | None:
        """Whether some clip of the split has ``modality``; only answered for ``audio`` (None
        otherwise): the store's record of each clip's audio track when it has the clip, else the
        container's streams (opened, not decoded), stopping at the first clip that has one.
        Unreadable clips count as not having it."""
        if modality != "audio" or not self.audio:
            return None
        import av

        for _, rel in self.clips:
            path = self.root / rel
            entry = self._store_entry(rel, path)  # None without a store
            if entry is not None:
                if entry.get("audio"):
                    return True
                continue
            try:
                with av.open(str(path)) as container:
                    if container.streams.audio:
                        return True
            except Exception:  # PyAV raises its own types; an unreadable clip has no audio to offer
                continue
        return False

    def _fail(self, path: Path, err: Exception) -> str:
        """Raise (``on_error="raise"``), or warn and return the message (``"skip"``)."""
        # Our own errors name the file already; any other (PyAV's, OpenCV's) is named here, as a
        # ValueError: its own type may not survive the trip out of a DataLoader worker.
        ours = type(err) in (ValueError, FileNotFoundError) and str(path) in str(err)
        if self.on_error == "raise":
            if ours:
                raise err
            raise ValueError(f"{path}: cannot read ({type(err).__name__}: {err})") from err
        self.num_skipped += 1
        message = str(err) if ours else f"{path}: cannot read ({type(err).__name__}: {err})"
        warnings.warn(f"skipped unreadable {message} (sample left out of its batch; data.options.on_error: skip)",
                      MMViewsWarning, stacklevel=3)
        return message

    def _window(self, n: int) -> np.ndarray:
        return clip_window(n, self.num_frames)

    def _resize(self, x: torch.Tensor) -> torch.Tensor:
        return resize_frames(x, self.size)

    def __getitem__(self, index: int) -> dict[str, Any]:
        cls, rel = self.clips[index]
        path = self.root / rel
        stem = Path(rel).stem
        mods: dict[str, Any] = {"video": None}
        if self.flow is not None:
            mods["flow"] = None
        if self.audio:
            mods["audio"] = None
        # Set by the frame reading below; when it fails the sample is left out before its audio
        # (the only reader of start_time) and frames_np is None.
        frames_np: np.ndarray | None
        fps = 25.0  # frame images carry no rate: taken as 25 fps for the audio window
        start_time: float
        entry = self._store_entry(rel, path)
        source = path if self.frames_root is None else self.frames_root / cls / stem  # named when reading fails
        failures: list[str] = []  # with on_error="skip": what could not be read
        try:
            if self.frames_root is not None:
                d = self.frames_root / cls / stem
                files = sorted(d.glob("img_*.jpg"))
                if not files:
                    raise FileNotFoundError(f"{d}: no img_*.jpg frames")
                idx = self._window(len(files))
                frames_np = np.stack([_read_image(files[i], "RGB") for i in idx])
            elif entry is not None:
                assert self.store is not None
                source = self.store.folder(entry)
                idx = self._window(int(entry["frames"]))
                frames_np = self.store.read_frames(entry, idx)
                fps = float(entry["fps"])
            else:
                if not path.is_file():
                    raise FileNotFoundError(f"{path}: listed in the split but missing")
                frames_np, idx, fps = read_video_window(path, self._window, seek=self.decode == "seek")
            start_time = float(idx[0]) / fps
            video = torch.from_numpy(frames_np).permute(0, 3, 1, 2).float().div_(255.0)
            mods["video"] = self._resize(video).clamp_(0, 1)
        except Exception as err:
            failures.append(self._fail(source, err))
            frames_np = None
        if self.flow == "raft":
            mods["flow"] = mods["video"]  # the same frames (None when unreadable): RAFT runs in the step
        elif self.flow is not None:
            try:
                if self.flow == "farneback" and entry is not None and self.store is not None and self.store.has_flow:
                    source = self.store.folder(entry)
                    # Stored flow of the same frame window (computed at the store's size).
                    mods["flow"] = self._resize_flow(torch.from_numpy(
                        self.store.read_flow(entry, self._window(int(entry["frames"])))))
                else:
                    source = (self.flow_root / cls / stem) if self.flow_root else path
                    mods["flow"] = self._flow(cls, stem, frames_np)
            except Exception as err:
                failures.append(self._fail(source, err))
        if self.audio and not failures:  # a sample already left out needs no audio
            try:
                if not path.is_file():
                    raise FileNotFoundError(f"{path}: missing (needed for its audio track)")
                # Up to max_audio_seconds centred on the frame window, shifted to fit inside the
                # track; only that part is decoded (all of it with decode="full").
                first, n = audio_window_start(start_time, self.num_frames, fps, self.max_audio_seconds, self.sample_rate)
                wav = read_audio_window(path, first, n, self.sample_rate, seek=self.decode == "seek")
                if wav is not None and wav.size > 0:
                    mods["audio"] = torch.from_numpy(wav)
            except Exception as err:
                failures.append(self._fail(path, err))
        sample = {"index": index, "id": rel, "modalities": mods, "labels": {"class": self.class_to_index[cls]}}
        if failures:
            sample[UNREADABLE] = "; ".join(failures)
        return sample

    def _store_entry(self, rel: str, path: Path) -> dict[str, Any] | None:
        """The store's entry of clip ``rel`` when it is there and its video unchanged, else None."""
        if self.store is None:
            return None
        entry, stale = self.store.lookup(rel, path)
        if stale:
            self.num_stale += 1
            if self.num_stale == 1:  # once per process: the count is in self.num_stale
                warnings.warn(f"{path} changed after the store {self.store.path} was made: decoding it instead "
                              "(rerun `mmviews prepare` to update the store)", MMViewsWarning, stacklevel=3)
        return entry

    def _flow(self, cls: str, stem: str, frames_np: np.ndarray | None) -> torch.Tensor | None:
        if self.flow == "farneback":
            if frames_np is None:
                return None
            flow = torch.from_numpy(farneback_flow(frames_np))
        else:
            assert self.flow_root is not None
            d = self.flow_root / cls / stem
            xs = sorted(d.glob("flow_x_*.jpg"))
            if xs:
                ys = [d / f.name.replace("flow_x_", "flow_y_") for f in xs]
                n = len(xs)
                idx = self._window(n + 1)[:-1].clip(0, n - 1)
                u = np.stack([_read_image(xs[i], "L") for i in idx])
                v = np.stack([_read_image(ys[i], "L") for i in idx])
                flow_np = np.stack([u, v], axis=1)
            else:
                fs = sorted(d.glob("flow_*.jpg"))
                if not fs:
                    raise FileNotFoundError(f"{d}: no flow_x_*.jpg / flow_y_*.jpg or flow_*.jpg images")
                idx = self._window(len(fs) + 1)[:-1].clip(0, len(fs) - 1)
                flow_np = np.stack([_read_image(fs[i], "RGB")[..., :2] for i in idx]).transpose(0, 3, 1, 2)
            flow = torch.from_numpy(decode_flow_image(flow_np))
        return self._resize_flow(flow)

    def _resize_flow(self, flow: torch.Tensor) -> torch.Tensor:
        return resize_flow(flow, self.size)


def resize_frames(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Frames ``[T, 3, h, w]`` resized to ``size`` (antialiased), unchanged when already that size."""
    from torchvision.transforms.v2 import functional as F

    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.resize(x, list(size), antialias=True)


def resize_flow(flow: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``[T, 2, h, w]`` pixels -> ``[T, 2, H, W]`` at ``size``, displacements scaled by ``W / w``, ``H / h``."""
    H, W = flow.shape[-2:]
    if (H, W) != tuple(size):
        import torch.nn.functional as TF

        flow = TF.interpolate(flow, size=tuple(size), mode="bilinear", align_corners=False)
        flow = flow * torch.tensor([size[1] / W, size[0] / H]).view(1, 2, 1, 1)
    return flow


def scan_video_folder(root: str | os.PathLike[str], extensions: Sequence[str] = VIDEO_EXTENSIONS) -> dict[str, Any]:
    """Count classes, clips and clips with an audio stream (for ``mmviews prepare``)."""
    import av
    from tqdm.auto import tqdm

    root = Path(root)
    clips = [p for p in sorted(root.glob("*/*")) if p.suffix.lower() in tuple(extensions)]
    with_audio, unreadable = 0, []
    for p in tqdm(clips, desc=f"scanning {root.name}", unit="clip"):
        try:
            with av.open(str(p)) as c:
                with_audio += bool(c.streams.audio)
        except Exception as err:  # av raises its own error types per container problem
            unreadable.append(f"{p}: {type(err).__name__}: {err}")
    return {"classes": len({p.parent.name for p in clips}), "clips": len(clips), "with_audio": with_audio,
            "unreadable": unreadable}


def _video_builder(dataset: str) -> Callable[..., Dataset]:
    """``build_dataset`` entry for one of the video-folder datasets (``root`` is required)."""

    def build(root: Any = None, split: str = "train", **options: Any) -> Dataset:
        if root is None:
            raise dataset_error(ValueError, f"{dataset}: pass root= the folder of class folders (see data_cards/{dataset}.md)",
                                "root")
        return VideoFolder(root, split=split, dataset=dataset, **options)

    return build


register_dataset("ucf101", "UCF-101 video folder with split lists: frames, flow images, audio track",
                 options_from=[VideoFolder])(_video_builder("ucf101"))
register_dataset("hmdb51", "HMDB-51 video folder with split lists: frames, flow images",
                 options_from=[VideoFolder])(_video_builder("hmdb51"))
