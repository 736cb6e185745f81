"""The batch loader: packing, masks, CP plans and device copies off the training step.

:func:`prepare_batch` turns one packed batch (this data-parallel group's rows) into what a step
needs on the device: with context parallelism it plans from the group's mask (hierarchically
when the CP group spans nodes), keeps this rank's shard of tokens, labels and position ids
(``plan.shard``), and builds the rank's device program (:func:`prepare_plan_for_rank`);
without, it moves the mask. Host tensors are pinned and copied with ``non_blocking=True``.

:class:`BatchLoader` runs ``packer.next_batch()`` + :func:`prepare_batch` for the *next* batch
in a background thread (on GPU on its own CUDA stream; the step's stream waits on an event, so
the host never blocks) while the current step runs, the CP plan itself in a worker process on a
GPU (:class:`ProcessPlanner`: a planning thread would hold the GIL the step's host path needs);
``prefetch=False`` does the same work inside the step, the comparison
``benchmarks/train.py --loader-ab`` measures.
"""

from __future__ import annotations

import pickle
import queue
import sys
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from flashmask3.distributed.plan import to_device_pinned
from flashmask3.masks import FlashMask

from .data import IGNORE_INDEX, PackedBatch


@dataclass
class DeviceBatch:
    """One step's inputs on this rank's device, and what the step reports about them."""

    tokens: torch.Tensor          # [b, S/cp] this rank's tokens
    labels: torch.Tensor          # [b, S/cp]
    position_ids: torch.Tensor    # [b, S/cp] global (per-document) positions
    label_count: torch.Tensor     # float32 scalar: this rank's targets
    num_tokens: int               # tokens of the global batch (all DP groups)
    mask: Optional[FlashMask]     # the group's mask on the device (None with CP)
    plan: Optional[object]        # the group's CPPlan (None without CP)
    host: PackedBatch             # the host batch (documents, mask: statistics only)
    data_state: dict              # the packer's state right after this batch
    ready: Optional[object] = None  # CUDA event: the copies are done (loader stream)

    def wait(self) -> None:
        """Make the current CUDA stream wait for the loader's copies (device-side only)."""
        if self.ready is None:
            return
        stream = torch.cuda.current_stream(self.tokens.device)
        stream.wait_event(self.ready)
        for t in (self.tokens, self.labels, self.position_ids, self.label_count):
            t.record_stream(stream)
        if self.mask is not None:
            self.mask.startend_row_indices.record_stream(stream)
        self.ready = None


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: pinned and copied asynchronously for a GPU, as is on the CPU
    (:func:`flashmask3.distributed.plan.to_device_pinned`)."""
    return to_device_pinned(t, device, [])


def prepare_plan_for_rank(plan, rank: int, device: torch.device, comm: str, backward_calls: str = "auto",
                          window: int = 0):
    """Everything ``cp_flashmask_attention`` needs for ``rank`` of ``plan``, on ``device``: the
    CP runtime's per-rank device program (:func:`flashmask3.distributed.prepare_rank`, cached on
    the plan, so the step's attention calls find it ready and copy nothing per layer); with a
    sliding ``window`` (> 0) also the windowed plan's (``CPPlan.windowed``, cached on the plan)."""
    from flashmask3.distributed import prepare_rank

    if window:
        prepare_rank(plan.windowed(window), rank, device, comm, backward_calls)
    return prepare_rank(plan, rank, device, comm, backward_calls)


def _plan_args(mask: FlashMask, cfg, env) -> tuple:
    """``(columns, causal, cp, keyword arguments)`` of a DP group's ``plan()`` call."""
    kwargs = {"balance": cfg.balance, "nodes": env.layout.cp_nodes}
    if cfg.chunk_size:
        kwargs["chunk_size"] = cfg.chunk_size
    return mask.startend_row_indices, mask.causal, env.cp, kwargs


def make_group_plan(mask: FlashMask, cfg, env):
    """The CP plan of a DP group's mask: same on every rank of the group; hierarchical routing
    (``nodes``) when the CP group spans several nodes."""
    from flashmask3.distributed import plan as make_plan
    cols, causal, cp, kwargs = _plan_args(mask, cfg, env)
    return make_plan(cols, causal, cp, **kwargs)


class ProcessPlanner:
    """:func:`make_group_plan` in a worker process (:mod:`.plan_worker`, a Python interpreter of
    its own: no CUDA, nothing of the training script imported), so planning the next batch never
    holds the training process's GIL: in a thread it does, and the step's eager host path
    (host-bound at high cp) waits for it. Measured on the H200 machine (``benchmarks/results/
    cp_planner_contention.md``): 24 eager CP layers of a cp-128 rank took 62.1 ms alone, 134.1 ms
    while a thread planned the next 128K-token batch and 64.8 ms while this worker did. The
    plan comes back pickled (2-8 MB at cp 128 and 128K tokens, mostly the mask's columns;
    unpickled in 1-2 ms on the development VM, since a plan's routing is arrays). An error
    ``plan()`` raises in the worker is raised by the call, as the thread's would be; a worker
    that died is a RuntimeError with what it printed. One caller at a time (the loader's
    thread)."""

    def __init__(self):
        import subprocess
        import tempfile

        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, "-m", "flashmask3.train.plan_worker"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr)

    def plan(self, cols, causal, cp: int, **kwargs):
        """``flashmask3.distributed.plan(cols, causal, cp, **kwargs)``, run in the worker."""
        try:
            pickle.dump((cols, causal, cp, kwargs), self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._proc.stdin.flush()
            ok, value = pickle.load(self._proc.stdout)
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            raise RuntimeError(f"the planning worker process died (exit code {self._proc.poll()}): "
                               f"{self._worker_output()}") from exc
        if not ok:
            raise value
        return value

    def __call__(self, mask: FlashMask, cfg, env):
        cols, causal, cp, kwargs = _plan_args(mask, cfg, env)
        return self.plan(cols, causal, cp, **kwargs)

    def _worker_output(self) -> str:
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace").strip()
        return text[-2000:] or "(it printed nothing)"

    def close(self) -> None:
        """End the worker (its input closes; killed if it does not exit within 5 s)."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - a worker that does not exit is killed
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()


def uses_plan_process(cfg, env) -> bool:
    """Whether :class:`BatchLoader` plans in a worker process (``cfg.planner``; ``auto``: on a
    GPU with context parallelism and the loader's thread, where the step's host path is what
    planning would slow; on the CPU a worker process only costs its start)."""
    if env.cp <= 1 or not cfg.prefetch:
        return False
    if cfg.planner == "auto":
        return env.device.type == "cuda"
    return cfg.planner == "process"


def prepare_batch(batch: PackedBatch, cfg, env, data_state: Optional[dict] = None,
                  planner=None) -> DeviceBatch:
    """This rank's device inputs for ``batch`` (see the module doc); ``planner``: what makes
    the CP plan (default :func:`make_group_plan` in this thread; a :class:`ProcessPlanner`)."""
    dev = env.device
    tokens, labels, positions = batch.tokens, batch.labels, batch.position_ids
    plan, mask = None, None
    if env.cp > 1:
        plan = (planner or make_group_plan)(batch.mask, cfg, env)
        r = env.cp_rank
        tokens, labels, positions = (plan.shard(t, r, 1) for t in (tokens, labels, positions))
        prepare_plan_for_rank(plan, r, dev, cfg.comm, cfg.backward_calls, cfg.sliding_window)
    else:
        m = batch.mask
        # checked when the batch's mask was built: no second value check on the device (a sync)
        mask = FlashMask(to_device(m.startend_row_indices, dev), m.causal, m.seqlen_q,
                         m.mean_row_span, _validated=True)
    count = torch.tensor(float((labels != IGNORE_INDEX).sum()), dtype=torch.float32)
    return DeviceBatch(to_device(tokens, dev), to_device(labels, dev), to_device(positions, dev),
                       to_device(count, dev), cfg.batch_size * cfg.seq_len, mask, plan, batch,
                       data_state if data_state is not None else {})


class BatchLoader:
    """Yields :class:`DeviceBatch` es from ``packer``, one batch ahead in a background thread
    (``prefetch=True``) or built on demand (``prefetch=False``).

    An exception in the thread is raised by the next :meth:`next` call. :meth:`close` stops the
    thread (it is a daemon, so a crashing run never waits for it) and the planning process, if
    any (:func:`uses_plan_process`).
    """

    def __init__(self, packer, cfg, env, prefetch: bool = True):
        self.packer, self.cfg, self.env, self.prefetch = packer, cfg, env, prefetch
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = None
        self._planner = ProcessPlanner() if uses_plan_process(cfg.replace(prefetch=prefetch), env) else None
        if prefetch:
            self._thread = threading.Thread(target=self._run, name="flashmask3-loader",
                                            daemon=True)
            self._thread.start()

    def _build(self) -> DeviceBatch:
        batch = self.packer.next_batch()
        return prepare_batch(batch, self.cfg, self.env, self.packer.state_dict(), self._planner)

    def _run(self) -> None:
        cuda = self.env.device.type == "cuda"
        stream = torch.cuda.Stream(self.env.device) if cuda else None
        try:
            if cuda:
                torch.cuda.set_device(self.env.device)
            while not self._stop.is_set():
                if cuda:
                    with torch.cuda.stream(stream):
                        item = self._build()
                        item.ready = torch.cuda.Event()
                        item.ready.record(stream)
                else:
                    item = self._build()
                self._put(item)
        except BaseException as exc:  # hand it to the training thread
            self._put(exc)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> DeviceBatch:
        """The next batch, its copies ordered before the current stream's work."""
        if not self.prefetch:
            item = self._build()
        else:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
        item.wait()
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._planner is not None:
            self._planner.close()
