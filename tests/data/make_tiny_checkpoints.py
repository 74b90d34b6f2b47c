#!/usr/bin/env python3
"""make_tiny_checkpoints.py: tiny random-weight Hugging Face checkpoints for the kvq runtime tests.

The two fixture models (models/tiny-gqa, models/tiny-mla) exercise neither YaRN, q_lora_rank,
sigmoid routing with e_score_correction_bias, group-limited top-k, fp8 block-scaled weights,
Qwen2's q/k/v bias nor Qwen3's q/k norm. This script builds one tiny checkpoint per feature set
with PyTorch + transformers (5.17 was used), runs transformers' own float32 forward pass on a
short random input and saves, per directory:
  config.json, *.safetensors (+ model.safetensors.index.json when sharded),
  reference.safetensors: input_ids [T] (I64) and logits [T, vocab] (F32), what transformers got.

  tiny-qwen2      Qwen2ForCausalLM, q/k/v bias, F16 weights, untied head.
  tiny-qwen3      Qwen3ForCausalLM, q/k RMSNorm, head_dim != hidden/heads, BF16 (+F32 norms), tied.
  tiny-dsv2-yarn  DeepseekV2ForCausalLM, no q_lora, YaRN as DeepSeek-V2-Lite declares it (factor 40,
                  original 4096, beta_fast 32, beta_slow 1, mscale = mscale_all_dim = 0.707),
                  softmax routing with group_limited_greedy, routed_scaling_factor 2, two shards,
                  config in the legacy rope_theta / rope_scaling form.
  tiny-dsv3-fp8   DeepseekV3ForCausalLM, q_lora_rank, YaRN as DeepSeek-V3 declares it (mscale =
                  mscale_all_dim = 1.0), sigmoid routing + e_score_correction_bias, noaux_tc
                  group-limited top-k, norm_topk_prob, fp8 e4m3 linear weights with 128x128
                  block scales (weight_scale_inv), as DeepSeek-V3 ships them.

Weights are drawn at a scale that gives O(1) activations, then rounded to the stored dtype (fp8
weights are replaced by their dequantized values) before transformers runs, so the stored
checkpoint is exactly the model whose logits are saved. Each checkpoint is re-loaded with
from_pretrained (fp8 ones from a dequantized copy) and its logits compared, which checks the
tensor names. Runs on the CPU; no network, no tokenizer.

Usage: python3 make_tiny_checkpoints.py OUT_DIR [--src-dump FILE.tar.gz]
"""
import argparse
import json
import math
import os
import re
import shutil
import sys
import tarfile
import tempfile
import traceback

import torch
import transformers
from safetensors.torch import save_file

T = 40  # tokens in the reference input


def log(*a):
    print(*a, flush=True)


def block_quant_fp8(w, block=128):
    """DeepSeek-V3 style: per 128x128 block, scale = amax / 448, q = fp8(w / scale); w ~ q * scale."""
    rows, cols = w.shape
    nbr, nbc = math.ceil(rows / block), math.ceil(cols / block)
    scale = torch.empty(nbr, nbc, dtype=torch.float32)
    for i in range(nbr):
        for j in range(nbc):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    deq = q.to(torch.float32) * full
    return q, scale, deq


def randomize(model, gen, bias_range=0.1):
    """O(1)-activation random weights: linear ~ N(0, 1/fan_in), norms ~ 1 + 0.1 N, embeddings ~ N(0, 1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(bias_range * (2 * torch.rand(p.shape, generator=gen) - 1))
            elif p.dim() == 1 and ("norm" in name or "layernorm" in name):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # biases
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(bias_range * (2 * torch.rand(b.shape, generator=gen) - 1))


def split_fused_experts(sd, moe_inter):
    """transformers may hold routed experts fused ([E, 2I, H] gate_up, [E, H, I] down); checkpoints
    (DeepSeek's, and what kvq reads first) name them per expert."""
    out = {}
    for k, v in sd.items():
        m = re.match(r"(.*\.mlp\.experts)\.gate_up_proj$", k)
        if m:
            E = v.shape[0]
            if v.shape[1] != 2 * moe_inter:  # [E, H, 2I] layout
                v = v.transpose(1, 2)
            assert v.shape[1] == 2 * moe_inter, (k, v.shape)
            for e in range(E):
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = v[e, :moe_inter].contiguous()
                out[f"{m.group(1)}.{e}.up_proj.weight"] = v[e, moe_inter:].contiguous()
            continue
        m = re.match(r"(.*\.mlp\.experts)\.down_proj$", k)
        if m:
            E = v.shape[0]
            if v.shape[2] != moe_inter:
                v = v.transpose(1, 2)
            assert v.shape[2] == moe_inter, (k, v.shape)
            for e in range(E):
                out[f"{m.group(1)}.{e}.down_proj.weight"] = v[e].contiguous()
            continue
        out[k] = v
    return out


def build(name, cfg_dict, out_root, gen, store, fp8=False, shards=1, tied=False, legacy_config=None):
    """store(name) -> torch dtype for the stored tensor; fp8: quantize linear weights of the layers."""
    d = os.path.join(out_root, name)
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(legacy_config if legacy_config is not None else cfg_dict, f, indent=2)
    cfg = transformers.AutoConfig.from_pretrained(d)
    log(f"[{name}] config class {type(cfg).__name__}; rope_parameters = {getattr(cfg, 'rope_parameters', None)}")
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model.to(torch.float32).eval()
    randomize(model, gen)
    rot = getattr(model.model, "rotary_emb", None)
    if rot is not None:
        log(f"[{name}] inv_freq {rot.inv_freq.tolist()} attention_scaling {getattr(rot, 'attention_scaling', None)}")
    log(f"[{name}] softmax scaling {getattr(model.model.layers[0].self_attn, 'scaling', None)}")
    if tied:
        log(f"[{name}] head shares the embedding storage: "
            f"{model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()}")

    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd = split_fused_experts(sd, cfg_dict.get("moe_intermediate_size", 0))
    if tied:
        sd.pop("lm_head.weight", None)
    stored = {}
    deq = {}
    for k, v in sd.items():
        if fp8 and k.endswith(".weight") and ".layers." in k and v.dim() == 2 and ".mlp.gate." not in k:
            q, s, w = block_quant_fp8(v.float())
            stored[k] = q
            stored[k.replace(".weight", ".weight_scale_inv")] = s
            deq[k] = w
        else:
            dt = store(k)
            stored[k] = v.to(dt).contiguous()
            deq[k] = v.to(dt).to(torch.float32)
    # Put the stored values back into the model so that transformers runs on exactly them.
    msd = model.state_dict()
    fused = any(k.endswith("experts.gate_up_proj") for k in msd)
    with torch.no_grad():
        for k, p in msd.items():
            if k in deq:
                p.copy_(deq[k])
            elif k.endswith("experts.gate_up_proj"):
                base = k[: -len(".gate_up_proj")]
                E = p.shape[0]
                g = torch.stack([deq[f"{base}.{e}.gate_proj.weight"] for e in range(E)])
                u = torch.stack([deq[f"{base}.{e}.up_proj.weight"] for e in range(E)])
                gu = torch.cat([g, u], dim=1)
                p.copy_(gu if p.shape == gu.shape else gu.transpose(1, 2))
            elif k.endswith("experts.down_proj"):
                base = k[: -len(".down_proj")]
                E = p.shape[0]
                dn = torch.stack([deq[f"{base}.{e}.down_proj.weight"] for e in range(E)])
                p.copy_(dn if p.shape == dn.shape else dn.transpose(1, 2))
            elif k == "lm_head.weight" and tied:
                p.copy_(deq["model.embed_tokens.weight"])
            else:
                raise RuntimeError(f"{name}: no stored value for model tensor {k}")
    log(f"[{name}] fused experts in transformers: {fused}")

    ids = torch.randint(0, cfg_dict["vocab_size"], (1, T), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float().contiguous()
    log(f"[{name}] logits {tuple(logits.shape)} std {logits.std().item():.4f} max|.| {logits.abs().max().item():.4f}")

    meta = {"format": "pt"}
    if shards == 1:
        save_file(stored, os.path.join(d, "model.safetensors"), metadata=meta)
    else:
        keys = sorted(stored)
        parts = [[] for _ in range(shards)]
        for k in keys:
            m = re.search(r"\.layers\.(\d+)\.", k)
            idx = 0 if (m is None or int(m.group(1)) == 0) else min(shards - 1, 1)
            parts[idx].append(k)
        weight_map, total = {}, 0
        for i, part in enumerate(parts):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: stored[k] for k in part}, os.path.join(d, fname), metadata=meta)
            for k in part:
                weight_map[k] = fname
                total += stored[k].numel() * stored[k].element_size()
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    save_file({"input_ids": ids[0].to(torch.int64).contiguous(), "logits": logits},
              os.path.join(d, "reference.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})

    # Re-load check: transformers reading back the written names (dequantized copy for fp8).
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(os.path.join(d, "config.json"), tmp)
        save_file({k: v.contiguous() for k, v in deq.items()}, os.path.join(tmp, "model.safetensors"))
        try:
            m2 = transformers.AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32)
        except TypeError:
            m2 = transformers.AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager",
                                                                   torch_dtype=torch.float32)
        m2.to(torch.float32).eval()
        with torch.no_grad():
            l2 = m2(input_ids=ids).logits[0].float()
        diff = (l2 - logits).abs().max().item()
        log(f"[{name}] reload via from_pretrained: max|diff| = {diff:.3g}")
        if diff > 1e-4:
            raise RuntimeError(f"{name}: reloaded checkpoint disagrees ({diff})")

    if fp8:  # now declare the quantization as DeepSeek-V3's config.json does
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
        c["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [128, 128]}
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    log(f"[{name}] wrote {d}: {size} bytes")
    if size >= 1 << 20:
        raise RuntimeError(f"{name}: {size} bytes, over 1 MB")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--src-dump", default=None, help="also tar the transformers sources read (for review)")
    args = ap.parse_args()
    torch.manual_seed(0)
    log(f"torch {torch.__version__}, transformers {transformers.__version__}")
    os.makedirs(args.out, exist_ok=True)
    ok = True

    common = dict(bos_token_id=0, eos_token_id=1, hidden_act="silu", rms_norm_eps=1e-6, attention_dropout=0.0,
                  use_cache=True, dtype="float32")

    jobs = []
    qwen2 = dict(common, architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=128, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                 tie_word_embeddings=False, use_sliding_window=False, sliding_window=None)
    jobs.append(("tiny-qwen2", qwen2, dict(store=lambda k: torch.float16)))

    qwen3 = dict(common, architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=128, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, max_position_embeddings=512,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, attention_bias=False,
                 tie_word_embeddings=True, use_sliding_window=False, sliding_window=None)
    jobs.append(("tiny-qwen3", qwen3, dict(store=lambda k: torch.float32 if "norm" in k else torch.bfloat16,
                                           tied=True)))

    yarn_v2 = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
               "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    dsv2 = dict(common, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=128,
                hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20, n_routed_experts=8, n_shared_experts=2,
                num_experts_per_tok=3, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=2.0, first_k_dense_replace=1,
                moe_layer_freq=1, max_position_embeddings=163840, tie_word_embeddings=False, attention_bias=False,
                rope_theta=10000.0, rope_scaling=yarn_v2)
    jobs.append(("tiny-dsv2-yarn", dsv2, dict(store=lambda k: torch.bfloat16, shards=2, legacy_config=dsv2)))

    dsv3 = dict(common, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=256,
                hidden_size=160, intermediate_size=320, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=64,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="noaux_tc", scoring_func="sigmoid",
                norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1, moe_layer_freq=1,
                max_position_embeddings=163840, tie_word_embeddings=False, attention_bias=False,
                rope_interleave=True,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                 "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                                 "mscale": 1.0, "mscale_all_dim": 1.0})
    jobs.append(("tiny-dsv3-fp8", dsv3, dict(store=lambda k: torch.float32 if "e_score" in k else torch.bfloat16,
                                             fp8=True)))

    for i, (name, cfg, kw) in enumerate(jobs):
        gen = torch.Generator().manual_seed(1000 + i)
        try:
            build(name, cfg, args.out, gen, **kw)
        except Exception:
            ok = False
            log(f"[{name}] FAILED")
            traceback.print_exc()
            sys.stdout.flush()

    if args.src_dump:
        root = os.path.dirname(transformers.__file__)
        with tarfile.open(args.src_dump, "w:gz") as tar:
            for rel in ["modeling_rope_utils.py", "conversion_mapping.py", "configuration_utils.py",
                        "models/deepseek_v2", "models/deepseek_v3", "models/qwen2", "models/qwen3", "models/llama",
                        "integrations/finegrained_fp8.py", "integrations/moe.py"]:
                p = os.path.join(root, rel)
                if os.path.exists(p):
                    tar.add(p, arcname=rel)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
