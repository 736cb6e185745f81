"""The training loop: packed documents -> model -> AdamW, with CP, checkpoints and a summary.

``train(cfg)`` validates the configuration in the calling process (so bad input fails before any
process is spawned), then runs :func:`run_rank` on every rank of the ``dp x cp`` mesh (see
:mod:`.parallel`). Each step:

1. the loader (:mod:`.loader`, a background thread) has already packed this DP group's rows of
   the next global batch, built its mask and CP plan, and copied this rank's shard to the device;
2. forward/backward (bf16 autocast on GPU) of the FSDP2-sharded model; the loss of each rank is
   its share ``Σ_local CE / (targets in the global batch)`` (the target count: one all-reduce),
   so the gradients summed over all ranks by FSDP2's reduce-scatter equal the single-process
   gradients, and the logged loss is the same for every ``dp x cp``;
3. gradient clipping, AdamW with linear warm-up + cosine decay;
4. periodic checkpoints (full state dicts, data position of every row stream, RNG states), so a
   resumed run, on any mesh, repeats the uninterrupted run's losses.

At the end rank 0 writes ``summary.json``, ``losses.csv``, ``loss.png`` and prints the throughput
summary (tokens/s, model TFLOP/s, attention share of the step time, mask sparsity).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from flashmask3.masks import with_window

from .attention import AttentionTimer, attention_available, make_attention
from .checkpoint import (checkpoint_dir, latest_checkpoint, load_checkpoint, restore_state,
                         save_checkpoint)
from .config import TrainConfig
from .data import make_packer, mask_picture, mask_sparsity
from .graphed import GraphedStep, check_graphable
from .loader import BatchLoader, DeviceBatch
from .model import (StepContext, Transformer, active_matmul_params, loss_terms,
                    model_flops_per_step, parameter_counts)
from .parallel import DistEnv, Layout, launch, resolve_device, resolve_layout, shard_model


# -- entry point --------------------------------------------------------------------------------

def train(cfg: TrainConfig) -> Optional[dict]:
    """Run the training described by ``cfg`` on all its ranks; returns rank 0's summary."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
    cfg.validate()
    device = resolve_device(cfg.device)
    layout = resolve_layout(cfg.cp, cfg.dp, cfg.nodes, device)
    if cfg.batch_size % layout.dp:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by dp ({layout.dp}): "
                         "it is the global batch, split over the data-parallel groups")
    if layout.cp > 1 and cfg.attention != "flashmask3":
        raise ValueError(f"attention={cfg.attention!r} has no context-parallel path; "
                         "use --attention flashmask3 with --cp > 1")
    if layout.cp > 1:
        _check_cp_chunking(cfg, layout)
    reason = attention_available(cfg.attention, device)
    if reason:
        raise ValueError(f"attention={cfg.attention!r} cannot run: {reason}")
    if cfg.cuda_graph and (reason := check_graphable(cfg, layout.world, device)):
        raise ValueError(f"cuda_graph cannot run: {reason}")
    packer = make_packer(cfg)  # fail here, not in N spawned ranks, on bad data or checkpoints
    if cfg.resume and (path := latest_checkpoint(cfg.out_dir)) is not None:
        ckpt = load_checkpoint(path, cfg.to_dict())
        packer.load_state_dict(ckpt["data"])
        if ckpt["step"] >= cfg.steps:
            print(f"[flashmask3] {cfg.out_dir} already holds a finished run (step "
                  f"{ckpt['step']} of {cfg.steps}); nothing to do. Pass --no-resume to start "
                  f"over or --out-dir for a new run.", flush=True)
            summary = Path(cfg.out_dir) / "summary.json"
            return json.loads(summary.read_text()) if summary.is_file() else None
    elif not cfg.resume:
        _remove_old_checkpoints(cfg.out_dir)
    with _triton_backward(cfg.attention_backward):
        return launch(run_rank, layout.world, device, cfg, layout=layout,
                      timeout=cfg.dist_timeout)


@contextlib.contextmanager
def _triton_backward(choice: str):
    """The Triton kernel's backward for this run (its environment switch, which spawned ranks
    inherit), restored afterwards; "auto" leaves the library's choice."""
    if choice == "auto":
        yield
        return
    from flashmask3.kernels.dispatch import use_backward
    with use_backward(choice):
        yield


def _remove_old_checkpoints(out_dir) -> None:
    """A fresh start (--no-resume) drops this harness's old step_*.pt files from ``out_dir``, so
    a later resume cannot pick up a stale run."""
    d = checkpoint_dir(out_dir)
    old = sorted(d.glob("step_*.pt")) if d.is_dir() else []
    for path in old:
        path.unlink(missing_ok=True)  # torchrun: every rank runs this
    if old:
        print(f"[flashmask3] starting over: removed {len(old)} old checkpoint(s) from {d}",
              flush=True)


def _check_cp_chunking(cfg: TrainConfig, layout: Layout) -> None:
    """Fail early (in the launching process) if seq_len cannot be chunked over the CP group."""
    from flashmask3.distributed import plan
    cp = layout.cp
    if cfg.seq_len % cp:
        raise ValueError(f"seq_len ({cfg.seq_len}) must be divisible by cp ({cp})")
    try:
        plan(None, True, cp, balance=cfg.balance, seqlen=cfg.seq_len,
             chunk_size=cfg.chunk_size or None, nodes=layout.cp_nodes)
    except ValueError as exc:
        raise ValueError(f"seq_len={cfg.seq_len}, cp={cp}, balance={cfg.balance}: {exc}") from None


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr · min_lr_ratio`` at ``steps``."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW (fused kernel on GPU); weight decay on matrices only (not on norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    on_gpu = decay[0].is_cuda
    impl = {"fused": True} if on_gpu else {"foreach": True}
    if cfg.cuda_graph:  # its step state on the device, safe to capture (graphed.GraphedStep)
        impl["capturable"] = True
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **impl)


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> Optional[torch.dtype]:
    """bf16 autocast on GPU by default, none (fp32) on CPU."""
    if cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def timed_attention(cfg: TrainConfig) -> bool:
    """Whether the run times its attention: ``time_attention``, except under ``compile`` and
    ``cuda_graph`` (its marks cannot sit inside a compiled or captured graph)."""
    return cfg.time_attention and not cfg.compile and not cfg.cuda_graph


# -- one step ----------------------------------------------------------------------------------

def train_step(model, optimizer, batch: DeviceBatch, cfg: TrainConfig, env: DistEnv,
               timer: AttentionTimer, lr: float) -> dict:
    """Forward, backward (FSDP2 sums the gradients over all ranks), clipping, optimiser step.
    Returns metrics (their ``float()`` is the step's one host synchronisation)."""
    out = step_tensors(model, optimizer, batch, cfg, env, timer, lr)
    plan = batch.plan
    return {**{k: float(v) for k, v in out.items()},
            "imbalance": float(plan.imbalance) if plan is not None else None}


def step_tensors(model, optimizer, batch: DeviceBatch, cfg: TrainConfig, env: DistEnv,
                 timer: AttentionTimer, lr) -> dict:
    """The step itself, without a host synchronisation: its metrics as device tensors
    (``loss``, ``total_loss``, ``grad_norm``). ``lr``: a number, or the device tensor a captured
    step reads (:mod:`.graphed`)."""
    attention, window_attention = step_attention(batch, cfg, env)
    ctx = StepContext(timer.wrap(attention), num_tokens=batch.num_tokens,
                      all_reduce=env.all_reduce_sum,
                      window_attention=None if window_attention is None else timer.wrap(window_attention))
    targets = env.all_reduce_sum(batch.label_count)  # targets in the global batch (on device)
    amp = autocast_dtype(cfg, env.device)
    # a captured step must not keep autocast's casts of the weights across the capture
    autocast = (torch.autocast(env.device.type, dtype=amp, cache_enabled=not cfg.cuda_graph) if amp
                else contextlib.nullcontext())
    with autocast:
        total, ce = loss_terms(model, batch.tokens, batch.labels, batch.position_ids, ctx,
                               targets, cfg.moe_aux_coef if cfg.moe_experts else 0.0)
    optimizer.zero_grad(set_to_none=True)
    with torch.autograd.set_multithreading_enabled(cfg.autograd_thread == "device"):
        total.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    loss = env.all_reduce_sum(torch.stack([ce.detach().float(), total.detach().float()]))
    return {"loss": loss[0], "total_loss": loss[1], "grad_norm": grad_norm}


def step_attention(batch: DeviceBatch, cfg: TrainConfig, env: DistEnv):
    """The attention callables of this step, ``(full layers, sliding-window layers or None)``:
    over the CP group from the batch's plan (the window layers: its windowed plan, on the same
    placement), or the selected backend on the batch's (device) mask (the window layers: the
    mask limited to the window, ``masks.with_window``)."""
    windowed = any(cfg.windowed_layers())
    if batch.plan is not None:
        from .attention import make_cp_attention
        args = (batch.plan, env.cp_group, cfg.comm, cfg.backward_calls, cfg.keep_kv)
        return make_cp_attention(*args), make_cp_attention(*args, cfg.sliding_window) if windowed else None
    dtype = autocast_dtype(cfg, env.device) or torch.float32
    full = make_attention(cfg.attention, batch.mask, dtype) if not all(cfg.windowed_layers()) else None
    window = make_attention(cfg.attention, with_window(batch.mask, cfg.sliding_window), dtype) if windowed else None
    return full, window


# -- the run on one rank ------------------------------------------------------------------------

def data_rows(cfg: TrainConfig, env: DistEnv) -> range:
    """The rows of the global batch this rank's data-parallel group trains on."""
    per_group = cfg.batch_size // env.dp
    return range(env.dp_rank * per_group, (env.dp_rank + 1) * per_group)


def run_rank(env: DistEnv, cfg: TrainConfig) -> dict:
    """The training loop on one rank; rank 0 returns (and writes) the summary."""
    torch.manual_seed(cfg.seed)
    with torch.device(env.device):  # initialised in place (same seed: same weights per rank)
        model = Transformer(cfg)
    if cfg.compile:
        model.compile_blocks()
    model = shard_model(model, env)
    optimizer = build_optimizer(model, cfg)
    packer = make_packer(cfg, data_rows(cfg, env))
    history = {"step": [], "loss": [], "lr": [], "grad_norm": [], "step_time": [],
               "attention_time": [], "sparsity": []}
    start = _maybe_resume(cfg, model, optimizer, packer, history, env)
    out_dir = Path(cfg.out_dir)
    if env.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(cfg.to_json())
        _print_header(cfg, model, env, packer, start, _peek(packer))
    timer = AttentionTimer(env.device, timed_attention(cfg))
    graphed = None
    if cfg.cuda_graph:  # the whole step replayed from one CUDA graph (captured on the first batch)
        graphed = GraphedStep(model, optimizer, lambda m, o, b, lr: step_tensors(m, o, b, cfg, env, timer, lr))
    bar = _progress(cfg, env, start)
    stats = RunStats(cfg, env)
    end = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps
    loader = BatchLoader(packer, cfg, env, prefetch=cfg.prefetch) if end > start else None
    try:
        for step in range(start + 1, end + 1):
            t0 = time.perf_counter()  # with --no-prefetch the step also packs and plans
            batch = loader.next()
            lr = lr_at(step, cfg)
            if graphed is not None:
                metrics = {**graphed(batch, lr), "imbalance": None}
            else:
                metrics = train_step(model, optimizer, batch, cfg, env, timer, lr)
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            step_time = time.perf_counter() - t0
            attn_time = timer.collect()
            sparsity = mask_sparsity(batch.host.mask)
            stats.add(step - start, batch.host, step_time, attn_time, metrics["imbalance"])
            for key, value in (("step", step), ("loss", metrics["loss"]), ("lr", lr),
                               ("grad_norm", metrics["grad_norm"]), ("step_time", step_time),
                               ("attention_time", attn_time), ("sparsity", sparsity["sparsity"])):
                history[key].append(value)
            _report(bar, env, cfg, step, metrics, batch.num_tokens / step_time)
            if cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
                _checkpoint(cfg, env, step, model, optimizer, batch.data_state, history)
    finally:
        if loader is not None:
            loader.close()
    if bar is not None:
        bar.close()
    stats.reduce()  # collective: every rank
    if not env.is_main:
        return None
    summary = stats.summary(model, history, start, packer)
    _write_outputs(cfg, history, summary)
    return summary


def _maybe_resume(cfg, model, optimizer, packer, history, env) -> int:
    """Load the latest checkpoint of ``out_dir`` if resuming (rank 0 reads it, the others get
    it broadcast); returns the step to continue from."""
    state = restore_state(cfg.out_dir if cfg.resume else None, cfg.to_dict(), model, optimizer,
                          env)
    if state is None:
        return 0
    packer.load_state_dict(state["data"])
    for key in history:
        history[key].extend(state["history"].get(key, []))
    if env.is_main:
        print(f"[flashmask3] resumed from {state['path']} (step {state['step']})", flush=True)
    return int(state["step"])


def _peek(packer):
    """The next batch, without moving the data position."""
    state = packer.state_dict()
    batch = packer.next_batch()
    packer.load_state_dict(state)
    return batch


def _merged_data_state(data_state: dict, env: DistEnv) -> dict:
    """The data position of every row stream of the global batch (each DP group holds its own
    rows; one all_gather_object at checkpoint time)."""
    if env.group is None:
        return data_state
    states = [None] * env.world_size
    dist.all_gather_object(states, data_state)
    merged = dict(data_state, streams={})
    for s in states:
        merged["streams"].update(s["streams"])
    return merged


def _checkpoint(cfg, env, step, model, optimizer, data_state, history) -> None:
    save_checkpoint(cfg.out_dir, step, model, optimizer, _merged_data_state(data_state, env),
                    cfg.to_dict(), history, env)
    env.barrier()


# -- reporting ----------------------------------------------------------------------------------

def _progress(cfg, env, start):
    """The main rank's progress bar, drawn only on a terminal (``disable=None``): in a log file
    or a pipe the periodic step lines of :func:`_report` say the same without carriage returns."""
    if not (env.is_main and cfg.progress):
        return None
    from tqdm import tqdm
    return tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
                mininterval=1.0, disable=None, file=sys.stderr)


def _report(bar, env, cfg, step, metrics, tokens_per_s) -> None:
    if not env.is_main:
        return
    if bar is not None:
        # refresh=False: the bar redraws at most once a second (mininterval), not every step
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        bar.update(1)
    if step % cfg.log_every == 0 or step == 1:
        line = (f"step {step:5d}/{cfg.steps}  loss {metrics['loss']:.4f}  "
                f"grad_norm {metrics['grad_norm']:.3f}  tokens/s {tokens_per_s:,.0f}")
        if bar is not None:
            bar.write(line)
        else:
            print(line, flush=True)


def _print_header(cfg, model, env, packer, start, first_batch=None) -> None:
    counts = parameter_counts(cfg)
    n_params = counts["total"]
    ffn = (f"MoE {cfg.moe_experts} experts top-{cfg.moe_top_k} ({counts['active'] / 1e6:.2f}M "
           f"active)" if cfg.moe_experts else f"SwiGLU {cfg.resolved_ffn_dim()}")
    backend = "nccl" if env.device.type == "cuda" else "gloo"
    lay = env.layout
    cp_text = (f"context parallel over {lay.cp} ranks per group (balance={cfg.balance}, "
               f"comm={cfg.comm}, backward_calls={cfg.backward_calls}" + (f", hierarchical over {lay.cp_nodes} nodes)"
                                     if lay.cp_nodes > 1 else ")") if lay.cp > 1 else "no CP")
    par = (f"mesh dp {lay.dp} x cp {lay.cp} = {env.world_size} {backend} ranks, FSDP2 over all; "
           f"{cp_text}" if env.world_size > 1 else "single rank (no CP)")
    windows = (f"; sliding window {cfg.sliding_window} on {sum(cfg.windowed_layers())} of {cfg.n_layers} layers"
               if cfg.sliding_window else "")
    print(f"[flashmask3] model: {n_params / 1e6:.2f}M params, {cfg.n_layers} layers, dim "
          f"{cfg.dim}, heads {cfg.n_heads}/{cfg.n_kv_heads} (GQA), {ffn}{windows}", flush=True)
    print(f"[flashmask3] data: {cfg.data} ({len(packer.corpus)} documents), {cfg.batch_size} x "
          f"{cfg.seq_len} byte tokens/step, mask {cfg.mask}", flush=True)
    print(f"[flashmask3] {par}; attention={cfg.attention}; device={env.device}; "
          f"steps {start + 1}..{cfg.steps}" + ("; blocks compiled (attention not timed)" if cfg.compile else ""),
          flush=True)
    if first_batch is not None:
        lens = first_batch.doc_lens[0]
        stats = mask_sparsity(first_batch.mask)
        picture = mask_picture(first_batch.mask, cells=min(16, cfg.seq_len))
        print(f"[flashmask3] first sequence: {len(lens)} documents {lens[:12]}"
              f"{' ...' if len(lens) > 12 else ''}; the mask skips "
              f"{100 * stats['sparsity']:.1f}% of (query, key) pairs. Tiles "
              f"({'#'} computed, + masked element-wise, . skipped):", flush=True)
        print("\n".join("    " + line for line in picture.splitlines()), flush=True)


class RunStats:
    """Throughput accounting over the steps after the warm-up ones."""

    def __init__(self, cfg, env):
        self.cfg, self.env = cfg, env
        self.time = self.attn_time = self.flops = 0.0
        self.tokens = self.steps = 0
        self.pairs = self.causal_pairs = self.all_pairs = 0
        self.imbalance: list[float] = []

    def add(self, run_step: int, batch: PackedBatch, step_time: float, attn_time: float,
            imbalance: Optional[float] = None) -> None:
        mask = batch.mask
        if imbalance is not None:
            self.imbalance.append(imbalance)
        s = mask.seqlen_q
        pairs = mask.unmasked_pairs()
        self.pairs += pairs
        self.all_pairs += mask.batch_size * mask.num_heads * s * s
        self.causal_pairs += mask.batch_size * mask.num_heads * s * (s + 1) // 2
        if run_step <= self.cfg.warmup_exclude:
            return
        attn = mask.flops(self.cfg.n_heads, self.cfg.head_dim, "fwd_bwd")
        window = (with_window(mask, self.cfg.sliding_window).flops(self.cfg.n_heads, self.cfg.head_dim, "fwd_bwd")
                  if self.cfg.sliding_window else None)
        self.flops += model_flops_per_step(self.cfg, batch.tokens.numel(), attn, window)
        self.time += step_time
        self.attn_time += attn_time
        self.tokens += batch.tokens.numel()
        self.steps += 1

    def reduce(self) -> None:
        """Sum the mask statistics of all DP groups (each CP rank of a group counted them
        alike): one all-reduce at the end of the run, on every rank."""
        if self.env.group is None:
            return
        t = torch.tensor([self.flops, self.pairs, self.causal_pairs, self.all_pairs],
                         dtype=torch.float64, device=self.env.device)
        t = self.env.all_reduce_sum(t).cpu() / self.env.cp
        self.flops, self.pairs, self.causal_pairs, self.all_pairs = (float(x) for x in t)
        self.tokens = self.steps * self.cfg.batch_size * self.cfg.seq_len

    def summary(self, model, history, start, packer) -> dict:
        cfg, env = self.cfg, self.env
        losses = history["loss"]
        k = max(1, min(10, len(losses) // 5))
        out = {
            "steps_run": len(losses) - len([s for s in history["step"] if s <= start]),
            "final_step": history["step"][-1] if history["step"] else start,
            "loss_first": sum(losses[:k]) / k if losses else float("nan"),
            "loss_last": sum(losses[-k:]) / k if losses else float("nan"),
            "params": parameter_counts(cfg)["total"],
            "active_params": parameter_counts(cfg)["active"],
            "dp": env.dp, "cp": env.cp, "cp_nodes": env.layout.cp_nodes,
            "prefetch": cfg.prefetch,
            "active_matmul_params": active_matmul_params(cfg),
            "world_size": env.world_size, "device": str(env.device),
            "attention": cfg.attention, "balance": cfg.balance, "comm": cfg.comm,
            "backward_calls": cfg.backward_calls, "keep_kv": cfg.keep_kv,
            "mask": cfg.mask, "seq_len": cfg.seq_len, "batch_size": cfg.batch_size,
            "mask_sparsity": 1 - self.pairs / self.all_pairs if self.all_pairs else 0.0,
            "mask_skipped_vs_causal": (1 - self.pairs / self.causal_pairs
                                       if self.causal_pairs else 0.0),
            "measured_steps": self.steps,
            "cp_imbalance": (sum(self.imbalance) / len(self.imbalance)
                             if self.imbalance else None),
            "data_epoch": packer.epoch,
        }
        if self.steps:
            out.update({
                "tokens_per_s": self.tokens / self.time,
                "model_tflops": self.flops / self.time / 1e12,
                "model_tflops_per_device": self.flops / self.time / 1e12 / env.world_size,
                "attention_share": self.attn_time / self.time if timed_attention(cfg) else None,
                "step_time_s": self.time / self.steps,
            })
        return out


def format_summary(s: dict) -> str:
    """The human-readable end-of-run summary."""
    lines = ["", "== flashmask3 training summary ==",
             f"loss           {s['loss_first']:.3f} -> {s['loss_last']:.3f} "
             f"(mean of first/last steps, through step {s['final_step']})",
             f"mask           {s['mask']}: {100 * s['mask_sparsity']:.1f}% of (query, key) pairs "
             f"skipped, {100 * s['mask_skipped_vs_causal']:.1f}% fewer than plain causal"]
    if s.get("tokens_per_s"):
        share = s.get("attention_share")
        lines += [
            f"throughput     {s['tokens_per_s']:,.0f} tokens/s over {s['measured_steps']} steps "
            f"({s['step_time_s'] * 1000:.0f} ms/step), {s['world_size']} rank(s) on {s['device']}",
            f"model FLOP/s   {s['model_tflops']:.4g} TFLOP/s total, "
            f"{s['model_tflops_per_device']:.4g} per device",
            f"attention      {'n/a' if share is None else f'{100 * share:.1f}% of step time'} "
            f"(backend {s['attention']}"
            + (f", CP balance={s['balance']} comm={s['comm']})" if s.get("cp", 1) > 1 else ")"),
        ]
    if s.get("cp_imbalance") is not None:
        lines.append(f"CP balance     attention work max/mean over ranks {s['cp_imbalance']:.3f} "
                     f"({s['balance']}; 1.0 = perfect)")
    return "\n".join(lines)


def _write_outputs(cfg, history, summary) -> None:
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    with open(out_dir / "losses.csv", "w") as fh:
        fh.write("step,loss,lr,grad_norm,step_time,attention_time,sparsity\n")
        for row in zip(*(history[k] for k in ("step", "loss", "lr", "grad_norm", "step_time",
                                              "attention_time", "sparsity"))):
            fh.write(",".join(repr(v) for v in row) + "\n")  # full precision
    if cfg.plot and history["step"]:
        from .plotting import plot_loss
        summary["loss_png"] = str(plot_loss(history, out_dir / "loss.png", summary))
    print(format_summary(summary), flush=True)
    print(f"outputs        {out_dir}/ (summary.json, losses.csv"
          + (", loss.png" if cfg.plot else "") + ", checkpoints/)", flush=True)
