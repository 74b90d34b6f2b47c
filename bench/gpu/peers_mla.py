#!/usr/bin/env python3
"""Peer MLA decode timings for `kvq bench mla --peers` (bench/results/decode-mla-*).

- flashmla: FlashMLA's dense bf16 decode (`flash_mla.flash_mla_with_kvcache`, sm90) on a paged
  bf16 cache [pages, 64, 1, 576] (content latent 512 + RoPE key 64 per token, head_dim_v 512),
  one query token per sequence, if the `flash_mla` package is importable (PYTHONPATH may point at
  a local build; none is part of this repository). Otherwise its rows are null.

Same method as `kvq bench mla`: pages shuffled over the pool, the decode (FlashMLA's split
kernel + its combine) captured once in a CUDA graph after a first call that builds FlashMLA's
scheduling metadata, replayed with the L2 flushed before each replay (--flush read: a read-only
reduction over a 4x L2 buffer; write: a memset of it), CUDA events, median of --reps replays.
Prints one JSON object.
"""
import argparse
import json
import os
import statistics
import sys

import torch
from peer_common import add_common_args, flush_buffer, flush_l2, settle


def main():
    ap = argparse.ArgumentParser()
    add_common_args(ap, batch="8,32", context="4096,32768,131072", reps=30, warmup=3)
    ap.add_argument("--heads", default="16,128")
    args, _ = ap.parse_known_args()
    dev = torch.device("cuda")
    flush, _ = flush_buffer(dev)
    versions = {"torch": torch.__version__, "flashmla": None}
    try:
        import flash_mla  # noqa: PLC0415

        versions["flashmla"] = os.environ.get("KVQ_FLASHMLA_VERSION", "flash_mla " + getattr(flash_mla, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        flash_mla = None
        versions["flashmla_error"] = repr(e)
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(20261129)
    for B in [int(x) for x in args.batch.split(",")]:
        for C in [int(x) for x in args.context.split(",")]:
            pages_per_seq = (C + 63) // 64
            n_pages = B * pages_per_seq
            cache = None
            if flash_mla is not None:
                cache = torch.randn(n_pages, 64, 1, 576, device=dev, dtype=torch.bfloat16)
                ids = torch.randperm(n_pages, generator=gen).to(torch.int32).view(B, pages_per_seq).to(dev)
                lens = torch.full((B,), C, dtype=torch.int32, device=dev)
            for H in [int(x) for x in args.heads.split(",")]:
                us = None
                if flash_mla is not None:
                    try:
                        us = run_flashmla(flash_mla, cache, ids, lens, B, H, flush, args, dev)
                    except Exception as e:  # noqa: BLE001
                        print(f"flashmla B={B} C={C} H={H} failed: {e!r}", file=sys.stderr)
                bytes_read = B * C * 576 * 2 + B * pages_per_seq * 4
                rows.append({"impl": "flashmla", "batch": B, "context": C, "heads": H, "us": us,
                             "bytes": bytes_read, "gbps": None if us is None else bytes_read / (us * 1e3)})
                print(f"flashmla B={B} C={C} H={H}: {us} us", file=sys.stderr)
            del cache
            torch.cuda.empty_cache()
    print(json.dumps({"versions": versions, "flush": args.flush, "gap_ms": args.gap_ms, "rows": rows}, indent=1))


def run_flashmla(fm, cache, ids, lens, B, H, flush, args, dev):
    q = torch.randn(B, 1, H, 576, device=dev, dtype=torch.bfloat16)
    meta, _ = fm.get_mla_metadata()
    scale = 1.0 / (192.0 ** 0.5)

    def call():
        return fm.flash_mla_with_kvcache(q, cache, ids, lens, 512, meta, softmax_scale=scale, causal=False)

    call()  # builds the scheduling metadata outside the capture
    torch.cuda.synchronize()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        call()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    settle(args.gap_ms)
    for _ in range(args.warmup):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for i in range(args.reps):
        flush_l2(flush, args.flush, i)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(t)


if __name__ == "__main__":
    main()
