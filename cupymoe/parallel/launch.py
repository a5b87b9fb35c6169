# SPDX-License-Identifier: Apache-2.0
"""One process per GPU: the launcher, the world from the environment, and the NCCL rendezvous.

``python -m cupymoe.parallel.launch --ep 2 [layer options]`` spawns two workers (this module
again) with ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` set and a fresh rendezvous directory;
under ``torchrun`` or ``mpirun`` (their environment variables set) it is the worker itself, and
``--rendezvous DIR`` must name a directory every rank sees.

The NCCL unique id goes through a file: rank 0 writes it atomically (a temporary file, then
``os.replace``), the others poll for it; then every rank writes an arrival file and waits for
all the others. Every wait has a time-out and ends with an error that names the missing ranks,
so a peer that never starts is an error, never a hang (the hang of a naive two-process start is
``NcclCommunicator`` waiting for a peer that is not there: the barrier before it makes sure the
world is complete). The launcher watches its workers: when one dies, it ends the others and
reports the rank and its exit status.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np

__all__ = [
    "FileRendezvous",
    "RendezvousError",
    "World",
    "WorkerFailed",
    "main",
    "nccl_communicator",
    "spawn",
    "world_from_env",
]

#: Rank, world size and local rank variables, first match wins: torchrun / our launcher,
#: Open MPI, then MPICH / Intel MPI (PMI; no local rank there: LOCAL_RANK or 0).
_ENV_SCHEMES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


class RendezvousError(TimeoutError):
    """A peer did not arrive within the time-out."""


class WorkerFailed(RuntimeError):
    """A worker exited with an error or the world ran past its time-out."""


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place in the world."""

    rank: int
    world_size: int
    local_rank: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"WORLD_SIZE: expected >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"RANK: expected 0 <= RANK < WORLD_SIZE = {self.world_size}, got {self.rank}"
            )
        if self.local_rank < 0:
            raise ValueError(f"LOCAL_RANK: expected >= 0, got {self.local_rank}")


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {value!r}") from None


def world_from_env(env: Mapping[str, str] | None = None) -> World | None:
    """The :class:`World` from torchrun / mpirun / launcher variables, or ``None`` when no
    scheme's rank and size are set (a plain start: the launcher spawns the workers)."""
    env = os.environ if env is None else env
    for rank_var, size_var, local_var in _ENV_SCHEMES:
        if rank_var in env and size_var in env:
            rank, size = _int_var(env, rank_var), _int_var(env, size_var)
            for name in (local_var, "LOCAL_RANK"):
                if name in env:
                    return World(rank, size, _int_var(env, name))
            return World(rank, size, 0)
        if (rank_var in env) != (size_var in env):
            have, lack = (rank_var, size_var) if rank_var in env else (size_var, rank_var)
            raise ValueError(f"{lack}: not set, but {have} is (set both or neither)")
    return None


class FileRendezvous:
    """Exchange rank 0's bytes (the NCCL unique id) through files in ``directory``.

    ``exchange(payload)`` on rank 0 writes ``payload`` and returns it; on the others it waits
    for it. Then every rank writes ``arrived.<rank>`` and waits for all ``world_size`` of them.
    Each wait ends after ``timeout`` seconds with :class:`RendezvousError` naming the ranks that
    did not arrive. ``directory`` must be fresh for each world (the launcher makes one).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        world: World,
        *,
        timeout: float = 60.0,
        poll: float = 0.01,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout: expected > 0 seconds, got {timeout}")
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"rendezvous: {self.directory} is not a directory")
        self.world, self.timeout, self.poll = world, float(timeout), float(poll)

    def _write(self, name: str, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / name)  # atomic: a reader sees all of it or nothing

    def _wait(self, names: Sequence[str], what: str, deadline: float) -> None:
        while True:
            missing = [n for n in names if not (self.directory / n).exists()]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"rendezvous: rank {self.world.rank} waited {self.timeout:g} s in "
                    f"{self.directory} for {what} {', '.join(missing)}; those ranks never "
                    "arrived (did they start, with the same --rendezvous directory?)"
                )
            time.sleep(self.poll)

    def exchange(self, payload: bytes | None = None) -> bytes:
        deadline = time.monotonic() + self.timeout
        if self.world.rank == 0:
            if payload is None:
                raise ValueError("payload: rank 0 must provide the bytes to share")
            self._write("payload", payload)
        else:
            self._wait(["payload"], "rank 0's", deadline)
        data = (self.directory / "payload").read_bytes()
        self._write(f"arrived.{self.world.rank}", b"")
        names = [f"arrived.{r}" for r in range(self.world.world_size)]
        self._wait(names, "the arrival of", deadline)
        return data


def nccl_communicator(world: World, rendezvous: FileRendezvous) -> Any:
    """An NCCL communicator of the world on the current device (unverified with W >= 2)."""
    from cupy.cuda import nccl

    uid = nccl.get_unique_id() if world.rank == 0 else None
    data = rendezvous.exchange(json.dumps(list(uid)).encode() if uid is not None else None)
    shared = tuple(json.loads(data.decode()))
    return nccl.NcclCommunicator(world.world_size, shared, world.rank)


def spawn(
    world_size: int,
    command: Callable[[int], Sequence[str]],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    poll: float = 0.05,
    grace: float = 5.0,
) -> None:
    """Run ``command(rank)`` for every rank with RANK / WORLD_SIZE / LOCAL_RANK set.

    Returns when all exit 0. When one exits otherwise, or the world runs past ``timeout``
    seconds, the others get SIGTERM (SIGKILL after ``grace`` seconds) and :class:`WorkerFailed`
    names the rank and its exit status.
    """
    base = dict(os.environ if env is None else env)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world_size):
            child = dict(base, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen(list(command(rank)), env=child))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                raise WorkerFailed(
                    f"rank {rank} exited with status {code}; the other ranks were stopped"
                )
            if all(c == 0 for c in codes):
                return
            if time.monotonic() >= deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                raise WorkerFailed(
                    f"ranks {running} still running after {timeout:g} s; the world was stopped"
                )
            time.sleep(poll)
    finally:
        _stop(procs, grace)


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _random_experts(rng: np.random.Generator, e: int, n: int, k: int, fmt: str) -> Any:
    """Random FP4 weights with outputs of order one (uniform codes; scales around 1/sqrt(k))."""
    from ..formats import Fp4Experts, Fp4Format

    f = Fp4Format.parse(fmt)
    packed = rng.integers(0, 256, size=(e, n, k // 2), dtype=np.uint8)
    blocks = (e, n, k // f.block_size)
    if f is Fp4Format.NVFP4:  # E4M3 bytes 0x30..0x37 (0.5 .. 0.94), global scale 1/sqrt(k)/2
        scales = rng.integers(0x30, 0x38, size=blocks, dtype=np.uint8)
        gs = np.full(e, 0.5 / np.sqrt(k), np.float32)
        return Fp4Experts.from_packed(packed, scales, gs, format=f)
    exponent = 127 + int(np.rint(np.log2(0.25 / np.sqrt(k))))
    scales = np.full(blocks, exponent, np.uint8)
    return Fp4Experts.from_packed(packed, scales, None, format=f)


def _worker(world: World, opts: dict[str, Any]) -> None:
    import cupy
    import ml_dtypes

    from ..layer import MoELayer
    from .ep import ExpertParallelMoE

    cupy.cuda.Device(world.local_rank).use()
    rng = np.random.default_rng(opts["seed"])  # the same weights on every rank
    e, h, i, fmt = opts["experts"], opts["hidden"], opts["inter"], opts["format"]
    gate, up = _random_experts(rng, e, i, h, fmt), _random_experts(rng, e, i, h, fmt)
    down = _random_experts(rng, e, h, i, fmt)
    layer = MoELayer((gate, up), down, top_k=opts["top_k"], max_tokens=max(opts["tokens"], 1))
    comm = None
    if world.world_size > 1:
        rdv = FileRendezvous(opts["rendezvous"], world, timeout=opts["timeout"])
        comm = nccl_communicator(world, rdv)
    ep = ExpertParallelMoE(layer, rank=world.rank, world_size=world.world_size, comm=comm)
    tok = np.random.default_rng([opts["seed"], world.rank])  # each rank its own tokens
    x = cupy.asarray(tok.standard_normal((opts["tokens"], h)).astype(ml_dtypes.bfloat16))
    logits = cupy.asarray(tok.standard_normal((opts["tokens"], e)).astype(np.float32))
    out = ep(x, logits)
    one = layer(x, logits)  # this rank's tokens on one GPU, all experts (the check)
    same = bool(cupy.array_equal(out.view(cupy.uint16), one.view(cupy.uint16)))
    diff = float(cupy.abs(out.astype(cupy.float32) - one.astype(cupy.float32)).max(initial=0))
    print(
        f"rank {world.rank}/{world.world_size}: {opts['tokens']} tokens, experts "
        f"{ep.shard.experts[0]}..{ep.shard.experts[-1]}, bitwise equal to one GPU: {same} "
        f"(max |diff| {diff:g})",
        flush=True,
    )
    if not same:
        sys.exit(1)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--ep",
    "world_size",
    type=click.IntRange(1),
    default=None,
    help="Workers to spawn (one per GPU); not with torchrun/mpirun variables set.",
)
@click.option(
    "--rendezvous",
    type=click.Path(file_okay=False),
    default=None,
    help="Directory for the NCCL id (default: a fresh temporary one).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=120.0,
    show_default=True,
    help="Seconds to wait for peers (and for the whole run).",
)
@click.option("--hidden", type=click.IntRange(1), default=2048, show_default=True)
@click.option("--inter", type=click.IntRange(1), default=512, show_default=True)
@click.option("--experts", type=click.IntRange(1), default=256, show_default=True)
@click.option("--top-k", type=click.IntRange(1), default=8, show_default=True)
@click.option(
    "--format", "fmt", type=click.Choice(["nvfp4", "mxfp4"]), default="nvfp4", show_default=True
)
@click.option(
    "--tokens", type=click.IntRange(0), default=8, show_default=True, help="Tokens per rank."
)
@click.option("--seed", type=int, default=0, show_default=True)
def main(world_size: int | None, rendezvous: str | None, timeout: float, **layer: Any) -> None:
    """Run one MoE layer with expert parallelism: one process per GPU, NCCL exchanges.

    Each rank checks its output against the same tokens on one GPU (bitwise)."""
    world = world_from_env()
    opts = dict(layer, format=layer.pop("fmt"), rendezvous=rendezvous, timeout=timeout)
    if world is not None:  # a worker: spawned by us, torchrun or mpirun
        if world.world_size > 1 and rendezvous is None:
            raise click.ClickException(
                "--rendezvous: a worker of a world > 1 needs the shared rendezvous directory"
            )
        _worker(world, opts)
        return
    if world_size is None:
        raise click.ClickException("--ep: give the number of workers (GPUs) to spawn")
    with tempfile.TemporaryDirectory(prefix="cupymoe-ep-") as tmp:
        args = [a for a in sys.argv[1:]]
        args = _drop_option(args, "--ep") + (["--rendezvous", tmp] if rendezvous is None else [])
        try:
            spawn(
                world_size,
                lambda rank: [sys.executable, "-m", "cupymoe.parallel.launch", *args],
                timeout=timeout + 60.0,  # the rendezvous time-out, then the run itself
            )
        except WorkerFailed as exc:
            raise click.ClickException(str(exc)) from None


def _drop_option(args: list[str], name: str) -> list[str]:
    """``args`` without ``name VALUE`` / ``name=VALUE`` (the workers must not spawn again)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == name:
            skip = True
            continue
        if a.startswith(name + "="):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    main()
