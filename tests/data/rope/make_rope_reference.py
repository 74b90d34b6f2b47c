#!/usr/bin/env python3
"""Writes the RoPE inverse frequencies that transformers computes for two scaled configurations, as the reference
of tests/model/test_model.cpp (Config.RopeMatchesTransformers): Llama 3.1 8B's llama3 scaling (theta 500000,
head_dim 128, factor 8, low / high frequency factors 1 / 4, 8192 original positions) and linear scaling by 4 with
the same theta. Run on a host with PyTorch and transformers:  python3 make_rope_reference.py > inv_freq.txt
Each line: the rope type, the attention factor, then the 64 float32 inverse frequencies (%.9e identifies a float32)."""
import transformers
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

print("# transformers", transformers.__version__)
for kind, rs in [("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
                 ("linear", {"rope_type": "linear", "factor": 4.0})]:
    c = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=rs,
                    max_position_embeddings=131072)
    inv, att = ROPE_INIT_FUNCTIONS[kind](c, "cpu")
    print(kind, att, " ".join("%.9e" % x for x in inv.tolist()))
