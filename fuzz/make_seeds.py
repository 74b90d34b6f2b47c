#!/usr/bin/env python3
"""Writes the small seed corpus of the fuzzers under fuzz/corpus/ (run once; the output is
committed). Tokenizer seeds are cut-down tokenizer.json files in the shapes kvq supports (GPT-2
ByteLevel, Qwen-style Split + NFC, DeepSeek-style several Splits, added-token flags) plus a few
it must reject; safetensors seeds are tiny valid files of each dtype and a few broken ones."""
import json
import os
import struct

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)


def byte_map():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def small_tokenizer(n_merges, pre, normalizer=None, added=(), pair_merges=True):
    full = json.load(open(os.path.join(root, "models/tiny-gqa/tokenizer.json"), encoding="utf-8"))
    bm = byte_map()
    vocab = {bm[b]: b for b in range(256)}
    merges = []
    for a, b in full["model"]["merges"][:n_merges]:
        vocab.setdefault(a + b, len(vocab))
        merges.append([a, b] if pair_merges else a + " " + b)
    added_tokens = []
    for i, (content, flags) in enumerate(added):
        t = {"id": len(vocab) + i, "content": content, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        t.update(flags)
        added_tokens.append(t)
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added_tokens,
            "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges}}


QWEN_RE = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
           "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
DS_RE = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
         " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")


def split(regex, behavior="Isolated"):
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": behavior, "invert": False}


def byte_level(use_regex):
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


tok_seeds = {
    "gpt2.json": small_tokenizer(120, byte_level(True),
                                 added=[("<|bos|>", {}), ("<|eos|>", {})]),
    "qwen.json": small_tokenizer(80, {"type": "Sequence", "pretokenizers": [split(QWEN_RE), byte_level(False)]},
                                 normalizer={"type": "NFC"}, pair_merges=False,
                                 added=[("<|im_start|>", {}), ("<tool_call>", {"special": False}),
                                        ("<s>", {"lstrip": True, "rstrip": True})]),
    "deepseek.json": small_tokenizer(
        80, {"type": "Sequence", "pretokenizers": [split("\\p{N}{1,3}"), split("[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"),
                                                   split(DS_RE), byte_level(False)]},
        normalizer={"type": "Sequence", "normalizers": []},
        added=[("<｜User｜>", {"special": False, "normalized": True}),
               ("[MASK]", {"single_word": True, "normalized": True})]),
    "behaviors.json": small_tokenizer(
        40, {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            split(" ", "MergedWithNext"), split("\\s+", "Contiguous"), split("!", "Removed"),
            {"type": "Split", "pattern": {"String": "x"}, "behavior": "MergedWithPrevious", "invert": True},
            {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}]},
        normalizer={"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "NFD"}]}),
}
tok_seeds["wordpiece.json"] = dict(tok_seeds["gpt2.json"], model={"type": "WordPiece", "vocab": {"a": 0}})
tok_seeds["no_pretokenizer.json"] = dict(tok_seeds["gpt2.json"], pre_tokenizer=None)

os.makedirs(os.path.join(here, "corpus/tokenizer"), exist_ok=True)
for name, obj in tok_seeds.items():
    with open(os.path.join(here, "corpus/tokenizer", name), "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, separators=(",", ":"))
with open(os.path.join(here, "corpus/tokenizer", "truncated.json"), "w", encoding="utf-8") as f:
    f.write(json.dumps(tok_seeds["gpt2.json"], ensure_ascii=False)[:700])


def safetensors(tensors, metadata=None, pad=True):
    header, blob = {}, b""
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + blob


st_seeds = {
    "f32.safetensors": safetensors([("w", "F32", [2, 3], struct.pack("<6f", 1, -2, 3.5, 0, 1e-3, -7))],
                                   {"format": "pt"}),
    "bf16_f16.safetensors": safetensors([("a", "BF16", [4], struct.pack("<4H", 0x3F80, 0xC000, 0x7F80, 0x0001)),
                                         ("b", "F16", [2, 1], struct.pack("<2H", 0x3C00, 0xFC00))]),
    "ints.safetensors": safetensors([("ids", "I64", [3], struct.pack("<3q", 0, 49, 4095)),
                                     ("mask", "U8", [2], b"\x01\x00"), ("e", "F32", [0], b"")]),
    "fp8.safetensors": safetensors([("q", "F8_E4M3", [2, 2], b"\x38\xb8\x7e\x01"),
                                    ("s", "F32", [1, 1], struct.pack("<f", 0.5))]),
}
st_seeds["truncated.safetensors"] = st_seeds["f32.safetensors"][:-5]
st_seeds["overlap.safetensors"] = struct.pack("<Q", 80) + json.dumps(
    {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
     "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, separators=(",", ":")).encode().ljust(80) + b"\0" * 12

os.makedirs(os.path.join(here, "corpus/safetensors"), exist_ok=True)
for name, data in st_seeds.items():
    with open(os.path.join(here, "corpus/safetensors", name), "wb") as f:
        f.write(data)
print("wrote", len(tok_seeds) + 1, "tokenizer seeds and", len(st_seeds), "safetensors seeds")
