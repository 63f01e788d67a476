"""GGUF interoperability with gguf-py (PyPI `gguf`), the format's reference reader and writer.

- files written by gguf-py are read by us with identical metadata and tensors;
- files written by our writer are read by gguf-py identically (and are
  byte-identical to what gguf-py writes for the same content);
- `ds4server dump` matches gguf-py's dequantisation bit for bit.
"""
import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants

from conftest import TOOLS, ds4


def write_gguf(path, kvs, tensors, alignment=None):
    """kvs: list of (key, value, vtype, sub_type); tensors: list of (name, array, raw_dtype)."""
    w = GGUFWriter(str(path), "oracle")
    if alignment:
        w.data_alignment = alignment
        w.add_uint32("general.alignment", alignment)
    for key, val, vtype, sub in kvs:
        w.add_key_value(key, val, vtype, sub_type=sub)
    for name, arr, raw in tensors:
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


V = GGUFValueType
RICH_KVS = [
    ("k.u8", 255, V.UINT8, None),
    ("k.i8", -128, V.INT8, None),
    ("k.u16", 65535, V.UINT16, None),
    ("k.i16", -32768, V.INT16, None),
    ("k.u32", 4294967295, V.UINT32, None),
    ("k.i32", -2147483648, V.INT32, None),
    ("k.u64", 18446744073709551615, V.UINT64, None),
    ("k.i64", -9223372036854775808, V.INT64, None),
    ("k.f32", 3.1415927410125732, V.FLOAT32, None),
    ("k.f64", 2.718281828459045, V.FLOAT64, None),
    ("k.bool_t", True, V.BOOL, None),
    ("k.bool_f", False, V.BOOL, None),
    ("k.str", "ascii, accents é, CJK 世界, emoji 😀, quote \" backslash \\ newline \n tab \t", V.STRING, None),
    ("k.empty_str", "", V.STRING, None),
    ("k.arr_u8", [0, 1, 255], V.ARRAY, V.UINT8),
    ("k.arr_i16", [-1, 2, -3], V.ARRAY, V.INT16),
    ("k.arr_u32", list(range(1000)), V.ARRAY, V.UINT32),
    ("k.arr_i64", [-(2**62), 2**62], V.ARRAY, V.INT64),
    ("k.arr_f32", [0.5, -1.25, 1e-30, 3e38], V.ARRAY, V.FLOAT32),
    ("k.arr_f64", [0.1, -1e300], V.ARRAY, V.FLOAT64),
    ("k.arr_bool", [True, False, True], V.ARRAY, V.BOOL),
    ("k.arr_str", ["<｜begin▁of▁sentence｜>", "", "Ġthe", "日本語", "a b"], V.ARRAY, V.STRING),
    ("k.nested", [[1, 2, 3], [4], [5, 6]], V.ARRAY, V.ARRAY),
    ("k.nested2", [[[1], [2, 3]], [[4, 5, 6]]], V.ARRAY, V.ARRAY),
]


OUR_TYPE_NAMES = {
    V.UINT8: "u8", V.INT8: "i8", V.UINT16: "u16", V.INT16: "i16", V.UINT32: "u32", V.INT32: "i32",
    V.FLOAT32: "f32", V.BOOL: "bool", V.STRING: "string", V.ARRAY: "array", V.UINT64: "u64",
    V.INT64: "i64", V.FLOAT64: "f64",
}


def rich_tensors(rng):
    f16 = rng.standard_normal((3, 64)).astype(np.float16)
    q8 = quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), T.Q8_0)
    bf16 = rng.integers(0, 65536, (2, 16), dtype=np.uint16).view(np.uint8)
    return [
        ("t.f32_3d", rng.standard_normal((2, 3, 5)).astype(np.float32), None),
        ("t.f16", f16, None),
        ("t.bf16", bf16, T.BF16),
        ("t.f64", rng.standard_normal(7), None),
        ("t.i8", rng.integers(-128, 128, 9, dtype=np.int8), None),
        ("t.i16", rng.integers(-30000, 30000, 9, dtype=np.int16), None),
        ("t.i32", rng.integers(-(2**23), 2**23, (6, 4), dtype=np.int32), None),
        ("blk.0.attn_q_a.weight", q8, T.Q8_0),
        ("t.vec1", np.array([1.0], dtype=np.float32), None),
    ]


def inspect_json(path):
    r = ds4("inspect", "--json", path)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


def dump(path, name, tmp_path):
    out = tmp_path / "dump.f32"
    r = ds4("dump", path, name, "--out", out)
    assert r.returncode == 0, r.stderr.decode()
    return np.fromfile(out, dtype="<f4")


def reference_dequant(t):
    """gguf-py's dequantisation of a reader tensor, flattened to float32."""
    data = np.asarray(t.data)
    if t.tensor_type in (T.I8, T.I16, T.I32, T.I64, T.F64):
        return data.astype(np.float32).ravel()
    return quants.dequantize(data.view(np.uint8) if t.tensor_type not in (T.F32, T.F16) else data, t.tensor_type).astype(np.float32).ravel()


def test_gguf_py_file_metadata_read_identically(tmp_path, ds4server):
    rng = np.random.default_rng(1)
    path = tmp_path / "rich.gguf"
    write_gguf(path, RICH_KVS, rich_tensors(rng))
    meta = inspect_json(path)["metadata"]
    assert meta["general.architecture"] == {"type": "string", "value": "oracle"}
    for key, val, vtype, sub in RICH_KVS:
        got = meta[key]
        assert got["type"] == OUR_TYPE_NAMES[vtype], key
        if vtype == V.FLOAT32:  # printed with 9 significant digits: round-trips float32 exactly
            assert np.float32(got["value"]) == np.float32(val), key
        elif vtype == V.ARRAY and sub == V.FLOAT32:
            assert [np.float32(x) for x in got["value"]] == [np.float32(x) for x in val], key
        else:
            assert got["value"] == val, key
        if vtype == V.ARRAY:
            assert got["count"] == len(val)


def test_gguf_py_file_tensors_read_identically(tmp_path, ds4server):
    rng = np.random.default_rng(2)
    path = tmp_path / "rich.gguf"
    write_gguf(path, RICH_KVS, rich_tensors(rng))
    ours = {t["name"]: t for t in inspect_json(path)["tensors"]}
    ref = GGUFReader(str(path))
    assert len(ours) == len(ref.tensors)
    for t in ref.tensors:
        o = ours[t.name]
        assert o["type_id"] == int(t.tensor_type), t.name
        assert o["shape"] == [int(x) for x in t.shape], t.name
        assert o["bytes"] == int(t.n_bytes), t.name
        assert o["offset"] == int(t.data_offset), t.name
        got = dump(path, t.name, tmp_path)
        want = reference_dequant(t)
        assert got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name


@pytest.mark.parametrize("alignment", [32, 64, 4096])
def test_our_writer_is_byte_identical_to_gguf_py(tmp_path, ds4server, alignment):
    """Re-encoding a gguf-py file through our reader and writer gives the same bytes."""
    rng = np.random.default_rng(3)
    src, dst = tmp_path / "src.gguf", tmp_path / "dst.gguf"
    write_gguf(src, RICH_KVS, rich_tensors(rng), alignment=None if alignment == 32 else alignment)
    from conftest import run
    r = run([TOOLS / "gguf_copy", src, dst])
    assert r.returncode == 0, r.stderr.decode()
    assert dst.read_bytes() == src.read_bytes()
    # and gguf-py reads our copy with the same fields and tensors
    a, b = GGUFReader(str(src)), GGUFReader(str(dst))
    assert list(a.fields) == list(b.fields)
    for k in a.fields:
        if a.fields[k].types and a.fields[k].types[0] == V.ARRAY and len(a.fields[k].types) > 2:
            continue  # gguf-py's contents() does not decode nested arrays
        assert a.fields[k].contents() == b.fields[k].contents(), k
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.name == tb.name and np.array_equal(np.asarray(ta.data), np.asarray(tb.data))


def test_writer_sample_read_by_gguf_py(tmp_path, ds4server):
    """Every writer call, checked value by value by gguf-py's reader."""
    from conftest import run
    path = tmp_path / "sample.gguf"
    r = run([TOOLS / "gguf_copy", "--sample", path])
    assert r.returncode == 0, r.stderr.decode()
    rd = GGUFReader(str(path))
    f = rd.fields
    assert rd.alignment == 64
    assert f["general.alignment"].contents() == 64
    expect = {
        "general.architecture": ("sample", V.STRING),
        "s.u8": (200, V.UINT8), "s.i8": (-100, V.INT8), "s.u16": (60000, V.UINT16), "s.i16": (-30000, V.INT16),
        "s.u32": (4000000000, V.UINT32), "s.i32": (-2000000000, V.INT32),
        "s.u64": (18000000000000000000, V.UINT64), "s.i64": (-9000000000000000000, V.INT64),
        "s.f32": (float(np.float32(0.1)), V.FLOAT32), "s.f64": (0.1, V.FLOAT64), "s.bool": (True, V.BOOL),
        "s.str": ("héllo 世界 😀", V.STRING),
        "s.arr_i32": ([1, -2, 3, -4, 5], V.ARRAY), "s.arr_f32": ([1.5, -2.25, float(np.float32(1e-20))], V.ARRAY),
        "s.arr_str": (["a", "", "<｜end▁of▁sentence｜>"], V.ARRAY),
    }
    for k, (val, vt) in expect.items():
        assert f[k].types[0] == vt, k
        assert f[k].contents() == val, k
    # an empty array: gguf-py keeps only the raw parts (key, type, element type, count)
    assert f["s.arr_empty"].types == [V.ARRAY]
    assert [p.tolist() for p in f["s.arr_empty"].parts[2:]] == [[V.ARRAY], [V.UINT8], [0]]
    t = {x.name: x for x in rd.tensors}
    assert list(t) == ["m.f32", "v.f16", "q.q8_0", "t.i32"]
    assert [int(x) for x in t["m.f32"].shape] == [3, 2]
    assert np.array_equal(np.asarray(t["m.f32"].data).ravel(), np.arange(6, dtype=np.float32))
    assert np.array_equal(np.asarray(t["v.f16"].data).astype(np.float32), 0.5 * np.arange(5, dtype=np.float32) - 1)
    assert t["q.q8_0"].tensor_type == T.Q8_0
    qref = quants.quantize((np.arange(64, dtype=np.float32) - 32) / 8, T.Q8_0)
    assert np.asarray(t["q.q8_0"].data).tobytes() == qref.tobytes()  # our Q8_0 quantiser is bit-exact too
    assert np.array_equal(np.asarray(t["t.i32"].data).ravel(), [10, 11, 20, 21, 30, 31])
    for x in rd.tensors:
        assert x.data_offset % 64 == 0


def test_dump_errors(tmp_path, ds4server):
    rng = np.random.default_rng(4)
    path = tmp_path / "rich.gguf"
    write_gguf(path, RICH_KVS, rich_tensors(rng))
    r = ds4("dump", path, "no.such.tensor", "--out", tmp_path / "x")
    assert r.returncode == 1 and b"no tensor named 'no.such.tensor'" in r.stderr
    assert not (tmp_path / "x").exists()
    r = ds4("dump", path, "t.f16")
    assert r.returncode == 1 and b"usage" in r.stderr
    r = ds4("dump", path, "t.f16", "--out", "/nonexistent-dir/out.f32")
    assert r.returncode == 1 and b"/nonexistent-dir/out.f32" in r.stderr
    r = ds4("inspect")
    assert r.returncode == 1 and r.stderr.count(b"\n") == 1
    r = ds4("no-such-command")
    assert r.returncode == 2


def test_inspect_text_summarises_arrays(tmp_path, ds4server):
    rng = np.random.default_rng(5)
    path = tmp_path / "rich.gguf"
    write_gguf(path, RICH_KVS, rich_tensors(rng))
    r = ds4("inspect", path)
    assert r.returncode == 0
    text = r.stdout.decode()
    line = next(l for l in text.splitlines() if l.strip().startswith("k.arr_u32"))
    assert "u32[1000]" in line and "[0, 1, 2, 3, 4, 5, 6, 7, ...]" in line
    assert "blk.0.attn_q_a.weight" in text and "Q8_0" in text
    assert "totals by type:" in text
