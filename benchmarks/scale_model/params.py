"""Cluster parameters of the scale model, each with where it comes from.

Every number carries a ``source`` string that says whether it was **measured** (on this
project's H200, with the file), **published** (vendor figure, with the document) or
**assumed** (no measurement possible here; swept in the sensitivity table).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

GB = 1e9


@dataclass(frozen=True)
class Param:
    """A value and its provenance ("measured: ...", "published: ...", "assumed: ...")."""

    value: float
    source: str

    def scaled(self, factor: float) -> "Param":
        return Param(self.value * factor, f"{self.source} (x{factor:g})")


#: The default of :attr:`Cluster.matmul_efficiency`: the measured matmul throughput is used as
#: measured at this value and scaled by ``matmul_efficiency / MATMUL_EFFICIENCY`` otherwise.
MATMUL_EFFICIENCY = 0.75

#: The CP runtime's op bandwidths (bytes/s) by rate class (runtime_ops.RATE_CLASSES) on each GPU
#: model it was profiled on: ``validate.validate_cp_runtime`` fits them (least squares over the
#: profiled ranks of the fit cp sizes, 3 us a launch) and ``tests/benchmarks/scale_model`` checks
#: that these constants are still that fit of the committed files. They differ by GPU because the
#: copies and fills are bound by memory bandwidth (H100 3.35, H200 4.8 TB/s by the datasheets;
#: measured, the H100's copies run at ~75% of the H200's); the small-index and scatter kernels are
#: not, and run about as fast on both.
RUNTIME_FITS = {
    "H200": {"copy": 4.25e12, "small_index": 0.91e12, "scatter": 1.38e12, "fill": 3.14e12,
             "source": "cp 8/32 ranks of cp_runtime_breakdown.json (one H200, 2026-12-04); held out: "
                       "its cp 16/64/128 ranks and cp_graph.json"},
    "H100": {"copy": 3.18e12, "small_index": 0.97e12, "scatter": 1.41e12, "fill": 2.46e12,
             "source": "cp 32 ranks of cp_ptrr.json (one H100 80GB HBM3, 2026-12-07); held out: its "
                       "cp 16/64/128 ranks"},
}


#: The :class:`Cluster` field of each rate class's bandwidth.
RUNTIME_BW_FIELDS = {"copy": "runtime_copy_bw", "small_index": "runtime_small_index_bw",
                     "scatter": "runtime_scatter_bw", "fill": "runtime_fill_bw"}


def runtime_fit_of(gpu_name: str) -> dict:
    """The runtime op bandwidths by rate class fitted on ``gpu_name``'s model (``"NVIDIA H200"``,
    ``"NVIDIA H100 80GB HBM3"``, ...); a GPU we have no fit for raises ``ValueError``."""
    for model, fit in RUNTIME_FITS.items():
        if model in (gpu_name or ""):
            return {c: fit[c] for c in RUNTIME_BW_FIELDS}
    raise ValueError(f"no runtime op bandwidths fitted for GPU {gpu_name!r} (have: {', '.join(RUNTIME_FITS)})")


@dataclass(frozen=True)
class Cluster:
    """Links, GPU and host of one cluster. Bandwidths in bytes/s, times in seconds."""

    name: str = "H100 SXM, 8 GPUs/node, 8x400 Gb/s InfiniBand (one NIC per GPU)"
    gpus_per_node: int = 8
    nvlink_bw: Param = Param(450 * GB, "published: NVLink 4 = 900 GB/s bidirectional per GPU "
                             "(NVIDIA H100/H200 SXM datasheets) -> 450 GB/s per direction")
    ib_bw: Param = Param(50 * GB, "published: 400 Gb/s NDR InfiniBand (ConnectX-7), one NIC per "
                         "GPU (NVIDIA DGX H100 user guide) -> 50 GB/s per direction per GPU")
    link_efficiency: Param = Param(0.8, "assumed: achieved / peak bandwidth of NCCL point-to-point "
                                   "and ring collectives (nccl-tests typically reach 0.75-0.9)")
    nvlink_latency: Param = Param(3e-6, "assumed: per-message NVLink latency ('a few us')")
    ib_latency: Param = Param(6e-6, "assumed: per-message InfiniBand latency incl. GPUDirect RDMA "
                              "setup ('a few us')")
    msg_overhead: Param = Param(1e-6, "assumed: port time per message (NCCL work item) on top of "
                                "bytes / bandwidth")
    comm_sm_share: Param = Param(0.08, "assumed: fraction of the GPU's SMs NCCL kernels occupy "
                                 "while a transfer is active (~8-16 of 132 SMs)")
    runtime_copy_bw: Param = Param(RUNTIME_FITS["H100"]["copy"],
                                   "fitted on the H100: the CP runtime's own contiguous copies and gathers "
                                   "(torch's vectorized gather, clone; the runtime's merge, key-gather, pack "
                                   "and gradient-sum kernels), recorded from the real runtime "
                                   "(RUNTIME_FITS['H100']: cp 32 ranks of cp_ptrr.json, one fit with the three "
                                   "classes below and 3 us a launch; held out, cp 16/64/128)")
    runtime_small_index_bw: Param = Param(RUNTIME_FITS["H100"]["small_index"],
                                          "fitted on the H100 (same fit): torch's index_select of <= 16 rows "
                                          "(its small-index kernel, runtime_ops.SMALL_INDEX_ROWS)")
    runtime_scatter_bw: Param = Param(RUNTIME_FITS["H100"]["scatter"],
                                      "fitted on the H100 (same fit): indexed writes and strided copies "
                                      "(index_copy_, index_add_, stack)")
    runtime_fill_bw: Param = Param(RUNTIME_FITS["H100"]["fill"],
                                   "fitted on the H100 (same fit): write-only ops (zeros, fills), bytes written")
    hbm_bw: Param = Param(4.3e12, "measured: device copy ~4.3 TB/s on the H200 "
                          "(benchmarks/NOTES.md 'Ceilings'); elementwise merges and casts")
    matmul_tflops: Param = Param(790.0, "measured: dense bf16 matmul ~790 TFLOP/s on the H200 "
                                 "(benchmarks/NOTES.md 'Ceilings')")
    matmul_efficiency: Param = Param(MATMUL_EFFICIENCY, "assumed: achieved / dense-ceiling matmul "
                                     "throughput at the model's MLP/expert shapes (grouped expert GEMMs) "
                                     "until benchmarks/gpu/scale-model.sh has measured them; with the "
                                     "measurement, its ratio to this default scales the measured throughput "
                                     "(the sensitivity sweep)")
    nonmatmul_share: Param = Param(0.15, "assumed: norms, activations, rotary, router, token "
                                   "permutation as a fraction of the matmul time")
    host_op: Param = Param(7e-6, "assumed: host time per eager PyTorch op that launches work "
                           "(dispatch + launch, 5-10 us on a server CPU)")
    gpu_scale: Param = Param(1.0, "measured: one H100 ran 299 of the H200 calibration's calls at a median "
                             "0.99x (forward) / 1.02x (forward+backward) their H200 GPU time "
                             "(scale_model_attention_h100.json, 2026-12-07 16:30); the backward's memory-bound "
                             "per-query-block passes run at the GPU's copy bandwidth instead "
                             "(validate.memory_scaled, x1.34 on an H100)")
    dp_overlap: Param = Param(0.8, "assumed: share of the data-parallel gradient reduction that "
                              "overlaps with the last micro-batch's backward")

    def with_(self, **changes) -> "Cluster":
        return dataclasses.replace(self, **changes)

    def swept(self, name: str, factor: float) -> "Cluster":
        """A copy with parameter ``name`` scaled by ``factor`` (the 0.5x-2x sweep); fractions
        (efficiencies, shares) are capped at 1."""
        p = getattr(self, name).scaled(factor)
        if name in FRACTIONS and p.value > 1.0:
            p = Param(1.0, p.source + " (capped at 1)")
        return dataclasses.replace(self, **{name: p})

    def params(self) -> dict[str, Param]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), Param)}

    def on_gpu(self, model: str) -> "Cluster":
        """A copy whose runtime-op bandwidths are those fitted on GPU ``model`` ("H100", "H200":
        :data:`RUNTIME_FITS`); the links and the kernels' speed stay as they are."""
        if model not in RUNTIME_FITS:
            raise ValueError(f"gpu must be one of {sorted(RUNTIME_FITS)}, got {model!r}")
        fit = RUNTIME_FITS[model]
        src = f"fitted on the {model}: {fit['source']}"
        return dataclasses.replace(self, name=self.name.replace("H100", model),
                                   **{f: Param(fit[c], src) for c, f in RUNTIME_BW_FIELDS.items()})

    def runtime_bandwidths(self) -> dict:
        """The CP runtime's op bandwidths by rate class (runtime_ops.RATE_CLASSES)."""
        return {c: getattr(self, f).value for c, f in RUNTIME_BW_FIELDS.items()}

    def p2p_bw(self, same_node: bool) -> float:
        bw = self.nvlink_bw.value if same_node else self.ib_bw.value
        return bw * self.link_efficiency.value

    def latency(self, same_node: bool) -> float:
        return self.nvlink_latency.value if same_node else self.ib_latency.value


#: Parameters that are fractions (a sweep caps them at 1).
FRACTIONS = ("link_efficiency", "matmul_efficiency", "comm_sm_share", "nonmatmul_share", "dp_overlap")

#: The link parameters swept 0.5x-2x in the sensitivity table.
SWEPT = ("nvlink_bw", "ib_bw", "nvlink_latency", "ib_latency", "comm_sm_share", "host_op",
         "matmul_efficiency", "runtime_copy_bw")


@dataclass(frozen=True)
class Runtime:
    """What the context-parallel runtime costs on the host and in small device ops.

    ``lean``: the cp-runtime target (issue 22): at most 64 launches per layer forward+backward
    outside the attention kernels. ``current``: the runtime on main before that rewrite, whose
    op counts grow with messages and chunks: ``20 + 14/stage-pass + 8/message + 1/received
    chunk`` per layer forward+backward (the ops of attention.py/comm.py on main: a stack and a
    buffer per message each way, a cat/contiguous/merge per stage, per-chunk gradient
    accumulation), which gives 260-350 at cp 8 and 760-3,100 at cp 128 on the 128K document
    spreads, against issue 22's counts of 170-330 and 1,000-2,500.
    """

    kind: str = "lean"
    lean_ops: int = 64
    ops_per_stage: int = field(default=14)
    ops_per_message: int = field(default=8)
    ops_per_chunk: int = field(default=1)
    #: the overlapped backward's attention calls (timeline.BWD_CALLS): ``"stage"`` one
    #: ``backward_stage`` call per stage as its K/V arrives (the runtime now); ``"one"`` one call
    #: per layer over every needed key once all K/V arrived, the dK/dV returns after it (exposed);
    #: ``"one+local"`` the remote keys' call first, its returns in flight during the own keys' call;
    #: ``"auto"`` (default) the runtime's rule per plan (flashmask3.distributed.program
    #: .auto_backward_calls), so the model predicts what the runtime runs by default
    bwd_calls: str = "auto"
    #: the overlapped backward reuses the K/V the forward received (the runtime's ``keep_kv``,
    #: default True): no K/V rounds in the backward, only the gradient returns; False: the
    #: backward fetches them again by the forward's rounds
    keep_kv: bool = True

    def host_ops(self, stages: int, messages: int, chunks: int, attention_calls: int) -> int:
        """Host ops of one layer's attention forward+backward (launches of any kind)."""
        if self.kind == "lean":
            return self.lean_ops + 2 * attention_calls
        if self.kind != "current":
            raise ValueError(f"runtime kind must be 'lean' or 'current', got {self.kind!r}")
        return (20 + self.ops_per_stage * stages + self.ops_per_message * messages
                + self.ops_per_chunk * chunks)
