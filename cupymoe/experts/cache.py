# SPDX-License-Identifier: Apache-2.0
"""The GEMV tuning cache: a JSON file of the fastest tiling per problem (written by :mod:`.tune`).

The cache (:func:`cache_path`, ``$XDG_CACHE_HOME/cupymoe/gemv_tune.json``) maps
``device | op | layout | format | dtype | N | K | row bucket`` (op: ``fc1`` or ``fc2``; layout:
the weight layout the kernel reads, :attr:`.layouts.WeightLayout.key`) to the winning
:class:`~.config.GemvConfig` fields and its time. ``GemvConfig.for_problem`` consults
it (:func:`tuned_fields`) after the ``CUPYMOE_GEMV_CONFIG`` override and before the
analytic table, so tuning is never required. A missing, unreadable or outdated file is ignored
(with one warning per file) and the analytic table applies.

File layout (``version`` changes whenever the meaning of an entry changes)::

    {"version": 3,
     "entries": {"NVIDIA H200|fc1|split|nvfp4|bfloat16|512|2048|8":
                     {"config": {"cta_n": 64, "threads": 128}, "us": 16.7, "op": "fc1"}}}

Version 2: the tensor-core kernels (tilings of 16-row m-tiles) and the op in the key (FC1 and FC2
of one shape, gpt-oss's 2880 x 2880, are different problems). Version 3: the weight layout in
the key (the split copy and the native bytes are different kernels).
"""

from __future__ import annotations

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
    "OPS",
    "cache_key",
    "cache_path",
    "clear_cache",
    "dtype_name",
    "row_bucket",
    "store_results",
    "tuned_fields",
]

#: Version of the file layout and entry meaning; files of another version are ignored.
CACHE_VERSION = 3

OPS = ("fc1", "fc2")
#: Row buckets (expanded rows of one GEMV call; larger GEMV calls use the 64-row entry).
BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


def cache_path() -> pathlib.Path:
    """``$XDG_CACHE_HOME/cupymoe/gemv_tune.json`` (``~/.cache/cupymoe/gemv_tune.json``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "cupymoe" / "gemv_tune.json"


def row_bucket(rows: int) -> int:
    """The smallest bucket of :data:`BUCKETS` holding ``rows`` (rows above 64 map to 64).

    A bucket's winner is profiled at the bucket's own size, the largest count it serves.

    >>> [row_bucket(r) for r in (1, 2, 3, 5, 33, 64, 1000)]
    [1, 2, 4, 8, 64, 64, 64]
    """
    if isinstance(rows, bool) or not isinstance(rows, int | np.integer) or rows < 1:
        raise ValueError(f"rows: expected an integer >= 1, got {rows!r}")
    return next((b for b in BUCKETS if rows <= b), BUCKETS[-1])


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
    if data.get("version") != CACHE_VERSION:
        warnings.warn(
            f"cupymoe tune cache {path}: version {data.get('version')!r}, expected "
            f"{CACHE_VERSION}; ignoring it (run `cupymoe tune` again)",
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
    found = _lookup(str(path or cache_path()), tuple(sorted(problem.items())))
    return None if found is None else dict(found)


def clear_cache() -> None:
    """Forget the memoised file contents (the next lookup reads the file again)."""
    _lookup.cache_clear()
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
