"""app/bench/disagg.py: colocated vs disaggregated runs of one workload (tiny engines).

Timings are not asserted; what is checked: both systems serve every request its tokens (the
same greedy ids), `after` requests wait for what they wait on, and the disaggregated run's
transfer accounting matches the requests (each multi-token request handed over once, the
one-token long prompt served by the prefill engine alone)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench.disagg import parse
from app.bench.workloads import QUICK, Vocab, make_workload

REPO = Path(__file__).resolve().parents[3]


def test_parse_keeps_after_dependencies_and_refuses_dangling_ones():
    wl = make_workload("interference", QUICK, 0, Vocab(128, [0, 1, 2]))
    streams, after = parse(wl)
    assert [s.id for s in streams] == ["d0", "d1", "d2", "d3", "long"]
    assert after == {"long": ("d0", QUICK.interf_warm)}
    bad = {"requests": [{"id": "a", "prompt": [1], "max_tokens": 1,
                         "after": {"request": "zz", "tokens": 1}}]}  # fmt: skip
    with pytest.raises(ValueError, match=r"after.request must name an earlier one"):
        parse(bad)


@pytest.mark.slow
def test_colocated_and_disaggregated_runs_serve_the_same_tokens(tmp_path):
    wl = make_workload("interference", QUICK, 0, Vocab(128, [0, 1, 2]))
    path = tmp_path / "interference.json"
    path.write_text(json.dumps(wl))
    runs = {}
    for system in ("kvscope-colocated", "kvscope-disagg"):
        out = subprocess.run(
            [sys.executable, "-m", "app.bench.disagg", "--system", system, "--workload",
             str(path), "--threads", "2", "--engine-args",
             "--engine-factory tests.ipc.engines:tiny"],
            cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                               "OMP_NUM_THREADS": "1"},
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        runs[system] = json.loads(out.stdout.strip().splitlines()[-1])
        assert "error" not in runs[system], out.stderr[-2000:]
    colo, dis = runs["kvscope-colocated"], runs["kvscope-disagg"]
    by_id = {s: {r["id"]: r for r in runs[s]["requests"]} for s in runs}
    for rid, r in by_id["kvscope-colocated"].items():
        assert r["output_tokens"] == next(q for q in wl["requests"] if q["id"] == rid)["max_tokens"]
        assert by_id["kvscope-disagg"][rid]["token_ids"] == r["token_ids"], rid
    for run in (colo, dis):
        rows = {r["id"]: r for r in run["requests"]}
        warm_time = rows["d0"]["token_times"][QUICK.interf_warm - 1]
        assert rows["long"]["arrival"] >= warm_time  # sent only once d0 had its tokens
    t = dis["transfer"]
    assert t["handoffs"] == 4 and t["pulls"] + t["releases"] == 4 and t["pull_failures"] == 0
    assert dis["threads"] == {"prefill": 1, "decode": 1} and colo["threads"] == {"engine": 2}
    assert "transfer" not in colo


def test_summary_and_rows_are_hand_computed_medians_and_ratios():
    from app.bench.disagg_table import disagg_rows, disagg_summary
    from app.bench.suite import _plan

    def run(itl: list[float], ttfts: list[float], tok_s: float, pull_s: float | None) -> dict:
        reqs = [{"itl": itl, "ttft": t} for t in ttfts]
        return {"requests": reqs, "output_tok_s": tok_s,
                **({"transfer": {"mean_pull_s": pull_s, "bytes_per_request": 1000.0,
                                 "pull_failures": 0}} if pull_s is not None else {})}  # fmt: skip

    # 101 ITLs 0..100 ms: p99 = 99 ms; p50 = 50 ms. TTFTs 1, 2, 3: p50 2, p99 2.98.
    itl = [i / 1000 for i in range(101)]
    colo = disagg_summary([run(itl, [1, 2, 3], 10.0, None), {"error": "x"}])
    dis = disagg_summary([run([x / 2 for x in itl], [2, 4, 6], 12.0, 0.5),
                          run([x / 2 for x in itl], [2, 4, 6], 8.0, 0.1)])
    assert colo["itl_p99"] == pytest.approx(0.099) and colo["ttft_p99"] == pytest.approx(2.98)
    assert dis["output_tok_s"] == 10.0 and dis["transfer_s"] == pytest.approx(0.3)
    rows = {r.metric: r for r in disagg_rows({"mixed": {"kvscope-colocated": colo,
                                                        "kvscope-disagg": dis}})}  # fmt: skip
    assert rows["decode ITL p99 s"].ratio == pytest.approx(2.0)  # half the ITL: 2x better
    assert rows["TTFT p50 s"].ratio == pytest.approx(0.5)
    assert rows["output tok/s"].ratio == pytest.approx(1.0)
    assert rows["KV transfer bytes per request"].value == 1000.0
    plan = _plan(["interference", "single"], ["kvscope"], disaggregation=True)
    assert ("interference", "kvscope-disagg") in plan and ("single", "kvscope-disagg") not in plan
    assert ("interference", "kvscope-disagg") not in _plan(["interference"], ["kvscope"])
