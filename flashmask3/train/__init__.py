"""Full-training harness: packed real documents, masks, context parallelism, throughput.

Entry points: ``flashmask3 demo|train|data`` (:mod:`.cli`) and :func:`train` with a
:class:`TrainConfig`. The attention kernel (``attention``) and the distributed layer
(``cp``, ``balance``, ``comm``) are configuration fields, so either is swapped by a flag.
"""

from .config import PRESETS, TrainConfig, from_preset

__all__ = ["PRESETS", "TrainConfig", "from_preset", "train"]


def train(cfg):
    """Run a training (see :func:`flashmask3.train.trainer.train`)."""
    from .trainer import train as _train
    return _train(cfg)
