"""DeepSeek V4 model math against Hugging Face transformers (tests/oracle/).

For every committed fixture (tests/oracle/fixtures/NAME.greedy.json + NAME.logits.npy,
made by tests/oracle/gen_fixtures.py from transformers 5.17 in float64):
  - regenerate the seeded checkpoint (gen_weights.py, numpy only) and check it is
    byte-identical to the one the fixture was made from;
  - `ds4server convert --from-hf` it to an F32 GGUF;
  - `ds4server logits --numerics reference` over prompt + 32 greedy tokens:
    relative error ||ours - ref|| / ||ref|| < 1e-4 at every prompt position,
    and the argmax at each continuation position is the reference's next greedy token;
  - the DS4-aligned config also runs `--numerics ds4` (F32 and Q8_0 files): the
    error is printed, with only a loose sanity bound.

Also: convert's output read back with gguf-py against the safetensors arrays
(names, shapes, no transposes, fused and per-expert experts, tid2eid as I32,
metadata), and convert's refusals of bad input.
"""
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from conftest import ROOT, ds4

ORACLE = ROOT / "tests" / "oracle"
FIXTURES = ORACLE / "fixtures"
sys.path.insert(0, str(ORACLE))
import gen_weights  # noqa: E402

FIXTURE_NAMES = sorted(p.name[: -len(".greedy.json")] for p in FIXTURES.glob("*.greedy.json"))
REL_TOL = 1e-4
# `ds4` numerics round activations (Q8_0, FP8 KV rows, FP4 indexer, ...), which on tiny random models moves
# logits by several percent and flips some indexer choices: only a sanity bound (unrelated logits of the
# same norm would sit near sqrt(2)).
DS4_LOOSE_MEDIAN, DS4_LOOSE_MAX = 0.3, 1.0
THREADS = str(os.cpu_count() or 1)


def load_spec(name):
    return json.loads((ORACLE / "configs" / f"{name}.json").read_text())


def regenerate(name, fx, d):
    spec = load_spec(name)
    gen_weights.generate(spec, d, fx["seed"])
    sha = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
    assert sha == fx["weights_sha256"], (
        f"{name}: gen_weights.py did not reproduce the checkpoint the fixture was made from "
        f"(sha256 {sha} != {fx['weights_sha256']}); regenerate the fixtures (make oracle)")
    assert json.loads((d / "tokens.json").read_text()) == fx["prompt"], f"{name}: prompt tokens differ"
    return spec


def convert(d, out, quant):
    r = ds4("convert", "--from-hf", d, "--out", out, "--quant", quant, timeout=600)
    assert r.returncode == 0, f"convert failed: {r.stderr.decode(errors='replace')}"
    return out


def run_logits(model, ids, out, numerics, *extra):
    r = ds4("logits", "-m", model, "--tokens", ",".join(map(str, ids)), "--out", out, "--numerics", numerics,
            "--backend", "cpu", "--threads", THREADS, *extra, timeout=1800)
    assert r.returncode == 0, f"logits ({numerics}) failed: {r.stderr.decode(errors='replace')}"
    return np.fromfile(out, dtype="<f4")


def rel_err_rows(a, ref):
    a = a.astype(np.float64)
    ref = ref.astype(np.float64)
    return np.linalg.norm(a - ref, axis=1) / np.linalg.norm(ref, axis=1)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_oracle_logits(name, tmp_path, ds4server):
    fx = json.loads((FIXTURES / f"{name}.greedy.json").read_text())
    ref = np.load(FIXTURES / f"{name}.logits.npy")
    prompt, greedy, V = fx["prompt"], fx["greedy"], fx["vocab_size"]
    n = len(prompt)
    assert ref.shape == (n, V)
    d = tmp_path / "hf"
    regenerate(name, fx, d)
    model = convert(d, tmp_path / "m.gguf", "f32")
    ids = prompt + greedy
    ours = run_logits(model, ids, tmp_path / "l.f32", "reference")
    assert ours.size == len(ids) * V, f"logits file has {ours.size} floats, expected {len(ids)} x {V}"
    ours = ours.reshape(len(ids), V)
    assert np.isfinite(ours).all(), "non-finite logits"
    err = rel_err_rows(ours[:n], ref)
    worst = int(np.argmax(err))
    print(f"{name}: reference numerics: rel err max {err.max():.3g} (position {worst}), median "
          f"{np.median(err):.3g}; transformers' own f32-vs-f64 max {fx['transformers_f32_vs_f64_rel_err']['max']:.3g}")
    assert err.max() < REL_TOL, (
        f"{name}: relative error {err.max():.3g} at position {worst} (of {n}) exceeds {REL_TOL}; "
        f"{int((err >= REL_TOL).sum())} positions over; first over at {int(np.argmax(err >= REL_TOL))}")
    # The same sequence split into prefill, single-token decode and prefill
    # again from a non-zero position meets the same tolerance.
    split = run_logits(model, ids, tmp_path / "s.f32", "reference", "--chunks", "1,1,37,5,1,100")
    split = split.reshape(len(ids), V)
    assert rel_err_rows(split[:n], ref).max() < REL_TOL
    assert np.array_equal(split[n - 1:-1].argmax(axis=1), ours[n - 1:-1].argmax(axis=1))
    got = ours[n - 1:-1].argmax(axis=1)
    bad = [i for i in range(len(greedy)) if int(got[i]) != greedy[i]]
    assert not bad, (f"{name}: greedy continuation differs at steps {bad} (ours {[int(got[i]) for i in bad]}, "
                     f"reference {[greedy[i] for i in bad]}; reference top-2 gaps "
                     f"{[fx['margins']['greedy_rel_gaps'][i] for i in bad]})")


def test_oracle_ds4_numerics(tmp_path, ds4server):
    """The DS4-aligned config under `--numerics ds4` and `ds4-f16` (whose binary16 products touch only the
    Q8_0 file's prompt): printed, loosely bounded."""
    name = "aligned"
    if name not in FIXTURE_NAMES:
        pytest.fail("the aligned fixture is missing")
    fx = json.loads((FIXTURES / f"{name}.greedy.json").read_text())
    ref = np.load(FIXTURES / f"{name}.logits.npy")
    n = len(fx["prompt"])
    d = tmp_path / "hf"
    regenerate(name, fx, d)
    ids = fx["prompt"] + fx["greedy"]
    for quant, numerics in (("f32", "ds4"), ("q8_0", "ds4"), ("q8_0", "ds4-f16")):
        model = tmp_path / f"m.{quant}.gguf"
        if not model.exists():
            convert(d, model, quant)
        ours = run_logits(model, ids, tmp_path / f"l.{quant}.{numerics}.f32", numerics).reshape(len(ids), -1)
        err = rel_err_rows(ours[:n], ref)
        agree = float((ours[n - 1:-1].argmax(axis=1) == np.array(fx["greedy"])).mean())
        print(f"{name}: {numerics} numerics, {quant} file: rel err max {err.max():.3g} median {np.median(err):.3g}, "
              f"greedy agreement {agree:.0%}")
        assert np.isfinite(ours).all()
        assert np.median(err) < DS4_LOOSE_MEDIAN and err.max() < DS4_LOOSE_MAX, (
            f"{name} ({quant}, {numerics} numerics): rel err median {np.median(err):.3g}, max {err.max():.3g}")


# ---------------------------------------------------------------- convert


def read_gguf(path):
    r = GGUFReader(str(path))
    tensors = {t.name: t for t in r.tensors}
    meta = {}
    for f in r.fields.values():
        if f.name.startswith("deepseek4.") or f.name == "general.architecture":
            meta[f.name] = f.contents()
    return tensors, meta


def gguf_name(hf, n_layer):
    """HF saved / upstream name -> GGUF name (spec 12.3), for the round-trip check."""
    n = hf[len("model."):] if hf.startswith("model.") else hf
    glob = {"embed_tokens.weight": "token_embd.weight", "embed.weight": "token_embd.weight",
            "head.weight": "output.weight", "norm.weight": "output_norm.weight",
            "hc_head.hc_fn": "output_hc_fn.weight", "hc_head_fn": "output_hc_fn.weight",
            "hc_head.hc_base": "output_hc_base.weight", "hc_head_base": "output_hc_base.weight",
            "hc_head.hc_scale": "output_hc_scale.weight", "hc_head_scale": "output_hc_scale.weight"}
    if n in glob:
        return glob[n]
    _, li, rest = n.split(".", 2)
    per = {"hc_attn_fn": "hc_attn_fn.weight", "hc_attn_base": "hc_attn_base.weight",
           "hc_attn_scale": "hc_attn_scale.weight", "hc_ffn_fn": "hc_ffn_fn.weight",
           "hc_ffn_base": "hc_ffn_base.weight", "hc_ffn_scale": "hc_ffn_scale.weight",
           "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
           "attn.wq_a.weight": "attn_q_a.weight", "attn.q_norm.weight": "attn_q_a_norm.weight",
           "attn.wq_b.weight": "attn_q_b.weight", "attn.wkv.weight": "attn_kv.weight",
           "attn.norm.weight": "attn_kv_a_norm.weight", "attn.kv_norm.weight": "attn_kv_a_norm.weight",
           "attn.attn_sink": "attn_sinks.weight", "attn.wo_a.weight": "attn_output_a.weight",
           "attn.wo_b.weight": "attn_output_b.weight", "ffn.gate.weight": "ffn_gate_inp.weight",
           "ffn.gate.bias": "exp_probs_b.bias", "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",
           "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
           "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
           "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
           "attn.compressor.ape": "attn_compressor_ape.weight", "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
           "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
           "attn.compressor.norm.weight": "attn_compressor_norm.weight",
           "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
           "attn.indexer.weights_proj.weight": "indexer.proj.weight",
           "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
           "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
           "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
           "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight"}
    return f"blk.{li}.{per[rest]}"


def expected_gguf_arrays(tensors, n_layer):
    """GGUF name -> array in numpy (reversed ggml) shape, built from the HF arrays."""
    want, experts = {}, {}
    for name, arr in tensors:
        parts = name.split(".")
        if ".experts." in name and "shared" not in name:
            li = int(parts[parts.index("layers") + 1])
            if name.endswith("gate_up_proj"):
                I = arr.shape[1] // 2
                want[f"blk.{li}.ffn_gate_exps.weight"] = arr[:, :I, :]
                want[f"blk.{li}.ffn_up_exps.weight"] = arr[:, I:, :]
            elif name.endswith("down_proj"):
                want[f"blk.{li}.ffn_down_exps.weight"] = arr
            else:
                e, w = int(parts[-3]), parts[-2]
                experts.setdefault((li, w), {})[e] = arr
            continue
        a = arr.astype(np.int32) if arr.dtype == np.int64 else arr
        want[gguf_name(name, n_layer)] = a
    for (li, w), d in experts.items():
        g = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}[w]
        want[f"blk.{li}.{g}.weight"] = np.stack([d[e] for e in sorted(d)])
    return want


@pytest.mark.parametrize("name", ["mixed", "long", "sliding"])
def test_convert_roundtrip(name, tmp_path, ds4server):
    """Every GGUF tensor holds exactly the HF array's bytes (no transposes), in F32."""
    spec = load_spec(name)
    d = gen_weights.generate(spec, tmp_path / "hf")
    tensors = gen_weights.build_tensors(spec["config"], spec["seed"], spec.get("naming", "saved"),
                                        spec.get("experts", "per_expert"))
    out = convert(d, tmp_path / "m.gguf", "f32")
    got, meta = read_gguf(out)
    cfg = spec["config"]
    want = expected_gguf_arrays(tensors, cfg["num_hidden_layers"])
    assert set(got) == set(want), f"tensor sets differ: {set(got) ^ set(want)}"
    for k, a in want.items():
        t = got[k]
        data = np.asarray(t.data)
        assert list(t.shape) == list(reversed(a.shape)), f"{k}: ggml shape {list(t.shape)} vs torch {a.shape}"
        assert data.shape == a.shape and np.array_equal(data, a), f"{k}: data differs"
        assert (t.tensor_type.name == "I32") == (a.dtype == np.int32), k
    ratios, hashed = gen_weights.layer_schedule(cfg)
    assert list(meta["deepseek4.attention.compress_ratios"]) == ratios
    assert meta["deepseek4.block_count"] == cfg["num_hidden_layers"]
    assert meta["deepseek4.attention.head_count_kv"] == 1
    assert meta["deepseek4.hash_layer_count"] == sum(hashed)
    assert meta["deepseek4.rope.dimension_count"] == gen_weights.rope_dims(cfg)
    assert meta["deepseek4.attention.sliding_window"] == cfg["sliding_window"]
    assert meta["deepseek4.expert_weights_norm"] is True
    assert all(x == pytest.approx(cfg["swiglu_limit"]) for x in meta["deepseek4.swiglu_clamp_exp"])
    rp = cfg["rope_parameters"]
    comp = rp.get("compress", rp)
    assert meta["deepseek4.rope.freq_base"] == pytest.approx(cfg["rope_theta"])
    assert meta["deepseek4.attention.compress_rope_freq_base"] == pytest.approx(cfg["compress_rope_theta"])
    assert meta["deepseek4.rope.scaling.factor"] == pytest.approx(comp["factor"])
    assert meta["deepseek4.rope.scaling.original_context_length"] == comp["original_max_position_embeddings"]
    assert meta["deepseek4.rope.scaling.yarn_beta_fast"] == pytest.approx(comp["beta_fast"])
    assert meta["deepseek4.rope.scaling.yarn_beta_slow"] == pytest.approx(comp["beta_slow"])


def test_convert_quantised(tmp_path, ds4server):
    """q8_0 / q2 / q4 files of the aligned config: right types, values close to the source."""
    from gguf import quants

    spec = load_spec("aligned")
    d = gen_weights.generate(spec, tmp_path / "hf")
    tensors = dict(gen_weights.build_tensors(spec["config"], spec["seed"]))
    for quant, exp_types in (("q8_0", ("Q8_0", "Q8_0")), ("q2", ("IQ2_XXS", "Q2_K")), ("q4", ("Q4_K", "Q4_K"))):
        got, _ = read_gguf(convert(d, tmp_path / f"m.{quant}.gguf", quant))
        assert got["blk.0.ffn_gate_exps.weight"].tensor_type.name == exp_types[0]
        assert got["blk.0.ffn_down_exps.weight"].tensor_type.name == exp_types[1]
        assert got["token_embd.weight"].tensor_type.name == "F16"
        assert got["output.weight"].tensor_type.name == "Q8_0"
        assert got["blk.1.attn_compressor_ape.weight"].tensor_type.name == "F16"
        assert got["blk.0.hc_attn_base.weight"].tensor_type.name == "F32"
        t = got["blk.3.attn_q_a.weight"]
        deq = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tensors["model.layers.3.attn.wq_a.weight"].shape)
        src = tensors["model.layers.3.attn.wq_a.weight"]
        assert np.abs(deq - src).max() <= np.abs(src).max() / 100
        ape = np.asarray(got["blk.1.attn_compressor_ape.weight"].data)
        assert np.array_equal(ape, tensors["model.layers.1.attn.compressor.ape"].astype(np.float16))


def write_ckpt(d, cfg, tensors):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    gen_weights.write_safetensors(d / "model.safetensors", tensors, {"format": "pt"})


def refuse(tmp_path, d, *needles, quant="f32"):
    out = tmp_path / "refused.gguf"
    r = ds4("convert", "--from-hf", d, "--out", out, "--quant", quant)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 1, f"exit {r.returncode}: {err}"
    assert err.startswith("ds4server convert: ") and err.count("\n") == 1, f"not one line: {err!r}"
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    assert not out.exists() and not Path(str(out) + ".tmp").exists()
    return err


@pytest.fixture(scope="module")
def small():
    spec = load_spec("sliding")
    return spec["config"], gen_weights.build_tensors(spec["config"], 5, "saved")


def test_convert_refuses_bad_tensors(tmp_path, small, ds4server):
    cfg, tensors = small
    t = dict(tensors)
    # a missing tensor is named
    d = tmp_path / "missing"
    write_ckpt(d, cfg, [(k, v) for k, v in tensors if k != "model.layers.1.attn.wkv.weight"])
    refuse(tmp_path, d, "model.layers.1.attn.wkv.weight", "blk.1.attn_kv.weight", "missing")
    # a missing expert
    d = tmp_path / "missing_expert"
    write_ckpt(d, cfg, [(k, v) for k, v in tensors if k != "model.layers.0.ffn.experts.3.w2.weight"])
    refuse(tmp_path, d, "experts.3.w2", "missing")
    # a wrong shape names the tensor, the expected and the found shape (a transposed matrix)
    d = tmp_path / "shape"
    bad = [(k, v.T.copy() if k == "model.layers.0.attn.wq_a.weight" else v) for k, v in tensors]
    write_ckpt(d, cfg, bad)
    q = t["model.layers.0.attn.wq_a.weight"].shape
    refuse(tmp_path, d, "model.layers.0.attn.wq_a.weight", f"expected shape [{q[0]}, {q[1]}]",
           f"found [{q[1]}, {q[0]}]")
    # tid2eid out of range
    d = tmp_path / "tid"
    tid = t["model.layers.0.ffn.gate.tid2eid"].copy()
    tid[7, 1] = cfg["n_routed_experts"]
    write_ckpt(d, cfg, [(k, tid if k.endswith("tid2eid") else v) for k, v in tensors])
    refuse(tmp_path, d, "tid2eid", "token 7", "outside [0, 4)")
    # a float tensor stored as an integer dtype
    d = tmp_path / "dtype"
    write_ckpt(d, cfg, [(k, v.astype(np.int32) if k == "model.norm.weight" else v) for k, v in tensors])
    refuse(tmp_path, d, "model.norm.weight", "dtype I32")
    # NaN in a weight
    d = tmp_path / "nan"
    w = t["head.weight"].copy()
    w[3, 2] = np.nan
    write_ckpt(d, cfg, [(k, w if k == "head.weight" else v) for k, v in tensors])
    refuse(tmp_path, d, "head.weight", "not finite")
    # a damaged safetensors file
    d = tmp_path / "damaged"
    write_ckpt(d, cfg, tensors)
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-5])
    refuse(tmp_path, d, "model.safetensors", "past the end")
    # no checkpoint files, no config
    d = tmp_path / "nofiles"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    refuse(tmp_path, d, "neither model.safetensors.index.json nor model.safetensors")
    refuse(tmp_path, tmp_path / "nowhere", "config.json")
    # extra tensors (e.g. MTP) are ignored and counted
    d = tmp_path / "extra"
    write_ckpt(d, cfg, tensors + [("mtp.0.e_proj.weight", np.ones((4, 4), np.float32)),
                                  ("mtp.0.norm.weight", np.ones(4, np.float32))])
    r = ds4("convert", "--from-hf", d, "--out", tmp_path / "ok.gguf", "--quant", "f32")
    assert r.returncode == 0, r.stderr
    assert b"ignored 2 unused checkpoint tensors" in r.stdout


def test_convert_sharded(tmp_path, small, ds4server):
    """model.safetensors.index.json with two shards gives the same file as one shard."""
    cfg, tensors = small
    one = tmp_path / "one"
    write_ckpt(one, cfg, tensors)
    two = tmp_path / "two"
    two.mkdir()
    (two / "config.json").write_text(json.dumps(cfg))
    half = len(tensors) // 2
    shards = {"model-00001-of-00002.safetensors": tensors[:half], "model-00002-of-00002.safetensors": tensors[half:]}
    wm = {}
    for fname, ts in shards.items():
        gen_weights.write_safetensors(two / fname, ts, {"format": "pt"})
        wm.update({k: fname for k, _ in ts})
    (two / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    a, b = convert(one, tmp_path / "a.gguf", "f32"), convert(two, tmp_path / "b.gguf", "f32")
    assert a.read_bytes() == b.read_bytes()


BAD_CONFIGS = [
    ({"num_key_value_heads": 2}, ["num_key_value_heads is 2"]),
    ({"scoring_func": "softmax"}, ["scoring_func", "sqrtsoftplus"]),
    ({"hidden_act": "gelu"}, ["hidden_act"]),
    ({"tie_word_embeddings": True}, ["tie_word_embeddings"]),
    ({"attention_bias": True}, ["attention_bias"]),
    ({"n_shared_experts": 2}, ["n_shared_experts is 2"]),
    ({"layer_types": None}, ["neither \"layer_types\" nor \"compress_ratios\""]),
    ({"layer_types": ["sliding_attention"]}, ["layer_types"]),
    ({"layer_types": ["sliding_attention", "full_attention"]}, ["layer_types[1]"]),
    ({"compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 128},
      "layer_types": ["sliding_attention", "compressed_sparse_attention"]}, ["ratio 8", "ratio 4 only"]),
    ({"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 64},
      "layer_types": ["sliding_attention", "heavily_compressed_attention"]}, ["ratio 64"]),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                          "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                                       "original_max_position_embeddings": 65536}}},
     ["attention_factor is 1.27", "set \"attention_factor\": 1.0"]),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                          "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                                       "original_max_position_embeddings": 65536, "attention_factor": 1.2}}},
     ["attention_factor is 1.2"]),
    ({"rope_parameters": {"main": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                          "compress": {"rope_type": "default", "rope_theta": 160000.0}}}, ["main.rope_type"]),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                          "compress": {"rope_type": "longrope", "rope_theta": 160000.0}}}, ["longrope"]),
    ({"model_type": "llama"}, ["model_type is 'llama'"]),
    ({"quantization_config": {"quant_method": "fp8"}}, ["quantization_config"]),
    ({"hidden_size": "64"}, ["hidden_size"]),
    ({"index_head_dim": 24, "layer_types": ["sliding_attention", "compressed_sparse_attention"]},
     ["power of two"]),
]


@pytest.mark.parametrize("change,needles", BAD_CONFIGS, ids=[str(i) for i in range(len(BAD_CONFIGS))])
def test_convert_refuses_bad_config(change, needles, tmp_path, small, ds4server):
    cfg, tensors = small
    cfg = dict(cfg)
    for k, v in change.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    d = tmp_path / "cfg"
    write_ckpt(d, cfg, tensors)
    refuse(tmp_path, d, "config.json", *needles)


def test_convert_refuses_invalid_json_and_quant(tmp_path, small, ds4server):
    cfg, tensors = small
    d = tmp_path / "json"
    write_ckpt(d, cfg, tensors)
    (d / "config.json").write_text('{"hidden_size": 32,')
    refuse(tmp_path, d, "config.json", "invalid JSON")
    write_ckpt(d, cfg, tensors)
    refuse(tmp_path, d, "--quant q4 cannot store this model", "cannot be stored as", quant="q4")
    r = ds4("convert", "--from-hf", d, "--out", tmp_path / "x.gguf", "--quant", "q3")
    assert r.returncode == 1 and b"unknown --quant 'q3'" in r.stderr
    r = ds4("convert", "--out", tmp_path / "x.gguf")
    assert r.returncode == 1 and b"usage" in r.stderr
