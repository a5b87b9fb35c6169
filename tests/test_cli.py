# SPDX-License-Identifier: Apache-2.0
"""The click CLI: ``run`` on presets and explicit shapes, bad options exit with code 2, ``info``."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from cupymoe._runtime.backend import gpu_available
from cupymoe.cli import cli


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def _error_ok(output: str) -> bool:
    """On a GPU: the error against the float64 reference is small. On the NumPy backend the
    output is that reference, and the error line says so instead of printing a number."""
    if not gpu_available():
        return "error   none measured: on the NumPy backend the output is the float64" in output
    m = re.search(r"max_rel (\S+)\s+rms_rel (\S+)", output)
    assert m, output
    return float(m.group(1)) < 2e-2


def test_run_readme_command() -> None:
    # The README's command, full size: 256 experts of 2048 x 512.
    code, out = _run("run", "--preset", "qwen3.6-35b-a3b", "--tokens", "4", "--repeats", "1")
    assert code == 0, out
    assert "experts=256" in out and "error" in out
    backend = "GPU" if gpu_available() else "NumPy reference (no CUDA GPU found)"
    assert f"backend {backend}" in out
    assert _error_ok(out)


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "deepseek-v3"])
def test_run_presets_with_fewer_experts(preset: str) -> None:
    code, out = _run(
        "run",
        "--preset",
        preset,
        "--experts",
        "32",
        "--tokens",
        "2",
        "--repeats",
        "1",
        "--dtype",
        "fp16",
    )
    assert code == 0, out
    assert "experts=32" in out and _error_ok(out)


def test_run_explicit_shape() -> None:
    code, out = _run(
        "run",
        "--hidden",
        "256",
        "--inter",
        "128",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--format",
        "mxfp4",
        "--tokens",
        "3",
        "--seed",
        "7",
        "--repeats",
        "1",
    )
    assert code == 0, out
    assert "hidden=256" in out and "mxfp4" in out


def test_run_zero_tokens() -> None:
    code, out = _run(
        "run",
        "--hidden",
        "64",
        "--inter",
        "32",
        "--experts",
        "4",
        "--top-k",
        "1",
        "--tokens",
        "0",
        "--repeats",
        "1",
    )
    assert code == 0, out


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["run", "--tokens", "-1", "--preset", "gpt-oss-20b"], "--tokens"),
        (["run", "--preset", "llama"], "--preset"),
        (["run", "--hidden", "64"], "--inter"),
        (["run", "--preset", "gpt-oss-20b", "--top-k", "0"], "--top-k"),
        (["run", "--preset", "gpt-oss-20b", "--top-k", "33"], "--top-k"),
        (["run", "--preset", "deepseek-v3", "--experts", "20"], "--experts"),
        (["run", "--preset", "gpt-oss-20b", "--format", "int4"], "--format"),
        (["run", "--preset", "gpt-oss-20b", "--dtype", "fp8"], "--dtype"),
        (["frobnicate"], "No such command"),
    ],
)
def test_bad_options_exit_2(args: list[str], match: str) -> None:
    code, out = _run(*args)
    assert code == 2, out
    assert match in out


_SHAPE = ["run", "--hidden", "256", "--inter", "128", "--experts", "8", "--top-k", "2"]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        # Every numeric option is range-checked by click (a usage error naming it, not a
        # traceback from NumPy).
        ([*_SHAPE, "--seed", "-5"], "'--seed': -5 is not in the range x>=0"),
        ([*_SHAPE, "--top-k", "-1"], "'--top-k'"),
        ([*_SHAPE, "--repeats", "0"], "'--repeats'"),
        (["run", "--hidden", "0", "--inter", "32", "--experts", "4"], "'--hidden'"),
        (["run", "--preset", "gpt-oss-20b", "--layer", "-1"], "'--layer'"),
        # K of a GEMM not a multiple of the block: the option that sets it is named.
        (
            ["run", "--hidden", "100", "--inter", "128", "--experts", "8", "--top-k", "2"],
            "--hidden: must be a multiple of the nvfp4 block size 16, got 100",
        ),
        (
            ["run", "--hidden", "128", "--inter", "100", "--experts", "8", "--top-k", "2"],
            "--inter: must be a multiple of the nvfp4 block size 16, got 100",
        ),
        (
            [
                "run",
                "--hidden",
                "48",
                "--inter",
                "64",
                "--experts",
                "4",
                "--top-k",
                "2",
                "--format",
                "mxfp4",
            ],
            "--hidden: must be a multiple of the mxfp4 block size 32, got 48",
        ),
        # The preset's top-k no longer fits a smaller --experts: --experts is named, not --top-k.
        (
            ["run", "--preset", "gpt-oss-20b", "--experts", "3"],
            "--experts: 3 experts are fewer than the top-k of gpt-oss-20b (4)",
        ),
        # Options that would do nothing.
        (
            ["run", "--preset", "gpt-oss-20b", "--layer", "3"],
            "--layer: only used with --checkpoint",
        ),
        (["run", "--preset", "gpt-oss-20b", "--naming", "modelopt"], "--naming: only used with"),
        (
            ["run", "--checkpoint", "README.md", "--hidden", "999", "--experts", "4"],
            "--hidden, --experts: the layer's shape and format come from --checkpoint",
        ),
        (["run", "--checkpoint", "README.md", "--format", "mxfp4"], "--format: the layer's shape"),
    ],
)
def test_bad_options_name_the_option(args: list[str], match: str) -> None:
    code, out = _run(*args)
    assert code == 2, out
    assert match in " ".join(out.split()), out
    assert "Traceback" not in out


def test_info() -> None:
    code, out = _run("info")
    assert code == 0, out
    for word in ("cupymoe", "numpy", "cupy", "tuning"):
        assert word in out


def test_info_lists_every_environment_variable() -> None:
    """Every ``CUPYMOE_*`` variable the package reads appears in ``cupymoe info`` (the README
    lists the same four)."""
    from pathlib import Path

    import cupymoe

    source = "".join(p.read_text() for p in Path(cupymoe.__file__).parent.rglob("*.py"))
    names = set(re.findall(r"\"(CUPYMOE_[A-Z_]+)\"", source))
    assert names >= {"CUPYMOE_LINEINFO", "CUPYMOE_GEMV_CONFIG", "CUPYMOE_PDL", "CUPYMOE_CLUSTERS"}
    code, out = _run("info")
    assert code == 0, out
    listed = set(re.findall(r"^  (CUPYMOE_[A-Z_]+)=", out, flags=re.M))
    assert listed == names, out


@pytest.mark.parametrize("naming", ["modelopt", "gpt-oss"])
def test_run_checkpoint(tmp_path, naming: str) -> None:
    import numpy as np

    import cupymoe as cm

    rng = np.random.default_rng(3)
    e, h, i = 4, 64, 32
    fmt = "nvfp4" if naming == "modelopt" else "mxfp4"
    if naming == "modelopt":
        fc1 = (cm.random_fp4_experts(rng, e, i, h, fmt), cm.random_fp4_experts(rng, e, i, h, fmt))
    else:
        fc1 = cm.random_fp4_experts(rng, e, 2 * i, h, fmt)
    path = tmp_path / "model.safetensors"
    cm.save_experts(
        path, layer=3, naming=naming, fc1=fc1, fc2=cm.random_fp4_experts(rng, e, h, i, fmt)
    )
    code, out = _run(
        "run",
        "--checkpoint",
        str(path),
        "--layer",
        "3",
        "--top-k",
        "2",
        "--tokens",
        "2",
        "--repeats",
        "1",
    )
    assert code == 0, out
    assert "loaded" in out and f"experts={e}" in out and f"hidden={h}" in out
    assert _error_ok(out)
    code, out = _run("run", "--checkpoint", str(path), "--layer", "0", "--top-k", "2")
    assert code == 1 and "Error:" in out and "layers" in out  # names the layers that exist


def test_tune_spreads_rows_over_the_presets_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cupymoe tune --preset` times the preset's expert count (the routing density the layer
    has); `--experts` overrides it, 32 without a preset; bad counts fail before any GPU work."""
    import cupymoe.cli as cli_module
    import cupymoe.experts.tune as tune_module

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(cli_module, "_require_gpu", lambda command: None)
    monkeypatch.setattr(tune_module, "tune_gemv", lambda shapes, **kw: calls.append(kw) or {})
    monkeypatch.setattr(tune_module, "tune_gemm", lambda shapes, **kw: calls.append(kw) or {})
    monkeypatch.setattr(tune_module, "count_gemm_trials", lambda shapes, **kw: 1)
    runner = CliRunner()
    for args, experts, n_calls in (
        (["--preset", "deepseek-v3"], 256, 4),  # FC1 and FC2, GEMV then GEMM
        (["--preset", "gpt-oss-20b"], 32, 4),
        (["--preset", "deepseek-v3", "--experts", "64"], 64, 4),
        (["--shape", "256,512"], 32, 2),
    ):
        calls.clear()
        result = runner.invoke(cli, ["tune", *args, "--rows", "8"])
        assert result.exit_code == 0, result.output
        assert len(calls) == n_calls, (args, calls)
        assert calls and all(kw["n_experts"] == experts for kw in calls), (args, calls)
    result = runner.invoke(cli, ["tune", "--preset", "deepseek-v3", "--experts", "0"])
    assert result.exit_code == 2 and "--experts" in result.output


def _fake_tuners(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, object]]]:
    """Record the tuners' calls (no GPU): ``(name, keywords)``; tune_gemm returns one entry."""
    import cupymoe.cli as cli_module
    import cupymoe.experts.tune as tune_module
    from cupymoe.experts.cache import gemm_cache_key

    calls: list[tuple[str, dict[str, object]]] = []

    def fake_gemm(shapes: list[tuple[int, int]], **kw: object) -> dict[str, object]:
        calls.append(("gemm", kw))
        (n, k), op = shapes[0], kw["op"]
        key = gemm_cache_key(
            device_name="GPU",
            op=op,
            fmt=kw["fmt"],
            dtype=kw["dtype"],
            n=n,
            k=k,
            n_experts=kw["n_experts"],
            rows_per_expert=1,
        )
        return {key: {"backend": "gemv", "tokens": 1, "candidates": {"gemv 16x128": 2.0}}}

    monkeypatch.setattr(cli_module, "_require_gpu", lambda command: None)
    monkeypatch.setattr(tune_module, "tune_gemv", lambda shapes, **kw: calls.append(("gemv", kw)))
    monkeypatch.setattr(tune_module, "tune_gemm", fake_gemm)
    monkeypatch.setattr(tune_module, "count_gemm_trials", lambda shapes, **kw: 1)
    return calls


def test_tune_help_lists_the_gemm_options() -> None:
    result = CliRunner().invoke(cli, ["tune", "--help"])
    assert result.exit_code == 0
    for option in ("--kernel", "gemv|gemm|all", "--rows-per-expert", "--tokens", "--top-k"):
        assert option in result.output


def test_tune_kernels_and_rows_per_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """--kernel picks the tuners (all: the GEMV first, so the GEMM meets the tuned GEMV); the
    rows per expert come from --rows-per-expert or from --tokens through the top-k and experts;
    the winners are printed."""
    calls = _fake_tuners(monkeypatch)
    runner = CliRunner()
    result = runner.invoke(cli, ["tune", "--preset", "qwen3.6-35b-a3b"])
    assert result.exit_code == 0, result.output
    assert [name for name, _ in calls] == ["gemv", "gemv", "gemm", "gemm"]
    gemm_kw = calls[2][1]
    from cupymoe.experts.tune import GEMM_TUNE_BUCKETS

    assert gemm_kw["rows_per_expert"] == [float(b) for b in GEMM_TUNE_BUCKETS]
    assert (gemm_kw["op"], gemm_kw["n_experts"], gemm_kw["top_k"]) == ("fc1", 256, 8)
    assert "rows/exp" in result.output and "winner" in result.output  # the table
    calls.clear()
    # 16 tokens x top-8 over 256 experts: 1 row per expert; 64: 2; 4,096: 128
    args = ["tune", "--preset", "qwen3.6-35b-a3b", "--kernel", "gemm", "--tokens", "16,64,4096"]
    result = runner.invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert [name for name, _ in calls] == ["gemm", "gemm"]
    assert calls[0][1]["rows_per_expert"] == [1.0, 2.0, 128.0]
    calls.clear()
    args = ["tune", "--shape", "256,512", "--kernel", "gemm", "--experts", "4", "--top-k", "2"]
    result = runner.invoke(cli, [*args, "--rows-per-expert", "3,16"])
    assert result.exit_code == 0, result.output
    assert calls == [("gemm", calls[0][1])] and calls[0][1]["rows_per_expert"] == [3.0, 16.0]
    assert (calls[0][1]["op"], calls[0][1]["n_experts"], calls[0][1]["top_k"]) == ("fc2", 4, 2)
    calls.clear()
    result = runner.invoke(cli, ["tune", "--preset", "gpt-oss-20b", "--layout", "pair"])
    assert result.exit_code == 0, result.output
    assert [name for name, _ in calls] == ["gemv", "gemv"]  # the GEMM reads the split layout only


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--kernel", "gemm", "--layout", "pair"], "split"),
        (["--kernel", "fast"], "--kernel"),
        (["--rows-per-expert", "4", "--tokens", "16"], "not both"),
        (["--rows-per-expert", "0"], "--rows-per-expert"),
        (["--rows-per-expert", "four"], "--rows-per-expert"),
        (["--tokens", "-1"], "--tokens"),
        (["--experts", "4", "--top-k", "9"], "--top-k"),
        (["--top-k", "0"], "--top-k"),
    ],
)
def test_tune_rejects_bad_options(
    monkeypatch: pytest.MonkeyPatch, args: list[str], match: str
) -> None:
    calls = _fake_tuners(monkeypatch)
    result = CliRunner().invoke(cli, ["tune", "--shape", "256,512", *args])
    assert result.exit_code == 2, result.output
    assert match in result.output and not calls  # before any GPU work


@pytest.mark.skipif(gpu_available(), reason="the NumPy backend's cost; a GPU runs the kernels")
def test_run_deepseek_on_the_numpy_backend_is_practical() -> None:
    """A full DeepSeek-V3 layer (6 GiB of weights) at 4 tokens on the NumPy backend: only the
    selected experts are drawn and decoded (in chunks), with a progress line before each slow
    step. Measured on a 2-core machine: 12 s wall, 1.5 GB peak; the bounds leave room."""
    import os
    import subprocess
    import sys
    import time

    script = (
        "import resource, sys\n"
        "from cupymoe.cli import main\n"
        "sys.argv = ['cupymoe', 'run', '--preset', 'deepseek-v3', '--tokens', '4']\n"
        "try:\n"
        "    main()\n"
        "finally:\n"
        "    print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    )
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=300,
    )
    wall = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    peak_gib = int(re.findall(r"maxrss (\d+)", result.stderr)[-1]) / 2**20  # KiB on Linux
    assert peak_gib < 6, f"peak RSS {peak_gib:.1f} GiB"
    assert wall < 90, f"{wall:.0f} s"
    assert "... running the float64 NumPy reference" in result.stderr
    assert "the experts the tokens select" not in result.stdout  # says how many
    assert re.search(r"the \d+ experts the tokens select, the others left zero", result.stdout)
    assert _error_ok(result.stdout)


def test_python_m_cupymoe_is_the_command() -> None:
    """``python -m cupymoe`` runs the same command as the ``cupymoe`` script (a source tree on
    ``PYTHONPATH`` has no script)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "cupymoe", "--version"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == CliRunner().invoke(cli, ["--version"]).output.strip()
    assert done.stdout.startswith("cupymoe, version ")
