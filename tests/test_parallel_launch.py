# SPDX-License-Identifier: Apache-2.0
"""The launcher on the CPU: the world from torchrun / mpirun variables, the file rendezvous with
its time-outs (threads stand in for ranks), and the spawner with fake workers (a dead or hung
peer ends the world with an error, never a hang)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cupymoe.parallel.launch import (
    FileRendezvous,
    RendezvousError,
    WorkerFailed,
    World,
    _drop_option,
    main,
    spawn,
    world_from_env,
)


# ---- the world from the environment ------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "world"),
    [
        ({}, None),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, World(1, 4, 1)),
        ({"RANK": "3", "WORLD_SIZE": "4"}, World(3, 4, 0)),
        (
            {
                "OMPI_COMM_WORLD_RANK": "2",
                "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            },
            World(2, 8, 2),
        ),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, World(1, 2, 1)),
    ],
)
def test_world_from_env(env: dict[str, str], world: World | None) -> None:
    assert world_from_env(env) == world


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK: expected 0 <= RANK < WORLD_SIZE = 2, got 2"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK: expected an integer, got 'x'"),
        ({"RANK": "0"}, "WORLD_SIZE: not set, but RANK is"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE: expected >= 1"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK: expected >= 0"),
    ],
)
def test_bad_world_env(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        world_from_env(env)


# ---- the rendezvous ----------------------------------------------------------------------------
def _ranks(tmp_path: Path, world_size: int, ranks: list[int], timeout: float) -> dict:
    results: dict[int, object] = {}

    def run(rank: int) -> None:
        rdv = FileRendezvous(tmp_path, World(rank, world_size, rank), timeout=timeout)
        try:
            results[rank] = rdv.exchange(b"nccl-id-bytes" if rank == 0 else None)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout + 5)
        assert not t.is_alive(), "a rank hung past its time-out"
    return results


def test_rendezvous_shares_rank_zeros_bytes(tmp_path: Path) -> None:
    results = _ranks(tmp_path, 4, [3, 1, 2, 0], timeout=10)  # order of arrival does not matter
    assert results == {r: b"nccl-id-bytes" for r in range(4)}
    assert not list(tmp_path.glob(".payload.*"))  # the temporary file was renamed into place


def test_rendezvous_rank_zero_never_arrives(tmp_path: Path) -> None:
    start = time.monotonic()
    results = _ranks(tmp_path, 2, [1], timeout=0.3)
    assert time.monotonic() - start < 3
    assert isinstance(results[1], RendezvousError)
    assert "rank 1 waited 0.3 s" in str(results[1]) and "rank 0's payload" in str(results[1])


def test_rendezvous_a_peer_never_arrives(tmp_path: Path) -> None:
    results = _ranks(tmp_path, 3, [0, 1], timeout=0.3)
    for r in (0, 1):
        assert isinstance(results[r], RendezvousError)
        assert "arrived.2" in str(results[r]) and "arrived.0" not in str(results[r])


def test_rendezvous_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="timeout: expected > 0"):
        FileRendezvous(tmp_path, World(0, 1, 0), timeout=0)
    with pytest.raises(ValueError, match="is not a directory"):
        FileRendezvous(tmp_path / "nope", World(0, 1, 0))
    with pytest.raises(ValueError, match="payload: rank 0 must provide"):
        FileRendezvous(tmp_path, World(0, 1, 0)).exchange(None)


# ---- the spawner with fake workers -------------------------------------------------------------
def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_spawn_sets_the_world(tmp_path: Path) -> None:
    code = (
        "import os, pathlib; e = os.environ; "
        f"pathlib.Path(r'{tmp_path}', e['RANK']).write_text(e['WORLD_SIZE'] + e['LOCAL_RANK'])"
    )
    spawn(3, lambda rank: _py(code), timeout=30)
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"0": "30", "1": "31", "2": "32"}


def test_a_dead_peer_ends_the_world() -> None:
    # rank 1 dies at once; ranks 0 and 2 would wait 60 s for it: they must be stopped
    code = (
        "import os, sys, time; r = int(os.environ['RANK']); "
        "sys.exit(3) if r == 1 else time.sleep(60)"
    )
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match="rank 1 exited with status 3"):
        spawn(3, lambda rank: _py(code), timeout=30, grace=2)
    assert time.monotonic() - start < 15


def test_a_hung_world_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"ranks \[0, 1\] still running after 0.5 s"):
        spawn(2, lambda rank: _py("import time; time.sleep(60)"), timeout=0.5, grace=2)
    assert time.monotonic() - start < 10


def test_launcher_drops_ep_for_workers() -> None:
    assert _drop_option(["--ep", "2", "--tokens", "4"], "--ep") == ["--tokens", "4"]
    assert _drop_option(["--ep=2", "--seed", "1"], "--ep") == ["--seed", "1"]


def test_launcher_needs_ep_or_a_world(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(main, [])
    assert result.exit_code != 0 and "--ep: give the number of workers" in result.output
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = CliRunner().invoke(main, [])
    assert result.exit_code != 0 and "--rendezvous: a worker of a world > 1" in result.output
