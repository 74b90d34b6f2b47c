#!/usr/bin/env python3
"""Peer decode-attention timings for `kvq bench decode --peers` (bench/results/decode-gqa-*).

- sdpa_flash: torch.nn.functional.scaled_dot_product_attention with the FlashAttention backend
  on a bf16 cache [batch, kv_heads, context, head_dim]; the G = q_heads / kv_heads query heads of
  a group are passed as G query rows of their KV head, so each K/V byte is read once per group
  (what FlashAttention's own GQA decode path does).
- vllm_triton: vLLM's Triton TurboQuant decode op (triton_turboquant_decode_attention, stage 1 +
  stage 2 + the query rotation GEMM it launches) on a paged uint8 cache of the preset's slot
  layout, if `vllm.v1.attention.ops.triton_turboquant_decode` is importable (PYTHONPATH may point
  at a copy of those files; none is part of this repository). Otherwise its rows are null.

Same method as kvq: CUDA events, warm-up, median of --reps runs, L2 flushed before every run
(--flush read: a read-only reduction over a 4x L2 buffer, leaving only clean lines; --flush
write: a memset of it, the earlier method, whose dirty lines are written back during the timed
run), inputs rotated over copies totalling >= 4x L2. Prints one JSON object; `kvq bench decode
--peers` refuses a file measured with another --flush than its own.
"""
import argparse
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from peer_common import add_common_args, flush_buffer, flush_l2, settle

VLLM_PRESETS = {  # name: (key bits (8 = fp8), value bits, norm correction)
    "tq-k8v4": (8, 4, False),
    "tq-4bit-nc": (4, 4, True),
    "tq-k3v4-nc": (3, 4, True),
    "tq-3bit-nc": (3, 3, True),
}


def timed(fn, reps, warmup, flush, mode, gap_ms=0):
    settle(gap_ms)
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for i in range(reps):
        flush_l2(flush, mode, i)
        a.record()
        fn(warmup + i)
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(t)


def main():
    ap = argparse.ArgumentParser()
    add_common_args(ap, batch="8,32", context="4096,16384,65536", reps=60, warmup=5)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vllm-splits", type=int, default=32)
    ap.add_argument("--arena-pad", type=int, default=0,
                    help="MiB held on the device before every row's tensors, as `kvq bench decode --arena-pad`: the "
                         "same rows at another physical placement")
    args, _ = ap.parse_known_args()
    if not 0 <= args.arena_pad <= 1 << 16:
        ap.error(f"--arena-pad {args.arena_pad}: from 0 to 65536 MiB")
    dev = torch.device("cuda")
    flush, l2 = flush_buffer(dev)
    # Held until main returns: every row's tensors are allocated after it (none at 0, as before the option).
    pad = torch.empty(args.arena_pad << 20, dtype=torch.uint8, device=dev) if args.arena_pad > 0 else None  # noqa: F841
    versions = {"torch": torch.__version__, "vllm_triton": None}
    try:
        from vllm.v1.attention.ops import triton_turboquant_decode as tqd  # noqa: PLC0415
        import triton  # noqa: PLC0415

        versions["vllm_triton"] = os.environ.get("KVQ_VLLM_VERSION", "vllm (importable, version unknown)")
        versions["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        tqd = None
        versions["vllm_triton_error"] = repr(e)
    rows = []
    B_list = [int(x) for x in args.batch.split(",")]
    C_list = [int(x) for x in args.context.split(",")]
    Hq, Hk, D = args.q_heads, args.kv_heads, args.head_dim
    G = Hq // Hk
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    for B in B_list:
        for C in C_list:
            # ---- bf16 FlashAttention ----
            kv_bytes = 2 * B * Hk * C * D * 2
            copies = max(1, math.ceil(4 * l2 / kv_bytes))
            ks = [torch.randn(B, Hk, C, D, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            vs = [torch.randn(B, Hk, C, D, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            q = torch.randn(B, Hk, G, D, device=dev, dtype=torch.bfloat16)

            def run_flash(i):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    F.scaled_dot_product_attention(q, ks[i % copies], vs[i % copies])

            try:
                us = timed(run_flash, args.reps, args.warmup, flush, args.flush, args.gap_ms)
            except Exception as e:  # noqa: BLE001
                print(f"sdpa_flash failed: {e!r}", file=sys.stderr)
                us = None
            rows.append({"impl": "sdpa_flash", "batch": B, "context": C, "us": us,
                         "bytes": kv_bytes, "gbps": None if us is None else kv_bytes / (us * 1e3)})
            print(f"sdpa_flash B={B} C={C}: {us} us", file=sys.stderr)
            del ks, vs
            torch.cuda.empty_cache()
            # ---- vLLM Triton TurboQuant ----
            for name, (kb, vb, nc) in VLLM_PRESETS.items():
                us = None
                if tqd is not None:
                    try:
                        us = run_vllm(tqd, name, kb, vb, nc, B, C, Hq, Hk, D, l2, flush, args, dev)
                    except Exception as e:  # noqa: BLE001
                        print(f"vllm {name} failed: {e!r}", file=sys.stderr)
                rows.append({"impl": "vllm_triton", "format": name, "batch": B, "context": C, "us": us})
                print(f"vllm_triton {name} B={B} C={C}: {us} us", file=sys.stderr)
    print(json.dumps({"versions": versions, "flush": args.flush, "gap_ms": args.gap_ms, "arena_pad_mib": args.arena_pad,
                      "rows": rows}, indent=1))


def run_vllm(tqd, name, kb, vb, nc, B, C, Hq, Hk, D, l2, flush, args, dev):
    block = 16
    key_fp8 = kb == 8
    kps = D if key_fp8 else math.ceil(D * kb / 8) + 2
    vps = math.ceil(D * vb / 8) + 4
    slot = kps + vps
    slot += slot % 2
    nblk_seq = math.ceil(C / block)
    nblocks = B * nblk_seq
    cache_bytes = nblocks * block * Hk * slot
    copies = max(1, math.ceil(4 * l2 / cache_bytes))
    caches = []
    for _ in range(copies):
        c = torch.randint(0, 256, (nblocks, block, Hk, slot), dtype=torch.uint8, device=dev)
        if key_fp8:
            c[..., :kps] &= 0xBF  # finite e4m3, |x| < 2
        else:
            c[..., kps - 2:kps] = torch.tensor([0x00, 0x3C], dtype=torch.uint8, device=dev)  # fp16 norm 1.0
        c[..., kps + vps - 4:kps + vps] = torch.tensor([0x00, 0x2C, 0x00, 0xBC], dtype=torch.uint8, device=dev)
        caches.append(c)
    bt = torch.randperm(nblocks, device=dev, dtype=torch.int32).reshape(B, nblk_seq)
    seq = torch.full((B,), C, dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
    H = torch.tensor([[1.0]], device=dev)
    while H.shape[0] < D:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    Pi = (H / math.sqrt(D)).contiguous()
    PiT = Pi.T.contiguous()
    cent = torch.linspace(-0.2, 0.2, 2 ** (vb if key_fp8 else kb), device=dev)
    scale = 1.0 / math.sqrt(D)

    def run(i):
        tqd.triton_turboquant_decode_attention(
            query=q, kv_cache=caches[i % copies], block_table=bt, seq_lens=seq, Pi=Pi, centroids=cent, scale=scale,
            mse_bits=(vb if key_fp8 else kb), key_packed_size=kps, value_quant_bits=vb, key_fp8=key_fp8,
            norm_correction=nc, PiT=PiT, max_num_kv_splits=args.vllm_splits)

    us = timed(run, args.reps, args.warmup, flush, args.flush, args.gap_ms)
    del caches
    torch.cuda.empty_cache()
    return us


if __name__ == "__main__":
    main()
