# SPDX-License-Identifier: Apache-2.0
"""Checkpoints: expert weights read from and written to safetensors files (:mod:`.checkpoint`),
over the file-format layer :mod:`.safetensors`."""

from .checkpoint import Checkpoint, CheckpointNaming, load_experts, save_experts

__all__ = ["Checkpoint", "CheckpointNaming", "load_experts", "save_experts"]
