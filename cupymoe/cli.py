# SPDX-License-Identifier: Apache-2.0
"""``cupymoe`` command line: a thin click layer over library calls.

Commands: ``run`` (one layer, error against the reference, time per stage), ``bench``
(CUDA-graph replay over a stack of layers), ``tune`` (GEMV tilings and the GEMV/GEMM hand-over
with the GEMM's tilings into the JSON cache),
``info`` (GPU, CuPy / NVRTC versions, cache paths, environment variables).
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import click
import ml_dtypes
import numpy as np

from ._runtime.backend import cupy_or_none, gpu_available
from ._runtime.compile import ENV_KERNEL_CACHE, ENV_LINEINFO, kernel_cache_dir
from ._runtime.device import device_name
from ._runtime.launch import ENV_CLUSTERS, ENV_PDL
from ._version import __version__
from .experts.activation import Activation
from .experts.config import ENV_GEMV_CONFIG
from .experts.gemm import ENV_WGMMA
from .experts.layouts import WeightLayout
from .presets import PRESETS, LayerShape, random_layer, random_layer_gpu
from .routing import RoutingMethod

_DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}
#: Tokens ``run`` checks against the float64 reference by default (``--check-tokens``).
CHECK_TOKENS = 8

_dtype_option = click.option(
    "--dtype", type=click.Choice(sorted(_DTYPES)), default="bf16", show_default=True
)


def _repeats_option(default: int, *, minimum: int) -> Any:
    return click.option(
        "--repeats", type=click.IntRange(min=minimum), default=default, show_default=True
    )


def _count_option(name: str, help: str) -> Any:
    """An optional positive count (``None`` when not given)."""
    return click.option(name, type=click.IntRange(min=1), default=None, help=help)


def _shape_from_options(preset: str | None, **options: Any) -> LayerShape:
    """A preset with the explicit options (``hidden``, ``inter``, ``experts``, ``top_k``,
    ``fmt``; ``None`` when not given) applied on top, or a fully explicit shape."""
    hidden, inter, experts = options["hidden"], options["inter"], options["experts"]
    top_k, fmt = options["top_k"], options["fmt"]
    if preset is not None:
        base = PRESETS[preset]
    else:
        missing = [
            name
            for name, v in (("--hidden", hidden), ("--inter", inter), ("--experts", experts))
            if v is None
        ]
        if missing:
            raise click.UsageError(
                f"give --preset or all of --hidden/--inter/--experts (missing {', '.join(missing)})"
            )
        base = LayerShape("custom", 0, 0, 0, 8 if top_k is None else top_k, fmt or "nvfp4")
    changes: dict[str, Any] = {
        k: v
        for k, v in (
            ("hidden", hidden),
            ("intermediate", inter),
            ("n_experts", experts),
            ("top_k", top_k),
            ("format", fmt),
        )
        if v is not None
    }
    import dataclasses

    shape = dataclasses.replace(base, **changes)
    if shape.top_k > shape.n_experts:
        if top_k is not None:
            raise click.BadParameter(
                f"must be in 1..{shape.n_experts} (the number of experts), got {shape.top_k}",
                param_hint="--top-k",
            )
        raise click.BadParameter(
            f"{shape.n_experts} experts are fewer than the top-k of {shape.name} "
            f"({shape.top_k}); pass at least {shape.top_k} experts or --top-k 1..{shape.n_experts}",
            param_hint="--experts",
        )
    block = 16 if shape.format == "nvfp4" else 32
    for option, size, given in (
        ("--hidden", shape.hidden, hidden),
        ("--inter", shape.intermediate, inter),
    ):
        if size % block:
            source = "" if given is not None else f" ({shape.name}'s)"
            raise click.BadParameter(
                f"must be a multiple of the {shape.format} block size {block}, got {size}{source}",
                param_hint=option,
            )
    if shape.n_group is not None and shape.n_experts % shape.n_group:
        raise click.BadParameter(
            f"{shape.name} routes in {shape.n_group} groups; --experts must be a multiple of it",
            param_hint="--experts",
        )
    return shape


def _checkpoint_layer(
    path: str,
    layer: int,
    naming: str,
    preset: str | None,
    top_k: int | None,
    overrides: dict[str, Any],
) -> tuple[LayerShape, dict[str, Any]]:
    """Weights from a checkpoint; routing and activation from ``--preset`` (weights lack them)."""
    import dataclasses

    from .io import load_experts

    try:
        weights = load_experts(path, layer=layer, naming=naming)
    except (ValueError, KeyError, OSError) as error:
        raise click.ClickException(str(error)) from error
    down = weights["fc2"]
    base = PRESETS[preset] if preset else LayerShape("checkpoint", 0, 0, 0, 8, "nvfp4")
    shape = dataclasses.replace(
        base,
        name=f"{path}:{layer}",
        hidden=down.n,
        intermediate=down.k,
        n_experts=down.n_experts,
        format=down.format.value,
        top_k=top_k if top_k is not None else min(base.top_k, down.n_experts),
        **overrides,
    )
    kwargs = {**shape.layer_kwargs(), **weights}
    if shape.routing == "sigmoid_grouped":
        kwargs["correction_bias"] = np.zeros(shape.n_experts, np.float32)
    return shape, kwargs


def _median_time(fn: Any, repeats: int, sync: Any) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cupymoe")
def cli() -> None:
    """Run 4-bit (NVFP4 / MXFP4) Mixture-of-Experts layers on NVIDIA GPUs."""


_preset_option = click.option(
    "--preset", type=click.Choice(sorted(PRESETS)), help="a real model's layer shape"
)


@cli.command()
@_preset_option
@click.option("--hidden", type=click.IntRange(min=1), help="hidden size H")
@click.option("--inter", type=click.IntRange(min=1), help="intermediate size I (per expert)")
@click.option("--experts", type=click.IntRange(min=1), help="number of experts E")
@click.option("--top-k", type=click.IntRange(min=1), help="experts per token")
@click.option("--format", "fmt", type=click.Choice(["nvfp4", "mxfp4"]), help="weight format")
@click.option("--tokens", type=click.IntRange(min=0), default=1, show_default=True)
@_dtype_option
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=None,
    help="timed calls  [default: 5 on a GPU, 1 on the NumPy backend]",
)
@click.option(
    "--routing",
    type=click.Choice([m.value for m in RoutingMethod]),
    help="router kind  [default: the preset's, else softmax_topk]",
)
@click.option(
    "--router-weights",
    is_flag=True,
    help="separate random mixing weights (ONNX Runtime's router_weights): top-k on the logits, "
    "weights gathered from these",
)
@click.option(
    "--activation",
    type=click.Choice([a.value for a in Activation]),
    help="FC1 activation; relu/gelu/silu/identity are non-gated (FC1 [E, I, H])  "
    "[default: the preset's, else swiglu]",
)
@click.option(
    "--checkpoint",
    type=click.Path(exists=True),
    help="safetensors file, index or directory (ModelOpt NVFP4 / gpt-oss MXFP4 naming)",
)
@click.option(
    "--layer",
    "layer_index",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="layer to load from --checkpoint",
)
@click.option(
    "--naming",
    type=click.Choice(["auto", "modelopt", "compressed-tensors", "gpt-oss"]),
    default="auto",
    show_default=True,
    help="tensor naming of --checkpoint",
)
@click.option(
    "--check-tokens",
    type=click.IntRange(min=0),
    default=CHECK_TOKENS,
    show_default=True,
    help="tokens (the first N; 0: all) checked against the float64 NumPy reference on a GPU",
)
def run(
    preset: str | None,
    hidden: int | None,
    inter: int | None,
    experts: int | None,
    top_k: int | None,
    fmt: str | None,
    tokens: int,
    dtype: str,
    seed: int,
    repeats: int | None,
    routing: str | None,
    router_weights: bool,
    activation: str | None,
    checkpoint: str | None,
    layer_index: int,
    naming: str,
    check_tokens: int,
) -> None:
    """Run one MoE layer on random (or loaded) weights; print the output, its error against the
    float64 reference (on a GPU) and timings."""
    import dataclasses

    from .layer import MoELayer, moe_reference
    from .testing import relative_errors

    _check_unused_options(checkpoint, hidden=hidden, inter=inter, experts=experts, fmt=fmt)
    on_gpu = gpu_available()
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    if checkpoint is not None:
        _progress(f"loading layer {layer_index} of {checkpoint}")
        shape, kwargs = _checkpoint_layer(
            checkpoint, layer_index, naming, preset, top_k, _layer_overrides(routing, activation)
        )
        x, logits = _inputs(rng, tokens, shape, dtype)
    else:
        shape = _shape_from_options(
            preset, hidden=hidden, inter=inter, experts=experts, top_k=top_k, fmt=fmt
        )
        shape = dataclasses.replace(shape, **_layer_overrides(routing, activation))
        x, logits = _inputs(rng, tokens, shape, dtype)
        # On a GPU the weights are drawn there (seconds for DeepSeek-V3, against minutes on the
        # host); the NumPy backend reads only the experts the tokens select: draw only those.
        _progress(
            "drawing random weights " + ("on the GPU" if on_gpu else "of the selected experts")
        )
    try:
        if checkpoint is None and on_gpu:
            kwargs = random_layer_gpu(shape, rng, seed=seed)
        elif checkpoint is None:
            kwargs = random_layer(shape, rng, only_for=logits)
        kwargs["max_tokens"] = max(tokens, 1)
        layer = MoELayer(**kwargs)
    except (ValueError, TypeError) as error:
        raise click.ClickException(str(error)) from error
    made = time.perf_counter() - t0
    click.echo(f"layer   {layer!r}")
    if checkpoint is not None:
        source = f"loaded in {made:.1f} s"
    elif on_gpu:
        source = f"random, drawn on the GPU in {made:.1f} s"
    else:
        drawn = _selected_experts(layer, logits)
        source = (
            f"random, made in {made:.1f} s: the {drawn} experts the tokens select, "
            "the others left zero"
        )
    click.echo(
        f"weights {layer.weight_nbytes / 2**20:.1f} MiB ({source}); "
        f"x [{tokens}, {shape.hidden}] {dtype}"
    )
    mix = rng.random(logits.shape).astype(np.float32) if router_weights else None
    try:
        layer.check_router_weights(mix, logits)
    except (ValueError, TypeError) as error:
        raise click.ClickException(f"--router-weights: {error}") from error
    if on_gpu:
        cupy = cupy_or_none()
        assert cupy is not None
        repeats = 5 if repeats is None else repeats
        _progress(
            "uploading the weights and running the layer on the GPU (the first use of a shape "
            "compiles its kernels)"
        )
        xd, ld = cupy.asarray(x), cupy.asarray(logits)
        md = None if mix is None else cupy.asarray(mix)
        out = layer(xd, ld, router_weights=md)
        sync = cupy.cuda.get_current_stream().synchronize
        seconds = _median_time(lambda: layer(xd, ld, router_weights=md), repeats, sync)
        out_host = out.get()
        click.echo(f"backend GPU ({device_name()})")
        click.echo(f"time    {seconds * 1e6:.1f} us per eager call + sync (median of {repeats})")
        _progress("timing each stage (one CUDA graph per stage)")
        for stage, us in layer.stage_times(xd, ld).items():
            click.echo(f"  {stage:<10} {us:8.2f} us")
    else:
        click.echo("backend NumPy reference (no CUDA GPU found)")
        _progress("running the float64 NumPy reference")
        with warnings.catch_warnings():  # the line above already says it
            warnings.simplefilter("ignore", RuntimeWarning)
            start = time.perf_counter()
            out_host = layer(x, logits, router_weights=mix)
            seconds = time.perf_counter() - start
            if repeats is not None and repeats > 1:
                seconds = _median_time(
                    lambda: layer(x, logits, router_weights=mix), repeats, lambda: None
                )
        click.echo(f"time    {seconds * 1e3:.1f} ms per call (median of {repeats or 1})")
    flat = out_host.astype(np.float64)
    if flat.size:
        click.echo(
            f"output  [{tokens}, {shape.hidden}] mean {flat.mean():+.4f} std {flat.std():.4f} "
            f"max|.| {np.abs(flat).max():.4f}"
        )
    if on_gpu and tokens:
        # The NumPy reference decodes every expert a token selects in float64: the first
        # --check-tokens tokens bound its cost (DeepSeek-V3, 8 tokens: up to 64 experts).
        checked = tokens if check_tokens == 0 else min(tokens, check_tokens)
        _progress(f"computing the float64 reference of {checked} of {tokens} tokens")
        ref = moe_reference(
            x[:checked],
            logits[:checked],
            layer,
            router_weights=None if mix is None else mix[:checked],
        )
        max_rel, rms_rel = relative_errors(ref, out_host[:checked])
        click.echo(
            f"error   max_rel {max_rel:.3e}  rms_rel {rms_rel:.3e}  (vs float64 reference, "
            f"{checked} of {tokens} tokens)"
        )
    else:
        click.echo(
            f"error   none measured: on the NumPy backend the output is the float64 reference "
            f"itself, rounded to {dtype}"
        )


def _layer_overrides(routing: str | None, activation: str | None) -> dict[str, Any]:
    """``--routing`` / ``--activation`` as LayerShape fields (those given); a checkpoint's FC1 is
    gated, so a non-gated ``--activation`` needs random weights."""
    changes: dict[str, Any] = {}
    if routing is not None:
        changes["routing"] = routing
    if activation is not None:
        changes["activation"] = activation
        if not Activation.parse(activation).gated:
            changes["fc1_layout"] = None
    return changes


def _inputs(
    rng: np.random.Generator, tokens: int, shape: LayerShape, dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    """Random activations ``[tokens, H]`` and router logits ``[tokens, E]``."""
    x = rng.standard_normal((tokens, shape.hidden)).astype(_DTYPES[dtype])
    logits = rng.standard_normal((tokens, shape.n_experts)).astype(np.float32)
    return x, logits


def _selected_experts(layer: Any, logits: np.ndarray) -> int:
    """How many distinct experts ``logits`` select in ``layer``."""
    from .routing import route_ref

    return int(np.unique(route_ref(logits, layer.router).topk_ids).size)


def _progress(message: str) -> None:
    """One line on stderr before a step that may take more than a second."""
    click.echo(f"... {message}", err=True)


def _check_unused_options(checkpoint: str | None, **options: Any) -> None:
    """Options that would change nothing are usage errors, not silently ignored."""
    ctx = click.get_current_context()
    if checkpoint is not None:
        given = [
            f"--{n}" if n != "fmt" else "--format" for n, v in options.items() if v is not None
        ]
        if given:
            raise click.UsageError(
                f"{', '.join(given)}: the layer's shape and format come from --checkpoint; "
                "drop them (--preset and --top-k set its routing)"
            )
        return
    source = click.core.ParameterSource
    given = [
        option
        for name, option in (("layer_index", "--layer"), ("naming", "--naming"))
        if ctx.get_parameter_source(name) is not source.DEFAULT
    ]
    if given:
        raise click.UsageError(f"{', '.join(given)}: only used with --checkpoint")


def _int_list(value: str, name: str) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated integers, got {value!r}", param_hint=name
        ) from None
    if not items or min(items) < 1:
        raise click.BadParameter(f"expected positive integers, got {value!r}", param_hint=name)
    return items


def _require_gpu(command: str) -> None:
    if not gpu_available():
        raise click.ClickException(
            f"`cupymoe {command}` times GPU kernels and needs a CUDA GPU (none found); "
            "`cupymoe run` works without one"
        )


@cli.command()
@click.option(
    "--preset",
    "presets",
    type=click.Choice(sorted(PRESETS)),
    multiple=True,
    help="preset(s) to time (default: all three)",
)
@click.option(
    "--tokens", default="1,2,4,8,16,64", show_default=True, help="comma-separated token counts"
)
@_dtype_option
@_count_option("--layers", "layers in the stack (default: enough to read 4x the L2 at one token)")
@_repeats_option(30, minimum=3)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write results as JSON")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), help="write results as CSV")
def bench(
    presets: tuple[str, ...],
    tokens: str,
    dtype: str,
    layers: int | None,
    repeats: int,
    json_path: str | None,
    csv_path: str | None,
) -> None:
    """Time whole layers: CUDA-graph replay over a stack of layers, µs and % of the HBM floor."""
    token_list = _int_list(tokens, "--tokens")
    _require_gpu("bench")
    from .bench import bench_preset, format_table, write_csv, write_json

    names = presets or tuple(PRESETS)
    results = []
    with click.progressbar(
        length=len(names) * len(token_list), label="benchmarking", file=sys.stderr
    ) as bar:
        for name in names:

            def step(label: str) -> None:
                bar.label = label
                bar.update(1)

            results += bench_preset(
                PRESETS[name],
                token_list,
                dtype=_DTYPES[dtype],
                n_layers=layers,
                repeats=repeats,
                progress=step,
            )
            cupy_or_none().get_default_memory_pool().free_all_blocks()  # type: ignore[union-attr]
    click.echo(format_table(results))
    if json_path:
        command = " ".join(["cupymoe", *sys.argv[1:]])
        write_json(json_path, results, gpu=device_name(), command=command)
    if csv_path:
        write_csv(csv_path, results)


@cli.command()
@_preset_option
@click.option(
    "--shape",
    "shapes",
    multiple=True,
    help="N,K of one matrix per expert [E, N, K] (an FC2) to tune (repeatable); default: the "
    "preset's FC1 and FC2",
)
@click.option("--format", "fmt", type=click.Choice(["nvfp4", "mxfp4"]), help="weight format")
@_dtype_option
@click.option(
    "--kernel",
    type=click.Choice(["gemv", "gemm", "all"]),
    default=None,
    help="gemv: the GEMV tilings per row bucket; gemm: the GEMV against every grouped-GEMM "
    "tiling per bucket of rows per expert (the hand-over); all: gemv, then gemm "
    "[default: all on the split layout, gemv on pair / plain]",
)
@click.option(
    "--rows",
    default="1,2,4,8,16,32,64",
    show_default=True,
    help="comma-separated expanded-row counts (--kernel gemv)",
)
@click.option(
    "--rows-per-expert",
    default=None,
    help="comma-separated average rows per active expert (--kernel gemm) [default: 1,2,4,...,512]",
)
@click.option(
    "--tokens",
    default=None,
    help="comma-separated token counts, for --kernel gemm instead of --rows-per-expert "
    "(rows per expert from the top-k and experts)",
)
@click.option(
    "--layout",
    type=click.Choice([layout.key for layout in WeightLayout]),
    default=WeightLayout.SPLIT.key,
    show_default=True,
    help="weight layout the GEMV reads: its split copy, or the uploaded bytes (pair, plain)",
)
@_count_option(
    "--experts",
    "experts per weight set, which sets how the rows spread (default: the preset's, else 32)",
)
@_count_option("--top-k", "experts per token for --kernel gemm (default: the preset's, else 8)")
@_repeats_option(20, minimum=3)
def tune(
    preset: str | None,
    shapes: tuple[str, ...],
    fmt: str | None,
    dtype: str,
    kernel: str | None,
    rows: str,
    rows_per_expert: str | None,
    tokens: str | None,
    layout: str,
    experts: int | None,
    top_k: int | None,
    repeats: int,
) -> None:
    """Profile the GEMV tilings and the GEMV/GEMM hand-over for the given shapes; store the
    winners in the tuning cache and print the grouped-GEMM winners."""
    rows_list = _int_list(rows, "--rows")
    pairs: list[tuple[int, int, str]] = []
    for text in shapes:
        n_k = _int_list(text, "--shape")
        if len(n_k) != 2:
            raise click.BadParameter(f"expected N,K, got {text!r}", param_hint="--shape")
        pairs.append((n_k[0], n_k[1], "fc2"))
    if preset is not None:
        p = PRESETS[preset]
        fmt = fmt or p.format
        experts = experts or p.n_experts
        top_k = top_k or p.top_k
        pairs += [(p.intermediate, p.hidden, "fc1"), (p.hidden, p.intermediate, "fc2")]
    if not pairs:
        raise click.UsageError("give --preset or at least one --shape N,K")
    split = layout == WeightLayout.SPLIT.key
    kernel = kernel or ("all" if split else "gemv")
    if kernel != "gemv" and not split:
        raise click.BadParameter(
            f"--kernel {kernel} times the grouped GEMM, which reads the split layout only; "
            f"use --kernel gemv with --layout {layout}",
            param_hint="--kernel",
        )
    experts = experts or 32
    top_k = top_k or min(8, experts)
    if top_k > experts:
        raise click.BadParameter(
            f"must be in 1..{experts} (the experts), got {top_k}", param_hint="--top-k"
        )
    if rows_per_expert is not None and tokens is not None:
        raise click.UsageError("give --rows-per-expert or --tokens, not both")
    from .experts.handover import rows_per_expert as average_rows
    from .experts.tune import GEMM_TUNE_BUCKETS

    if tokens is not None:
        per_expert = [average_rows(t * top_k, experts) for t in _int_list(tokens, "--tokens")]
    else:
        default = ",".join(map(str, GEMM_TUNE_BUCKETS))
        per_expert = [float(r) for r in _int_list(rows_per_expert or default, "--rows-per-expert")]
    _require_gpu("tune")
    from .experts.cache import cache_path
    from .experts.tune import count_gemm_trials, count_trials, gemm_table, tune_gemm, tune_gemv

    fmt = fmt or "nvfp4"
    matrices = [(n, k) for n, k, _ in pairs]
    if kernel in ("gemv", "all"):
        with _tune_progress(count_trials(matrices, rows_list=rows_list), "tuning the GEMV") as step:
            for n, k, op in pairs:
                tune_gemv(
                    [(n, k)],
                    fmt=fmt,
                    dtype=_DTYPES[dtype],
                    rows_list=rows_list,
                    op=op,
                    layout=layout,
                    n_experts=experts,
                    repeats=repeats,
                    progress=step,
                )
        click.echo(
            f"stored {len(pairs)} GEMV shape(s) x {len(rows_list)} row buckets in {cache_path()}"
        )
    if kernel in ("gemm", "all"):
        total = count_gemm_trials(
            matrices, fmt=fmt, rows_per_expert=per_expert, n_experts=experts, top_k=top_k
        )
        results: dict[str, Any] = {}
        with _tune_progress(total, "tuning the GEMV/GEMM hand-over") as step:
            for n, k, op in pairs:
                found = tune_gemm(
                    [(n, k)],
                    fmt=fmt,
                    dtype=_DTYPES[dtype],
                    rows_per_expert=per_expert,
                    op=op,
                    n_experts=experts,
                    top_k=top_k,
                    repeats=repeats,
                    progress=step,
                )
                results.update(found)
        click.echo(gemm_table(results))
        click.echo(f"stored {len(results)} GEMV/GEMM entries in {cache_path()}")


@contextlib.contextmanager
def _tune_progress(total: int, label: str) -> Iterator[Callable[[int, int, str], None]]:
    """A progress bar on a terminal, else one line per timing on stderr; yields the tuners'
    ``progress(done, total, label)`` callback (whose ``done`` restarts at 0 in every call)."""
    state = {"done": 0, "base": 0}
    bars: list[Any] = []  # the bar, on a terminal

    def step(done: int, _total: int, text: str) -> None:
        if done == 0:
            state["base"] = state["done"]
            return
        now = state["base"] + done
        if bars:
            bars[0].label = text
            bars[0].update(now - state["done"])
        else:
            click.echo(f"[{now}/{total}] {text}", err=True)
        state["done"] = now

    if not sys.stderr.isatty():
        click.echo(f"{label}: {total} timings", err=True)
        yield step
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        bars.append(bar)
        yield step


@cli.command()
def info() -> None:
    """GPU, CuPy / NVRTC versions, cache paths and the environment variables in force."""

    click.echo(f"cupymoe  {__version__}")
    click.echo(f"python   {platform.python_version()} ({sys.executable})")
    click.echo(f"numpy    {np.__version__}   ml_dtypes {ml_dtypes.__version__}")
    cupy = cupy_or_none()
    if cupy is None:
        click.echo("cupy     not installed (pip install 'cupymoe[cuda12]'); reference backend only")
    else:
        click.echo(f"cupy     {cupy.__version__}")
        try:
            from cupy_backends.cuda.libs import nvrtc

            click.echo(f"nvrtc    {'.'.join(map(str, nvrtc.getVersion()))}")
        except Exception as error:  # NVRTC library not found
            click.echo(f"nvrtc    unavailable ({error})")
        if gpu_available():
            props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
            click.echo(
                f"gpu      {device_name()} (sm_{props['major']}{props['minor']}, "
                f"{props['multiProcessorCount']} SMs, {props['totalGlobalMem'] / 2**30:.0f} GiB)"
            )
            from ._runtime.launch import pdl_enabled

            state = "on" if pdl_enabled() else "off (needs sm_90+, driver 12.3+, CUPYMOE_PDL!=0)"
            click.echo(f"pdl      programmatic dependent launches {state}")
        else:
            click.echo("gpu      none found; reference backend")
        cache = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
        click.echo(f"kernels  CuPy cache {cache}; sm_90a cubins {kernel_cache_dir()}")
    from .experts.cache import cache_path, summary

    counts = summary()
    click.echo(
        f"tuning   {cache_path()} ({counts['gemv']} GEMV tilings, {counts['gemm']} GEMV/GEMM "
        "hand-over entries)"
    )
    click.echo("environment:")
    for name in (ENV_LINEINFO, ENV_GEMV_CONFIG, ENV_PDL, ENV_CLUSTERS, ENV_WGMMA, ENV_KERNEL_CACHE):
        click.echo(f"  {name}={os.environ.get(name, '')!s:<20} ")


def main() -> None:
    """Entry point of the ``cupymoe`` script."""
    cli(prog_name="cupymoe")


if __name__ == "__main__":
    main()
