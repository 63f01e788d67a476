#!/usr/bin/env python3
"""Seeded random DeepseekV4 checkpoints for the oracle tests (numpy only, no torch).

    gen_weights.py SPEC.json OUTDIR [--seed N]

SPEC is tests/oracle/configs/NAME.json:
    {
      "config":    the transformers DeepseekV4 config dict (written as OUTDIR/config.json),
      "seed":      weight seed,
      "n_tokens":  prompt length,
      "token_seed": prompt seed,
      "naming":    "saved" (transformers 5.17 save_pretrained names, default) or "upstream"
                   (DeepSeek's original names: embed.weight, hc_head_fn, attn.kv_norm, no "model." prefix),
      "experts":   "per_expert" (ffn.experts.E.w1/w2/w3, default) or "fused"
                   (model.layers.N.mlp.experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I])
    }

Writes OUTDIR/config.json, OUTDIR/model.safetensors and OUTDIR/tokens.json.
The output is a pure function of SPEC (and --seed, which overrides the spec's
seed): the same bytes on every run and every machine. All randomness comes
from numpy's PCG64 `Generator.random()` (uniform doubles, a bit-stable
stream), transformed here into scaled uniform variables, so no distribution
sampler whose algorithm could change between numpy versions is involved.

Every tensor that transformers' own initialisation sets to zero or one is
randomised (compressor/indexer position bias, attention sinks, HC base and
scale, router bias, norm weights), and tid2eid holds k distinct experts per
token in [0, E), so layout mistakes in those tensors cannot hide (spec 12.1).
"""
import argparse
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np

SQRT3 = math.sqrt(3.0)

# transformers defaults for keys a spec may omit (configuration_deepseek_v4.py, 5.17)
DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024, "num_experts_per_tok": 6,
    "n_routed_experts": 256, "hc_mult": 4, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 512,
}
RATIO_OF_TYPE = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


class Rng:
    """Uniform-based random tensors from PCG64's raw doubles."""

    def __init__(self, seed):
        self.g = np.random.Generator(np.random.PCG64(seed))

    def uniform(self, shape, lo, hi):
        n = int(np.prod(shape)) if shape else 1
        u = self.g.random(n)  # float64 in [0, 1): (next_uint64 >> 11) * 2**-53
        return (lo + (hi - lo) * u).reshape(shape)

    def sym(self, shape, std):
        """Zero-mean uniform with the given standard deviation."""
        a = SQRT3 * std
        return self.uniform(shape, -a, a)


def layer_schedule(cfg):
    n = cfg["num_hidden_layers"]
    if "layer_types" in cfg:
        ratios = [RATIO_OF_TYPE[t] for t in cfg["layer_types"]]
    elif "compress_ratios" in cfg:
        ratios = list(cfg["compress_ratios"][:n])
    else:
        raise SystemExit("spec config needs layer_types or compress_ratios")
    if "mlp_layer_types" in cfg:
        hashed = [t == "hash_moe" for t in cfg["mlp_layer_types"]]
    else:
        nh = cfg.get("num_hash_layers", 3)
        hashed = [i < nh for i in range(n)]
    assert len(ratios) == n and len(hashed) == n
    return ratios, hashed


def rope_dims(cfg):
    D = cfg.get("head_dim", DEFAULTS["head_dim"])
    if cfg.get("partial_rotary_factor") is not None:
        return int(D * cfg["partial_rotary_factor"])
    if cfg.get("qk_rope_head_dim") is not None:
        return int(cfg["qk_rope_head_dim"])
    return int(D * 64 / 512)


def build_tensors(cfg, seed, naming="saved", experts="per_expert"):
    """Ordered list of (name, array). Arrays are float32 except tid2eid (int64)."""
    g = {k: cfg.get(k, v) for k, v in DEFAULTS.items()}
    V, H, I, L = g["vocab_size"], g["hidden_size"], g["moe_intermediate_size"], g["num_hidden_layers"]
    nh, D, qr, k, E = g["num_attention_heads"], g["head_dim"], g["q_lora_rank"], g["num_experts_per_tok"], \
        g["n_routed_experts"]
    hc, G, ro, ih, idim = g["hc_mult"], g["o_groups"], g["o_lora_rank"], g["index_n_heads"], g["index_head_dim"]
    M = (2 + hc) * hc
    ratios, hashed = layer_schedule(cfg)
    rng = Rng(seed)
    up = naming == "upstream"
    pre = "" if up else "model."
    out = []

    def add(name, arr):
        out.append((name, np.ascontiguousarray(arr)))

    def mat(rows, cols):  # a projection: y = W x, W [rows, cols], fan-in cols
        return rng.sym((rows, cols), 1.0 / math.sqrt(cols)).astype(np.float32)

    def norm(n):
        return rng.uniform((n,), 0.75, 1.25).astype(np.float32)

    add("embed.weight" if up else "model.embed_tokens.weight", rng.sym((V, H), 1.0).astype(np.float32))
    add("head.weight", mat(V, H))
    add(f"{pre}norm.weight", norm(H))
    add("hc_head_fn" if up else "model.hc_head.hc_fn", mat(hc, hc * H))
    add("hc_head_base" if up else "model.hc_head.hc_base", rng.sym((hc,), 0.5).astype(np.float32))
    add("hc_head_scale" if up else "model.hc_head.hc_scale", rng.uniform((1,), 0.5, 1.5).astype(np.float32))
    for li in range(L):
        p = f"{pre}layers.{li}."
        m = ratios[li]
        for site in ("attn", "ffn"):
            add(f"{p}hc_{site}_fn", mat(M, hc * H))
            add(f"{p}hc_{site}_base", rng.sym((M,), 0.5).astype(np.float32))
            add(f"{p}hc_{site}_scale", rng.uniform((3,), 0.5, 1.5).astype(np.float32))
        add(f"{p}attn_norm.weight", norm(H))
        add(f"{p}ffn_norm.weight", norm(H))
        add(f"{p}attn.wq_a.weight", mat(qr, H))
        add(f"{p}attn.q_norm.weight", norm(qr))
        add(f"{p}attn.wq_b.weight", mat(nh * D, qr))
        add(f"{p}attn.wkv.weight", mat(D, H))
        add(f"{p}attn.{'kv_norm' if up else 'norm'}.weight", norm(D))
        add(f"{p}attn.attn_sink", rng.sym((nh,), 1.0).astype(np.float32))
        add(f"{p}attn.wo_a.weight", mat(G * ro, nh * D // G))
        add(f"{p}attn.wo_b.weight", mat(H, G * ro))
        if m:
            c = 2 if m == 4 else 1
            add(f"{p}attn.compressor.ape", rng.sym((m, c * D), 0.5).astype(np.float32))
            add(f"{p}attn.compressor.wkv.weight", mat(c * D, H))
            add(f"{p}attn.compressor.wgate.weight", mat(c * D, H))
            add(f"{p}attn.compressor.norm.weight", norm(D))
        if m == 4:
            add(f"{p}attn.indexer.wq_b.weight", mat(ih * idim, qr))
            add(f"{p}attn.indexer.weights_proj.weight", mat(ih, H))
            add(f"{p}attn.indexer.compressor.ape", rng.sym((4, 2 * idim), 0.5).astype(np.float32))
            add(f"{p}attn.indexer.compressor.wkv.weight", mat(2 * idim, H))
            add(f"{p}attn.indexer.compressor.wgate.weight", mat(2 * idim, H))
            add(f"{p}attn.indexer.compressor.norm.weight", norm(idim))
        add(f"{p}ffn.gate.weight", mat(E, H))
        if hashed[li]:
            # k distinct experts per token: the first k of a random permutation of [0, E)
            keys = rng.uniform((V, E), 0.0, 1.0)
            add(f"{p}ffn.gate.tid2eid", np.argsort(keys, axis=1, kind="stable")[:, :k].astype(np.int64))
        else:
            add(f"{p}ffn.gate.bias", rng.sym((E,), 0.1).astype(np.float32))
        w1 = [mat(I, H) for _ in range(E)]
        w3 = [mat(I, H) for _ in range(E)]
        w2 = [mat(H, I) for _ in range(E)]
        if experts == "fused":
            add(f"model.layers.{li}.mlp.experts.gate_up_proj",
                np.stack([np.concatenate([a, b], axis=0) for a, b in zip(w1, w3)]))
            add(f"model.layers.{li}.mlp.experts.down_proj", np.stack(w2))
        else:
            for e in range(E):
                add(f"{p}ffn.experts.{e}.w1.weight", w1[e])
                add(f"{p}ffn.experts.{e}.w2.weight", w2[e])
                add(f"{p}ffn.experts.{e}.w3.weight", w3[e])
        add(f"{p}ffn.shared_experts.w1.weight", mat(I, H))
        add(f"{p}ffn.shared_experts.w2.weight", mat(H, I))
        add(f"{p}ffn.shared_experts.w3.weight", mat(I, H))
    return out


DTYPE_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.float16): "F16",
               np.dtype(np.int64): "I64", np.dtype(np.int32): "I32"}


def write_safetensors(path, tensors, metadata=None):
    """The safetensors format: u64 header length, JSON header (padded with spaces
    to a multiple of 8), then the tensors' bytes back to back in header order."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    pos = 0
    for name, arr in tensors:
        n = arr.nbytes
        header[name] = {"dtype": DTYPE_NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [pos, pos + n]}
        pos += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, arr in tensors:
            f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())


def tokens_for(spec, vocab):
    rng = Rng(spec["token_seed"])
    return [int(x) for x in np.floor(rng.uniform((spec["n_tokens"],), 0.0, 1.0) * vocab).astype(np.int64)]


def generate(spec, outdir, seed=None):
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    cfg = dict(spec["config"])
    cfg.setdefault("model_type", "deepseek_v4")
    cfg.setdefault("architectures", ["DeepseekV4ForCausalLM"])
    seed = spec["seed"] if seed is None else seed
    tensors = build_tensors(cfg, seed, spec.get("naming", "saved"), spec.get("experts", "per_expert"))
    (outdir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    write_safetensors(outdir / "model.safetensors", tensors, {"format": "pt"})
    vocab = cfg.get("vocab_size", DEFAULTS["vocab_size"])
    (outdir / "tokens.json").write_text(json.dumps(tokens_for(spec, vocab)) + "\n")
    return outdir


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("spec")
    ap.add_argument("outdir")
    ap.add_argument("--seed", type=int, default=None, help="override the spec's weight seed")
    a = ap.parse_args()
    generate(json.loads(Path(a.spec).read_text()), a.outdir, a.seed)


if __name__ == "__main__":
    sys.exit(main())
