"""A restricted unpickler for the feature pickles users download (MMSA, MulT, MultiBench).

Plain ``pickle.load`` runs whatever callable a file names (``os.system`` included). The
files these datasets ship only need builtin containers and scalars and numpy arrays, so
:func:`safe_load_pickle` resolves exactly those globals and refuses every other one with
an :class:`UnsafePickleError` naming it, before anything is called.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

# (module, name) pairs a data pickle may reference. The numpy entries are what ndarray,
# dtype and numpy scalars reduce to under numpy 1.x (numpy.core) and 2.x (numpy._core);
# _codecs.encode is how protocol-2 pickles store bytes (torch's weights-only loader allows it too).
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    [("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str",
                               "bytes", "bytearray", "bool", "slice", "range")]
    + [("__builtin__", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str",
                                    "bytes", "bool", "unicode", "long")]
    + [("collections", "OrderedDict"), ("collections", "defaultdict"), ("_codecs", "encode"), ("copy_reg", "_reconstructor"),
       ("copyreg", "_reconstructor")]
    + [(mod, name) for mod in ("numpy.core.multiarray", "numpy._core.multiarray")
       for name in ("_reconstruct", "scalar")]
    + [(mod, "_frombuffer") for mod in ("numpy.core.numeric", "numpy._core.numeric")]
    + [("numpy", "ndarray"), ("numpy", "dtype")]
)


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle references a global outside the allow-list (possible code execution)."""


class CorruptFileError(ValueError):
    """The file is truncated or not a pickle."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file, encoding="latin1")  # latin1: Python 2 numpy pickles (MulT's)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            if module == "copy_reg" or module == "copyreg":
                # copyreg._reconstructor(cls, base, state) instantiates ``cls``: only safe
                # because every class it could receive also comes through this method.
                return super().find_class("copyreg", name)
            return super().find_class(module, name)
        if module.startswith("numpy.dtypes") and name.endswith("DType"):
            # numpy >= 2 pickles dtype instances through their DType classes (e.g. Float64DType).
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"{self._source}: refused to load global '{module}.{name}': only builtin containers, scalars and "
            "numpy arrays are allowed in data pickles (the file may be malicious or not a dataset file)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self._source}: persistent ids are not allowed in data pickles")


def safe_loads(data: bytes, source: str = "<bytes>") -> Any:
    """:func:`safe_load_pickle` for bytes already in memory."""
    return _load(io.BytesIO(data), source, len(data))


def safe_load_pickle(path: str | os.PathLike[str]) -> Any:
    """Load a pickle that may only contain builtin containers/scalars and numpy arrays.

    Raises:
        FileNotFoundError: no such file.
        UnsafePickleError: the file references any other global (its name is in the message);
            nothing from the file has been called.
        CorruptFileError: the file is truncated or not a pickle ("truncated, re-download").
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such pickle file: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        return _load(f, str(path), size)


def _load(f: Any, source: str, size: int) -> Any:
    if size == 0:
        raise CorruptFileError(f"{source}: the file is empty (truncated, re-download it)")
    try:
        return _RestrictedUnpickler(f, source).load()
    except UnsafePickleError:
        raise
    except EOFError as err:
        raise CorruptFileError(f"{source}: the pickle ends early ({size} bytes): truncated, re-download it") from err
    except pickle.UnpicklingError as err:
        msg = str(err)
        if "truncated" in msg:
            raise CorruptFileError(f"{source}: pickle data was truncated ({size} bytes): truncated, re-download it") from err
        raise CorruptFileError(f"{source}: not a valid pickle ({msg}); the file may be corrupt: re-download it") from err
    except (ValueError, TypeError, IndexError, KeyError, MemoryError, AttributeError, UnicodeDecodeError) as err:
        # numpy raises ValueError when an array's buffer is cut short.
        raise CorruptFileError(f"{source}: could not rebuild the pickled data ({type(err).__name__}: {err}); "
                               "the file may be truncated or corrupt: re-download it") from err
