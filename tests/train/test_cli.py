"""The command line and the configuration: flags, presets, outputs, clear errors."""

import json
import os

import pytest

from flashmask3.train.cli import main
from flashmask3.train.config import PRESETS, TrainConfig, from_preset


def test_train_command_writes_summary_curve_and_checkpoints(tmp_path, jsonl_corpus, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--preset", "tiny", "--data", jsonl_corpus, "--out-dir", str(out),
               "--steps", "5", "--checkpoint-every", "5", "--plot", "--mask", "prefix_document"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_step"] == 5 and summary["mask"] == "prefix_document"
    assert summary["tokens_per_s"] > 0 and summary["model_tflops"] > 0
    assert 0 < summary["attention_share"] < 1
    assert 0 < summary["mask_sparsity"] < 1
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "checkpoints" / "step_00000005.pt").is_file()
    text = capsys.readouterr().out
    assert "training summary" in text and "tokens/s" in text and "TFLOP/s" in text
    assert "% of (query, key) pairs skipped" in text


def test_progress_bar_stays_out_of_a_log_file(tmp_path, jsonl_corpus, capsys):
    """With --progress but no terminal (pytest captures the streams), the bar draws nothing:
    no carriage-return frames in the log, and the periodic step lines still arrive."""
    rc = main(["train", "--preset", "tiny", "--data", jsonl_corpus, "--steps", "3", "--no-plot",
               "--log-every", "1", "--progress", "--out-dir", str(tmp_path / "run")])
    assert rc == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "step/s" not in captured.err
    assert [line.split()[1] for line in captured.out.splitlines()
            if line.startswith("step ")] == ["1/3", "2/3", "3/3"]


def test_attention_backward_flag_selects_the_triton_backward(tmp_path, jsonl_corpus, monkeypatch):
    """--attention-backward reaches the kernel's switch (FLASHMASK3_KERNELS) while the ranks
    are launched, and the caller's environment is restored afterwards; auto leaves it alone."""
    from flashmask3.train import trainer

    seen = []
    real_launch = trainer.launch

    def recording_launch(*args, **kwargs):
        seen.append(os.environ.get("FLASHMASK3_KERNELS"))
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(trainer, "launch", recording_launch)
    monkeypatch.setenv("FLASHMASK3_KERNELS", "split")
    base = ["train", "--preset", "tiny", "--data", jsonl_corpus, "--steps", "1", "--no-plot",
            "--checkpoint-every", "0"]
    assert main(base + ["--out-dir", str(tmp_path / "a")]) == 0
    assert main(base + ["--out-dir", str(tmp_path / "b"), "--attention-backward", "fused"]) == 0
    assert seen == ["split", "default"]
    assert os.environ["FLASHMASK3_KERNELS"] == "split"
    monkeypatch.delenv("FLASHMASK3_KERNELS")
    assert main(base + ["--out-dir", str(tmp_path / "c"), "--attention-backward", "fused"]) == 0
    assert seen[-1] == "default" and "FLASHMASK3_KERNELS" not in os.environ


def test_autograd_thread_flag_says_where_the_backward_runs(tmp_path, jsonl_corpus, monkeypatch):
    """--autograd-thread reaches the step's backward: the calling thread by default, torch's
    per-device threads with ``device``; torch's own setting is restored after the step."""
    import torch

    from flashmask3.train import trainer

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(torch._C._is_multithreading_enabled())
            return grad

    real = trainer.loss_terms

    def probed(*args, **kwargs):
        total, ce = real(*args, **kwargs)
        return Probe.apply(total), ce

    monkeypatch.setattr(trainer, "loss_terms", probed)
    base = ["train", "--preset", "tiny", "--data", jsonl_corpus, "--steps", "1", "--no-plot",
            "--checkpoint-every", "0"]
    assert main(base + ["--out-dir", str(tmp_path / "a")]) == 0
    assert main(base + ["--out-dir", str(tmp_path / "b"), "--autograd-thread", "device"]) == 0
    assert seen == [False, True]
    assert torch._C._is_multithreading_enabled()


def test_data_command_reports_sparsity(jsonl_corpus, capsys):
    assert main(["data", "--data", jsonl_corpus, "--seq-len", "128", "--batches", "3"]) == 0
    assert "mask sparsity" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["train", "--preset", "tiny", "--dim", "30"], "dim (30) must be divisible by n_heads"),
    (["train", "--preset", "tiny", "--steps", "0"], "steps must be > 0"),
    (["train", "--preset", "tiny", "--data", "/no/such/dir"], "does not exist"),
    (["train", "--preset", "tiny", "--attention", "flex", "--device", "cpu"],
     "FlexAttention has no backward on CPU"),
    (["train", "--preset", "tiny", "--moe-experts", "2", "--moe-top-k", "3"], "moe_top_k"),
    (["train", "--preset", "tiny", "--cuda-graph", "--device", "cpu"],
     "cuda_graph cannot run: it needs a CUDA device"),
])
def test_bad_settings_exit_with_a_clear_message(argv, message, capsys, tmp_path):
    assert main(argv + ["--out-dir", str(tmp_path / "x")]) == 2
    assert message in capsys.readouterr().err


def test_unknown_choices_are_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--balance", "zigzag"])
    assert "invalid choice" in capsys.readouterr().err


def test_config_validation_names_the_field():
    with pytest.raises(TypeError, match="seq_len must be int"):
        TrainConfig(seq_len="1024")
    with pytest.raises(ValueError, match="mask must be one of"):
        TrainConfig(mask="diagonal")
    with pytest.raises(ValueError, match="attention_backward must be one of"):
        TrainConfig(attention_backward="atomic")
    with pytest.raises(ValueError, match="n_heads .* divisible by n_kv_heads"):
        TrainConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="preset must be one of"):
        from_preset("huge")
    with pytest.raises(ValueError, match="unknown config field"):
        from_preset("tiny", layers=3)
    assert all(isinstance(from_preset(name), TrainConfig) for name in PRESETS)
    assert from_preset("demo").cp == 0  # the demo picks its ranks (2 CPU / all GPUs)
