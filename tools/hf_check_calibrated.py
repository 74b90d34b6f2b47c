#!/usr/bin/env python3
"""Checks that transformers loads a `kvq calibrate` output directory unchanged and computes the
same function as the original model (quantization is kvq's, not transformers': with an
unquantized cache the fused transforms cancel; QuaRot-dagger's online RoPE Hadamard cancels in
q . k, so transformers may ignore kvq_calibration.json).

usage: hf_check_calibrated.py ORIGINAL_DIR CALIBRATED_DIR [CALIBRATED_DIR ...]
Prints one JSON line per calibrated dir: max |logit difference|, relative to max |logit|, and the
mean next-token NLL of both on the original's reference input_ids (reference.safetensors).
Needs torch, transformers and safetensors (the GPU host has them).
"""
import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def logits(d, ids):
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        return m(ids).logits[0].float()


def nll(lg, ids):
    return torch.nn.functional.cross_entropy(lg[:-1], ids[0, 1:]).item()


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    orig = sys.argv[1]
    ids = load_file(f"{orig}/reference.safetensors")["input_ids"].long()[None]
    a = logits(orig, ids)
    for d in sys.argv[2:]:
        b = logits(d, ids)
        diff = (a - b).abs().max().item()
        print(json.dumps({"model": d, "max_abs_logit_diff": diff, "rel": diff / a.abs().max().item(),
                          "nll_original": nll(a, ids), "nll_calibrated": nll(b, ids)}))


if __name__ == "__main__":
    main()
