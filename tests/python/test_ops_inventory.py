"""docs/ops.md lists exactly the ops of the operation table, and names CPU tests that exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def table_ops():
    text = (ROOT / "src/backends/backend.h").read_text()
    body = text[text.index("typedef struct ds4_backend_ops {"):text.index("} ds4_backend_ops;")]
    return re.findall(r"\(\*([a-z_0-9]+)\)\(", body)


def inventory():
    rows = {}
    for line in (ROOT / "docs/ops.md").read_text().splitlines():
        m = re.match(r"\| `([a-z_0-9]+)` \|(.*)\|\s*$", line)
        if m:
            cells = [c.strip() for c in m.group(2).split("|")]
            rows[m.group(1)] = cells
    return rows


def test_inventory_matches_the_op_table():
    ops = table_ops()
    assert len(ops) > 20
    rows = inventory()
    assert set(ops) - set(rows) == set(), "ops missing from docs/ops.md"
    assert set(rows) - set(ops) == set(), "docs/ops.md lists ops the table does not have"


def test_inventory_cpu_tests_exist():
    tests = set(re.findall(r"static void (test_[a-z0-9_]+)\(void\)", (ROOT / "tests/c/test_cpu_ops.c").read_text()))
    for op, cells in inventory().items():
        assert len(cells) == 7, op
        named = re.findall(r"test_[a-z0-9_]+", cells[4])
        assert named, f"{op}: no CPU test named"
        for t in named:
            assert t in tests, f"{op}: {t} is not in tests/c/test_cpu_ops.c"


def test_inventory_cuda_tests_exist():
    """Each op names its CUDA unit test ("file: test_name"; test_name may end in _* or _<type>) and it exists."""
    files = {"ops": "test_cuda_ops.c", "matmul": "test_cuda_matmul.c", "attention": "test_cuda_attention.c",
             "hc_ffn": "test_cuda_hc_ffn.c", "session": "test_cuda_session.c"}
    defined = {}
    for key, name in files.items():
        defined[key] = set(re.findall(r"static void (test_[a-z0-9_A-Z]+)\(void\)", (ROOT / "tests/cuda" / name).read_text()))
    for op, cells in inventory().items():
        cell = cells[5]
        assert cell and cell != "—", f"{op}: no CUDA parity entry"
        found = re.findall(r"\b(ops|matmul|attention|hc_ffn|session): ((?:test_[a-zA-Z0-9_<>*]+(?:, )?)+)", cell)
        if op == "take_error":
            found = [f for f in found if f[0] == "session"]
        assert found, f"{op}: no CUDA test named in {cell!r}"
        for key, names in found:
            for t in re.findall(r"test_[a-zA-Z0-9_<>*]+", names):
                pattern = re.escape(t).replace(r"<type>", "[a-zA-Z0-9_]+").replace(r"\*", "[a-zA-Z0-9_]+")
                assert any(re.fullmatch(pattern, d) for d in defined[key]), f"{op}: {t} not in {files[key]}"
