# SPDX-License-Identifier: Apache-2.0
"""safetensors files in NumPy: header parsing, memory-mapped reads, atomic writes.

Format (little-endian): an 8-byte ``u64`` header size ``N``, then ``N`` bytes of UTF-8 JSON
``{name: {"dtype": "U8", "shape": [...], "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``, then the byte buffer; offsets count from the start of the buffer and each tensor
is C-ordered. The reader maps the buffer with :class:`numpy.memmap`, so only the bytes of the
tensors asked for are read from disk (real checkpoints are tens of GB, in shards).
:class:`Checkpoint` opens one file, a directory of shards or a ``model.safetensors.index.json``.

Why our own reader and writer rather than the ``safetensors`` package: its NumPy API
(``safetensors.numpy.load_file``, ``safe_open(..., framework="np")``, version 0.8) reads U8,
BF16 and F32 tensors, but fails on F8_E4M3 (``module 'numpy' has no attribute
'float8_e4m3fn'``), the dtype of every NVFP4 checkpoint's block scales, and ``load_file`` then
fails for the whole file. Reading those tensors as raw bytes around it would leave two readers
of one format (and two sets of error messages); this module reads every dtype the checkpoints
hold through ``ml_dtypes``, validates the header with errors that name the file and the tensor,
and writes files the package reads (``tests/test_checkpoint.py`` shows both: the package's
reads of our files, and its failure on F8_E4M3 where ours succeeds).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .._runtime.backend import to_numpy

__all__ = [
    "DTYPES",
    "FLOATS",
    "Checkpoint",
    "SafetensorsHeader",
    "TensorInfo",
    "read_safetensors_header",
    "read_tensor",
    "write_safetensors",
]

#: safetensors dtype name -> NumPy dtype (the format is little-endian).
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(t)
    for name, t in (
        ("BOOL", np.bool_), ("U8", "u1"), ("I8", "i1"), ("U16", "<u2"), ("I16", "<i2"),
        ("U32", "<u4"), ("I32", "<i4"), ("U64", "<u8"), ("I64", "<i8"), ("F16", "<f2"),
        ("BF16", ml_dtypes.bfloat16), ("F32", "<f4"), ("F64", "<f8"), ("C64", "<c8"),
        ("F8_E4M3", ml_dtypes.float8_e4m3fn), ("F8_E5M2", ml_dtypes.float8_e5m2),
        ("F8_E8M0", ml_dtypes.float8_e8m0fnu),
    )
}  # fmt: skip
#: Packed sub-byte dtypes: bits per element. The header is validated; reading them is refused.
_SUBBYTE_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
_NAME_OF = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 2**20  # the limit of the reference implementation
FLOATS = ("F32", "BF16", "F16")  # exact in float32
_INDEX_NAME = "model.safetensors.index.json"


# ---- safetensors: header -----------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    """One header entry: bytes ``begin:end`` of the data buffer hold ``shape`` of ``dtype``."""

    name: str
    dtype: str  # safetensors spelling, e.g. "U8", "F8_E4M3", "BF16"
    shape: tuple[int, ...]
    begin: int  # data_offsets[0], relative to the start of the data buffer
    end: int  # data_offsets[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data, ``end - begin``."""
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed, validated header of one ``.safetensors`` file."""

    path: str
    tensors: Mapping[str, TensorInfo]  # in the header's order
    metadata: Mapping[str, str]  # "__metadata__", empty when absent
    data_start: int  # absolute file offset of the data buffer, 8 + N
    data_size: int  # bytes of the file after the header


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _entry(path: str, name: str, entry: Any, data_size: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise ValueError(
            f"{where}: expected an object with dtype, shape, data_offsets, got {entry!r}"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES and dtype not in _SUBBYTE_BITS:
        known = ", ".join([*DTYPES, *_SUBBYTE_BITS])
        raise ValueError(f"{where}: unknown dtype {dtype!r} (known: {known})")
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)) or not (
        isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
    ):
        raise ValueError(f"{where}: malformed shape {shape!r} or data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise ValueError(
            f"{where}: data_offsets [{begin}, {end}] out of range: the data buffer holds "
            f"{data_size} bytes (truncated file?)"
        )
    bits = _SUBBYTE_BITS[dtype] if dtype in _SUBBYTE_BITS else 8 * DTYPES[dtype].itemsize
    nbytes = -(-math.prod(shape) * bits // 8)
    if end - begin != nbytes:
        raise ValueError(
            f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, but {dtype} "
            f"{tuple(shape)} needs {nbytes}"
        )
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def read_safetensors_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate the header of one ``.safetensors`` file (no tensor data is read).

    Raises ``ValueError`` naming the file (and the tensor) for a truncated file, a header that
    is not UTF-8 JSON or repeats a key, an unknown dtype, a malformed shape, or ``data_offsets``
    outside the data buffer or not matching ``dtype`` and ``shape``.
    """
    p = os.fspath(path)
    size = os.path.getsize(p)
    with open(p, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(
                f"{p}: truncated safetensors file: {size} bytes, no 8-byte header size"
            )
        (n,) = struct.unpack("<Q", prefix)
        if n > _MAX_HEADER_BYTES:
            raise ValueError(f"{p}: header size {n} exceeds {_MAX_HEADER_BYTES} bytes")
        if 8 + n > size:
            raise ValueError(
                f"{p}: truncated safetensors file: header of {n} bytes declared, {size - 8} follow"
            )
        raw = f.read(n)
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{p}: invalid safetensors header (not UTF-8 JSON): {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{p}: invalid safetensors header: expected a JSON object")
    metadata = obj.pop("__metadata__", None) or {}
    if not (isinstance(metadata, dict) and all(map(_is_str, metadata.values()))):
        raise ValueError(f"{p}: __metadata__ must map strings to strings, got {metadata!r}")
    data_size = size - 8 - n
    tensors = {name: _entry(p, name, entry, data_size) for name, entry in obj.items()}
    return SafetensorsHeader(p, tensors, metadata, 8 + n, data_size)


# ---- safetensors: files, directories, index files ----------------------------------------------
class Checkpoint:
    """Read-only access by name to the tensors of a safetensors checkpoint, read lazily.

    ``path`` is one ``.safetensors`` file; an index file (``model.safetensors.index.json``:
    ``{"weight_map": {tensor: shard file}}``, shards relative to it); or a directory holding an
    index file, or else ``*.safetensors`` shards. Each shard's data buffer is memory-mapped
    once, so reading a tensor touches only its own bytes; :meth:`close` (or ``with``) releases
    the maps. ``name in checkpoint`` and ``iter(checkpoint)`` see every tensor name.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        self.path = str(p)
        self._headers: dict[str, SafetensorsHeader] = {}
        self._buffers: dict[str, np.ndarray] = {}
        if p.is_dir() and not (p / _INDEX_NAME).is_file():
            files = sorted(str(f) for f in p.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{p}: no {_INDEX_NAME} and no *.safetensors files")
            self._where = self._scan(files)
        elif p.is_dir() or p.suffix == ".json":
            self._where = self._read_index(p / _INDEX_NAME if p.is_dir() else p)
        elif p.is_file():
            self._where = self._scan([str(p)])
        else:
            raise FileNotFoundError(f"{p}: no such checkpoint file or directory")

    def _read_index(self, index: Path) -> dict[str, str]:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: invalid index file (need 'weight_map'): {exc!r}") from None
        if not (isinstance(weight_map, dict) and all(map(_is_str, weight_map.values()))):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names")
        return {name: str(index.parent / shard) for name, shard in weight_map.items()}

    def _scan(self, files: list[str]) -> dict[str, str]:
        where: dict[str, str] = {}
        for file in files:
            for name in self._header(file).tensors:
                if name in where:
                    raise ValueError(f"{file}: tensor {name!r} is also in {where[name]}")
                where[name] = file
        return where

    def _header(self, file: str) -> SafetensorsHeader:
        if file not in self._headers:
            if not os.path.isfile(file):
                raise ValueError(f"{self.path}: shard {file} does not exist")
            self._headers[file] = read_safetensors_header(file)
        return self._headers[file]

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the memory maps (arrays read with ``copy=False`` keep theirs alive)."""
        self._buffers.clear()

    def info(self, name: str) -> TensorInfo:
        """The :class:`TensorInfo` of ``name``; ``KeyError`` if the checkpoint lacks it."""
        if name not in self._where:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        file = self._where[name]
        info = self._header(file).tensors.get(name)
        if info is None:
            raise ValueError(
                f"{self.path}: the index puts tensor {name!r} in {file}, which lacks it"
            )
        return info

    def read(self, name: str, *, copy: bool = True) -> np.ndarray:
        """Tensor ``name`` as a NumPy array of its dtype and shape (``ml_dtypes`` for BF16/F8).

        With ``copy=False`` the result is a read-only view of the memory map (no read until
        touched); by default it is an in-memory copy, independent of the file.
        """
        info = self.info(name)
        file = self._where[name]
        if info.dtype in _SUBBYTE_BITS:
            raise ValueError(f"{file}: tensor {name!r}: packed dtype {info.dtype} is not supported")
        if file not in self._buffers:  # np.memmap cannot map 0 bytes
            h = self._header(file)
            self._buffers[file] = (
                np.memmap(file, np.uint8, "r", offset=h.data_start, shape=(h.data_size,))
                if h.data_size
                else np.zeros(0, np.uint8)
            )
        raw = np.asarray(self._buffers[file][info.begin : info.end])
        view = raw.view(DTYPES[info.dtype]).reshape(info.shape)
        return np.array(view) if copy else view


def read_tensor(path: str | os.PathLike[str], name: str) -> np.ndarray:
    """Read one tensor (an in-memory copy) from a checkpoint file, index file or directory.

    Only that tensor's bytes are read. To read many tensors, open a :class:`Checkpoint` once.

    Examples
    --------
    >>> import tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "t.safetensors")
    >>> write_safetensors(f, {"w": np.arange(6, dtype=np.uint8).reshape(2, 3)})
    >>> read_tensor(f, "w").tolist()
    [[0, 1, 2], [3, 4, 5]]
    """
    with Checkpoint(path) as checkpoint:
        return checkpoint.read(name)


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` (name -> array) and ``metadata`` (str -> str) to one ``.safetensors`` file.

    Arrays may be bool, (u)int8..64, float16/32/64, complex64 or ``ml_dtypes`` bfloat16 /
    float8_e4m3fn / float8_e5m2 / float8_e8m0fnu, NumPy or CuPy; 0-d arrays get shape ``[]``.
    Tensors are laid out by decreasing item size, then name, after a header padded with spaces
    to a multiple of 8 bytes, so each is aligned in the file. A temporary file is renamed into
    place, so a failure never leaves a truncated file.
    """
    arrays: list[tuple[str, str, np.ndarray]] = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"tensors: invalid tensor name {name!r}")
        a = to_numpy(value)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        if a.dtype not in _NAME_OF:
            raise TypeError(
                f"tensors[{name!r}]: dtype {a.dtype} has no safetensors equivalent "
                f"(supported: {', '.join(str(d) for d in _NAME_OF)})"
            )
        arrays.append((name, _NAME_OF[a.dtype], np.asarray(a, order="C")))  # keeps 0-d
    arrays.sort(key=lambda item: (-item[2].dtype.itemsize, item[0]))
    header: dict[str, Any] = {}
    if metadata:
        if not all(map(_is_str, [*metadata, *metadata.values()])):
            raise TypeError(f"metadata: expected a mapping of str to str, got {metadata!r}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, a in arrays:
        end = offset + a.nbytes
        header[name] = dict(dtype=dtype, shape=list(a.shape), data_offsets=[offset, end])
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    target = os.fspath(path)
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        try:
            f = open(tmp, "wb")
        except OSError as exc:  # name the caller's path, not the temporary one
            raise OSError(exc.errno, f"cannot write {target}: {exc.strerror}", target) from None
        with f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for _, _, a in arrays:
                f.write(a.reshape(-1).view(np.uint8).data)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
