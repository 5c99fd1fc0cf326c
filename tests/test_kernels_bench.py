"""engine_proc.kernels_bench without a GPU: the no-GPU message, the interpreter check, and the
whole-model decode-step table (eager vs graph replay) on a tiny model."""

import os
import subprocess
import sys
import time

import pytest
import torch

from engine_proc import kernels_bench
from engine_proc.attention.triton_backend import TritonAttentionBackend, is_triton_usable
from engine_proc.cuda_graphs import EagerReplayGraph
from tests.engine_fixtures import tiny_engine


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a GPU-less machine")
def test_says_clearly_when_no_gpu_is_present(capsys):
    assert kernels_bench.main([]) == 0
    assert "no CUDA GPU present" in capsys.readouterr().out


def test_interpreter_run_checks_the_kernel_against_sdpa():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "engine_proc.kernels_bench", "--interpret"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(OK)" in proc.stdout


def test_bad_arguments_name_the_flag():
    with pytest.raises(SystemExit):
        kernels_bench.main(["--heads", "9", "--kv-heads", "2"])
    with pytest.raises(SystemExit):
        kernels_bench.main(["--batches", "0,4"])


def test_decode_step_table_runs_eager_and_graph_on_one_model():
    if not is_triton_usable("cpu"):
        pytest.skip("triton cannot run on the CPU here (set TRITON_INTERPRET=1)")
    engine = tiny_engine(attention_backend="triton", device="cpu")

    def timer(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    rows = kernels_bench.decode_step_table(
        engine.model, TritonAttentionBackend(), [1, 3], 20, 4, timer, make_graph=EagerReplayGraph
    )
    assert [r.batch for r in rows] == [1, 3]
    for r in rows:
        assert r.eager_ms > 0 and r.graph_ms > 0
        assert r.max_abs_diff < 1e-5
