"""Several ranks, one job: data-parallel attention with expert parallelism (DEP) over torch.distributed.

    rank r     its own Engine: slots, pages, prefix cache; the model with routed experts
               expert_range(E, r, world) (model/expert_parallel.py), the rest whole
    routing    SessionRouter, computed alike on every rank: a session stays on the rank that holds
               its pages (affinity); a new one goes to the rank with the fewest tokens routed so
               far, ties to the lowest rank
    stepping   step_together: before each step the ranks agree (one all-reduce) whether any has
               work; then every rank steps, an idle one on a padding row, because every MoE layer
               is an all-to-all that all ranks must enter
    launch     launch(worker, world): one process per rank (spawned), the process group set up
               with a timeout; a rank that raises or dies ends the job with a RankFailure naming
               the rank and the reason, the other ranks stopped, never a hang

gloo on CPUs, NCCL on GPUs (rank r on cuda:r).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """A rank of a launched job raised or died; the message names the rank and why."""


class SessionRouter:
    """The rank of each session: affinity first (its prefix pages live there), else the rank with
    the fewest tokens routed so far, ties to the lowest rank. Deterministic: every rank that
    routes the same sessions in the same order computes the same ranks."""

    def __init__(self, world: int):
        if world < 1:
            raise ValueError(f"a router needs at least one rank, got world={world}")
        self.load = [0] * world  # tokens routed to each rank (prompt + new tokens)
        self.home: dict[Hashable, int] = {}

    def route(self, session: Hashable, tokens: int) -> int:
        rank = self.home.get(session)
        if rank is None:
            rank = min(range(len(self.load)), key=lambda r: (self.load[r], r))
            self.home[session] = rank
        self.load[rank] += tokens
        return rank


def step_together(engine, group=None) -> tuple[int, float]:
    """Step `engine` in lockstep with the other ranks until no rank has work; returns the steps run
    and the compile time inside them (engine.setup_s summed)."""
    busy = torch.zeros(1, dtype=torch.int64, device=engine.device if dist.get_backend(group) == "nccl" else "cpu")
    steps, setup_s = 0, 0.0
    while True:
        busy.fill_(int(bool(engine.waiting or engine.running)))
        dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=group)
        if not busy.item():
            return steps, setup_s
        engine.step()
        steps += 1
        setup_s += engine.setup_s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, backend: str, timeout_s: float, worker: Callable, args: tuple,
               results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        result = worker(rank, world, *args)
    except BaseException as e:  # noqa: BLE001 (reported to the launcher, which names the rank)
        # reported before the group closes: the peers' broken collectives come after this cause
        results.put((rank, "error", "".join(traceback.format_exception_only(type(e), e)).strip()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # pickled here, by value: a queue would pass tensors as shared memory, gone when this process exits
    results.put((rank, "ok", pickle.dumps(result)))


def _why(rank: int, exitcode: int | None, error: str | None) -> str:
    if error is not None:
        return f"rank {rank} raised {error}"
    if exitcode is not None and exitcode < 0:
        return f"rank {rank} was killed by {signal.Signals(-exitcode).name}"
    return f"rank {rank} exited with code {exitcode}"


def launch(worker: Callable, world: int, args: tuple = (), *, backend: str = "gloo", timeout_s: float = 300,
           grace_s: float = 2.0) -> list:
    """Run `worker(rank, world, *args)` in `world` spawned processes with the process group set up;
    returns the workers' return values in rank order (they must pickle).

    timeout_s bounds every collective, so a rank that stops answering makes the others raise. The
    first rank to fail (raise, die, or exit early) ends the job: the launcher waits `grace_s` for
    the others to report, stops the rest, and raises RankFailure naming the first failure (a
    rank killed by a signal before the others' collectives broke first of all)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}; valid: gloo (CPUs), nccl (GPUs)")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"world size {world} needs {world} GPUs for NCCL; this machine has {torch.cuda.device_count()}")
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank_main, args=(rank, world, port, backend, timeout_s, worker, args, results),
                                 name=f"megafuse-rank-{rank}") for rank in range(world)]
    for process in processes:
        process.start()
    done: dict[int, object] = {}
    errors: dict[int, str] = {}
    failed_at: dict[int, float] = {}  # rank -> when its failure was seen
    exited_at: dict[int, float] = {}  # rank -> when it was seen gone with status 0 (its result may be in flight)
    try:
        while len(done) < world:
            try:
                rank, status, value = results.get(timeout=0.1)
                if status == "ok":
                    done[rank] = pickle.loads(value)
                else:
                    errors[rank] = value
                    failed_at.setdefault(rank, time.monotonic())
            except queue.Empty:
                pass
            now = time.monotonic()
            for rank, process in enumerate(processes):
                if rank in done or rank in failed_at or process.exitcode is None:
                    continue
                if process.exitcode != 0 or now - exited_at.setdefault(rank, now) > grace_s:
                    failed_at[rank] = now
            if failed_at and now - min(failed_at.values()) > grace_s:
                break
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    if failed_at:
        killed = [r for r in failed_at if r not in errors and (processes[r].exitcode or 0) < 0]
        first = min(killed or failed_at, key=lambda r: failed_at[r])
        others = sorted(r for r in failed_at if r != first)
        message = _why(first, processes[first].exitcode, errors.get(first))
        if others:
            message += "; then " + "; ".join(_why(r, processes[r].exitcode, errors.get(r)) for r in others)
        raise RankFailure(message)
    return [done[rank] for rank in range(world)]
