"""The packed fine-tuning example runs a few steps end to end on the CPU."""

import importlib.util
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_packed_finetune.py")


def load_example():
    spec = importlib.util.spec_from_file_location("hf_packed_finetune", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_trains_on_packed_documents(tmp_path):
    threads = torch.get_num_threads()
    example = load_example()
    plot = tmp_path / "loss.png"
    try:
        result = example.main(["--steps", "4", "--tokens", "512", "--max-doc-len", "128",
                               "--device", "cpu", "--plot", str(plot)])
    finally:
        torch.set_num_threads(threads)
    assert plot.stat().st_size > 0
    saved = json.loads((tmp_path / "loss.json").read_text())
    assert saved["losses"] == result["losses"] and len(result["losses"]) == 4
    assert result["documents"] > 4  # several documents per packed batch
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["losses"][-1] < result["losses"][0]  # it learns (random init: ~ln 256 first)


def test_document_batches_are_real_text_adding_up_to_the_batch():
    example = load_example()
    features = next(example.document_batches(300, 64))
    assert sum(len(f["input_ids"]) for f in features) == 300
    assert all(1 <= len(f["input_ids"]) <= 64 for f in features)
    text = bytes(t for f in features for t in f["input_ids"])
    assert sum(32 <= c < 127 or c in (9, 10) for c in text) > 0.8 * len(text)


def test_example_under_torchrun_trains_context_parallel_as_one_process(tmp_path):
    """Two gloo processes (each its tokens of every batch, ``flashmask_cp=``), the model under
    ``torch.compile``, give the losses of the same steps in one eager process."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = ["--steps", "3", "--tokens", "512", "--max-doc-len", "128", "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_INTERPRET")}
    env.update(PYTHONPATH=root, CUDA_VISIBLE_DEVICES="", FLASHMASK3_BACKEND="torch", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           EXAMPLE, *args, "--compile", "--plot", str(tmp_path / "cp.png")]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cp = json.loads((tmp_path / "cp.json").read_text())
    assert cp["context_parallel"] == 2
    threads = torch.get_num_threads()
    try:
        one = load_example().main(args + ["--plot", str(tmp_path / "one.png")])
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(torch.tensor(cp["losses"]), torch.tensor(one["losses"]), rtol=1e-4, atol=1e-5)
