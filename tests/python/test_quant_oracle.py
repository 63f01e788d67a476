"""Every quant block format dequantised by `ds4server dump` against gguf-py's numpy dequantisers.

Random blocks: random bits everywhere, with the f16 scale fields overwritten by
sane finite values (so the comparison covers every code path with real
numbers), compared bit for bit. A second pass keeps fully random bits (NaN and
Inf scales included) and requires equality up to NaN.
"""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants

from conftest import ds4
from test_gguf_oracle import write_gguf

N_BLOCKS = 20000  # per type and pass

# Byte offsets of the f16 scale fields inside one block.
F16_FIELDS = {
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ2_XXS: [0],
}


def sane_f16(rng, n):
    mag = np.exp(rng.uniform(np.log(1e-4), np.log(2.0), n))
    return (mag * rng.choice([-1.0, 1.0], n)).astype(np.float16)


def random_blocks(qtype, rng, sane):
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(N_BLOCKS, block_bytes), dtype=np.uint8)
    if sane:
        if qtype == T.F16:
            raw = sane_f16(rng, N_BLOCKS).view(np.uint8).reshape(N_BLOCKS, 2)
        elif qtype == T.BF16:
            raw = rng.standard_normal(N_BLOCKS).astype(np.float32).view(np.uint32)
            raw = (raw >> 16).astype(np.uint16).view(np.uint8).reshape(N_BLOCKS, 2)
        elif qtype == T.F32:
            raw = rng.standard_normal(N_BLOCKS).astype(np.float32).view(np.uint8).reshape(N_BLOCKS, 4)
        elif qtype == T.Q8_K:
            d = (rng.standard_normal(N_BLOCKS) * 0.01).astype(np.float32)
            raw[:, 0:4] = d.view(np.uint8).reshape(N_BLOCKS, 4)
        for off in F16_FIELDS.get(qtype, []):
            raw[:, off:off + 2] = sane_f16(rng, N_BLOCKS).view(np.uint8).reshape(N_BLOCKS, 2)
    # 100 rows; each row holds N_BLOCKS/100 blocks
    return raw.reshape(100, -1), block_elems


def reference(qtype, raw):
    if qtype == T.Q8_K:  # no gguf-py dequantiser: d (f32) * q (int8), as ggml's dequantize_row_q8_K
        blocks = raw.reshape(-1, GGML_QUANT_SIZES[T.Q8_K][1])
        d = blocks[:, 0:4].copy().view(np.float32)
        q = blocks[:, 4:260].view(np.int8).astype(np.float32)
        return (d * q).astype(np.float32).ravel()
    if qtype == T.F32:
        return raw.view(np.float32).ravel()
    if qtype == T.F16:
        return raw.view(np.float16).astype(np.float32).ravel()
    return quants.dequantize(raw, qtype).astype(np.float32).ravel()


TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q2_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ2_XXS, T.Q8_K]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN/Inf scales in the random-bits pass are the point
@pytest.mark.parametrize("sane", [True, False], ids=["sane-scales", "random-bits"])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequant_bit_exact(tmp_path, ds4server, qtype, sane):
    rng = np.random.default_rng(1000 + int(qtype) * 2 + int(sane))
    raw, block_elems = random_blocks(qtype, rng, sane)
    path = tmp_path / "q.gguf"
    write_gguf(path, [], [("w", raw, qtype)])
    out = tmp_path / "w.f32"
    r = ds4("dump", path, "w", "--out", out)
    assert r.returncode == 0, r.stderr.decode()
    got = np.fromfile(out, dtype="<f4")
    want = reference(qtype, raw)
    assert got.size == want.size == N_BLOCKS * block_elems
    if sane:
        assert np.isfinite(want).all()
        mismatch = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    else:
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        mismatch = np.flatnonzero(~same)
    assert mismatch.size == 0, (
        f"{qtype.name}: {mismatch.size} of {got.size} values differ; first at {mismatch[0]}: "
        f"ours {got[mismatch[0]]!r} gguf-py {want[mismatch[0]]!r}"
    )
    print(f"{qtype.name}: {N_BLOCKS} blocks ({got.size} values) bit-exact")


@pytest.mark.parametrize("qtype", [T.Q8_0, T.BF16], ids=["Q8_0", "BF16"])
def test_quantiser_matches_gguf_py(tmp_path, ds4server, qtype):
    """Our reference quantisers for the types gguf-py can quantise produce the same bytes.

    The values go through an F32 tensor and come back quantised by the test tool."""
    from conftest import TOOLS, run
    rng = np.random.default_rng(7 + int(qtype))
    x = (rng.standard_normal((64, 256)) * np.exp(rng.uniform(-8, 8, (64, 1)))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    x[1, :32] = np.float32(127.0) * np.arange(-16, 16, dtype=np.float32) / 127  # exact halves
    src, dst = tmp_path / "x.gguf", tmp_path / "q.gguf"
    write_gguf(src, [], [("x", x, None)])
    r = run([TOOLS / "gguf_quantize", src, dst, qtype.name])
    assert r.returncode == 0, r.stderr.decode()
    from gguf import GGUFReader
    got = np.asarray(GGUFReader(str(dst)).tensors[0].data).view(np.uint8).tobytes()
    want = quants.quantize(x, qtype).tobytes()
    assert got == want
