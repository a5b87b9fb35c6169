# SPDX-License-Identifier: Apache-2.0
"""Typed kernel launches, optionally as programmatic dependent launches (PDL) and in
thread-block clusters.

CuPy validates nothing about kernel arguments ("No validation is performed ... including types
and number of arguments"): a bare Python ``int`` becomes a 64-bit value and silently shifts every
later argument. :func:`launch` accepts only device arrays, ``None`` (a null pointer), NumPy
scalars of an exact type, so each call site states the C++ type of every scalar, and
:class:`.tensormap.TensorMap` values (128-byte ``__grid_constant__`` parameters).

PDL (sm_90 and newer, CUDA driver 12.3 and newer, which records it in CUDA graphs too): a launch
with the programmatic-stream-serialization attribute may start while the previous kernel on the
stream is still running, once every block of that kernel has executed
``griddepcontrol.launch_dependents``. Its blocks then run their prologue (shared tables, reads of
data that kernel does not write) and block in ``griddepcontrol.wait`` until it has completed and
its writes are visible. The kernels launched this way call ``cm::wait_upstream()`` (common.cuh)
before they read what the previous kernel wrote and before they write anything.

Clusters (sm_90 and newer): ``launch(..., cluster=C)`` groups every C consecutive blocks along x
into a cluster, co-scheduled on one GPC, whose blocks can reach each other's shared memory (the
decode routing, ``routing.topk.fused_cluster_size``). CuPy has no ``cuLaunchKernelEx``; it is
called
through ``ctypes`` on ``libcuda``.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .backend import require_cupy
from .compile import KernelSpec, get_kernel
from .device import current_device
from .tensormap import TensorMap

__all__ = [
    "ENV_CLUSTERS",
    "ENV_PDL",
    "cluster_supported",
    "launch",
    "pdl_enabled",
    "pdl_supported",
]

#: ``CUPYMOE_PDL=0`` turns programmatic dependent launches off (every launch is an ordinary one).
ENV_PDL = "CUPYMOE_PDL"
#: ``CUPYMOE_CLUSTERS=0``: no thread-block clusters (the decode routing runs as one block). For
#: compute-sanitizer: its racecheck did not finish a cluster launch of the routing on the H200.
ENV_CLUSTERS = "CUPYMOE_CLUSTERS"

_SCALAR_TYPES = (np.int32, np.uint32, np.int64, np.uint64, np.float32, np.float64, np.bool_)

# The C type of each accepted scalar (kernelParams points at a value of exactly this size).
_CTYPES: dict[type, Any] = {
    np.int32: ctypes.c_int32,
    np.uint32: ctypes.c_uint32,
    np.int64: ctypes.c_int64,
    np.uint64: ctypes.c_uint64,
    np.float32: ctypes.c_float,
    np.float64: ctypes.c_double,
    np.bool_: ctypes.c_bool,
}

# cuda.h (CUDA 12.0+): CUlaunchAttributeID, CUlaunchAttributeValue (a 64-byte union),
# CUlaunchAttribute {id; pad to 8; value}, CUlaunchConfig.
_ATTR_CLUSTER_DIMENSION = 4
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_PDL_MIN_DRIVER = 12030  # graph capture of programmatic dependencies
_PDL_MIN_CC = 90
_CLUSTER_MIN_CC = 90


class _ClusterDim(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class _LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int), ("cluster", _ClusterDim)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid_x", ctypes.c_uint),
        ("grid_y", ctypes.c_uint),
        ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint),
        ("block_y", ctypes.c_uint),
        ("block_z", ctypes.c_uint),
        ("shared_mem", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


def _check_args(spec: KernelSpec, args: Sequence[Any]) -> None:
    cupy = require_cupy()
    for i, a in enumerate(args):
        if a is None or isinstance(a, (cupy.ndarray, TensorMap, *_SCALAR_TYPES)):
            continue
        raise TypeError(
            f"{spec.name}: argument {i} must be a cupy.ndarray, a TensorMap or an exact NumPy "
            f"scalar (np.int32(...), np.float32(...)), got {type(a).__name__}"
        )


def _dims(v: tuple[int, ...] | int) -> tuple[int, int, int]:
    t = v if isinstance(v, tuple) else (v,)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"launch dimensions: expected 1 to 3 values, got {t}")
    return (*t, 1, 1)[:3]  # type: ignore[return-value]


def kernel_params(args: Sequence[Any]) -> tuple[Any, list[Any]]:
    """``void* kernelParams[]`` for ``args`` (checked by :func:`launch`) and the C values it
    points at (keep them alive until the launch call returns)."""
    values: list[Any] = []
    for a in args:
        if a is None:
            values.append(ctypes.c_void_p(0))
        elif type(a) in _CTYPES:
            values.append(_CTYPES[type(a)](a.item()))
        elif isinstance(a, TensorMap):  # the parameter is the 128 bytes themselves
            values.append(a)
        else:  # cupy.ndarray: its device address
            values.append(ctypes.c_void_p(int(a.data.ptr)))
    # addressof gives the address cast(pointer(v), c_void_p) gives, without two temporary ctypes
    # objects per argument: 11 arguments (a GEMV launch) 33 -> 8 µs of host time
    addressof = ctypes.addressof
    array = (ctypes.c_void_p * max(len(values), 1))(
        *[v.address if isinstance(v, TensorMap) else addressof(v) for v in values]
    )
    return array, values


def launch_config(
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    shared_mem: int,
    stream_ptr: int,
    *,
    pdl: bool = True,
    cluster: int = 1,
) -> tuple[_LaunchConfig, Any]:
    """The ``CUlaunchConfig`` of a launch with the programmatic-stream-serialization attribute
    (``pdl``) and a cluster dimension of ``(cluster, 1, 1)`` blocks (when above 1), and the
    attribute array it points at (keep it alive until the launch call returns)."""
    attrs = (_LaunchAttribute * 2)()
    n = 0
    if pdl:
        attrs[n].id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[n].value.flag = 1
        n += 1
    if cluster > 1:
        attrs[n].id = _ATTR_CLUSTER_DIMENSION
        attrs[n].value.cluster = _ClusterDim(cluster, 1, 1)
        n += 1
    config = _LaunchConfig(*grid, *block, shared_mem, ctypes.c_void_p(stream_ptr), attrs, n)
    return config, attrs


@functools.lru_cache(maxsize=1)
def _libcuda() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [
        ctypes.POINTER(_LaunchConfig),
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib


def pdl_supported(driver_version: int, compute_capability: int, has_launch_ex: bool) -> bool:
    """Whether a driver (``cudaDriverGetVersion``), a device (``major * 10 + minor``) and a
    ``libcuda`` (with or without ``cuLaunchKernelEx``) run programmatic dependent launches, in
    streams and in captured CUDA graphs."""
    return driver_version >= _PDL_MIN_DRIVER and compute_capability >= _PDL_MIN_CC and has_launch_ex


@functools.cache
def _device_facts(device_id: int) -> tuple[int, int, bool] | None:
    """(driver version, compute capability, whether ``libcuda`` has ``cuLaunchKernelEx``); None
    without a driver or ``libcuda.so.1``."""
    cupy = require_cupy()
    try:
        driver = int(cupy.cuda.runtime.driverGetVersion())
        cc = int(cupy.cuda.Device(device_id).compute_capability)
        has_ex = hasattr(_libcuda(), "cuLaunchKernelEx")
    except (OSError, cupy.cuda.runtime.CUDARuntimeError):
        return None
    return driver, cc, has_ex


def _device_supports_pdl(device_id: int) -> bool:
    facts = _device_facts(device_id)
    return facts is not None and pdl_supported(*facts)


def _device_supports_clusters(device_id: int) -> bool:
    facts = _device_facts(device_id)
    return facts is not None and facts[1] >= _CLUSTER_MIN_CC and facts[2]


def _switched_off(env: str) -> bool:
    return os.environ.get(env, "1").strip() == "0"


def cluster_supported() -> bool:
    """Whether launches may use thread-block clusters: the current device runs them (sm_90+,
    through ``cuLaunchKernelEx``) and ``CUPYMOE_CLUSTERS`` is not ``0``."""
    if _switched_off(ENV_CLUSTERS):
        return False
    return _device_supports_clusters(current_device())


def pdl_enabled() -> bool:
    """Whether ``launch(..., pdl=True)`` makes programmatic dependent launches on the current
    device: sm_90+, driver 12.3+, and ``CUPYMOE_PDL`` not ``0``."""
    if _switched_off(ENV_PDL):
        return False
    return _device_supports_pdl(current_device())


def launch(
    spec: KernelSpec,
    grid: tuple[int, ...] | int,
    block: tuple[int, ...] | int,
    args: Sequence[Any],
    *,
    shared_mem: int = 0,
    stream: Any = None,
    pdl: bool = False,
    cluster: int = 1,
) -> None:
    """Launch ``spec`` on ``stream`` (the current stream when ``None``).

    ``args`` follow the ``__global__`` signature in the ``.cu`` file, in order. ``pdl``: a
    programmatic dependent launch when :func:`pdl_enabled` (else an ordinary one); only for
    kernels that call ``cm::wait_upstream()`` before touching the previous kernel's data.
    """
    _check_args(spec, args)
    grid3, block3 = _dims(grid), _dims(block)
    if cluster > 1 and grid3[0] % cluster:
        raise ValueError(
            f"{spec.name}: grid {grid3} is not a whole number of {cluster}-block clusters"
        )
    kernel = get_kernel(spec)
    pdl = pdl and pdl_enabled()
    # CuPy's launch cannot pass a 128-byte tensor map: those go through cuLaunchKernelEx too
    if pdl or cluster > 1 or any(isinstance(a, TensorMap) for a in args):
        cupy = require_cupy()
        s = stream if stream is not None else cupy.cuda.get_current_stream()
        config, attr = launch_config(
            grid3, block3, shared_mem, int(s.ptr), pdl=pdl, cluster=cluster
        )
        params, values = kernel_params(args)
        status = _libcuda().cuLaunchKernelEx(
            ctypes.byref(config), ctypes.c_void_p(int(kernel.kernel.ptr)), params, None
        )
        del attr, values  # alive until here: the driver copied them during the call
        if status != 0:
            raise RuntimeError(f"{spec.expression}: cuLaunchKernelEx failed (CUresult {status})")
        return
    cupy_args = tuple(0 if a is None else a for a in args)  # CuPy passes 0 as a null pointer
    if stream is None:
        kernel(grid3, block3, cupy_args, shared_mem=shared_mem)
    else:
        with stream:
            kernel(grid3, block3, cupy_args, shared_mem=shared_mem)
