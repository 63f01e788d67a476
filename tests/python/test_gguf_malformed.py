"""Malformed GGUF files: each gives one clean error line naming what is wrong, never a crash or a hang."""
import pytest

from conftest import ds4
from gguf_corpus import cases, valid_file


def check_rejected(tmp_path, data, expect=None):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    r = ds4("inspect", path, timeout=30)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 1, f"exit {r.returncode} (negative = killed by a signal): {err}"
    assert err.startswith("ds4server inspect: ") and err.count("\n") == 1, err
    if expect:
        assert expect in err, err
    return err


def test_valid_base_file_is_accepted(tmp_path, ds4server):
    path = tmp_path / "ok.gguf"
    path.write_bytes(valid_file())
    r = ds4("inspect", path)
    assert r.returncode == 0, r.stderr.decode()
    assert b"t1" in r.stdout


@pytest.mark.parametrize("name,data,expect", cases(), ids=[c[0] for c in cases()])
def test_malformed_file_rejected(tmp_path, ds4server, name, data, expect):
    check_rejected(tmp_path, data, expect)


def test_every_truncation_rejected(tmp_path, ds4server):
    data = valid_file()
    last_byte_used = len(data) - 16  # the file ends with the last tensor's padding
    for n in range(0, last_byte_used):
        check_rejected(tmp_path, data[:n])


def test_error_names_byte_offset(tmp_path, ds4server):
    err = check_rejected(tmp_path, valid_file()[:60])
    assert "byte " in err
