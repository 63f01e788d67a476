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
