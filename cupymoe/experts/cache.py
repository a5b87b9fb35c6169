# SPDX-License-Identifier: Apache-2.0
"""The tuning cache: a JSON file of measured winners (written by :mod:`.tune`), two kinds of entry.

The cache (:func:`cache_path`, ``$XDG_CACHE_HOME/cupymoe/gemv_tune.json``; one file for both
kinds) holds

* **GEMV tilings**, keyed ``device | op | layout | format | dtype | N | K | row bucket``
  (:func:`cache_key`; op: ``fc1`` for gate + up, ``fc2`` for one matrix per expert; layout: the
  weight layout the kernel reads, :attr:`.layouts.WeightLayout.key`; row bucket:
  :func:`row_bucket` of the call's expanded rows) -> the winning
  :class:`~.config.GemvConfig` fields. ``GemvConfig.for_problem`` consults them
  (:func:`tuned_fields`) after the ``CUPYMOE_GEMV_CONFIG`` override and before its analytic table.
* **Expert backends** (kind ``gemm``), keyed ``device | gemm | op | format | dtype | N | K |
  experts | rows-per-expert bucket`` (:func:`gemm_cache_key`; op as above; the bucket:
  :func:`rows_per_expert_bucket` of the average expanded rows per active expert) -> the winning
  backend (``gemv`` or ``gemm``), for ``gemm`` its tiling tagged by kernel (``mma``:
  :class:`~.gemm.GemmConfig` fields; ``wgmma``: :class:`~.gemm.WgmmaConfig` fields), its µs and
  every candidate's µs. :func:`.handover.choose` consults them (:func:`tuned_gemm`) between the
  environment and the analytic hand-over table. Only the SPLIT layout has them: the grouped
  GEMM reads no other.

Tuning is never required. A missing, unreadable or outdated file is ignored (with one warning per
file) and the analytic tables apply; so is an entry that no longer makes a valid config (warned
by the reader that builds the config).

File layout (``version`` changes whenever the meaning of an entry changes)::

    {"version": 4,
     "entries": {"NVIDIA H200|fc1|split|nvfp4|bfloat16|512|2048|8":
                     {"config": {"cta_n": 64, "threads": 128}, "us": 16.7, "op": "fc1"},
                 "NVIDIA H200|gemm|fc1|nvfp4|bfloat16|512|2048|256|32":
                     {"backend": "gemm", "config": {"kind": "mma", "warps_m": 4, "warps_n": 1,
                      "mt": 2, "nt": 4, "stages": 4}, "us": 251.0,
                      "candidates": {"gemv": 402.3, "mma 4x1x2x4x4": 251.0, ...}}}}

Version 2: the tensor-core kernels (tilings of 16-row m-tiles) and the op in the key (FC1 and FC2
of one shape, gpt-oss's 2880 x 2880, are different problems). Version 3: the weight layout in
the key (the split copy and the native bytes are different kernels). Version 4: the ``gemm``
entries. A version 3 file holds GEMV entries only, whose meaning version 4 keeps: it is read
as it is (:data:`READABLE_VERSIONS`) and rewritten as version 4 by the next store.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import pathlib
import tempfile
import warnings
from typing import Any

import numpy as np

from ..formats import Fp4Format
from .layouts import WeightLayout

__all__ = [
    "BUCKETS",
    "CACHE_VERSION",
    "GemmChoice",
    "OPS",
    "READABLE_VERSIONS",
    "ROWS_PER_EXPERT_BUCKETS",
    "cache_key",
    "cache_path",
    "clear_cache",
    "dtype_name",
    "gemm_cache_key",
    "row_bucket",
    "rows_per_expert_bucket",
    "store_results",
    "summary",
    "tuned_fields",
    "tuned_gemm",
]

#: Version of the file layout and entry meaning, written by :func:`store_results`.
CACHE_VERSION = 4
#: Versions read; files of any other version are ignored. Version 3 files hold GEMV entries of
#: the meaning version 4 keeps (version 4 only adds the ``gemm`` kind).
READABLE_VERSIONS = (3, 4)

OPS = ("fc1", "fc2")
#: Row buckets (expanded rows of one GEMV call; larger GEMV calls use the 64-row entry).
BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
#: Buckets of the average expanded rows per active expert (``gemm`` entries): powers of two, so
#: that a bucket spans at most a factor of two and every tile width of the kernels (bn 16, 32,
#: 128) and every threshold of the analytic tables (8, 64, 256 rows per expert) is a bucket edge:
#: no bucket straddles a hand-over of the analytic rule. Up to 2,048: gpt-oss-20b (32 experts,
#: top-4) at a prefill chunk of 16,384 tokens; above it the 2,048 entry serves (every block tile
#: is full there, and the kernels' cost grows in proportion to the rows).
ROWS_PER_EXPERT_BUCKETS: tuple[int, ...] = tuple(2**i for i in range(12))


def cache_path() -> pathlib.Path:
    """``$XDG_CACHE_HOME/cupymoe/gemv_tune.json`` (``~/.cache/cupymoe/gemv_tune.json``)."""
    return pathlib.Path(_default_file())


def _default_file() -> str:
    """:func:`cache_path` as text, built once per value of the two variables it reads (the
    lookups of every expert call ask for it)."""
    return _file_for(os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))


@functools.lru_cache(maxsize=8)
def _file_for(xdg_cache_home: str | None, home: str | None) -> str:
    base = xdg_cache_home or os.path.join(os.path.expanduser("~"), ".cache")
    return str(pathlib.Path(base) / "cupymoe" / "gemv_tune.json")


def row_bucket(rows: int) -> int:
    """The smallest bucket of :data:`BUCKETS` holding ``rows`` (rows above 64 map to 64).

    A bucket's winner is profiled at the bucket's own size, the largest count it serves.

    >>> [row_bucket(r) for r in (1, 2, 3, 5, 33, 64, 1000)]
    [1, 2, 4, 8, 64, 64, 64]
    """
    if isinstance(rows, bool) or not isinstance(rows, int | np.integer) or rows < 1:
        raise ValueError(f"rows: expected an integer >= 1, got {rows!r}")
    return next((b for b in BUCKETS if rows <= b), BUCKETS[-1])


def rows_per_expert_bucket(per_expert: float) -> int:
    """The smallest bucket of :data:`ROWS_PER_EXPERT_BUCKETS` holding ``per_expert`` (the
    average expanded rows per active expert, a fraction in general); above 2,048 the last.

    A bucket's winner is profiled at the bucket's own value, the largest average it serves.

    >>> [rows_per_expert_bucket(r) for r in (0.5, 1, 1.5, 8, 8.01, 100, 10**5)]
    [1, 1, 2, 8, 16, 128, 2048]
    """
    if (
        isinstance(per_expert, bool)
        or not isinstance(per_expert, int | float | np.number)
        or not per_expert > 0  # also NaN
    ):
        raise ValueError(f"per_expert: expected a number > 0, got {per_expert!r}")
    index = bisect.bisect_left(ROWS_PER_EXPERT_BUCKETS, per_expert)
    return ROWS_PER_EXPERT_BUCKETS[min(index, len(ROWS_PER_EXPERT_BUCKETS) - 1)]


def _format_name(fmt: Any) -> str:
    return Fp4Format.parse(fmt, "fmt").value


def dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name
    if name not in ("bfloat16", "float16"):
        raise TypeError(f"dtype: expected bfloat16 or float16 activations, got {name}")
    return name


def cache_key(
    *,
    device_name: str,
    fmt: Any,
    dtype: Any,
    n: int,
    k: int,
    rows: int,
    op: str = "fc2",
    layout: WeightLayout | str = WeightLayout.SPLIT,
) -> str:
    """The entry key: ``"<device>|<op>|<layout>|<format>|<dtype>|<N>|<K>|<row bucket>"``."""
    if op not in OPS:
        raise ValueError(f"op: expected 'fc1' or 'fc2', got {op!r}")
    return "|".join(
        (
            str(device_name),
            op,
            WeightLayout.parse(layout).key,
            _format_name(fmt),
            dtype_name(dtype),
            str(int(n)),
            str(int(k)),
            str(row_bucket(rows)),
        )
    )


def gemm_cache_key(
    *,
    device_name: str,
    op: str,
    fmt: Any,
    dtype: Any,
    n: int,
    k: int,
    n_experts: int,
    rows_per_expert: float,
) -> str:
    """The key of a ``gemm`` entry:
    ``"<device>|gemm|<op>|<format>|<dtype>|<N>|<K>|<experts>|<rows-per-expert bucket>"``.

    ``op``: ``"fc1"`` (gate and up, N = intermediate) or ``"fc2"`` (one matrix per expert: FC2,
    and FC1 of a non-gated activation), as in :func:`cache_key`; ``rows_per_expert``: the average
    expanded rows per active expert, mapped with :func:`rows_per_expert_bucket`.

    >>> gemm_cache_key(device_name="NVIDIA H200", op="fc1", fmt="nvfp4", dtype="bfloat16",
    ...                n=512, k=2048, n_experts=256, rows_per_expert=20.5)
    'NVIDIA H200|gemm|fc1|nvfp4|bfloat16|512|2048|256|32'
    """
    if op not in OPS:
        raise ValueError(f"op: expected 'fc1' or 'fc2', got {op!r}")
    return "|".join(
        (
            str(device_name),
            "gemm",
            op,
            _format_name(fmt),
            dtype_name(dtype),
            str(int(n)),
            str(int(k)),
            str(int(n_experts)),
            str(rows_per_expert_bucket(rows_per_expert)),
        )
    )


# ---- reading ------------------------------------------------------------------------------------
def _read_entries(path: pathlib.Path) -> dict[str, Any] | None:
    """Entries of a valid file; ``None`` (after one warning) for an unusable one or no file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as error:
        warnings.warn(f"cupymoe tune cache {path}: unreadable ({error}); ignoring it", stacklevel=3)
        return None
    try:
        data = json.loads(text)
    except ValueError as error:
        warnings.warn(f"cupymoe tune cache {path}: corrupt ({error}); ignoring it", stacklevel=3)
        return None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        warnings.warn(f"cupymoe tune cache {path}: no 'entries' table; ignoring it", stacklevel=3)
        return None
    if data.get("version") not in READABLE_VERSIONS:
        warnings.warn(
            f"cupymoe tune cache {path}: version {data.get('version')!r}, expected one of "
            f"{list(READABLE_VERSIONS)}; ignoring it (run `cupymoe tune` again)",
            stacklevel=3,
        )
        return None
    return data["entries"]


@functools.lru_cache(maxsize=8)
def _entries(path: str) -> dict[str, Any]:
    return _read_entries(pathlib.Path(path)) or {}


@functools.lru_cache(maxsize=4096)
def _lookup(path: str, problem: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...] | None:
    entry = _entries(path).get(cache_key(**dict(problem)))
    if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
        return None if entry is None else ()
    return tuple(sorted(entry["config"].items()))


def tuned_fields(
    *, path: str | os.PathLike[str] | None = None, **problem: Any
) -> dict[str, Any] | None:
    """The stored ``GemvConfig`` fields of a problem (``{"cta_n": 64, "threads": 128}``), or
    ``None`` when the cache has no entry; an entry without fields gives ``{}``.

    ``problem`` holds the keywords of :func:`cache_key` (``device_name``: the GPU's name, ``""``
    nowhere; ``fmt``; ``dtype``: the activation dtype; ``n``, ``k``; ``rows``: expanded rows,
    mapped with :func:`row_bucket`; ``op``: ``"fc1"`` or ``"fc2"``; ``layout``: the
    :class:`~.layouts.WeightLayout` the kernel reads). ``path``: the cache file (default
    :func:`cache_path`).

    Memoised: the file is parsed once per process (again after :func:`store_results` /
    :func:`clear_cache`). A missing or corrupt file means "no entry".
    """
    found = _lookup(str(path) if path else _default_file(), tuple(sorted(problem.items())))
    return None if found is None else dict(found)


#: A stored ``gemm`` choice as the lookups return it: the backend (``"gemv"``, ``"gemm"``; ``""``
#: for an entry without one) and the config fields, sorted (hashable, so its decoding memoises).
GemmChoice = tuple[str, tuple[tuple[str, Any], ...]]


@functools.lru_cache(maxsize=4096)
def _lookup_gemm(path: str, *problem: Any) -> GemmChoice | None:
    names = ("device_name", "op", "fmt", "dtype", "n", "k", "n_experts", "rows_per_expert")
    entry = _entries(path).get(gemm_cache_key(**dict(zip(names, problem, strict=True))))
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("backend"), str):
        return ("", ())
    fields = entry.get("config")
    if not isinstance(fields, dict):
        return (entry["backend"], ())
    if not all(isinstance(v, str | int | float | bool) or v is None for v in fields.values()):
        return ("", ())  # a hand-edited value (a list, a mapping): unusable, not unhashable
    return (entry["backend"], tuple(sorted(fields.items())))


def tuned_gemm(
    *,
    device_name: str,
    op: str,
    fmt: Any,
    dtype: Any,
    n: int,
    k: int,
    n_experts: int,
    rows_per_expert: float,
    path: str | os.PathLike[str] | None = None,
) -> GemmChoice | None:
    """The stored choice of a ``gemm`` problem (the keywords of :func:`gemm_cache_key`):
    ``("gemm", (("bn", 128), ("kind", "wgmma"), ("stages", 4)))`` or ``("gemv", ())``; ``None``
    when the cache has no entry; ``("", ())`` for an entry without a backend.

    The fields are not validated here (:func:`.handover.tuned_choice` builds the config and warns
    about a stale one). Memoised per bucket: a call costs a dictionary lookup (the file is parsed
    once per process, again after :func:`store_results` / :func:`clear_cache`).
    """
    return _lookup_gemm(
        str(path) if path else _default_file(),
        device_name,
        op,
        fmt,
        dtype,
        n,
        k,
        n_experts,
        rows_per_expert_bucket(rows_per_expert),
    )


def summary(path: str | os.PathLike[str] | None = None) -> dict[str, int]:
    """How many entries of each kind the cache file holds: ``{"gemv": 12, "gemm": 40}`` (both 0
    for a missing or unusable file)."""
    entries = _entries(str(path or cache_path()))
    gemm = sum(1 for key in entries if key.split("|")[1:2] == ["gemm"])
    return {"gemv": len(entries) - gemm, "gemm": gemm}


def clear_cache() -> None:
    """Forget the memoised file contents (the next lookup reads the file again)."""
    _lookup.cache_clear()
    _lookup_gemm.cache_clear()
    _entries.cache_clear()


# ---- writing ------------------------------------------------------------------------------------
def store_results(
    results: dict[str, dict[str, Any]], path: str | os.PathLike[str] | None = None
) -> pathlib.Path:
    """Merge ``results`` (key -> entry) into the cache file, atomically (temp file + replace).

    Entries of other keys are kept; an unusable old file is replaced.
    """
    target = pathlib.Path(path or cache_path())
    target.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unusable old file is simply overwritten
        entries = dict(_read_entries(target) or {})
    entries.update(results)
    text = json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1, sort_keys=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    clear_cache()
    return target
