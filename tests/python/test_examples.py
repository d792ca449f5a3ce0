"""The examples run to the end (they check their own results)."""
import os
import subprocess
import sys

import pytest

EX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python")


@pytest.mark.parametrize("args", [
    ["async_pipeline.py", "--batches", "200"],
    ["async_infer_client.py", "--spawn-server", "--clients", "2", "--requests", "20"],
])
def test_async_example_runs(args):
    r = subprocess.run([sys.executable, os.path.join(EX, args[0])] + args[1:],
                       capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "batches/s" in r.stdout or "served 2 clients, 40 requests" in r.stdout, r.stdout


def test_gpu_dataloader_example():
    """The GPU producer/training example, over cuda-ipc; it exits 3 (skipped)
    where PyTorch has no CUDA or the library sees no GPU."""
    r = subprocess.run([sys.executable, os.path.join(EX, "gpu_dataloader.py"),
                        "--batches", "100"],
                       capture_output=True, text=True, timeout=180, env=os.environ.copy())
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "trained on 100 GPU batches over cuda-ipc" in r.stdout, r.stdout


def test_weights_broadcast_example():
    """One trainer broadcasts loaned weight buffers to 3 replica processes;
    the example checks every replica got every version, in order, and ends
    with the trainer's weights."""
    r = subprocess.run([sys.executable, os.path.join(EX, "weights_broadcast.py"), "--replicas",
                        "3", "--steps", "20"],
                       capture_output=True, text=True, timeout=240, env=os.environ.copy())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 replicas got 20 weight versions" in r.stdout, r.stdout
