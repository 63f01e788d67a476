#!/usr/bin/env python3
"""Reference logits from Hugging Face transformers' DeepseekV4ForCausalLM.

    gen_fixtures.py [NAME ...] [--check] [--tries N]

For each tests/oracle/configs/NAME.json (all of them by default):
  1. gen_weights.py writes the seeded checkpoint into a temporary directory;
  2. transformers (5.17, eager attention, CPU) loads it twice: in float64 (with
     its internal float32 casts lifted, see F64) and in float32;
  3. the float64 model decodes 32 greedy tokens after the prompt (full
     recompute per step), then runs once over prompt + continuation with hooks
     that record the indexer scores, the router scores and the SwiGLU clamp;
  4. pitfall checks (spec section 12.1): loading used every tensor and left
     nothing at its init value; the compress rotary's attention scaling is
     exactly 1.0; >= 16 indexer heads; no indexer or router top-k boundary
     closer than 1e-5 relative; no greedy step whose top-2 logit gap is below
     1e-3 of the largest logit. A failing seed is replaced by the next one
     (seed + 1000 i, up to --tries); the seed used is recorded.
  5. writes fixtures/NAME.logits.npy (float32 [n_prompt, vocab], the float64
     logits rounded once) and fixtures/NAME.greedy.json (prompt, 32 greedy ids,
     seed, margins, and transformers' own float32-vs-float64 error).

--check regenerates into memory and compares with the committed fixtures
instead of writing (exit 1 on a difference beyond 1e-6 relative per position
or any greedy difference).

Needs torch + transformers (not part of tests/requirements.txt): run with
ORACLE_PYTHON=/path/to/python make oracle.
"""
import argparse
import contextlib
import hashlib
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdv4

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gen_weights  # noqa: E402

N_GREEDY = 32
TOPK_REL_GAP = 1e-5
GREEDY_REL_GAP = 1e-3


@contextlib.contextmanager
def F64():
    """Run transformers' DeepseekV4 in float64 throughout.

    The model casts to float32 in several places (RMSNorm, the HC modules,
    the rotary tables and inv_freq, the indexer scorer, the compressor
    softmax), so loading it with dtype=float64 alone still rounds to float32
    there. Inside this context every request for a float32 (or lower) float
    dtype made through Tensor.float / Tensor.to / softmax(dtype=) / arange
    yields float64 instead. Build and run the float64 model inside it."""
    low = (torch.float32, torch.float16, torch.bfloat16)
    up = lambda dt: torch.float64 if dt in low else dt  # noqa: E731
    orig = {"float": torch.Tensor.float, "to": torch.Tensor.to, "tsoftmax": torch.Tensor.softmax,
            "fsoftmax": F.softmax, "arange": torch.arange}

    def t_float(self, *a, **k):
        return orig["to"](self, torch.float64)

    def t_to(self, *a, **k):
        a = tuple(up(x) if isinstance(x, torch.dtype) else x for x in a)
        if isinstance(k.get("dtype"), torch.dtype):
            k["dtype"] = up(k["dtype"])
        return orig["to"](self, *a, **k)

    def t_softmax(self, *a, **k):
        if isinstance(k.get("dtype"), torch.dtype):
            k["dtype"] = up(k["dtype"])
        return orig["tsoftmax"](self, *a, **k)

    def f_softmax(*a, **k):
        if isinstance(k.get("dtype"), torch.dtype):
            k["dtype"] = up(k["dtype"])
        return orig["fsoftmax"](*a, **k)

    def arange(*a, **k):
        if isinstance(k.get("dtype"), torch.dtype):
            k["dtype"] = up(k["dtype"])
        return orig["arange"](*a, **k)

    torch.Tensor.float, torch.Tensor.to, torch.Tensor.softmax = t_float, t_to, t_softmax
    F.softmax, torch.arange = f_softmax, arange
    prev_default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to, torch.Tensor.softmax = orig["float"], orig["to"], orig["tsoftmax"]
        F.softmax, torch.arange = orig["fsoftmax"], orig["arange"]
        torch.set_default_dtype(prev_default)


def load(d, dtype):
    model, info = DeepseekV4ForCausalLM.from_pretrained(str(d), dtype=dtype, attn_implementation="eager",
                                                        experts_implementation="eager",
                                                        output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise SystemExit(f"{d}: transformers did not load the checkpoint cleanly: {bad}")
    model = model.to(dtype)  # also the modules transformers keeps in float32
    model.eval()
    return model


def check_loaded(model, tensors, name):
    """Every parameter and buffer came from the checkpoint: the sum of |values|
    is invariant under renaming, fusing and reshaping, and an init value left
    anywhere would change it."""
    want = sum(float(np.abs(a.astype(np.float64)).sum()) for _, a in tensors)
    got = 0.0
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in n:
            continue
        got += float(t.detach().double().abs().sum())
    if abs(got - want) > 1e-6 * want:
        raise SystemExit(f"{name}: loaded weights do not match the checkpoint (sum |w| {got} vs {want})")


def check_rope(model, name):
    for mod_name, mod in model.named_modules():
        if isinstance(mod, mdv4.DeepseekV4RotaryEmbedding):
            for lt in mod.layer_types:
                s = getattr(mod, f"{lt}_attention_scaling")
                if s != 1.0:
                    raise SystemExit(f"{name}: {mod_name or 'rotary'} '{lt}' attention scaling is {s}, not 1.0 "
                                     "(give attention_factor 1.0 in the compress RoPE parameters)")


class Probe:
    """Forward hooks that record what the pitfall checks need."""

    def __init__(self, model):
        self.model = model
        self.handles = []
        self.index_scores = []   # (layer_module, [S, T] float64)
        self.router_scores = []  # [tokens, E] selection scores (score + bias)
        self.clamp_hits = 0
        self.clamp_total = 0
        cfg = model.config
        self.k = cfg.num_experts_per_tok
        self.topk = cfg.index_topk
        self.rate = cfg.compress_rates["compressed_sparse_attention"]
        self.limit = cfg.swiglu_limit
        for mod in model.modules():
            if isinstance(mod, mdv4.DeepseekV4IndexerScorer):
                self.handles.append(mod.register_forward_hook(self._on_scores))
            elif isinstance(mod, mdv4.DeepseekV4TopKRouter):
                self.handles.append(mod.register_forward_hook(self._on_router))
            elif isinstance(mod, mdv4.DeepseekV4Experts):
                self.handles.append(mod.register_forward_hook(self._on_experts))
            elif isinstance(mod, mdv4.DeepseekV4MLP):
                self.handles.append(mod.register_forward_pre_hook(self._on_mlp))

    def close(self):
        for h in self.handles:
            h.remove()

    def _on_scores(self, mod, args, out):
        self.index_scores.append(out[0].detach().double().cpu().numpy())

    def _on_router(self, mod, args, out):
        logits = out[0].detach()
        s = mod.score_fn(logits) + mod.e_score_correction_bias
        self.router_scores.append(s.double().cpu().numpy())

    def _count(self, gate, up):
        self.clamp_hits += int((gate > self.limit).sum()) + int((up.abs() > self.limit).sum())
        self.clamp_total += gate.numel() + up.numel()

    def _on_experts(self, mod, args, out):
        hidden, idx, _ = args
        for e in torch.unique(idx).tolist():
            rows = (idx == e).any(dim=-1)
            gu = F.linear(hidden[rows], mod.gate_up_proj[e])
            g, u = gu.chunk(2, dim=-1)
            self._count(g, u)

    def _on_mlp(self, mod, args):
        x = args[0]
        self._count(mod.gate_proj(x), mod.up_proj(x))

    def min_index_gap(self):
        """Smallest relative gap between the k-th and (k+1)-th visible indexer
        scores over all queries with more than k visible rows."""
        worst = (math.inf, None)
        for li, sc in enumerate(self.index_scores):
            S = sc.shape[0]
            for s in range(S):
                vis = (s + 1) // self.rate
                if vis <= self.topk:
                    continue
                v = np.sort(sc[s, :vis])[::-1]
                a, b = v[self.topk - 1], v[self.topk]
                rel = (a - b) / max(abs(a), abs(b), 1e-300)
                if rel < worst[0]:
                    worst = (rel, f"indexer call {li}, query {s}")
        return worst

    def min_router_gap(self):
        worst = (math.inf, None)
        for li, sc in enumerate(self.router_scores):
            v = -np.sort(-sc, axis=1)
            a, b = v[:, self.k - 1], v[:, self.k]
            rel = (a - b) / np.maximum(np.maximum(np.abs(a), np.abs(b)), 1e-300)
            i = int(np.argmin(rel))
            if rel[i] < worst[0]:
                worst = (float(rel[i]), f"router call {li}, token {i}")
        return worst


def forward_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double().cpu().numpy()


def rel_err_rows(a, ref):
    return np.linalg.norm(a - ref, axis=1) / np.linalg.norm(ref, axis=1)


def run_case(name, spec, seed):
    """Everything for one seed; returns (result dict, None) or (None, reason)."""
    with tempfile.TemporaryDirectory() as td:
        d = gen_weights.generate(spec, Path(td) / name, seed)
        cfg = spec["config"]
        tensors = gen_weights.build_tensors(dict(cfg), seed, spec.get("naming", "saved"),
                                            spec.get("experts", "per_expert"))
        prompt = json.loads((d / "tokens.json").read_text())
        sha = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
        with F64():
            m64 = load(d, torch.float64)
            check_loaded(m64, tensors, name)
            check_rope(m64, name)
            types = m64.config.layer_types
            if "compressed_sparse_attention" in types and m64.config.index_n_heads < 16:
                raise SystemExit(f"{name}: index_n_heads {m64.config.index_n_heads} < 16 (indexer ties, spec 12.1 row 26)")
            ids = list(prompt)
            gaps = []
            for _ in range(N_GREEDY):
                last = forward_logits(m64, ids)[-1]
                order = np.argsort(-last)
                gaps.append(float((last[order[0]] - last[order[1]]) / np.abs(last).max()))
                ids.append(int(order[0]))
            probe = Probe(m64)
            full64 = forward_logits(m64, ids)
            probe.close()
        m32 = load(d, torch.float32)
        full32 = forward_logits(m32, ids)
        del m32, m64
    n = len(prompt)
    greedy = ids[n:]
    if [int(x) for x in full64[n - 1:-1].argmax(axis=1)] != greedy:
        raise SystemExit(f"{name}: the full float64 forward disagrees with its own greedy decode")
    idx_gap, idx_where = probe.min_index_gap()
    rt_gap, rt_where = probe.min_router_gap()
    min_gap = min(gaps)
    if idx_gap < TOPK_REL_GAP:
        return None, f"indexer top-k boundary gap {idx_gap:.3g} at {idx_where}"
    if rt_gap < TOPK_REL_GAP:
        return None, f"router top-k boundary gap {rt_gap:.3g} at {rt_where}"
    if min_gap < GREEDY_REL_GAP:
        return None, f"greedy top-2 logit gap {min_gap:.3g} (relative to the largest logit)"
    err = rel_err_rows(full32, full64)
    flips32 = int(sum(int(a) != b for a, b in zip(full32[n - 1:-1].argmax(axis=1), greedy)))
    return {
        "name": name,
        "description": spec.get("description", ""),
        "seed": seed,
        "token_seed": spec["token_seed"],
        "weights_sha256": sha,
        "prompt": prompt,
        "greedy": greedy,
        "vocab_size": int(full64.shape[1]),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "reference": "transformers DeepseekV4ForCausalLM, eager, CPU, float64 with its internal float32 casts "
                     "lifted; logits.npy holds the prompt positions rounded once to float32",
        "transformers_f32_vs_f64_rel_err": {"max": float(err.max()), "median": float(np.median(err)),
                                            "greedy_argmax_flips": flips32},
        "margins": {"indexer_topk_min_rel_gap": None if math.isinf(idx_gap) else idx_gap,
                    "router_topk_min_rel_gap": None if math.isinf(rt_gap) else rt_gap,
                    "greedy_min_rel_gap": min_gap, "greedy_rel_gaps": gaps},
        "swiglu_clamp": {"hits": probe.clamp_hits, "of": probe.clamp_total},
        "indexer_calls": len(probe.index_scores),
    }, full64[:n].astype(np.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--check", action="store_true", help="compare with the committed fixtures, write nothing")
    ap.add_argument("--tries", type=int, default=10)
    ap.add_argument("--out", default=str(HERE / "fixtures"))
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    names = a.names or sorted(p.stem for p in (HERE / "configs").glob("*.json"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    status = 0
    for name in names:
        spec = json.loads((HERE / "configs" / f"{name}.json").read_text())
        old = out / f"{name}.greedy.json"
        seeds = [spec["seed"] + 1000 * i for i in range(a.tries)]
        if a.check and old.exists():
            seeds = [json.loads(old.read_text())["seed"]]
        for seed in seeds:
            res, logits = run_case(name, spec, seed)
            if res:
                break
            print(f"{name}: seed {seed} rejected: {logits}", flush=True)
        else:
            print(f"{name}: no acceptable seed in {len(seeds)} tries", flush=True)
            status = 1
            continue
        e = res["transformers_f32_vs_f64_rel_err"]
        print(f"{name}: seed {res['seed']}, {len(res['prompt'])} prompt tokens, greedy {res['greedy'][:8]}..., "
              f"f32-vs-f64 rel err max {e['max']:.3g} median {e['median']:.3g}, clamp hits "
              f"{res['swiglu_clamp']['hits']}/{res['swiglu_clamp']['of']}, min gaps: indexer "
              f"{res['margins']['indexer_topk_min_rel_gap']}, router {res['margins']['router_topk_min_rel_gap']}, "
              f"greedy {res['margins']['greedy_min_rel_gap']:.3g}", flush=True)
        npy = out / f"{name}.logits.npy"
        if a.check:
            if not npy.exists() or not old.exists():
                print(f"{name}: no committed fixture to check against")
                status = 1
                continue
            ref = np.load(npy)
            prev = json.loads(old.read_text())
            d = rel_err_rows(logits.astype(np.float64), ref.astype(np.float64)).max() if ref.shape == logits.shape \
                else math.inf
            same = prev["greedy"] == res["greedy"] and prev["prompt"] == res["prompt"]
            print(f"{name}: regenerated vs committed: max rel err {d:.3g}, greedy {'same' if same else 'DIFFERENT'}")
            if d > 1e-6 or not same:
                status = 1
            continue
        np.save(npy, logits)
        old.write_text(json.dumps(res, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
