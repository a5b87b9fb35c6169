# SPDX-License-Identifier: Apache-2.0
"""The wgmma GEMM's pipeline stage built up one ingredient at a time: how far from the tensor
cores' ideal each one takes it (probe).

Run on an H100 / H200 with ``nvcc`` on PATH (no cupymoe needed)::

    python3 benchmarks/stage_anatomy.py [--json results.json]

Builds ``stage_anatomy.cu`` for ``sm_90a`` with the wrappers of ``wgmma_ceiling.py`` and runs
it: one block per SM of a producer warp group and two consumer warp groups, each consumer warp
two m-tiles, every stage 8 commit groups of two ``wgmma m64nNk16`` (bf16, fp32 accumulators, A
from registers) after the decode of two weight words (the kernel's split-order bf16 decode and
the exact block-scale multiply), ``wait_group 1``: the K loop of ``cuda/gemm_sm90.cu`` at bn 144.
The variants add, one at a time, what the kernel's stage has besides: the weight, scale and
scale-table loads from shared memory, the full/empty mbarriers of a 4-stage ring with the
consumers' early release, a producer streaming 18 KB of weights per stage from HBM (one bulk
copy) and gathering 144 activation rows of 256 bytes from the L2 (16-byte ``cp.async`` through a
row table), the consumers' proxy fence, random data. No epilogue, no work items: the gap between
the last row and the kernel's own K loop (``item_timeline.py``) is what the items add. Each row
is the median of 5 launches of 2,000 stages; cycles are the SMs' own (``clock64``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from wgmma_ceiling import build_and_run, wrapper  # noqa: E402  (the benchmarks folder is not a package)

#: The wgmma widths stage_anatomy.cu instantiates.
WIDTHS = (64, 128, 144)
_LINE = re.compile(
    r"^(?P<name>.+?)\s+N=(?P<n>\d+) cycles/stage (?P<cycles>\d+) "
    r"\(ideal (?P<ideal>\d+), (?P<pct>\d+) %\) "
    r"(?P<ms>[\d.]+) ms, (?:(?P<mhz>\d+) MHz, )?HBM (?P<tbps>[\d.]+) TB/s, (?P<error>.+)$"
)


def includes() -> dict[str, str]:
    """The generated part of ``stage_anatomy.cu``: ``wgrsN`` for each of :data:`WIDTHS`."""
    return {"ops.inc": "\n".join(wrapper(n, False) for n in WIDTHS)}


def parse(line: str) -> dict[str, float | str]:
    """One output line of the probe as a row (``mhz`` where the line has it); ``RuntimeError`` for
    a CUDA error."""
    m = _LINE.match(line.strip())
    if m is None:
        raise ValueError(f"stage_anatomy: unexpected output {line!r}")
    if m["error"] != "no error":
        raise RuntimeError(f"CUDA error: {m['error']}")
    row: dict[str, float | str] = {"variant": m["name"].strip()}
    for key in ("n", "cycles", "ideal", "pct"):
        row[key] = int(m[key])
    if m["mhz"] is not None:  # (the first version of the probe printed no clock)
        row["mhz"] = int(m["mhz"])
    row["ms"], row["hbm_tbps"] = float(m["ms"]), float(m["tbps"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    lines = build_and_run("stage_anatomy.cu", includes())
    rows = [parse(line) for line in lines if line.strip()]
    print("| variant | N | cycles / stage | ideal | % of ideal | MHz | HBM TB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [
            r.get(k, "") for k in ("variant", "n", "cycles", "ideal", "pct", "mhz", "hbm_tbps")
        ]
        print("| " + " | ".join(map(str, cells)) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python3 benchmarks/stage_anatomy.py", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
