# SPDX-License-Identifier: Apache-2.0
"""Expert parallelism: a layer's experts spread over the GPUs of a world, same bits as one GPU.

:mod:`.placement` (which rank owns which expert), :mod:`.plan` (the exchange plan, NumPy),
:mod:`.shard` (what one rank holds, the options ranks must share), :mod:`.simulate` (a world of
ranks in one process on the float64 reference), :mod:`.ep` (the NCCL layer, one process per
GPU) and :mod:`.launch` (the launcher and the rendezvous). See ``docs/parallel.md``.
"""

from .ep import ExpertParallelMoE
from .placement import ExpertPlacement, select_experts
from .plan import ReceivePlan, SendPlan, capacity, receive_plan, send_plan
from .shard import ExpertShard, layer_options
from .simulate import simulate_expert_parallel

__all__ = [
    "ExpertParallelMoE",
    "ExpertPlacement",
    "ExpertShard",
    "ReceivePlan",
    "SendPlan",
    "capacity",
    "layer_options",
    "receive_plan",
    "select_experts",
    "send_plan",
    "simulate_expert_parallel",
]
