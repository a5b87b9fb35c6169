# SPDX-License-Identifier: Apache-2.0
"""Benchmark bookkeeping (CPU): bytes per expert, the stack depth that defeats the L2, the table,
and the GPU-only commands refusing cleanly without a GPU."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from cupymoe._runtime.backend import gpu_available
from cupymoe.bench import (
    L2_BYTES,
    BenchResult,
    expert_bytes,
    floor_time_us,
    format_table,
    layer_flops,
    stack_depth,
)
from cupymoe.cli import cli
from cupymoe.presets import PRESETS


def test_expert_bytes_by_hand() -> None:
    qwen = PRESETS["qwen3.6-35b-a3b"]  # 3 matrices of 512 x 2048: codes, E4M3 per 16, fp32
    assert expert_bytes(qwen) == 3 * (512 * 2048 // 2 + 512 * 2048 // 16 + 4)
    oss = PRESETS["gpt-oss-20b"]  # E8M0 per 32
    assert expert_bytes(oss) == 3 * (2880 * 2880 // 2 + 2880 * 2880 // 32 + 4)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_stack_defeats_l2(name: str) -> None:
    shape = PRESETS[name]
    depth = stack_depth(shape)
    touched = depth * shape.top_k * expert_bytes(shape)
    assert depth >= 2
    assert touched >= 4 * L2_BYTES or depth * shape.n_experts * expert_bytes(shape) > 40e9
    small = dataclasses.replace(shape, n_experts=8, top_k=2)
    assert stack_depth(small, max_weight_bytes=1e6) == 2  # memory cap wins, never below 2


def test_table_and_metrics() -> None:
    r = BenchResult(
        "p",
        "nvfp4",
        "bfloat16",
        4,
        10,
        "graph",
        20.0,
        10.0,
        45_000_000,
        {"route": 1.0, "fc1": 12.0, "fc2": 6.0, "finalize": 1.0},
        35.0,
    )
    assert r.pct_of_floor == pytest.approx(50.0)
    assert r.effective_tbps == pytest.approx(45e6 / 20e-6 / 1e12)
    assert r.bound == "bytes" and r.tflops == 0.0  # no FLOPs given
    table = format_table([r])
    assert "| p nvfp4 bfloat16 | 4 | graph | 20.00 | 10.00 | bytes | 50 % | 2.25 | 0.0 |" in table
    assert table.count("\n") == 2 and r.as_dict()["pct_of_floor"] == pytest.approx(50.0)


def test_flop_floor_binds_at_prefill() -> None:
    qwen = PRESETS["qwen3.6-35b-a3b"]
    flops = layer_flops(qwen, 4096)
    assert flops == 2.0 * 4096 * 8 * 3 * 2048 * 512  # gate, up and down of every expanded row
    distinct = 256 * expert_bytes(qwen)  # every expert active
    assert floor_time_us(distinct, flops) == pytest.approx(flops / 790e12 * 1e6)  # 261 µs
    assert floor_time_us(distinct, layer_flops(qwen, 16)) == pytest.approx(distinct / 4.5e12 * 1e6)
    r = dataclasses.replace(
        BenchResult("q", "nvfp4", "bfloat16", 4096, 2, "graph", 522.0, 0.0, distinct, {}, 0.0),
        flops=flops,
        floor_us=floor_time_us(distinct, flops),
    )
    assert r.bound == "flops" and r.pct_of_floor == pytest.approx(50.0, rel=1e-3)
    assert r.tflops == pytest.approx(flops / 522e-6 / 1e12)


@pytest.mark.skipif(gpu_available(), reason="checks the no-GPU refusal")
@pytest.mark.parametrize("args", [["bench", "--tokens", "1"], ["tune", "--preset", "gpt-oss-20b"]])
def test_gpu_commands_refuse_without_gpu(args: list[str]) -> None:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and "needs a CUDA GPU" in result.output


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["bench", "--tokens", "1,x"], "--tokens"),
        (["bench", "--tokens", "0"], "--tokens"),
        (["tune"], "--preset"),
        (["tune", "--shape", "1,2,3"], "--shape"),
    ],
)
def test_bench_tune_bad_options(args: list[str], match: str) -> None:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and match in result.output


def test_ab_bookkeeping(tmp_path: Any, repo_script: Any) -> None:
    """bench_ab: the case and tree arguments, the bitwise comparison against the first tree
    (equal, a fraction of differing elements, missing), and the summary's ratios."""
    ab = repo_script("benchmarks/bench_ab.py")
    assert ab.Case.parse("gpt-oss-20b:16,64") == ab.Case("gpt-oss-20b", (16, 64))
    for bad in ("gpt-oss-20b", "gpt-oss-20b:", ":16", "x:0", "x:a"):
        with pytest.raises(ValueError, match="--case"):
            ab.Case.parse(bad)
    (tmp_path / "cupymoe").mkdir()
    (tmp_path / "cupymoe" / "__init__.py").write_text("")
    assert ab.parse_tree(f"old={tmp_path}") == ("old", tmp_path.resolve())
    with pytest.raises(ValueError, match="holds no cupymoe"):
        ab.parse_tree(f"old={tmp_path / 'cupymoe'}")
    with pytest.raises(ValueError, match="name=directory"):
        ab.parse_tree(str(tmp_path))
    cases = [ab.Case("p", (1, 8))]
    y = np.arange(12, dtype=np.uint16).reshape(3, 4)
    for name, m, v in (("a", 1, y), ("b", 1, y), ("a", 8, y), ("b", 8, y + (y == 5))):
        np.save(tmp_path / f"{name}_p_{m}.npy", v)
    got = ab.compare_outputs(tmp_path, ["a", "b", "c"], cases)
    assert got == {"p:1:b": "bitwise", "p:1:c": "missing", "p:8:b": 1 / 12, "p:8:c": "missing"}
    rows = [
        {"tree": t, "preset": "p", "tokens": 1, "us": us, "stages_us": {"fc1": 1.0, "fc2": 2.0}}
        for t, us in (("a", 10.0), ("b", 9.0), ("a", 11.0), ("b", 8.0))
    ]
    text = ab.table(rows, ["a", "b"], got)
    assert text.startswith("p M=1: a 10.0 (1.0 / 2.0), 11.0 (1.0 / 2.0) | b 9.0")
    assert text.endswith("x0.800 bitwise")


def test_ab_warm_runs_every_tree_case_and_size(
    tmp_path: Any, repo_script: Any, monkeypatch: Any
) -> None:
    """bench_ab --warm: one warm-up process per (tree, preset, M), each with its tree alone on
    PYTHONPATH and the hand-over passed on; a failed one stops the run."""
    ab = repo_script("benchmarks/bench_ab.py")
    seen = []

    def fake_run(cmd: list[str], env: dict[str, str], check: bool) -> None:
        assert check
        i = cmd.index("--warm-worker")
        seen.append((env["PYTHONPATH"], cmd[i + 1], cmd[cmd.index("--hand-over") + 1]))

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    trees = [("a", tmp_path / "a"), ("b", tmp_path / "b")]
    ab.warm(trees, [ab.Case("p", (1, 8)), ab.Case("q", (4,))], 2.0, 3)
    want = {(str(tmp_path / t), c, "2.0") for t in "ab" for c in ("p:1", "p:8", "q:4")}
    assert len(seen) == 6 and set(seen) == want

    def failing(cmd: list[str], env: dict[str, str], check: bool) -> None:
        raise ab.subprocess.CalledProcessError(1, cmd)

    monkeypatch.setattr(ab.subprocess, "run", failing)
    with pytest.raises(ab.subprocess.CalledProcessError):
        ab.warm(trees, [ab.Case("p", (1,))], 0.0, 2)


def test_read_ceiling_bookkeeping(repo_script: Any) -> None:
    bc = repo_script("benchmarks/bench_ceiling.py")
    results = [
        dict(preset="a", tokens=1, mode="graph", fc1_mb=36.0, fc1_us=12.0, fc2_mb=18.0, fc2_us=9.0),
        dict(preset="a", tokens=64, mode="eager", fc1_mb=1.0, fc1_us=1.0, fc2_mb=1.0, fc2_us=1.0),
        dict(preset="b", tokens=4, mode="graph", fc1_mb=2.0, fc1_us=3.0, fc2_mb=1.5, fc2_us=2.5),
    ]
    sizes = bc.read_sizes(results, {1, 4, 64})
    assert [(s["preset"], s["op"], s["mb"], s["gemv_us"]) for s in sizes] == [
        ("a", "FC1", 36.0, 12.0),
        ("a", "FC2", 18.0, 9.0),
        ("b", "FC1", 2.0, 3.0),
        ("b", "FC2", 1.5, 2.5),
    ]  # eager rows are not GEMV launches: left out
    assert bc.read_sizes(results, {8}) == []
    assert bc.needs_us(36.0) == pytest.approx(10.0)  # 36 MB at 0.8 x 4.5 TB/s
    assert bc.launches_for(10**6, 2 * 10**9) == math.ceil(4 * bc.L2_BYTES / 10**6)
    assert bc.launches_for(10**9, 10**9 + 5) == 1  # the pool holds one buffer
    assert bc.launches_for(100 * 2**20, 2**31) == 8  # at least 8 launches per graph
    with pytest.raises(ValueError, match="read of"):
        bc.launches_for(2**31, 2**30)
    rows = [dict(s, ceiling_us=10.5, shape="", needs_us=bc.needs_us(s["mb"])) for s in sizes[:2]]
    table = bc.markdown(rows).splitlines()
    assert table[2].endswith("| 10.00 | no |") and table[3].endswith("| 5.00 | no |")
    assert "| 88 % |" in table[2]  # the ceiling over the GEMV: 10.5 / 12
    assert "| 10.50 | 76 % |" in table[2]  # 36 MB in 10.5 µs: 3.43 TB/s of 4.5


def test_stream_probe_edits_the_current_kernel(repo_script: Any, tmp_path: Any) -> None:
    """stream_probe: every probe's edits find their anchors in today's gemm_sm90.cu (exactly
    once), change it as named, and refuse a kernel that moved on."""
    probe = repo_script("benchmarks/stream_probe.py")
    source = (probe.ROOT / probe.KERNEL).read_text()
    unread = probe.probe_source(source, ["unread"])
    assert unread.count("// PROBE unread") == 1 and "PROBE bulk" not in unread
    bulk = probe.probe_source(source, ["bulk"])
    assert "tma_load_3d(stage + kAOff" not in bulk and bulk.count("bulk_copy(") == 4
    both = probe.probe_source(source, ["bulk", "unread"])
    assert "// PROBE unread" in both and "PROBE bulk" in both
    alone = probe.probe_source(source, ["nogather", "unread"])
    assert alone.count("if (false) cp_async16(") == 2 and alone.count("cp_async16(") == 3
    assert "PROBE nogather" in alone and "2 * boxes * kXBoxBytes" not in alone
    assert probe.probe_source(source, ["ring7"]) == source
    tiling = (probe.ROOT / probe.GEMM).read_text()
    ring7 = probe.tiling_source(tiling, ["ring7", "unread"])
    assert ring7.count("# PROBE ring7") == 2 and "32: 16}" in ring7
    assert probe.tiling_source(tiling, ["bulk", "unread"]) == tiling
    with pytest.raises(ValueError, match="ring7: its anchor is in experts/gemm.py 0 times"):
        probe.tiling_source(ring7, ["ring7"])
    with pytest.raises(ValueError, match="unread: its anchor is in gemm_sm90.cu 0 times"):
        probe.probe_source(unread.replace("fence_async_shared();  //", "x;  //"), ["unread"])
    with pytest.raises(ValueError, match="unknown edit"):
        probe.probe_source(source, ["nothing"])
    trees = probe.write_probes(probe.ROOT, tmp_path)
    assert sorted(trees) == sorted(probe.PROBES)
    for name, tree in trees.items():
        edited = (tree / probe.KERNEL).read_text()
        assert edited == probe.probe_source(source, probe.PROBES[name])
        gemm = (tree / probe.GEMM).read_text()
        assert gemm == probe.tiling_source(tiling, probe.PROBES[name])
        assert (tree / "cupymoe" / "__init__.py").is_file()


def test_item_timeline_edits_the_current_kernel(repo_script: Any, tmp_path: Any) -> None:
    """item_timeline: its edits find their anchors in today's gemm_sm90.cu (exactly once), add
    the five stamps per item and the record, and refuse a kernel that moved on."""
    timeline = repo_script("benchmarks/item_timeline.py")
    source = (timeline.ROOT / timeline.KERNEL).read_text()
    edited = timeline.instrument(source)
    assert edited.count("clock64()") == source.count("clock64()") + 5
    assert edited.count("cm_probe") == 2 and edited.count("++nitem;") == 1
    moved = source.replace("            if constexpr (kEpiInSlot) {\n", "")
    with pytest.raises(ValueError, match="edit 2: its anchor is in gemm_sm90.cu 0 times"):
        timeline.instrument(moved)
    tree = timeline.write_tree(timeline.ROOT, tmp_path)
    assert (tree / timeline.KERNEL).read_text() == edited
    assert (tree / "cupymoe" / "__init__.py").is_file()


def test_item_timeline_summary(repo_script: Any) -> None:
    """item_timeline.summarize: the shares of each block's span and the means per item position
    and width, from a hand-made record of two blocks."""
    timeline = repo_script("benchmarks/item_timeline.py")
    stamps = np.zeros(
        (timeline.BLOCKS, timeline.ITEMS, timeline.GROUPS, timeline.VALUES), np.uint64
    )
    assert timeline.summarize(stamps) is None
    # Block 0, group 0: two items. Item 0 (width 144): wait 100, K loop 700, barrier 0, epilogue
    # 200; a gap of 50; item 1 (width 128): wait 10, K loop 600, barrier 20, epilogue 120.
    stamps[0, 0, 0] = [1000, 1100, 1800, 1800, 2000, 140, 144, 1]
    stamps[0, 1, 0] = [2050, 2060, 2660, 2680, 2800, 128, 128, 1]
    # Block 5, group 1: one item of width 32: wait 0, K loop 300, barrier 0, epilogue 100.
    stamps[5, 0, 1] = [7, 7, 307, 307, 407, 20, 32, 1]
    s = timeline.summarize(stamps)
    assert s is not None and s["records"] == 2 and s["span_max"] == 1800
    assert s["span_median"] == pytest.approx((1800 + 400) / 2)
    assert s["shares"]["kloop"] == pytest.approx((1300 / 1800 + 300 / 400) / 2)
    assert s["shares"]["gap"] == pytest.approx((50 / 1800 + 0) / 2)
    assert s["by_position"][0] == dict(wait=50.0, kloop=500.0, bar=0.0, epi=150.0, items=2)
    assert s["by_position"][1] == dict(wait=10.0, kloop=600.0, bar=20.0, epi=120.0, items=1)
    assert s["by_width_after_first"] == {
        128: dict(wait=10.0, kloop=600.0, bar=20.0, epi=120.0, items=1)
    }


def test_stage_anatomy_bookkeeping(repo_script: Any) -> None:
    """stage_anatomy: the wrappers it generates are the widths its kernel instantiates, and its
    output lines parse (a CUDA error raises)."""
    anatomy = repo_script("benchmarks/stage_anatomy.py")
    ops = anatomy.includes()["ops.inc"]
    kernel = (Path(anatomy.HERE) / "stage_anatomy.cu").read_text()
    for n in anatomy.WIDTHS:
        assert f"void wgrs{n}(" in ops and f"wgrs{n}(d, a, b, 1)" in kernel
    line = (
        "all (the kernel's stage)   N=144 cycles/stage 2662 (ideal 2304, 87 %) 2.944 ms, "
        "1808 MHz, HBM 1.65 TB/s, no error"
    )
    row = anatomy.parse(line)
    expected = dict(variant="all (the kernel's stage)", n=144, cycles=2662, ideal=2304, pct=87)
    assert row == dict(expected, mhz=1808, ms=2.944, hbm_tbps=1.65)
    with pytest.raises(RuntimeError, match="misaligned address"):
        anatomy.parse(line.replace("no error", "misaligned address"))
    assert "mhz" not in anatomy.parse(line.replace("1808 MHz, ", ""))
    with pytest.raises(ValueError, match="unexpected output"):
        anatomy.parse("something else")
