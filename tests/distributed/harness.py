"""Run a function on a few gloo ranks in spawned processes, with hard timeouts.

``run_distributed(fn, world, *args)`` starts ``world`` processes, each initialising a gloo
process group (with a collective timeout) and calling ``fn(rank, world, *args)``. If any rank
raises, the others are terminated and the parent raises with the original traceback; if the
whole run exceeds ``timeout_s`` every rank is terminated and the parent raises TimeoutError.
So a failing or deadlocked rank never leaves the test suite hanging.

A rank whose checks passed (all ranks reached the final barrier) records that; after destroying
the group it leaves with ``os._exit(0)``, skipping interpreter finalisation, which can abort a
process inside gloo's C++ teardown (pytorch/pytorch#179291 describes the race; CI once saw a
rank die with ``terminate called without an active exception`` and no Python error). A rank
that dies *after* recording success is reported as a warning. A rank killed by a signal
*before* that, without a Python error of its own (its peers then record "connection closed"
echoes), gets the run repeated once, with a warning; a second such death fails the test and
shows the first Python error any rank recorded. Python errors and timeouts are never retried.
"""

from __future__ import annotations

import datetime
import gc
import glob
import os
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank raised: carries the traceback of the rank that failed first."""


def _entry(rank, fn, world, store_path, timeout_s, args, env):
    os.environ.update(env)
    try:
        _run_rank(rank, fn, world, store_path, timeout_s, args)
    except BaseException:
        _record(store_path, rank)
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter finalisation (see the module docstring)


def _finished_ranks(store_path) -> set[int]:
    return {int(p.rsplit(".", 1)[1]) for p in glob.glob(f"{store_path}.ok.*")}


def _record(store_path, rank):
    """Write when and what failed, once per rank: the first failure is the cause, later ones
    are its echoes (peers see "connection closed" once the failing rank is gone)."""
    path = f"{store_path}.err.{rank}"
    if not os.path.exists(path):
        with open(path + ".tmp", "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        os.replace(path + ".tmp", path)  # readers never see a half-written record


def _first_error(store_path):
    """(time, rank, traceback) of the earliest recorded Python error, or None."""
    errors = []
    for path in glob.glob(f"{store_path}.err.*[0-9]"):
        with open(path) as f:
            stamp, _, tb = f.read().partition("\n")
        errors.append((float(stamp), int(path.rsplit(".", 1)[1]), tb))
    return min(errors) if errors else None


def _has_error_record(store_path, rank: int) -> bool:
    return os.path.exists(f"{store_path}.err.{rank}")


def _run_rank(rank, fn, world, store_path, timeout_s, args):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world, *args)
        dist.barrier()  # every rank's checks passed
        with open(f"{store_path}.ok.{rank}", "w") as f:
            f.write("passed\n")
    except BaseException:
        _record(store_path, rank)  # before tearing down the group, which wakes the peers
        raise
    finally:
        gc.collect()  # free autograd graphs that still hold the group while Python is intact
        dist.destroy_process_group()


class NativeCrash(RuntimeError):
    """A rank died from a signal, before every rank passed, without a Python error of its own.
    ``python_error``: the first Python error other ranks recorded (their echo of the crash, or
    a cause), as RankError or None."""

    def __init__(self, message: str, python_error: "RankError | None"):
        super().__init__(message)
        self.python_error = python_error


def run_distributed(fn, world: int, *args, timeout_s: float = 240.0, collective_timeout_s: float = 60.0,
                    env: dict | None = None, native_crash_retries: int = 1):
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; raise the first rank error.

    ``env``: extra environment variables for the ranks (the attention backend defaults to the
    torch path). A run in which a rank dies from a signal without a Python error of its own (a
    crash inside gloo's C++, see the module docstring; its peers' errors are echoes) is
    repeated up to ``native_crash_retries`` times with a warning; Python errors and timeouts
    never are, and a crash that repeats fails the test with the first Python error recorded.
    """
    for attempt in range(native_crash_retries + 1):
        try:
            return _run_once(fn, world, args, timeout_s, collective_timeout_s, env)
        except NativeCrash as exc:
            if attempt == native_crash_retries:  # a repeat: show a Python error if any
                if exc.python_error is not None:
                    raise exc.python_error from exc
                raise
            warnings.warn(f"{fn.__name__}: {exc}; retrying once")


def _run_once(fn, world, args, timeout_s, collective_timeout_s, env):
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        rank_env = {"FLASHMASK3_BACKEND": "torch", **(env or {})}  # not whatever the parent has
        ctx = mp.start_processes(_entry, args=(fn, world, store, collective_timeout_s, args, rank_env),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):  # raises on the first rank that fails
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed run of {fn.__name__} exceeded {timeout_s}s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            time.sleep(0.5)  # let a slower failing rank finish writing its record
            first = _first_error(store)
            python_error = None if first is None else RankError(f"rank {first[1]} failed first:\n{first[2]}")
            signalled = isinstance(exc, mp.ProcessExitedException) and bool(exc.signal_name)
            if signalled and _all_finished(ctx, store, world):
                warnings.warn(f"every rank of {fn.__name__} passed, but rank {exc.error_index} "
                              f"then died in teardown ({exc})")
                return
            if signalled and not _has_error_record(store, exc.error_index):
                raise NativeCrash(f"rank {exc.error_index} died ({exc}) with no Python error",
                                  python_error) from exc
            if python_error is not None:
                raise python_error from exc
            raise
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(5)


def _all_finished(ctx, store_path, world: int, wait_s: float = 30.0) -> bool:
    """Whether every rank recorded success (waiting for the live ones to get there)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if len(_finished_ranks(store_path)) == world:
            return True
        if not any(p.is_alive() for p in ctx.processes):
            break
        time.sleep(0.2)
    return len(_finished_ranks(store_path)) == world


def run_one_rank(fn, backend: str, device: str, store: str, timeout_s: float, what: str):
    """``fn(backend, device, store, queue)`` in a spawned process that makes a one-rank group
    itself (NCCL where there is one GPU); returns what it put on ``queue`` (its result, or the
    text of its exception) and fails the test if it does not finish within ``timeout_s``."""
    import pytest

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=fn, args=(backend, device, store, queue))
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.terminate()
        pytest.fail(f"{what} did not finish in {timeout_s:.0f} s")
    return queue.get()
