# SPDX-License-Identifier: Apache-2.0
"""Expert parallelism on the CPU: the placement, the exchange plan's invariants, and a simulated
world of W ranks that equals the single-layer reference bitwise; bad worlds raise clear errors.
(The NCCL layer's GPU tests are in test_parallel_gpu.py.)"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import cupymoe as cm
from cupymoe.parallel import (
    ExpertPlacement,
    capacity,
    receive_plan,
    send_plan,
    simulate_expert_parallel,
)
from cupymoe.presets import random_fp4_experts
from cupymoe.routing import route_ref

BF16 = ml_dtypes.bfloat16
# E = 24 divides by 1, 2, 3, 4 and 8 (the worlds of the issue); small H and I keep it fast
E, H, I = 24, 64, 32


def _layer(rng: np.random.Generator, top_k: int = 2, **kw: object) -> cm.MoELayer:
    gate = random_fp4_experts(rng, E, I, H, "nvfp4")
    up = random_fp4_experts(rng, E, I, H, "nvfp4")
    down = random_fp4_experts(rng, E, H, I, "nvfp4")
    args: dict[str, object] = dict(top_k=top_k, max_tokens=512)
    args.update(kw)
    return cm.MoELayer((gate, up), down, **args)  # type: ignore[arg-type]


def _tokens(rng: np.random.Generator, counts: list[int]) -> tuple[list, list]:
    xs = [rng.standard_normal((m, H)).astype(BF16) for m in counts]
    logits = [rng.standard_normal((m, E)).astype(np.float32) for m in counts]
    return xs, logits


# ---- placement ---------------------------------------------------------------------------------
def test_contiguous_placement_blocks() -> None:
    p = ExpertPlacement.contiguous(24, 4)
    assert p.owner.tolist() == sum(([r] * 6 for r in range(4)), [])
    assert p.experts_of(2).tolist() == list(range(12, 18))
    assert p.local_index.tolist() == list(range(6)) * 4
    assert p.max_local_experts == 6


def test_explicit_placement() -> None:
    p = ExpertPlacement.from_owners([1, 0, 1, 0, 2], 3)
    assert p.experts_of(0).tolist() == [1, 3]
    assert p.experts_of(2).tolist() == [4]
    assert p.local_index.tolist() == [0, 0, 1, 1, 0]
    assert p == ExpertPlacement.from_owners(np.array([1, 0, 1, 0, 2]), 3)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: ExpertPlacement.contiguous(24, 5), ValueError, "world_size: .*divisible"),
        (lambda: ExpertPlacement.contiguous(24, 0), ValueError, "world_size: expected >= 1"),
        (lambda: ExpertPlacement.contiguous(24, 2.0), TypeError, "world_size: expected int"),
        (lambda: ExpertPlacement.from_owners([0, 1, 2], 2), ValueError, r"owner\[2\] = 2"),
        (lambda: ExpertPlacement.from_owners([0, -1], 2), ValueError, "owner: expected ranks"),
        (lambda: ExpertPlacement.from_owners([0, 0], 2), ValueError, r"ranks \[1\] own none"),
        (lambda: ExpertPlacement.from_owners([0.0, 1.0], 2), TypeError, "owner: expected"),
        (lambda: ExpertPlacement.from_owners([], 1), TypeError, "owner: expected a non-empty"),
    ],
)
def test_bad_placements(make, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        make()


def test_rank_out_of_range() -> None:
    p = ExpertPlacement.contiguous(8, 2)
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world_size = 2, got 2"):
        p.experts_of(2)


def test_resolve_checks_layer_and_world() -> None:
    p = ExpertPlacement.contiguous(8, 2)
    with pytest.raises(ValueError, match="placement: places 8 experts, the layer has 16"):
        ExpertPlacement.resolve(p, 16, 2)
    with pytest.raises(ValueError, match="placement: made for world_size = 2, got 4"):
        ExpertPlacement.resolve(p, 8, 4)
    with pytest.raises(TypeError, match="placement: expected an ExpertPlacement"):
        ExpertPlacement.resolve([0, 1], 2, 2)


# ---- the plan ----------------------------------------------------------------------------------
def test_capacity_is_the_worst_case() -> None:
    assert capacity(8, 8, 128) == 64  # a token sends at most top_k rows to one owner
    assert capacity(8, 8, 4) == 32  # ... and at most one row per expert of that owner
    assert capacity(0, 4, 3) == 0
    with pytest.raises(ValueError, match="n_tokens: expected >= 0"):
        capacity(-1, 2, 2)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("top_k", [2, 4])
def test_send_plan_invariants(rng: np.random.Generator, world: int, top_k: int) -> None:
    m = 37
    routing = route_ref(rng.standard_normal((m, E)).astype(np.float32), cm.Router(E, top_k))
    place = ExpertPlacement.contiguous(E, world)
    cap = capacity(m, top_k, place.max_local_experts)
    plan = send_plan(routing, place, cap)
    offsets = routing.expert_offsets
    expert = routing.topk_ids.reshape(-1)[routing.sorted_rows]
    assert plan.send_counts.sum() == m * top_k
    assert plan.send_counts.max() <= cap
    assert np.unique(plan.slot).size == plan.slot.size  # injective
    dest = plan.slot // cap
    assert np.array_equal(dest, place.owner[expert])  # every row goes to its expert's owner
    assert np.all(plan.slot % cap < plan.send_counts[dest])  # inside the valid prefix
    for d in range(world):  # expert-major and stable within each segment
        mine = np.flatnonzero(dest == d)
        assert np.all(np.diff(plan.slot[mine]) == 1)
    for e in range(E):
        assert plan.expert_counts[e] == offsets[e + 1] - offsets[e]


def test_send_plan_explicit_placement_is_expert_major(rng: np.random.Generator) -> None:
    place = ExpertPlacement.from_owners(rng.permutation(np.arange(E) % 3), 3)
    routing = route_ref(rng.standard_normal((20, E)).astype(np.float32), cm.Router(E, 3))
    cap = capacity(20, 3, place.max_local_experts)
    plan = send_plan(routing, place, cap)
    expert = routing.topk_ids.reshape(-1)[routing.sorted_rows]
    for d in range(3):
        order = np.argsort(plan.slot[plan.slot // cap == d])
        got = expert[plan.slot // cap == d][order]
        assert np.all(np.diff(got) >= 0)  # the owner's experts ascending in its segment


def test_send_plan_rejects_a_small_capacity(rng: np.random.Generator) -> None:
    routing = route_ref(rng.standard_normal((10, E)).astype(np.float32), cm.Router(E, 4))
    with pytest.raises(ValueError, match="capacity: 3 rows per segment"):
        send_plan(routing, ExpertPlacement.contiguous(E, 2), 3)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_owner_order_is_the_single_gpu_order(rng: np.random.Generator, world: int) -> None:
    """Expert e's rows on its owner are the one-GPU rows of e, in the same order."""
    top_k, counts = 3, [int(c) for c in rng.integers(0, 20, world)]
    place = ExpertPlacement.contiguous(E, world)
    cap = capacity(max(counts), top_k, place.max_local_experts)
    logits = [rng.standard_normal((m, E)).astype(np.float32) for m in counts]
    router = cm.Router(E, top_k)
    routings = [route_ref(g, router) for g in logits]
    plans = [send_plan(r, place, cap) for r in routings]
    one = route_ref(np.concatenate(logits), router)
    first = np.concatenate([[0], np.cumsum(counts)])
    for d in range(world):
        # the global flat slot (token * k + slot) each received row stands for
        received = np.full(world * cap, -1)
        for s in range(world):
            seg = plans[s].slot // cap == d
            flat = routings[s].sorted_rows[seg] + first[s] * top_k
            received[s * cap + plans[s].slot[seg] % cap] = flat
        rplan = receive_plan(np.stack([p.counts_for(place, d) for p in plans]), cap)
        got = received[rplan.sorted_rows]
        mine = place.experts_of(d)
        lo, hi = one.expert_offsets[mine[0]], one.expert_offsets[mine[-1] + 1]
        assert np.array_equal(got, one.sorted_rows[lo:hi])
        assert np.array_equal(np.diff(rplan.expert_offsets), np.diff(one.expert_offsets)[mine])


def test_receive_plan_checks_counts() -> None:
    with pytest.raises(ValueError, match="recv_counts: expected >= 0 counts summing to <= "):
        receive_plan(np.array([[3, 2]]), 4)
    with pytest.raises(TypeError, match="recv_counts: expected an integer array"):
        receive_plan(np.zeros(3), 4)


# ---- the simulated world -----------------------------------------------------------------------
def _world_cases() -> list[tuple[int, int]]:
    # every world of the issue with top_k 2..4; W = 8 with top_k 4 > E / W = 3 caps rows per owner
    return [(w, k) for w in (1, 2, 3, 4, 8) for k in (2, 3, 4)]


@pytest.mark.parametrize(("world", "top_k"), _world_cases())
def test_simulated_world_is_bitwise_the_reference(
    rng: np.random.Generator, world: int, top_k: int
) -> None:
    layer = _layer(rng, top_k)
    counts = [int(c) for c in rng.integers(1, 24, world)]
    counts[world // 2] = 0  # a rank with no tokens still owns experts and serves its peers
    xs, logits = _tokens(rng, counts)
    outs = simulate_expert_parallel(xs, logits, layer, world)
    ref = cm.moe_reference(np.concatenate(xs), np.concatenate(logits), layer)
    assert [o.shape for o in outs] == [(m, H) for m in counts]
    assert np.array_equal(np.concatenate(outs), ref)  # bitwise, float64


def test_simulated_world_options(rng: np.random.Generator) -> None:
    """Grouped sigmoid routing with a correction bias, geglu, biases and an explicit placement."""
    bias = rng.standard_normal(E).astype(np.float32)
    layer = _layer(
        rng,
        4,
        routing="sigmoid_grouped",
        n_group=4,
        topk_group=2,
        correction_bias=bias,
        routed_scaling_factor=2.5,
        activation="geglu",
        fc1_bias=rng.standard_normal((E, 2 * I)),
        fc2_bias=rng.standard_normal((E, H)),
    )
    place = ExpertPlacement.from_owners(rng.permutation(np.arange(E) % 3), 3)
    xs, logits = _tokens(rng, [5, 0, 17])
    outs = simulate_expert_parallel(xs, logits, layer, 3, placement=place)
    ref = cm.moe_reference(np.concatenate(xs), np.concatenate(logits), layer)
    assert np.array_equal(np.concatenate(outs), ref)


def test_simulated_world_of_empty_ranks(rng: np.random.Generator) -> None:
    layer = _layer(rng)
    xs, logits = _tokens(rng, [0, 0])
    outs = simulate_expert_parallel(xs, logits, layer, 2)
    assert [o.shape for o in outs] == [(0, H), (0, H)]


def test_per_rank_layers_that_agree(rng: np.random.Generator) -> None:
    layer = _layer(rng)
    xs, logits = _tokens(rng, [3, 4])
    twin = cm.MoELayer((layer.gate, layer.up), layer.down, top_k=2, max_tokens=512)
    outs = simulate_expert_parallel(xs, logits, [layer, twin], 2)
    ref = cm.moe_reference(np.concatenate(xs), np.concatenate(logits), layer)
    assert np.array_equal(np.concatenate(outs), ref)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(top_k=3), "option 'top_k' differs across ranks: rank 0 has 2, rank 1 has 3"),
        (dict(renormalize=False), "option 'renormalize' differs"),
        (dict(activation="geglu"), "option 'activation' differs"),
        (dict(max_tokens=64), "option 'max_tokens' differs"),
        (dict(fc2_bias=np.zeros((E, H))), "option 'fc2_bias' differs"),
    ],
)
def test_mismatched_layer_options_across_ranks(
    rng: np.random.Generator, change: dict, match: str
) -> None:
    layer = _layer(rng)
    args: dict[str, object] = dict(top_k=2, max_tokens=512)
    args.update(change)
    other = cm.MoELayer((layer.gate, layer.up), layer.down, **args)  # type: ignore[arg-type]
    xs, logits = _tokens(rng, [2, 2])
    with pytest.raises(ValueError, match=match):
        simulate_expert_parallel(xs, logits, [layer, other], 2)


def test_bad_worlds(rng: np.random.Generator) -> None:
    layer = _layer(rng)
    xs, logits = _tokens(rng, [2] * 5)
    with pytest.raises(ValueError, match="world_size: .*n_experts = 24 and world_size = 5"):
        simulate_expert_parallel(xs, logits, layer, 5)
    with pytest.raises(ValueError, match="x_per_rank: expected 2 arrays"):
        simulate_expert_parallel(xs[:3], logits[:2], layer, 2)
    with pytest.raises(ValueError, match="layer: expected 3 layers"):
        simulate_expert_parallel(xs[:3], logits[:3], [layer, layer], 3)
    with pytest.raises(TypeError, match="layer: expected a MoELayer"):
        simulate_expert_parallel(xs[:2], logits[:2], "layer", 2)
    bad = dataclasses.replace(ExpertPlacement.contiguous(E, 2))
    with pytest.raises(ValueError, match="placement: made for world_size = 2, got 3"):
        simulate_expert_parallel(xs[:3], logits[:3], layer, 3, placement=bad)
    wrong = [x[:, :32] for x in xs[:2]]
    with pytest.raises(ValueError, match="x: expected shape"):
        simulate_expert_parallel(wrong, logits[:2], layer, 2)
