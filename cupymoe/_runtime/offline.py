# SPDX-License-Identifier: Apache-2.0
"""Offline compile: NVRTC only, no GPU, no CUDA driver.

:func:`compile_offline` compiles any list of specialisations to machine code for a named
architecture, from the text the run-time loader compiles (:func:`~.compile.kernel_source`), and
reports what ptxas says about each (registers, stack, spills, static shared memory). The test
suite compiles :func:`~.compile.all_kernel_specs` this way for sm_80 … sm_120.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import re
from collections.abc import Sequence

from . import compile as loader
from .compile import KernelSpec, nvrtc_module

__all__ = [
    "OfflineResult",
    "compile_offline",
    "nvrtc_module",
    "offline_options",
    "supported_offline_archs",
    "target_arch",
]

_PTXAS_USAGE = re.compile(
    r"Function properties for (?P<name>\S+)\s*\n.*?(?P<stack>\d+) bytes stack frame, "
    r"(?P<spill_st>\d+) bytes spill stores, (?P<spill_ld>\d+) bytes spill loads"
    r"(?:.*?\n.*?Used (?P<regs>\d+) registers"
    r"(?:, used \d+ barriers)?(?:, (?P<smem>\d+) bytes smem)?)?",
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
    smem_bytes: int  # static shared memory
    #: ptxas's performance warnings about this function (e.g. wgmma serialised), one per line.
    notes: tuple[str, ...] = ()


def target_arch(spec: KernelSpec, arch: str) -> str | None:
    """The architecture ``spec`` is compiled for in a pass over ``arch``: ``arch`` itself, or for
    an architecture-specific spec its target when that belongs to ``arch`` (``sm_90a`` in the
    ``sm_90`` pass), else ``None`` (not compiled in that pass)."""
    if not spec.target:
        return arch
    return spec.target if spec.target.rstrip("af") == arch else None


def supported_offline_archs() -> list[str]:
    """The ``sm_XX`` targets this NVRTC can generate code for."""
    return [f"sm_{a}" for a in nvrtc_module().getSupportedArchs()]


def offline_options(arch: str) -> list[str]:
    """NVRTC options of an offline compile for ``arch``: :func:`.compile.nvrtc_options`."""
    return loader.nvrtc_options(arch)


def _compile_program(
    stage: str, specs: Sequence[KernelSpec], arch: str, options: list[str]
) -> list[OfflineResult]:
    """One NVRTC program of ``stage`` holding ``specs``: compile it, read the ptxas report."""
    nvrtc = nvrtc_module()
    program = nvrtc.createProgram(loader.kernel_source(stage), f"{stage}.cu", [], [])
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
        losses = [line for line in log.splitlines() if "Performance Loss" in line]
        results = []
        for spec in specs:
            lowered = nvrtc.getLoweredName(program, spec.expression)
            m = usage.get(lowered)
            notes = tuple(line.strip() for line in losses if lowered in line)
            results.append(
                OfflineResult(
                    spec=spec,
                    arch=arch,
                    lowered_name=lowered,
                    registers=int(m.group("regs") or 0) if m else -1,
                    stack_bytes=int(m.group("stack")) if m else -1,
                    spill_bytes=(int(m.group("spill_st")) + int(m.group("spill_ld"))) if m else -1,
                    smem_bytes=int(m.group("smem") or 0) if m else -1,
                    notes=notes,
                )
            )
        return results
    finally:
        nvrtc.destroyProgram(program)


def compile_offline(
    specs: Sequence[KernelSpec], arch: str, *, workers: int | None = None
) -> list[OfflineResult]:
    """Compile ``specs`` to machine code for ``arch`` (``"sm_90"``) with NVRTC and no GPU; a spec
    with an architecture-specific target is compiled for it (:func:`target_arch`; it must belong
    to ``arch``).

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
    by_stage: dict[tuple[str, str], list[KernelSpec]] = {}
    for spec in specs:
        target = target_arch(spec, arch)
        if target is None:
            raise ValueError(
                f"{spec.expression}: its target {spec.target} is not a variant of {arch}"
            )
        by_stage.setdefault((spec.stage, target), []).append(spec)
    jobs = []
    for (stage, target), stage_specs in by_stage.items():
        size = -(-len(stage_specs) // n_workers)
        options = [*offline_options(target), "--ptxas-options=-v"]
        jobs += [
            (stage, stage_specs[i : i + size], target, options)
            for i in range(0, len(stage_specs), size)
        ]
    if n_workers == 1 or len(jobs) == 1:
        parts = [_compile_program(*job) for job in jobs]
    else:
        context = multiprocessing.get_context("spawn")  # no fork of a threaded parent
        with concurrent.futures.ProcessPoolExecutor(n_workers, mp_context=context) as pool:
            futures = [pool.submit(_compile_program, *job) for job in jobs]
            parts = [f.result() for f in futures]
    by_spec = {r.spec: r for part in parts for r in part}
    return [by_spec[spec] for spec in specs]
