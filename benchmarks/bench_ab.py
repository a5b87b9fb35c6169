# SPDX-License-Identifier: Apache-2.0
"""Whole layers of two or more package trees side by side (A/B), each run in its own process.

Run on a GPU from the repository root::

    git archive main cupymoe | (mkdir -p /tmp/main && tar -x -C /tmp/main)
    python3 benchmarks/bench_ab.py --tree main=/tmp/main --tree new=. \\
        --case qwen3.6-35b-a3b:256,1024 --case deepseek-v3:512 [--rounds 2] [--repeats 10] \\
        [--hand-over ROWS] [--warm 8] [--json ab.json]

A tree is a directory that holds a ``cupymoe`` package (a checkout, or the ``git archive`` of
one revision as above). Each round runs the trees in the order given, each in a fresh process
with the tree first on ``PYTHONPATH`` (its own kernels, compiled into the shared kernel cache
under their own source keys), so that clock drift between variants spreads over the rounds. A run
times every case with :func:`cupymoe.bench.bench_preset` (CUDA-graph replays over a stack of
layers, the median of ``--repeats``: µs per layer and per stage) and then runs one layer of fixed
seeds at each M and keeps its output. The outputs of every tree are compared bitwise with the
first tree's (a layout or schedule change should give the same bits; a numerics change will
not). ``--hand-over ROWS`` moves every preset's GEMV/GEMM hand-over to ROWS rows per expert in
every tree (the grouped GEMM above it), to time the GEMM where the GEMV would run. ``--warm N``
first compiles what every tree runs, in N processes at once (one eager layer call per tree,
preset and M, each process holding its layer's weights on the GPU: keep N x the largest layer
within the GPU's memory); without it each tree's first round compiles its kernels one after
another, which on a fresh machine costs minutes of the device's time.

Prints one line per (preset, M): each tree's µs per layer (FC1 / FC2) per round, the ratio of
each tree's best round to the first tree's, and whether the outputs are bitwise equal; after
each round but the last the timings so far (and ``--json``), so that a run stopped at a time
limit still reports its finished rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    preset: str
    tokens: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> Case:
        """``"preset:M,M,..."`` -> Case; ``ValueError`` naming the text."""
        name, sep, ms = text.partition(":")
        try:
            tokens = tuple(int(m) for m in ms.split(","))
        except ValueError:
            tokens = ()
        if not sep or not name or not tokens or min(tokens) < 1:
            raise ValueError(f"--case: expected 'preset:M,M,...' with M >= 1, got {text!r}")
        return cls(name, tokens)


def parse_tree(text: str) -> tuple[str, Path]:
    """``"name=dir"`` -> (name, dir); the directory must hold a ``cupymoe`` package."""
    name, sep, path = text.partition("=")
    if not sep or not name or not name.isidentifier():
        raise ValueError(f"--tree: expected 'name=directory' with a plain name, got {text!r}")
    root = Path(path).resolve()
    if not (root / "cupymoe" / "__init__.py").is_file():
        raise ValueError(f"--tree {name}: {root} holds no cupymoe package")
    return name, root


def _set_hand_over(rows_per_expert: float) -> None:
    """Every preset's GEMV/GEMM hand-over at ``rows_per_expert`` (0: as is)."""
    from cupymoe.experts import handover

    if rows_per_expert:
        for key in list(handover._BY_SHAPE):
            handover._BY_SHAPE[key] = handover.HandOver(rows_per_expert, rows_per_expert)


def _output_layer(shape: Any, max_tokens: int) -> Any:
    """The layer of fixed seeds whose outputs the trees compare (and the warm-up calls)."""
    import cupymoe
    from cupymoe import presets

    rng = np.random.default_rng(5)
    return cupymoe.MoELayer(**presets.random_layer_gpu(shape, rng, seed=77, max_tokens=max_tokens))


def _inputs(shape: Any, m: int, rng: np.random.Generator) -> tuple[Any, Any]:
    """bf16 activations and float32 router logits of ``m`` tokens on the GPU."""
    import cupy
    import ml_dtypes

    x = cupy.asarray(rng.standard_normal((m, shape.hidden)).astype(ml_dtypes.bfloat16))
    logits = cupy.asarray(rng.standard_normal((m, shape.n_experts)).astype(np.float32))
    return x, logits


def warm_worker(preset: str, tokens: int, hand_over: float) -> None:
    """One eager layer call of ``preset`` at ``tokens`` tokens: compiles the tree's kernels for
    it into the shared kernel cache (in the process that imported that tree's cupymoe)."""
    import cupy

    from cupymoe import presets

    _set_hand_over(hand_over)
    shape = presets.PRESETS[preset]
    _output_layer(shape, tokens)(*_inputs(shape, tokens, np.random.default_rng(9)))
    cupy.cuda.Device().synchronize()


def warm(
    trees: Sequence[tuple[str, Path]], cases: Sequence[Case], hand_over: float, workers: int
) -> None:
    """:func:`warm_worker` for every tree, preset and M, ``workers`` processes at a time."""
    jobs = [(root, case.preset, m) for _, root in trees for case in cases for m in case.tokens]

    def one(job: tuple[Path, str, int]) -> None:
        root, preset, m = job
        env = dict(os.environ, PYTHONPATH=str(root))
        cmd = [sys.executable, __file__, "--warm-worker", f"{preset}:{m}",
               "--hand-over", str(hand_over), f"--case={preset}:{m}"]  # fmt: skip
        subprocess.run(cmd, env=env, check=True)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, jobs))


def run_worker(name: str, cases: Sequence[Case], repeats: int, hand_over: float, out: Path) -> None:
    """One tree's run (in the process that imported that tree's cupymoe): times, then outputs."""
    import cupy
    import ml_dtypes

    from cupymoe import bench, presets

    _set_hand_over(hand_over)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rows = []
    for case in cases:
        shape = presets.PRESETS[case.preset]
        for r in bench.bench_preset(shape, case.tokens, dtype=bf16, repeats=repeats):
            rows.append(
                {
                    "tree": name,
                    "preset": case.preset,
                    "tokens": r.tokens,
                    "us": r.us_per_layer,
                    "stages_us": r.stages_us,
                }  # fmt: skip
            )
        layer = _output_layer(shape, max(case.tokens))
        rng = np.random.default_rng(9)
        for m in case.tokens:
            y = cupy.asnumpy(layer(*_inputs(shape, m, rng))).view(np.uint16)
            np.save(out / f"{name}_{case.preset}_{m}.npy", y)
    (out / f"{name}.json").write_text(json.dumps(rows))


def compare_outputs(out: Path, names: Sequence[str], cases: Sequence[Case]) -> dict[str, Any]:
    """Per (preset, M) and tree after the first: "bitwise", or the fraction of elements that
    differ, or "missing"."""
    result: dict[str, Any] = {}
    for case in cases:
        for m in case.tokens:
            ref = np.load(out / f"{names[0]}_{case.preset}_{m}.npy")
            for name in names[1:]:
                path = out / f"{name}_{case.preset}_{m}.npy"
                key = f"{case.preset}:{m}:{name}"
                if not path.exists():
                    result[key] = "missing"
                    continue
                got = np.load(path)
                same = got.shape == ref.shape and bool(np.array_equal(got, ref))
                result[key] = "bitwise" if same else float(np.mean(got != ref))
    return result


def table(rows: Sequence[dict[str, Any]], names: Sequence[str], compared: dict[str, Any]) -> str:
    """The printed summary: per (preset, M), each tree's rounds as µs (FC1 / FC2), the best
    round against the first tree's best, and the bitwise comparison."""
    lines = []
    keys = sorted({(r["preset"], r["tokens"]) for r in rows})
    for preset, m in keys:
        best: dict[str, float] = {}
        parts = []
        for name in names:
            mine = [r for r in rows if (r["tree"], r["preset"], r["tokens"]) == (name, preset, m)]
            if not mine:
                continue
            best[name] = min(r["us"] for r in mine)
            runs = ", ".join(
                f"{r['us']:.1f} ({r['stages_us'].get('fc1', 0):.1f} / "
                f"{r['stages_us'].get('fc2', 0):.1f})"
                for r in mine
            )
            ratio = f" x{best[name] / best[names[0]]:.3f}" if names[0] in best else ""
            same = compared.get(f"{preset}:{m}:{name}", "")
            parts.append(f"{name} {runs}{ratio if name != names[0] else ''} {same}".rstrip())
        lines.append(f"{preset} M={m}: " + " | ".join(parts))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], help="name=directory (2 or more)")
    ap.add_argument("--case", action="append", default=[], help="preset:M,M,...")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--hand-over", type=float, default=0.0, help="rows per expert (0: as is)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--warm", type=int, default=0, help="compile first, in this many processes (0: no)"
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = [Case.parse(c) for c in args.case]
    if not cases:
        ap.error("--case: at least one")
    if args.worker:
        run_worker(args.worker, cases, args.repeats, args.hand_over, args.out_dir)
        return 0
    if args.warm_worker:
        preset, _, m = args.warm_worker.partition(":")
        warm_worker(preset, int(m), args.hand_over)
        return 0
    trees = [parse_tree(t) for t in args.tree]
    names = [n for n, _ in trees]
    if len(trees) < 2 or len(set(names)) != len(names):
        ap.error("--tree: two or more, with different names")
    if args.rounds < 1 or args.repeats < 1 or args.warm < 0:
        ap.error("--rounds and --repeats: at least 1; --warm: at least 0")
    if args.warm:
        warm(trees, cases, args.hand_over, args.warm)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for done in range(args.rounds):
            if done:  # the finished rounds, in case a time limit stops the run
                print(f"after round {done}:\n{table(rows, names, {})}", flush=True)
                if args.json:
                    args.json.write_text(json.dumps({"rows": rows, "bitwise": {}}, indent=1))
            for name, root in trees:
                env = dict(os.environ, PYTHONPATH=str(root))
                cmd = [sys.executable, __file__, "--worker", name, "--out-dir", str(out),
                       "--repeats", str(args.repeats), "--hand-over", str(args.hand_over),
                       *(f"--case={c}" for c in args.case)]  # fmt: skip
                subprocess.run(cmd, env=env, check=True)
                rows += json.loads((out / f"{name}.json").read_text())
        compared = compare_outputs(out, names, cases)
    print(table(rows, names, compared), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "bitwise": compared}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
