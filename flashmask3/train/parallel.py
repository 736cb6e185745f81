"""The device mesh of a run, launching, FSDP2 sharding and failure handling.

A run has ``world = dp x cp`` ranks on a torch ``DeviceMesh`` with dimensions ``("dp", "cp")``
(row-major: rank ``r`` is data-parallel group ``r // cp``, context-parallel rank ``r % cp``), so
the ranks of one CP group are consecutive and, with torchrun's node-major numbering, on as few
nodes as possible. Each DP group trains on its own rows of the global batch; inside a group the
CP ranks hold one token shard each of the same rows.

Every rank holds the same parameters (CP ranks included: each computes the model on its
tokens), and the gradient of the global loss is the **sum** over all ranks of their partial
gradients (each rank's loss is its share ``Σ_local CE / (targets in the global batch)``). So
the model is sharded with FSDP2 over all ``dp x cp`` ranks (a 1-D mesh of the world, the
flattened mesh): parameters, gradients and optimiser states are split ``world`` ways, and the
reduce-scatter of the gradients (divide factor 1: a sum) reduces over DP and CP at once.

Launch modes, chosen automatically:

* under ``torchrun`` (``WORLD_SIZE`` set): one process per rank already exists; join the mesh;
* ``world == 1``: run in this process, no process group, no FSDP;
* otherwise spawn ``world`` local processes (gloo on CPU, NCCL with one GPU each); a rank that
  raises makes every rank stop: its peers' collectives fail when it exits (gloo) or time out
  after ``dist_timeout`` seconds, and the launcher raises naming the rank that failed first.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist


@dataclass
class Layout:
    """The parallel layout of a run: ``dp x cp`` ranks, ``cp_nodes`` nodes per CP group."""

    dp: int = 1
    cp: int = 1
    nodes: int = 1
    cp_nodes: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.cp


@dataclass
class DistEnv:
    """Where this process sits: rank, world size, device, the mesh (None: one process)."""

    rank: int
    world_size: int
    device: torch.device
    group: Optional[object] = None        # the world's ProcessGroup (None: one process)
    layout: Layout = None
    mesh: Optional[object] = None         # DeviceMesh ("dp", "cp")
    shard_mesh: Optional[object] = None   # 1-D DeviceMesh of all ranks (FSDP2)

    def __post_init__(self):
        if self.layout is None:
            self.layout = Layout(1, self.world_size)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.layout.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.layout.cp

    @property
    def cp_group(self):
        """The CP group as ``cp_flashmask_attention`` takes it: ``(mesh, "cp")``."""
        return (self.mesh, "cp")

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over all ranks (a new tensor; identity without a group)."""
        if self.group is None:
            return t
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when a GPU is visible, else cpu; ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible; use --device cpu")
    return torch.device(name)


def _local_ranks(device: torch.device) -> int:
    """Ranks a plain (non-torchrun) run can start here: the visible GPUs (the largest power of
    two of them, so that sequence lengths split evenly), or 2 CPU ranks without a GPU."""
    if device.type != "cuda":
        return 2
    return 1 << (max(1, torch.cuda.device_count()).bit_length() - 1)


def resolve_layout(cp: int, dp: int, nodes: int, device: torch.device,
                   environ: Optional[dict] = None) -> Layout:
    """``dp x cp`` and the node count from the flags and the launcher's environment.

    Under torchrun the world is ``WORLD_SIZE``: a 0 flag is derived from it (both 0: all ranks
    are one CP group) and ``nodes`` defaults to ``WORLD_SIZE / LOCAL_WORLD_SIZE``. Otherwise
    ``dp`` defaults to 1 and ``cp=0`` takes the local ranks (all GPUs, or 2 on CPU). A CP group
    must sit inside one node or span whole nodes (ranks are node-major), so that the planner's
    hierarchical routing (``cp_nodes > 1``) sees the true node layout.
    """
    environ = os.environ if environ is None else environ
    world = int(environ.get("WORLD_SIZE", "0") or 0)
    if world > 1:
        if cp == 0 and dp == 0:
            cp, dp = world, 1
        elif cp == 0:
            cp = world // dp if world % dp == 0 else 0
        elif dp == 0:
            dp = world // cp if world % cp == 0 else 0
        if dp * cp != world:
            raise ValueError(f"dp x cp must equal the {world} processes torchrun started, got "
                             f"dp={dp or '?'} x cp={cp or '?'}; pass --dp/--cp that multiply "
                             f"to {world} (or 0 to derive one)")
        local = int(environ.get("LOCAL_WORLD_SIZE", str(world)) or world)
        nodes = nodes or max(1, world // local)
    else:
        dp = dp or 1
        if cp == 0:
            total = _local_ranks(device)
            cp = total // dp if total >= dp else 0
            if cp == 0:
                raise ValueError(f"dp={dp} is more than the {total} local ranks")
        if device.type == "cuda" and dp * cp > torch.cuda.device_count():
            raise ValueError(f"dp x cp = {dp * cp} ranks need {dp * cp} GPUs, "
                             f"{torch.cuda.device_count()} visible")
        nodes = nodes or 1
    world = dp * cp
    if world % nodes:
        raise ValueError(f"nodes={nodes} must divide the world of {world} ranks")
    per_node = world // nodes
    if cp > per_node and cp % per_node:
        raise ValueError(f"a CP group of {cp} ranks must span whole nodes of {per_node} ranks")
    if cp < per_node and per_node % cp:
        raise ValueError(f"cp={cp} must divide the {per_node} ranks of a node, so that no CP "
                         "group straddles two nodes")
    return Layout(dp, cp, nodes, max(1, cp // per_node))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn: Callable, world_size: int, device: torch.device, *args,
           layout: Optional[Layout] = None, timeout: float = 600.0):
    """Run ``fn(env, *args)`` on every rank; returns rank 0's result (others: None).

    Under torchrun this process is one rank. Otherwise ``world_size`` local processes are spawned
    (``world_size == 1`` runs in-process without a group). ``layout`` (default: one CP group of
    all ranks) shapes the mesh; ``timeout`` bounds every collective. A rank that raises fails
    the whole launch: see :func:`_join`.
    """
    layout = layout or Layout(1, world_size)
    if layout.world != world_size:
        raise ValueError(f"layout {layout.dp} x {layout.cp} does not match world_size={world_size}")
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        env = init_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device,
                        local_rank=int(os.environ.get("LOCAL_RANK", 0)), layout=layout,
                        timeout=timeout)
        try:
            return fn(env, *args)
        finally:
            dist.destroy_process_group()
    if world_size == 1:
        return fn(DistEnv(0, 1, _rank_device(device, 0), layout=layout), *args)
    import torch.multiprocessing as mp
    port = _free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_spawned_rank, daemon=False,
                         args=(rank, world_size, str(device), port, results, fn, args, layout,
                               timeout))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    return _join(procs, results, grace=timeout + 30.0)


def _join(procs, results, grace: float):
    """Wait for every rank; on a failure give the others ``grace`` seconds to raise on their
    own (a broken collective), then terminate the rest and raise the first error (its type if
    it is a ValueError or TypeError, else RuntimeError), listing what every rank reported."""
    outcome: dict[int, tuple] = {}
    failed_at = None

    def drain(block: float):
        try:
            while True:
                kind, rank, *rest = results.get(timeout=block)
                outcome[rank] = (kind, *rest)
                block = 0.0
        except queue_module.Empty:
            pass

    while any(p.is_alive() for p in procs):
        drain(0.2)
        if failed_at is None and any(o[0] == "error" for o in outcome.values()):
            failed_at = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for p in procs:
                if p.is_alive():
                    p.terminate()
    drain(0.5)
    for p in procs:
        p.join()
    errors = {r: o for r, o in outcome.items() if o[0] == "error"}
    for rank, p in enumerate(procs):
        if p.exitcode != 0 and rank not in errors:
            errors[rank] = ("error", "RuntimeError", f"exited with code {p.exitcode} "
                            "(killed, or terminated after another rank failed)", "", float("inf"))
    if errors:
        first = min(errors, key=lambda r: (errors[r][4], r))
        _, kind, message, tb, _ = errors[first]
        others = "; ".join(f"rank {r}: {errors[r][1]}: {errors[r][2].splitlines()[0][:160]}"
                           for r in sorted(errors) if r != first)
        text = f"rank {first} failed: {message}" + (f" [then {others}]" if others else "")
        exc_type = {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)
        err = exc_type(text)
        err.rank_errors = {r: (e[1], e[2]) for r, e in errors.items()}
        err.remote_traceback = tb
        raise err
    return outcome.get(0, ("ok", None))[1]


def _spawned_rank(rank, world_size, device, port, results, fn, args, layout, timeout):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    env = None
    try:
        env = init_rank(rank, world_size, torch.device(device), local_rank=rank, layout=layout,
                        timeout=timeout)
        result = fn(env, *args)
        results.put(("ok", rank, result if rank == 0 else None))
    except BaseException as exc:  # report, then exit non-zero: the launcher raises
        print(f"[flashmask3] rank {rank}: {traceback.format_exc()}", file=sys.stderr, flush=True)
        results.put(("error", rank, type(exc).__name__, str(exc) or repr(exc),
                     traceback.format_exc(), time.time()))
        raise SystemExit(1) from None
    finally:
        if env is not None and dist.is_initialized():
            dist.destroy_process_group()


def _rank_device(device: torch.device, local_rank: int) -> torch.device:
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return device


def init_rank(rank: int, world_size: int, device: torch.device, local_rank: int = 0,
              layout: Optional[Layout] = None, timeout: float = 600.0) -> DistEnv:
    """Join the default process group (NCCL on GPU, gloo on CPU) and build the mesh.

    Every group gets ``timeout`` (the mesh's groups are made here with it, not with torch's
    30-minute default), so a dead peer cannot block a collective longer than that.
    """
    layout = layout or Layout(1, world_size)
    device = _rank_device(device, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    td = timedelta(seconds=timeout)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=td, **kwargs)
    return mesh_env(device, layout, timeout)


def mesh_env(device: torch.device, layout: Layout, timeout: float = 600.0) -> DistEnv:
    """This rank's :class:`DistEnv` on a new ``("dp", "cp")`` mesh of the initialised world.

    The groups are created here with ``timeout`` (not torch's 30-minute default), every rank
    creating every group in the same order, and wrapped by ``DeviceMesh.from_group``.
    """
    from torch.distributed.device_mesh import DeviceMesh

    world_size, rank = dist.get_world_size(), dist.get_rank()
    if layout.world != world_size:
        raise ValueError(f"layout dp {layout.dp} x cp {layout.cp} does not match the world of "
                         f"{world_size} ranks")
    td = timedelta(seconds=timeout)
    grid = torch.arange(world_size).view(layout.dp, layout.cp)
    mine = {}
    for name, lines in (("cp", grid.tolist()), ("dp", grid.t().tolist())):
        for ranks in lines:
            g = dist.new_group(ranks, timeout=td)
            if rank in ranks:
                mine[name] = g
    mesh = DeviceMesh.from_group([mine["dp"], mine["cp"]], device.type, mesh=grid,
                                 mesh_dim_names=("dp", "cp"))
    shard_mesh = DeviceMesh.from_group(dist.group.WORLD, device.type, mesh_dim_names=("dp_cp",))
    return DistEnv(rank, world_size, device, dist.group.WORLD, layout, mesh, shard_mesh)


# -- the model on the mesh -------------------------------------------------------------------

def shard_model(model: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """FSDP2 over all ranks: each decoder block is one unit (gathered just before it runs,
    freed after), the embedding, final norm and head the root unit. Gradients are summed, not
    averaged, across ranks (each rank's loss is already its share of the global mean)."""
    if env.world_size == 1:
        return model
    from torch.distributed.fsdp import fully_shard
    units = [fully_shard(block, mesh=env.shard_mesh) for block in model.layers]
    units.append(fully_shard(model, mesh=env.shard_mesh))
    for unit in units:  # the setters act on one unit's own parameter group
        unit.set_gradient_divide_factor(1.0)
        if env.device.type != "cuda":
            # factor 1 is NCCL's PREMUL_SUM(1), which gloo lacks: ask for a plain SUM there
            unit.set_force_sum_reduction_for_comms(True)
    return model
