# SPDX-License-Identifier: Apache-2.0
"""Launch configurations of the FP4 GEMV kernels: a frozen dataclass and its threshold table.

A GEMV block of ``threads`` threads (``threads / 32`` warps splitting K) owns ``cta_n`` weight
rows of one expert, ``cta_n / 16`` tensor-core m-tiles (FC2: ``cta_n`` output columns; FC1:
``cta_n / 2`` columns, each with its gate and up row). Larger tiles share each activation load
among more weight rows; smaller tiles give more blocks to small problems. The warps' partial sums
are added in a fixed order: each config is bitwise deterministic, two configs differ in the last
bits.

Selection order in :meth:`GemvConfig.for_problem`: the environment variable
``CUPYMOE_GEMV_CONFIG`` (``"cta_n=32,threads=128"``) > the tune cache (:func:`lookup_tuned`,
reading :mod:`.cache`; ``cupymoe tune`` writes it) > the analytic table :data:`BLOCKS_FOR_CTA_N`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from ..formats import Fp4Format
from . import cache
from .layouts import CHUNK, WeightLayout

__all__ = [
    "BLOCKS_FOR_CTA_N",
    "ENV_GEMV_CONFIG",
    "TILINGS",
    "WIDE_MAX_BLOCKS",
    "GemvConfig",
    "lookup_tuned",
]

#: Environment variable forcing one tiling for every GEMV call, e.g. ``"cta_n=32,threads=128"``.
ENV_GEMV_CONFIG = "CUPYMOE_GEMV_CONFIG"

#: Every (cta_n, threads) the kernels are compiled for (kernel_specs lists all of them). The warps
#: of a block split K. 4 warps: at most 128 registers per thread at cta_n 64 (4 blocks, 16 warps
#: per SM), 80 at cta_n <= 32 (6 blocks, 24 warps); 8 warps at cta_n 32: 3 blocks, 24 warps.
TILINGS: tuple[tuple[int, int], ...] = ((16, 128), (32, 128), (64, 128), (32, 256))

#: Analytic table: (blocks the launch must have at least, cta_n), largest tile first; blocks =
#: ceil(weight rows / cta_n) x active experts (weight rows: N, or 2N for FC1's gate + up). Measured
#: on the H200 (``benchmarks/bench_gemv.py``, bf16, µs per call, cta_n 16 / 32 / 64; blocks at 64):
#:  * Qwen FC1 M=1: 8.2 / 8.5 / 10.3 (128 blocks) -> 16; M=4: 21.7 / 21.3 / 20.6 (480) -> 64;
#:  * Qwen FC2 M=1: 7.6 / 5.2 / 5.6 (256; 512 at 32) -> 32; M=4: 21.9 / 14.0 / 12.8 (960) -> 64;
#:  * gpt-oss FC2 M=1: 13.8 / 13.2 / 16.7 (180; 360 at 32) -> 32;
#:  * DeepSeek FC1 / FC2 M=1: 61.8 / 62.3 / 60.0 (512) and 35.6 / 33.7 / 32.9 (896) -> 64.
#: (gpt-oss FC2 at M=4 / 8 runs 4-7 % faster at 32 than the 64 chosen here; ``cupymoe tune``.)
BLOCKS_FOR_CTA_N: tuple[tuple[int, int], ...] = ((480, 64), (300, 32))
#: Where the table picks cta_n 32 for at most this many blocks (3 blocks of 8 warps per SM x 132
#: SMs: one wave) and K has at least 64 chunks (two steps of 8 warps x 4 chunks), the blocks get 8
#: warps instead of 4: twice the warps on the SMs of a launch that fills under half a wave.
#: gpt-oss FC2 at M = 1 (360 blocks, K 2880), H200: 10.86 -> 9.12 µs.
WIDE_MAX_BLOCKS = 396
_WIDE_MIN_K = 64 * CHUNK
_SMALLEST_CTA_N = 16
_DEFAULT_THREADS = 128
_WIDE_THREADS = 256


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One tiling of the GEMV kernels: ``cta_n`` weight rows per block, ``threads`` per block."""

    cta_n: int
    threads: int

    def __post_init__(self) -> None:
        for name in ("cta_n", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected int, got {type(value).__name__}")
        if (self.cta_n, self.threads) not in TILINGS:
            raise ValueError(
                f"GemvConfig: (cta_n, threads) = ({self.cta_n}, {self.threads}) is not compiled; "
                f"expected one of {list(TILINGS)}"
            )

    @classmethod
    def parse(cls, text: str, name: str = ENV_GEMV_CONFIG) -> GemvConfig:
        """``"cta_n=32,threads=128"`` -> ``GemvConfig(32, 128)``; ``ValueError`` naming ``name``."""
        fields: dict[str, int] = {}
        try:
            for item in filter(None, (s.strip() for s in text.split(","))):
                key, value = (t.strip() for t in item.split("="))
                if key not in ("cta_n", "threads") or key in fields:
                    raise ValueError(f"unknown or repeated field {key!r}")
                fields[key] = int(value)
            return cls(**fields)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{name}: expected 'cta_n=<int>,threads=<int>' with (cta_n, threads) in "
                f"{list(TILINGS)}, got {text!r} ({error})"
            ) from None

    @staticmethod
    def analytic(
        *, n: int, k: int, rows: int, gated: bool = False, n_experts: int | None = None
    ) -> GemvConfig:
        """The threshold-table choice (no environment, no cache); see :data:`BLOCKS_FOR_CTA_N`.

        ``rows`` expanded rows touch at most ``min(rows, n_experts)`` experts (the table counts
        that many); ``gated`` doubles the weight rows (FC1); ``k`` only matters for
        :data:`WIDE_MAX_BLOCKS`. The format does not enter: both read the same bytes per code.
        """
        weight_rows = int(n) * (2 if gated else 1)
        active = int(rows) if n_experts is None else min(int(rows), int(n_experts))
        for min_blocks, cta_n in BLOCKS_FOR_CTA_N:
            blocks = -(-weight_rows // cta_n) * active
            if blocks >= min_blocks:
                if cta_n == 32 and blocks <= WIDE_MAX_BLOCKS and int(k) >= _WIDE_MIN_K:
                    return GemvConfig(cta_n, _WIDE_THREADS)
                return GemvConfig(cta_n, _DEFAULT_THREADS)
        return GemvConfig(_SMALLEST_CTA_N, _DEFAULT_THREADS)

    @classmethod
    def for_problem(
        cls,
        *,
        n: int,
        k: int,
        rows: int,
        fmt: Any,
        device_name: str,
        dtype: Any = None,
        gated: bool = False,
        n_experts: int | None = None,
        layout: WeightLayout | str = WeightLayout.SPLIT,
    ) -> GemvConfig:
        """The config for one GEMV call: environment > tune cache > analytic table.

        Parameters
        ----------
        n, k : int
            Output rows N of each weight matrix and the reduction length K.
        rows : int
            Expanded rows of the call.
        fmt : Fp4Format or str
            The weight format (the tune-cache key).
        device_name : str
            GPU name (the tune-cache key); ``""`` skips the cache.
        dtype : dtype, optional
            Activation dtype (the tune-cache key); ``None`` skips the cache.
        gated, n_experts : optional
            FC1 (gate + up rows) and the expert count, for the analytic table.
        layout : WeightLayout
            The weight layout the kernel reads (the tune-cache key).
        """
        fmt = Fp4Format.parse(fmt, "fmt")
        env = os.environ.get(ENV_GEMV_CONFIG, "").strip()
        if env:
            return cls.parse(env)
        if device_name and dtype is not None:
            tuned = lookup_tuned(
                device_name=device_name,
                fmt=fmt,
                dtype=dtype,
                n=n,
                k=k,
                rows=rows,
                op="fc1" if gated else "fc2",
                layout=layout,
            )
            if tuned is not None:
                return tuned
        return cls.analytic(n=n, k=k, rows=rows, gated=gated, n_experts=n_experts)

    @staticmethod
    def candidates() -> list[GemvConfig]:
        """Every tiling worth timing: all of :data:`TILINGS` (each fits any N and K)."""
        return [GemvConfig(c, t) for c, t in TILINGS]


def lookup_tuned(*, path: Any = None, **problem: Any) -> GemvConfig | None:
    """The tuned config of a problem (the keywords of :func:`.cache.tuned_fields`), or ``None``
    when the cache has none or its entry no longer makes a valid :class:`GemvConfig` (then with
    a warning)."""
    fields = cache.tuned_fields(**problem, path=path)
    if fields is None:
        return None
    try:
        return GemvConfig(**fields)
    except (TypeError, ValueError) as error:  # fields of an older GemvConfig
        where = path or cache.cache_path()
        warnings.warn(f"cupymoe tune cache {where}: entry unusable ({error})", stacklevel=3)
        return None
