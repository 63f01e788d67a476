"""Write the fuzzer's seed corpus: a valid file and the malformed corpus of the tests.

    python tests/fuzz/make_seeds.py tests/fuzz/seeds
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from gguf_corpus import cases, valid_file  # noqa: E402

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / "valid.gguf").write_bytes(valid_file())
for i, (name, data, _) in enumerate(cases()):
    (out / f"bad-{i:02d}.gguf").write_bytes(data)
