# SPDX-License-Identifier: Apache-2.0
"""The whole MoE layer: routing -> FC1 GEMV with its activation -> FC2 GEMV -> finalize.

``MoELayer`` holds validated weights and options; :func:`moe_reference` composes the float64
``*_ref`` stages and is the oracle of every test. The GPU path runs the CUDA stages on CuPy
arrays; on a machine without a GPU the layer runs the reference and says so once.
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

import ml_dtypes
import numpy as np

from .._runtime.backend import gpu_available, is_cupy_array, require_cupy, to_numpy
from .._runtime.validate import ACTIVATION_DTYPES, check_bias, check_int
from ..experts.activation import Activation, ActivationSpec
from ..experts.layouts import DEFAULT_LAYOUT, WeightLayout
from ..experts.reference import fc1_ref, fc2_ref
from ..formats import Fp4Experts
from ..routing import Router, RoutingMethod, check_router_weights, route_ref
from .device import DeviceLayer
from .eager import EagerGraphs
from .expand import expand_ref
from .finalize import finalize_ref
from .graph import LayerGraph, record_graph, time_stages

__all__ = ["Fc1Layout", "MoELayer", "moe_reference"]

_LOGIT_DTYPES = (*ACTIVATION_DTYPES, np.dtype(np.float32), np.dtype(np.float64))


class Fc1Layout(enum.Enum):
    """How gate and up rows are stored when FC1 is given as one ``[E, 2I, H]`` tensor."""

    #: rows ``0..I-1`` are gate, rows ``I..2I-1`` are up (ModelOpt / ONNX Runtime order)
    CONCATENATED = "concatenated"
    #: gate and up alternate: gate0, up0, gate1, up1, ... (gpt-oss checkpoints)
    INTERLEAVED = "interleaved"


def _split_fc1(
    fc1: Any, layout: str | Fc1Layout | None
) -> tuple[Fp4Experts, Fp4Experts, np.ndarray, np.ndarray]:
    """Return (gate, up, gate_rows, up_rows): the row indices of gate and up in fc1's order."""
    if isinstance(fc1, tuple | list):
        if len(fc1) != 2 or not all(isinstance(w, Fp4Experts) for w in fc1):
            raise TypeError("fc1: expected an Fp4Experts or a (gate, up) pair of Fp4Experts")
        if layout is not None:
            raise ValueError(
                "fc1_layout: only for a single [E, 2I, H] tensor, not a (gate, up) pair"
            )
        gate, up = fc1
        if gate.packed.shape != up.packed.shape or gate.format != up.format:
            raise ValueError(
                f"fc1: gate and up must have the same shape and format, got "
                f"{gate.format.value}{gate.packed.shape} and {up.format.value}{up.packed.shape}"
            )
        i = gate.n
        return gate, up, np.arange(i), np.arange(i, 2 * i)
    if not isinstance(fc1, Fp4Experts):
        raise TypeError(f"fc1: expected Fp4Experts or a (gate, up) pair, got {type(fc1).__name__}")
    if layout is None:
        raise ValueError(
            "fc1_layout: a single fc1 tensor [E, 2I, H] needs fc1_layout='concatenated' or "
            "'interleaved'"
        )
    try:
        layout = Fc1Layout(layout)
    except ValueError:
        raise ValueError(
            f"fc1_layout: expected one of {[m.value for m in Fc1Layout]}, got {layout!r}"
        ) from None
    if fc1.n % 2:
        raise ValueError(f"fc1: expected an even number of rows (2 * intermediate), got {fc1.n}")
    i = fc1.n // 2
    if layout is Fc1Layout.CONCATENATED:
        gate_rows, up_rows = np.arange(i), np.arange(i, 2 * i)
    else:
        gate_rows, up_rows = np.arange(0, 2 * i, 2), np.arange(1, 2 * i, 2)
    return fc1.select_rows(gate_rows), fc1.select_rows(up_rows), gate_rows, up_rows


def _single_fc1(fc1: Any, layout: str | Fc1Layout | None, act: Activation) -> Fp4Experts:
    """FC1 of a non-gated activation: one ``[E, I, H]`` tensor, no gate/up layout."""
    if isinstance(fc1, tuple | list):
        raise ValueError(
            f"fc1: the non-gated activation {act.value!r} takes one Fp4Experts [E, I, H], "
            "not a (gate, up) pair"
        )
    if not isinstance(fc1, Fp4Experts):
        raise TypeError(
            f"fc1: the non-gated activation {act.value!r} takes one Fp4Experts [E, I, H], "
            f"got {type(fc1).__name__}"
        )
    if layout is not None:
        raise ValueError(
            f"fc1_layout: the non-gated activation {act.value!r} has no gate and up rows, "
            f"got {layout!r}"
        )
    return fc1


def _bias(value: Any, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """A host float32 copy of a checked bias (read-only), or ``None``."""
    b = check_bias(None if value is None else to_numpy(value), name, shape)
    if b is None:
        return None
    b = b.astype(np.float32)
    b.setflags(write=False)
    return b


class MoELayer:
    """One quantized MoE layer: ``out[t] = sum_j w[t, j] * FFN_{e[t, j]}(x[t])``.

    ``FFN_e(x) = W2_e · act(W1gate_e · x + b_gate, W1up_e · x + b_up) + b2_e`` (gated
    activations) or ``W2_e · act(W1_e · x + b1) + b2_e`` (relu, gelu, silu, identity), with
    block-scaled E2M1 weights (:class:`~cupymoe.formats.Fp4Experts`).

    Parameters
    ----------
    fc1 : (Fp4Experts, Fp4Experts) or Fp4Experts
        Gated activations: ``(gate, up)``, each ``[E, I, H]`` with its own global scale, or one
        ``[E, 2I, H]`` tensor with ``fc1_layout``. Non-gated activations: one ``[E, I, H]``
        tensor (no ``fc1_layout``).
    fc2 : Fp4Experts
        Down projection ``[E, H, I]``.
    top_k : int
        Experts per token, ``1 <= top_k <= E``.
    routing : {"softmax_topk", "topk_softmax", "sigmoid_grouped", "sparse_mixer"}
        Router kind (see ``FORMATS.md``); ``sigmoid_grouped`` takes ``n_group``,
        ``topk_group``, ``correction_bias`` and ``routed_scaling_factor``; ``sparse_mixer``
        (ONNX Runtime's, Phi-3.5-MoE) needs ``top_k = 2`` and 8 or 16 experts (``ValueError``
        otherwise). Separate mixing weights (ONNX Runtime's ``router_weights``) are a call
        argument.
    renormalize : bool
        ``softmax_topk`` only: divide the ``top_k`` weights by their sum.
    activation : {"swiglu", "geglu", "swiglu_oai", "relu", "gelu", "silu", "identity"}
        FC1's activation, the first three gated; ``swiglu_oai`` (the general SwiGLU,
        ``g * sigmoid(alpha g) * (u + beta)`` with clamp ``limit``) takes ``activation_alpha``,
        ``activation_beta`` and ``activation_limit``.
    fc1_bias : array [E, 2I] or [E, I], optional
        In fc1's row order (for a ``(gate, up)`` pair: gate rows, then up rows); ``[E, I]`` for a
        non-gated activation.
    fc2_bias : array [E, H], optional
    max_tokens : int
        Largest ``n_tokens`` per call; GPU workspaces are sized for it.
    weight_layout : WeightLayout or {"split", "pair", "plain"}
        The weight layout the GEMV reads (:class:`~cupymoe.WeightLayout`): ``"split"`` (the
        default; fastest, a second copy of the weights on the GPU), or the uploaded bytes
        themselves in the pair-interleaved (``"pair"``) or plain (``"plain"``) nibble order.
        Results are identical.

    Notes
    -----
    NumPy in -> NumPy out (copied to and from the GPU); CuPy in -> CuPy out (no copy). With no
    GPU the layer computes :func:`moe_reference` and rounds to the activation dtype.
    """

    def __init__(
        self,
        fc1: Any,
        fc2: Fp4Experts,
        *,
        top_k: int,
        routing: str | RoutingMethod = "softmax_topk",
        renormalize: bool = True,
        n_group: int | None = None,
        topk_group: int | None = None,
        correction_bias: Any = None,
        routed_scaling_factor: float = 1.0,
        activation: str | Activation = "swiglu",
        activation_alpha: float = 1.702,
        activation_limit: float = 7.0,
        activation_beta: float = 1.0,
        fc1_layout: str | Fc1Layout | None = None,
        fc1_bias: Any = None,
        fc2_bias: Any = None,
        max_tokens: int = 64,
        weight_layout: WeightLayout | str = DEFAULT_LAYOUT,
    ) -> None:
        if not isinstance(activation, Activation):
            activation = Activation.parse(activation)
        up: Fp4Experts | None
        if activation.gated:
            gate, up, gate_rows, up_rows = _split_fc1(fc1, fc1_layout)
        else:
            gate, up = _single_fc1(fc1, fc1_layout, activation), None
        if not isinstance(fc2, Fp4Experts):
            raise TypeError(f"fc2: expected Fp4Experts, got {type(fc2).__name__}")
        n_experts, intermediate, hidden = gate.n_experts, gate.n, gate.k
        if fc2.packed.shape[0] != n_experts or (fc2.n, fc2.k) != (hidden, intermediate):
            raise ValueError(
                f"fc2: expected experts x rows x cols = ({n_experts}, {hidden}, {intermediate}) "
                f"to match fc1, got ({fc2.n_experts}, {fc2.n}, {fc2.k})"
            )
        if hidden < 1 or intermediate < 1:
            raise ValueError(
                f"fc1: expected hidden and intermediate sizes >= 1, got hidden {hidden}, "
                f"intermediate {intermediate}"
            )
        check_int("max_tokens", max_tokens)
        if max_tokens < 1:
            raise ValueError(f"max_tokens: expected >= 1, got {max_tokens}")
        self.router = Router(
            n_experts=n_experts,
            top_k=top_k,
            method=RoutingMethod.parse(routing) if isinstance(routing, str) else routing,
            renormalize=renormalize,
            n_group=n_group,
            topk_group=topk_group,
            correction_bias=correction_bias,
            routed_scaling_factor=routed_scaling_factor,
        )
        self.activation = ActivationSpec(
            activation, alpha=activation_alpha, limit=activation_limit, beta=activation_beta
        )
        #: FC1: ``gate`` and ``up`` (gated activations), or ``gate`` = the one matrix and
        #: ``up = None`` (non-gated); likewise their biases.
        self.gate, self.up, self.down = gate, up, fc2
        if up is None:
            self.gate_bias = _bias(fc1_bias, "fc1_bias", (n_experts, intermediate))
            self.up_bias = None
        else:
            b1 = _bias(fc1_bias, "fc1_bias", (n_experts, 2 * intermediate))
            self.gate_bias = None if b1 is None else np.ascontiguousarray(b1[:, gate_rows])
            self.up_bias = None if b1 is None else np.ascontiguousarray(b1[:, up_rows])
        self.fc2_bias = _bias(fc2_bias, "fc2_bias", (n_experts, hidden))
        self.max_tokens = int(max_tokens)
        self.weight_layout = WeightLayout.parse(weight_layout, "weight_layout")  # before any upload
        self._gpu: DeviceLayer | None = None  # built on first GPU use (device_layer)
        self._graphs: EagerGraphs | None = None  # eager calls' CUDA graphs, built on first call
        self._in_place_graphs = True
        self._warned_reference = False

    # ---- shapes ------------------------------------------------------------------------------
    @property
    def n_experts(self) -> int:
        return self.gate.n_experts

    @property
    def hidden(self) -> int:
        return self.gate.k

    @property
    def intermediate(self) -> int:
        return self.gate.n

    @property
    def top_k(self) -> int:
        return self.router.top_k

    @property
    def weight_nbytes(self) -> int:
        """Bytes of all experts' packed weights, block scales and global scales."""
        up = 0 if self.up is None else self.up.nbytes
        return self.gate.nbytes + up + self.down.nbytes

    def __repr__(self) -> str:
        return (
            f"MoELayer(experts={self.n_experts}, hidden={self.hidden}, "
            f"intermediate={self.intermediate}, top_k={self.top_k}, "
            f"format={self.gate.format.value}/{self.down.format.value}, "
            f"routing={self.router.method.value}, activation={self.activation.kind.value})"
        )

    # ---- validation --------------------------------------------------------------------------
    def check_inputs(self, x: Any, router_logits: Any) -> int:
        """Validate ``x [M, H]`` and ``router_logits [M, E]``; return ``M``.

        Attribute comparisons only (a few µs): every eager call runs it before anything else."""
        on_device = is_cupy_array(x)
        for name, a in (("x", x), ("router_logits", router_logits)):
            if not (isinstance(a, np.ndarray) or is_cupy_array(a)):
                raise TypeError(
                    f"{name}: expected a numpy.ndarray or cupy.ndarray, got {type(a).__name__}"
                )
        if on_device != is_cupy_array(router_logits):
            raise TypeError("x and router_logits: expected both NumPy or both CuPy arrays")
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x: expected shape (n_tokens, {self.hidden}), got {tuple(x.shape)}")
        if x.dtype not in ACTIVATION_DTYPES:  # a NumPy dtype for NumPy and CuPy arrays alike
            raise TypeError(f"x: expected dtype bfloat16 or float16, got {x.dtype}")
        m = x.shape[0]
        if router_logits.ndim != 2 or tuple(router_logits.shape) != (m, self.n_experts):
            raise ValueError(
                f"router_logits: expected shape ({m}, {self.n_experts}), "
                f"got {tuple(router_logits.shape)}"
            )
        if router_logits.dtype not in _LOGIT_DTYPES:
            raise TypeError(
                f"router_logits: expected dtype bfloat16, float16, float32 or float64, "
                f"got {router_logits.dtype}"
            )
        if on_device and self._gpu is not None:  # the weights live on one GPU
            for name, a in (("x", x), ("router_logits", router_logits)):
                if a.data.device_id != self._gpu.device_id:
                    raise ValueError(
                        f"{name}: on GPU {a.data.device_id}, the layer's weights are on GPU "
                        f"{self._gpu.device_id}"
                    )
        if on_device and m > 0:  # the kernels read rows in place: check before any launch
            if not x.flags.c_contiguous:
                raise ValueError(
                    "x: expected a C-contiguous cupy.ndarray (use cupy.ascontiguousarray)"
                )
            item = router_logits.itemsize
            if router_logits.strides[1] != item or router_logits.strides[0] < self.n_experts * item:
                raise ValueError(
                    "router_logits: expected contiguous rows with a positive row stride, got "
                    f"strides {router_logits.strides}"
                )
        if m > self.max_tokens:
            raise ValueError(
                f"x: n_tokens {m} exceeds max_tokens={self.max_tokens}; build the layer with a "
                "larger max_tokens"
            )
        return m

    # ---- running -----------------------------------------------------------------------------
    def check_router_weights(self, router_weights: Any, router_logits: Any) -> Any:
        """Validate the mixing weights of a call (``None`` or ``[M, E]`` like the logits, float32;
        a CuPy array C-contiguous) and return them."""
        if router_weights is None:
            return None
        check_router_weights(router_weights, router_logits, self.router)
        if is_cupy_array(router_weights) and not router_weights.flags.c_contiguous:
            raise ValueError("router_weights: expected a C-contiguous array")
        return router_weights

    def __call__(
        self,
        x: Any,
        router_logits: Any,
        *,
        router_weights: Any = None,
        out: Any = None,
        replay: bool = True,
    ) -> Any:
        """Run the layer: ``x [M, H]`` (bf16/fp16), ``router_logits [M, E]`` -> ``[M, H]``.

        ``x`` and ``router_logits`` are NumPy arrays (result: NumPy), CuPy arrays (result: CuPy,
        no copies) or GPU tensors of another framework that speaks DLPack, such as torch or JAX
        (zero-copy in and out; the result is a tensor of that framework). ``router_weights``
        (float32 ``[M, E]``, the same kind of array; softmax_topk / topk_softmax): ONNX
        Runtime's separate mixing tensor, the top-k is taken on ``router_logits`` and the weights
        gathered from it. ``out``: the result's array (NumPy or CuPy like ``x``); with CuPy
        arrays a loop of calls with ``out`` allocates no device memory.

        On the GPU a call replays a CUDA graph of the layer recorded on the first call with this
        token count, dtypes and current stream (:mod:`cupymoe.layer.eager`; at most
        :data:`~cupymoe.layer.eager.MAX_GRAPHS` are kept): the inputs are copied into the
        graph's buffers, the graph runs on the current stream, the output is copied into ``out``
        or a new array; after a few calls with the same ``x``, ``router_logits`` and ``out``
        buffers, a graph recorded on those buffers runs instead, without copies (the same bits).
        ``replay=False`` launches the stages one by one instead (the path a graph
        records; bitwise the same result). Calls with ``router_weights``, calls on a stream that
        is being captured, and MXFP4 layers whose fp16 calls need the batched fallback always
        launch the stages.
        """
        graphs = self._graphs
        if replay and router_weights is None and graphs is not None:
            # CuPy arrays like those of this stream's last replay: matched by identity and
            # integer comparisons, anything else falls through to the checks below
            result = graphs.hit(x, router_logits, out)
            if result is not None:
                return result
        framework = _dlpack_framework(x)
        if framework is not None:
            cupy = require_cupy()
            result = self(
                cupy.from_dlpack(x),
                cupy.from_dlpack(router_logits),
                router_weights=None if router_weights is None else cupy.from_dlpack(router_weights),
                out=None if out is None else cupy.from_dlpack(out),
                replay=replay,
            )
            return out if out is not None else framework.from_dlpack(result)
        m = self.check_inputs(x, router_logits)
        router_weights = self.check_router_weights(router_weights, router_logits)
        on_device = is_cupy_array(x)
        if not on_device and not gpu_available():
            if not self._warned_reference:
                warnings.warn(
                    "cupymoe: no CUDA GPU available; MoELayer runs the NumPy reference",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._warned_reference = True
            result = moe_reference(x, router_logits, self, router_weights=router_weights).astype(
                x.dtype
            )
            if out is not None:
                _check_out(out, (m, self.hidden), x.dtype, device=False)
                out[...] = result
                return out
            return result
        if out is not None:  # before anything runs
            _check_out(out, (m, self.hidden), x.dtype, device=on_device)
        ld = router_logits
        if ld.dtype == np.float64:  # the routing kernels read fp32 at most (the reference too)
            ld = ld.astype(np.float32)
        if replay and m > 0 and router_weights is None:
            if graphs is None:
                graphs = self._graphs = EagerGraphs(self, in_place=self._in_place_graphs)
            result = graphs.call_device(x, ld, out) if on_device else graphs.call_host(x, ld, out)
            if result is not None:
                return result
        cupy = require_cupy()
        # NumPy inputs of any layout are uploaded C-contiguous (CuPy would keep F order);
        # CuPy inputs are used in place (check_inputs has checked their layout).
        xd = x if on_device else cupy.asarray(np.ascontiguousarray(x))
        ld = ld if on_device else cupy.asarray(np.ascontiguousarray(ld))
        rw = router_weights
        if rw is not None and not on_device:
            rw = cupy.asarray(np.ascontiguousarray(rw))
        result = self.device_layer().run(xd, ld, out=out if on_device else None, router_weights=rw)
        if on_device:
            return result
        host = result.get()
        if out is not None:
            out[...] = host
            return out
        return host

    @property
    def in_place_graphs(self) -> bool:
        """Whether eager calls that pass the same ``x``, ``router_logits`` and ``out`` buffers
        again and again get a graph recorded on those buffers (no copies; default ``True``,
        :mod:`cupymoe.layer.eager`). Set ``False`` where no CUDA graph capture may start in the
        middle of a decode loop, e.g. a server whose other threads synchronise the device at any
        time (an in-place capture fails then, and the call goes on with the copies): the calls
        keep replaying the layer's graph with copies, and graphs already recorded on buffers keep
        serving them. The first call of each token count, dtypes and stream still records the
        layer's own graph: make those calls before other threads run, or pass ``replay=False``."""
        return self._in_place_graphs

    @in_place_graphs.setter
    def in_place_graphs(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"in_place_graphs: expected a bool, got {type(value).__name__}")
        self._in_place_graphs = value
        if self._graphs is not None:
            self._graphs.in_place = value

    def clear_cache(self) -> None:
        """Forget the CUDA graphs recorded for eager calls; the next call of each token count
        records again, with the tilings the tuning cache and ``CUPYMOE_GEMV_CONFIG`` give then.
        A recorded graph keeps what it read (:data:`~cupymoe.layer.eager.RECORDED_ONCE`): after
        changing ``CUPYMOE_GEMV_CONFIG``, ``CUPYMOE_PDL``, ``CUPYMOE_CLUSTERS`` or
        ``CUPYMOE_WGMMA``, or the tuning cache in this process, call this."""
        if self._graphs is not None:
            self._graphs.clear()

    def graph(self, n_tokens: int, *, dtype: Any = ml_dtypes.bfloat16) -> LayerGraph:
        """Record this layer into a CUDA graph with static buffers for ``n_tokens`` tokens.

        Returns a :class:`~cupymoe.LayerGraph`: copy the inputs into ``g.x`` and
        ``g.logits[0]``, call ``g.replay()``, read ``g.out``. Replays give bitwise the results of
        eager calls. Any ``n_tokens`` up to ``max_tokens``: the GEMV and the grouped GEMM take
        their tile schedule from the routing maps on the device.
        """
        return record_graph([self], n_tokens, dtype)

    @property
    def resident_bytes(self) -> int:
        """GPU bytes of the expert weights (codes, block scales, global scales; biases and
        workspaces excluded). The layer holds them once, in the layout every kernel reads: for N
        a multiple of 16 and K of 32 exactly the format's bytes. Uploads the layer on first use."""
        return self.device_layer().resident_bytes

    def stage_times(self, x: Any, router_logits: Any, *, repeats: int = 50) -> dict[str, float]:
        """Median GPU microseconds of each stage (route, fc1, fc2, finalize) for these inputs.

        Each stage is recorded into its own CUDA graph and replayed ``repeats`` times between
        CUDA events, so host launch cost is excluded. Weights stay in L2 between replays: use
        ``cupymoe bench`` for HBM-bound figures.
        """
        self.check_inputs(x, router_logits)
        return time_stages(self.device_layer(), x, router_logits, repeats=repeats)

    def device_layer(self) -> DeviceLayer:
        """The prepared GPU state of this layer on the current device (weights uploaded and laid
        out once, workspaces for ``max_tokens``), built on first use."""
        if self._gpu is None:
            self._gpu = DeviceLayer(self)
        return self._gpu


def _dlpack_framework(a: Any) -> Any:
    """The module whose ``from_dlpack`` turns a CuPy result back into ``a``'s kind, or ``None``
    for NumPy / CuPy arrays."""
    if isinstance(a, np.ndarray) or is_cupy_array(a) or not hasattr(a, "__dlpack__"):
        return None
    root = type(a).__module__.split(".")[0]
    if root == "torch":
        import torch

        return torch
    if root in ("jax", "jaxlib"):
        import jax.numpy

        return jax.numpy
    raise TypeError(f"x: expected a NumPy, CuPy, torch or JAX array, got {type(a).__name__}")


def _check_out(out: Any, shape: tuple[int, ...], dtype: Any, *, device: bool) -> None:
    if device != is_cupy_array(out) or not (device or isinstance(out, np.ndarray)):
        kind = "cupy.ndarray" if device else "numpy.ndarray"
        raise TypeError(f"out: expected a {kind} like x, got {type(out).__name__}")
    if tuple(out.shape) != shape or np.dtype(out.dtype) != np.dtype(dtype):
        raise ValueError(f"out: expected {shape} {np.dtype(dtype)}, got {out.shape} {out.dtype}")
    if device and not out.flags.c_contiguous:  # checked before any stage launches
        raise ValueError("out: expected a C-contiguous array")


def moe_reference(
    x: Any, router_logits: Any, layer: MoELayer, *, router_weights: Any = None
) -> np.ndarray:
    """Float64 NumPy oracle of ``layer(x, router_logits)``: the ``*_ref`` stages composed.

    Parameters
    ----------
    x : array [M, H]
        bf16 / fp16 activations (NumPy or CuPy; copied to the host).
    router_logits : array [M, E]
    layer : MoELayer
    router_weights : array [M, E], optional
        float32 mixing weights (see :meth:`MoELayer.__call__`).

    Returns
    -------
    numpy.ndarray float64 [M, H]

    Examples
    --------
    >>> import numpy as np, ml_dtypes, cupymoe as cm
    >>> rng = np.random.default_rng(0)
    >>> gate, up = (cm.Fp4Experts.quantize(rng.standard_normal((4, 32, 64))) for _ in range(2))
    >>> down = cm.Fp4Experts.quantize(rng.standard_normal((4, 64, 32)))
    >>> layer = cm.MoELayer((gate, up), down, top_k=2)
    >>> x = rng.standard_normal((3, 64)).astype(ml_dtypes.bfloat16)
    >>> cm.moe_reference(x, rng.standard_normal((3, 4)).astype(np.float32), layer).shape
    (3, 64)
    """
    if not isinstance(layer, MoELayer):
        raise TypeError(f"layer: expected a MoELayer, got {type(layer).__name__}")
    x = to_numpy(x)
    logits = to_numpy(router_logits)
    layer.check_inputs(x, logits)
    mix = None if router_weights is None else to_numpy(router_weights)
    layer.check_router_weights(mix, logits)
    routing = route_ref(logits, layer.router, router_weights=mix)
    x_sorted = expand_ref(x, routing).astype(np.float64)
    h = fc1_ref(
        x_sorted,
        layer.gate,
        layer.up,
        routing.expert_offsets,
        act=layer.activation,
        gate_bias=layer.gate_bias,
        up_bias=layer.up_bias,
    )
    y = fc2_ref(h, layer.down, routing.expert_offsets, bias=layer.fc2_bias)
    return finalize_ref(y, routing)
