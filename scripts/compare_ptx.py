# SPDX-License-Identifier: Apache-2.0
"""Compare the PTX of kernel specialisations between a git revision and the working tree, with
no GPU: proof that a change left existing specialisations' code as it was.

    python scripts/compare_ptx.py BASE_REV [--stage route --stage gemv_fp4 ...] [--arch sm_90]

Each spec the base revision lists (``all_kernel_specs`` of its tree) is compiled alone with
NVRTC from both trees; the PTX is compared after normalising the source-hash part of internal
symbol names (it changes with any edit of the file's text). Reports the specs whose PTX differs;
a spec whose kernel gained a parameter differs in its signature only (look with ``--show``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

_NAMES = re.compile(r"_(INTERNAL|GLOBAL__N_)_[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+_\d+")

_WORKER = r"""
import hashlib, json, re, sys
from cupymoe._runtime import compile as loader
from cupymoe._runtime.compile import KernelSpec, all_kernel_specs
from cupymoe._runtime.offline import nvrtc_module, offline_options
stages, arch, wanted = json.loads(sys.argv[1])
specs = [s for s in all_kernel_specs() if not stages or s.stage in stages]
if wanted is not None:
    specs = [s for s in specs if s.expression in wanted]
nvrtc, out = nvrtc_module(), {}
for spec in specs:
    prog = nvrtc.createProgram(loader.kernel_source(spec.stage), f"{spec.stage}.cu", [], [])
    nvrtc.addNameExpression(prog, spec.expression)
    nvrtc.compileProgram(prog, offline_options(spec.target or arch))
    ptx = nvrtc.getPTX(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    out[spec.expression] = re.sub(NAMES, "_X", ptx)
    nvrtc.destroyProgram(prog)
json.dump(out, sys.stdout)
"""


def _ptx(root: str, stages: list[str], arch: str, wanted: list[str] | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": root}
    code = _WORKER.replace("NAMES", repr(_NAMES.pattern))
    args = json.dumps([stages, arch, wanted])
    done = subprocess.run(
        [sys.executable, "-c", code, args], env=env, cwd=root, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(done.stderr)
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="git revision of the old tree")
    parser.add_argument("--stage", action="append", default=[], help="file stem (repeatable)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--show", action="store_true", help="print the diff of each change")
    args = parser.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as base:
        archive = subprocess.run(
            ["git", "-C", here, "archive", args.base, "cupymoe"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", base], input=archive.stdout, check=True)
        old = _ptx(base, args.stage, args.arch, None)
    new = _ptx(here, args.stage, args.arch, sorted(old))
    changed = [s for s in old if new.get(s) != old[s]]
    for spec in changed:
        print(f"differs: {spec}" if spec in new else f"gone: {spec}")
        if args.show and spec in new:
            import difflib

            diff = difflib.unified_diff(old[spec].splitlines(), new[spec].splitlines(), lineterm="")
            print("\n".join(list(diff)[:60]))
    digest = hashlib.sha256("".join(sorted(old)).encode()).hexdigest()[:12]
    print(f"{len(old)} specs of {args.base} ({digest}): {len(changed)} changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
