# SPDX-License-Identifier: Apache-2.0
"""The kernel loader: spec -> expression, header inlining, offline NVRTC compile of every
specialisation the dispatchers can select (no GPU needed), and the typed launch guard."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import cupymoe._runtime.compile as compile_mod
from cupymoe._runtime.compile import KernelSpec, all_kernel_specs, kernel_source
from cupymoe._runtime.offline import compile_offline, supported_offline_archs, target_arch
from cupymoe.experts.gemm import GemmConfig, WgmmaConfig
from cupymoe.routing import topk as routing_topk

# sm_80 (A100), sm_89 (L40/Ada), sm_90 (H100/H200), sm_100 (B200), sm_120 (RTX 50xx / RTX PRO).
ARCHS = ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120")


def _nvrtc_archs() -> set[str]:
    pytest.importorskip("cupy")
    return set(supported_offline_archs())


def test_expression_spelling() -> None:
    spec = KernelSpec("gemv_fp4", "gemv_fc1", ("__nv_bfloat16", 0, 8, 128, True, False))
    assert spec.expression == "gemv_fc1<__nv_bfloat16, 0, 8, 128, true, false>"
    assert KernelSpec("routing", "route_decode").expression == "route_decode"


def test_equal_specs_are_equal_and_hash_equal() -> None:
    a = KernelSpec("dequant", "dequantize_fp4", (0, "float", False))
    b = KernelSpec("dequant", "dequantize_fp4", (0, "float", False))
    assert a == b and hash(a) == hash(b) and a.expression == b.expression
    assert a != KernelSpec("dequant", "dequantize_fp4", (1, "float", False))


@pytest.mark.parametrize("bad", [1.5, "", None, b"x"])
def test_bad_template_argument(bad: object) -> None:
    with pytest.raises(TypeError, match="template argument"):
        _ = KernelSpec("x", "k", (bad,)).expression  # type: ignore[arg-type]


def test_headers_are_inlined_once() -> None:
    for stage in {s.stage for s in all_kernel_specs()}:
        text = kernel_source(stage)
        assert '#include "' not in text, f"{stage}.cu still includes a package header"
        assert text.count("namespace cm {") == 1, f"{stage}.cu: common.cuh inlined twice?"


def test_header_edit_changes_source(monkeypatch: pytest.MonkeyPatch) -> None:
    files = {"a.cu": '#include "h.cuh"\n#include "h.cuh"\nA', "h.cuh": "H1"}
    monkeypatch.setattr(compile_mod, "_read_cuda_file", lambda name: files[name])
    monkeypatch.setattr(compile_mod, "_source_cache", {})
    first = kernel_source("a")
    assert "H1" in first and first.count("H1") == 1
    files["h.cuh"] = "H2"
    monkeypatch.setattr(compile_mod, "_source_cache", {})
    assert "H2" in kernel_source("a") and kernel_source("a") != first


def test_every_stage_lists_specs() -> None:
    specs = all_kernel_specs()
    stages = {s.stage for s in specs}
    expected = "dequant route route_fused maps expand finalize gemv_fp4 exchange".split()
    assert set(expected) <= stages
    assert len(specs) == len(set(specs))


@pytest.mark.parametrize("arch", ARCHS)
def test_offline_compile_every_specialisation(arch: str) -> None:
    if arch not in _nvrtc_archs():
        pytest.skip(f"this NVRTC cannot target {arch}")
    # Architecture-specific specialisations (wgmma: sm_90a) compile in their architecture's pass.
    specs = [s for s in all_kernel_specs() if target_arch(s, arch) is not None]
    results = compile_offline(specs, arch)
    assert [r.spec for r in results] == specs
    for r in results:
        assert r.lowered_name, r.spec
        assert r.registers > 0, f"{r.spec.expression}: no ptxas report"
        # the launches size their dynamic shared memory to what the static part leaves
        static = {"gemm_fp4": GemmConfig.static_bytes, "gemm_sm90": WgmmaConfig.static_bytes}
        if r.spec.stage in static and r.spec.name != "permute_split":
            assert 0 < r.smem_bytes <= static[r.spec.stage], (r.spec.expression, r.smem_bytes)
        if r.spec.name == "route_tiles":  # the host's shared-memory fit check counts on it
            assert 0 < r.smem_bytes <= routing_topk._TILE_STATIC_SMEM, r.smem_bytes
        if arch == "sm_90":  # the target we tune for: no spills, no serialised wgmma
            assert r.spill_bytes == 0, f"{r.spec.expression} spills {r.spill_bytes} bytes"
            assert not r.notes, f"{r.spec.expression}: {r.notes}"
    if arch == "sm_90":
        assert any(r.arch == "sm_90a" for r in results)


def test_parallel_offline_compile_keeps_order_and_results() -> None:
    _nvrtc_archs()
    specs = [s for s in all_kernel_specs() if s.stage in ("finalize", "expand")][::-1]
    serial = compile_offline(specs, "sm_90", workers=1)
    parallel = compile_offline(specs, "sm_90", workers=3)  # 3 programs per stage, 3 processes
    assert [r.spec for r in parallel] == specs
    assert parallel == serial
    with pytest.raises(ValueError, match="workers"):
        compile_offline(specs, "sm_90", workers=0)


def test_offline_compile_reports_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    _nvrtc_archs()
    broken = '#include "common.cuh"\ntemplate <int N> __global__ void k(float* x) { x[0] = N+; }\n'
    real = compile_mod._read_cuda_file
    monkeypatch.setattr(
        compile_mod, "_read_cuda_file", lambda name: broken if name == "broken.cu" else real(name)
    )
    monkeypatch.setattr(compile_mod, "_source_cache", {})
    with pytest.raises(RuntimeError, match="broken.cu failed to compile for sm_90"):
        compile_offline([KernelSpec("broken", "k", (1,))], "sm_90")


def test_launch_rejects_python_scalars() -> None:
    pytest.importorskip("cupy")
    from cupymoe._runtime.launch import _check_args

    spec = KernelSpec("dequant", "k")
    _check_args(spec, (np.int32(3), np.float32(1.0), None))
    with pytest.raises(TypeError, match="argument 1"):
        _check_args(spec, (np.int32(3), 3))
    with pytest.raises(TypeError, match="argument 0"):
        _check_args(spec, (np.ones(3),))


@pytest.mark.gpu
def test_get_kernel_is_memoised() -> None:
    from cupymoe._runtime.compile import get_kernel

    spec = all_kernel_specs()[0]
    assert get_kernel(spec) is get_kernel(spec)


@pytest.mark.gpu
def test_first_use_from_threads_compiles_once() -> None:
    import threading

    from cupymoe._runtime.compile import get_kernel

    spec = all_kernel_specs()[-1]
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(get_kernel(spec))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(k is got[0] for k in got)


def test_sass_tool_counts_loop_trips(repo_script: Any) -> None:
    """scripts/sass.py --loops: each backward branch whose body issues the opcode, innermost first,
    with its instruction count; addresses past 0xffff (kernels over 64 KB of code) included."""
    sass = repo_script("scripts/sass.py")

    def line(addr: int, text: str) -> str:
        return f"        /*{addr:04x}*/                   {text} ;"

    body = [line(0xFFE0, "MOV R1, R2"), line(0xFFF0, "HGMMA.64x16x16.F32.BF16 R24, R80")]
    body += [line(0x10000, "IADD3 R1, R1, 0x1, RZ"), line(0x10010, "@!P0 BRA 0xffe0")]
    body += [line(0x10020, "HGMMA.64x16x16.F32.BF16 R24, R80"), line(0x10030, "BRA 0xffd0")]
    listing = "\n".join([line(0xFFD0, "NOP"), *body, line(0x10040, "EXIT")])
    assert sass.innermost_loops(listing, "HGMMA") == [
        (0xFFE0, 0x10010, 4, 1),
        (0xFFD0, 0x10030, 7, 2),
    ]
    assert sass.innermost_loops(listing, "EXIT") == []  # outside every loop
    assert len([m for m in map(sass._OPCODE.match, listing.splitlines()) if m]) == 8
