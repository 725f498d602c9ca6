"""The prepared video store: frames and optical flow of every clip, extracted once.

Decoding a video and computing flow for every sample is what limits training on video folders,
so ``mmviews prepare ucf101|hmdb51 ROOT`` (:func:`prepare_video_store`) does it once, in worker
processes, into a store folder (default ``<ROOT>.mmstore``) that :class:`VideoStore` reads back and
the video datasets use when it exists. A prepare is safe to kill and rerun: each clip is written
under a temporary name and renamed when complete, the manifest's journal keeps every finished clip,
workers die with the prepare, and a rerun redoes only clips whose source or options changed.
Clips that cannot be read, are truncated or are too short are recorded under the manifest keys
training reads; mmviews deletes only what the manifest says it wrote. The layout, the options,
the bad-clip keys and the rules are in ``data_cards/ucf101.md`` ("The prepared store").
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from mmviews.data.decode import encode_flow_image, read_jpeg, window_flow
from mmviews.data.video_io import (
    DEFAULT_FPS,
    farneback_pair,
    list_video_clips,
    to_gray,
)
from mmviews.fileio import atomic_write_text, disk_full_error, folder_bytes, full_device, read_json_object

STORE_KIND = "mmviews-video-store"
STORE_VERSION = 1
MANIFEST = "manifest.json"
JOURNAL = "manifest.journal"
REPORT_FILE = "prepare-report.json"  # written by `mmviews prepare`: every clip it left out, and why
CLIP_ENTRY = "clip.json"
CLIPS_DIR = "clips"
TMP_PREFIX = ".mmviews-tmp-"
LOCK_FILE = ".mmviews-lock"
FORMATS = ("jpeg", "npy")
FLOW_METHODS = ("farneback",)
# Any file name a clip folder of ours can hold (used for temporary folders, whose entry may be
# missing; complete clip folders are cleaned by the names their entry accounts for).
_OUR_FILE = re.compile(r"clip\.json|frames\.npy|flow\.npy|img_\d{5,}\.jpg|flow_[xy]_\d{5,}\.jpg")
_MANIFEST_SAVE_S = 10.0  # seconds between manifest saves during a prepare (the journal keeps up in between)
# A container may state a frame or two more than decode (encoder delay, packed B-frames in AVI):
# only a larger shortfall marks a clip truncated.
TRUNCATION_TOLERANCE = 2
# Bytes hashed at each end of a video for its content fingerprint: the container header (frame
# count, index) and the end (the AVI index, the last frames) change with any re-encode or cut.
FINGERPRINT_BYTES = 64 * 1024
DEFAULT_MIN_FRAMES = 8  # frames one view needs by default: the ucf101 / hmdb51 recipes' num_frames


def default_store_path(root: str | os.PathLike[str]) -> Path:
    """Where ``mmviews prepare`` puts the store of the video folder ``root``: ``<root>.mmstore``."""
    root = Path(root)
    return root.with_name(root.name + ".mmstore")


def read_manifest(store: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The store's manifest, or None when ``store`` has no video-store ``manifest.json``."""
    path = Path(store) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("kind") != STORE_KIND:
        return None
    records = _read_journal(Path(store))
    if records:
        clips, failed = dict(manifest.get("clips", {})), dict(manifest.get("failed", {}))
        for key, rel, value in records:
            if key == "clips":
                clips[rel] = value
                failed.pop(rel, None)
            else:
                failed[rel] = value
        manifest.update(clips=clips, failed=failed,
                        **bad_clip_keys(clips, int(manifest.get("min_frames") or DEFAULT_MIN_FRAMES)))
    return manifest


def _read_journal(store: Path) -> list[tuple[str, str, Any]]:
    """``[(key "clips" | "failed", rel, entry | message)]`` of the store's journal, in order. A
    torn last line (a prepare killed while appending) and foreign lines are ignored."""
    path = store / JOURNAL
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return []
    records = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if (isinstance(rec, dict) and rec.get("key") in ("clips", "failed") and isinstance(rec.get("rel"), str)
                and "value" in rec):
            records.append((rec["key"], rec["rel"], rec["value"]))
    return records


def _append_journal(store: Path, key: str, rel: str, value: Any) -> None:
    """One line per finished clip: in the page cache as soon as it is written, so a killed
    process (not a power cut: no fsync per clip) keeps it."""
    with open(store / JOURNAL, "a") as f:
        f.write(json.dumps({"key": key, "rel": rel, "value": value}) + "\n")


def truncation(entry: dict[str, Any]) -> dict[str, Any] | None:
    """``{"declared", "decoded"[, "error"]}`` when the clip of ``entry`` decoded fewer frames than
    its container states (beyond :data:`TRUNCATION_TOLERANCE`) or stopped on a decode error; else None."""
    declared, decoded = entry.get("declared_frames"), int(entry["frames"])
    error = entry.get("decode_error")
    if not error and not (declared and int(declared) - decoded > TRUNCATION_TOLERANCE):
        return None
    return {"declared": declared, "decoded": decoded, **({"error": error} if error else {})}


def bad_clip_keys(clips: dict[str, dict[str, Any]], min_frames: int) -> dict[str, dict[str, Any]]:
    """The manifest's ``truncated`` and ``short`` maps, derived from the clip entries."""
    truncated = {rel: t for rel, e in sorted(clips.items()) if (t := truncation(e)) is not None}
    short = {rel: {"decoded": int(e["frames"]), "needed": int(min_frames)} for rel, e in sorted(clips.items())
             if int(e["frames"]) < min_frames}
    return {"truncated": truncated, "short": short}


def source_fingerprint(path: str | os.PathLike[str]) -> str:
    """``"<size>:<sha256 of the first and last FINGERPRINT_BYTES>"`` of a video: what decides that a
    copy (``cp -r``, new modification times) is still the video a store was made from."""
    path = Path(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(f.read(FINGERPRINT_BYTES))
        if size > FINGERPRINT_BYTES:
            f.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
            digest.update(f.read(FINGERPRINT_BYTES))
    return f"{size}:{digest.hexdigest()}"


def source_matches(entry: dict[str, Any], source: Path) -> bool:
    """Whether ``source`` is the video ``entry`` was prepared from: same size, and the same
    modification time or (a copy that did not keep it) the same :func:`source_fingerprint`. An
    entry of an older store without a fingerprint falls back to the modification time."""
    try:
        st = source.stat()
    except OSError:
        return False
    if entry.get("source_size") != st.st_size:
        return False
    if entry.get("source_mtime_ns") == st.st_mtime_ns:
        return True
    recorded = entry.get("source_fingerprint")
    try:
        return recorded is not None and recorded == source_fingerprint(source)
    except OSError:
        return False


def clip_dir_name(rel: str) -> str:
    """Store folder of the clip ``"Class/clip.avi"``: ``"clips/Class/clip"``."""
    cls, name = rel.split("/", 1)
    return f"{CLIPS_DIR}/{cls}/{Path(name).stem}"


def _entry_files(entry: dict[str, Any]) -> list[str]:
    """Every file name a complete clip folder holds according to its entry."""
    names = [CLIP_ENTRY]
    if entry.get("format") == "npy":
        return names + ["frames.npy", "flow.npy"]
    names += [f"img_{i:05d}.jpg" for i in range(1, int(entry["frames"]) + 1)]
    for i in range(1, int(entry.get("flows", 0)) + 1):
        names += [f"flow_x_{i:05d}.jpg", f"flow_y_{i:05d}.jpg"]
    return names


def _check_ours(folder: Path, entry: dict[str, Any] | None) -> None:
    """ValueError naming ``folder`` if it holds anything but the files its entry names (any of
    our file names for a temporary folder, ``entry=None``)."""
    ours = set(_entry_files(entry)) if entry is not None else None
    foreign = sorted(f.name for f in folder.iterdir()
                     if not f.is_file() or not (f.name in ours if ours is not None else _OUR_FILE.fullmatch(f.name)))
    if foreign:
        raise ValueError(f"{folder}: holds files mmviews did not write ({foreign[:5]}); nothing deleted, "
                         "move them away first")


def _remove_clip_folder(folder: Path, entry: dict[str, Any] | None) -> None:
    """Delete a clip folder mmviews wrote (see :func:`_check_ours`, checked first)."""
    _check_ours(folder, entry)
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()


# --------------------------------------------------------------------------- writing one clip


def _output_size(height: int, width: int, size: int) -> tuple[int, int]:
    """Stored ``(H, W)``: the short side scaled to ``size`` (aspect kept); never upscaled; 0 = as is."""
    short = min(height, width)
    if size <= 0 or short <= size:
        return height, width
    # both sides are at least the short side, so neither rounds below size (>= 1)
    return round(height * size / short), round(width * size / short)


def _init_worker(parent_pid: int | None = None) -> None:
    import cv2

    cv2.setNumThreads(1)  # one process per core already: OpenCV's own threads would oversubscribe
    if parent_pid is not None:
        _die_with_parent(parent_pid)


def _die_with_parent(parent_pid: int) -> None:
    """End this worker when the prepare that started it dies (SIGKILL included): otherwise a
    worker blocked on its task queue, or busy with a long clip, outlives it as an orphan."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None)
            pr_set_pdeathsig = 1
            if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0:
                if os.getppid() != parent_pid:  # the parent died before prctl took effect
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass  # no prctl: watch the parent instead

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="mmviews-parent-watch", daemon=True).start()


class StoreWriteError(OSError):
    """Writing to the store failed (disk full, permissions): stops a prepare, never skips a clip."""


def _prepare_clip(root: str, rel: str, store: str, options: dict[str, Any],
                  before_commit: Callable[[str], None] | None) -> tuple[str, dict[str, Any] | None, str | None]:
    """Decode, resize, compute flow and write one clip. Returns ``(rel, entry, None)`` or, when the
    video cannot be read, ``(rel, None, message naming the file)``; a failure to write the store
    raises :class:`StoreWriteError`. Runs in a worker process."""
    import av
    import cv2

    src = Path(root) / rel
    final = Path(store) / clip_dir_name(rel)
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}.{os.getpid()}")
    fmt, size, flow_method, quality = options["format"], int(options["size"]), options["flow"], options.get("jpeg_quality")
    jpeg = [cv2.IMWRITE_JPEG_QUALITY, int(quality or 90)]

    def write_jpeg(path: Path, img: np.ndarray) -> None:  # OpenCV: faster than PIL, and what the reader uses
        try:
            ok = cv2.imwrite(str(path), img if img.ndim == 2 else cv2.cvtColor(img, cv2.COLOR_RGB2BGR), jpeg)
        except cv2.error as err:
            raise StoreWriteError(f"{path}: cannot write ({err})") from err
        if not ok:
            raise StoreWriteError(f"{path}: cannot write")

    if tmp.exists():  # left by a killed worker that had the same process id
        _remove_clip_folder(tmp, None)
    reading = True  # until the video is decoded, an exception means the video cannot be read
    n = out_h = out_w = 0
    try:
        st = src.stat()
        fingerprint = source_fingerprint(src)
        try:
            tmp.mkdir(parents=True)
        except OSError as err:
            raise StoreWriteError(f"{tmp}: cannot create ({err})") from err
        frames: list[np.ndarray] = []  # npy format only
        flows: list[np.ndarray] = []
        n = src_h = src_w = out_h = out_w = 0
        prev_gray: np.ndarray | None = None
        decode_error: str | None = None
        with av.open(str(src)) as container:
            if not container.streams.video:
                raise ValueError("no video stream")
            stream = container.streams.video[0]
            fps = float(stream.average_rate) if stream.average_rate else DEFAULT_FPS
            declared = int(stream.frames) if stream.frames and stream.frames > 0 else None  # AVI header, MP4 table
            has_audio = bool(container.streams.audio)
            decoded = container.decode(stream)
            while True:
                try:
                    frame = next(decoded)
                except StopIteration:
                    break
                except av.error.FFmpegError as err:
                    if n == 0:
                        raise
                    # damaged data after frames that decoded: keep those, report the clip as truncated
                    decode_error = f"{type(err).__name__}: {err}"
                    break
                rgb = frame.to_ndarray(format="rgb24")
                if n == 0:
                    src_h, src_w = rgb.shape[:2]
                    out_h, out_w = _output_size(src_h, src_w, size)
                if (out_h, out_w) != rgb.shape[:2]:
                    rgb = cv2.resize(rgb, (out_w, out_h), interpolation=cv2.INTER_AREA)
                n += 1
                if flow_method is not None:
                    gray = to_gray(rgb)
                    if prev_gray is not None:
                        uv = encode_flow_image(farneback_pair(prev_gray, gray))  # uint8 [2, H, W]
                        if fmt == "npy":
                            flows.append(uv)
                        else:
                            write_jpeg(tmp / f"flow_x_{n - 1:05d}.jpg", uv[0])
                            write_jpeg(tmp / f"flow_y_{n - 1:05d}.jpg", uv[1])
                    prev_gray = gray
                if fmt == "npy":
                    frames.append(rgb)
                else:
                    write_jpeg(tmp / f"img_{n:05d}.jpg", rgb)
        if n == 0:
            raise ValueError("the video stream has no decodable frames")
        reading = False
        n_flows = n - 1 if flow_method is not None else 0
        if fmt == "npy":
            np.save(tmp / "frames.npy", np.stack(frames))
            if flow_method is not None:
                np.save(tmp / "flow.npy", np.stack(flows) if flows else np.zeros((0, 2, out_h, out_w), np.uint8))
        entry = {"dir": clip_dir_name(rel), "frames": n, "declared_frames": declared, "flows": n_flows, "height": out_h,
                 "width": out_w, "fps": fps, "audio": has_audio, "source_size": st.st_size,
                 "source_mtime_ns": st.st_mtime_ns, "source_fingerprint": fingerprint, "source_height": src_h,
                 "source_width": src_w, "format": fmt, "options": options}
        if decode_error is not None:
            entry["decode_error"] = decode_error
        (tmp / CLIP_ENTRY).write_text(json.dumps(entry))
        if before_commit is not None:
            before_commit(rel)
        os.rename(tmp, final)  # atomic: the clip folder appears complete or not at all
        return rel, entry, None
    except Exception as err:  # PyAV and OpenCV raise their own types; report, never half-write
        writing = not reading or isinstance(err, StoreWriteError)
        # a write that failed on a full device (or quota), whatever the writer said (cv2.imwrite only
        # returns False): decided while the partial clip still holds its space
        frame = out_h * out_w * 3 * (max(n, 1) if fmt == "npy" else 1)  # what was being written: a frame, or them all
        full = full_device(err, Path(store), lambda: folder_bytes(tmp) + frame) if writing else None
        if tmp.exists():
            _remove_clip_folder(tmp, None)
        if full is not None:
            raise disk_full_error(store, f"the clip of {rel}", *full) from err
        if writing:
            raise
        return rel, None, f"{src}: {type(err).__name__}: {err}"


# --------------------------------------------------------------------------- the whole store


@contextmanager
def _store_lock(store: Path) -> Iterator[None]:
    """Hold an exclusive lock on the store for one prepare (a second one fails, naming the store)."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; one prepare at a time is then up to the user
        yield
        return
    with open(store / LOCK_FILE, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            raise ValueError(f"{store}: another mmviews prepare is writing this store") from err
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def clear_video_store(store: str | os.PathLike[str]) -> int:
    """Remove the outputs a video store's manifest lists; returns the number of clip folders removed.

    The manifest is ``manifest.json`` plus the per-clip ``clip.json`` entries. Only those clip
    folders (the files their entries name), temporary folders of an interrupted prepare,
    ``manifest.json``, its journal and the prepare report are deleted; class folders are removed when that leaves them empty.
    A folder that is not a mmviews video store raises ValueError naming it; nothing is deleted.
    """
    store = Path(store)
    manifest = read_manifest(store)
    if manifest is None:
        raise ValueError(f"{store} is not a mmviews video store (no {MANIFEST} of kind {STORE_KIND!r}): "
                         "refusing to delete anything in it")
    removed = 0
    folders: dict[Path, dict[str, Any] | None] = {}
    for entry in manifest.get("clips", {}).values():
        folders[store / entry["dir"]] = entry
    clips_root = store / CLIPS_DIR
    if clips_root.is_dir():
        for cls in clips_root.iterdir():
            if not cls.is_dir():
                continue
            for d in cls.iterdir():
                if d.is_dir() and d.name.startswith(TMP_PREFIX):
                    folders[d] = None
                elif d.is_dir() and (d / CLIP_ENTRY).is_file() and d not in folders:
                    folders[d] = read_json_object(d / CLIP_ENTRY)
    folders = {d: entry for d, entry in folders.items() if d.is_dir()}
    for d, entry in folders.items():  # all checked before anything is deleted
        _check_ours(d, entry)
    for d, entry in folders.items():
        _remove_clip_folder(d, entry)
        removed += 1
    if clips_root.is_dir():
        for cls in clips_root.iterdir():
            if cls.is_dir() and not any(cls.iterdir()):
                cls.rmdir()
        if not any(clips_root.iterdir()):
            clips_root.rmdir()
    (store / MANIFEST).unlink(missing_ok=True)
    (store / JOURNAL).unlink(missing_ok=True)
    (store / REPORT_FILE).unlink(missing_ok=True)
    return removed


def _write_manifest(store: Path, header: dict[str, Any], clips: dict[str, Any], failed: dict[str, str]) -> None:
    """Rewrite ``manifest.json`` (atomically) with everything, then empty the journal it now holds."""
    manifest = {**header, "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "clips": dict(sorted(clips.items())), "failed": dict(sorted(failed.items())),
                **bad_clip_keys(clips, int(header.get("min_frames") or DEFAULT_MIN_FRAMES))}
    atomic_write_text(store / MANIFEST, json.dumps(manifest, indent=0))
    (store / JOURNAL).unlink(missing_ok=True)  # killed between the two: the journal repeats the manifest, harmless


def _is_current(entry: dict[str, Any], source: Path, options: dict[str, Any]) -> bool:
    return entry.get("options") == options and source_matches(entry, source)


def store_options(image_format: str = "jpeg", size: int = 128, flow: str | None = "farneback",
                  jpeg_quality: int = 90) -> dict[str, Any]:
    """The options a store is made with (checked, as recorded in its manifest)."""
    if image_format not in FORMATS:
        raise ValueError(f"image format must be one of {FORMATS}, got {image_format!r}")
    if flow not in (None, *FLOW_METHODS):
        raise ValueError(f"flow must be None or one of {FLOW_METHODS}, got {flow!r}")
    if int(size) < 0:
        raise ValueError(f"size (short side in pixels, 0 = as decoded) must be >= 0, got {size}")
    if image_format == "jpeg" and not 1 <= int(jpeg_quality) <= 100:
        raise ValueError(f"jpeg_quality must be in 1..100, got {jpeg_quality}")
    return {"format": image_format, "size": int(size), "flow": flow,
            "jpeg_quality": int(jpeg_quality) if image_format == "jpeg" else None}


def _listed_clips(root: Path, out: Path) -> list[str]:
    """The clips under ``root`` (as :func:`list_video_clips`), refused when the store ``out`` lies
    inside ``root``, when there are none, or when two would share a store folder."""
    if out.resolve() == root.resolve() or root.resolve() in out.resolve().parents:
        raise ValueError(f"store {out} is inside the video folder {root}, where it would be taken for a class folder; "
                         f"choose another --out (default {default_store_path(root)})")
    clips = list_video_clips(root)
    if not clips:
        raise ValueError(f"{root}: no videos in class folders (expected {root}/<class>/<clip>.avi)")
    seen: dict[str, str] = {}
    for rel in clips:
        other = seen.setdefault(clip_dir_name(rel), rel)
        if other != rel:
            raise ValueError(f"{root}: {other} and {rel} would share the store folder {clip_dir_name(rel)}")
    return clips


def _store_manifest(out: Path) -> dict[str, Any] | None:
    """The manifest of the store at ``out`` (None for a new or empty folder); a file, or a folder
    holding anything but a video store, is refused: mmviews writes only into its own stores."""
    manifest = read_manifest(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    if manifest is None and out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} is not a mmviews video store (no {MANIFEST} of kind {STORE_KIND!r}) and is not empty: "
                         "refusing to write into it; choose another --out")
    return manifest


def _clips_done_and_to_do(root: Path, out: Path, clips: list[str],
                          options: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Split ``clips`` into those the store already holds for the current source and options
    (``{rel: entry}``) and those to prepare. Removes what an interrupted or stale prepare left
    (temporary folders, clip folders of a changed source: ours, by prefix or entry); refuses a clip
    folder it did not write."""
    clips_root = out / CLIPS_DIR
    if clips_root.is_dir():
        for tmp in clips_root.glob(f"*/{TMP_PREFIX}*"):
            if tmp.is_dir():
                _remove_clip_folder(tmp, None)
    done: dict[str, dict[str, Any]] = {}
    todo: list[str] = []
    for rel in clips:
        folder = out / clip_dir_name(rel)
        entry_path = folder / CLIP_ENTRY
        if entry_path.is_file():
            entry = read_json_object(entry_path)
            if _is_current(entry, root / rel, options):
                mtime = (root / rel).stat().st_mtime_ns
                if entry.get("source_mtime_ns") != mtime:  # a copy, same content: record its time once
                    entry = {**entry, "source_mtime_ns": mtime}
                    atomic_write_text(entry_path, json.dumps(entry))
                done[rel] = entry
                continue
            _remove_clip_folder(folder, entry)  # ours but stale (source changed): redo
        elif folder.exists():
            raise ValueError(f"{folder} exists but was not written by mmviews (no {CLIP_ENTRY}): "
                             "move it away or choose another --out")
        todo.append(rel)
    return done, todo


def _prepare_clips(todo: list[str], job: tuple[str, str, dict[str, Any], Callable[[str], None] | None],
                   n_workers: int, record: Callable[..., None], stop: Callable[[], bool]) -> None:
    """Run :func:`_prepare_clip` on each clip of ``todo`` (``job``: its other arguments, root, store,
    options, before_commit), in this process when ``n_workers <= 0``, else in a pool of that many
    worker processes; ``record`` gets each result as it comes, and no further result is taken
    once ``stop()`` is true (clips not started are cancelled)."""
    root, out, options, before_commit = job
    if n_workers <= 0:
        for rel in todo:
            record(*_prepare_clip(root, rel, out, options, before_commit))
            if stop():
                break
    elif todo:
        # spawn, not fork: the parent may hold threads (torch, OpenCV) that fork does not copy safely.
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=min(n_workers, len(todo)), mp_context=ctx,
                                    initializer=_init_worker, initargs=(os.getpid(),)) as pool:
            futures = [pool.submit(_prepare_clip, root, rel, out, options, before_commit) for rel in todo]
            try:
                for fut in cf.as_completed(futures):
                    record(*fut.result())
                    if stop():
                        break
            finally:
                for fut in futures:
                    fut.cancel()


def prepare_video_store(root: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
                        dataset: str | None = None, image_format: str = "jpeg", size: int = 128,
                        flow: str | None = "farneback", jpeg_quality: int = 90, workers: int | None = None,
                        on_error: str = "skip", overwrite: bool = False, progress: bool = True,
                        before_commit: Callable[[str], None] | None = None,
                        min_frames: int = DEFAULT_MIN_FRAMES) -> dict[str, Any]:
    """Extract frames and flow of every video under ``root/<class>/`` into a store.

    ``image_format`` "jpeg" (``jpeg_quality``) or "npy" (uint8 arrays, exact); ``size``: short side
    in pixels (0: as decoded); ``flow`` "farneback" or None; ``workers``: worker processes (0: in
    this process; None: one per CPU). ``on_error="skip"`` reports unreadable videos by name
    (one ``warning:`` line on stderr, above the progress bar, and ``failed`` in the result and
    manifest) and goes on; ``"raise"`` stops at the first one with a ValueError naming it
    (finished clips are kept). A truncated video (fewer frames decode than its container states)
    is stored as far as it decodes and reported the same way (``truncated``); clips with fewer
    than ``min_frames`` frames are listed (``short``), see ``data_cards/ucf101.md``. A rerun resumes:
    clips already in the store are not redone. ``overwrite`` first clears the store
    (:func:`clear_video_store`). ``before_commit(rel)`` is called in the worker just before a
    finished clip is renamed into place (tests use it to slow a prepare down; must pickle).

    Returns ``{"store", "clips", "already_done", "prepared", "failed": {rel: message},
    "truncated": {rel: {...}}, "short": {rel: {...}}, "with_audio", "seconds"}`` (``truncated``
    and ``short`` over every clip of the store, not only those prepared now).
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no such video folder: {root}")
    out = Path(out) if out is not None else default_store_path(root)
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    if int(min_frames) < 1:
        raise ValueError(f"min_frames (frames one view needs) must be >= 1, got {min_frames}")
    options = store_options(image_format, size, flow, jpeg_quality)
    clips = _listed_clips(root, out)
    manifest = _store_manifest(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    with _store_lock(out):
        if manifest is not None and overwrite:
            clear_video_store(out)
            manifest = None
        if manifest is not None and manifest.get("options") != options:
            raise ValueError(f"{out} was prepared with options {manifest.get('options')}, not {options}: "
                             "pass --overwrite to rebuild it with the new ones, or choose another --out")
        header = {"kind": STORE_KIND, "version": STORE_VERSION, "dataset": dataset, "source_root": str(root.resolve()),
                  "options": options, "min_frames": int(min_frames)}
        done, todo = _clips_done_and_to_do(root, out, clips, options)
        already = len(done)
        failed: dict[str, str] = {}
        _write_manifest(out, header, done, failed)
        for class_dir in {clip_dir_name(r).rsplit("/", 1)[0] for r in todo}:
            (out / class_dir).mkdir(parents=True, exist_ok=True)

        from tqdm.auto import tqdm

        bar = tqdm(total=len(clips), initial=already, desc=f"preparing {dataset or root.name}", unit="clip",
                   disable=not progress)
        last_save = time.monotonic()
        error: str | None = None

        def say(line: str) -> None:  # one clean line above the progress bar (not glued to it)
            tqdm.write(f"warning: {line}", file=sys.stderr)

        def record(rel: str, entry: dict[str, Any] | None, message: str | None) -> None:
            nonlocal last_save, error
            bar.update(1)
            if entry is not None:
                done[rel] = entry
                _append_journal(out, "clips", rel, entry)
                cut = truncation(entry)
                if cut is not None:
                    say(f"truncated video {root / rel}: the container states {cut['declared']} frames, "
                        f"{cut['decoded']} decode" + (f" ({cut['error']})" if "error" in cut else "")
                        + "; stored as decoded, listed under 'truncated'")
            else:
                assert message is not None
                failed[rel] = message
                _append_journal(out, "failed", rel, message)
                if on_error == "raise":
                    error = message
                else:
                    say(f"skipped unreadable video {message}")
            if time.monotonic() - last_save > _MANIFEST_SAVE_S:
                _write_manifest(out, header, done, failed)
                last_save = time.monotonic()

        n_workers = (os.cpu_count() or 1) if workers is None else int(workers)
        try:
            _prepare_clips(todo, (str(root), str(out), options, before_commit), n_workers, record,
                           stop=lambda: error is not None)
        finally:
            bar.close()
            _write_manifest(out, header, done, failed)
        if error is not None:
            raise ValueError(f"cannot read {error} (prepare stopped: on_error='raise'; finished clips are kept, "
                             "a rerun resumes)")
    return {"store": str(out), "clips": len(clips), "already_done": already, "prepared": len(done) - already,
            "failed": failed, **bad_clip_keys(done, int(min_frames)),
            "with_audio": sum(bool(e.get("audio")) for e in done.values()),
            "seconds": round(time.perf_counter() - t_start, 2)}


# --------------------------------------------------------------------------- reading

# Manifest keys that list clips a prepare found bad, {rel: message}; training leaves them out
# (:func:`known_bad_clips`). A later key (truncated, too short...) is added here.
KNOWN_BAD_KEYS: tuple[str, ...] = ("failed",)


def known_bad_clips(store: str | os.PathLike[str]) -> dict[str, str]:
    """``{rel: "key: message"}``: the clips the store's manifest records as bad (keys
    :data:`KNOWN_BAD_KEYS`), which the video datasets leave out of their splits. A clip repaired
    since is listed until a rerun of ``mmviews prepare``, which retries the clips it could not
    read (file times cannot tell: a copy with ``cp -r`` renews them)."""
    manifest = read_manifest(store)
    if manifest is None:
        return {}
    bad: dict[str, str] = {}
    for key in KNOWN_BAD_KEYS:
        listed = manifest.get(key) or {}
        if isinstance(listed, dict):
            for rel, message in listed.items():
                bad.setdefault(str(rel), f"{key}: {message}")
    return bad


class VideoStore:
    """Read access to a prepared store: ``lookup`` a clip, then ``read_frames`` / ``read_flow``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        manifest = read_manifest(self.path)
        if manifest is None:
            raise ValueError(f"{self.path} is not a mmviews video store (no {MANIFEST} of kind {STORE_KIND!r}); "
                             "make one with `mmviews prepare ucf101|hmdb51 ROOT --out STORE`")
        if manifest.get("version") != STORE_VERSION:
            raise ValueError(f"{self.path}: video store version {manifest.get('version')}, this mmviews reads "
                             f"{STORE_VERSION}; rebuild it with `mmviews prepare ... --overwrite`")
        self.options: dict[str, Any] = manifest["options"]
        self.clips: dict[str, dict[str, Any]] = manifest["clips"]
        self._verified: dict[str, int] = {}  # rel -> modification time whose content matched the fingerprint
        self.has_flow = self.options.get("flow") is not None

    @classmethod
    def find(cls, root: str | os.PathLike[str]) -> VideoStore | None:
        """The store at :func:`default_store_path` of ``root`` if there is one, else None."""
        path = default_store_path(root)
        return cls(path) if read_manifest(path) is not None else None

    def lookup(self, rel: str, source: Path) -> tuple[dict[str, Any] | None, bool]:
        """``(entry, stale)`` of clip ``rel``: entry None when the store lacks it or ``source`` has
        changed since (``stale`` True: see :func:`source_matches`; a copy with new modification
        times but the same content is not stale, its fingerprint checked once per process). A
        source that no longer exists does not make the entry stale: the store is then all there is."""
        entry = self.clips.get(rel)
        if entry is None:
            return None, False
        try:
            st = source.stat()
        except FileNotFoundError:
            return entry, False
        if st.st_size == entry["source_size"] and st.st_mtime_ns in (entry["source_mtime_ns"], self._verified.get(rel)):
            return entry, False
        if not source_matches(entry, source):
            return None, True
        self._verified[rel] = st.st_mtime_ns  # same content, new time (a copy): hash it once
        return entry, False

    def folder(self, entry: dict[str, Any]) -> Path:
        return self.path / entry["dir"]

    def read_frames(self, entry: dict[str, Any], idx: np.ndarray) -> np.ndarray:
        """Frames ``idx`` (0-based, repeats allowed) as uint8 ``[T, H, W, 3]``."""
        d = self.folder(entry)
        if entry["format"] == "npy":
            return np.asarray(np.load(d / "frames.npy", mmap_mode="r")[idx])
        uniq, inverse = np.unique(idx, return_inverse=True)
        images = np.stack([read_jpeg(d / f"img_{i + 1:05d}.jpg", gray=False) for i in uniq])
        return images[inverse]

    def read_flow(self, entry: dict[str, Any], idx: np.ndarray) -> np.ndarray:
        """Flow between the frames ``idx[t]`` and ``idx[t + 1]`` as float32 ``[T - 1, 2, H, W]`` pixels.

        Consecutive frames read the stored flow ``idx[t]``; a repeated frame (a clip shorter than
        the window) gives zero flow.
        """
        if not entry.get("flows") and np.any(idx[1:] == idx[:-1] + 1):  # no pair at all: nothing to read
            raise ValueError(f"{self.folder(entry)}: the store holds no flow (prepared with flow=None)")
        d = self.folder(entry)

        def read(wanted: np.ndarray) -> np.ndarray:
            if entry["format"] == "npy":
                return np.asarray(np.load(d / "flow.npy", mmap_mode="r")[wanted])
            return np.stack([np.stack([read_jpeg(d / f"flow_x_{i + 1:05d}.jpg", gray=True),
                                       read_jpeg(d / f"flow_y_{i + 1:05d}.jpg", gray=True)]) for i in wanted])

        return window_flow(idx, int(entry["height"]), int(entry["width"]), read)
