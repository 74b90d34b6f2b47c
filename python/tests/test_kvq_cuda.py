"""GPU tests of kvq.cuda (the store and decode kernels on torch tensors).

Skipped without torch, a CUDA device or a build with the kernels. On the GPU host (no pytest
needed): PYTHONPATH=build/python python3 python/tests/test_kvq_cuda.py

Each case stores random bf16 rows through kvq.cuda into shuffled slots of a page pool, checks
the records against the CPU quantizers of the same (layer, head) (kvq.quantizers: codes then
metadata at the page offsets Layer.offsets gives), decodes one query per sequence with mixed
lengths, and compares with NumPy attention over the CPU-decoded rows of the same pool: output
NMSE <= 1e-5 per sequence (issue 7's bound).
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
]


def calibration_for(name, n_kv, d):
    if not kvq.format(name).needs_outliers:
        return None
    rng = np.random.default_rng(11)
    key = [[sorted(rng.choice(d, d // 2, replace=False).tolist()) for _ in range(n_kv)]]
    value = [[sorted(rng.choice(d, d // 2, replace=False).tolist()) for _ in range(n_kv)]]
    return kvq.Calibration(key_channels=key, value_channels=value)


def run_case(name, n_kv, d, q_heads, seed=0):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    g = kvq.Geometry(n_layers=1, n_kv_heads=n_kv, head_dim=d)
    calib = calibration_for(name, n_kv, d)
    layer = kvq.cuda.Layer(name, g, 0, calibration=calib)
    P = layer.page_tokens
    lens = [70, 333, 1, 197]
    n_pages = sum((n + P - 1) // P for n in lens) + 3
    perm = rng.permutation(n_pages).tolist()
    max_pages = max((n + P - 1) // P for n in lens)
    tables = np.zeros((len(lens), max_pages), np.int32)
    slots = []
    for b, n in enumerate(lens):
        for j in range((n + P - 1) // P):
            tables[b, j] = perm.pop()
        slots += [int(tables[b, t // P]) * P + t % P for t in range(n)]
    N = len(slots)
    key = torch.randn(N, n_kv, d, dtype=torch.bfloat16, device="cuda")
    val = torch.randn(N, n_kv, d, dtype=torch.bfloat16, device="cuda")
    order = rng.permutation(N)  # tokens stored in shuffled order
    slot_t = torch.tensor(np.array(slots)[order], dtype=torch.int64, device="cuda")
    pool = torch.zeros(n_pages * layer.page_bytes, dtype=torch.uint8, device="cuda")
    rejected = layer.store(key[order].contiguous(), val[order].contiguous(), slot_t, pool)
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
        recs_k = np.zeros((N, kq.bytes), np.uint8)
        recs_v = np.zeros((N, vq.bytes), np.uint8)
        for i, s in enumerate(slots):
            base = (s // P) * layer.page_bytes
            o = layer.offsets(h, s % P)
            kc, km = o["key_code"], o["key_meta"]
            vc, vm = o["value_code"], o["value_meta"]
            recs_k[i] = np.concatenate([pool_h[base + kc[0]: base + kc[0] + kc[1]], pool_h[base + km[0]: base + km[0] + km[1]]])
            recs_v[i] = np.concatenate([pool_h[base + vc[0]: base + vc[0] + vc[1]], pool_h[base + vm[0]: base + vm[0] + vm[1]]])
        cpu_k, cpu_v = kq.encode(kf[:, h]), vq.encode(vf[:, h])
        differ += int(np.sum(np.any(recs_k != cpu_k, axis=1) | np.any(recs_v != cpu_v, axis=1)))
        K[:, h] = kq.decode(recs_k)
        V[:, h] = vq.decode(recs_v)
    # The GPU store's double sums of squares may round differently (tests/cuda/test_decode.cpp).
    assert differ * 1000 <= N * n_kv, f"{name}: {differ} of {N * n_kv} records differ from the CPU encoders"

    q = torch.randn(len(lens), q_heads, d, dtype=torch.float32, device="cuda")
    out = torch.empty_like(q)
    scale = 1.0 / np.sqrt(d)
    tables_t = torch.tensor(tables, device="cuda")
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    layer.decode(pool, tables_t, lens_t, q, out, scale)
    torch.cuda.synchronize()
    got = out.cpu().numpy().astype(np.float64)
    qh = q.cpu().numpy().astype(np.float64)
    group = q_heads // n_kv
    start = 0
    for b, n in enumerate(lens):
        want = np.zeros((q_heads, d))
        for hq in range(q_heads):
            h = hq // group
            kk = K[start:start + n, h].astype(np.float64)
            vv = V[start:start + n, h].astype(np.float64)
            s = kk @ qh[b, hq] * scale
            p = np.exp(s - s.max())
            want[hq] = (p / p.sum()) @ vv
        err = np.sum((got[b] - want) ** 2) / np.sum(want ** 2)
        assert np.isfinite(err) and err <= 1e-5, f"{name} seq {b}: NMSE {err:.3g}"
        start += n
    return differ


def test_store_and_decode_match_the_cpu():
    for case in CASES:
        run_case(*case)


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


if __name__ == "__main__":
    if not HAVE_GPU:
        print("kvq.cuda tests skipped: needs torch, a CUDA device and kvq.cuda")
    else:
        for case in CASES:
            d = run_case(*case)
            print(f"ok   {case[0]:<11} kv_heads {case[1]} head_dim {case[2]} q_heads {case[3]}: {d} records differ")
        test_errors_and_refused_rows()
        print("ok   errors and refused rows")
