# SPDX-License-Identifier: Apache-2.0
"""The tensor-core ceiling of the wgmma instruction patterns the sm_90a grouped GEMM issues.

Run on an H100 / H200 with ``nvcc`` on PATH (no cupymoe needed)::

    python3 benchmarks/wgmma_ceiling.py [--json results.json]

Generates the wrappers of ``wgmma_ceiling.cu`` into a temporary folder, builds it for ``sm_90a``
and runs it: one block per SM, ``groups`` warp groups each issuing ``wgmma m64nNk16`` (bf16 in,
fp32 accumulators) in groups of ``G`` between ``wgmma.fence`` and ``commit_group`` /
``wait_group W``, four groups per loop trip, A from registers (as the GEMM's decoded weights) or
from shared memory, B from shared memory with the 128-byte swizzle; ``alu`` integer operations
rewrite the A registers before each group (where the decode sits). No global memory and no
barriers: what remains is the issue pattern. Each row is the median of 5 launches of 2,000 loop
trips; TFLOP/s counts 2 x 64 x N x 16 per wgmma, the clock is the SM's own (``clock64`` over the
elapsed time). The operands are zeros, which draws less power than real data (the H200 holds
about 1.78 GHz here), so the ceiling to read is the cycles per wgmma against the ideal
``64 x N x 16 / 2048`` (dense bf16: 2,048 multiply-adds per cycle per SM), not the TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

#: (N, G, W, groups, A from shared memory, alu): the GEMM's pattern first (N 128, two wgmma per
#: commit group, wait_group 1, two consumer warp groups, A from registers), then one change at a
#: time from it.
PATTERNS = [
    (128, 2, 1, 2, False, 0),
    (128, 2, 1, 2, False, 16),
    (128, 2, 0, 2, False, 0),
    (128, 8, 1, 2, False, 0),
    (128, 2, 1, 1, False, 0),
    (128, 2, 1, 3, False, 0),
    (128, 2, 1, 2, True, 0),
    (256, 2, 1, 2, False, 0),
    (256, 2, 1, 2, True, 0),
    (64, 2, 1, 2, False, 0),
    (32, 2, 1, 2, False, 0),
]
FIELDS = ("n", "g", "wait", "groups", "ss", "alu", "ms", "tflops", "mhz", "cycles_per_wgmma")


def wrapper(n: int, ss: bool) -> str:
    """``wgrsN`` / ``wgssN``: one ``wgmma.mma_async m64nNk16`` with N / 2 accumulators."""
    acc = n // 2
    d = ", ".join(f"%{i}" for i in range(acc))
    if ss:
        operands, pred = f"%{acc}, %{acc + 1}", acc + 2
        inputs = '"l"(ad), "l"(b), "r"(sd)'
        args = f"float (&d)[{acc}], uint64_t ad, uint64_t b, int sd"
        tail = "p, 1, 1, 0, 0"
    else:
        operands, pred = f"{{%{acc}, %{acc + 1}, %{acc + 2}, %{acc + 3}}}, %{acc + 4}", acc + 5
        inputs = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(sd)'
        args = f"float (&d)[{acc}], const uint32_t (&a)[4], uint64_t b, int sd"
        tail = "p, 1, 1, 0"
    outputs = ", ".join(f'"+f"(d[{i}])' for i in range(acc))
    ptx = (
        f"{{ .reg .pred p; setp.ne.b32 p, %{pred}, 0; "
        f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, {operands}, {tail}; }}"
    )
    name = f"wg{'ss' if ss else 'rs'}{n}"
    return (
        f"__device__ __forceinline__ void {name}({args}) {{\n"
        f'  asm volatile("{ptx}"\n    : {outputs} : {inputs});\n}}\n'
    )


def includes() -> dict[str, str]:
    """The generated parts of ``wgmma_ceiling.cu``."""
    ops = "\n".join(wrapper(n, ss) for n in (32, 64, 128, 256) for ss in (False, True))
    rows = "\n".join(
        f"T({n}, {g}, {w}, {groups}, {'true' if ss else 'false'}, {alu})"
        for n, g, w, groups, ss, alu in PATTERNS
    )
    return {"ops.inc": ops, "rows.inc": rows + "\n"}


def build_and_run(source: str, generated: dict[str, str]) -> list[str]:
    """Builds ``source`` (a file of this folder) for ``sm_90a`` with nvcc, the ``generated``
    includes (name -> text) beside it in a temporary folder, runs it, returns its output lines
    (stage_anatomy.py uses it too)."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in generated.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        exe = os.path.join(tmp, "probe")
        build = ["nvcc", "-gencode", "arch=compute_90a,code=sm_90a", "-O3", "-std=c++17"]
        subprocess.run([*build, "-I", tmp, "-o", exe, os.path.join(HERE, source)], check=True)
        done = subprocess.run([exe], check=True, capture_output=True, text=True)
    return done.stdout.splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    lines = build_and_run("wgmma_ceiling.cu", includes())
    rows = []
    print("| N | wgmma / group | wait | groups | A | alu | TFLOP/s | MHz | cycles/wgmma | ideal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for line in lines:
        *values, error = line.split(",")
        if error != "no error":
            raise RuntimeError(f"CUDA error: {error}")
        row: dict[str, float | bool] = dict(zip(FIELDS, map(float, values), strict=True))
        row["ss"] = bool(row["ss"])
        rows.append(row)
        print(
            f"| {row['n']:.0f} | {row['g']:.0f} | {row['wait']:.0f} | {row['groups']:.0f} | "
            f"{'smem' if row['ss'] else 'regs'} | {row['alu']:.0f} | {row['tflops']:.0f} | "
            f"{row['mhz']:.0f} | {row['cycles_per_wgmma']:.1f} | {64 * row['n'] * 16 / 2048:.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            command = "python3 benchmarks/wgmma_ceiling.py"
            gpu = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            ).stdout.splitlines()
            device = gpu[0] if gpu else "unknown"
            json.dump({"device": device, "command": command, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
