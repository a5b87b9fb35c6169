# SPDX-License-Identifier: Apache-2.0
"""Launch configurations of the FP4 GEMV kernels: a frozen dataclass and its threshold table.

A GEMV block of ``threads`` threads owns ``cta_n`` weight rows of one expert (FC2: ``cta_n``
output columns; FC1: ``cta_n / 2`` columns, each with its gate and up row). Its threads form row
groups of four weight rows; the ``lanes_k = threads * 4 / cta_n`` lanes of a group split K in
chunks of 32 codes (one 16-byte load per row and chunk, two chunks in flight per lane) and reduce
with a warp-shuffle butterfly. ``lanes_k`` changes the summation order: each config is bitwise
deterministic, but two configs differ in the last bits.

Selection order in :meth:`GemvConfig.for_problem`: the environment variable
``CUPYMOE_GEMV_CONFIG`` (``"cta_n=32,threads=128"``) > the tune cache
(:func:`cupymoe.tune.lookup_tuned`) > the analytic table :data:`LANES_BY_CHUNKS`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .formats import Fp4Format

__all__ = ["ENV_GEMV_CONFIG", "LANES_BY_CHUNKS", "ROW_WINDOW", "TILINGS", "GemvConfig"]

#: Environment variable forcing one tiling for every GEMV call, e.g. ``"cta_n=32,threads=128"``.
ENV_GEMV_CONFIG = "CUPYMOE_GEMV_CONFIG"

#: Expanded rows above which fc1/fc2 switch to the batched (dequantize + cuBLAS) path.
ROW_WINDOW = 64

#: Codes per lane per load (16 bytes) and weight rows per row group: fixed by the kernel.
CHUNK = 32
ROWS_PER_GROUP = 4

#: Every (cta_n, threads) the kernels are compiled for (kernel_specs lists all of them).
#: 128 threads: 4 warps, 128 registers per thread -> 4 blocks (16 warps) per SM on sm_90.
TILINGS: tuple[tuple[int, int], ...] = ((16, 128), (32, 128), (64, 128))

#: Analytic table: (largest number of 32-code chunks along K, lanes_k). Each lane keeps two chunks
#: of its four rows in flight (8 x 16 B), so lanes_k ~ chunks / 2 puts the whole row in flight in
#: one iteration while no lane idles. To be measured on the H200:
#:  * chunks <= 16 (K <= 512, Qwen FC2): 8 lanes, 64 rows per block;
#:  * chunks <= 32 (K <= 1024): 16 lanes;
#:  * longer K (FC1 of every preset, gpt-oss / DeepSeek FC2): 32 lanes, 16 rows per block, which
#:    also gives the most blocks for the small-N FC1 of Qwen (2 x 512 rows x 8 experts = 512).
LANES_BY_CHUNKS: tuple[tuple[int, int], ...] = ((16, 8), (32, 16))
_DEFAULT_LANES = 32
_DEFAULT_THREADS = 128


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

    @property
    def lanes_k(self) -> int:
        """Lanes that split K for one row group (a power of two <= 32)."""
        return self.threads * ROWS_PER_GROUP // self.cta_n

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
    def analytic(*, n: int, k: int, rows: int, fmt: Any) -> GemvConfig:
        """The threshold-table choice (no environment, no cache); see :data:`LANES_BY_CHUNKS`.

        ``n`` and ``rows`` do not change the choice today: every tiling keeps 4 rows per group and
        the row dimension is handled in registers, so only K decides how many lanes can work.
        """
        Fp4Format.parse(fmt, "fmt")
        chunks = -(-int(k) // CHUNK)
        lanes = next((lanes for limit, lanes in LANES_BY_CHUNKS if chunks <= limit), _DEFAULT_LANES)
        return GemvConfig(_DEFAULT_THREADS * ROWS_PER_GROUP // lanes, _DEFAULT_THREADS)

    @classmethod
    def for_problem(
        cls, *, n: int, k: int, rows: int, fmt: Any, device_name: str, dtype: Any = None
    ) -> GemvConfig:
        """The config for one GEMV call: environment > tune cache > analytic table.

        Parameters
        ----------
        n, k : int
            Output rows N of each weight matrix and the reduction length K.
        rows : int
            Expanded rows of the call.
        fmt : Fp4Format or str
        device_name : str
            GPU name (the tune-cache key); ``""`` skips the cache.
        dtype : dtype, optional
            Activation dtype (the tune-cache key); ``None`` skips the cache.
        """
        env = os.environ.get(ENV_GEMV_CONFIG, "").strip()
        if env:
            return cls.parse(env)
        if device_name and dtype is not None:
            from .tune import lookup_tuned

            tuned = lookup_tuned(device_name=device_name, fmt=fmt, dtype=dtype, n=n, k=k, rows=rows)
            if tuned is not None:
                return tuned
        return cls.analytic(n=n, k=k, rows=rows, fmt=fmt)

    @staticmethod
    def candidates(*, n: int, k: int, fmt: Any) -> list[GemvConfig]:
        """Every tiling worth timing for the shape (lanes beyond the K chunks would idle)."""
        Fp4Format.parse(fmt, "fmt")
        chunks = -(-int(k) // CHUNK)
        configs = [GemvConfig(c, t) for c, t in TILINGS]
        useful = [c for c in configs if c.lanes_k <= max(chunks, min(x.lanes_k for x in configs))]
        return useful or configs
