"""Host cost of the kvq.cuda binding: one decode of 8 sequences x 16K tokens (GQA: 32 query / 8 KV
heads, head_dim 128; MLA: 16 heads, d_latent 512, d_rope 64) through Layer.decode with validate=True
and False, and through a plan (Layer.plan_decode, then DecodePlan.run) without validate. Not a kernel
benchmark (no L2 flush; kvq bench decode / mla times the kernels): CUDA events around one call, and
the host time of the call (with the two event records, measured alone in the first row), median of 50
after 10 warm-up calls.

    PYTHONPATH=build-gpu/python python3 bench/gpu/kvq_cuda_overhead.py
"""
import time

import numpy as np
import torch

import kvq

torch.manual_seed(0)
B, T = 8, 16384
s = torch.cuda.current_stream().cuda_stream


def timed(call):
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    ev, walls = [], []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        call()
        b.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        ev.append(a.elapsed_time(b) * 1000)
        walls.append((t1 - t0) * 1e6)
    return np.median(ev), np.median(walls)


def paged(L):
    P = L.page_tokens
    pages = B * T // P
    pool = torch.zeros(pages * L.page_bytes, dtype=torch.uint8, device="cuda")
    tables = torch.randperm(pages, device="cuda").view(B, T // P).to(torch.int32).contiguous()
    slots = (tables.to(torch.int64).unsqueeze(-1) * P + torch.arange(P, device="cuda")).reshape(-1).contiguous()
    return pool, tables, slots


def report(label, L, pool, tables, lens, q, out, scale):
    rows = [
        ("decode, validate=True", lambda: L.decode(pool, tables, lens, q, out, scale, max_seq_len=T, stream=s, validate=True)),
        ("decode, validate=False", lambda: L.decode(pool, tables, lens, q, out, scale, max_seq_len=T, stream=s, validate=False)),
    ]
    plan = L.plan_decode(pool, tables, lens, q, out, scale)
    rows.append(("plan.run, validate=False", lambda: plan.run(T, s, False)))
    ref = None
    for what, call in rows:
        ev, wall = timed(call)
        torch.cuda.synchronize()
        if ref is None:
            ref = out.clone()
        assert torch.equal(out, ref), "the calls must give the same output bits"
        print(f"| {label} | {what} | {ev:.1f} | {wall:.1f} |")


print("| format | call | CUDA events around the call, us | host time of the call, us |")
print("|---|---|---:|---:|")
ev, wall = timed(lambda: None)
print(f"| - | nothing (the two event records alone) | {ev:.1f} | {wall:.1f} |")
for name in ["tq-4bit-nc", "tq-3bit"]:
    L = kvq.cuda.Layer(name, kvq.Geometry(n_layers=1, n_kv_heads=8, head_dim=128))
    pool, tables, slots = paged(L)
    for i in range(0, B * T, 65536):
        k = torch.randn(65536, 8, 128, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(65536, 8, 128, dtype=torch.bfloat16, device="cuda")
        assert L.store(k, v, slots[i:i + 65536].contiguous(), pool) == 0
    q = torch.randn(B, 32, 128, device="cuda")
    report(name, L, pool, tables, torch.full((B,), T, dtype=torch.int32, device="cuda"), q, torch.empty_like(q), 0.088)
for name in ["c4r4"]:
    L = kvq.cuda.MlaLayer(name, kvq.Geometry(n_layers=1, d_latent=512, d_rope=64))
    pool, tables, slots = paged(L)
    for i in range(0, B * T, 65536):
        c = torch.randn(65536, 512, dtype=torch.bfloat16, device="cuda")
        r = torch.randn(65536, 64, dtype=torch.bfloat16, device="cuda")
        assert L.store(c, r, slots[i:i + 65536].contiguous(), pool) == 0
    q = torch.randn(B, 16, 576, device="cuda")
    out = torch.empty(B, 16, 512, device="cuda")
    report(name + " (MLA)", L, pool, tables, torch.full((B,), T, dtype=torch.int32, device="cuda"), q, out, 0.0417)
