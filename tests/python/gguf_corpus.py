"""A corpus of malformed GGUF files, built byte by byte.

Each case is (name, file bytes, substring the error message must contain).
Used by test_gguf_malformed.py and by tests/fuzz/make_seeds.py (fuzzer seeds).
"""
import struct


def u32(v):
    return struct.pack("<I", v)


def u64(v):
    return struct.pack("<Q", v)


def gstr(b):
    if isinstance(b, str):
        b = b.encode()
    return u64(len(b)) + b


def kv(key, vtype, payload):
    return gstr(key) + u32(vtype) + payload


def kv_u32(key, v):
    return kv(key, 4, u32(v))


def tinfo(name, dims, ttype, offset):
    return gstr(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(ttype) + u64(offset)


def gguf(kvs=(), tinfos=(), data=b"", version=3, n_tensors=None, n_kv=None, align=32, magic=b"GGUF"):
    head = magic + u32(version) + u64(len(tinfos) if n_tensors is None else n_tensors)
    head += u64(len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tinfos)
    body += b"\0" * ((align - len(body) % align) % align)
    return body + data


F32, Q8_0 = 0, 8


def valid_file():
    """Two F32 tensors of 4 elements and a few keys: the base most cases damage."""
    kvs = [kv("general.architecture", 8, gstr("test")), kv_u32("a.u32", 7),
           kv("a.arr", 9, u32(8) + u64(2) + gstr("x") + gstr("yz"))]
    tis = [tinfo("t0", [4], F32, 0), tinfo("t1", [2, 2], F32, 32)]
    data = struct.pack("<4f", 1, 2, 3, 4) + b"\0" * 16 + struct.pack("<4f", 5, 6, 7, 8) + b"\0" * 16
    return gguf(kvs, tis, data)


def nested_array(depth):
    inner = u32(4) + u64(1) + u32(1)  # array of one u32
    for _ in range(depth - 1):
        inner = u32(9) + u64(1) + inner
    return kv("deep", 9, inner)


def cases():
    d16 = b"\0" * 16
    one = struct.pack("<4f", 1, 2, 3, 4)
    return [
        ("empty", b"", "smaller than a GGUF header"),
        ("short header", b"GGUF" + u32(3) + u64(0), "smaller than a GGUF header"),
        ("bad magic", gguf(magic=b"GGML"), "bad magic"),
        ("version 1", gguf(version=1), "version 1 is not supported"),
        ("version 4", gguf(version=4), "unsupported GGUF version 4"),
        ("big-endian", gguf(version=0x03000000), "big-endian"),
        ("huge kv count", gguf(n_kv=2**63), "metadata count"),
        ("huge tensor count", gguf(n_tensors=2**62), "tensor count"),
        ("key past end", gguf([u64(2**40)], n_kv=1, data=b"\0" * 64), "metadata key length 1099511627776 runs past"),
        ("empty key", gguf([kv("", 4, u32(1))]), "key length 0"),
        ("unknown value type", gguf([kv("k", 13, u32(1))]), "unknown metadata value type 13"),
        ("unknown array element type", gguf([kv("k", 9, u32(77) + u64(1) + u32(1))]), "unknown element type 77"),
        ("huge array count", gguf([kv("k", 9, u32(4) + u64(2**61) + u32(1))]), "cannot fit"),
        ("huge string array count", gguf([kv("k", 9, u32(8) + u64(2**60))]), "cannot fit"),
        ("string past end", gguf([kv("k", 8, u64(1000) + b"abc")]), "string value length 1000"),
        ("truncated scalar", gguf([kv("k", 12, b"\1\2")], align=1), "truncated"),
        ("nesting too deep", gguf([nested_array(9)]), "nested deeper than 8"),
        ("duplicate key", gguf([kv_u32("k", 1), kv_u32("k", 2)]), "duplicate metadata key 'k'"),
        ("alignment wrong type", gguf([kv("general.alignment", 5, u32(32))]), "general.alignment must be u32"),
        ("alignment zero", gguf([kv_u32("general.alignment", 0)]), "not a power of two"),
        ("alignment 48", gguf([kv_u32("general.alignment", 48)]), "not a power of two"),
        ("empty tensor name", gguf([], [tinfo("", [4], F32, 0)], one), "tensor name length 0"),
        ("zero dims", gguf([], [tinfo("t", [], F32, 0)], one), "n_dims 0"),
        ("five dims", gguf([], [tinfo("t", [1, 1, 1, 1, 4], F32, 0)], one), "n_dims 5"),
        ("element count overflow", gguf([], [tinfo("t", [2**40, 2**40], F32, 0)], one), "overflows"),
        ("unknown tensor type", gguf([], [tinfo("t", [4], 99, 0)], one), "unknown type 99"),
        ("removed tensor type 4", gguf([], [tinfo("t", [32], 4, 0)], one), "unknown type 4"),
        ("row not multiple of block", gguf([], [tinfo("t", [33], Q8_0, 0)], one), "not a multiple of the Q8_0 block"),
        ("misaligned offset", gguf([], [tinfo("t", [4], F32, 4)], one + d16), "not a multiple of the alignment"),
        ("offset past end", gguf([], [tinfo("t", [4], F32, 2**40)], one), "runs past the end"),
        ("offset overflow", gguf([], [tinfo("t", [4], F32, 2**64 - 32)], one), "runs past the end"),
        ("data past end", gguf([], [tinfo("t", [1024], F32, 0)], one), "runs past the end"),
        ("overlapping tensors", gguf([], [tinfo("a", [16], F32, 0), tinfo("b", [4], F32, 32)], one * 5), "overlap"),
        ("duplicate tensor names", gguf([], [tinfo("t", [4], F32, 0), tinfo("t", [4], F32, 32)], one + d16 + one),
         "duplicate tensor name 't'"),
        ("tensor count too large for the file", gguf([], [tinfo("t", [4], F32, 0)[:-3]], align=1), "cannot fit"),
        ("tensor info truncated", gguf([], [tinfo("t", [4, 4, 4], F32, 0)[:-3]], align=1), "truncated"),
    ]
