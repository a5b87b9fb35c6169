# SPDX-License-Identifier: Apache-2.0
"""The wgmma kernel against its own weight stream, by TMA boxes and by contiguous copies (probes).

Run on an H100 / H200 from the repository root::

    python3 benchmarks/stream_probe.py --case qwen3.6-35b-a3b:256,1024 --case deepseek-v3:512 \\
        [--rounds 2] [--repeats 5] [--warm 8] [--json probe.json]

Writes a probe copy of this checkout's ``cupymoe`` per probe (``--probes``, default all) into a
temporary folder, each with its edits to ``cuda/gemm_sm90.cu`` (``ring7``: to
``experts/gemm.py``), and times them against the checkout itself with
``benchmarks/bench_ab.py`` (whole layers, each tree in its own process, alternating rounds):

- ``unread``: the consumers release each stage as soon as it lands, without decoding it or
  issuing its ``wgmma``: what is left is the producer's stream (weights, scales, activation
  gather) and the item loop. The layer's output is not the layer's.
- ``bulk``: the producer copies each stage's weights and scales as one contiguous
  ``cp.async.bulk`` per matrix instead of the TMA boxes of 16 m-tile pieces: the byte count and
  the contiguity of a stage-contiguous weight layout, over the bytes of the resident layout in
  the wrong order (timing only; the output is wrong).
- ``bulk_unread``: both.
- ``ring7`` and ``ring7_unread``: the landed kernel and ``unread`` with a bn 32 x 7 stage
  tiling for up to 16 rows per expert (``experts/gemm.py`` edited; at bn 64 five stages fit):
  40 % more weight bytes in flight per SM, which says whether the ring's depth caps the stream.
- ``nogather_unread`` and ``bulk_nogather_unread``: ``unread`` and ``bulk_unread`` with the
  producer gathering no activations (no ``cp.async`` of x, no boxes of h): the weights' and
  scales' stream alone, without the activation traffic and the producer threads' issue.

How to read it: the landed kernel against ``unread`` says how much the consumers add to the
stream; ``unread`` against ``bulk_unread`` whether the box copies cap the stream (on the H100
they streamed alike at the DRAM rate: ``benchmarks/h100_probes_s26.json``, docs/kernels.md,
twelfth round). The patches name the code they replace; a kernel change that moves it makes
this script fail loudly (``tests/test_bench.py`` checks the anchors on the CPU). The probe
kernels compile with no spills for bn 64 and bn 128; at bn 144 (112-160 rows per expert) the
``bulk`` edit spills 56 bytes in the 56-register producer, so time the stream at other sizes.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = Path("cupymoe") / "cuda" / "gemm_sm90.cu"

# After a consumer's full wait in k_loop: release the slot at once and go to the next stage
# (bn 144, whose epilogue stages in the item's last slot: all but that one, which consume()
# releases after the epilogue).
_UNREAD = (
    "            if (split_source() && !x_tma()) fence_async_shared();  "
    "// the cp.async pieces, for wgmma\n",
    "            if (!kEpiInSlot || ks + 1 < ksteps) {  // PROBE unread\n"
    "                mbar_arrive(empty + 8 * slot);\n"
    "            } else {\n"
    "                reading = slot;\n"
    "            }\n"
    "            if (++slot == kStages) slot = 0, phase ^= 1u;\n"
    "            continue;\n",
)
# load_weights: the boxes replaced by contiguous bulk copies of the same byte count, from the
# item's own m-tiles' bytes (clamped to the expert), so that every read stays in the allocation.
_BULK_BOXES = (
    "        tma_load_3d(stage + kAOff, map0, ks * kStageChunks * kUnitBytes / 8, c1, e, bar);\n"
    "        if constexpr (kGated)\n"
    "            tma_load_3d(stage + kAOff + kBMT * kMatTileBytes, map1, "
    "ks * kStageChunks * kUnitBytes / 8, c1, e,\n"
    "                        bar);\n"
    "        tma_load_3d(stage + kSOff, smap, "
    "ks * kStageChunks * kScaleChunkBytes / 8, c1, e, bar);",
    "        // PROBE bulk: one contiguous copy per matrix, the stage's bytes (wrong order).\n"
    "        const long long tiles = (p.n + kRowsPerTile - 1) / kRowsPerTile;\n"
    "        const long long mrow = (long long)p.chunks * kUnitBytes, mexp = tiles * mrow;\n"
    "        const long long span = kBMT * kMatTileBytes;\n"
    "        const long long off = min((long long)c1 * mrow + (long long)ks * span, mexp - span);\n"
    "        bulk_copy(stage + kAOff, p.w0 + e * mexp + off, (uint32_t)span, bar);\n"
    "        if constexpr (kGated)\n"
    "            bulk_copy(stage + kAOff + span, p.w1 + e * mexp + off, (uint32_t)span, bar);\n"
    "        const long long srow = (long long)p.chunks * kScaleChunkBytes, sexp = tiles * srow;\n"
    "        const long long sspan = kBMT * kScaleTileBytes;\n"
    "        const long long so =\n"
    "            min((long long)c1 * srow + (long long)ks * sspan, sexp - sspan);\n"
    "        bulk_copy(stage + kSOff, p.scales + e * sexp + so, (uint32_t)sspan, bar);",
)
_BULK_COPY = (
    "// Orders this thread's ordinary shared-memory stores before later async-proxy reads "
    "(wgmma).\n",
    "// PROBE bulk: a contiguous global -> shared copy completing on the mbarrier with its bytes.\n"
    "__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes,\n"
    "                                          uint32_t bar) {\n"
    '    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "\n'
    '                 "[%0], [%1], %2, [%3];" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)\n'
    '                 : "memory");\n'
    "}\n",
)

# The producer's activation copies skipped (the gathered pieces and FC2's boxes of h), the full
# barrier's byte count without them: only with "unread", whose consumers read nothing.
_NOGATHER = (
    ("cp_async16(row + (c / 2) * kHalfBytes", "if (false) cp_async16(row + (c / 2) * kHalfBytes"),
    ("cp_async16(row + ((4 * (q % 2)", "if (false) cp_async16(row + ((4 * (q % 2)"),
    (
        "load_weights(stage, ks, c1, it.e, full + 8 * slot, 2 * boxes * kXBoxBytes);\n"
        "                            for (int b = 0; b < boxes; ++b) {\n",
        "load_weights(stage, ks, c1, it.e, full + 8 * slot, 0);  // PROBE nogather\n"
        "                            for (int b = 0; b < 0 * boxes; ++b) {\n",
    ),
)

# The tiling edits of experts/gemm.py (ring7): bn 32 x 7 stages x 4 groups for up to 16 rows per
# expert, its epilogue in 16-row chunks as the kernel's kEpiRows gives bn 32.
GEMM = Path("cupymoe") / "experts" / "gemm.py"
_RING7 = (
    (
        "WGMMA_TILINGS: tuple[tuple[int, int, int], ...] = ((64, 5, 4), (128, 4, 2), (144, 4, 2))",
        "WGMMA_TILINGS: tuple[tuple[int, int, int], ...] = (\n"
        "    (64, 5, 4), (128, 4, 2), (144, 4, 2), (32, 7, 4)  # PROBE ring7\n)",
    ),
    ("_EPI_ROWS = {64: 32, 128: 16}", "_EPI_ROWS = {64: 32, 128: 16, 32: 16}"),
    (
        "    if rows_per_expert <= WGMMA_NARROW_MAX_ROWS_PER_EXPERT:\n",
        "    if rows_per_expert <= 16:  # PROBE ring7\n"
        "        return WgmmaConfig(32, 7, 4)\n"
        "    if rows_per_expert <= WGMMA_NARROW_MAX_ROWS_PER_EXPERT:\n",
    ),
)

# The edits of experts/gemm.py, by name (tiling_source); every other edit is the kernel's.
_TILING_EDITS = {"ring7": _RING7}

#: Probe name -> its edits: of gemm_sm90.cu, where the anchor is replaced (bulk, nogather) or the
#: text inserted after it (unread, bulk_copy's helper before its anchor), or of experts/gemm.py
#: (ring7).
PROBES: dict[str, tuple[str, ...]] = {
    "unread": ("unread",),
    "bulk": ("bulk",),
    "bulk_unread": ("bulk", "unread"),
    "nogather_unread": ("nogather", "unread"),
    "bulk_nogather_unread": ("bulk", "nogather", "unread"),
    "ring7": ("ring7",),
    "ring7_unread": ("ring7", "unread"),
}


def _once(text: str, anchor: str, new: str, what: str, where: str = "gemm_sm90.cu") -> str:
    times = text.count(anchor)
    if times != 1:
        raise ValueError(f"stream probe {what}: its anchor is in {where} {times} times")
    return text.replace(anchor, new)


def tiling_source(source: str, edits: Sequence[str]) -> str:
    """experts/gemm.py's text with the named edits that touch it (``"ring7"``; the others are
    the kernel's); ``ValueError`` when an anchor is not found exactly once."""
    for edit in edits:
        for anchor, new in _TILING_EDITS.get(edit, ()):
            source = _once(source, anchor, new, edit, "experts/gemm.py")
    return source


def probe_source(source: str, edits: Sequence[str]) -> str:
    """gemm_sm90.cu's text with the named edits (``"unread"``, ``"bulk"``, ``"nogather"``; those
    of experts/gemm.py are left to :func:`tiling_source`); ``ValueError`` when an anchor is not
    found exactly once (the kernel moved on: update the probe)."""

    for edit in edits:
        if edit in _TILING_EDITS:
            continue
        if edit == "unread":
            source = _once(source, _UNREAD[0], _UNREAD[0] + _UNREAD[1], edit)
        elif edit == "bulk":
            source = _once(source, _BULK_BOXES[0], _BULK_BOXES[1], edit)
            source = _once(source, _BULK_COPY[0], _BULK_COPY[1] + _BULK_COPY[0], edit)
        elif edit == "nogather":
            for anchor, new in _NOGATHER:
                source = _once(source, anchor, new, edit)
        else:
            raise ValueError(f"stream probe: unknown edit {edit!r}")
    return source


def write_probes(root: Path, into: Path, names: Sequence[str] | None = None) -> dict[str, Path]:
    """A copy of ``root``'s ``cupymoe`` per probe (``names``, default all) under ``into``, its
    kernel or tiling edited: probe name -> tree."""
    source = (root / KERNEL).read_text()
    tiling = (root / GEMM).read_text()
    trees = {}
    for name in PROBES if names is None else names:
        edits = PROBES[name]
        tree = into / name
        skip = shutil.ignore_patterns("__pycache__")
        shutil.copytree(root / "cupymoe", tree / "cupymoe", ignore=skip)
        (tree / KERNEL).write_text(probe_source(source, edits))
        (tree / GEMM).write_text(tiling_source(tiling, edits))
        trees[name] = tree
    return trees


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", default=[], help="preset:M,M,... (bench_ab.py)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--warm", type=int, default=0, help="bench_ab.py --warm: compile first")
    ap.add_argument(
        "--probes", default=",".join(PROBES), help=f"comma-separated, of {', '.join(PROBES)}"
    )
    args = ap.parse_args(argv)
    if not args.case:
        ap.error("give at least one --case")
    names = args.probes.split(",")
    unknown = sorted(set(names) - set(PROBES))
    if unknown:
        ap.error(f"unknown probes: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory(prefix="stream_probe_") as tmp:
        trees = write_probes(ROOT, Path(tmp), names)
        ab = [sys.executable, str(ROOT / "benchmarks" / "bench_ab.py"), "--tree", f"landed={ROOT}"]
        for name, tree in trees.items():
            ab += ["--tree", f"{name}={tree}"]
        for case in args.case:
            ab += ["--case", case]
        ab += ["--rounds", str(args.rounds), "--repeats", str(args.repeats)]
        ab += ["--warm", str(args.warm)]
        if args.json:
            ab += ["--json", args.json]
        return subprocess.run(ab).returncode


if __name__ == "__main__":
    sys.exit(main())
