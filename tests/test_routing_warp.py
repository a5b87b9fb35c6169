# SPDX-License-Identifier: Apache-2.0
"""CPU transcription of the fused routing launch's warp algorithms (cupymoe/cuda/topk.cuh,
maps.cuh, route_fused.cu),
checked against the NumPy reference: the sorting networks (read from the kernel source), the
top-k in rounds of two warp reductions over 32 sorted lanes, the top-2 of a group of whole lanes
(a butterfly), and the one-warp expert maps (8 buckets per lane, a packed lane scan).

The GPU tests compare the kernels themselves with the reference; these tests pin the algorithms
down on the CPU, tie rules included, so that a change to the design is checked in CI too."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from cupymoe._runtime.compile import kernel_source
from cupymoe.routing import Router, expert_maps_ref, route_ref, sigmoid_f32
from cupymoe.routing.reference import _order_bits, _top_k_by_key
from cupymoe.routing.topk import _warp_keys

LANES = 32
MASK32 = 0xFFFFFFFF


def _network(n: int) -> list[tuple[int, int]]:
    """The exchange list of ``sort_descending<n>`` as written in topk.cuh."""
    if n == 2:
        return [(0, 1)]
    src = kernel_source("route_fused")
    m = re.search(r"kNet\[(\d+)\]\[2\] = \{(.*?)\};", src[src.index(f"N == {n})") :], re.S)
    assert m is not None, f"no sorting network for N = {n} in topk.cuh"
    pairs = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+), (\d+)\}", m.group(2))]
    assert len(pairs) == int(m.group(1))
    return pairs


def _sort_descending(keys: list[int], net: list[tuple[int, int]]) -> list[int]:
    a = list(keys)
    for i, j in net:
        if a[i] < a[j]:
            a[i], a[j] = a[j], a[i]
    return a


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sorting_network_sorts_every_01_input(n: int) -> None:
    # 0-1 principle: a comparator network that sorts every 0/1 input sorts every input.
    net = _network(n)
    for bits in itertools.product((0, 1), repeat=n):
        assert _sort_descending(list(bits), net) == sorted(bits, reverse=True), bits
    assert len(net) == {2: 1, 4: 5, 8: 19}[n]


def _lane_keys(high: np.ndarray, kn: int) -> list[list[int]]:
    """Lane l's keys (expert = kn l + j): high word = score order, low word = ~expert."""
    e = high.size
    lanes = []
    for lane in range(LANES):
        keys = []
        for j in range(kn):
            x = kn * lane + j
            keys.append((int(high[x]) << 32) | (MASK32 - x) if x < e else 0)
        lanes.append(keys)
    return lanes


def _warp_top_k(high: np.ndarray, k: int) -> list[int]:
    """Transcription of rt::warp_top_k: sort each lane, then k rounds of two reductions."""
    kn = _warp_keys(high.size, k)
    net = _network(kn) if kn > 1 else []
    lanes = [_sort_descending(keys, net) for keys in _lane_keys(high, kn)]
    chosen = []
    for _ in range(k):
        heads = [keys[0] for keys in lanes]
        best_hi = max(h >> 32 for h in heads)  # redux.max over the score words
        best_lo = max(h & MASK32 for h in heads if h >> 32 == best_hi)  # then the expert words
        best = (best_hi << 32) | best_lo
        for keys in lanes:
            if keys[0] == best:  # the lane holding it pops its head
                keys[:] = [*keys[1:], 0]
        chosen.append(MASK32 - best_lo)
    return chosen


def _scores(kind: str, e: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(e).astype(np.float32)
    if kind == "ties":
        x = np.round(x * 2).astype(np.float32)
    elif kind == "equal":
        x[:] = 0.25
    elif kind == "nan":
        x[rng.random(e) < 0.3] = np.nan
        x[rng.random(e) < 0.1] = -np.inf
        x[rng.random(e) < 0.1] = -0.0
    return x


@pytest.mark.parametrize("kind", ["random", "ties", "equal", "nan"])
@pytest.mark.parametrize(("e", "k"), [(8, 1), (8, 8), (32, 2), (60, 6), (128, 4), (256, 8)])
def test_warp_top_k_matches_reference(kind: str, e: int, k: int) -> None:
    rng = np.random.default_rng(e * 100 + k)
    for _ in range(20):
        x = _scores(kind, e, rng)
        want = _top_k_by_key(_order_bits(x)[None, :], k)[0].tolist()
        assert _warp_top_k(_order_bits(x), k) == want
        # the same through route_ref (softmax_topk selects by logit)
        assert route_ref(x[None, :], Router(e, k)).topk_ids[0].tolist() == want


def _f32_from_order(o: int) -> np.float32:
    u = o & 0x7FFFFFFF if o & 0x80000000 else ~o & MASK32
    return np.array([u], np.uint32).view(np.float32)[0]


def _groups_by_lanes(choice: np.ndarray, n_group: int, topk_group: int, kn: int) -> list[bool]:
    """Transcription of rt::groups_by_lanes: lane l holds experts kn l .. kn l + kn - 1, a group is
    L = group_size / kn lanes; each lane's top-2 (max / min), then a butterfly over the L lanes."""
    e = choice.size
    lanes_per_group = e // n_group // kn
    assert e // n_group % kn == 0 and lanes_per_group & (lanes_per_group - 1) == 0
    padded = np.full(LANES * kn, -np.inf, np.float32)  # lanes past E hold -inf
    padded[:e] = choice
    o = [int(v) for v in _order_bits(padded)]
    o1 = [o[kn * lane] for lane in range(LANES)]
    o2 = [0] * LANES
    for lane in range(LANES):
        for v in o[kn * lane + 1 : kn * lane + kn]:
            o2[lane] = max(o2[lane], min(o1[lane], v))
            o1[lane] = max(o1[lane], v)
    s = 1
    while s < lanes_per_group:
        p1 = [o1[lane ^ s] for lane in range(LANES)]
        p2 = [o2[lane ^ s] for lane in range(LANES)]
        o2 = [max(o2[i], p2[i], min(o1[i], p1[i])) for i in range(LANES)]
        o1 = [max(o1[i], p1[i]) for i in range(LANES)]
        s <<= 1
    mine = []
    for lane in range(LANES):
        total = np.float32(_f32_from_order(o1[lane]) + _f32_from_order(o2[lane]))
        mine.append(int(_order_bits(np.array([total], np.float32))[0]))
    kept = []
    for g in range(n_group):
        lane = g * lanes_per_group
        scores = [mine[h * lanes_per_group] for h in range(n_group)]
        rank = sum(v > mine[lane] or (v == mine[lane] and h < g) for h, v in enumerate(scores))
        kept.append(rank < topk_group)
    return kept


@pytest.mark.parametrize("kind", ["random", "ties", "equal", "nan"])
@pytest.mark.parametrize(
    ("e", "n_group", "topk_group", "k"),
    [
        (256, 8, 4, 8),  # DeepSeek-V3: 4 lanes per group
        (256, 8, 1, 8),
        (256, 16, 4, 8),  # 2 lanes per group
        (256, 32, 3, 8),  # groups of 8: one lane each
        (256, 4, 2, 8),  # 8 lanes per group
        (96, 3, 1, 4),  # 3 groups of 8 lanes, lanes 24..31 past E
        (64, 2, 1, 2),  # 16 lanes per group
        (48, 24, 5, 2),  # groups of 2 on one lane each
        (32, 16, 8, 1),  # one expert per lane: groups of two lanes
    ],
)
def test_groups_by_lanes_match_reference(
    kind: str, e: int, n_group: int, topk_group: int, k: int
) -> None:
    kn = _warp_keys(e, k)
    group_size = e // n_group
    rng = np.random.default_rng(e * 1000 + n_group * 10 + topk_group)
    for _ in range(10):
        x = _scores(kind, e, rng)
        bias = np.round(rng.standard_normal(e) * 8).astype(np.float32) / 64
        router = Router(
            e,
            k,
            "sigmoid_grouped",
            n_group=n_group,
            topk_group=topk_group,
            correction_bias=bias,
        )
        # The choice scores as both the kernel and route_ref form them (NaN logit -> -inf).
        with np.errstate(invalid="ignore"):
            c = (sigmoid_f32(x) + bias).astype(np.float32)
        c[np.isnan(x)] = -np.inf
        kept = _groups_by_lanes(c, n_group, topk_group, kn)
        ids = route_ref(x[None, :], router).topk_ids[0]
        assert all(kept[i // group_size] for i in ids)  # the reference only picks kept groups
        # and the kept groups are exactly those holding the reference's best choices
        kept_e = np.repeat(kept, group_size)
        high = np.where(kept_e, _order_bits(c), 0)
        high[np.isnan(x) & kept_e] = 1
        assert _top_k_by_key(high[None, :], k)[0].tolist() == ids.tolist()
        assert sum(kept) == topk_group


def _kernel_constant(name: str) -> int:
    """A ``constexpr int`` of the routing kernels, read from the kernel source."""
    found = re.search(rf"constexpr int {name} = (\d+);", kernel_source("route_fused"))
    assert found, name
    return int(found.group(1))


def _maps_warp(ids: np.ndarray, e: int) -> tuple[np.ndarray, ...]:
    """Transcription of rt::build_maps_warp (n <= 64 rows, E <= 256, one warp)."""
    n = ids.size
    cnt = np.zeros(33 * 8, np.int64)
    rank = np.zeros(64, np.int64)

    def bucket(row: int) -> int:
        return (int(ids[row]) if 0 <= ids[row] < e else e) if row < n else -1

    ea = [bucket(lane) for lane in range(LANES)]
    eb = [bucket(lane + LANES) for lane in range(LANES)]
    # lanes_a / lanes_b: per bucket, the lanes whose row of the chunk is in it (atomicOr)
    lanes_a: dict[int, int] = {}
    lanes_b: dict[int, int] = {}
    for lane in range(LANES):
        if ea[lane] >= 0:
            lanes_a[ea[lane]] = lanes_a.get(ea[lane], 0) | 1 << lane
        if eb[lane] >= 0:
            lanes_b[eb[lane]] = lanes_b.get(eb[lane], 0) | 1 << lane
    few = n <= _kernel_constant("kMatchRows")
    for lane in range(LANES):
        lower = (1 << lane) - 1
        if few:  # match.any: the lanes holding the same value (-1 included)
            pa = sum(1 << j for j in range(LANES) if ea[j] == ea[lane])
        else:
            pa = lanes_a.get(ea[lane], 0) if ea[lane] >= 0 else 0
        count = bin(pa).count("1")
        rank[lane] = bin(pa & lower).count("1")
        if n > LANES:
            pb = lanes_b.get(eb[lane], 0) if eb[lane] >= 0 else 0
            before = lanes_a.get(eb[lane], 0) if eb[lane] >= 0 else 0
            rank[lane + LANES] = bin(before).count("1") + bin(pb & lower).count("1")
            count += bin(lanes_b.get(ea[lane], 0)).count("1") if ea[lane] >= 0 else 0
            if eb[lane] >= 0 and before == 0 and pb & lower == 0:
                cnt[eb[lane]] = bin(pb).count("1")
        if ea[lane] >= 0 and pa & lower == 0:
            cnt[ea[lane]] = count
    packed = []
    for lane in range(LANES):
        buckets = range(8 * lane, 8 * lane + (9 if lane == 31 else 8))
        packed.append(sum((int(cnt[b]) << 8) + (b < e and cnt[b] > 0) for b in buckets))
    excl = np.concatenate([[0], np.cumsum(packed)[:-1]])
    offsets = np.zeros(e + 1, np.int32)
    start = np.zeros(33 * 8, np.int64)
    active = np.full(min(n, e), -1, np.int32)
    for lane in range(LANES):
        pos, a = int(excl[lane]) >> 8, int(excl[lane]) & 0xFF
        for i in range(9 if lane == 31 else 8):
            b = 8 * lane + i
            start[b] = pos
            if b <= e:
                offsets[b] = pos
            if b < e and cnt[b] > 0:
                active[a] = b
                a += 1
            pos += int(cnt[b])
    inverse = np.array([start[ids[r]] + rank[r] for r in range(n)], np.int32)
    rows = np.empty(n, np.int32)
    rows[inverse] = np.arange(n, dtype=np.int32)
    return offsets, rows, inverse, active


@pytest.mark.parametrize(
    ("m", "k", "e"),
    [
        (1, 8, 256),
        (4, 8, 256),
        (8, 8, 256),
        (64, 1, 256),
        (33, 1, 60),
        (5, 6, 255),
        (2, 2, 8),
        (16, 4, 128),
    ],
)
def test_maps_warp_matches_reference(m: int, k: int, e: int) -> None:
    rng = np.random.default_rng(m * 1000 + k * 10 + e)
    for _ in range(10):
        # distinct experts within a token, as routing gives them; many shared across tokens
        pool = rng.choice(e, size=min(e, 2 * k), replace=False)
        ids = np.stack([rng.choice(pool, size=k, replace=False) for _ in range(m)]).astype(np.int32)
        for got, want in zip(_maps_warp(ids.reshape(-1), e), expert_maps_ref(ids, e), strict=True):
            np.testing.assert_array_equal(got, want)
