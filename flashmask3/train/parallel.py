"""Process groups, launching and the context-parallel plumbing of the training loop.

Launch modes, chosen automatically:

* under ``torchrun`` (``WORLD_SIZE`` set): one process per rank already exists; join the group;
* ``cp == 1``: run in this process, no process group;
* ``cp > 1`` otherwise: spawn ``cp`` local processes (gloo on CPU, NCCL with one GPU each).

All ranks form one context-parallel group. Every rank packs the same global batch (cheap, and
no broadcast needed), builds the same plan from its mask, and keeps its own token shard. Because
everything but attention is token-local, the parameter gradients of the ranks are partial sums
of the single-rank gradient: one all-reduce (sum) makes them equal to it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    """Where this process sits: rank, world size, device, and the CP group (None: no CP)."""

    rank: int
    world_size: int
    device: torch.device
    group: Optional[object] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over the group (a new tensor; identity without a group)."""
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


def resolve_cp(cp: int, device: torch.device) -> int:
    """``cp=0`` means: the visible GPUs (the largest power of two of them, so that sequence
    lengths split evenly), or 2 CPU ranks without a GPU."""
    if cp:
        under_torchrun = "WORLD_SIZE" in os.environ
        if device.type == "cuda" and cp > torch.cuda.device_count() and not under_torchrun:
            raise ValueError(f"cp={cp} needs {cp} GPUs, {torch.cuda.device_count()} visible")
        return cp
    if device.type != "cuda":
        return 2
    return 1 << (max(1, torch.cuda.device_count()).bit_length() - 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn: Callable, world_size: int, device: torch.device, *args) -> list:
    """Run ``fn(env, *args)`` on every rank; returns rank 0's result (others: None).

    Under torchrun this process is one rank. Otherwise ``world_size`` local processes are spawned
    (``world_size == 1`` runs in-process without a group).
    """
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        env = init_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device,
                        local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        try:
            return fn(env, *args)
        finally:
            dist.destroy_process_group()
    if world_size == 1:
        return fn(DistEnv(0, 1, _rank_device(device, 0)), *args)
    import torch.multiprocessing as mp
    port = _free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_spawned_rank, args=(world_size, str(device), port, queue, fn, args),
                       nprocs=world_size, join=True, start_method="spawn")
    return queue.get() if not queue.empty() else None


def _spawned_rank(rank, world_size, device, port, queue, fn, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    env = init_rank(rank, world_size, torch.device(device), local_rank=rank)
    try:
        result = fn(env, *args)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def _rank_device(device: torch.device, local_rank: int) -> torch.device:
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return device


def init_rank(rank: int, world_size: int, device: torch.device, local_rank: int = 0) -> DistEnv:
    """Join the default process group (NCCL on GPU, gloo on CPU); CPU ranks share the cores."""
    device = _rank_device(device, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    return DistEnv(rank, world_size, device, dist.group.WORLD)


# -- gradients ---------------------------------------------------------------------------------

def all_reduce_gradients(params, env: DistEnv) -> None:
    """Sum every gradient over the CP group, in one flat buffer per dtype."""
    if env.group is None:
        return
    grads = [p.grad for p in params if p.grad is not None]
    by_dtype: dict = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=env.group)
        offset = 0
        for g in group:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


# -- context-parallel sharding --------------------------------------------------------------------

class CPShard:
    """This rank's slice of a global batch and the attention callable over the CP group."""

    def __init__(self, batch, cfg, env: DistEnv):
        from flashmask3.distributed import plan as make_plan

        from .attention import make_cp_attention
        mask = batch.mask
        kwargs = {"balance": cfg.balance}
        if cfg.chunk_size:
            kwargs["chunk_size"] = cfg.chunk_size
        self.plan = make_plan(mask.startend_row_indices, mask.causal, env.world_size, **kwargs)
        r = env.rank
        self.tokens = self.plan.shard(batch.tokens, r, 1)
        self.labels = self.plan.shard(batch.labels, r, 1)
        self.position_ids = self.plan.shard(batch.position_ids, r, 1)
        self.attention = make_cp_attention(self.plan, env.group, cfg.comm)
