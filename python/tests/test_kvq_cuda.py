"""GPU tests of kvq.cuda (the store and decode kernels on torch tensors).

Skipped without torch, a CUDA device or a build with the kernels. On the GPU host (no pytest
needed): PYTHONPATH=build/python python3 python/tests/test_kvq_cuda.py

Each case stores random bf16 rows through kvq.cuda into shuffled slots of a page pool, checks
the records against the CPU quantizers of the same (layer, head) (kvq.quantizers: codes then
metadata at the page offsets Layer.offsets gives), decodes one query per sequence with mixed
lengths, and compares with NumPy attention over the CPU-decoded rows of the same pool: output
NMSE <= 1e-5 per sequence (issue 7's bound). Protected layers (sinks and a recent window) also
check the bf16 rows buffer and read those positions from it, before and after one decode step
moves the window; MLA layers (kvq.cuda.MlaLayer) check latent and RoPE-key records and the
absorbed attention the same way.
"""

import numpy as np

try:
    import pytest
except ImportError:  # plain-script run on the GPU host
    pytest = None

import kvq

try:
    import torch
    HAVE_GPU = kvq.has_cuda and torch.cuda.is_available()
except ImportError:
    torch = None
    HAVE_GPU = False

if pytest is not None:
    pytestmark = pytest.mark.skipif(not HAVE_GPU, reason="needs torch, a CUDA device and kvq.cuda")

CASES = [
    # format, n_kv_heads, head_dim, q_heads
    ("tq-k8v4", 8, 128, 32),
    ("tq-4bit-nc", 8, 128, 32),
    ("tq-k3v4-nc", 8, 128, 32),
    ("tq-3bit-nc", 8, 128, 64),
    ("tq-4bit", 8, 128, 32),
    ("tq-3bit", 8, 128, 64),
    ("tq-3.5bit", 8, 128, 32),
    ("tq-4bit-nc", 2, 64, 4),
    ("tq-3bit", 2, 256, 6),
    ("bf16", 4, 128, 16),
    ("tq-4bit-nc", 2, 128, 32),  # 16 query heads per KV head: one sixteen-head CTA per KV head and split
]


def calibration_for(name, n_kv, d):
    if not kvq.format(name).needs_outliers:
        return None
    rng = np.random.default_rng(11)
    key = [[sorted(rng.choice(d, d // 2, replace=False).tolist()) for _ in range(n_kv)]]
    value = [[sorted(rng.choice(d, d // 2, replace=False).tolist()) for _ in range(n_kv)]]
    return kvq.Calibration(key_channels=key, value_channels=value)


LENS = [70, 333, 1, 197]


def paged_layout(lens, P, rng, spare=3):
    """Shuffled pages for sequences of these lengths: (block tables, slot of every token in
    sequence order, page count)."""
    n_pages = sum((n + P - 1) // P for n in lens) + spare
    perm = rng.permutation(n_pages).tolist()
    max_pages = max((n + P - 1) // P for n in lens)
    tables = np.zeros((len(lens), max_pages), np.int32)
    slots = []
    for b, n in enumerate(lens):
        for j in range((n + P - 1) // P):
            tables[b, j] = perm.pop()
        slots += [int(tables[b, t // P]) * P + t % P for t in range(n)]
    return tables, slots, n_pages


def page_record(pool_h, layer, page_bytes, P, slot, head, side):
    """The record of (slot, head) read back from the pool as the CPU quantizer lays it out:
    codes then metadata ('key' or 'value' side; MLA: latent or RoPE key)."""
    base = (slot // P) * page_bytes
    o = layer.offsets(head, slot % P) if head is not None else layer.offsets(slot % P)
    c, m = o[side + "_code"], o[side + "_meta"]
    return np.concatenate([pool_h[base + c[0]: base + c[0] + c[1]], pool_h[base + m[0]: base + m[0] + m[1]]])


def check_records(pool_h, layer, quant, rows, slots, head, side):
    """Compares every stored record with the CPU quantizer's; returns (decoded rows, records that differ)."""
    P, pb = layer.page_tokens, layer.page_bytes
    recs = np.stack([page_record(pool_h, layer, pb, P, s, head, side) for s in slots])
    differ = np.any(recs != quant.encode(rows), axis=1)
    return quant.decode(recs), differ


def protected(t, n, sinks, window):
    """Whether position t of a sequence of length n is read from its bf16 row."""
    return t < sinks or t >= max(sinks, n - window)


def protection_args(layer, lens, order):
    """The protection arguments of one store call of whole sequences (tokens in `order`), with a
    fresh rows buffer; {} for a layer without protection."""
    if not (layer.sinks or layer.window):
        return {}
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    seq = np.concatenate([np.full(n, b) for b, n in enumerate(lens)]).astype(np.int32)
    return dict(positions=torch.tensor(pos[order], device="cuda"), seq_ids=torch.tensor(seq[order], device="cuda"),
                protect_rows=torch.zeros(layer.protect_rows_shape(len(lens)), dtype=torch.bfloat16, device="cuda"),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"))


def ring_slot(t, sinks, window):
    """Slot of protected position t in the rows buffer (kvq/cuda_protect.hpp): sinks, then a ring."""
    return t if t < sinks else sinks + (t - sinks) % window


def nmse(got, want):
    return np.sum((got - want) ** 2) / np.sum(want ** 2)


def run_case(name, n_kv, d, q_heads, seed=0, sinks=0, window=0):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    g = kvq.Geometry(n_layers=1, n_kv_heads=n_kv, head_dim=d)
    calib = calibration_for(name, n_kv, d)
    layer = kvq.cuda.Layer(name, g, 0, calibration=calib, sinks=sinks, window=window)
    P = layer.page_tokens
    lens = list(LENS)
    tables, slots, n_pages = paged_layout(lens, P, rng)
    N = len(slots)
    key = torch.randn(N, n_kv, d, dtype=torch.bfloat16, device="cuda")
    val = torch.randn(N, n_kv, d, dtype=torch.bfloat16, device="cuda")
    order = rng.permutation(N)  # tokens stored in shuffled order
    slot_t = torch.tensor(np.array(slots)[order], dtype=torch.int64, device="cuda")
    pool = torch.zeros(n_pages * layer.page_bytes, dtype=torch.uint8, device="cuda")
    prot = protection_args(layer, lens, order)
    rejected = layer.store(key[order].contiguous(), val[order].contiguous(), slot_t, pool, **prot)
    assert rejected == 0
    pool_h = pool.cpu().numpy()
    kf = key.float().cpu().numpy()
    vf = val.float().cpu().numpy()

    # Records against the CPU quantizers; decoded rows for the reference.
    K = np.zeros((N, n_kv, d), np.float32)
    V = np.zeros((N, n_kv, d), np.float32)
    differ = 0
    for h in range(n_kv):
        kq, vq = kvq.quantizers(name, g, 0, h, calibration=calib)
        K[:, h], dk = check_records(pool_h, layer, kq, kf[:, h], slots, h, "key")
        V[:, h], dv = check_records(pool_h, layer, vq, vf[:, h], slots, h, "value")
        differ += int(np.sum(dk | dv))
    # Both sides add the norms in kvq::sum_squares's order: every record must match.
    assert differ == 0, f"{name}: {differ} of {N * n_kv} records differ from the CPU encoders"

    def check_protect_rows(lens_now, first_token):
        """The rows buffer holds exactly the bf16 rows of the positions protected at lens_now."""
        got = prot["protect_rows"].float().cpu().numpy()
        for b, n in enumerate(lens_now):
            for t in range(n):
                if protected(t, n, sinks, window):
                    s, i = ring_slot(t, sinks, window), first_token(b, t)
                    assert np.array_equal(got[b, :, s, 0], kf[i]) and np.array_equal(got[b, :, s, 1], vf[i]), \
                        f"{name}: protected row of sequence {b} position {t}"

    starts = np.cumsum([0] + lens[:-1])
    if prot:
        check_protect_rows(lens, lambda b, t: starts[b] + t)

    def decode_and_compare(lens_now, index):
        q = torch.randn(len(lens_now), q_heads, d, dtype=torch.float32, device="cuda")
        out = torch.empty_like(q)
        scale = 1.0 / np.sqrt(d)
        layer.decode(pool, torch.tensor(tables, device="cuda"), torch.tensor(lens_now, dtype=torch.int32, device="cuda"), q, out,
                     scale, **({"protect_rows": prot["protect_rows"]} if prot else {}))
        torch.cuda.synchronize()
        got = out.cpu().numpy().astype(np.float64)
        qh = q.cpu().numpy().astype(np.float64)
        group = q_heads // n_kv
        for b, n in enumerate(lens_now):
            ids = [index(b, t) for t in range(n)]
            # Protected positions are read from their bf16 rows, the others from the packed copy.
            exact = np.array([protected(t, n, sinks, window) for t in range(n)]) if prot else np.zeros(n, bool)
            want = np.zeros((q_heads, d))
            for hq in range(q_heads):
                h = hq // group
                kk = np.where(exact[:, None], kf[ids, h], K[ids, h]).astype(np.float64)
                vv = np.where(exact[:, None], vf[ids, h], V[ids, h]).astype(np.float64)
                s = kk @ qh[b, hq] * scale
                p = np.exp(s - s.max())
                want[hq] = (p / p.sum()) @ vv
            err = nmse(got[b], want)
            assert np.isfinite(err) and err <= 1e-5, f"{name} seq {b}: NMSE {err:.3g}"

    decode_and_compare(lens, lambda b, t: starts[b] + t)
    if not prot:
        return differ
    # One decode step: a new token per sequence at position lens[b] (the window's ring moves on by one;
    # the position that leaves it is read from its packed copy from now on).
    new_k = torch.randn(len(lens), n_kv, d, dtype=torch.bfloat16, device="cuda")
    new_v = torch.randn(len(lens), n_kv, d, dtype=torch.bfloat16, device="cuda")
    new_slots = [int(tables[b, n // P]) * P + n % P for b, n in enumerate(lens)]
    lens1 = [n + 1 for n in lens]
    assert layer.store(new_k, new_v, torch.tensor(new_slots, dtype=torch.int64, device="cuda"), pool,
                       positions=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                       seq_ids=torch.arange(len(lens), dtype=torch.int32, device="cuda"), protect_rows=prot["protect_rows"],
                       seq_lens=torch.tensor(lens1, dtype=torch.int32, device="cuda")) == 0
    pool_h = pool.cpu().numpy()
    kf = np.concatenate([kf, new_k.float().cpu().numpy()])
    vf = np.concatenate([vf, new_v.float().cpu().numpy()])
    K = np.concatenate([K, np.zeros((len(lens), n_kv, d), np.float32)])
    V = np.concatenate([V, np.zeros((len(lens), n_kv, d), np.float32)])
    for h in range(n_kv):
        kq, vq = kvq.quantizers(name, g, 0, h, calibration=calib)
        K[N:, h], _ = check_records(pool_h, layer, kq, kf[N:, h], new_slots, h, "key")
        V[N:, h], _ = check_records(pool_h, layer, vq, vf[N:, h], new_slots, h, "value")
    index1 = lambda b, t: N + b if t == lens[b] else starts[b] + t  # noqa: E731
    check_protect_rows(lens1, index1)
    decode_and_compare(lens1, index1)
    return differ


PROTECTED_CASES = [
    # format, n_kv_heads, head_dim, q_heads, sinks, window
    ("tq-4bit-nc", 8, 128, 32, 4, 16),
    ("tq-3bit", 8, 128, 64, 4, 16),
    ("tq-3.5bit", 4, 128, 16, 2, 40),
    ("tq-4bit", 2, 64, 4, 0, 24),
    ("bf16", 2, 128, 8, 4, 8),
    ("tq-3bit", 2, 128, 20, 4, 16),  # 10 query heads per KV head: one CTA of 10 with a protected split of 10
]


# MLA: format, heads, d_latent, d_rope, sinks, window
MLA_CASES = [
    ("c4r4", 16, 512, 64, 0, 0),
    ("c2r4", 16, 512, 64, 0, 0),
    ("c8r8", 128, 512, 64, 0, 0),
    ("mla-tq4", 16, 512, 64, 0, 0),
    ("bf16", 16, 512, 64, 0, 0),
    ("c4r4", 16, 512, 64, 4, 32),
    ("c3r4", 8, 256, 64, 2, 16),
    # the two decode kernels of c4r4 / c2r4 chosen explicitly (the warpgroup one: no protection)
    ("c4r4", 16, 512, 64, 0, 0, 0, "fragment"),
    ("c4r4", 16, 512, 64, 0, 0, 0, "wgmma"),
    ("c2r4", 64, 512, 64, 0, 0, 0, "wgmma"),
]


def run_mla_case(name, heads, dc, dr, sinks, window, seed=0, kernel="auto"):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    g = kvq.Geometry(n_layers=1, d_latent=dc, d_rope=dr)
    layer = kvq.cuda.MlaLayer(name, g, 0, sinks=sinks, window=window, kernel=kernel)
    assert layer.kernel == kernel
    P = layer.page_tokens
    lens = list(LENS)
    tables, slots, n_pages = paged_layout(lens, P, rng)
    N = len(slots)
    lat = torch.randn(N, dc, dtype=torch.bfloat16, device="cuda")
    rope = torch.randn(N, dr, dtype=torch.bfloat16, device="cuda")
    order = rng.permutation(N)
    pool = torch.zeros(n_pages * layer.page_bytes, dtype=torch.uint8, device="cuda")
    prot = protection_args(layer, lens, order)
    assert layer.store(lat[order].contiguous(), rope[order].contiguous(),
                       torch.tensor(np.array(slots)[order], dtype=torch.int64, device="cuda"), pool, **prot) == 0
    pool_h = pool.cpu().numpy()
    cf, rf = lat.float().cpu().numpy(), rope.float().cpu().numpy()
    cq, rq = kvq.quantizers(name, g, 0, 0)
    C, dc_ = check_records(pool_h, layer, cq, cf, slots, None, "key")
    R, dr_ = check_records(pool_h, layer, rq, rf, slots, None, "value")
    differ = int(np.sum(dc_ | dr_))
    assert differ * 1000 <= N, f"{name}: {differ} of {N} records differ from the CPU encoders"
    q = torch.randn(len(lens), heads, dc + dr, dtype=torch.float32, device="cuda")
    out = torch.empty(len(lens), heads, dc, dtype=torch.float32, device="cuda")
    scale = 1.0 / np.sqrt(dc + dr)
    layer.decode(pool, torch.tensor(tables, device="cuda"), torch.tensor(lens, dtype=torch.int32, device="cuda"), q, out, scale,
                 **({"protect_rows": prot["protect_rows"]} if prot else {}))
    torch.cuda.synchronize()
    got = out.cpu().numpy().astype(np.float64)
    qh = q.cpu().numpy().astype(np.float64)
    start = 0
    for b, n in enumerate(lens):
        exact = np.array([bool(prot) and protected(t, n, sinks, window) for t in range(n)])
        cc = np.where(exact[:, None], cf[start:start + n], C[start:start + n]).astype(np.float64)
        rr = np.where(exact[:, None], rf[start:start + n], R[start:start + n]).astype(np.float64)
        s = (qh[b, :, :dc] @ cc.T + qh[b, :, dc:] @ rr.T) * scale  # (heads, n)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        want = (p / p.sum(axis=1, keepdims=True)) @ cc
        err = nmse(got[b], want)
        assert np.isfinite(err) and err <= 1e-5, f"{name} seq {b}: NMSE {err:.3g}"
        start += n
    if prot:
        rows = prot["protect_rows"].float().cpu().numpy()
        start = 0
        for b, n in enumerate(lens):
            for t in range(n):
                if protected(t, n, sinks, window):
                    s = ring_slot(t, sinks, window)
                    assert np.array_equal(rows[b, s], np.concatenate([cf[start + t], rf[start + t]])), f"{name}: row {b} {t}"
            start += n
    return differ


def test_store_and_decode_match_the_cpu():
    for case in CASES:
        run_case(*case)


def test_protected_rows():
    for name, n_kv, d, q_heads, sinks, window in PROTECTED_CASES:
        run_case(name, n_kv, d, q_heads, sinks=sinks, window=window)


def test_mla_store_and_decode_match_the_cpu():
    for case in MLA_CASES:
        run_mla_case(*case)


def test_errors_and_refused_rows():
    g = kvq.Geometry(n_layers=1, n_kv_heads=2, head_dim=128)
    layer = kvq.cuda.Layer("tq-4bit-nc", g)
    pool = torch.zeros(2 * layer.page_bytes, dtype=torch.uint8, device="cuda")
    key = torch.randn(3, 2, 128, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([0, 1, 2], dtype=torch.int64, device="cuda")

    def raises(exc, fn, *args):
        try:
            fn(*args)
        except exc:
            return
        raise AssertionError(f"{fn} did not raise {exc}")

    raises(ValueError, layer.store, key, key, torch.tensor([0, 1, 128], dtype=torch.int64, device="cuda"), pool)  # beyond the pool
    raises(ValueError, layer.store, key.float(), key, slots, pool)  # dtype
    raises(ValueError, layer.store, key.cpu(), key, slots, pool)  # host tensor
    raises(ValueError, layer.store, key[:, :1], key, slots, pool)  # shape
    raises(kvq.Error, kvq.cuda.Layer, "c4r4", g)  # an MLA format on a GQA geometry
    # A NaN row is refused: written nowhere, counted.
    bad = key.clone()
    bad[1, 0, 5] = float("nan")
    assert layer.store(bad, key, slots, pool) == 1
    o = layer.offsets(0, 1)
    kc = o["key_code"]
    assert int(pool[kc[0]: kc[0] + kc[1]].abs().sum()) == 0
    assert int(pool[layer.offsets(0, 0)["key_code"][0]: layer.offsets(0, 0)["key_code"][0] + kc[1]].abs().sum()) > 0
    q = torch.randn(1, 4, 128, device="cuda")
    out = torch.empty_like(q)
    raises(ValueError, layer.decode, pool, torch.tensor([[0, 5]], dtype=torch.int32, device="cuda"),
           torch.tensor([100], dtype=torch.int32, device="cuda"), q, out, 0.1)  # page 5 is not in the pool
    raises(ValueError, layer.decode, pool, torch.tensor([[0]], dtype=torch.int32, device="cuda"),
           torch.tensor([65], dtype=torch.int32, device="cuda"), q, out, 0.1)  # longer than its pages
    layer.decode(pool, torch.tensor([[0]], dtype=torch.int32, device="cuda"), torch.tensor([1], dtype=torch.int32, device="cuda"),
                 q, out, 0.1)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out).all())




def test_protection_and_mla_errors():
    def raises(exc, fn, *args, **kw):
        try:
            fn(*args, **kw)
        except exc:
            return
        raise AssertionError(f"{fn} did not raise {exc}")

    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    g = kvq.Geometry(n_layers=1, n_kv_heads=2, head_dim=128)
    plain = kvq.cuda.Layer("tq-4bit-nc", g)
    layer = kvq.cuda.Layer("tq-4bit-nc", g, sinks=2, window=4)
    pool = torch.zeros(2 * layer.page_bytes, dtype=torch.uint8, device="cuda")
    key = torch.randn(3, 2, 128, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([0, 1, 2], dtype=torch.int64, device="cuda")
    rows = torch.zeros(layer.protect_rows_shape(2), dtype=torch.bfloat16, device="cuda")
    assert rows.shape == (2, 2, 6, 2, 128)
    raises(ValueError, plain.store, key, key, slots, pool, positions=i32([0, 1, 2]), seq_ids=i32([0, 0, 0]), protect_rows=rows)
    raises(ValueError, layer.store, key, key, slots, pool)  # protected layer without positions / rows
    raises(ValueError, layer.store, key, key, slots, pool, positions=i32([0, 1, 2]), seq_ids=i32([0, 0, 2]), protect_rows=rows)
    raises(ValueError, layer.store, key, key, slots, pool, positions=i32([0, -1, 2]), seq_ids=i32([0, 0, 0]), protect_rows=rows)
    raises(ValueError, layer.store, key, key, slots, pool, positions=i32([0, 1]), seq_ids=i32([0, 0, 0]), protect_rows=rows)
    raises(ValueError, layer.store, key, key, slots, pool, positions=i32([0, 1, 2]), seq_ids=i32([0, 0, 0]), protect_rows=rows[:, :1])
    # Positions 2 and 6 of one sequence share ring slot 2 + 0: refused without seq_lens, kept right with them.
    raises(ValueError, layer.store, key, key, slots, pool, positions=i32([2, 6, 3]), seq_ids=i32([0, 0, 0]), protect_rows=rows)
    raises(ValueError, layer.store, key, key, slots, pool, positions=i32([2, 6, 3]), seq_ids=i32([0, 0, 0]), protect_rows=rows,
           seq_lens=i32([6, 0]))  # position 6 is not below the length
    assert layer.store(key, key, slots, pool, positions=i32([2, 6, 3]), seq_ids=i32([0, 0, 0]), protect_rows=rows,
                       seq_lens=i32([7, 0])) == 0
    torch.cuda.synchronize()
    assert torch.equal(rows[0, :, 2, 0], key[1])  # position 6 (the later one) holds the slot
    q = torch.randn(1, 4, 128, device="cuda")
    out = torch.empty_like(q)
    raises(ValueError, layer.decode, pool, i32([[0]]), i32([7]), q, out, 0.1)  # no protect_rows
    raises(ValueError, plain.decode, pool, i32([[0]]), i32([7]), q, out, 0.1, protect_rows=rows)
    layer.decode(pool, i32([[0]]), i32([7]), q, out, 0.1, protect_rows=rows)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out).all())

    m = kvq.Geometry(n_layers=1, d_latent=512, d_rope=64)
    raises(ValueError, kvq.cuda.Layer, "c4r4", m)  # an MLA geometry on the GQA layer
    raises(ValueError, kvq.cuda.MlaLayer, "c4r4", g)  # a GQA geometry on the MLA layer
    raises(kvq.Error, kvq.cuda.MlaLayer, "tq-4bit", m)  # no MLA kernel for a GQA format
    raises((ValueError, kvq.Error), kvq.cuda.MlaLayer, "c4r4", kvq.Geometry(n_layers=1, d_latent=96, d_rope=64))  # no kernel shape
    raises(ValueError, kvq.cuda.MlaLayer, "c4r4", m, kernel="tensor")  # no such kernel
    ml = kvq.cuda.MlaLayer("c4r4", m)
    mpool = torch.zeros(2 * ml.page_bytes, dtype=torch.uint8, device="cuda")
    lat = torch.randn(2, 512, dtype=torch.bfloat16, device="cuda")
    rope = torch.randn(2, 64, dtype=torch.bfloat16, device="cuda")
    ms = torch.tensor([0, 200], dtype=torch.int64, device="cuda")
    raises(ValueError, ml.store, lat, rope, ms, mpool)  # slot 200 is beyond the pool's 128
    raises(ValueError, ml.store, lat[:, :256], rope, ms, mpool)  # shape
    bad = lat.clone()
    bad[1, 7] = float("inf")
    assert ml.store(bad, rope, torch.tensor([0, 1], dtype=torch.int64, device="cuda"), mpool) == 1
    mq = torch.randn(1, 16, 576, device="cuda")
    mo = torch.empty(1, 16, 512, device="cuda")
    raises(ValueError, ml.decode, mpool, i32([[0, 9]]), i32([100]), mq, mo, 0.05)  # page 9 is not in the pool
    raises(ValueError, ml.decode, mpool, i32([[0]]), i32([1]), mq, torch.empty(1, 16, 576, device="cuda"), 0.05)  # out shape
    ml.decode(mpool, i32([[0]]), i32([1]), mq, mo, 0.05)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(mo).all())


def test_decode_plan():
    """A plan launches on the bound tensors' current contents and gives decode()'s bits."""
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    for kind in ["gqa", "mla"]:
        torch.manual_seed(3)
        if kind == "gqa":
            layer = kvq.cuda.Layer("tq-4bit", kvq.Geometry(n_layers=1, n_kv_heads=4, head_dim=128), sinks=2, window=8)
            rows = [torch.randn(300, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
            q = torch.randn(2, 16, 128, device="cuda")
            out, out2 = torch.empty_like(q), torch.empty_like(q)
        else:
            layer = kvq.cuda.MlaLayer("c4r4", kvq.Geometry(n_layers=1, d_latent=512, d_rope=64), sinks=2, window=8)
            rows = [torch.randn(300, 512, dtype=torch.bfloat16, device="cuda"), torch.randn(300, 64, dtype=torch.bfloat16, device="cuda")]
            q = torch.randn(2, 16, 576, device="cuda")
            out, out2 = torch.empty(2, 16, 512, device="cuda"), torch.empty(2, 16, 512, device="cuda")
        pool = torch.zeros(6 * layer.page_bytes, dtype=torch.uint8, device="cuda")
        prot = torch.zeros(layer.protect_rows_shape(2), dtype=torch.bfloat16, device="cuda")
        # Two sequences of 150 tokens on pages (5, 1, 3) and (0, 2, 4).
        tables = i32([[5, 1, 3], [0, 2, 4]])
        tab = tables.cpu().numpy()
        slots = [int(tab[b, t // 64]) * 64 + t % 64 for b in range(2) for t in range(150)]
        assert layer.store(rows[0], rows[1], torch.tensor(slots, dtype=torch.int64, device="cuda"), pool,
                           positions=i32(list(range(150)) * 2), seq_ids=i32([0] * 150 + [1] * 150), protect_rows=prot,
                           seq_lens=i32([150, 150])) == 0
        # The lengths change between runs (the window rows were kept for length 150, so only the two calls'
        # agreement is checked here; run_case checks protected decoding against NumPy).
        lens = i32([150, 97])
        plan = layer.plan_decode(pool, tables, lens, q, out2, 0.1, protect_rows=prot)
        for n0, n1 in [(150, 97), (3, 150), (128, 64)]:
            lens.copy_(i32([n0, n1]))
            layer.decode(pool, tables, lens, q, out, 0.1, protect_rows=prot)  # max_seq_len: the longest length
            plan.run(max(n0, n1), 0, False)  # the same bound, so the same split count and bits
            torch.cuda.synchronize()
            assert torch.equal(out, out2), f"{kind}: the plan's output differs from decode() at lengths {n0}, {n1}"
            plan.run()  # validate=True reads max_seq_len from seq_lens
            torch.cuda.synchronize()
            assert torch.equal(out, out2)
        tables[0, 1] = 9  # not a page of the pool (sequence 0's second page): the plan's validate refuses it
        try:
            plan.run()
        except ValueError:
            pass
        else:
            raise AssertionError("plan.run(validate=True) accepted page 9 of a 6-page pool")
        tables[0, 1] = 1
        try:
            plan.run(100, 0, True)
        except ValueError:
            pass
        else:
            raise AssertionError("plan.run accepted max_seq_len below the longest sequence")


def test_async_store_and_graph_capture():
    """store(counter=) returns at once and counts refused records on the device; a plan's run()
    captured in a CUDA graph gives decode()'s bits on every replay as the lengths and queries change."""
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    tables = i32([[3, 1, 6, 0], [2, 7, 5, 4]])  # two sequences of up to 256 tokens in 8 pages
    tab = tables.cpu().numpy()
    slots = torch.tensor([int(tab[b, t // 64]) * 64 + t % 64 for b in range(2) for t in range(256)], dtype=torch.int64,
                         device="cuda")
    for kind in ["gqa", "mla"]:
        torch.manual_seed(5)
        if kind == "gqa":
            layer = kvq.cuda.Layer("tq-4bit-nc", kvq.Geometry(n_layers=1, n_kv_heads=8, head_dim=128))
            a = torch.randn(512, 8, 128, dtype=torch.bfloat16, device="cuda")
            b = torch.randn(512, 8, 128, dtype=torch.bfloat16, device="cuda")
            q = torch.randn(2, 32, 128, device="cuda")
            out, out2 = torch.empty_like(q), torch.empty_like(q)
        else:
            layer = kvq.cuda.MlaLayer("c4r4", kvq.Geometry(n_layers=1, d_latent=512, d_rope=64))
            a = torch.randn(512, 512, dtype=torch.bfloat16, device="cuda")
            b = torch.randn(512, 64, dtype=torch.bfloat16, device="cuda")
            q = torch.randn(2, 16, 576, device="cuda")
            out, out2 = torch.empty(2, 16, 512, device="cuda"), torch.empty(2, 16, 512, device="cuda")
        a[5].view(-1)[0] = float("nan")  # one refused token
        a[300].view(-1)[3] = float("inf")  # and another
        pool = torch.zeros(8 * layer.page_bytes, dtype=torch.uint8, device="cuda")
        counter = torch.full((1,), 7, dtype=torch.int32, device="cuda")
        assert layer.store(a, b, slots, pool, counter=counter) is None
        torch.cuda.synchronize()
        # Two refused records added to the 7 already there (GQA: (token, KV head) records, here head 0 of tokens 5
        # and 300; MLA: tokens 5 and 300).
        assert int(counter.item()) == 9, f"{kind}: counter {int(counter.item())}"
        lens = i32([200, 100])
        plan = layer.plan_decode(pool, tables, lens, q, out2, 0.088)
        plan.run(256, 0, False)  # the workspace exists before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan.run(256, torch.cuda.current_stream().cuda_stream, False)
        for n0, n1 in [(200, 100), (256, 7), (1, 256)]:
            lens.copy_(i32([n0, n1]))
            q.copy_(torch.randn_like(q))
            graph.replay()
            torch.cuda.synchronize()
            layer.decode(pool, tables, lens, q, out, 0.088, max_seq_len=256)
            torch.cuda.synchronize()
            assert torch.equal(out, out2), f"{kind}: graph replay differs from decode() at lengths {n0}, {n1}"
        # The asynchronous store captured too: a replay over new rows writes the bytes a direct store writes.
        a2, b2, s2 = a[:64].clone(), b[:64].clone(), slots[:64].clone()
        pool_g, pool_d = pool.clone(), pool.clone()
        c2 = torch.zeros(1, dtype=torch.int32, device="cuda")
        layer.store(a2, b2, s2, pool_g, validate=False, counter=c2)
        torch.cuda.synchronize()
        sgraph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(sgraph):
            layer.store(a2, b2, s2, pool_g, torch.cuda.current_stream().cuda_stream, False, counter=c2)
        a2.copy_(torch.randn_like(a2))
        b2.copy_(torch.randn_like(b2))
        sgraph.replay()
        layer.store(a2, b2, s2, pool_d, validate=False, counter=c2)
        torch.cuda.synchronize()
        assert torch.equal(pool_g, pool_d) and not torch.equal(pool_g, pool), f"{kind}: captured store"


def test_programmatic_decode_after_store():
    """decode(programmatic=True) right after a store on the same stream (its CTAs may start while the store runs)
    gives the bits of an ordinary decode over the stored pages, launched directly and from a captured graph of the
    store and the plan's run; an MLA layer refuses programmatic=True."""
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    tables = i32([[3, 1, 6, 0], [2, 7, 5, 4]])
    tab = tables.cpu().numpy()
    slots = torch.tensor([int(tab[b, t // 64]) * 64 + t % 64 for b in range(2) for t in range(256)], dtype=torch.int64,
                         device="cuda")
    torch.manual_seed(11)
    layer = kvq.cuda.Layer("tq-4bit-nc", kvq.Geometry(n_layers=1, n_kv_heads=8, head_dim=128))
    k = torch.randn(512, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(512, 8, 128, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(2, 32, 128, device="cuda")
    lens = i32([256, 173])
    pool = torch.full((8 * layer.page_bytes,), 0xFF, dtype=torch.uint8, device="cuda")  # NaN pages until stored
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    ref, out = torch.empty_like(q), torch.empty_like(q)
    stream = torch.cuda.current_stream().cuda_stream
    layer.store(k, v, slots, pool, counter=counter)
    layer.decode(pool, tables, lens, q, ref, 0.088, max_seq_len=256)  # creates the workspace
    torch.cuda.synchronize()
    assert torch.isfinite(ref).all()
    for r in range(3):
        pool.fill_(0xFF)
        out.fill_(float("nan"))
        layer.store(k, v, slots, pool, stream, False, counter=counter)
        layer.decode(pool, tables, lens, q, out, 0.088, 256, 0, stream, False, programmatic=True)
        torch.cuda.synchronize()
        assert torch.equal(out, ref), f"programmatic decode after the store differs (launch {r + 1})"
    plan = layer.plan_decode(pool, tables, lens, q, out, 0.088, programmatic=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cs = torch.cuda.current_stream().cuda_stream
        layer.store(k, v, slots, pool, cs, False, counter=counter)
        plan.run(256, cs, False)
    for r in range(2):
        pool.fill_(0xFF)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref), f"graph replay {r + 1} of the store and the programmatic decode differs"
    assert int(counter.item()) == 0
    mla = kvq.cuda.MlaLayer("c4r4", kvq.Geometry(n_layers=1, d_latent=512, d_rope=64))
    mpool = torch.zeros(8 * mla.page_bytes, dtype=torch.uint8, device="cuda")
    mq, mout = torch.randn(2, 16, 576, device="cuda"), torch.empty(2, 16, 512, device="cuda")
    try:
        mla.decode(mpool, tables, lens, mq, mout, 0.088, max_seq_len=256, programmatic=True)
    except ValueError as e:
        assert "GQA layers only" in str(e), str(e)
    else:
        raise AssertionError("MlaLayer.decode accepted programmatic=True")


if __name__ == "__main__":
    if not HAVE_GPU:
        print("kvq.cuda tests skipped: needs torch, a CUDA device and kvq.cuda")
    else:
        for case in CASES:
            d = run_case(*case)
            print(f"ok   {case[0]:<11} kv_heads {case[1]} head_dim {case[2]} q_heads {case[3]}: {d} records differ")
        for name, n_kv, d, q_heads, sinks, window in PROTECTED_CASES:
            d_ = run_case(name, n_kv, d, q_heads, sinks=sinks, window=window)
            print(f"ok   {name:<11} kv_heads {n_kv} head_dim {d} q_heads {q_heads} sinks {sinks} window {window}: {d_} records differ")
        for case in MLA_CASES:
            d_ = run_mla_case(*case)
            print(f"ok   {case[0]:<11} MLA heads {case[1]} d_latent {case[2]} d_rope {case[3]} sinks {case[4]} window {case[5]} "
                  f"kernel {case[7] if len(case) > 7 else 'auto'}: {d_} records differ")
        test_errors_and_refused_rows()
        test_protection_and_mla_errors()
        print("ok   errors and refused rows")
        test_decode_plan()
        print("ok   decode plans")
        test_async_store_and_graph_capture()
        print("ok   asynchronous store, plans in a captured CUDA graph")
        test_programmatic_decode_after_store()
        print("ok   programmatic decode after the store, direct and in a captured CUDA graph")
