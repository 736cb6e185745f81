"""Which kernels run a call: one table, one function, one environment variable.

:data:`TABLE` maps a call's hardware, head dim, dtype, mask layout and row-span bucket to the
kernel and tile of each pass (forward; fused backward, or the split backward's dK/dV and dQ),
each row with the measurement that put it there (numbers: benchmarks/NOTES.md; the algorithms:
docs/kernels.md). :func:`decide` is a pure function of those keys, cached, so a shape is
decided once; :func:`choose` computes the keys of a call and asks it.

Rows are tried in order; the first row of a pass that matches wins. A Gluon row matches only
on Hopper (``sm90``: compute capability 9.x, TMA descriptors and Gluon available) for 16-bit
inputs, and only where that kernel accepts the tile (its ``check_config``; the forward counts
the mask's columns in shared memory). The ``tl`` rows run everywhere Triton runs.

``FLASHMASK3_KERNELS`` overrides the choice for debugging:

* ``default`` (or unset): the table.
* ``split``: the table, with the split backward (dK/dV, then dQ: no atomics, bitwise
  reproducible) instead of the fused one. ``torch.use_deterministic_algorithms(True)`` does the
  same.
* ``portable``: the ``tl`` kernels only (the kernels every Triton GPU runs), split backward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton

from . import gluon_bwd, gluon_common, gluon_fwd, launcher
from .tiles import Config
from .tl_kernels import TensorDescriptor, _capability, interpreting

ENV_VAR = "FLASHMASK3_KERNELS"
MODES = ("default", "split", "portable")

#: Every pass a call may run: the forward, the fused backward, the split backward's two.
PASSES = ("fwd", "fused", "dkdv", "dq")

#: Whether a pass's live-range plan is per key block (True) or per query block (False).
PLAN_BY_KEY = {"fwd": False, "dkdv": True, "fused": True, "dq": False}


class Row(NamedTuple):
    """One row of :data:`TABLE`: pass, where it applies, what runs, and why."""

    pass_: str
    hardware: str  # "sm90" (Hopper with Gluon and TMA), "any" (every Triton GPU), "interpreter"
    dims: tuple  # head dims
    dtypes: str  # "16bit" (fp16/bf16) or "any"
    span_below: Optional[float]  # the row applies when the mean row span is below this (None: any)
    kernel: str  # see KERNELS
    tile: Config
    reason: str


#: The kernels a row may name: (module that runs it, what it is).
KERNELS = {
    "tl": ("tl_kernels", "the portable tl kernel of the pass"),
    "gluon_ws": ("gluon_fwd", "warp-specialised Gluon forward: TMA producer warp, K/V rings, "
                 "consumer warpgroups of 64 rows"),
    "gluon_ws_pingpong": ("gluon_fwd", "the same with its two warpgroups taking turns (FA3)"),
    "gluon_ws_dkdv": ("gluon_bwd", "warp-specialised Gluon dK/dV"),
    "gluon_ws_dkdv_stats": ("gluon_bwd", "warp-specialised Gluon dK/dV with lse/delta staged in "
                            "shared memory (STATS_SMEM)"),
    "gluon_fused": ("gluon_bwd", "fused Gluon backward (dK/dV + dQ reduce-added per tile, "
                    "P and dS in shared memory: DS_SHARED)"),
}

_C = Config
_INTERP = _C(32, 16, 4, 1)  # several blocks even on 100-token CPU test sequences
_ALL_DIMS = (16, 32, 64, 128, 256)
_SMALL = (16, 32, 64)

#: The dispatch table. H200 measurements, 32K tokens unless said (benchmarks/NOTES.md).
TABLE: tuple[Row, ...] = (
    # --- CPU tests: the Triton interpreter, small tiles
    *(Row(p, "interpreter", _ALL_DIMS, "any", None, "tl", _INTERP,
          "interpreter: small tiles so that short CPU test sequences have several blocks")
      for p in ("fwd", "dkdv", "dq")),
    # --- forward
    Row("fwd", "sm90", (128,), "16bit", 2.0 ** 10.5, "gluon_ws", _C(64, 64, 4, 2),
        "short rows (mean span < 1448): one-warpgroup WS at 64x64 1.13x the default tile on "
        "causal short documents (span 987), 1.01x at 1973, 0.86x at 2903 (session 16)"),
    Row("fwd", "sm90", (128,), "16bit", None, "gluon_ws", _C(128, 128, 8, 2),
        "WS forward 1.00-1.20x tl on every masked layout, 1.04-1.12x causal and full; "
        "ping-pong 0.93-1.04x of without (sessions 13-14)"),
    Row("fwd", "sm90", (256,), "16bit", None, "gluon_ws_pingpong", _C(128, 64, 8, 2),
        "WS forward with ping-pong 1.13-1.26x tl (sessions 13-14)"),
    Row("fwd", "any", _SMALL, "any", 2.0 ** 11, "tl", _C(64, 64, 4, 3),
        "short rows (mean span < 2048) at D<=64: 64x64 s3 1.20x / 1.10x / 1.045x the default "
        "tile on short / document / mixed causal documents (session 16)"),
    Row("fwd", "any", _SMALL, "any", None, "tl", _C(128, 64, 4, 3),
        "the autotuner's pick on all four layouts (v5); the Gluon WS forward at D=64 was "
        "0.91-1.06x tl (session 15), so D=64 keeps tl"),
    Row("fwd", "any", (128,), "any", None, "tl", _C(128, 128, 8, 3),
        "portable D=128 forward: the compiler report's spill-free FA tile (v1-v5)"),
    Row("fwd", "any", (256,), "any", None, "tl", _C(128, 64, 8, 2),
        "autotuner's pick on all four layouts, 1.45-1.58x 128x32 (v6.3)"),
    # --- fused backward (one kernel; dQ reduce-added: not bitwise reproducible)
    Row("fused", "sm90", (128,), "16bit", None, "gluon_fused", _C(64, 128, 8, 2),
        "DS_SHARED fused backward 1.11-1.18x the split backward (v6.5); s2 and s3 within 2%"),
    Row("fused", "sm90", (64,), "16bit", None, "gluon_fused", _C(64, 64, 4, 2),
        "DS_SHARED fused backward at 64x64 w4 1.05-1.15x the split backward (v6.6)"),
    # --- split backward: dK/dV
    Row("dkdv", "sm90", (128,), "16bit", None, "gluon_ws_dkdv_stats", _C(64, 128, 8, 2),
        "WS + STATS_SMEM at 64x128 1.12-1.14x the 32x64 WS kernel, 1.31-1.40x tl (v6.4)"),
    Row("dkdv", "sm90", (256,), "16bit", None, "gluon_ws_dkdv_stats", _C(64, 64, 8, 2),
        "two warpgroups splitting the head dim: 1.61-1.87x tl at the same tile (session 15)"),
    Row("dkdv", "sm90", (64,), "16bit", None, "gluon_ws_dkdv", _C(64, 64, 4, 2),
        "WS dK/dV 1.27-1.49x tl at D=64 (v6.3)"),
    Row("dkdv", "any", _SMALL, "any", None, "tl", _C(64, 64, 4, 2),
        "backward_configs winner at D=64 (v5.1)"),
    Row("dkdv", "any", (128,), "any", None, "tl", _C(32, 64, 4, 3),
        "backward_configs winner at D=128 (v4)"),
    Row("dkdv", "any", (256,), "any", None, "tl", _C(64, 64, 8, 2),
        "backward_configs winner at D=256 (v6.3)"),
    # --- split backward: dQ (the Gluon dQ kernel measured 0.86-1.01x tl and was deleted)
    Row("dq", "any", _SMALL, "any", None, "tl", _C(64, 64, 4, 3),
        "backward_configs winner at D=64 (v5.1)"),
    Row("dq", "any", (128,), "any", None, "tl", _C(128, 64, 8, 3),
        "backward_configs winner at D=128 (v4)"),
    Row("dq", "any", (256,), "any", None, "tl", _C(128, 32, 8, 2),
        "Q, dO in shared memory: 1.7x the 64x64 tile (v6.3)"),
)


@dataclass(frozen=True)
class Launch:
    """One pass of a call: the kernel (a :data:`KERNELS` key), its tile and the table's reason."""

    pass_: str
    kernel: str
    tile: Config
    reason: str


@dataclass(frozen=True)
class Choice:
    """Everything that runs for one call: the forward and the backward's launches."""

    forward: Launch
    backward: tuple  # (fused,) or (dkdv, dq)

    @property
    def backward_mode(self) -> str:
        """"fused" (one kernel, dQ by atomics) or "split" (dK/dV then dQ, reproducible)."""
        return "fused" if self.backward[0].pass_ == "fused" else "split"


#: Test hook: pass -> Config. Runs the ``tl`` kernel of that pass at that tile (after the table).
TILE_OVERRIDE: dict = {}


def mode() -> str:
    """The override of :data:`ENV_VAR` ("default" when unset); "split" under
    ``torch.use_deterministic_algorithms(True)`` unless it says "portable"."""
    env = (os.environ.get(ENV_VAR) or "default").strip().lower()
    if env not in MODES:
        raise ValueError(f"{ENV_VAR} must be one of {list(MODES)} (or unset), got {env!r}")
    if env == "default" and torch.are_deterministic_algorithms_enabled():
        return "split"
    return env


#: The version guard of the table's "sm90" rows: the Triton versions on which the Gluon
#: kernels were run and checked on a GPU (the gpu tests and the kernel benchmark: 3.6.0 with
#: torch 2.11; 3.7.1, 3.8.0 and 3.9.0, torch 2.12.1-2.15's, carried to the GPU machine,
#: benchmarks/results/newer_triton_*.md; 3.7.0, torch 2.12.0's, compiles every kernel to the
#: same SASS as 3.7.1). Gluon is an experimental language whose API and code generation change
#: between releases (3.9 renamed the TMA load and the CTA barrier, and its ptxas spills what
#: 3.6-3.8's kept in registers: gluon_bwd.OPAQUE_INVARIANTS), so on any other version every
#: pass takes its portable tl row (docs/host-path.md: the supported matrix, what was checked
#: how, and how a release joins).
GLUON_CHECKED_TRITON = ("3.6.0", "3.7.0", "3.7.1", "3.8.0", "3.9.0")

#: ``FLASHMASK3_GLUON_UNCHECKED=1`` runs the Gluon kernels on a Triton outside that list: the
#: switch for checking a new release on a GPU (benchmarks/gpu/newer-triton.sh), never a default.
#: Import warns that it is on.
UNCHECKED_VAR = "FLASHMASK3_GLUON_UNCHECKED"


def gluon_forced(version: str = triton.__version__, environ=os.environ) -> bool:
    """Whether ``FLASHMASK3_GLUON_UNCHECKED=1`` turns the Gluon kernels on for ``version``, a
    Triton outside :data:`GLUON_CHECKED_TRITON` (on a checked one it changes nothing)."""
    return environ.get(UNCHECKED_VAR, "0") == "1" and version not in GLUON_CHECKED_TRITON


GLUON_FORCED = gluon_forced()

#: Whether this process's Triton is one of them, or the switch above is on (decided at import).
GLUON_CHECKED_HERE = triton.__version__ in GLUON_CHECKED_TRITON or GLUON_FORCED


#: What the warning adds where the raw C launch is off too (launcher.RAW_LAUNCH_TRITON).
THROUGH_TRITON = " through Triton's own launch path"
#: What the tl path costs on Hopper (fwd+bwd at 32K, D=128, an H100 or H200): a proxy on Triton 3.6
#: (benchmarks/results/newer_torch_path.md) and Tritons 3.7.1 / 3.8.0 / 3.9.0 themselves
#: (newer_triton_*.md). The warning and ``flashmask3 env`` quote it.
TL_PATH_COST = ("on Hopper ~1.2-1.4x slower than the Gluon path, within ~15% of FlexAttention's "
                "speed: docs/host-path.md#supported-versions")


def announce_kernel_path() -> None:
    """Say once (at import) which kernels the Hopper path runs with this Triton: an INFO log
    line (logger "flashmask3") on a checked version, a RuntimeWarning on an unchecked one."""
    if GLUON_FORCED:
        warnings.warn(
            f"flashmask3: {UNCHECKED_VAR}=1: the Gluon kernels run on Triton {triton.__version__}, "
            f"a version they were not checked on ({', '.join(GLUON_CHECKED_TRITON)}): for checking "
            f"that release, not for training", RuntimeWarning, stacklevel=2)
    elif GLUON_CHECKED_HERE:
        logging.getLogger("flashmask3").info(
            "flashmask3: Triton %s: the Gluon kernels (checked on this version) run on Hopper "
            "where the dispatch table picks them, the tl kernels elsewhere", triton.__version__)
    else:
        warnings.warn(
            f"flashmask3: Triton {triton.__version__} is not a version the Gluon kernels were "
            f"checked on ({', '.join(GLUON_CHECKED_TRITON)}): every launch uses the portable tl "
            f"kernels{'' if launcher.RAW_LAUNCH_HERE else THROUGH_TRITON} ({TL_PATH_COST})",
            RuntimeWarning, stacklevel=2)


announce_kernel_path()


def gluon_usable() -> bool:
    """Whether the Gluon kernels may run here: a Triton version they were checked on
    (:data:`GLUON_CHECKED_HERE`), and Gluon and TMA descriptors import."""
    return (GLUON_CHECKED_HERE and gluon_common.unavailable_reason() is None
            and TensorDescriptor is not None)


def hardware(device: torch.device) -> str:
    """The table's hardware key of tensors on ``device``: "interpreter" under
    ``TRITON_INTERPRET=1``, "sm90" on a Hopper GPU where the Gluon kernels can run, else "any"."""
    if interpreting():
        return "interpreter"
    if device.type != "cuda":
        return "any"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return "sm90" if _capability(index)[0] == 9 and gluon_usable() else "any"


def dtype_class(dtype: torch.dtype) -> str:
    """The table's dtype key: "16bit" for float16/bfloat16 (the wgmma operands), else "any"."""
    return "16bit" if dtype in (torch.float16, torch.bfloat16) else "any"


def _accepts(row: Row, head_dim: int, c: int) -> bool:
    """Whether the Gluon kernel of ``row`` accepts its tile at this head dim and mask width."""
    t = row.tile
    try:
        if row.kernel in ("gluon_ws", "gluon_ws_pingpong"):
            cols = c if gluon_fwd._uses_cols_smem(True, c, None) else 0
            gluon_fwd.check_config(head_dim, t.block_m, t.block_n, t.num_warps, t.num_stages,
                                   warp_spec=True, pingpong=row.kernel == "gluon_ws_pingpong",
                                   col_words=cols)
        elif row.kernel == "gluon_fused":
            gluon_bwd.check_config(head_dim, t.block_m, t.block_n, t.num_warps, t.num_stages,
                                   **gluon_bwd.FUSED_VARIANT)
        elif row.kernel.startswith("gluon_ws_dkdv"):
            gluon_bwd.check_config(head_dim, t.block_m, t.block_n, t.num_warps, t.num_stages,
                                   warp_spec=True, stats_smem=row.kernel.endswith("stats"))
    except ValueError:
        return False
    return True


def _matches(row: Row, pass_: str, hw: str, head_dim: int, dtype: str, c: int,
             span: Optional[float], portable: bool) -> bool:
    if row.pass_ != pass_ or head_dim not in row.dims:
        return False
    if row.hardware == "interpreter" or hw == "interpreter":
        return row.hardware == hw
    if row.hardware == "sm90" and (hw != "sm90" or portable or dtype != "16bit"):
        return False
    if row.span_below is not None and (span is None or span >= row.span_below):
        return False
    return row.kernel == "tl" or _accepts(row, head_dim, c)


def _first(pass_: str, *keys) -> Optional[Launch]:
    for row in TABLE:
        if _matches(row, pass_, *keys):
            return Launch(pass_, row.kernel, row.tile, row.reason)
    return None


@functools.lru_cache(maxsize=None)
def decide(hw: str, head_dim: int, dtype: str, causal: bool, c: int, span: Optional[float],
           mode_: str = "default") -> Choice:
    """The :class:`Choice` of a call (pure and cached): hardware key (:func:`hardware`), head
    dim, dtype key (:func:`dtype_class`), mask layout (causal, C columns; 0 without a mask),
    the mask's mean row span as its half-octave bucket (None: unknown), and :func:`mode`.
    ``causal`` is part of the layout key although no row depends on it today."""
    if head_dim not in _ALL_DIMS:
        raise ValueError(f"head_dim must be one of {_ALL_DIMS} for the Triton kernels, got {head_dim}")
    if mode_ not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode_!r}")
    portable = mode_ == "portable"
    keys = (hw, head_dim, dtype, c, span, portable)
    fwd = _first("fwd", *keys)
    fused = None if mode_ != "default" else _first("fused", *keys[:4], None, portable)
    backward = (fused,) if fused is not None else (
        _first("dkdv", *keys[:4], None, portable), _first("dq", *keys[:4], None, portable))
    return Choice(fwd, backward)


def _overridden(launch: Launch) -> Launch:
    tile = TILE_OVERRIDE.get(launch.pass_)
    return launch if tile is None else Launch(launch.pass_, "tl", tile, "TILE_OVERRIDE")


def choose(device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool, c: int,
           row_span: Optional[float] = None) -> Choice:
    """The kernels that run a call with inputs on ``device`` of ``dtype`` and head dim
    ``head_dim``, a mask of ``c`` columns (0: none), ``row_span`` its bucketed mean row span."""
    choice = decide(hardware(device), head_dim, dtype_class(dtype), bool(causal), int(c),
                    None if row_span is None else float(row_span), mode())
    if not TILE_OVERRIDE:
        return choice
    if "fused" in TILE_OVERRIDE or (choice.backward_mode == "fused"
                                    and {"dkdv", "dq"} & set(TILE_OVERRIDE)):
        raise ValueError("TILE_OVERRIDE runs tl kernels: set 'dkdv'/'dq' with the split "
                         f"backward ({ENV_VAR}=split), not 'fused'")
    return Choice(_overridden(choice.forward), tuple(_overridden(x) for x in choice.backward))


def backward_mode(like: Optional[torch.Tensor] = None) -> str:
    """"fused" or "split": the backward a call with tensors like ``like`` (e.g. q) runs; "split"
    without ``like``. The fused backward is not bitwise reproducible (dQ by atomics)."""
    if like is None:
        return "split"
    c = 0
    return choose(like.device, like.dtype, like.shape[-1], True, c).backward_mode


@contextlib.contextmanager
def use_backward(mode_: str):
    """Run the block (and processes started from it) with the "split" backward or the table's
    ("fused": fused where the table has a fused row), by setting :data:`ENV_VAR`; "auto" unsets
    it. ``portable`` stays portable; deterministic mode still gives split. Restored after."""
    if mode_ not in ("auto", "fused", "split"):
        raise ValueError(f"mode must be 'auto', 'fused' or 'split', got {mode_!r}")
    old = os.environ.get(ENV_VAR)
    if (old or "").strip().lower() != "portable":
        if mode_ == "auto":
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = "split" if mode_ == "split" else "default"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = old


#: The most waves of grouped dK/dV programs (one per SM) for which expanding K/V pays: measured on
#: one H200 at real context-parallel stage calls (benchmarks/results/gqa_expand_ab.json, "stages":
#: 8K rows, 32/4 heads): grids of 1-4 waves gained 1.04-1.75x, grids of 6-9 waves lost 8-11% (the
#: copies, and eight times the programs' fixed cost, outweigh the better balance).
KV_EXPANSION_MAX_WAVES = 4


def kv_expansion(programs: int, group: int, sms: int,
                 max_waves: Optional[int] = KV_EXPANSION_MAX_WAVES) -> bool:
    """Whether a GQA dK/dV launch of ``programs`` programs (one per key block and KV head, each
    looping over ``group`` query heads) runs with each group split over one program per query
    head (the kernels' KV_SPLIT; "expanded": the grid of an MHA call with ``Hq`` KV heads): when
    the grouped grid is at most :data:`KV_EXPANSION_MAX_WAVES` waves over ``sms`` SMs (one
    program per SM) and the expanded grid (``group`` times the programs, one head each) needs
    fewer waves of one head than the grouped grid's waves of ``group`` heads: few programs
    leave SMs idle, and a ragged last wave of ``group``-head programs idles the rest of the GPU
    for a whole group's work (``triton_backend.splits_kv_groups``; the scale model uses the same
    rule; it also predicts with ``max_waves=None``, the same rule without the cap)."""
    if group <= 1:
        return False
    waves = -(-programs // sms)
    return ((max_waves is None or waves <= max_waves)
            and -(-programs * group // sms) < group * waves)


def describe(choice: Choice) -> str:
    """One line per pass: kernel, tile and reason (for logs and benchmark reports)."""
    lines = []
    for launch in (choice.forward,) + tuple(choice.backward):
        t = launch.tile
        lines.append(f"{launch.pass_}: {launch.kernel} {t.block_m}x{t.block_n} w{t.num_warps} "
                     f"s{t.num_stages} ({launch.reason})")
    return "\n".join(lines)
