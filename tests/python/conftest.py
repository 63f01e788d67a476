"""Shared helpers for the Python oracle tests: where the binaries are, and how to run them."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DS4SERVER = Path(os.environ.get("DS4SERVER", ROOT / "build" / "ds4server"))
TOOLS = Path(os.environ.get("DS4_TEST_TOOLS", ROOT / "build" / "tests" / "tools"))


def run(args, timeout=300, **kw):
    """Run a program; a hang fails the test through the timeout instead of stalling CI."""
    return subprocess.run([str(a) for a in args], capture_output=True, timeout=timeout, **kw)


def ds4(*args, **kw):
    return run([DS4SERVER, *args], **kw)


@pytest.fixture(scope="session")
def ds4server():
    if not DS4SERVER.exists():
        pytest.fail(f"{DS4SERVER} is missing: run `make` first")
    return DS4SERVER
