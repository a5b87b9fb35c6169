# SPDX-License-Identifier: Apache-2.0
"""The one kernel loader: ``KernelSpec`` -> compiled CuPy function.

Only this module calls ``cupy.RawModule``. It

* builds the ``name_expressions`` string in one place (:attr:`KernelSpec.expression`);
* inlines the package's own headers into the source text, because CuPy's disk cache hashes the
  source text and not files reached through ``-I`` (cupy#941), so a header edit must change it;
* compiles one module per specialisation, lazily, memoised per device and safe to call from
  several threads at once (each specialisation compiles once);
* names the C++ spelling of every dtype a kernel is specialised for (:data:`CTYPE`);
* compiles the specialisations that need an architecture-specific target (``sm_90a`` for
  ``wgmma``, :attr:`KernelSpec.target`) through NVRTC itself, because CuPy always adds its own
  ``-arch`` for the device and NVRTC refuses a second one: the cubin is cached on disk
  (:func:`kernel_cache_dir`) and loaded with ``cupy.RawModule(path=...)``.

:mod:`.offline` compiles the same text through NVRTC for a named architecture with no GPU
present, which CI uses to prove that every specialisation compiles for sm_80 … sm_120.

Every stage module lists the specialisations its dispatcher can select in a function
``kernel_specs()``; :data:`SPEC_MODULES` names those modules.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.resources
import os
import pathlib
import re
import tempfile
import threading
from typing import Any

import ml_dtypes
import numpy as np

from .backend import require_cupy

__all__ = [
    "CTYPE",
    "ENV_KERNEL_CACHE",
    "ENV_LINEINFO",
    "SPEC_MODULES",
    "KernelSpec",
    "all_kernel_specs",
    "compile_options",
    "get_kernel",
    "get_kernel_with_smem",
    "kernel_cache_dir",
    "kernel_source",
    "nvrtc_module",
    "nvrtc_options",
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

#: Environment variable: the directory of the cubins of architecture-specific specialisations
#: (default ``$XDG_CACHE_HOME/cupymoe/kernels``, else ``~/.cache/cupymoe/kernels``).
ENV_KERNEL_CACHE = "CUPYMOE_KERNEL_CACHE"

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
    template arguments in their C++ spelling (``"__nv_bfloat16"``, ``128``, ``True``);
    ``target`` an architecture-specific NVRTC target the kernel needs (``"sm_90a"``), or ``""``
    for the current device's own architecture.
    """

    stage: str
    name: str
    args: tuple[str | int | bool, ...] = ()
    target: str = ""

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


def nvrtc_module() -> Any:
    """CuPy's NVRTC bindings (``cupy_backends.cuda.libs.nvrtc``)."""
    require_cupy()
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc


def _cuda_include_dirs() -> list[str]:
    """Directories holding ``cuda_fp16.h`` / ``cuda_bf16.h`` for a compile outside CuPy."""
    dirs: list[str] = []
    try:
        import cuda.pathfinder as pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            dirs.append(str(found))
    except Exception:  # cuda-pathfinder absent or too old
        pass
    home = os.environ.get("CUDA_PATH") or os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    if os.path.isdir(os.path.join(home, "include")):
        dirs.append(os.path.join(home, "include"))
    return dirs


def nvrtc_options(arch: str) -> list[str]:
    """NVRTC options of a compile outside CuPy for ``arch`` (``"sm_90a"``): the loader's, plus
    ``-ftz=true`` as CuPy adds, plus the CUDA header directories."""
    return [
        f"--gpu-architecture={arch}",
        *compile_options(),
        "-ftz=true",
        *(f"-I{d}" for d in _cuda_include_dirs()),
    ]


def kernel_cache_dir() -> pathlib.Path:
    """Where the cubins of architecture-specific specialisations are kept
    (:data:`ENV_KERNEL_CACHE`)."""
    configured = os.environ.get(ENV_KERNEL_CACHE)
    if configured:
        return pathlib.Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "cupymoe" / "kernels"


def _target_cubin(spec: KernelSpec) -> tuple[str, str]:
    """Compile ``spec`` for ``spec.target`` (once: cached on disk by source, options, NVRTC
    version and name); returns (cubin path, lowered name)."""
    nvrtc = nvrtc_module()
    source = kernel_source(spec.stage)
    options = nvrtc_options(spec.target)
    digest = hashlib.sha256(
        "\0".join([source, *options, spec.expression, repr(nvrtc.getVersion())]).encode()
    ).hexdigest()[:32]
    directory = kernel_cache_dir()
    cubin, name = directory / f"{digest}.cubin", directory / f"{digest}.name"
    if cubin.is_file() and name.is_file():
        return str(cubin), name.read_text(encoding="utf-8")
    program = nvrtc.createProgram(source, f"{spec.stage}.cu", [], [])
    try:
        nvrtc.addNameExpression(program, spec.expression)
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program)
            raise RuntimeError(
                f"{spec.expression} failed to compile for {spec.target}:\n{log}"
            ) from error
        lowered = nvrtc.getLoweredName(program, spec.expression)
        binary = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    directory.mkdir(parents=True, exist_ok=True)
    # Written under temporary names and renamed: a concurrent reader sees whole files or none.
    for path, data in ((cubin, binary), (name, lowered.encode())):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return str(cubin), lowered


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
            if spec.target:
                path, lowered = _target_cubin(spec)
                kernel = cupy.RawModule(path=path).get_function(lowered)
            else:
                module = cupy.RawModule(
                    code=kernel_source(spec.stage),
                    options=compile_options(),
                    name_expressions=(spec.expression,),
                )
                kernel = module.get_function(spec.expression)
            _kernels[key] = kernel
        return kernel


_smem_limits: dict[tuple[int, KernelSpec], int] = {}


def get_kernel_with_smem(spec: KernelSpec, dynamic_bytes: int) -> Any:
    """:func:`get_kernel`, with the kernel's dynamic shared-memory limit raised to at least
    ``dynamic_bytes`` (a launch whose static and dynamic shared memory exceed 48 KB needs it;
    the attribute is the kernel's, so it is set once per device and size)."""
    kernel = get_kernel(spec)
    key = (require_cupy().cuda.Device().id, spec)
    if _smem_limits.get(key, 0) < dynamic_bytes:
        kernel.max_dynamic_shared_size_bytes = dynamic_bytes
        _smem_limits[key] = dynamic_bytes
    return kernel


_resident: dict[tuple[int, KernelSpec, int, int], int] = {}


def resident_blocks(spec: KernelSpec, threads: int, dynamic_bytes: int = 0) -> int:
    """Blocks of ``threads`` threads (and ``dynamic_bytes`` of dynamic shared memory) that one SM
    holds at once (the occupancy calculator; cached per device). ``ValueError`` where not even one
    fits."""
    key = (require_cupy().cuda.Device().id, spec, threads, dynamic_bytes)
    if key not in _resident:
        kernel = get_kernel_with_smem(spec, dynamic_bytes)
        blocks = require_cupy().cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.kernel.ptr, threads, dynamic_bytes
        )
        if blocks < 1:
            raise ValueError(
                f"{spec.expression}: {threads} threads and {dynamic_bytes} bytes of shared "
                "memory do not fit one SM"
            )
        _resident[key] = int(blocks)
    return _resident[key]


def all_kernel_specs() -> list[KernelSpec]:
    """Every specialisation any dispatcher of the package can select, without duplicates."""
    specs: dict[KernelSpec, None] = {}
    for name in SPEC_MODULES:
        module = importlib.import_module(name)
        for spec in module.kernel_specs():
            specs[spec] = None
    return list(specs)
