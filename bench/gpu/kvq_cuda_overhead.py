"""Host cost of the kvq.cuda binding: Layer.decode of 8 sequences x 16K tokens (32 query / 8 KV heads,
head_dim 128) with validate=True and False. Not a kernel benchmark (no L2 flush; kvq bench decode
times the kernel): CUDA events around one call, and the host time of the call, median of 50.

    PYTHONPATH=build-gpu/python python3 bench/gpu/kvq_cuda_overhead.py
"""
import time, numpy as np, torch, kvq
torch.manual_seed(0)
for name in ["tq-4bit-nc", "tq-3bit"]:
    g = kvq.Geometry(n_layers=1, n_kv_heads=8, head_dim=128)
    L = kvq.cuda.Layer(name, g)
    B, T, P = 8, 16384, L.page_tokens
    pages = B * T // P
    pool = torch.zeros(pages * L.page_bytes, dtype=torch.uint8, device="cuda")
    perm = torch.randperm(pages, device="cuda", dtype=torch.int64)
    tables = perm.view(B, T // P).to(torch.int32).contiguous()
    slots = (tables.to(torch.int64).unsqueeze(-1) * P + torch.arange(P, device="cuda")).reshape(-1).contiguous()
    chunk = 65536
    for i in range(0, B * T, chunk):
        k = torch.randn(chunk, 8, 128, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(chunk, 8, 128, dtype=torch.bfloat16, device="cuda")
        assert L.store(k, v, slots[i:i + chunk].contiguous(), pool) == 0
    lens = torch.full((B,), T, dtype=torch.int32, device="cuda")
    q = torch.randn(B, 32, 128, device="cuda")
    out = torch.empty_like(q)
    s = torch.cuda.current_stream().cuda_stream
    res = {}
    for validate in [True, False]:
        kw = dict(max_seq_len=T, stream=s, validate=validate)
        for _ in range(10):
            L.decode(pool, tables, lens, q, out, 0.088, **kw)
        torch.cuda.synchronize()
        ev = []
        walls = []
        for _ in range(50):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            L.decode(pool, tables, lens, q, out, 0.088, **kw)
            b.record()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            ev.append(a.elapsed_time(b) * 1000)
            walls.append((t1 - t0) * 1e6)
        res[validate] = (np.median(ev), np.median(walls))
    print(f"{name}: events us (validate on / off) {res[True][0]:.1f} / {res[False][0]:.1f}; host us per call {res[True][1]:.1f} / {res[False][1]:.1f}")
