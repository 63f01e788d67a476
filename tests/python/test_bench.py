"""`ds4server bench` on the CPU with the tiny model: the harness, never the timings.

The figures themselves are machine-dependent, so nothing here asserts a speed:
these check that the JSON has every field with sane values (positive rates,
one sample per --repeat, frontiers beyond the context reported as skipped),
that the reported statistics are the ones the raw samples give, that A/B
rounds alternate A B B A ... and their ratio and paired confidence interval
follow from the samples, that bad options exit with status 2 and a message,
and that scripts/bench_report.py turns the JSON into Markdown and a
well-formed SVG.
"""
import json
import os
import math
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from conftest import ROOT, ds4

REPORT = ROOT / "scripts" / "bench_report.py"
REPEAT = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory, ds4server):
    path = tmp_path_factory.mktemp("bench") / "tiny-q2.gguf"
    r = ds4("synth", "--scale", "tiny", "--quant", "q2", "--seed", "5", "--out", path)
    assert r.returncode == 0, r.stderr.decode()
    return path


@pytest.fixture(scope="module")
def sweep(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    js, md = d / "bench.json", d / "bench.md"
    # the tiny model's context is 4096: the 8192 frontier and prefill must be skipped
    r = ds4("bench", "-m", model, "--ctx", "16,40,8192", "--prefill", "1,8,24,8192", "--gen", "4",
            "--repeat", str(REPEAT), "--warmup", "1", "--ttft", "16", "--threads", "2", "--bandwidth-mib", "16",
            "--chunk", "12", "--profile-token", "2", "--profile-prefill", "8", "--profile-layers", "1,2", "--json", js, "--md", md)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    return r, json.loads(js.read_text()), js, md


@pytest.fixture(scope="module")
def ab(model, tmp_path_factory):
    js = tmp_path_factory.mktemp("ab") / "ab.json"
    r = ds4("bench", "-m", model, "--ctx", "12", "--prefill", "4,10", "--gen", "3", "--repeat", "4",
            "--warmup", "1", "--threads", "2", "--ab", "threads=1", "--json", js)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    return r, json.loads(js.read_text()), js


def median(v):
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def p95(v):
    s = sorted(v)
    return s[-(-95 * len(s) // 100) - 1]


def close(a, b, rel=1e-7):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def check_stats(row):
    s = row["samples_s"]
    assert row["n"] == len(s)
    assert all(x > 0 for x in s)
    assert close(row["median_s"], median(s)), row
    assert close(row["p95_s"], p95(s)), row
    assert close(row["min_s"], min(s)) and close(row["max_s"], max(s))
    assert close(row["mean_s"], sum(s) / len(s))
    assert row["min_s"] <= row["median_s"] <= row["p95_s"] <= row["max_s"]


def test_batched_decode(model, tmp_path):
    """--batch: N streams decode in lockstep; aggregate tokens/s is N times
    the per-stream rate, both from the per-step samples; a prompt beyond the
    model's context (4096) is a skip, not a failure."""
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    r = ds4("bench", "-m", model, "--ctx", "8", "--prefill", "1", "--gen", "5", "--repeat", "1", "--ttft", "0",
            "--threads", "2", "--bandwidth", "100", "--batch", "1,3", "--batch-ctx", "10", "--json", js, "--md", md)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    d = json.loads(js.read_text())
    rows = d["batch"]
    assert [b["streams"] for b in rows] == [1, 3] and d["batch_skipped"] == []
    for b in rows:
        assert b["ctx"] == 10 and b["gen"] == 5 and len(b["samples_s"]) == 5
        check_stats(b)
        total = sum(b["samples_s"])
        assert close(b["per_stream_tokens_per_s"], 5 / total, 1e-6)
        assert close(b["tokens_per_s"], b["streams"] * 5 / total, 1e-6)
        assert b["per_step"]["graphs"] == 0 and b["per_step"]["launches"] == 0  # CPU backend
    text = md.read_text()
    assert "Batched decode (each stream prefilled with 10 tokens" in text and "| streams |" in text
    r = ds4("bench", "-m", model, "--ctx", "8", "--prefill", "1", "--gen", "2", "--repeat", "1", "--ttft", "0",
            "--bandwidth", "100", "--batch", "2", "--batch-ctx", "4095", "--json", js)
    assert r.returncode == 0, r.stderr.decode()
    d = json.loads(js.read_text())
    assert d["batch"] == [] and d["batch_skipped"][0]["streams"] == 2
    assert "exceed the model's context" in d["batch_skipped"][0]["reason"]
    # without --batch there is no batched section
    r = ds4("bench", "-m", model, "--ctx", "8", "--prefill", "1", "--gen", "2", "--repeat", "1", "--ttft", "0",
            "--bandwidth", "100", "--json", js, "--md", md)
    assert r.returncode == 0 and json.loads(js.read_text())["batch"] == [] and "Batched" not in md.read_text()


def test_sweep_fields(sweep, model):
    _, d, _, _ = sweep
    assert d["schema"] == "ds4server-bench/1" and d["mode"] == "sweep" and d["ab"] is None
    p = d["provenance"]
    assert p["commit"] and p["compiler"] and p["build"] in ("cpu", "cuda") and p["device"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", p["date_utc"])
    assert "bench" in p["command_line"] and "--ctx 16,40,8192" in p["command_line"]
    m = p["model"]
    assert m["path"] == str(model) and m["file_bytes"] == model.stat().st_size
    assert re.fullmatch(r"[0-9a-f]{16}", m["fingerprint"])
    assert m["n_layer"] == 5 and m["n_vocab"] == 1024 and m["context_length"] == 4096
    assert p["tokens"]["seed"] == 1 and p["tokens"]["ttft_tokens"] == 16 and p["tokens"]["gen"] == 4
    o = d["options"]
    assert o["backend"] == "cpu" and o["numerics"] == "ds4" and o["threads"] == 2 and o["repeat"] == REPEAT
    assert o["ctx"] == [16, 40, 8192] and o["prefill"] == [1, 8, 24, 8192] and o["chunk"] == 12
    ld = d["load"]
    assert ld["total_s"] > 0 and ld["weights_s"] > 0 and ld["bytes_bound"] > 0
    assert ld["upload_gbps"] is None  # the CPU backend reads the mapping in place


def test_sweep_prefill_and_ttft(sweep):
    _, d, _, _ = sweep
    assert [r["tokens"] for r in d["prefill"]] == [1, 8, 24]
    for r in d["prefill"]:
        check_stats(r)
        assert r["n"] == REPEAT
        assert r["tokens_per_s"] > 0 and close(r["tokens_per_s"], r["tokens"] / r["median_s"], 1e-6)
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
    assert [r["tokens"] for r in d["prefill_skipped"]] == [8192]
    assert "context" in d["prefill_skipped"][0]["reason"]
    t = d["ttft"]
    assert t["tokens"] == 16 and t["n"] == REPEAT
    check_stats(t)


def test_sweep_decode(sweep):
    _, d, _, _ = sweep
    rows = d["decode"]
    assert [r["ctx"] for r in rows] == [16, 40]
    assert [r["ctx"] for r in d["decode_skipped"]] == [8192]
    assert "context" in d["decode_skipped"][0]["reason"]
    # one state: each frontier prefills only the gap since the previous
    # decode, then decodes --warmup x min(--gen, 8) untimed tokens (here 4)
    # before the timed ones
    assert all(r["warmup_tokens"] == 4 for r in rows)
    assert rows[0]["interval_tokens"] == 16 and rows[0]["pos_start"] == 16 + 4
    assert rows[1]["interval_tokens"] == 40 - (16 + 4 + 4) and rows[1]["pos_start"] == 40 + 4
    for r in rows:
        assert r["gen"] == 4 and len(r["samples_s"]) == 4
        check_stats(r)
        assert r["p50_s"] == r["median_s"]
        assert r["tokens_per_s"] > 0 and close(r["tokens_per_s"], 4 / sum(r["samples_s"]), 1e-6)
        assert r["interval_tokens_per_s"] > 0
        pt = r["per_token"]
        for k in ("launches", "copies", "h2d_bytes", "d2h_bytes", "syncs", "wait_ms"):
            assert pt[k] >= 0  # zero on the CPU backend
        for k in ("graphs", "graph_launches", "graph_builds", "graph_refusals", "node_updates", "step_breaks", "step_host_ms",
                  "graph_gpu_ms"):
            assert pt[k] == 0  # the CPU backend records no steps
        rf = r["roofline"]
        assert rf["weights_bytes"] == d["roofline"]["weights_bytes_per_token"] and rf["kv_bytes"] > 0
        bw = d["bandwidth"]["gbps"] * 1e9
        assert close(rf["floor_s_weights"], rf["weights_bytes"] / bw, 1e-6)
        assert close(rf["floor_s_weights_kv"], (rf["weights_bytes"] + rf["kv_bytes"]) / bw, 1e-6)
        assert close(rf["measured_over_floor_weights"], r["median_s"] / rf["floor_s_weights"], 1e-6)
        assert rf["measured_over_floor_weights"] > rf["measured_over_floor_weights_kv"] > 0
    assert rows[1]["roofline"]["kv_bytes"] > rows[0]["roofline"]["kv_bytes"]
    assert d["kernels"] is None  # no kernel timing on the CPU backend


def test_sweep_roofline_and_bandwidth(sweep, model):
    _, d, _, _ = sweep
    rl = d["roofline"]
    size = model.stat().st_size
    assert 0 < rl["routed_expert_bytes_per_token"] < rl["routed_expert_bytes_total"]
    assert close(rl["weights_bytes_per_token"],
                 rl["dense_bytes"] + rl["routed_expert_bytes_per_token"] + rl["row_bytes_per_token"], 1e-6)
    assert 0 < rl["weights_bytes_per_token"] < size
    bw = d["bandwidth"]
    assert bw["source"] == "measured" and bw["buffer_bytes"] == 16 << 20
    assert len(bw["samples_gbps"]) == 5 and all(x > 0 for x in bw["samples_gbps"])
    assert close(bw["gbps"], max(bw["samples_gbps"]))


def test_sweep_markdown(sweep):
    r, _, _, md = sweep
    out = r.stdout.decode()
    assert out == md.read_text()
    assert "| prefill tokens | tokens/s (median) |" in out and "| context |" in out
    assert "| 8192 | skipped:" in out and "time to first token (16-token prompt)" in out


def small_bench(model, js, *extra):
    """One round of a tiny bench (8-token context, a 4-token prefill, 2 tokens decoded, no TTFT) with
    `extra` options: its JSON."""
    r = ds4("bench", "-m", model, "--ctx", "8", "--prefill", "4", "--gen", "2", "--repeat", "1", "--warmup", "0",
            "--ttft", "0", "--threads", "1", *extra, "--json", js)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(js.read_text())


def test_given_bandwidth(model, tmp_path):
    d = small_bench(model, tmp_path / "b.json", "--bandwidth", "100", "--numerics", "reference")
    assert d["bandwidth"]["source"] == "given" and d["bandwidth"]["gbps"] == 100
    assert d["options"]["numerics"] == "reference" and d["ttft"] is None and "--ttft 0" in d["ttft_reason"]
    row = d["decode"][0]
    assert close(row["roofline"]["floor_s_weights"], d["roofline"]["weights_bytes_per_token"] / 100e9, 1e-6)
    assert len(d["prefill"][0]["samples_s"]) == 1


def check_ab(exp, rounds, work):
    """An A/B experiment's rounds, samples and statistics; `work` is what a
    sample measured (decode: --gen tokens, prefill: its prompt's tokens)."""
    order = exp["order"]
    assert len(order) == 2 * rounds
    assert "".join(order) == ("ABBA" * rounds)[: 2 * rounds]
    assert [s["variant"] for s in exp["samples"]] == order
    assert [s["round"] for s in exp["samples"]] == [i // 2 for i in range(2 * rounds)]
    tps = {"A": [], "B": []}
    for s in exp["samples"]:
        assert s["tokens_per_s"] > 0 and s["seconds"] > 0
        assert math.isclose(s["tokens_per_s"] * s["seconds"], work, rel_tol=1e-6), s
        tps[s["variant"]].append(s["tokens_per_s"])
    logs = [math.log(b / a) for a, b in zip(tps["A"], tps["B"])]
    assert len(logs) == exp["n_pairs"] == rounds
    for got, want in zip(exp["log_ratios"], logs):
        assert math.isclose(got, want, abs_tol=1e-6)
    mean = sum(logs) / len(logs)
    assert close(exp["ratio"], math.exp(mean), 1e-6)
    lo, hi = exp["ci95"]
    assert lo <= exp["ratio"] <= hi
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    half = exp["t_crit"] * sd / math.sqrt(len(logs))
    assert close(lo, math.exp(mean - half), 1e-5) and close(hi, math.exp(mean + half), 1e-5)
    assert close(exp["a_tokens_per_s_median"], median(tps["A"]), 1e-6)
    assert close(exp["b_tokens_per_s_median"], median(tps["B"]), 1e-6)


def test_ab_threads(ab):
    r, d, _ = ab
    assert d["mode"] == "ab" and d["prefill"] == [] and d["decode"] == []
    a = d["ab"]
    assert a["key"] == "threads" and a["value"] == "1"
    assert a["variants"]["A"]["threads"] == 2 and a["variants"]["B"]["threads"] == 1
    assert a["decode"]["ctx"] == 12 and not a["decode"]["skipped"]
    assert a["prefill"]["tokens"] == 10 and not a["prefill"]["skipped"]  # the largest size
    for exp, work in ((a["decode"], 3), (a["prefill"], 10)):
        check_ab(exp, 4, work)
        assert math.isclose(exp["t_crit"], 3.182446305, rel_tol=1e-5)  # Student t, 3 degrees of freedom
    out = r.stdout.decode()
    assert "| decode at 12" in out and "ABBAABBA" in out


def test_f16_numerics_recorded(model, tmp_path):
    d = small_bench(model, tmp_path / "f.json", "--numerics", "ds4-f16", "--ab", "numerics=ds4")
    assert d["options"]["numerics"] == "ds4-f16"
    assert d["ab"]["variants"]["A"]["numerics"] == "ds4-f16" and d["ab"]["variants"]["B"]["numerics"] == "ds4"


def test_ab_numerics_two_rounds(model, tmp_path):
    js = tmp_path / "ab.json"
    r = ds4("bench", "-m", model, "--ctx", "6", "--prefill", "5", "--gen", "2", "--repeat", "2", "--warmup", "0",
            "--threads", "1", "--ab", "numerics=reference", "--json", js)
    assert r.returncode == 0, r.stderr.decode()
    a = json.loads(js.read_text())["ab"]
    assert a["variants"]["A"]["numerics"] == "ds4" and a["variants"]["B"]["numerics"] == "reference"
    for exp, work in ((a["decode"], 2), (a["prefill"], 5)):
        check_ab(exp, 2, work)
        assert math.isclose(exp["t_crit"], 12.70620474, rel_tol=1e-5)


def test_ab_frontier_beyond_context(model, tmp_path):
    js = tmp_path / "ab.json"
    r = ds4("bench", "-m", model, "--ctx", "5000", "--prefill", "6", "--gen", "2", "--repeat", "1", "--warmup", "0",
            "--threads", "1", "--ab", "threads=2", "--json", js)
    assert r.returncode == 0, r.stderr.decode()
    a = json.loads(js.read_text())["ab"]
    assert a["decode"]["skipped"] and "context" in a["decode"]["reason"] and a["decode"]["order"] == []
    assert a["prefill"]["order"] == ["A", "B"] and a["prefill"]["ci95"] is None  # one pair: no interval


# --compare: B is a command line (here a wrapper that logs its environment
# and arguments, then runs this same binary), A this binary; each sample is
# one child `bench` run.
def wrapper(tmp_path, body):
    w = tmp_path / "variant-b.sh"
    w.write_text("#!/bin/sh\n" + body)
    w.chmod(0o755)
    return w


def test_compare(model, tmp_path, ds4server):
    log = tmp_path / "b.log"
    w = wrapper(tmp_path, f'echo "$DS4_BENCH_TAG $*" >> "{log}"\nexec "{ds4server}" "$@"\n')
    js, md = tmp_path / "cmp.json", tmp_path / "cmp.md"
    cmd = f"env DS4_BENCH_TAG=tagged {w}"
    r = ds4("bench", "-m", model, "--ctx", "12", "--prefill", "4,10", "--gen", "3", "--repeat", "3",
            "--warmup", "1", "--threads", "1", "--compare", cmd, "--json", js, "--md", md)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    d = json.loads(js.read_text())
    assert d["mode"] == "ab" and d["prefill"] == [] and d["decode"] == []
    assert d["options"]["compare"] == cmd and d["options"]["ab"] is None
    a = d["ab"]
    assert a["key"] == "command" and a["value"] == cmd
    va, vb = a["variants"]["A"], a["variants"]["B"]
    assert vb["command"] == cmd and str(ds4server.resolve()) in va["command"]
    assert va["commit"] == vb["commit"] == d["provenance"]["commit"]
    assert va["fingerprint"] == vb["fingerprint"] == d["provenance"]["model"]["fingerprint"]
    assert a["decode"]["ctx"] == 12 and a["prefill"]["tokens"] == 10  # the largest size
    for exp, work in ((a["decode"], 3), (a["prefill"], 10)):
        check_ab(exp, 3, work)
        assert math.isclose(exp["t_crit"], 4.30265273, rel_tol=1e-5)  # Student t, 2 degrees of freedom
    # B ran once per round, with its environment, the model and one sample of each measurement
    runs = log.read_text().splitlines()
    assert len(runs) == 3
    for line in runs:
        tag, *args = line.split()
        assert tag == "tagged" and args[0] == "bench" and str(model) in args
        flags = dict(zip(args[1::2], args[2::2]))
        assert flags["--ctx"] == "12" and flags["--prefill"] == "10" and flags["--gen"] == "3"
        assert flags["--repeat"] == "1" and flags["--warmup"] == "1" and flags["--threads"] == "1"
        assert flags["--ttft"] == "0" and "--compare" not in args
    text = md.read_text()
    assert "| decode at 12" in text and "ABBAAB" in text and cmd in text
    # the report names both commands and commits
    out = tmp_path / "report.md"
    rr = subprocess.run([sys.executable, REPORT, js, "--md", out, "--svg", tmp_path / "plot.svg"], capture_output=True,
                        timeout=60)
    assert rr.returncode == 0, rr.stderr.decode()
    rep = out.read_text()
    assert f"B = `{cmd}` (commit {vb['commit']})" in rep and "| decode at 12 |" in rep


def test_compare_frontier_beyond_context(model, tmp_path, ds4server):
    js = tmp_path / "cmp.json"
    r = ds4("bench", "-m", model, "--ctx", "5000", "--prefill", "6", "--gen", "2", "--repeat", "2", "--warmup", "0",
            "--threads", "1", "--compare", str(ds4server), "--json", js)
    assert r.returncode == 0, r.stderr.decode()
    a = json.loads(js.read_text())["ab"]
    assert a["decode"]["skipped"] and "context" in a["decode"]["reason"] and a["decode"]["order"] == []
    check_ab(a["prefill"], 2, 6)


def test_compare_from_another_directory(model, tmp_path, ds4server):
    # the model given by a relative path, B started in another directory: B still finds it
    js = tmp_path / "cmp.json"
    r = ds4("bench", "-m", model.name, "--ctx", "8", "--prefill", "4", "--gen", "2", "--repeat", "2", "--warmup", "0",
            "--threads", "1", "--compare", f"cd / && {ds4server}", "--json", js, cwd=model.parent)
    assert r.returncode == 0, r.stderr.decode()
    check_ab(json.loads(js.read_text())["ab"]["decode"], 2, 2)


def test_compare_fingerprint_mismatch_warns(model, tmp_path, ds4server):
    # B reports another model fingerprint: the comparison is kept, with a warning
    w = wrapper(tmp_path, f'"{ds4server}" "$@" || exit $?\n'
                'while [ $# -gt 1 ]; do [ "$1" = --json ] && sed -i \'s/"fingerprint": "[0-9a-f]*"/'
                '"fingerprint": "0123456789abcdef"/\' "$2"; shift; done\n')
    js = tmp_path / "cmp.json"
    r = ds4("bench", "-m", model, "--ctx", "8", "--prefill", "4", "--gen", "2", "--repeat", "1", "--warmup", "0",
            "--threads", "1", "--compare", str(w), "--json", js)
    assert r.returncode == 0, r.stderr.decode()
    assert b"different model fingerprints" in r.stderr and b"0123456789abcdef" in r.stderr
    v = json.loads(js.read_text())["ab"]["variants"]
    assert v["B"]["fingerprint"] == "0123456789abcdef" != v["A"]["fingerprint"]


def test_compare_killed_parent_cleans_up(model, tmp_path, ds4server):
    # SIGTERM to bench while B runs: B is stopped and the temporary directory removed
    pidfile = tmp_path / "b.pid"
    w = wrapper(tmp_path, f'echo $$ > "{pidfile}"\nexec sleep 60\n')
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.Popen([str(ds4server), "bench", "-m", str(model), "--ctx", "8", "--prefill", "4",
                          "--gen", "2", "--repeat", "1", "--warmup", "0", "--threads", "1", "--compare", str(w)],
                         env=dict(os.environ, TMPDIR=str(tmp)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(600):
            if pidfile.exists() and pidfile.read_text().strip():
                break
            time.sleep(0.05)
        assert list(tmp.iterdir()), "no temporary directory while B runs"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
    child = int(pidfile.read_text())
    for _ in range(200):  # B was sent SIGTERM
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("B still runs after bench was stopped")
    assert not list(tmp.iterdir())


@pytest.mark.parametrize("body, message", [
    ("exit 3\n", "variant B (`{w}`) failed (exit status 3)"),
    ("echo 'cannot open the device' >&2; exit 1\n", "failed (exit status 1): cannot open the device"),
    # writes something other than a bench result where --json points
    ('while [ $# -gt 1 ]; do [ "$1" = --json ] && echo "{not json" > "$2"; shift; done\n', "is not JSON"),
    ('while [ $# -gt 1 ]; do [ "$1" = --json ] && echo \'{"schema": "other"}\' > "$2"; shift; done\n',
     "is not a ds4server-bench/1 result"),
    ('while [ $# -gt 1 ]; do [ "$1" = --json ] && echo \'{"schema": "ds4server-bench/1", "decode": []}\' > "$2"; '
     'shift; done\n', "has no decode samples"),
    ('while [ $# -gt 1 ]; do [ "$1" = --json ] && echo \'{"schema": "ds4server-bench/1", "decode": [{"ctx": 8, '
     '"samples_s": [0.5, 0.5]}], "prefill": []}\' > "$2"; shift; done\n', "has no prefill sample"),
    ("kill -9 $$\n", "failed (exit status 137: signal 9)"),
])
def test_compare_variant_failures(model, tmp_path, body, message):
    w = wrapper(tmp_path, body)
    js = tmp_path / "cmp.json"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = ds4("bench", "-m", model, "--ctx", "8", "--prefill", "4", "--gen", "2", "--repeat", "1", "--warmup", "0",
            "--threads", "1", "--compare", str(w), "--json", js, env=dict(os.environ, TMPDIR=str(tmp)))
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert message.format(w=w) in err, err
    assert not list(tmp.iterdir())  # its temporary files are gone


@pytest.mark.parametrize("args", [
    [],                                  # no model
    ["--gen", "0"],
    ["--gen"],                           # missing value
    ["--ctx", "1,,2"],
    ["--ctx", "abc"],
    ["--prefill", "-1"],
    ["--prefill", "8,"],
    ["--repeat", "0"],
    ["--warmup", "x"],
    ["--numerics", "fp8"],
    ["--backend", "tpu"],
    ["--ab", "colour=red"],
    ["--ab", "threads=0"],
    ["--ab", "threads"],
    ["--ab", "backend=tpu"],
    ["--ab", "numerics=fp8"],
    ["--bandwidth", "-5"],
    ["--bandwidth", "fast"],
    ["--threads", "0"],
    ["--batch", "0"],
    ["--batch", "2,x"],
    ["--batch-ctx", "0"],
    ["--seed", "-3"],
    ["--profile-token", "0"],
    ["--profile-token", "x"],
    ["--gen", "4", "--profile-token", "5"],  # past the decoded tokens
    ["--profile-token", "1", "--ab", "threads=1"],
    ["--compare", ""],
    ["--compare", "./other;"],           # would end the command before bench's arguments
    ["--compare", "./other &  "],
    ["--compare", "./other\n--gen 3"],
    ["--compare", "./other", "--batch", "2"],  # --compare measures decode and prefill only
    ["--compare", "./other", "--ttft", "16"],
    ["--compare", "./other", "--bandwidth", "100"],
    ["--compare", "./other", "--ab", "threads=1"],
    ["--profile-token", "1", "--compare", "./other"],
    ["--profile-prefill", "0"],
    ["--profile-layers", "2,1"],  # without --profile-prefill
    ["--prefill", "8", "--profile-prefill", "8", "--profile-layers", "2"],
    ["--prefill", "8", "--profile-prefill", "8", "--profile-layers", "2,0"],
    ["--prefill", "8", "--profile-prefill", "8", "--profile-layers", "-1,2"],
    ["--prefill", "8", "--profile-prefill", "8", "--profile-layers", "1,2,3"],
    ["--prefill", "8", "--profile-prefill", "8", "--profile-layers", ",2"],
    ["--profile-prefill", "x"],
    ["--prefill", "1,8", "--profile-prefill", "16"],  # not one of the --prefill sizes
    ["--prefill", "8", "--profile-prefill", "8", "--ab", "threads=1"],
    ["--prefill", "8", "--profile-prefill", "8", "--compare", "./other"],
    ["--frobnicate", "1"],
    ["stray"],
])
def test_bad_options(model, args):
    full = args if args == [] else ["-m", model, *args]
    r = ds4("bench", *full)
    assert r.returncode == 2, (args, r.stderr.decode())
    err = r.stderr.decode()
    assert err.startswith("ds4server bench: ") and "--help" in err, err
    assert r.stdout == b""


def test_cuda_missing_is_usage_error(model, ds4server):
    if b"cuda" in ds4("version").stdout.split(b"backends:")[-1]:
        pytest.skip("this binary has the CUDA backend")
    r = ds4("bench", "-m", model, "--backend", "cuda")
    assert r.returncode == 2 and b"not built into this binary" in r.stderr


def test_runtime_failure_exits_1(tmp_path):
    r = ds4("bench", "-m", tmp_path / "missing.gguf", "--ctx", "8")
    assert r.returncode == 1 and r.stderr.startswith(b"ds4server bench: ")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    r = ds4("bench", "-m", bad)
    assert r.returncode == 1


def test_unwritable_output_fails_first(model, tmp_path):
    # an output that cannot be written fails before the measurements start
    r = ds4("bench", "-m", model, "--md", tmp_path / "no-such-dir" / "b.md", timeout=20)
    assert r.returncode == 1 and b"no-such-dir" in r.stderr and r.stdout == b""


def test_help():
    r = ds4("bench", "--help")
    assert r.returncode == 0 and b"usage: ds4server bench" in r.stdout


def test_report(sweep, ab, tmp_path):
    _, d, js, _ = sweep
    _, _, ab_js = ab
    md, svg = tmp_path / "out" / "report.md", tmp_path / "out" / "plot.svg"
    md.parent.mkdir()
    r = subprocess.run([sys.executable, REPORT, js, ab_js, "--md", md, "--svg", svg, "--title", "tiny CPU"],
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    text = md.read_text()
    assert text.startswith("# tiny CPU") and "![decode and prefill tokens/s](plot.svg)" in text
    assert "| prefill tokens |" in text and "| context |" in text and "| decode at 12 |" in text
    assert "skipped:" in text
    root = ET.parse(svg).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    ns = {"s": "http://www.w3.org/2000/svg"}
    # one marker per plotted point: decode rows plus prefill rows of the sweep (the A/B file has none)
    assert len(root.findall(".//s:circle", ns)) == len(d["decode"]) + len(d["prefill"])
    assert len(root.findall(".//s:polyline", ns)) == 2
    texts = "".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "decode tokens/s vs context" in texts and "prefill tokens/s vs batch size" in texts


def test_report_recorded_steps_and_kernels(sweep, tmp_path):
    """The GPU-only parts of a bench file (recorded-step counters, the
    per-kernel table) are rendered from the JSON: a CPU sweep with them
    filled in as a CUDA run would."""
    _, d, _, _ = sweep
    d = json.loads(json.dumps(d))
    pt = d["decode"][0]["per_token"]
    pt.update(graphs=1.0, graph_launches=6.0, graph_builds=0.25, graph_refusals=0.125, node_updates=191.5, step_breaks=0.0,
              step_host_ms=1.25,
              graph_gpu_ms=18.5)
    d["kernels"] = {"context": 16, "tokens": 4, "distinct": 3, "per_token": [
        {"name": "_Z9mv_kernel", "what": "matvec kernel", "launches": 345.0, "ms": 5.75},
        {"name": "copy", "what": "copy|x", "launches": 2.0, "ms": 0.25}]}
    d["batch"] = [{"streams": 8, "ctx": 128, "gen": 4, "samples_s": [0.02] * 4, "n": 4, "median_s": 0.02,
                   "p95_s": 0.02, "min_s": 0.02, "max_s": 0.02, "mean_s": 0.02, "tokens_per_s": 400.0,
                   "per_stream_tokens_per_s": 50.0,
                   "per_step": {"launches": 2700.0, "syncs": 2, "wait_ms": 19.0, "graphs": 1, "graph_gpu_ms": 19.5},
                   "peak_device_bytes": 2 * 1073741824}]
    d["batch_skipped"] = [{"streams": 64, "reason": "state: out of device memory"}]
    js = tmp_path / "cuda.json"
    js.write_text(json.dumps(d))
    md, svg = tmp_path / "r.md", tmp_path / "r.svg"
    r = subprocess.run([sys.executable, REPORT, js, "--md", md, "--svg", svg], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    text = md.read_text()
    assert "| 16 | 1.00 | 6.00 | 0.250 | 0.125 | 191.5 | 0.00 | 1.250 | 18.500 |" in text
    assert "by kernel at context 16 (4 tokens" in text and "2 of 3 kernels" in text
    # us/tok, us/launch and share of the listed total (6.0 ms)
    assert "| `_Z9mv_kernel` | matvec kernel | 345.0 | 5750.0 | 16.67 | 95.8% |" in text
    assert "| `copy` | copy\\|x | 2.0 | 250.0 | 125.00 | 4.2% |" in text
    assert "prefilled with 128 tokens of its own, then 4 greedy" in text
    assert "| 8 | 400.00 | 50.00 | 20.000 | 20.000 | 2700.0 | 19.500 | 2.00 |" in text
    assert "| 64 | skipped: state: out of device memory |" in text
    # a CPU file has neither table
    _, _, cpu_js, _ = sweep
    r = subprocess.run([sys.executable, REPORT, cpu_js, "--md", md, "--svg", svg], capture_output=True, timeout=60)
    assert r.returncode == 0 and "graph GPU ms" not in md.read_text() and "by kernel" not in md.read_text()


def test_report_notes(sweep, tmp_path):
    _, _, js, _ = sweep
    notes = tmp_path / "notes.md"
    notes.write_text("Read **this** first.\n")
    md, svg = tmp_path / "r.md", tmp_path / "r.svg"
    r = subprocess.run([sys.executable, REPORT, js, "--md", md, "--svg", svg, "--title", "T", "--notes", notes],
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    text = md.read_text()
    assert text.startswith("# T\n") and text.index("Read **this** first.") < text.index("Generated by")
    r = subprocess.run([sys.executable, REPORT, js, "--md", md, "--svg", svg, "--notes", tmp_path / "missing.md"],
                       capture_output=True, timeout=60)
    assert r.returncode == 1 and b"missing.md" in r.stderr


def test_report_rejects_other_json(tmp_path):
    other = tmp_path / "x.json"
    other.write_text('{"schema": "something-else"}')
    r = subprocess.run([sys.executable, REPORT, other, "--md", tmp_path / "r.md", "--svg", tmp_path / "r.svg"],
                       capture_output=True, timeout=60)
    assert r.returncode == 1 and b"not a ds4server-bench/1 file" in r.stderr


def test_ops_bench(tmp_path):
    """bench --ops: every decode-shaped product of the model (widths / 16)
    is timed through the backend op, with weight bytes, per-call statistics
    from the samples and GB/s = bytes / median; --only filters by name and
    --rows adds batched rows (bytes scale with the rows for the experts)."""
    js, md = tmp_path / "ops.json", tmp_path / "ops.md"
    r = ds4("bench", "--ops", "--div", "16", "--repeat", "2", "--warmup", "0", "--threads", "2",
            "--bandwidth", "10", "--rotate-mib", "1", "--json", js, "--md", md)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    d = json.loads(js.read_text())
    assert d["schema"] == "ds4server-bench-ops/1" and d["backend"] == "cpu" and d["div"] == 16
    assert d["bandwidth"]["gbps"] == 10 and d["bandwidth"]["source"] == "given"
    names = [o["name"] for o in d["ops"]]
    assert names[0] == "attn_q_a" and "output" in names
    assert names[-11:] == ["experts q2", "experts q4", "indexer_scores", "indexer_scores", "indexer_scores_f16",
                           "indexer_scores_f16", "top_k", "top_k", "hc_pre", "rmsnorm", "fill"]
    select = ("indexer_scores", "indexer_scores_f16", "top_k")
    for o in d["ops"]:
        assert "skipped" not in o, o
        assert o["rows"] == 1 and o["timing"] == "wall"
        assert o["name"] in ("fill",) + select or (o["n_in"] >= 256 and o["n_in"] % 256 == 0)
        assert ("keys" in o) == (o["name"] in select)
        s = dict(o["per_call"])
        assert len(s["samples_s"]) == 2
        check_stats(s)
        assert close(o["gbps"], o["bytes"] / s["median_s"] / 1e9, 1e-6)
        assert close(o["of_bandwidth"], o["gbps"] / 10, 1e-6)
        assert o["calls"] >= o["copies"] >= 1
    out = next(o for o in d["ops"] if o["name"] == "output")
    assert out["type"] == "Q8_0" and out["n_in"] == 256 and out["n_out"] == 129280 // 16
    assert out["bytes"] == out["n_out"] * (out["n_in"] // 32) * 34
    q2 = next(o for o in d["ops"] if o["name"] == "experts q2")
    assert q2["type"] == "IQ2_XXS" and q2["down_type"] == "Q2_K" and q2["experts"] == 16
    assert q2["bytes"] == 6 * (2 * 256 * (256 // 256) * 66 + 256 * (256 // 256) * 84)
    # the selection at the default 4096 and 16384 key rows, / 16: the indexer's
    # key rows (and one row's query, weights and scores), the top 512's scores
    for kind in select:
        ops = [o for o in d["ops"] if o["name"] == kind]
        assert [o["keys"] for o in ops] == [256, 1024] and all(o["kind"] == kind for o in ops)
        for o in ops:
            n = o["keys"]
            if kind == "top_k":
                assert o["n_in"] == n and o["n_out"] == 512 and o["copies"] == 1
                assert o["bytes"] == 4 * n + 4 * 512
            else:
                assert o["n_in"] == 128 and o["n_out"] == 64
                assert o["copies"] == (1 << 20) // (n * 128 * 4)  # rotated over 1 MiB of key rows
                assert o["bytes"] == n * 128 * 4 + (64 * 129 + n) * 4
    fill = next(o for o in d["ops"] if o["name"] == "fill")
    assert fill["kind"] == "fill" and fill["n_in"] == 1 and fill["bytes"] == 4 and fill["calls"] == 256
    hc = next(o for o in d["ops"] if o["name"] == "hc_pre")
    assert hc["kind"] == "hc_pre" and hc["n_in"] == 4 * 4096 // 16 and hc["n_out"] == 24
    assert hc["bytes"] == 24 * hc["n_in"] * 2 + hc["n_in"] * 4 * 1.25
    text = md.read_text()
    assert "| product |" in text and "| attn_output_a | Q8_0 | 8 x (256x64) | 1 |" in text
    assert "| indexer_scores_f16 | F16 | 64 heads x 128, 1024 keys | 1 |" in text and "| top_k | F32 | 512 of 256 | 1 |" in text
    r = ds4("bench", "--ops", "--div", "16", "--repeat", "1", "--warmup", "0", "--bandwidth", "10",
            "--only", "experts q2", "--rows", "1,3", "--json", js)
    assert r.returncode == 0, r.stderr.decode()
    d = json.loads(js.read_text())
    assert [(o["name"], o["rows"]) for o in d["ops"]] == [("experts q2", 1), ("experts q2", 3)]
    one, three = d["ops"]
    assert one["used"] == 6 and one["experts_read"] == 6  # six distinct experts per row
    assert 6 < three["experts_read"] <= 16  # three rows of six picks among 16 experts: some shared
    per_expert = one["bytes"] / 6
    assert close(three["bytes"], three["experts_read"] * per_expert, 1e-9)


def test_ops_bench_selection(tmp_path):
    """bench --ops --keys: the indexer's and the top-k's ops at each count
    of key rows (divided by --div) for each --rows; --only takes several
    names; the key rows rotate over copies of --rotate-mib, the top-k's
    scores (just written by the indexer in a token) do not."""
    js = tmp_path / "sel.json"
    r = ds4("bench", "--ops", "--div", "2", "--repeat", "1", "--warmup", "0", "--bandwidth", "10",
            "--keys", "64,300", "--rows", "1,2", "--only", "indexer_scores_f16,top_k", "--rotate-mib", "1",
            "--json", js)
    assert r.returncode == 0, r.stderr.decode()
    d = json.loads(js.read_text())
    got = [(o["name"], o["rows"], o["keys"]) for o in d["ops"]]
    assert got == [("indexer_scores_f16", 1, 32), ("indexer_scores_f16", 1, 150), ("indexer_scores_f16", 2, 32),
                   ("indexer_scores_f16", 2, 150), ("top_k", 1, 32), ("top_k", 1, 150), ("top_k", 2, 32),
                   ("top_k", 2, 150)]
    for o in d["ops"]:
        assert "skipped" not in o, o
        n, rows = o["keys"], o["rows"]
        if o["name"] == "top_k":
            assert o["copies"] == 1 and o["bytes"] == rows * 4 * n + rows * 4 * 512
        else:  # 1 MiB over rows of 128 floats
            assert o["copies"] == -(-(1 << 20) // (n * 128 * 4)) and o["calls"] == max(8, o["copies"])
            assert o["bytes"] == n * 128 * 4 + rows * (64 * 129 + n) * 4
        check_stats(dict(o["per_call"]))
    for bad in (["--keys", "0"], ["--keys", "x"], ["--only", "top_k,"], ["--only", "top_k,nothing"]):
        r = ds4("bench", "--ops", *bad)
        assert r.returncode == 2 and b"bench --ops" in r.stderr, (bad, r.stderr.decode())


def test_report_ops(sweep, tmp_path):
    """bench_report.py --ops: one table row per product of a bench --ops
    JSON, with the JSON's time per call and share of bandwidth; an --ops
    file of another schema is refused."""
    js = tmp_path / "ops.json"
    r = ds4("bench", "--ops", "--div", "16", "--repeat", "1", "--warmup", "0", "--bandwidth", "10",
            "--only", "experts q2", "--rows", "1,3", "--json", js)
    assert r.returncode == 0, r.stderr.decode()
    d = json.loads(js.read_text())
    bench_js = sweep[2]
    md, svg = tmp_path / "r.md", tmp_path / "r.svg"
    r = subprocess.run([sys.executable, REPORT, bench_js, "--ops", js, "--md", md, "--svg", svg],
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    text = md.read_text()
    assert "## Weight products on their own (`ops.json`)" in text and "bandwidth: 10.0 GB/s (given)" in text
    rows = [line for line in text.splitlines() if line.startswith("| experts q2 |")]
    assert len(rows) == 2 and "| 256x256, 6 of 16 | 1 |" in rows[0] and "| 256x256, 6 of 16 | 3 |" in rows[1]
    for row, o in zip(rows, d["ops"]):
        assert f"| {o['per_call']['median_s'] * 1e6:.2f} |" in row and row.endswith(f"| {100 * o['of_bandwidth']:.0f}% |")
    r = subprocess.run([sys.executable, REPORT, bench_js, "--ops", bench_js, "--md", md, "--svg", svg],
                       capture_output=True, timeout=60)
    assert r.returncode == 1 and b"not a ds4server-bench-ops/1 file" in r.stderr


@pytest.mark.parametrize("args", [["--div", "3"], ["--rows", "0"], ["--repeat", "x"], ["--bogus", "1"],
                                  ["--backend", "tpu"], ["--bandwidth", "-1"], ["--only", "no-such-product"]])
def test_ops_bench_bad_options(args):
    r = ds4("bench", "--ops", *args)
    assert r.returncode == 2 and b"bench --ops" in r.stderr, (args, r.stderr.decode())


def test_synthetic_model(tmp_path):
    """--synthetic: no weight file; the layout goes to $TMPDIR as a GGUF
    without weight data, removed once open, and the backend makes the
    weights. The report names the synthetic model and its seed; a bad name,
    or a file and a synthetic model together, is a usage error."""
    js = tmp_path / "s.json"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    r = subprocess.run([str(ROOT / "build" / "ds4server"), "bench", "--synthetic", "deepseek4-tiny-q2", "--ctx", "8",
                        "--prefill", "1", "--gen", "2", "--repeat", "1", "--ttft", "0", "--bandwidth", "10",
                        "--seed", "3", "--json", str(js)], capture_output=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr.decode()
    assert list(tmp.iterdir()) == []
    d = json.loads(js.read_text())
    m = d["provenance"]["model"]
    assert m["path"] == "synthetic deepseek4-tiny-q2, seed 3" and m["synthetic"] == "deepseek4-tiny-q2"
    assert m["n_layer"] == 5 and m["n_vocab"] == 1024
    assert d["decode"][0]["tokens_per_s"] > 0 and d["load"]["bytes_bound"] > 0
    for args in (["--synthetic", "deepseek4-huge-q2"], ["--synthetic", "deepseek4-tiny-q3"],
                 ["--synthetic", "llama-tiny-q2"], ["--synthetic", "deepseek4-tiny-q2", "-m", str(js)]):
        r = ds4("bench", *args, "--ctx", "8")
        assert r.returncode == 2, (args, r.stderr.decode())
    assert b"one of them" in r.stderr


def test_synthetic_layers(tmp_path):
    """--layers N: only the first N layers of the synthetic layout (a
    full-size model's layers on a smaller device); the report names them
    and the model has N layers. More layers than the layout has fails the
    run; --layers without --synthetic is a usage error."""
    js = tmp_path / "l.json"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    base = [str(ROOT / "build" / "ds4server"), "bench", "--synthetic", "deepseek4-tiny-q2", "--ctx", "8",
            "--prefill", "2", "--gen", "2", "--repeat", "1", "--ttft", "0", "--bandwidth", "10", "--seed", "3"]
    r = subprocess.run(base + ["--layers", "3", "--json", str(js)], capture_output=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr.decode()
    m = json.loads(js.read_text())["provenance"]["model"]
    assert m["n_layer"] == 3 and m["path"] == "synthetic deepseek4-tiny-q2 (first 3 layers), seed 3"
    r = subprocess.run(base + ["--layers", "9"], capture_output=True, timeout=300, env=env)
    assert r.returncode != 0 and b"9 layers" in r.stderr, r.stderr.decode()
    for args in (["-m", str(js), "--layers", "2"], ["--synthetic", "deepseek4-tiny-q2", "--layers", "0"]):
        r = ds4("bench", *args, "--ctx", "8")
        assert r.returncode == 2, (args, r.stderr.decode())


def test_ncu_source(tmp_path):
    """scripts/ncu_source.py sums ncu's per-instruction counters by opcode (loads
    keep their width, other opcodes lose their modifiers, predicates are not
    opcodes) and the stall reasons, and refuses a file without the columns."""
    script = ROOT / "scripts" / "ncu_source.py"
    src = tmp_path / "source.csv"
    cols = ['"Address"', '"Source"', '"Warp Stall Sampling (All Samples)"', '"Instructions Executed"',
            '"L1 Wavefronts Shared"', '"L1 Tag Requests Global"', '"stall_wait"', '"stall_wait (Not Issued)"',
            '"stall_short_sb"']
    src.write_text('"Kernel Name","void mv_kernel<16>(mv_args)",\n' + ",".join(cols) + "\n"
                   '"0x0","      IMAD.SHL.U32 R1, R2, 0x4, RZ","3","300","0","0","2","9","1"\n'
                   '"0x10","  @P0 IMAD R1, R2, R3, RZ","1","100","0","0","1","9","0"\n'
                   '"0x20","      LDS.U16 R4, [R1+0x2]","4","50","120","0","0","9","4"\n'
                   '"0x30","      LDS R4, [R1]","2","50","80","0","0","9","2"\n'
                   '"0x40","      LDG.E.128 R8, desc[UR4][R2.64]","0","25","0","200","0","9","0"\n'
                   '"0x50"\n')
    r = subprocess.run([sys.executable, str(script), str(src)], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    assert "kernel: `void mv_kernel<16>(mv_args)`" in out, out
    assert "525 warp instructions executed, 10 stall samples, 200 shared-memory wavefronts, " \
           "200 L1 global requests (1 rows without an instruction left out)" in out, out
    rows = [l for l in out.splitlines() if l.startswith("| `")]
    assert rows[0] == "| `IMAD` | 400 | 76.2% | 40.0% | 0 | 0 |", rows
    assert rows[1] == "| `LDS.U16` | 50 | 9.5% | 40.0% | 120 | 0 |", rows
    assert rows[2] == "| `LDS` | 50 | 9.5% | 20.0% | 80 | 0 |", rows
    assert rows[3] == "| `LDG.E.128` | 25 | 4.8% | 0.0% | 0 | 200 |", rows
    # stall reasons from the all-samples columns only, largest first
    assert "| short_sb | 70.0% |\n| wait | 30.0% |" in out, out
    assert "Not Issued" not in out
    r = subprocess.run([sys.executable, str(script), str(src), "--top", "1"], capture_output=True)
    assert r.returncode == 0 and len([l for l in r.stdout.decode().splitlines() if l.startswith("| `")]) == 1
    bad = tmp_path / "bad.csv"
    bad.write_text('"Kernel Name","k"\n"Address","Source"\n"0x0","NOP"\n')
    r = subprocess.run([sys.executable, str(script), str(bad)], capture_output=True)
    assert r.returncode != 0 and b"no 'Source'" in r.stderr
    r = subprocess.run([sys.executable, str(script), str(src), "--top"], capture_output=True)
    assert r.returncode != 0 and b"--top" in r.stderr


def test_ncu_table(tmp_path):
    """scripts/ncu_table.py sums an ncu raw CSV by kernel, in the units row's unit,
    after any log lines, and refuses a file without the duration column."""
    raw = tmp_path / "raw.csv"
    raw.write_text('==PROF== Connected to process 1\n'
                   '"ID","Kernel Name","Grid Size","gpu__time_duration.sum"\n'
                   '"","","","usecond"\n'
                   '"0","mv_kernel","(1, 1, 1)","2.5"\n'
                   '"1","rmsnorm","(1, 1, 1)","1,000.5"\n'
                   '"2","mv_kernel","(1, 1, 1)","3.5"\n')
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ncu_table.py"), str(raw)], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    assert out.startswith("3 kernels, 1006.5 us in all"), out
    rows = [l for l in out.splitlines() if l.startswith("| `")]
    assert rows[0].startswith("| `rmsnorm` | 1 | 1000.5 | 1000.50 |"), rows
    assert rows[1].startswith("| `mv_kernel` | 2 | 6.0 | 3.00 |"), rows
    bad = tmp_path / "bad.csv"
    bad.write_text('"ID","Kernel Name"\n"0","k"\n')
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ncu_table.py"), str(bad)], capture_output=True)
    assert r.returncode != 0 and b"no 'Kernel Name'" in r.stderr
    # rows without a number (ncu writes n/a) are left out and counted, short rows too
    odd = tmp_path / "odd.csv"
    odd.write_text('"ID","Kernel Name","gpu__time_duration.sum"\n"","","nsecond"\n'
                   '"0","k","2000"\n"1","k","n/a"\n"2"\n')
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ncu_table.py"), str(odd)], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().startswith("1 kernels, 2.0 us in all"), r.stdout.decode()
    assert b"2 rows without a duration left out" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ncu_table.py"), str(raw), "--top"], capture_output=True)
    assert r.returncode != 0 and b"--top" in r.stderr
    # DRAM bytes (in their units) give bytes per launch and the rate, --bandwidth its share
    mem = tmp_path / "mem.csv"
    mem.write_text('"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"\n'
                   '"","","Mbyte","Kbyte","usecond"\n'
                   '"0","mv","4","0","2"\n"1","mv","4","0","2"\n"2","norm","0.001","1","1"\n')
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ncu_table.py"), str(mem), "--bandwidth", "4000"],
                       capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    assert "3 kernels, 5.0 us in all" in out and "0.008 GB to and from device memory, 1600 GB/s, 40.0% of 4000" in out, out
    rows = [l for l in out.splitlines() if l.startswith("| `")]
    assert rows[0] == "| `mv` | 2 | 4.0 | 2.00 | 80.0% | 4.000 | 2000 | 50% |", rows
    assert rows[1] == "| `norm` | 1 | 1.0 | 1.00 | 20.0% | 0.002 | 2 | 0% |", rows
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ncu_table.py"), str(mem), "--bandwidth", "0"],
                       capture_output=True)
    assert r.returncode != 0 and b"--bandwidth" in r.stderr


def test_timeline(tmp_path):
    """scripts/timeline.py cuts the kernel records of scripts/cupti_trace.c into
    tokens at each embedding kernel and charges each instant to the running kernel
    that started first (the head of the chain), an instant with none running to
    the gap before the next kernel; one layer's kernels are listed in order."""
    us = 1000  # the records are in ns
    head = "start_ns,end_ns,graph_id,graph_node_id,stream,grid_x,grid_y,grid_z,block_x,registers,dynamic_smem,name\n"
    rows = []

    def k(start, end, name, grid="1,1,1"):
        rows.append("%d,%d,1,0,7,%s,256,64,0,%s" % (start * us, end * us, grid, name))

    for t0 in (0, 2000):  # two tokens of the same shape, 2000 us apart
        k(t0 + 0, t0 + 100, "embed_float_kernel")
        k(t0 + 150, t0 + 400, "hc_partial_kernel")      # 50 us gap before it
        k(t0 + 300, t0 + 600, "mv_kernel", "128,1,2")   # overlaps: at the head from 400 to 600
        k(t0 + 700, t0 + 800, "hc_partial_kernel")      # 100 us gap before it
        k(t0 + 800, t0 + 900, "rmsnorm_kernel")
        k(t0 + 900, t0 + 950, "hc_partial_kernel")
    k(4000, 4100, "embed_float_kernel")  # the third token's start closes the second
    trace = tmp_path / "trace.csv"
    trace.write_text(head + "\n".join(reversed(rows)) + "\n")  # (records come in any order)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "timeline.py"), str(trace), "--layer", "0"],
                       capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    assert "(kernel records, 2 tokens)" in out, out
    assert "| kernels a token | 6.000 | 6.000 | 6.000 |" in out, out
    assert "| first kernel start to last end (ms) | 0.950 | 0.950 | 0.950 |" in out, out
    assert "| some kernel running (ms) | 0.800 | 0.800 | 0.800 |" in out, out
    assert "| no kernel running (ms) | 0.150 | 0.150 | 0.150 |" in out, out
    assert "| kernel durations summed (ms) | 0.900 | 0.900 | 0.900 |" in out, out
    assert "(ms, includes the host between steps): 2.000, 2.000" in out, out
    by = {l.split("|")[1].strip(): l for l in out.splitlines() if l.startswith("| `")}
    # hc_partial: 3 launches, 250 + 100 + 50 us long, all of it at the head, the gaps of 50 and 100 us before two
    assert by["`hc_partial_kernel`"] == "| `hc_partial_kernel` | 3.0 | 0.400 | 0.400 | 0.150 | 133.33 |", by
    assert by["`mv_kernel`"] == "| `mv_kernel` | 1.0 | 0.300 | 0.200 | 0.000 | 200.00 |", by
    layer = out.split("## One layer")[1]
    assert "| 1 | `hc_partial_kernel` | 1x1x1 | 0.00 | 250.00 | 50.00 | 250.00 |" in layer, layer
    assert "| 2 | `mv_kernel` | 128x1x2 | 150.00 | 300.00 | 0.00 | 200.00 |" in layer, layer
    # a trace with fewer than two markers is refused with a message
    one = tmp_path / "one.csv"
    one.write_text(head + rows[0] + "\n")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "timeline.py"), str(one)], capture_output=True)
    assert r.returncode != 0 and b"--marker" in r.stderr
