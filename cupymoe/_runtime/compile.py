# SPDX-License-Identifier: Apache-2.0
"""The one kernel loader: ``KernelSpec`` -> compiled CuPy function.

Only this module calls ``cupy.RawModule``. It

* builds the ``name_expressions`` string in one place (:attr:`KernelSpec.expression`);
* inlines the package's own headers into the source text, because CuPy's disk cache hashes the
  source text and not files reached through ``-I`` (cupy#941), so a header edit must change it;
* compiles one module per specialisation, lazily, memoised per device and safe to call from
  several threads at once (each specialisation compiles once);
* names the C++ spelling of every dtype a kernel is specialised for (:data:`CTYPE`).

:mod:`.offline` compiles the same text through NVRTC for a named architecture with no GPU
present, which CI uses to prove that every specialisation compiles for sm_80 … sm_120.

Every stage module lists the specialisations its dispatcher can select in a function
``kernel_specs()``; :data:`SPEC_MODULES` names those modules.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.resources
import os
import re
import threading
from typing import Any

import ml_dtypes
import numpy as np

from .backend import require_cupy

__all__ = [
    "CTYPE",
    "ENV_LINEINFO",
    "SPEC_MODULES",
    "KernelSpec",
    "all_kernel_specs",
    "compile_options",
    "get_kernel",
    "kernel_source",
]

#: Modules that define ``kernel_specs() -> list[KernelSpec]``; every spec they list is compiled
#: offline by the test suite.
SPEC_MODULES: tuple[str, ...] = (
    "cupymoe.experts.dequant",
    "cupymoe.routing.topk",
    "cupymoe.routing.maps",
    "cupymoe.layer.expand",
    "cupymoe.layer.finalize",
    "cupymoe.experts.gemv",
    "cupymoe.experts.gemm",
    "cupymoe.parallel.kernels",
)

#: The C++ spelling of each dtype a kernel template takes (``T``, ``TOut``, ...): the one table.
CTYPE: dict[np.dtype, str] = {
    np.dtype(np.float32): "float",
    np.dtype(np.float16): "__half",
    np.dtype(ml_dtypes.bfloat16): "__nv_bfloat16",
}

#: Environment variable: ``1`` adds ``-lineinfo`` (for compute-sanitizer and Nsight Compute).
ENV_LINEINFO = "CUPYMOE_LINEINFO"

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)


def _cpp_literal(arg: str | int | bool) -> str:
    if isinstance(arg, bool):  # before int: bool is a subclass of int
        return "true" if arg else "false"
    if isinstance(arg, int):
        return str(arg)
    if isinstance(arg, str) and arg:
        return arg
    raise TypeError(f"template argument: expected str, int or bool, got {arg!r}")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One template specialisation of one ``__global__`` function.

    ``stage`` names the file ``cupymoe/cuda/<stage>.cu``; ``name`` the template; ``args`` the
    template arguments in their C++ spelling (``"__nv_bfloat16"``, ``128``, ``True``).
    """

    stage: str
    name: str
    args: tuple[str | int | bool, ...] = ()

    @property
    def expression(self) -> str:
        """The C++ name expression; the ONLY place it is built (CuPy maps it by exact text)."""
        if not self.args:
            return self.name
        return f"{self.name}<{', '.join(_cpp_literal(a) for a in self.args)}>"


def _read_cuda_file(name: str) -> str:
    return (importlib.resources.files("cupymoe") / "cuda" / name).read_text(encoding="utf-8")


def _inline(text: str, seen: set[str]) -> str:
    def replace(match: re.Match[str]) -> str:
        header = match.group(1)
        if header in seen:  # every header is include-once
            return f"// {header}: already inlined"
        seen.add(header)
        return f"// begin {header}\n{_inline(_read_cuda_file(header), seen)}\n// end {header}"

    return _INCLUDE.sub(replace, text)


_source_lock = threading.Lock()
_source_cache: dict[str, str] = {}


def kernel_source(stage: str) -> str:
    """The source text of ``cuda/<stage>.cu`` with the package's ``"..."`` headers inlined."""
    with _source_lock:
        if stage not in _source_cache:
            _source_cache[stage] = _inline(_read_cuda_file(f"{stage}.cu"), set())
        return _source_cache[stage]


def compile_options() -> tuple[str, ...]:
    """NVRTC options used for every kernel (the offline compile adds the target and ``-I``)."""
    options: tuple[str, ...] = ("-std=c++17",)
    if os.environ.get(ENV_LINEINFO, "0") == "1":
        options += ("-lineinfo",)
    return options


_kernel_lock = threading.Lock()
_kernels: dict[tuple[int, KernelSpec], Any] = {}


def get_kernel(spec: KernelSpec) -> Any:
    """Compile (once per device and process) and return the ``cupy.RawKernel`` for ``spec``."""
    cupy = require_cupy()
    key = (cupy.cuda.Device().id, spec)
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    with _kernel_lock:  # first use from several threads compiles once
        kernel = _kernels.get(key)
        if kernel is None:
            module = cupy.RawModule(
                code=kernel_source(spec.stage),
                options=compile_options(),
                name_expressions=(spec.expression,),
            )
            kernel = module.get_function(spec.expression)
            _kernels[key] = kernel
        return kernel


def all_kernel_specs() -> list[KernelSpec]:
    """Every specialisation any dispatcher of the package can select, without duplicates."""
    specs: dict[KernelSpec, None] = {}
    for name in SPEC_MODULES:
        module = importlib.import_module(name)
        for spec in module.kernel_specs():
            specs[spec] = None
    return list(specs)
