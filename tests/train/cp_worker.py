"""Rank bodies for the mesh tests: several trainings, on several meshes, in one launch."""

from flashmask3.train import trainer
from flashmask3.train.parallel import Layout, mesh_env


def run_layouts(env, jobs):
    """``jobs``: ``[((dp, cp), [configs])]``. Each mesh is built on the launched world, then its
    configs train in turn; rank 0 returns the summaries in order."""
    out = []
    for (dp, cp), configs in jobs:
        sub = mesh_env(env.device, Layout(dp, cp), timeout=120.0)
        out += [trainer.run_rank(sub, cfg) for cfg in configs]
    return out


def fail_on_rank(env, cfg, rank, step):
    """Train ``cfg``; rank ``rank`` raises when it reaches ``step``."""
    real = trainer.train_step
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if env.rank == rank and len(calls) == step:
            raise RuntimeError(f"injected failure on rank {rank}")
        return real(*args, **kwargs)

    trainer.train_step = failing
    return trainer.run_rank(env, cfg)
