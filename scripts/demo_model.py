"""Write the built-in demo file: a small GGUF in the DeepSeek V4 Flash layout.

Until the model runs (synth and inference arrive with the CPU model), the demo
is a file with the real key names and tensor names of the first layer, tiny
shapes, seeded random weights, and every quant type the DS4 files use, so
`ds4server inspect` and `dump` have something real-looking to show.

    python scripts/demo_model.py OUT.gguf
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf import GGUFWriter, quants

rng = np.random.default_rng(20261129)
out = sys.argv[1]
w = GGUFWriter(out, "deepseek4")
w.add_name("DS4Server demo (random weights)")
for key, val in [("block_count", 1), ("embedding_length", 256), ("vocab_size", 512),
                 ("attention.head_count", 4), ("attention.head_count_kv", 1), ("expert_count", 4),
                 ("expert_used_count", 2), ("expert_feed_forward_length", 256), ("attention.sliding_window", 128)]:
    w.add_uint32(f"deepseek4.{key}", val)
w.add_key_value("deepseek4.attention.compress_ratios", [4], V.ARRAY, sub_type=V.UINT32)
w.add_float32("deepseek4.rope.freq_base", 10000.0)
w.add_bool("deepseek4.expert_weights_norm", True)


def weights(*shape, scale=0.05):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


w.add_tensor("token_embd.weight", weights(512, 256).astype(np.float16))
w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
w.add_tensor("output.weight", quants.quantize(weights(512, 256), T.Q8_0), raw_dtype=T.Q8_0)
w.add_tensor("blk.0.attn_q_a.weight", quants.quantize(weights(64, 256), T.Q8_0), raw_dtype=T.Q8_0)
w.add_tensor("blk.0.ffn_gate_tid2eid.weight", rng.integers(0, 4, (512, 2), dtype=np.int32))
# Routed experts in the q2 file's types: IQ2_XXS gate/up and Q2_K down, as raw
# random blocks with sane f16 scales (gguf-py has no quantiser for these).
for name, qtype, d_offsets in [("ffn_gate_exps", T.IQ2_XXS, [0]), ("ffn_up_exps", T.IQ2_XXS, [0]),
                               ("ffn_down_exps", T.Q2_K, [80, 82])]:
    from gguf import GGML_QUANT_SIZES
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (4, 256, block_bytes), dtype=np.uint8)  # 4 experts x 256 rows x 1 block
    for off in d_offsets:
        raw[..., off:off + 2] = np.full(raw.shape[:-1], 0.01, dtype=np.float16)[..., None].view(np.uint8)
    w.add_tensor(f"blk.0.{name}.weight", raw, raw_dtype=qtype)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(f"wrote {out}")
