# SPDX-License-Identifier: Apache-2.0
"""CPU tests of checkpoint I/O: the NumPy safetensors reader / writer (checked against an
independent byte-level writer and parser), and the ModelOpt, compressed-tensors and gpt-oss
namings of one layer's experts, loaded back exactly."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import cupymoe as cm
from cupymoe.formats import E2M1_VALUES, Fp4Experts
from cupymoe.io.checkpoint import (
    Checkpoint,
    load_experts,
    read_safetensors_header,
    read_tensor,
    save_experts,
    write_safetensors,
)
from cupymoe.presets import random_fp4_experts

# Smallest shapes valid in both formats: MXFP4 needs H and I multiples of 32; E = 4 with top_k 2.
E, H, I = 4, 64, 32
NAMINGS = ["modelopt", "compressed-tensors", "gpt-oss"]
# Every dtype the format names and NumPy / ml_dtypes can hold (spelled independently of the module).
# fmt: off
DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16,
    "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64, "C64": np.complex64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}
# fmt: on


# ---- helpers -----------------------------------------------------------------------------------
def raw_safetensors(path: Path, entries: list[tuple[str, str, list[int], bytes]]) -> None:
    """Independent writer: tensors packed in the order given, no alignment, no padding."""
    header: dict[str, Any] = {}
    buffer = b""
    for name, dtype, shape, data in entries:
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(buffer), len(buffer) + len(data)],
        }
        buffer += data
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + buffer)


def all_tensors(path: Path) -> dict[str, np.ndarray]:
    with Checkpoint(path) as checkpoint:
        return {name: checkpoint.read(name) for name in checkpoint}


def assert_same(ref: Fp4Experts, out: Fp4Experts) -> None:
    assert out.format is ref.format
    for field in ("packed", "scales", "global_scale"):
        a, b = getattr(ref, field), getattr(out, field)
        assert b.dtype == a.dtype and np.array_equal(a, b), field


def nvfp4_layer(rng: np.random.Generator) -> dict[str, Any]:
    gate, up = (random_fp4_experts(rng, E, I, H, "nvfp4") for _ in range(2))
    assert not np.array_equal(gate.global_scale, up.global_scale)  # else "kept separate" is moot
    return {"fc1": (gate, up), "fc2": random_fp4_experts(rng, E, H, I, "nvfp4")}


def gpt_oss_layer(rng: np.random.Generator) -> dict[str, Any]:
    return {
        "fc1": random_fp4_experts(rng, E, 2 * I, H, "mxfp4"),
        "fc2": random_fp4_experts(rng, E, H, I, "mxfp4"),
        "fc1_bias": rng.standard_normal((E, 2 * I)).astype(ml_dtypes.bfloat16),
        "fc2_bias": rng.standard_normal((E, H)).astype(ml_dtypes.bfloat16),
    }


def modelopt_file(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, dict[str, Any]]:
    layer = nvfp4_layer(rng)
    path = tmp_path / "modelopt.safetensors"
    save_experts(path, layer=0, naming="modelopt", **layer)
    return path, layer


# ---- safetensors: reader and writer -------------------------------------------------------------
@pytest.mark.parametrize("shape", [(), (0,), (3, 5), (2, 0, 3)])  # scalar, empty, plain, empty 3-D
def test_write_read_every_dtype(tmp_path: Path, rng: np.random.Generator, shape: tuple) -> None:
    tensors = {}
    for name, dtype in DTYPES.items():
        size = np.dtype(dtype).itemsize * int(np.prod(shape))
        raw = rng.integers(0, 2 if dtype is np.bool_ else 256, size=size, dtype=np.uint8)
        tensors[name] = raw.view(dtype).reshape(shape)  # every bit pattern, NaNs included
    path = tmp_path / "all.safetensors"
    write_safetensors(path, tensors, metadata={"note": "x"})
    header = read_safetensors_header(path)
    assert header.metadata == {"note": "x"}
    for name, ref in tensors.items():
        assert header.tensors[name].dtype == name and header.tensors[name].shape == shape
        out = read_tensor(path, name)
        assert out.dtype == ref.dtype and out.shape == shape
        assert out.tobytes() == ref.tobytes()


def test_writer_byte_layout(tmp_path: Path) -> None:
    """Parse the writer's bytes by hand: header size, JSON, aligned contiguous data."""
    tensors = {
        "b": np.arange(3, dtype=np.uint8),
        "a": np.array([1.5, -2.0], dtype=np.float32),
        "c": np.array(7.25, dtype=np.float64),
        "d": np.array([1, 2], dtype=">i4"),  # big-endian input is written little-endian
    }
    path = tmp_path / "layout.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt"})
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0  # data buffer starts 8-aligned
    header = json.loads(data[8 : 8 + n])
    assert header.pop("__metadata__") == {"format": "pt"}
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(data) - 8 - n  # the buffer is covered ...
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # ... without holes
    expected = {"a": ("F32", "<f4"), "b": ("U8", "u1"), "c": ("F64", "<f8"), "d": ("I32", "<i4")}
    for name, (dtype, numpy_dtype) in expected.items():
        entry = header[name]
        begin, end = entry["data_offsets"]
        assert entry["dtype"] == dtype and entry["shape"] == list(tensors[name].shape)
        assert begin % np.dtype(numpy_dtype).itemsize == 0
        stored = np.frombuffer(data[8 + n + begin : 8 + n + end], dtype=numpy_dtype)
        assert np.array_equal(stored, tensors[name].reshape(-1))


def test_reader_on_independent_unaligned_file(tmp_path: Path) -> None:
    path = tmp_path / "raw.safetensors"
    f32 = np.array([[1.0, -0.5], [3.0, 2.0**-20]], dtype="<f4")
    bf16 = np.array([1.0, -3.5], dtype=ml_dtypes.bfloat16)
    raw_safetensors(
        path,
        [
            ("z.odd", "U8", [3], b"\x01\x02\x03"),  # pushes the next tensors off alignment
            ("y.f32", "F32", [2, 2], f32.tobytes()),
            ("x.bf16", "BF16", [2], bf16.tobytes()),
            ("w.scalar", "F32", [], np.float32(0.125).tobytes()),
        ],
    )
    header = read_safetensors_header(path)
    assert list(header.tensors) == ["z.odd", "y.f32", "x.bf16", "w.scalar"]
    assert header.tensors["y.f32"].begin == 3 and header.tensors["y.f32"].nbytes == 16
    assert read_tensor(path, "z.odd").tolist() == [1, 2, 3]
    assert np.array_equal(read_tensor(path, "y.f32"), f32)
    assert read_tensor(path, "x.bf16").dtype == ml_dtypes.bfloat16
    assert read_tensor(path, "x.bf16").astype(np.float32).tolist() == [1.0, -3.5]
    assert read_tensor(path, "w.scalar").shape == () and read_tensor(path, "w.scalar") == 0.125
    with pytest.raises(KeyError, match="nope"):
        read_tensor(path, "nope")


def test_read_views_and_copies(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"w": np.arange(8, dtype=np.int16)})
    with Checkpoint(path) as checkpoint:
        view = checkpoint.read("w", copy=False)
        assert not view.flags.writeable  # a view of the read-only memory map
        copy = checkpoint.read("w")
        copy[0] = 99  # an independent in-memory array
        assert checkpoint.read("w")[0] == 0 and view[0] == 0


def _file_cases() -> list[tuple[str, bytes, str]]:
    """(id, file bytes, expected message) for malformed files; tensor "t" where one is named."""

    def file(header: Any, data: bytes = b"", size: int | None = None) -> bytes:
        text = header if isinstance(header, bytes) else json.dumps(header).encode()
        return struct.pack("<Q", len(text) if size is None else size) + text + data

    good = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    return [
        ("no-size", b"\x10\x00", "truncated"),
        ("header-cut", file(good, bytes(8))[:20], "truncated"),
        ("huge-size", file(good, bytes(8), size=2**40), "exceeds"),
        ("bad-json", file(b"{not json", bytes(8)), "not UTF-8 JSON"),
        ("not-utf8", file(b'{"\xff": 1}'), "not UTF-8 JSON"),
        ("json-list", file([1, 2]), "expected a JSON object"),
        ("duplicate", file(b'{"t": {}, "t": {}}'), "duplicate key 't'"),
        ("data-cut", file(good, bytes(5)), "'t'.*out of range.*holds 5 bytes"),
        (
            "offsets-out",
            file({"t": {**good["t"], "data_offsets": [8, 16]}}, bytes(8)),
            "'t'.*out of range",
        ),
        (
            "offsets-reversed",
            file({"t": {**good["t"], "data_offsets": [8, 0]}}, bytes(8)),
            "'t'.*out of range",
        ),
        (
            "size-mismatch",
            file({"t": {**good["t"], "shape": [3]}}, bytes(8)),
            "'t'.*span 8 bytes.*needs 12",
        ),
        (
            "unknown-dtype",
            file({"t": {**good["t"], "dtype": "F7"}}, bytes(8)),
            "'t'.*unknown dtype 'F7'",
        ),
        ("bad-shape", file({"t": {**good["t"], "shape": [-2]}}, bytes(8)), "'t'.*shape"),
        (
            "no-offsets",
            file({"t": {"dtype": "F32", "shape": [2]}}, bytes(8)),
            "'t'.*data_offsets",
        ),
        ("bad-metadata", file({"__metadata__": {"a": 1}, **good}, bytes(8)), "__metadata__"),
    ]


FILE_CASES = _file_cases()


@pytest.mark.parametrize(
    ("data", "message"), [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES]
)
def test_malformed_files_raise_with_path(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message) as info:
        read_tensor(path, "t")
    assert str(path) in str(info.value)


def test_packed_subbyte_dtype_is_listed_but_not_read(tmp_path: Path) -> None:
    path = tmp_path / "f4.safetensors"
    raw_safetensors(path, [("q", "F4", [2, 4], bytes(4)), ("u", "U8", [1], b"\x07")])
    assert read_safetensors_header(path).tensors["q"].nbytes == 4  # 8 codes, 4 bits each
    assert read_tensor(path, "u").tolist() == [7]
    with pytest.raises(ValueError, match="'q'.*F4"):
        read_tensor(path, "q")


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    with pytest.raises(TypeError, match=r"tensors\['s'\].*no safetensors equivalent"):
        write_safetensors(path, {"s": np.array(["text"])})
    with pytest.raises(ValueError, match="__metadata__"):
        write_safetensors(path, {"__metadata__": np.zeros(1)})
    with pytest.raises(TypeError, match="metadata"):
        write_safetensors(path, {"a": np.zeros(1)}, metadata={"a": 1})  # type: ignore[dict-item]
    assert not list(tmp_path.iterdir())  # nothing half-written is left behind


# ---- namings: save -> load ---------------------------------------------------------------------
@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("naming", NAMINGS)
def test_save_load_exact(
    tmp_path: Path, rng: np.random.Generator, naming: str, biases: bool
) -> None:
    layer = gpt_oss_layer(rng) if naming == "gpt-oss" else nvfp4_layer(rng)
    if naming != "gpt-oss" and biases:  # per-expert `.bias`, float32 this time
        layer["fc1_bias"] = rng.standard_normal((E, 2 * I)).astype(np.float32)
        layer["fc2_bias"] = rng.standard_normal((E, H)).astype(np.float32)
    if not biases:
        layer = {k: v for k, v in layer.items() if not k.endswith("_bias")}
    path = tmp_path / f"{naming}.safetensors"
    save_experts(path, layer=7, naming=naming, **layer)
    out = load_experts(path, layer=7)  # naming detected from the names
    assert out.keys() == {"fc1", "fc1_layout", "fc2", "fc1_bias", "fc2_bias"}
    assert_same(out["fc2"], load_experts(path, layer=7, naming=naming)["fc2"])  # explicit naming
    if naming == "gpt-oss":
        assert out["fc1_layout"] == "interleaved"
        pairs = [(layer["fc1"], out["fc1"]), (layer["fc2"], out["fc2"])]
    else:
        assert out["fc1_layout"] is None
        pairs = list(zip((*layer["fc1"], layer["fc2"]), (*out["fc1"], out["fc2"]), strict=True))
    for ref, got in pairs:
        if naming == "compressed-tensors":  # stored as 1 / g, loaded as 1 / (1 / g)
            one = np.float32(1)
            ref = Fp4Experts(ref.format, ref.packed, ref.scales, one / (one / ref.global_scale))
        assert_same(ref, got)
    for key in ("fc1_bias", "fc2_bias"):
        if biases:
            assert out[key].dtype == np.float32
            assert np.array_equal(out[key], layer[key].astype(np.float32))
        else:
            assert out[key] is None


# ---- namings: independent hand-written checkpoints ----------------------------------------------
def test_modelopt_handwritten(tmp_path: Path, rng: np.random.Generator) -> None:
    """Raw ModelOpt names and bytes: scalar scales as [] and [1], input_scale and unrelated
    tensors (attention, shared experts, another layer) present and ignored."""
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}  # [N, K]
    packed = {
        p: rng.integers(0, 256, (E, n, k // 2), dtype=np.uint8) for p, (n, k) in shapes.items()
    }
    # E4M3 bytes 0x08..0x77: finite, positive, no NaN
    scales = {
        p: rng.integers(0x08, 0x78, (E, n, k // 16), dtype=np.uint8) for p, (n, k) in shapes.items()
    }
    globals_ = {p: rng.uniform(1e-4, 1e-2, E).astype(np.float32) for p in packed}
    entries = [
        ("model.layers.1.self_attn.q_proj.weight", "BF16", [2, 2], bytes(8)),
        (
            "model.layers.1.mlp.shared_experts.gate_proj.weight",
            "U8",
            [I, H // 2],
            bytes(I * H // 2),
        ),
        ("model.layers.2.mlp.experts.0.gate_proj.weight", "U8", [1], b"\x00"),
    ]
    for e in reversed(range(E)):  # file order must not matter
        for p in packed:
            stem = f"model.layers.1.mlp.experts.{e}.{p}."
            entries += [
                (stem + "weight", "U8", list(packed[p][e].shape), packed[p][e].tobytes()),
                (
                    stem + "weight_scale",
                    "F8_E4M3",
                    list(scales[p][e].shape),
                    scales[p][e].tobytes(),
                ),
                (stem + "weight_scale_2", "F32", [] if e % 2 else [1], globals_[p][e].tobytes()),
                (stem + "input_scale", "F32", [], np.float32(3.0).tobytes()),
            ]
    path = tmp_path / "handwritten.safetensors"
    raw_safetensors(path, entries)
    out = load_experts(path, layer=1)
    gate, up = out["fc1"]
    for p, got in (("gate_proj", gate), ("up_proj", up), ("down_proj", out["fc2"])):
        assert_same(Fp4Experts("nvfp4", packed[p], scales[p], globals_[p]), got)
    assert out["fc1_bias"] is None and out["fc2_bias"] is None


def test_compressed_tensors_global_scale_is_the_reciprocal(tmp_path: Path) -> None:
    stored = np.array([0.25, 3.0, 2688.0 / 0.7, 1e-3], dtype=np.float32)  # weight_global_scale
    entries = []
    for e in range(E):
        for p, n, k in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)):
            stem = f"model.layers.0.mlp.experts.{e}.{p}."
            entries += [
                (stem + "weight_packed", "U8", [n, k // 2], bytes(n * k // 2)),
                (stem + "weight_scale", "F8_E4M3", [n, k // 16], b"\x38" * (n * k // 16)),
                (stem + "weight_global_scale", "F32", [1], stored[e].tobytes()),
            ]
    path = tmp_path / "ct.safetensors"
    raw_safetensors(path, entries)
    out = load_experts(path, layer=0)
    for w in (*out["fc1"], out["fc2"]):
        assert np.array_equal(w.global_scale, np.float32(1) / stored)
        assert w.global_scale[0] == 4.0  # a power of two is exact both ways


def test_compressed_tensors_round_trip_of_global_scales(tmp_path: Path) -> None:
    """``save_experts`` stores ``1 / g`` in float32 and ``load_experts`` takes ``1 / stored``:
    exact for most ``g`` (and every power of two), 1 ulp off for the rest, and for those no
    float32 reciprocal at all maps back to ``g`` (so no choice of stored value could do better)."""
    one = np.float32(1)
    rng = np.random.default_rng(0)
    n_experts = 512
    g = (rng.uniform(1, 2, n_experts) * 2.0 ** rng.integers(-12, 0, n_experts)).astype(np.float32)
    g[:4] = [2.0**-8, 0.5, 1.0, 2.0**-20]
    w = Fp4Experts(
        "nvfp4",
        np.zeros((n_experts, 16, 8), np.uint8),
        np.full((n_experts, 16, 1), 0x38, np.uint8),
        g,
    )
    path = tmp_path / "ct.safetensors"
    save_experts(path, layer=0, naming="compressed-tensors", fc1=(w, w), fc2=w)
    back = load_experts(path, layer=0)["fc2"].global_scale
    exact = back == g
    assert exact[:4].all() and 0.75 < exact.mean() < 0.9  # about 83 % of random values
    ulps = np.abs(back.view(np.int32).astype(np.int64) - g.view(np.int32))
    assert ulps.max() == 1
    for value in g[~exact]:  # no float32 near 1 / g has g as its reciprocal
        near = (one / value).view(np.int32) + np.arange(-4, 5, dtype=np.int32)
        assert not np.any(one / near.view(np.float32) == value)


def test_gpt_oss_handwritten_nibble_order(tmp_path: Path, rng: np.random.Generator) -> None:
    """Dequantize raw gpt-oss blocks the way the model's reference code does (low nibble ->
    even element, high nibble -> odd, times 2**(scale - 127)) and compare to the loaded layer."""
    blocks = {
        "gate_up_proj": rng.integers(0, 256, (E, 2 * I, H // 32, 16), dtype=np.uint8),
        "down_proj": rng.integers(0, 256, (E, H, I // 32, 16), dtype=np.uint8),
    }
    scales = {k: rng.integers(120, 134, v.shape[:3], dtype=np.uint8) for k, v in blocks.items()}
    bias = rng.standard_normal((E, 2 * I)).astype(ml_dtypes.bfloat16)
    stem = "model.layers.0.mlp.experts."
    entries = [(stem + "gate_up_proj_bias", "BF16", [E, 2 * I], bias.tobytes())]
    for k, scale_dtype in (("gate_up_proj", "U8"), ("down_proj", "F8_E8M0")):  # both occur
        entries += [
            (f"{stem}{k}_blocks", "U8", list(blocks[k].shape), blocks[k].tobytes()),
            (f"{stem}{k}_scales", scale_dtype, list(scales[k].shape), scales[k].tobytes()),
        ]
    path = tmp_path / "gpt-oss.safetensors"
    raw_safetensors(path, entries)
    out = load_experts(path, layer=0)
    for key, got in (("gate_up_proj", out["fc1"]), ("down_proj", out["fc2"])):
        b = blocks[key]
        values = np.empty((*b.shape[:3], 32))
        values[..., 0::2] = E2M1_VALUES[b & 0x0F]
        values[..., 1::2] = E2M1_VALUES[b >> 4]
        ref = np.ldexp(values, scales[key].astype(np.int64)[..., None] - 127)
        assert np.array_equal(got.dequantize(np.float64), ref.reshape(*b.shape[:2], -1))
    assert np.array_equal(out["fc1_bias"], bias.astype(np.float32))
    assert out["fc2_bias"] is None


# ---- shards, prefixes, several layers ------------------------------------------------------------
def test_sharded_index_and_directory(tmp_path: Path, rng: np.random.Generator) -> None:
    single, _ = modelopt_file(tmp_path, rng)
    tensors = all_tensors(single)
    shard_dir = tmp_path / "model"
    shard_dir.mkdir()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):  # every expert spans both shards
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        write_safetensors(shard_dir / shard, {n: tensors[n] for n in part})
        weight_map.update(dict.fromkeys(part, shard))
    index = shard_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    ref = load_experts(single, layer=0)
    for source in (index, shard_dir):
        out = load_experts(source, layer=0)
        for a, b in zip((*ref["fc1"], ref["fc2"]), (*out["fc1"], out["fc2"]), strict=True):
            assert_same(a, b)
    index.rename(tmp_path / "index.json")  # a directory without an index: shards are scanned
    assert_same(ref["fc2"], load_experts(shard_dir, layer=0)["fc2"])
    # An index naming a missing shard, or a shard that lacks the tensor.
    bad = dict(weight_map)
    bad[names[0]] = "missing.safetensors"
    index.write_text(json.dumps({"weight_map": bad}))
    with pytest.raises(ValueError, match="missing.safetensors does not exist"):
        load_experts(index, layer=0)
    bad[names[0]] = weight_map[names[1]]
    index.write_text(json.dumps({"weight_map": bad}))
    with pytest.raises(ValueError, match=f"{names[0]}.*lacks it"):
        load_experts(index, layer=0)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="weight_map"):
        load_experts(index, layer=0)


PREFIX = "language_model.model.layers.{layer}.feed_forward"  # not the default stem


def test_prefix_detection_and_several_layers(tmp_path: Path, rng: np.random.Generator) -> None:
    layers = {n: nvfp4_layer(rng) for n in (3, 5)}
    tensors = {}
    for n, layer in layers.items():
        save_experts(tmp_path / "l.safetensors", layer=n, naming="modelopt", prefix=PREFIX, **layer)
        tensors.update(all_tensors(tmp_path / "l.safetensors"))
    path = tmp_path / "two-layers.safetensors"
    write_safetensors(path, tensors)
    with Checkpoint(path) as checkpoint:  # one header read for both layers
        for n, layer in layers.items():
            out = load_experts(checkpoint, layer=n)
            assert_same(layer["fc2"], out["fc2"])
            explicit = load_experts(checkpoint, layer=n, prefix=PREFIX.format(layer=n))
            assert_same(layer["fc2"], explicit["fc2"])
        message = r"no expert tensors of layer 4.*layers with experts: \[3, 5\]"
        with pytest.raises(ValueError, match=message):
            load_experts(checkpoint, layer=4)
    tensors["other.layers.3.moe.experts.0.gate_proj.weight"] = np.zeros(1, np.uint8)
    write_safetensors(path, tensors)
    with pytest.raises(ValueError, match=r"layer 3 has experts under \[.*feed_forward.*moe'\]"):
        load_experts(path, layer=3)


# ---- loader errors -------------------------------------------------------------------------------
def expert(e: int, rest: str) -> str:
    return f"model.layers.0.mlp.experts.{e}.{rest}"


def drop_scale(t: dict) -> None:
    del t[expert(2, "up_proj.weight_scale")]


def bad_shape(t: dict) -> None:
    t[expert(1, "gate_proj.weight_scale")] = np.zeros((I, H // 32), np.uint8)


def bad_dtype(t: dict) -> None:
    t[expert(0, "down_proj.weight")] = t[expert(0, "down_proj.weight")].view(np.int8)


def drop_expert_2(t: dict) -> None:
    for name in [n for n in t if n.startswith(expert(2, ""))]:
        del t[name]


def zero_global(t: dict) -> None:
    t[expert(3, "up_proj.weight_scale_2")] = np.zeros((), np.float32)


def nan_scale(t: dict) -> None:
    t[expert(1, "down_proj.weight_scale")].view(np.uint8)[0, 0] = 0x7F  # E4M3 NaN


def partial_bias(t: dict) -> None:  # expert 1 has a bias, expert 0 does not
    t[expert(1, "gate_proj.bias")] = np.zeros(I, np.float32)


def drop_global(t: dict) -> None:
    for name in [n for n in t if n.endswith("weight_scale_2")]:
        del t[name]


def unchanged(t: dict) -> None:
    pass


# id: (mutation of a valid ModelOpt checkpoint, naming passed, expected message)
LOADER_ERRORS = {
    "missing": (drop_scale, "auto", r"missing tensor '.*experts\.2\.up_proj\.weight_scale'"),
    "shape": (
        bad_shape,
        "auto",
        r"experts\.1\.gate_proj\.weight_scale'.*expected dtype F8_E4M3 or U8 and shape "
        r"\(32, 4\), got U8 \(32, 2\)",
    ),
    "dtype": (bad_dtype, "auto", r"experts\.0\.down_proj\.weight'.*got I8"),
    "ids": (
        drop_expert_2,
        "auto",
        r"naming 'modelopt' expects expert ids 0\.\.E-1 in '.*experts\.<e>\.\*'; found 3 ids "
        r"from 0 to 3, so ids \[2\] are missing",
    ),
    "zero-global": (zero_global, "auto", r"experts\.3\.up_proj\.weight_scale_2'.*finite value > 0"),
    "nan-scale": (nan_scale, "auto", r"experts\.\*\.down_proj'.*NaN"),
    "partial-bias": (partial_bias, "auto", r"missing tensor '.*experts\.0\.gate_proj\.bias'"),
    "wrong-naming": (unchanged, "gpt-oss", r"missing tensor '.*gate_up_proj_blocks'"),
    "wrong-naming-ct": (unchanged, "compressed-tensors", r"missing tensor '.*weight_packed'"),
    "undetectable": (
        drop_global,
        "auto",
        r"matches no naming \(looked for gpt-oss: .*gate_up_proj_blocks.*"
        r"modelopt: .*weight_scale_2",
    ),
}


@pytest.mark.parametrize("case", LOADER_ERRORS)
def test_loader_errors(tmp_path: Path, rng: np.random.Generator, case: str) -> None:
    mutate, naming, message = LOADER_ERRORS[case]
    path, _ = modelopt_file(tmp_path, rng)
    tensors = all_tensors(path)
    mutate(tensors)
    write_safetensors(path, tensors)
    with pytest.raises(ValueError, match=message) as info:
        load_experts(path, layer=0, naming=naming)
    assert str(path) in str(info.value)  # every checkpoint error names the file


def test_loader_argument_errors(tmp_path: Path, rng: np.random.Generator) -> None:
    path, _ = modelopt_file(tmp_path, rng)
    with pytest.raises(ValueError, match="naming: expected one of 'modelopt'"):
        load_experts(path, layer=0, naming="nvfp4")
    with pytest.raises(ValueError, match="layer: expected an int >= 0"):
        load_experts(path, layer=-1)
    with pytest.raises(FileNotFoundError):
        load_experts(tmp_path / "nope.safetensors", layer=0)
    assert "FileNotFoundError" in (load_experts.__doc__ or "")  # documented as raised


def test_save_to_a_missing_directory_names_the_users_path(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    target = tmp_path / "no" / "such" / "x.safetensors"
    with pytest.raises(FileNotFoundError) as info:
        save_experts(target, layer=0, naming="modelopt", **nvfp4_layer(rng))
    assert f"cannot write {target}:" in str(info.value) and ".tmp" not in str(info.value)
    assert info.value.filename == str(target)
    assert not (tmp_path / "no").exists()


def test_wrong_naming_says_what_it_expected_and_what_was_found(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """A gpt-oss file read as ModelOpt: the naming's expectation and the names found."""
    path = tmp_path / "gpt-oss.safetensors"
    save_experts(path, layer=2, naming="gpt-oss", **gpt_oss_layer(rng))
    with pytest.raises(ValueError) as info:
        load_experts(path, layer=2, naming="modelopt")
    message = str(info.value)
    assert "naming 'modelopt' expects per-expert tensors such as " in message
    assert "'model.layers.2.mlp.experts.<e>.gate_proj.weight' for e = 0..E-1" in message
    assert "found no numbered experts under 'model.layers.2.mlp.experts.'" in message
    assert "'model.layers.2.mlp.experts.down_proj_blocks'" in message
    assert "None" not in message and "[]" not in message


def test_gpt_oss_loader_checks_shapes(tmp_path: Path, rng: np.random.Generator) -> None:
    path = tmp_path / "g.safetensors"
    save_experts(path, layer=0, naming="gpt-oss", **gpt_oss_layer(rng))
    tensors = all_tensors(path)
    tensors["model.layers.0.mlp.experts.down_proj_scales"] = np.zeros((E, H, 2), np.uint8)
    write_safetensors(path, tensors)
    message = r"down_proj_scales'.*shape \(4, 64, 1\), got U8 \(4, 64, 2\)"
    with pytest.raises(ValueError, match=message):
        load_experts(path, layer=0)


def test_save_rejects_mismatched_weights(tmp_path: Path, rng: np.random.Generator) -> None:
    nv, mx = nvfp4_layer(rng), gpt_oss_layer(rng)
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="fc2: expected nvfp4"):
        save_experts(path, layer=0, naming="modelopt", fc1=nv["fc1"], fc2=mx["fc2"])
    with pytest.raises(TypeError, match=r"fc1: expected a \(gate, up\) pair"):
        save_experts(path, layer=0, naming="modelopt", fc1=nv["fc2"], fc2=nv["fc2"])
    with pytest.raises(ValueError, match="fc1_bias: expected shape"):
        bias = np.zeros((E, I), np.float32)
        save_experts(path, layer=0, naming="modelopt", fc1_bias=bias, **nv)
    scaled = Fp4Experts("mxfp4", mx["fc1"].packed, mx["fc1"].scales, np.full(E, 2, np.float32))
    with pytest.raises(ValueError, match="no global scale"):
        save_experts(path, layer=0, naming="gpt-oss", fc1=scaled, fc2=mx["fc2"])
    assert not path.exists()


# ---- the loaded layer runs ---------------------------------------------------------------------
@pytest.mark.parametrize("naming", NAMINGS)
def test_loaded_layer_builds_and_matches_the_original(
    tmp_path: Path, rng: np.random.Generator, naming: str
) -> None:
    layer = gpt_oss_layer(rng) if naming == "gpt-oss" else nvfp4_layer(rng)
    options: dict[str, Any] = {"top_k": 2}
    if naming == "gpt-oss":
        options.update(routing="topk_softmax", activation="swiglu_oai")
    path = tmp_path / "layer.safetensors"
    save_experts(path, layer=0, naming=naming, **layer)
    loaded = cm.MoELayer(**load_experts(path, layer=0), **options)
    assert (loaded.n_experts, loaded.hidden, loaded.intermediate) == (E, H, I)
    x = rng.standard_normal((3, H)).astype(ml_dtypes.bfloat16)
    logits = rng.standard_normal((3, E)).astype(np.float32)
    out = cm.moe_reference(x, logits, loaded)
    assert out.shape == (3, H) and np.all(np.isfinite(out))
    if naming != "compressed-tensors":  # the same weights give bitwise the same reference
        original = {**layer, "fc1_layout": "interleaved" if naming == "gpt-oss" else None}
        for key in ("fc1_bias", "fc2_bias"):  # MoELayer takes float biases
            if key in original:
                original[key] = original[key].astype(np.float32)
        assert np.array_equal(out, cm.moe_reference(x, logits, cm.MoELayer(**original, **options)))


def test_safetensors_package_reads_our_files_but_not_f8_e4m3(tmp_path: Path) -> None:
    """Why ``cupymoe.io.safetensors`` keeps its own reader: the ``safetensors`` package reads the
    U8 / BF16 / F32 tensors of our files exactly, and fails on F8_E4M3 (NVFP4 block scales),
    which ours reads bit for bit."""
    st = pytest.importorskip("safetensors")
    from cupymoe.io.safetensors import read_tensor, write_safetensors

    codes = np.arange(12, dtype=np.uint8).reshape(3, 4)
    act = np.linspace(-2, 2, 6).astype(ml_dtypes.bfloat16)
    gscale = np.array([0.5, 0.25], np.float32)
    scales = np.array([0x38, 0x40, 0x7E], np.uint8).view(ml_dtypes.float8_e4m3fn)  # 1, 2, 448
    path = str(tmp_path / "w.safetensors")
    write_safetensors(path, {"codes": codes, "act": act, "gscale": gscale, "scales": scales})
    with st.safe_open(path, framework="np") as f:
        for name, want in (("codes", codes), ("act", act), ("gscale", gscale)):
            got = f.get_tensor(name)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
        with pytest.raises(Exception, match="float8_e4m3fn"):
            f.get_tensor("scales")
    ours = read_tensor(path, "scales")
    assert ours.dtype == ml_dtypes.float8_e4m3fn
    assert ours.view(np.uint8).tolist() == [0x38, 0x40, 0x7E]
    assert ours.astype(np.float32).tolist() == [1.0, 2.0, 448.0]
