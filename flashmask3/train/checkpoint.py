"""Checkpoints: model, optimiser, data position, RNG states and the loss history, in one file.

Files are ``<out_dir>/checkpoints/step_<N>.pt``, written atomically (temporary file, fsync,
rename) by rank 0. The model and optimiser are saved as *full* state dicts (keyed by parameter
name): ``torch.distributed.checkpoint.state_dict`` gathers the FSDP2 shards to rank 0 (on the
CPU) when saving and broadcasts them from rank 0 and re-shards them when loading, so one file
resumes on any ``dp x cp`` mesh (or one process). The price is that rank 0 holds the whole
model and optimiser state in host memory while saving: right for the models this harness
trains (up to a few billion parameters); a sharded ``torch.distributed.checkpoint`` save would
be the next step for larger ones. ``load_checkpoint`` checks the format, the keys and the model
shape and turns any failure into a ValueError naming the file.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import zipfile
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .config import MODEL_FIELDS

FORMAT = "flashmask3-train-checkpoint"
VERSION = 2  # 2: full state dicts keyed by name, per-row data streams
REQUIRED_KEYS = ("format", "version", "step", "model", "optimizer", "data", "rng", "config",
                 "history")
_NAME = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_dir(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / "checkpoints"


def checkpoint_path(out_dir, step: int) -> Path:
    return checkpoint_dir(out_dir) / f"step_{step:08d}.pt"


def latest_checkpoint(out_dir) -> Optional[Path]:
    """The checkpoint with the highest step in ``out_dir``, or None."""
    d = checkpoint_dir(out_dir)
    if not d.is_dir():
        return None
    steps = sorted(int(m.group(1)) for p in d.iterdir() if (m := _NAME.match(p.name)))
    return checkpoint_path(out_dir, steps[-1]) if steps else None


# -- RNG ----------------------------------------------------------------------------------------

def rng_state() -> dict:
    """Every RNG the run could draw from, in torch.load(weights_only=True)-safe types."""
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                       int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"][:torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(cuda)


def _as_tuple(x):
    return tuple(_as_tuple(i) for i in x) if isinstance(x, (list, tuple)) else x


# -- save / load --------------------------------------------------------------------------------

def _options(env, **kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    distributed = env is not None and env.group is not None
    return StateDictOptions(full_state_dict=True, cpu_offload=distributed, **kw)


def save_checkpoint(out_dir, step: int, model, optimizer, data_state: dict, config: dict,
                    history: dict, env=None) -> Optional[Path]:
    """Write ``step_<step>.pt`` atomically (rank 0); returns its path (None on other ranks).

    A collective when distributed: every rank must call it (the shards are gathered).
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(env))
    if env is not None and not env.is_main:
        return None
    path = checkpoint_path(out_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, "step": step,
               "model": model_state, "optimizer": optim_state,
               "data": data_state, "rng": rng_state(), "config": config, "history": history}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        torch.save(payload, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def restore_state(out_dir, config: dict, model, optimizer, env) -> Optional[dict]:
    """Resume from ``out_dir``'s latest checkpoint (None: no checkpoint or ``out_dir=None``).

    Every rank reads the file (memory-mapped, so the ranks of a node share its pages) and takes
    its shard of the full state (``set_state_dict(full_state_dict=True)``), so ``out_dir`` must
    be on storage all nodes see; the ranks first check (one all-reduce) that they found the
    same checkpoint, and raise together if not. Returns ``{"step", "data", "history", "path"}``.
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict
    path = latest_checkpoint(out_dir) if out_dir is not None else None
    step = -1 if path is None else int(_NAME.match(path.name).group(1))
    if env.group is not None:
        seen = torch.tensor([step, -step], dtype=torch.int64, device=env.device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=env.group)
        if int(seen[0]) != step or -int(seen[1]) != step:
            raise ValueError(f"the ranks found different latest checkpoints in {str(out_dir)!r} "
                             f"(this rank: step {step}, others up to {int(seen[0])}); out_dir "
                             "must be on storage every node sees")
    if path is None:
        return None
    ckpt = load_checkpoint(path, config)
    set_state_dict(model, optimizer, model_state_dict=ckpt["model"],
                   optim_state_dict=ckpt["optimizer"], options=_options(env))
    set_rng_state(ckpt["rng"])
    return {"step": ckpt["step"], "data": ckpt["data"], "history": ckpt["history"],
            "path": str(path)}


def load_checkpoint(path, config: Optional[dict] = None) -> dict:
    """Read and check a checkpoint. ``config``: the run's config, whose model fields must match.

    Raises ValueError (naming ``path``) when the file is missing, truncated, not a checkpoint
    of this harness, or for a model of another shape.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint {str(path)!r} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError,
            zipfile.BadZipFile, AttributeError, KeyError, IndexError) as exc:
        raise ValueError(f"checkpoint {str(path)!r} is corrupt or not a torch checkpoint: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                         ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"checkpoint {str(path)!r} is not a flashmask3 training checkpoint")
    missing = [k for k in REQUIRED_KEYS if k not in payload]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} is incomplete: missing {missing}")
    if payload["version"] != VERSION:
        raise ValueError(f"checkpoint {str(path)!r} has format version {payload['version']}, "
                         f"this code reads version {VERSION}")
    if config is not None:
        diff = {k: (payload["config"].get(k), config.get(k)) for k in MODEL_FIELDS
                if payload["config"].get(k) != config.get(k)}
        if diff:
            raise ValueError(f"checkpoint {str(path)!r} is for a different model "
                             f"(field: saved vs requested) {diff}")
    return payload
