"""engine_proc.bench.kernels without a GPU: the no-GPU message, the interpreter check, argument
errors, and the whole-model decode-step table (eager vs graph replay) on a tiny model, whose
hidden states are checked against a float64 forward written here."""

import math
import os
import subprocess
import sys

import pytest
import torch

from engine_proc.attention.triton_backend import TritonAttentionBackend
from engine_proc.bench import kernels as kernels_bench
from engine_proc.executor.cuda_graphs import EagerReplayGraph
from tests.engine_fixtures import tiny_checkpoint, tiny_engine
from tests.needs import interpreted_triton, require_triton


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a GPU-less machine")
def test_says_clearly_when_no_gpu_is_present(capsys):
    assert kernels_bench.main([]) == 0
    assert "no CUDA GPU present" in capsys.readouterr().out


def test_interpreter_run_checks_the_kernel_against_sdpa():
    require_triton()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "engine_proc.bench.kernels", "--interpret"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(OK)" in proc.stdout


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--heads", "9", "--kv-heads", "2"], "--heads (9) must be a multiple of --kv-heads (2)"),
        (["--batches", "0,4"], "--batches: expected positive integers, got '0,4'"),
        (["--contexts", "a"], "--contexts: expected comma-separated integers, got 'a'"),
    ],
)
def test_bad_arguments_name_the_flag(capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        kernels_bench.main(argv)
    assert info.value.code == 2  # argparse's usage error, not a crash or a clean exit
    assert needle in capsys.readouterr().err


def zero_cache_decode_float64(config, weights, token_ids: list[int], position: int):
    """Final-norm hidden states, float64, of each token alone at `position` after `position`
    cached tokens whose K and V are all zero (the table's fresh cache): a zero key scores 0 and
    a zero value adds nothing, so attention is the token's own value times its softmax weight."""
    c = config
    w = {k: v.double() for k, v in weights.items()}

    def norm(x, name):
        return w[name] * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)

    half = torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim
    angle = position * c.rope_theta**-half
    cos, sin = torch.cat([angle.cos()] * 2), torch.cat([angle.sin()] * 2)

    def rope(x):  # [heads, head_dim], rotate_half layout
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    group = c.num_heads // c.num_kv_heads
    out = []
    for token in token_ids:
        h = w["model.embed_tokens.weight"][token]
        for i in range(c.num_layers):
            p = f"model.layers.{i}"
            x = norm(h, f"{p}.input_layernorm.weight")
            q = rope((w[f"{p}.self_attn.q_proj.weight"] @ x).view(c.num_heads, c.head_dim))
            k = rope((w[f"{p}.self_attn.k_proj.weight"] @ x).view(c.num_kv_heads, c.head_dim))
            v = (w[f"{p}.self_attn.v_proj.weight"] @ x).view(c.num_kv_heads, c.head_dim)
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            own = (q * k).sum(-1) / math.sqrt(c.head_dim)  # the zero keys score 0
            weight = own.exp() / (position + own.exp())
            h = h + w[f"{p}.self_attn.o_proj.weight"] @ (weight[:, None] * v).flatten()
            x = norm(h, f"{p}.post_attention_layernorm.weight")
            gate, up = w[f"{p}.mlp.gate_proj.weight"] @ x, w[f"{p}.mlp.up_proj.weight"] @ x
            h = h + w[f"{p}.mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)
        out.append(norm(h, "model.norm.weight"))
    return torch.stack(out)


def test_decode_step_table_runs_eager_and_graph_on_one_model():
    interpreted_triton()
    engine = tiny_engine(attention_backend="triton", device="cpu")
    context = 20
    replays = [0]

    class CountingGraph(EagerReplayGraph):
        def replay(self) -> None:
            replays[0] += 1
            super().replay()

    timed: list[tuple[str, torch.Tensor]] = []

    def timer(fn) -> float:  # records what was timed; the times are made up, not measured
        before = replays[0]
        out = fn().clone()
        kind = "graph" if replays[0] > before else "eager"
        timed.append((kind, out))
        return {"eager": 1.0, "graph": 2.0}[kind]

    rows = kernels_bench.decode_step_table(
        engine.model, TritonAttentionBackend(), [1, 3], context, 4, timer, make_graph=CountingGraph
    )
    assert [r.batch for r in rows] == [1, 3]
    assert [kind for kind, _ in timed] == ["eager", "graph"] * 2
    # Each row reports the timer's values for its own eager and graph runs.
    assert [(r.eager_ms, r.graph_ms) for r in rows] == [(1.0, 2.0), (1.0, 2.0)]
    outputs = [out for _, out in timed]
    ckpt = tiny_checkpoint()
    for r, (eager, graph) in zip(rows, zip(outputs[::2], outputs[1::2], strict=True), strict=True):
        # decode_step_input's tokens: 100, 101, ... at position `context`.
        ref = zero_cache_decode_float64(ckpt.config, ckpt.weights, list(range(100, 100 + r.batch)),
                                        context)  # fmt: skip
        torch.testing.assert_close(eager.double(), ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(graph.double(), ref, rtol=1e-4, atol=1e-5)
        assert r.max_abs_diff == pytest.approx((eager - graph).abs().max().item(), abs=1e-7)
