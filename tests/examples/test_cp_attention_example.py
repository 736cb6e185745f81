"""examples/cp_attention.py runs as the README says: torchrun, 2 gloo processes on the CPU."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cp_example_runs_under_torchrun_with_two_cpu_processes():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_INTERPRET")}
    env.update(PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", FLASHMASK3_BACKEND="torch",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", os.path.join(ROOT, "examples", "cp_attention.py")]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "cp_size=2: output (1, 512, 4, 64)" in run.stdout, run.stdout
