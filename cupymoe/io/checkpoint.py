# SPDX-License-Identifier: Apache-2.0
"""Expert weights from safetensors checkpoints, in NumPy (no ``safetensors`` package needed).

Files are read and written by :mod:`cupymoe.safetensors_io` (memory-mapped: only the tensors
asked for are read from disk).

**Namings** of one MoE layer's experts (``FORMATS.md``), with ``prefix`` such as
``model.layers.{layer}.mlp``:

* ``modelopt`` (NVIDIA ModelOpt NVFP4): per expert ``e`` and ``proj`` in ``gate_proj, up_proj,
  down_proj``: ``{prefix}.experts.{e}.{proj}.weight`` uint8 ``[N, K/2]`` (element 2i in the low
  nibble), ``.weight_scale`` float8_e4m3fn ``[N, K/16]``, ``.weight_scale_2`` float32 ``[]`` or
  ``[1]`` (the global scale), ``.input_scale`` (ignored), optional ``.bias`` ``[N]``.
* ``compressed-tensors`` (NVFP4): ``.weight_packed``, ``.weight_scale`` and
  ``.weight_global_scale``, which is the **reciprocal** of the global scale.
* ``gpt-oss`` (MXFP4): ``{prefix}.experts.gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]``,
  ``gate_up_proj_scales`` uint8 E8M0 ``[E, 2I, H/32]``, ``gate_up_proj_bias`` ``[E, 2I]``,
  ``down_proj_blocks`` ``[E, H, I/32, 16]``, ``down_proj_scales`` ``[E, H, I/32]``,
  ``down_proj_bias`` ``[E, H]``; gate and up rows **interleaved** (gate0, up0, gate1, ...). The
  16 bytes of a block hold its 32 codes with element 2i in the low nibble (like ModelOpt), so
  ``blocks.reshape(E, 2I, H/2)`` is the packed layout of :class:`~cupymoe.formats.Fp4Experts`.

Gate and up keep their own NVFP4 global scales: they are never merged.
"""

from __future__ import annotations

import enum
import os
import re
from typing import Any

import ml_dtypes
import numpy as np

from .._runtime.backend import to_numpy
from .._runtime.validate import check_bias, parse_enum
from ..formats import Fp4Experts, Fp4Format
from .safetensors import (
    DTYPES,
    FLOATS,
    Checkpoint,
    SafetensorsHeader,
    TensorInfo,
    read_safetensors_header,
    read_tensor,
    write_safetensors,
)

# fmt: off
__all__ = [
    "Checkpoint", "CheckpointNaming", "SafetensorsHeader", "TensorInfo", "load_experts",
    "read_safetensors_header", "read_tensor", "save_experts", "write_safetensors",
]
# fmt: on


# ---- expert namings ----------------------------------------------------------------------------
class CheckpointNaming(enum.Enum):
    """Tensor naming of one layer's experts in a checkpoint (details in the module docstring)."""

    #: NVIDIA ModelOpt NVFP4: per expert ``weight`` / ``weight_scale`` / ``weight_scale_2``.
    MODELOPT = "modelopt"
    #: compressed-tensors NVFP4: per expert ``weight_packed`` / ``weight_scale`` /
    #: ``weight_global_scale``, the last being the RECIPROCAL of the global scale.
    COMPRESSED_TENSORS = "compressed-tensors"
    #: gpt-oss MXFP4: stacked ``gate_up_proj_*`` (gate/up rows interleaved) and ``down_proj_*``.
    GPT_OSS = "gpt-oss"

    @classmethod
    def parse(cls, value: str | CheckpointNaming, name: str = "naming") -> CheckpointNaming:
        """``CheckpointNaming`` from a member or its value; ``ValueError`` listing them."""
        return parse_enum(cls, value, name)


_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: Per-expert NVFP4 suffixes: packed codes, E4M3 block scales, global scale (or its reciprocal).
_FIELDS = {
    CheckpointNaming.MODELOPT: ("weight", "weight_scale", "weight_scale_2"),
    CheckpointNaming.COMPRESSED_TENSORS: ("weight_packed", "weight_scale", "weight_global_scale"),
}


def _prefix(layer: int, prefix: str | None) -> str:
    return (prefix or "model.layers.{layer}.mlp").replace("{layer}", str(layer))


def _find_prefix(checkpoint: Checkpoint, layer: int, prefix: str | None) -> str:
    """The given prefix, else the default if it has experts, else the one ``layers.N`` stem."""
    default = _prefix(layer, prefix)
    if prefix is not None or any(n.startswith(default + ".experts.") for n in checkpoint):
        return default
    stems = {name.split(".experts.")[0] + "." for name in checkpoint if ".experts." in name}
    found = sorted(s[:-1] for s in stems if re.search(rf"(?:^|\.)layers\.{layer}\.", s))
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(
            f"{checkpoint.path}: layer {layer} has experts under {found}; pass prefix="
        )
    layers = sorted({int(m[1]) for s in stems if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", s))})
    raise ValueError(
        f"{checkpoint.path}: no expert tensors of layer {layer}: looked for '{default}.experts.*' "
        f"and any '*layers.{layer}.*.experts.*' name; layers with experts: {layers or 'none'}"
    )


def _detect_naming(checkpoint: Checkpoint, prefix: str, naming: Any) -> CheckpointNaming:
    if naming != "auto":
        return CheckpointNaming.parse(naming)
    probes = {
        CheckpointNaming.GPT_OSS: f"{prefix}.experts.gate_up_proj_blocks",
        CheckpointNaming.MODELOPT: f"{prefix}.experts.0.gate_proj.weight_scale_2",
        CheckpointNaming.COMPRESSED_TENSORS: f"{prefix}.experts.0.gate_proj.weight_packed",
    }
    hits = [kind for kind, name in probes.items() if name in checkpoint]
    if len(hits) == 1:
        return hits[0]
    looked = "; ".join(f"{kind.value}: {name!r}" for kind, name in probes.items())
    problem = "matches several namings" if hits else "matches no naming"
    raise ValueError(f"{checkpoint.path}: {prefix}.experts {problem} (looked for {looked})")


def _read(
    checkpoint: Checkpoint, name: str, dtypes: tuple[str, ...], shapes: list[tuple] | None
) -> np.ndarray:
    """A read-only view of ``name`` once its presence, dtype and shape (None: any) are checked."""
    if name not in checkpoint:
        raise ValueError(f"{checkpoint.path}: missing tensor {name!r}")
    info = checkpoint.info(name)
    if info.dtype not in dtypes or (shapes is not None and info.shape not in shapes):
        raise ValueError(
            f"{checkpoint.path}: tensor {name!r}: expected dtype {' or '.join(dtypes)} and shape "
            f"{' or '.join(map(str, shapes)) if shapes else 'any'}, got {info.dtype} {info.shape}"
        )
    return checkpoint.read(name, copy=False)


def _expert_count(checkpoint: Checkpoint, prefix: str, kind: CheckpointNaming) -> int:
    pattern = re.compile(rf"{re.escape(prefix)}\.experts\.(\d+)\.")
    ids = {int(m[1]) for name in checkpoint if (m := pattern.match(name))}
    expected = f"'{prefix}.experts.<e>.gate_proj.{_FIELDS[kind][0]}' for e = 0..E-1"
    if not ids:
        under = sorted(n for n in checkpoint if n.startswith(f"{prefix}.experts."))
        found = ", ".join(repr(n) for n in under[:3]) + (", ..." if len(under) > 3 else "")
        raise ValueError(
            f"{checkpoint.path}: naming {kind.value!r} expects per-expert tensors such as "
            f"{expected}; found no numbered experts under '{prefix}.experts.' (found "
            f"{found or 'nothing'}); naming='auto' detects the naming"
        )
    missing = sorted(set(range(max(ids) + 1)) - ids)
    if missing:
        raise ValueError(
            f"{checkpoint.path}: naming {kind.value!r} expects expert ids 0..E-1 in "
            f"'{prefix}.experts.<e>.*'; found {len(ids)} ids from {min(ids)} to {max(ids)}, "
            f"so ids {missing[:8]}{' ...' if len(missing) > 8 else ''} are missing"
        )
    return len(ids)


def _stack_nvfp4(
    checkpoint: Checkpoint, prefix: str, proj: str, n_experts: int, kind: CheckpointNaming
) -> Fp4Experts:
    weight, scale, global_scale = _FIELDS[kind]
    shape = _read(checkpoint, f"{prefix}.experts.0.{proj}.{weight}", ("U8",), None).shape
    if len(shape) != 2 or shape[1] % 8:
        raise ValueError(
            f"{checkpoint.path}: '{prefix}.experts.0.{proj}.{weight}': expected [N, K/2] with K a "
            f"multiple of 16, got shape {shape}"
        )
    n, half_k = shape
    packed = np.empty((n_experts, n, half_k), np.uint8)
    scales = np.empty((n_experts, n, half_k // 8), np.uint8)
    global_scales = np.empty(n_experts, np.float32)
    for e in range(n_experts):
        stem = f"{prefix}.experts.{e}.{proj}."
        packed[e] = _read(checkpoint, stem + weight, ("U8",), [(n, half_k)])
        block_scales = _read(checkpoint, stem + scale, ("F8_E4M3", "U8"), [scales.shape[1:]])
        scales[e] = block_scales.view(np.uint8)
        g = _read(checkpoint, stem + global_scale, FLOATS, [(), (1,)]).astype(np.float32).flat[0]
        if not (np.isfinite(g) and g > 0):
            raise ValueError(
                f"{checkpoint.path}: tensor {stem + global_scale!r}: expected a finite value > 0, "
                f"got {g}"
            )
        # compressed-tensors stores 1 / global_scale: one correctly rounded fp32 division.
        global_scales[e] = np.float32(1) / g if kind is CheckpointNaming.COMPRESSED_TENSORS else g
    try:
        return Fp4Experts(Fp4Format.NVFP4, packed, scales, global_scales)
    except ValueError as exc:
        raise ValueError(f"{checkpoint.path}: '{prefix}.experts.*.{proj}': {exc}") from None


def _load_nvfp4(checkpoint: Checkpoint, prefix: str, kind: CheckpointNaming) -> dict[str, Any]:
    n_experts = _expert_count(checkpoint, prefix, kind)
    weights = [_stack_nvfp4(checkpoint, prefix, p, n_experts, kind) for p in _PROJECTIONS]
    gate, up, down = weights
    if gate.packed.shape != up.packed.shape or (down.n, down.k) != (gate.k, gate.n):
        raise ValueError(
            f"{checkpoint.path}: '{prefix}.experts': expected gate and up [I, H] and down [H, I], "
            f"got gate [{gate.n}, {gate.k}], up [{up.n}, {up.k}], down [{down.n}, {down.k}]"
        )
    biases: list[np.ndarray | None] = []  # optional per-expert `.bias` [N]: all experts or none
    for proj, w in zip(_PROJECTIONS, weights, strict=True):
        names = [f"{prefix}.experts.{e}.{proj}.bias" for e in range(n_experts)]
        if not any(map(checkpoint.__contains__, names)):
            biases.append(None)
            continue
        b = np.stack([_read(checkpoint, n, FLOATS, [(w.n,)]) for n in names])
        biases.append(b.astype(np.float32))
    gate_b, up_b, down_b = biases
    if (gate_b is None) != (up_b is None):
        raise ValueError(f"{checkpoint.path}: '{prefix}.experts': gate and up need both or no bias")
    fc1_bias = None if gate_b is None or up_b is None else np.concatenate([gate_b, up_b], axis=1)
    return {"fc1": (gate, up), "fc1_layout": None, "fc2": down, "fc1_bias": fc1_bias,
            "fc2_bias": down_b}  # fmt: skip


def _load_mxfp4(checkpoint: Checkpoint, stem: str, shape: tuple[int, int, int]) -> Fp4Experts:
    blocks = _read(checkpoint, stem + "_blocks", ("U8",), [(*shape, 16)])
    scales = _read(checkpoint, stem + "_scales", ("U8", "F8_E8M0"), [shape]).view(np.uint8)
    try:  # a block's 16 bytes hold its 32 codes, element 2i in the low nibble: [E, N, K/2] bytes
        packed = np.array(blocks.reshape(*shape[:2], 16 * shape[2]))
        return Fp4Experts(Fp4Format.MXFP4, packed, np.array(scales), np.ones(shape[0], np.float32))
    except ValueError as exc:
        raise ValueError(f"{checkpoint.path}: '{stem}_*': {exc}") from None


def _load_gpt_oss(checkpoint: Checkpoint, prefix: str) -> dict[str, Any]:
    stem = f"{prefix}.experts."
    shape = _read(checkpoint, stem + "gate_up_proj_blocks", ("U8",), None).shape
    if len(shape) != 4 or shape[1] % 64:
        raise ValueError(
            f"{checkpoint.path}: '{stem}gate_up_proj_blocks': expected [E, 2I, H/32, 16] with I "
            f"a multiple of 32, got shape {shape}"
        )
    n_experts, two_i, h_blocks = shape[:3]
    hidden = 32 * h_blocks

    def bias(name: str, shape: tuple[int, int]) -> np.ndarray | None:
        if stem + name not in checkpoint:
            return None
        return _read(checkpoint, stem + name, FLOATS, [shape]).astype(np.float32)

    return {
        "fc1": _load_mxfp4(checkpoint, stem + "gate_up_proj", (n_experts, two_i, h_blocks)),
        "fc1_layout": "interleaved",
        "fc2": _load_mxfp4(checkpoint, stem + "down_proj", (n_experts, hidden, two_i // 64)),
        "fc1_bias": bias("gate_up_proj_bias", (n_experts, two_i)),
        "fc2_bias": bias("down_proj_bias", (n_experts, hidden)),
    }


def load_experts(
    path: str | os.PathLike[str] | Checkpoint,
    *,
    layer: int,
    naming: str | CheckpointNaming = "auto",
    prefix: str | None = None,
) -> dict[str, Any]:
    """Read one layer's experts from a checkpoint: the weight arguments of ``MoELayer``.

    Parameters
    ----------
    path : str, os.PathLike or Checkpoint
        A ``.safetensors`` file, an index file, a directory of shards, or an open
        :class:`Checkpoint` (to load several layers reading each header once).
    layer : int
    naming : {"auto", "modelopt", "compressed-tensors", "gpt-oss"} or CheckpointNaming
        ``"auto"`` detects it from the layer's tensor names.
    prefix : str, optional
        Name stem before ``.experts``, ``"{layer}"`` replaced by ``layer``. Default:
        ``model.layers.{layer}.mlp`` if present, else the one stem with ``layers.{layer}.``.

    Returns
    -------
    dict
        ``fc1``: a ``(gate, up)`` pair of NVFP4 ``[E, I, H]`` (each with its own global scales)
        or one gpt-oss MXFP4 ``[E, 2I, H]``; ``fc1_layout``: ``None`` or ``"interleaved"``;
        ``fc2`` ``[E, H, I]``; ``fc1_bias`` float32 ``[E, 2I]`` in fc1's row order and
        ``fc2_bias`` float32 ``[E, H]``, or ``None``. Use as ``MoELayer(**d, top_k=...)``.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    ValueError
        Naming the file and the tensor: no experts for the layer (saying what was looked for),
        expert ids not ``0..E-1``, a missing tensor, a wrong dtype or shape, a global scale
        that is not finite and > 0, a NaN scale byte, or a malformed file.

    Notes
    -----
    Packed and scale bytes are copied unchanged; biases (bf16 / fp16 / fp32) widen to float32
    exactly. A compressed-tensors ``weight_global_scale`` ``g`` gives the global scale
    ``float32(1) / g``, one correctly rounded fp32 division.
    """
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or layer < 0:
        raise ValueError(f"layer: expected an int >= 0, got {layer!r}")
    own = not isinstance(path, Checkpoint)
    checkpoint = path if isinstance(path, Checkpoint) else Checkpoint(path)
    try:
        stem = _find_prefix(checkpoint, int(layer), prefix)
        kind = _detect_naming(checkpoint, stem, naming)
        if kind is CheckpointNaming.GPT_OSS:
            return _load_gpt_oss(checkpoint, stem)
        return _load_nvfp4(checkpoint, stem, kind)
    finally:
        if own:
            checkpoint.close()


# ---- writing ------------------------------------------------------------------------------------
def _check(w: Any, name: str, fmt: Fp4Format) -> Fp4Experts:
    if not isinstance(w, Fp4Experts):
        raise TypeError(f"{name}: expected Fp4Experts, got {type(w).__name__}")
    if w.format is not fmt:
        raise ValueError(
            f"{name}: expected {fmt.value} weights for this naming, got {w.format.value}"
        )
    if fmt is Fp4Format.MXFP4 and not np.all(w.global_scale == 1):
        raise ValueError(f"{name}: gpt-oss MXFP4 has no global scale; expected all 1.0")
    return w


def _check_bias(value: Any, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """A bias to write: checked, and of a dtype safetensors files store exactly (:data:`FLOATS`)."""
    b = check_bias(None if value is None else to_numpy(value), name, shape, finite=False)
    if b is not None and b.dtype not in [DTYPES[d] for d in FLOATS]:
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {b.dtype}")
    return b


def _nvfp4_tensors(
    stem: str, kind: CheckpointNaming, fc1: Any, fc2: Any, fc1_bias: Any, fc2_bias: Any
) -> dict[str, np.ndarray]:
    if not isinstance(fc1, tuple | list) or len(fc1) != 2:
        raise TypeError(f"fc1: expected a (gate, up) pair of Fp4Experts, got {type(fc1).__name__}")
    names = ("fc1[0] (gate)", "fc1[1] (up)", "fc2")
    gate, up, down = (
        _check(w, n, Fp4Format.NVFP4) for w, n in zip((*fc1, fc2), names, strict=True)
    )
    n_experts, inter, hidden = gate.n_experts, gate.n, gate.k
    if up.packed.shape != gate.packed.shape or down.packed.shape != (n_experts, hidden, inter // 2):
        raise ValueError(
            f"fc1, fc2: expected gate and up [E, I, H] and fc2 [E, H, I], got {gate!r}, {up!r}, "
            f"{down!r}"
        )
    b1 = _check_bias(fc1_bias, "fc1_bias", (n_experts, 2 * inter))
    b2 = _check_bias(fc2_bias, "fc2_bias", (n_experts, hidden))
    biases = (None, None, b2) if b1 is None else (b1[:, :inter], b1[:, inter:], b2)
    weight, scale, global_scale = _FIELDS[kind]
    tensors: dict[str, np.ndarray] = {}
    for proj, w, bias in zip(_PROJECTIONS, (gate, up, down), biases, strict=True):
        g = w.global_scale
        g = np.float32(1) / g if kind is CheckpointNaming.COMPRESSED_TENSORS else g
        for e in range(n_experts):
            name = f"{stem}.experts.{e}.{proj}."
            tensors[name + weight] = w.packed[e]
            tensors[name + scale] = w.scales[e].view(ml_dtypes.float8_e4m3fn)
            tensors[name + global_scale] = g[e].reshape(())  # a 0-d float32 tensor
            if bias is not None:
                tensors[name + "bias"] = bias[e]
    return tensors


def _gpt_oss_tensors(stem: str, fc1: Any, fc2: Any, fc1_bias: Any, fc2_bias: Any) -> dict:
    gate_up, down = _check(fc1, "fc1", Fp4Format.MXFP4), _check(fc2, "fc2", Fp4Format.MXFP4)
    n_experts, two_i, hidden = gate_up.n_experts, gate_up.n, gate_up.k
    if two_i % 64 or down.packed.shape != (n_experts, hidden, two_i // 4):
        raise ValueError(
            f"fc1, fc2: expected fc1 [E, 2I, H] with I a multiple of 32 and fc2 [E, H, I], got "
            f"{gate_up!r}, {down!r}"
        )
    base = f"{stem}.experts."
    tensors = {
        base + "gate_up_proj_blocks": gate_up.packed.reshape(n_experts, two_i, hidden // 32, 16),
        base + "gate_up_proj_scales": gate_up.scales,
        base + "down_proj_blocks": down.packed.reshape(n_experts, hidden, two_i // 64, 16),
        base + "down_proj_scales": down.scales,
        base + "gate_up_proj_bias": _check_bias(fc1_bias, "fc1_bias", (n_experts, two_i)),
        base + "down_proj_bias": _check_bias(fc2_bias, "fc2_bias", (n_experts, hidden)),
    }
    return {name: t for name, t in tensors.items() if t is not None}


def save_experts(
    path: str | os.PathLike[str],
    *,
    layer: int,
    naming: str | CheckpointNaming,
    fc1: Any,
    fc2: Fp4Experts,
    fc1_bias: Any = None,
    fc2_bias: Any = None,
    prefix: str | None = None,
) -> None:
    """Write one layer's experts to a ``.safetensors`` file: the inverse of :func:`load_experts`
    (bit for bit, except some compressed-tensors global scales: see Notes).

    Parameters
    ----------
    path : str or os.PathLike
    layer : int
    naming : {"modelopt", "compressed-tensors", "gpt-oss"} or CheckpointNaming
    fc1 : (Fp4Experts, Fp4Experts) or Fp4Experts
        NVFP4 namings: a ``(gate, up)`` pair ``[E, I, H]``. gpt-oss: one MXFP4 ``[E, 2I, H]``
        with gate and up rows interleaved (global scales all 1).
    fc2 : Fp4Experts
        ``[E, H, I]``, same format.
    fc1_bias, fc2_bias : array, optional
        ``[E, 2I]`` in fc1's row order (for a pair: gate columns, then up) and ``[E, H]``;
        float32, float16 or bfloat16, written in that dtype (gpt-oss checkpoints use bfloat16).
    prefix : str, optional
        Default ``model.layers.{layer}.mlp``; ``"{layer}"`` in it is replaced by ``layer``.

    Raises
    ------
    FileNotFoundError
        The directory of ``path`` does not exist (the message names ``path``).

    Notes
    -----
    Scales are written as ``F8_E4M3`` (NVFP4) or ``U8`` (gpt-oss E8M0), global scales as 0-d
    float32 tensors, and the metadata as ``{"format": "pt"}``.

    compressed-tensors stores the reciprocal ``float32(1) / g`` of each global scale ``g``, and
    the loader takes ``float32(1) / stored``. That gives ``g`` back for about 83 % of values and
    differs by 1 ulp for the rest, and no other float32 could do better: when the significand of
    ``g`` exceeds sqrt(2), the float32 grid of the reciprocal is coarser than that of ``g``, so
    about half of those values are the reciprocal of no float32 at all. Powers of two round-trip
    exactly. ModelOpt and gpt-oss round-trip bit for bit.
    """
    kind = CheckpointNaming.parse(naming)
    stem = _prefix(layer, prefix)
    if kind is CheckpointNaming.GPT_OSS:
        tensors = _gpt_oss_tensors(stem, fc1, fc2, fc1_bias, fc2_bias)
    else:
        tensors = _nvfp4_tensors(stem, kind, fc1, fc2, fc1_bias, fc2_bias)
    write_safetensors(path, tensors, metadata={"format": "pt"})
