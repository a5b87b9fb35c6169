# SPDX-License-Identifier: Apache-2.0
"""The one kernel loader: ``KernelSpec`` -> compiled CuPy function.

Only this module calls ``cupy.RawModule``. It

* builds the ``name_expressions`` string in one place (:attr:`KernelSpec.expression`);
* inlines the package's own headers into the source text, because CuPy's disk cache hashes the
  source text and not files reached through ``-I`` (cupy#941), so a header edit must change it;
* compiles one module per specialisation, lazily, memoised per device and safe to call from
  several threads at once (each specialisation compiles once);
* compiles any list of specialisations **offline** through NVRTC for a named architecture with
  no GPU present (:func:`compile_offline`), which CI uses to prove that every specialisation the
  dispatchers can select compiles for sm_80 … sm_120, with no local-memory spills.

Every stage module lists the specialisations its dispatcher can select in a function
``kernel_specs()``; :data:`SPEC_MODULES` names those modules.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import importlib.resources
import multiprocessing
import os
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from ._backend import require_cupy

__all__ = [
    "KernelSpec",
    "OfflineResult",
    "all_kernel_specs",
    "compile_offline",
    "compile_options",
    "get_kernel",
    "kernel_source",
    "offline_options",
    "supported_offline_archs",
]

#: Modules that define ``kernel_specs() -> list[KernelSpec]``; every spec they list is compiled
#: offline by the test suite.
SPEC_MODULES: tuple[str, ...] = (
    "cupymoe.dequant",
    "cupymoe.routing",
    "cupymoe.expand",
    "cupymoe.finalize",
    "cupymoe.gemv",
)

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


# --------------------------------------------------------------------------------------------
# Offline compile (NVRTC only, no GPU, no CUDA driver)
# --------------------------------------------------------------------------------------------

_PTXAS_USAGE = re.compile(
    r"Function properties for (?P<name>\S+)\s*\n.*?(?P<stack>\d+) bytes stack frame, "
    r"(?P<spill_st>\d+) bytes spill stores, (?P<spill_ld>\d+) bytes spill loads"
    r"(?:.*?\n.*?Used (?P<regs>\d+) registers)?",
    re.DOTALL,
)


@dataclasses.dataclass(frozen=True)
class OfflineResult:
    """What ptxas reported for one specialisation compiled offline."""

    spec: KernelSpec
    arch: str
    lowered_name: str
    registers: int
    stack_bytes: int
    spill_bytes: int  # spill stores + spill loads


def _nvrtc() -> Any:
    require_cupy()
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc


def _cuda_include_dirs() -> list[str]:
    """Directories holding ``cuda_fp16.h`` / ``cuda_bf16.h`` for an offline compile."""
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


def supported_offline_archs() -> list[str]:
    """The ``sm_XX`` targets this NVRTC can generate code for."""
    return [f"sm_{a}" for a in _nvrtc().getSupportedArchs()]


def offline_options(arch: str) -> list[str]:
    """NVRTC options of an offline compile for ``arch``: the loader's, plus ``-ftz=true`` as CuPy
    adds, plus the CUDA header directories."""
    return [
        f"--gpu-architecture={arch}",
        *compile_options(),
        "-ftz=true",
        *(f"-I{d}" for d in _cuda_include_dirs()),
    ]


def _compile_program(
    stage: str, specs: Sequence[KernelSpec], arch: str, options: list[str]
) -> list[OfflineResult]:
    """One NVRTC program of ``stage`` holding ``specs``: compile it, read the ptxas report."""
    nvrtc = _nvrtc()
    program = nvrtc.createProgram(kernel_source(stage), f"{stage}.cu", [], [])
    try:
        for spec in specs:
            nvrtc.addNameExpression(program, spec.expression)
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program)
            raise RuntimeError(f"{stage}.cu failed to compile for {arch}:\n{log}") from error
        log = nvrtc.getProgramLog(program)
        usage = {m.group("name"): m for m in _PTXAS_USAGE.finditer(log)}
        results = []
        for spec in specs:
            lowered = nvrtc.getLoweredName(program, spec.expression)
            m = usage.get(lowered)
            results.append(
                OfflineResult(
                    spec=spec,
                    arch=arch,
                    lowered_name=lowered,
                    registers=int(m.group("regs") or 0) if m else -1,
                    stack_bytes=int(m.group("stack")) if m else -1,
                    spill_bytes=(int(m.group("spill_st")) + int(m.group("spill_ld"))) if m else -1,
                )
            )
        return results
    finally:
        nvrtc.destroyProgram(program)


def compile_offline(
    specs: Sequence[KernelSpec], arch: str, *, workers: int | None = None
) -> list[OfflineResult]:
    """Compile ``specs`` to machine code for ``arch`` (``"sm_90"``) with NVRTC and no GPU.

    The specs of one stage are split into ``workers`` NVRTC programs (default: one per CPU, at
    most 8) of the text the run-time loader compiles, with the same options plus ``-ftz=true`` as
    CuPy adds, compiled in parallel worker processes (spawned, not threads: nothing relies on
    NVRTC's thread safety, and a compiler crash surfaces as an error here instead of ending this
    process). One program is compiled in this process. Results come in the order of
    ``specs``. Raises ``RuntimeError`` with the compiler log when a stage fails to compile.
    """
    n_workers = workers if workers is not None else min(8, os.cpu_count() or 1)
    if n_workers < 1:
        raise ValueError(f"workers: expected >= 1, got {workers}")
    by_stage: dict[str, list[KernelSpec]] = {}
    for spec in specs:
        by_stage.setdefault(spec.stage, []).append(spec)
    options = [*offline_options(arch), "--ptxas-options=-v"]
    jobs = []
    for stage, stage_specs in by_stage.items():
        size = -(-len(stage_specs) // n_workers)
        jobs += [(stage, stage_specs[i : i + size]) for i in range(0, len(stage_specs), size)]
    if n_workers == 1 or len(jobs) == 1:
        parts = [_compile_program(stage, chunk, arch, options) for stage, chunk in jobs]
    else:
        context = multiprocessing.get_context("spawn")  # no fork of a threaded parent
        with concurrent.futures.ProcessPoolExecutor(n_workers, mp_context=context) as pool:
            futures = [pool.submit(_compile_program, st, ch, arch, options) for st, ch in jobs]
            parts = [f.result() for f in futures]
    by_spec = {r.spec: r for part in parts for r in part}
    return [by_spec[spec] for spec in specs]


def compile_all_offline(archs: Iterable[str]) -> list[OfflineResult]:
    """:func:`compile_offline` of :func:`all_kernel_specs` for each of ``archs``."""
    specs = all_kernel_specs()
    return [r for arch in archs for r in compile_offline(specs, arch)]
