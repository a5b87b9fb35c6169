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


def _error(output: str) -> float:
    m = re.search(r"max_rel (\S+)\s+rms_rel (\S+)", output)
    assert m, output
    return float(m.group(1))


def test_run_readme_command() -> None:
    # The README's command, full size: 256 experts of 2048 x 512.
    code, out = _run("run", "--preset", "qwen3.6-35b-a3b", "--tokens", "4", "--repeats", "1")
    assert code == 0, out
    assert "experts=256" in out and "error" in out
    backend = "GPU" if gpu_available() else "NumPy reference (no CUDA GPU found)"
    assert f"backend {backend}" in out
    assert _error(out) < 2e-2  # the reference itself (bf16 rounding) or the GPU kernels


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
    assert "experts=32" in out and _error(out) < 2e-2


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


def test_bad_shape_is_a_clear_error() -> None:
    # K = 40 is not a multiple of the NVFP4 block (16): the library's ValueError, exit code 1.
    code, out = _run(
        "run", "--hidden", "40", "--inter", "32", "--experts", "4", "--top-k", "1", "--repeats", "1"
    )
    assert code == 1, out
    assert "Error:" in out and "16" in out


def test_info() -> None:
    code, out = _run("info")
    assert code == 0, out
    for word in ("cupymoe", "numpy", "cupy", "tuning", "CUPYMOE_LINEINFO", "CUPYMOE_PDL"):
        assert word in out


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
    assert _error(out) < 2e-2
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
    runner = CliRunner()
    for args, experts in (
        (["--preset", "deepseek-v3"], 256),
        (["--preset", "gpt-oss-20b"], 32),
        (["--preset", "deepseek-v3", "--experts", "64"], 64),
        (["--shape", "256,512"], 32),
    ):
        calls.clear()
        result = runner.invoke(cli, ["tune", *args, "--rows", "8"])
        assert result.exit_code == 0, result.output
        assert calls and all(kw["n_experts"] == experts for kw in calls), (args, calls)
    result = runner.invoke(cli, ["tune", "--preset", "deepseek-v3", "--experts", "0"])
    assert result.exit_code == 2 and "--experts" in result.output
