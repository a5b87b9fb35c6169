# SPDX-License-Identifier: Apache-2.0
"""Machine code of kernel specialisations without a GPU: NVRTC -> cubin -> cuobjdump -sass.

    python scripts/sass.py STAGE 'EXPRESSION' ['EXPRESSION' ...] [--arch sm_90] [--loops OPCODE]
        [--dump DIR]

STAGE is a file of ``cupymoe/cuda`` without ``.cu`` (``route_fused``, ``gemv_fp4``, ...), each
EXPRESSION a kernel instantiation as the loader names it (``'route_fused<float, 1, 8>'``). Prints
the static instruction count and the most frequent opcodes of each kernel; with ``--loops
OPCODE`` the instructions per trip of each loop that issues OPCODE (``HGMMA``: the wgmma K loops,
one stage per trip); with ``--dump`` writes the full listing to DIR/<mangled name>.sass. The
text compiled is the loader's (same options, ``-ftz=true`` as CuPy adds). Needs ``cuobjdump`` and
``nvdisasm`` on PATH or from the ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` wheels
(any CUDA 12+ version reads sm_90 cubins).

CuPy's ``nvrtc.getCUBIN`` returns the image one byte short (it treats it as a C string), which
cuobjdump rejects; the image is read through the NVRTC C API instead.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cupymoe.testing import kernel_source, nvrtc_module, offline_options

_OPCODE = re.compile(r"^\s+/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;")
_BACK_BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")


def innermost_loops(listing: str, opcode: str) -> list[tuple[int, int, int, int]]:
    """The loops of a listing whose body holds ``opcode``: ``(start, end, instructions, count of
    opcode)`` for each backward branch, innermost first (shortest body), so a K loop's trip is
    the first row of the loops that issue its ``HGMMA``."""
    rows = [
        (int(m.group(1), 16), m.group(2))
        for m in map(_INSTRUCTION.match, listing.splitlines())
        if m
    ]
    index = {addr: i for i, (addr, _) in enumerate(rows)}
    loops = []
    for i, (addr, text) in enumerate(rows):
        m = _BACK_BRANCH.search(text)
        target = int(m.group(1), 16) if m else None
        if target is not None and target < addr and target in index:
            body = rows[index[target] : i + 1]
            hits = sum(1 for _, t in body if re.search(rf"\b{opcode}\b", t))
            if hits:
                loops.append((target, addr, len(body), hits))
    return sorted(loops, key=lambda loop: loop[2])


def _cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations or [] if spec else []:
        for candidate in Path(root).glob("cu*/bin/cuobjdump"):
            return str(candidate)
    sys.exit("cuobjdump not found: install the nvidia-cuda-cuobjdump wheel or a CUDA toolkit")


def _tool_env(tool: str) -> dict[str, str]:
    """The environment for ``cuobjdump -sass``, which runs ``nvdisasm``: the cuobjdump's own
    folder first on PATH (where the nvidia-cuda-nvdisasm wheel puts it beside the cuobjdump
    wheel's)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(tool).parent), env.get("PATH", "")])
    if not shutil.which("nvdisasm", path=env["PATH"]):
        sys.exit("nvdisasm not found: install the nvidia-cuda-nvdisasm wheel or a CUDA toolkit")
    return env


def _loaded_libnvrtc() -> ctypes.CDLL:
    """The libnvrtc this process already uses (through CuPy)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if re.search(r"/libnvrtc(\.alt)?\.so[.\d]*$", path):
                return ctypes.CDLL(path)
    sys.exit("libnvrtc is not loaded")


def cubin(stage: str, expressions: list[str], arch: str) -> tuple[bytes, dict[str, str]]:
    """Compile ``expressions`` of ``stage`` for ``arch``; return the cubin and lowered names."""
    nvrtc = nvrtc_module()
    program = nvrtc.createProgram(kernel_source(stage), f"{stage}.cu", [], [])
    try:
        for expression in expressions:
            nvrtc.addNameExpression(program, expression)
        try:
            nvrtc.compileProgram(program, offline_options(arch))
        except nvrtc.NVRTCError:
            sys.exit(nvrtc.getProgramLog(program))
        lowered = {e: nvrtc.getLoweredName(program, e) for e in expressions}
        lib = _loaded_libnvrtc()
        size = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(ctypes.c_void_p(program), ctypes.byref(size)) != 0:
            sys.exit("nvrtcGetCUBINSize failed")
        image = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetCUBIN(ctypes.c_void_p(program), image) != 0:
            sys.exit("nvrtcGetCUBIN failed")
        return image.raw, lowered
    finally:
        nvrtc.destroyProgram(program)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage")
    parser.add_argument("expressions", nargs="+")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--dump", type=Path, help="write each listing to DIR/<name>.sass")
    parser.add_argument(
        "--loops",
        metavar="OPCODE",
        help="also list the loops whose body holds OPCODE (e.g. HGMMA): instructions per trip",
    )
    a = parser.parse_args()
    image, lowered = cubin(a.stage, a.expressions, a.arch)
    tool = _cuobjdump()
    env = _tool_env(tool)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{a.stage}.cubin")
        Path(path).write_bytes(image)
        for expression, name in lowered.items():
            listing = subprocess.run(
                [tool, "-sass", "-fun", name, path],
                capture_output=True,
                text=True,
                check=True,
                env=env,
            ).stdout
            ops = collections.Counter(
                m.group(1) for m in map(_OPCODE.match, listing.splitlines()) if m
            )
            print(f"{expression}: {sum(ops.values())} instructions")
            print("   " + ", ".join(f"{op} {n}" for op, n in ops.most_common(16)))
            if a.loops:
                for start, end, count, hits in innermost_loops(listing, a.loops)[:8]:
                    print(f"   loop {start:#x}-{end:#x}: {count} instructions, {hits} {a.loops}")
            if a.dump:
                a.dump.mkdir(parents=True, exist_ok=True)
                (a.dump / f"{name}.sass").write_text(listing)


if __name__ == "__main__":
    main()
