# SPDX-License-Identifier: Apache-2.0
"""Optional GEMV autotuning: profile every tiling, keep the fastest in a JSON cache.

The cache (:func:`cache_path`, ``$XDG_CACHE_HOME/cupymoe/gemv_tune.json``) maps
``device | op | layout | format | dtype | N | K | row bucket`` (op: ``fc1`` or ``fc2``; layout:
the weight layout the kernel reads, :data:`~cupymoe.config.WEIGHT_LAYOUTS`) to the winning
:class:`~cupymoe.config.GemvConfig` fields and its time. ``GemvConfig.for_problem`` consults
it through :func:`lookup_tuned` after the ``CUPYMOE_GEMV_CONFIG`` override and before the
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

import dataclasses
import functools
import json
import os
import pathlib
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from ._backend import require_cupy
from ._timing import capture, median_event_us
from .config import WEIGHT_LAYOUTS
from .formats import Fp4Experts, Fp4Format

if TYPE_CHECKING:  # GemvConfig is imported where it is used: tests swap the config module
    from .config import GemvConfig

__all__ = [
    "BUCKETS",
    "CACHE_VERSION",
    "cache_key",
    "cache_path",
    "clear_cache",
    "count_trials",
    "device_name",
    "lookup_tuned",
    "random_fp4_gpu",
    "random_routing",
    "row_bucket",
    "store_results",
    "tune_gemv",
]

#: Version of the file layout and entry meaning; files of another version are ignored.
CACHE_VERSION = 3

_OPS = ("fc1", "fc2")
#: Row buckets (expanded rows of one GEMV call, up to the 64-row window).
BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)

#: ``progress(done, total, label)``: called with ``done = 0`` first, then after each trial.
ProgressFn = Callable[[int, int, str], None]


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


def _dtype_name(dtype: Any) -> str:
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
    layout: str = "split",
) -> str:
    """The entry key: ``"<device>|<op>|<layout>|<format>|<dtype>|<N>|<K>|<row bucket>"``."""
    if op not in _OPS:
        raise ValueError(f"op: expected 'fc1' or 'fc2', got {op!r}")
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"layout: expected one of {list(WEIGHT_LAYOUTS)}, got {layout!r}")
    return "|".join(
        (
            str(device_name),
            op,
            layout,
            _format_name(fmt),
            _dtype_name(dtype),
            str(int(n)),
            str(int(k)),
            str(row_bucket(rows)),
        )
    )


def device_name() -> str:
    """Name of the current CUDA device, as used in cache keys (``"NVIDIA H200"``)."""
    cupy = require_cupy()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


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
def _lookup(
    path: str,
    device_name: str,
    fmt: Any,
    dtype: Any,
    n: int,
    k: int,
    rows: int,
    op: str,
    layout: str,
) -> GemvConfig | None:
    key = cache_key(
        device_name=device_name, fmt=fmt, dtype=dtype, n=n, k=k, rows=rows, op=op, layout=layout
    )
    entry = _entries(path).get(key)
    if entry is None:
        return None
    from .config import GemvConfig

    try:
        return GemvConfig(**entry["config"])
    except (TypeError, ValueError, KeyError) as error:  # fields of an older GemvConfig
        warnings.warn(f"cupymoe tune cache {path}: entry {key!r} unusable ({error})", stacklevel=4)
        return None


def lookup_tuned(
    *,
    device_name: str,
    fmt: Any,
    dtype: Any,
    n: int,
    k: int,
    rows: int,
    op: str = "fc2",
    layout: str = "split",
    path: str | os.PathLike[str] | None = None,
) -> GemvConfig | None:
    """The tuned config for this problem, or ``None`` when the cache has none.

    Parameters
    ----------
    device_name : str
        GPU name (:func:`device_name`).
    fmt : Fp4Format or str
    dtype : dtype
        Activation dtype (bfloat16 or float16).
    n, k : int
        Output rows and reduction length of the GEMV.
    rows : int
        Expanded rows of the call; mapped with :func:`row_bucket`.
    op : {"fc1", "fc2"}
        Which GEMV (FC1 reads gate and up rows: twice the rows of the same N).
    layout : str
        The weight layout the kernel reads (:data:`~cupymoe.config.WEIGHT_LAYOUTS`).
    path : path, optional
        Cache file (default :func:`cache_path`).

    Notes
    -----
    Memoised per argument tuple: the file is parsed once per process (again after
    :func:`store_results` / :func:`clear_cache`). A missing or corrupt file means "no entry".
    """
    return _lookup(str(path or cache_path()), device_name, fmt, dtype, n, k, rows, op, layout)


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


# ---- random problems on the GPU ----------------------------------------------------------------
def _random_uint8(rs: Any, shape: tuple[int, ...], low: int, high: int) -> Any:
    """Uniform integers in ``[low, high]`` as a cupy uint8 array, made in bounded chunks."""
    cupy = require_cupy()
    out = cupy.empty(shape, dtype=cupy.uint8)
    flat = out.reshape(-1)
    step = 1 << 27
    for i in range(0, flat.size, step):
        count = min(step, flat.size - i)
        u = rs.random_sample(count, dtype=cupy.float32) * np.float32(high - low + 1) + low
        flat[i : i + count] = cupy.minimum(u, high).astype(cupy.uint8)
    return out


def random_fp4_gpu(n_experts: int, n: int, k: int, fmt: Any, *, seed: int = 0) -> Fp4Experts:
    """Random valid FP4 weights ``[n_experts, n, k]`` drawn on the GPU (for tuning and benchmarks).

    Codes are uniform bytes; block scales are E4M3 bytes 0x30..0x40 (0.5..2) or E8M0 bytes
    120..124 (2^-7..2^-3); NVFP4 global scales are 1/64. The arrays are copied once to the host
    (``Fp4Experts`` holds NumPy arrays); nothing is quantized on the host.
    """
    cupy = require_cupy()
    fmt = Fp4Format.parse(fmt, "fmt")
    rs = cupy.random.RandomState(seed)
    packed = _random_uint8(rs, (n_experts, n, k // 2), 0, 255)
    low, high = (0x30, 0x40) if fmt is Fp4Format.NVFP4 else (120, 124)
    scales = _random_uint8(rs, (n_experts, n, k // fmt.block_size), low, high)
    global_scale = np.full(n_experts, 1.0 / 64 if fmt is Fp4Format.NVFP4 else 1.0, np.float32)
    return Fp4Experts.from_packed(packed.get(), scales.get(), global_scale, format=fmt)


def random_routing(
    rng: np.random.Generator, n_tokens: int, top_k: int, n_experts: int, *, device: bool = True
) -> Any:
    """A ``Routing`` of ``n_tokens`` tokens, each sent to ``top_k`` distinct random experts.

    Built with NumPy by the contract of ``cupymoe.routing.Routing`` (expert-major, stable), with
    weights 1/top_k; CuPy arrays when ``device`` (else NumPy).
    """
    ids = np.argsort(rng.random((n_tokens, n_experts)), axis=1)[:, :top_k].astype(np.int32)
    flat = ids.reshape(-1)
    sorted_rows = np.argsort(flat, kind="stable").astype(np.int32)
    counts = np.bincount(flat, minlength=n_experts)
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
    inverse = np.empty_like(sorted_rows)
    inverse[sorted_rows] = np.arange(sorted_rows.size, dtype=np.int32)
    active = np.flatnonzero(counts).astype(np.int32)
    padded = np.full(min(flat.size, n_experts), -1, np.int32)
    padded[: active.size] = active
    fields: dict[str, Any] = dict(
        topk_ids=ids,
        topk_weights=np.full((n_tokens, top_k), 1.0 / top_k, np.float32),
        expert_offsets=offsets,
        sorted_rows=sorted_rows,
        inverse=inverse,
        active_experts=padded,
    )
    if device:
        cupy = require_cupy()
        fields = {name: cupy.asarray(a) for name, a in fields.items()}
    from .routing import Routing

    return Routing(**fields)


# ---- profiling ---------------------------------------------------------------------------------
def count_trials(shapes: Sequence[tuple[int, int]], *, fmt: Any, rows_list: Iterable[int]) -> int:
    """Number of (shape, bucket, candidate) timings :func:`tune_gemv` will run."""
    from .config import GemvConfig

    fmt = Fp4Format.parse(fmt, "fmt")
    buckets = sorted({row_bucket(r) for r in rows_list})
    return sum(len(GemvConfig.candidates(n=n, k=k, fmt=fmt)) * len(buckets) for n, k in shapes)


def _time_graph(calls: Callable[[], None], n_calls: int, *, warmup: int, repeats: int) -> float:
    """Median µs per call of ``calls`` (``n_calls`` GEMVs) captured into one CUDA graph."""
    stream = require_cupy().cuda.Stream(non_blocking=True)
    graph = capture(calls, stream)
    launch = functools.partial(graph.launch, stream)
    return median_event_us(launch, stream, repeats=repeats, warmup=warmup) / n_calls


def _run_sets(
    op: str, x: Any, sets: list[Any], routings: list[Any], out: Any, act: Any, config: Any
) -> None:
    """One GEMV per weight set (FC1 with ``act`` or FC2), all into ``out``."""
    from . import gemv

    for weights, routing in zip(sets, routings, strict=True):
        if op == "fc1":
            gemv.fc1(x, weights, routing, act=act, out=out, config=config)
        else:
            gemv.fc2(x, weights, routing, out=out, config=config)


def tune_gemv(
    shapes: Sequence[tuple[int, int]],
    *,
    fmt: Any,
    dtype: Any = ml_dtypes.bfloat16,
    rows_list: Iterable[int] = BUCKETS,
    op: str = "fc2",
    layout: str = "split",
    n_experts: int = 32,
    warmup: int = 3,
    repeats: int = 20,
    l2_defeat_bytes: int = 256 << 20,
    progress: ProgressFn | None = None,
    path: str | os.PathLike[str] | None = None,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Profile every ``GemvConfig.candidates`` tiling per shape and row bucket; store the winners.

    Parameters
    ----------
    shapes : list of (n, k)
        GEMV shapes: output rows N and reduction length K (``op="fc2"``: the down projection
        ``[E, N, K]``; ``op="fc1"``: gate and up, each ``[E, N, K]``, with SwiGLU).
    fmt : Fp4Format or str
    dtype : dtype
        Activation dtype (bfloat16 or float16).
    rows_list : iterable of int
        Expanded-row counts; each maps to its :func:`row_bucket` and is profiled at the bucket.
    op : {"fc2", "fc1"}
        Which GEMV of :mod:`cupymoe.gemv` runs the candidates.
    layout : str
        The weight layout timed (:data:`~cupymoe.config.WEIGHT_LAYOUTS`): ``"split"`` (the
        GEMV's own copy, the default of ``prepare_fc1`` / ``prepare_fc2``), or the native bytes
        in the ``"pair"`` (the default upload order) or ``"plain"`` nibble order.
    n_experts : int
        Experts per weight set (rows are routed to random distinct experts, top-k <= 8).
    warmup, repeats : int
        Graph replays before timing, and timed replays (the median is kept).
    l2_defeat_bytes : int
        Weight bytes one graph reads, so that the weights come from HBM rather than the 60 MB
        L2: enough weight sets to hold them, and enough calls, each routed to its own random
        experts, to read them (a call reads only its active experts).
    progress : callable, optional
        ``progress(done, total, label)``; ``done = 0`` first (the total for a progress bar).
    path : path, optional
        Cache file (default :func:`cache_path`).
    seed : int
        Seed of the random weights, activations and routing.

    Returns
    -------
    dict
        ``key -> {"config": {...}, "us": float, "op": str, "candidates": {label: us}}`` for every
        (shape, bucket); also merged into the cache file.

    Notes
    -----
    Each candidate is timed as a CUDA graph of GEMV calls rotating over the weight sets and
    routings (graph replay, no host launch cost), with CUDA events; µs per call is the median
    over ``repeats``.
    """
    cupy = require_cupy()
    from . import gemv
    from .config import GemvConfig

    fmt = Fp4Format.parse(fmt, "fmt")
    act_dtype = np.dtype(_dtype_name(dtype))
    if op not in ("fc1", "fc2"):
        raise ValueError(f"op: expected 'fc1' or 'fc2', got {op!r}")
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"layout: expected one of {list(WEIGHT_LAYOUTS)}, got {layout!r}")
    prepare = {
        "gemv_order": "split" if layout == "split" else "native",
        "pair_interleaved": layout != "plain",
    }
    buckets = sorted({row_bucket(r) for r in rows_list})
    total = count_trials(shapes, fmt=fmt, rows_list=buckets)
    done = 0
    if progress is not None:
        progress(0, total, "starting")
    name = device_name()
    rng = np.random.default_rng(seed)
    results: dict[str, dict[str, Any]] = {}
    for n, k in shapes:
        mats = 2 if op == "fc1" else 1
        expert_bytes = mats * n * (k // 2 + k // fmt.block_size)
        n_sets = max(1, min(64, -(-l2_defeat_bytes // (n_experts * expert_bytes))))
        sets = []
        for s in range(n_sets):
            weights = [
                random_fp4_gpu(n_experts, n, k, fmt, seed=seed + 7919 * s + m) for m in range(mats)
            ]
            sets.append(
                gemv.prepare_fc1(*weights, **prepare)  # type: ignore[arg-type]
                if op == "fc1"
                else gemv.prepare_fc2(*weights, **prepare)  # type: ignore[arg-type]
            )
        for bucket in buckets:
            top_k = min(8, bucket, n_experts)
            while bucket % top_k:
                top_k -= 1
            n_tokens = bucket // top_k
            # Calls (cycling over the sets) until they read l2_defeat_bytes: with many experts
            # one set holds the whole budget, and a single routing of it would re-read the same
            # few active experts from the L2 (Qwen FC1 at 32 rows: 256 experts, 1 set).
            active_bytes = min(bucket, n_experts) * expert_bytes
            n_calls = max(n_sets, min(64, -(-l2_defeat_bytes // active_bytes)))
            call_sets = [sets[i % n_sets] for i in range(n_calls)]
            routings = [random_routing(rng, n_tokens, top_k, n_experts) for _ in range(n_calls)]
            shape_in = (n_tokens, k) if op == "fc1" else (bucket, k)
            x = cupy.asarray(rng.standard_normal(shape_in).astype(act_dtype))
            out = cupy.empty((bucket, n), dtype=act_dtype)
            act = gemv.ActivationSpec(gemv.Activation.SWIGLU)
            timings: dict[str, float] = {}
            best: tuple[float, Any] | None = None
            for config in GemvConfig.candidates(n=n, k=k, fmt=fmt):
                calls = functools.partial(_run_sets, op, x, call_sets, routings, out, act, config)
                us = _time_graph(calls, n_calls, warmup=warmup, repeats=repeats)
                timings[repr(config)] = us
                if best is None or us < best[0]:
                    best = (us, config)
                done += 1
                if progress is not None:
                    progress(done, total, f"N={n} K={k} rows={bucket}")
            if best is None:
                continue
            key = cache_key(
                device_name=name,
                fmt=fmt,
                dtype=act_dtype,
                n=n,
                k=k,
                rows=bucket,
                op=op,
                layout=layout,
            )
            results[key] = {
                "config": dataclasses.asdict(best[1]),
                "us": round(best[0], 3),
                "op": op,
                "layout": layout,
                "candidates": {label: round(t, 3) for label, t in timings.items()},
            }
    store_results(results, path)
    return results
