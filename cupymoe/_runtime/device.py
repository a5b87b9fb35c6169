# SPDX-License-Identifier: Apache-2.0
"""Facts about the current CUDA device (never device 0 unless it is the current one)."""

from __future__ import annotations

import functools

from .backend import require_cupy

__all__ = [
    "compute_capability",
    "current_device",
    "device_name",
    "max_shared_per_block",
    "sm_count",
]


def current_device() -> int:
    """Id of the current CUDA device."""
    return int(require_cupy().cuda.Device().id)


@functools.lru_cache(maxsize=16)
def _properties(device_id: int) -> dict:
    return dict(require_cupy().cuda.runtime.getDeviceProperties(device_id))


def _name(device_id: int) -> str:
    name = _properties(device_id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def device_name(device_id: int | None = None) -> str:
    """Name of the current CUDA device (or of ``device_id``), as in tune-cache keys
    (``"NVIDIA H200"``); read once per device."""
    return _name(current_device() if device_id is None else device_id)


def sm_count() -> int:
    """Multiprocessors of the current CUDA device."""
    return int(_properties(current_device())["multiProcessorCount"])


def max_shared_per_block() -> int:
    """Opt-in dynamic shared memory per block of the current CUDA device, in bytes."""
    return int(_properties(current_device())["sharedMemPerBlockOptin"])


def compute_capability() -> int:
    """Compute capability of the current CUDA device as ``major * 10 + minor`` (90 on the H200)."""
    props = _properties(current_device())
    return int(props["major"]) * 10 + int(props["minor"])
