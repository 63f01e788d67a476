#!/usr/bin/env bash
# The README's first command lands here (via `make demo`): write the demo file
# and show what DS4Server reads from it.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s venv all
mkdir -p build/demo
.venv/bin/python scripts/demo_model.py build/demo/demo.gguf
./build/ds4server inspect build/demo/demo.gguf
./build/ds4server dump build/demo/demo.gguf blk.0.ffn_gate_exps.weight --out build/demo/ffn_gate_exps.f32
echo "dumped blk.0.ffn_gate_exps.weight (IQ2_XXS) to build/demo/ffn_gate_exps.f32 ($(stat -c %s build/demo/ffn_gate_exps.f32) bytes of float32)"
