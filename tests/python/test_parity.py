"""`ds4server parity` on the CPU: the harness itself.

CI has no GPU, so these run the harness with the CPU backend on both sides
(where every comparison must come out exactly zero), check that a perturbed
op is caught and fails the run, and check its usage errors, JSON report and
the clean refusal of a backend this build lacks. The CPU-vs-CUDA runs are in
scripts/gpu-check.sh.
"""
import json

import pytest

from conftest import ds4


@pytest.fixture(scope="module", params=["q2", "f32"])
def model(request, tmp_path_factory, ds4server):
    path = tmp_path_factory.mktemp("parity") / f"tiny-{request.param}.gguf"
    r = ds4("synth", "--scale", "tiny", "--quant", request.param, "--seed", "11", "--out", path)
    assert r.returncode == 0, r.stderr.decode()
    return path


@pytest.mark.parametrize("numerics", ["reference", "ds4", "ds4-f16"])
def test_same_backend_is_exact(model, numerics, tmp_path):
    out = tmp_path / "p.json"
    # 40 tokens: enough for the ratio-4 indexer to select (top-k 8 of 10 rows)
    r = ds4("parity", "-m", model, "--backends", "cpu,cpu", "--n-tokens", "40", "--decode", "3", "--greedy", "6",
            "--numerics", numerics, "--json", out)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    assert b"parity: PASS" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["pass"] is True and rep["numerics"] == numerics and rep["tokens"] == 40
    names = {row["op"] for row in rep["ops"]}
    for op in ["embed", "attn_hc_x", "q_rope", "kv", "attention", "attn_out_b", "router_experts", "moe", "ffn_X",
               "logits", "comp_pool", "idx_comp_pool"]:
        assert op in names, op
    if numerics != "reference":
        assert {"kv_fp8", "idx_q_qat", "idx_top_k", "idx_scores"} <= names
    for row in rep["ops"]:
        assert row["pass"] and row["max_abs"] == 0 and row["calls"] > 0, row
    assert rep["logits"]["checked"] and rep["logits"]["rel_err"] == 0
    assert rep["logits"]["argmax_agree"] == 40
    # (ds4-f16: a prompt's products are binary16, a decoded token's Q8_0: reported, not judged)
    assert rep["decode_vs_prefill"]["pass"] and rep["decode_vs_prefill"]["judged"] == (numerics != "ds4-f16")
    assert rep["greedy"]["pass"]
    assert len(rep["layer_drift"]) == 5


@pytest.mark.parametrize("op", ["q_b", "attention", "router_weights", "idx_comp_qat", "logits"])
def test_injected_error_fails(model, op):
    r = ds4("parity", "-m", model, "--backends", "cpu,cpu", "--n-tokens", "40", "--numerics", "ds4",
            "--inject-error", op)
    assert r.returncode == 1, r.stdout.decode() + r.stderr.decode()
    failed = [line.split()[0] for line in r.stdout.decode().splitlines()
              if line.rstrip().endswith("FAIL") and not line.startswith("parity:")]
    assert failed and set(failed) == {op}, r.stdout.decode()
    assert b"parity: FAIL" in r.stdout


def test_layer_limit(model, tmp_path):
    out = tmp_path / "p.json"
    r = ds4("parity", "-m", model, "--backends", "cpu,cpu", "--layers", "2", "--tokens", "1,2,3,4,5", "--json", out)
    assert r.returncode == 0, r.stderr.decode()
    rep = json.loads(out.read_text())
    assert rep["layers"] == 2 and not rep["logits"]["checked"]
    assert {row["layer"] for row in rep["ops"]} == {-1, 0, 1}
    assert "logits" not in {row["op"] for row in rep["ops"]}


@pytest.mark.parametrize("args,msg", [
    (["--backends", "cpu"], b"two names"),
    (["--numerics", "fast"], b"--numerics"),
    (["--tokens", "1,x"], b"--tokens"),
    (["--n-tokens", "0"], b"out of range"),
    (["--bogus", "1"], b"unknown option"),
])
def test_usage_errors(model, args, msg):
    r = ds4("parity", "-m", model, *args)
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_missing_backend_is_refused(model):
    r = ds4("parity", "-m", model, "--backends", "cpu,metal")
    assert r.returncode == 1 and b"unknown backend" in r.stderr, r.stderr
    r = ds4("parity", "-m", model, "--backends", "cpu,cpu", "--tokens", "1,999999")
    assert r.returncode == 1 and b"outside the vocabulary" in r.stderr, r.stderr
