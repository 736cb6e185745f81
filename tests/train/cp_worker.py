"""Rank body for the CP tests: run several trainings inside one 2-rank gloo group."""

from flashmask3.train.trainer import run_rank


def run_configs(env, configs):
    """Train every config in turn on this rank; rank 0 returns the summaries."""
    return [run_rank(env, cfg) for cfg in configs]
