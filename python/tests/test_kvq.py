"""Tests of the Python bindings (python/kvq_py.cpp) against NumPy references and the fixtures.

Run by ctest (test `python_bindings`) with PYTHONPATH=build/python; KVQ_ROOT names the source
tree (models/, data/). What they check is the binding, not the library again: shapes, dtypes and
record layout on the way in and out, that the packed-code paths (scores, weighted sums,
attention over pages) agree with NumPy on the decoded rows, that errors arrive as kvq.Error /
ValueError with the library's message, and that the model runtime reproduces the transformers
logits of the fixtures.
"""

import json
import os
import struct
import sys

import numpy as np
import pytest

import kvq

ROOT = os.environ.get("KVQ_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))


def models_dir(name):
    return os.path.join(ROOT, "models", name)


def read_safetensors(path):
    """The tensors of a safetensors file as float32 / int arrays (bf16 widened exactly)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        raw = data[a:b]
        if t["dtype"] == "F32":
            arr = np.frombuffer(raw, dtype="<f4")
        elif t["dtype"] == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif t["dtype"] == "I64":
            arr = np.frombuffer(raw, dtype="<i8")
        elif t["dtype"] == "I32":
            arr = np.frombuffer(raw, dtype="<i4")
        else:
            raise ValueError(t["dtype"])
        out[name] = arr.reshape(t["shape"])
    return out


def bf16_round(x):
    """Round float32 to bf16 (nearest even), as float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def nmse(a, b):
    return float(np.sum((a - b) ** 2) / np.sum(b ** 2))


def gqa_attention(q, keys, values, n_heads, n_kv, d, dv, scale):
    """Softmax attention of one query row over rows [T, n_kv * d] (query head h reads kv head h // group)."""
    group = n_heads // n_kv
    out = np.zeros(n_heads * dv)
    for h in range(n_heads):
        kv = h // group
        k = keys[:, kv * d:(kv + 1) * d].astype(np.float64)
        v = values[:, kv * dv:(kv + 1) * dv].astype(np.float64)
        s = k @ q[h * d:(h + 1) * d].astype(np.float64) * scale
        p = np.exp(s - s.max())
        out[h * dv:(h + 1) * dv] = (p / p.sum()) @ v
    return out


# ---- registry ----------------------------------------------------------------------------


def test_registry_names_and_bits():
    names = [f.name for f in kvq.formats()]
    for n in ["bf16", "fp8", "tq-k8v4", "tq-4bit-nc", "tq-k3v4-nc", "tq-3bit-nc", "tq-4bit", "tq-3.5bit", "tq-3bit",
              "tq-2.5bit", "c4r4", "c2r4", "mla-tq4"]:
        assert n in names
    kv = {f.name for f in kvq.formats("kv")}
    mla = {f.name for f in kvq.formats("mla")}
    assert "c4r4" in mla and "c4r4" not in kv and "tq-3bit" in kv and "tq-3bit" not in mla
    assert "bf16" in kv and "bf16" in mla
    f = kvq.format("tq-k3v4-nc")
    assert (f.key_bits, f.value_bits, f.family, f.pair) == (3, 4, "kv", "")
    assert kvq.format("tq-3.5bit").needs_outliers and not kvq.format("tq-4bit").needs_outliers
    assert kvq.format("tq-4bit").uses_centering and not kvq.format("tq-4bit-nc").uses_centering
    with pytest.raises(kvq.Error, match="tq-4bit-nc"):  # the message lists the valid names
        kvq.format("tq-5bit")
    with pytest.raises(ValueError):
        kvq.formats("gqa")


@pytest.mark.parametrize("name,per_head", [("bf16", 512), ("tq-k8v4", 196), ("tq-4bit-nc", 134), ("tq-k3v4-nc", 118),
                                           ("tq-3bit-nc", 102), ("tq-4bit", 132), ("tq-3bit", 100)])
def test_token_bytes_match_the_format_table(name, per_head):
    # README's table: bytes per token and KV head at head_dim 128.
    g = kvq.Geometry(n_layers=2, n_kv_heads=8, head_dim=128)
    t = kvq.token_bytes(name, g)
    assert t["per_layer"] == 8 * per_head
    assert t["bf16_per_layer"] == 8 * 512


def test_mla_token_bytes():
    g = kvq.Geometry(n_layers=1, d_latent=512, d_rope=64)
    assert kvq.token_bytes("c4r4", g)["record"] == 320
    assert kvq.token_bytes("c2r4", g)["record"] == 192
    with pytest.raises(kvq.Error):
        kvq.token_bytes("tq-3bit", g)  # a GQA format on an MLA geometry
    with pytest.raises(ValueError):
        kvq.Geometry(n_layers=1, n_kv_heads=2, head_dim=64, d_latent=512, d_rope=64)


# ---- quantizers --------------------------------------------------------------------------


@pytest.mark.parametrize("name,lo,hi", [("tq-4bit", 0.005, 0.015), ("tq-3bit", 0.02, 0.05), ("tq-4bit-nc", 0.005, 0.015)])
def test_key_distortion_is_the_lloyd_max_distortion(name, lo, hi):
    # TurboQuant-MSE keys on Gaussian vectors: NMSE near the sphere codebook's distortion
    # (4 bits ~0.0095, 3 bits ~0.034 per the chapter).
    rng = np.random.default_rng(1)
    g = kvq.Geometry(n_layers=1, n_kv_heads=1, head_dim=128)
    kq, vq = kvq.quantizers(name, g)
    x = rng.standard_normal((2000, 128)).astype(np.float32)
    rec = kq.encode(x)
    assert rec.dtype == np.uint8 and rec.shape == (2000, kq.bytes)
    assert kq.bytes == kq.code_bytes + kq.meta_bytes
    y = kq.decode(rec)
    assert y.shape == x.shape and y.dtype == np.float32
    e = nmse(y, x)
    assert lo <= e <= hi, e
    # One vector in, one record out, equal to the batch's row.
    np.testing.assert_array_equal(kq.encode(x[7]), rec[7])
    np.testing.assert_array_equal(kq.decode(rec[7]), y[7])
    # Other dtypes and layouts are converted like NumPy would.
    np.testing.assert_array_equal(kq.encode(np.asfortranarray(x.astype(np.float64))), rec)


@pytest.mark.parametrize("name", ["tq-4bit", "tq-3bit", "tq-k8v4", "tq-3bit-nc", "fp8", "tq-3bit-qjl"])
def test_scores_and_weighted_sums_from_packed_codes(name):
    rng = np.random.default_rng(2)
    g = kvq.Geometry(n_layers=3, n_kv_heads=4, head_dim=128)
    kq, vq = kvq.quantizers(name, g, layer=2, head=3)
    keys = rng.standard_normal((300, 128)).astype(np.float32)
    vals = rng.standard_normal((300, 128)).astype(np.float32)
    kr, vr = kq.encode(keys), vq.encode(vals)
    q = rng.standard_normal(128).astype(np.float32)
    s = kq.scores(q, kr)
    assert s.shape == (300,)
    want = kq.decode(kr).astype(np.float64) @ q
    if name == "tq-3bit-qjl":  # QJL scores are an unbiased estimate, not decode(code) . q
        assert np.corrcoef(s, want)[0, 1] > 0.9
    else:
        np.testing.assert_allclose(s, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    w = rng.random(300).astype(np.float32)
    acc = vq.weighted_sum(w, vr)
    want_v = w.astype(np.float64) @ vq.decode(vr).astype(np.float64)
    np.testing.assert_allclose(acc, want_v, rtol=1e-4, atol=1e-4 * np.abs(want_v).max())


def test_quantizers_differ_by_layer_and_head():
    # kvq's formats rotate with a sign diagonal per (layer, head): the records must differ.
    g = kvq.Geometry(n_layers=2, n_kv_heads=2, head_dim=64)
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    r00 = kvq.quantizers("tq-4bit", g, 0, 0)[0].encode(x)
    r01 = kvq.quantizers("tq-4bit", g, 0, 1)[0].encode(x)
    r10 = kvq.quantizers("tq-4bit", g, 1, 0)[0].encode(x)
    assert not np.array_equal(r00, r01) and not np.array_equal(r00, r10)
    np.testing.assert_array_equal(r00, kvq.quantizers("tq-4bit", g, 0, 0)[0].encode(x))


def test_quantizer_errors():
    g = kvq.Geometry(n_layers=1, n_kv_heads=2, head_dim=64)
    kq, _ = kvq.quantizers("tq-3bit", g)
    x = np.ones((3, 64), np.float32)
    x[1, 5] = np.nan
    with pytest.raises(kvq.Error, match="finite|NaN|nan"):
        kq.encode(x)
    with pytest.raises(ValueError, match="64"):
        kq.encode(np.ones((3, 65), np.float32))
    with pytest.raises(ValueError):
        kq.decode(np.zeros((2, kq.bytes + 1), np.uint8))
    with pytest.raises(ValueError):
        kvq.quantizers("tq-3bit", g, head=2)
    with pytest.raises(kvq.Error, match="outlier"):
        kvq.quantizers("tq-3.5bit", kvq.Geometry(n_layers=1, n_kv_heads=1, head_dim=128))
    # A zero vector encodes (norm 0) and decodes to zeros.
    z = kq.decode(kq.encode(np.zeros(64, np.float32)))
    assert np.all(z == 0)


def test_split_format_with_explicit_calibration():
    g = kvq.Geometry(n_layers=1, n_kv_heads=1, head_dim=128)
    ch = list(range(0, 128, 2))
    c = kvq.Calibration(key_channels=[[ch]], value_channels=[[ch]])
    kq, vq = kvq.quantizers("tq-3.5bit", g, calibration=c)
    x = np.random.default_rng(4).standard_normal((500, 128)).astype(np.float32)
    e = nmse(kq.decode(kq.encode(x)), x)
    assert 0.01 < e < 0.03, e  # between the 4-bit and 3-bit distortions


# ---- caches ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,sinks,window", [("tq-4bit-nc", 0, 0), ("tq-3bit", 4, 16), ("tq-k8v4", 0, 8), ("bf16", 0, 0)])
def test_paged_attention_equals_numpy_on_the_rows_it_reads(name, sinks, window):
    rng = np.random.default_rng(5)
    n_kv, d, heads, T = 2, 64, 4, 150
    g = kvq.Geometry(n_layers=2, n_kv_heads=n_kv, head_dim=d)
    cache = kvq.PagedCache(g, name, sinks=sinks, window=window, page_tokens=16)
    keys = rng.standard_normal((T, n_kv * d)).astype(np.float32)
    vals = rng.standard_normal((T, n_kv * d)).astype(np.float32)
    for layer in range(2):
        cache.append(layer, keys[:100], vals[:100])
    assert cache.length() == 100
    for layer in range(2):
        cache.append(layer, keys[100:], vals[100:])
    assert cache.length() == T
    q = rng.standard_normal(heads * d).astype(np.float32)
    scale = 1 / np.sqrt(d)
    out = cache.attend(1, q, heads, scale)  # one query at the last position
    assert out.shape == (heads * d,)
    rows = [cache.read_row(1, t, as_of=T - 1) for t in range(T)]
    k = np.stack([r[0] for r in rows])
    v = np.stack([r[1] for r in rows])
    want = gqa_attention(q, k, v, heads, n_kv, d, d, scale)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    # Protected rows are read from bf16, the others from their packed copies.
    if window:
        np.testing.assert_array_equal(k[T - 1], bf16_round(keys[T - 1]))
    if name != "bf16":
        assert not np.array_equal(cache.read_row(1, T - 1)[0], bf16_round(keys[T - 1]))
    # A causal query at an earlier position sees only the rows up to it. With a recent window,
    # queries must belong to the chunk appended last (older window rows are gone).
    if window:
        with pytest.raises(kvq.Error, match="chunk appended last"):
            cache.attend(1, q, heads, scale, pos0=9)
        return
    out_early = cache.attend(1, q, heads, scale, pos0=9)
    rows9 = [cache.read_row(1, t, as_of=9) for t in range(10)]
    want9 = gqa_attention(q, np.stack([r[0] for r in rows9]), np.stack([r[1] for r in rows9]), heads, n_kv, d, d, scale)
    np.testing.assert_allclose(out_early, want9, rtol=1e-4, atol=1e-5)


def test_dense_cache_is_bf16_rows():
    rng = np.random.default_rng(6)
    g = kvq.Geometry(n_layers=1, n_kv_heads=1, head_dim=32)
    keys = rng.standard_normal((40, 32)).astype(np.float32)
    vals = rng.standard_normal((40, 32)).astype(np.float32)
    q = rng.standard_normal(64).astype(np.float32)
    for storage, rnd in [("bf16", bf16_round), ("f32", lambda a: a)]:
        c = kvq.DenseCache(g, storage)
        c.append(0, keys, vals)
        out = c.attend(0, q, 2, 0.2)
        want = gqa_attention(q, rnd(keys), rnd(vals), 2, 1, 32, 32, 0.2)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
        with pytest.raises(ValueError, match="PagedCache"):
            c.memory()


def test_memory_accounting_and_pool_exhaustion():
    g = kvq.Geometry(n_layers=2, n_kv_heads=2, head_dim=128)
    c = kvq.PagedCache(g, "tq-3bit-nc", sinks=4, window=32)
    x = np.random.default_rng(7).standard_normal((200, 256)).astype(np.float32)
    for layer in range(2):
        c.append(layer, x, x)
    assert c.memory() == kvq.account(g, "tq-3bit-nc", 200, sinks=4, window=32)
    bf = kvq.account(g, "bf16", 200)
    assert bf["total"] > 4 * c.memory()["packed_bytes"]
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        kvq.account(g, "tq-3bit-nc", -1)
    with pytest.raises(kvq.Error, match="page_tokens must be 1..4096"):  # was a division by zero
        kvq.account(g, "tq-3bit-nc", 200, page_tokens=0)
    # A pool of two blocks: the third block's append fails with kvq.Error and nothing is lost.
    assert kvq.PagedCache(g, "tq-3bit-nc").memory()["blocks"] == 0  # an empty cache holds no block
    small = kvq.PagedCache(g, "tq-3bit-nc", page_tokens=16, pool_bytes=2 * 16 * 2 * 2 * 102)
    for layer in range(2):
        small.append(layer, x[:32], x[:32])
    assert small.length() == 32
    with pytest.raises(kvq.Error, match="pool|exhaust"):
        small.append(0, x[32:33], x[32:33])
    assert small.length() == 32
    out = small.attend(0, np.ones(256, np.float32), 2, 0.1)
    assert np.all(np.isfinite(out))


def test_cache_argument_errors():
    g = kvq.Geometry(n_layers=1, n_kv_heads=2, head_dim=16)
    c = kvq.PagedCache(g, "tq-4bit-nc")
    with pytest.raises(ValueError, match="k"):
        c.append(0, np.ones((3, 31), np.float32), np.ones((3, 32), np.float32))
    with pytest.raises(ValueError, match="layer"):
        c.append(1, np.ones((3, 32), np.float32), np.ones((3, 32), np.float32))
    bad = np.ones((3, 32), np.float32)
    bad[2, 0] = np.inf
    with pytest.raises(kvq.Error):
        c.append(0, bad, np.ones((3, 32), np.float32))
    assert c.length() == 0
    c.append(0, np.ones((3, 32), np.float32), np.ones((3, 32), np.float32))
    with pytest.raises(ValueError, match="positions"):
        c.attend(0, np.ones(32, np.float32), 2, 0.1, pos0=3)
    with pytest.raises(ValueError, match="multiple"):
        c.attend(0, np.ones(48, np.float32), 3, 0.1)
    with pytest.raises(kvq.Error):
        kvq.PagedCache(g, "c4r4")


def test_mla_cache_attention():
    rng = np.random.default_rng(8)
    g = kvq.Geometry(n_layers=1, d_latent=128, d_rope=64)
    c = kvq.PagedCache(g, "c4r4", sinks=2, window=8)
    lat = rng.standard_normal((90, 128)).astype(np.float32)
    rope = rng.standard_normal((90, 64)).astype(np.float32)
    c.append(0, lat, rope)
    heads = 4
    q = rng.standard_normal(heads * 192).astype(np.float32)
    out = c.attend(0, q, heads, 0.07)
    assert out.shape == (heads * 128,)
    rows = [c.read_row(0, t, as_of=89) for t in range(90)]
    kc = np.stack([r[0] for r in rows]).astype(np.float64)
    kr = np.stack([r[1] for r in rows]).astype(np.float64)
    for h in range(heads):
        qh = q[h * 192:(h + 1) * 192].astype(np.float64)
        s = (kc @ qh[:128] + kr @ qh[128:]) * 0.07
        p = np.exp(s - s.max())
        np.testing.assert_allclose(out[h * 128:(h + 1) * 128], (p / p.sum()) @ kc, rtol=1e-4, atol=1e-5)


# ---- model runtime -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-mla"])
def test_model_logits_match_transformers(name):
    ref = read_safetensors(os.path.join(models_dir(name), "reference.safetensors"))
    model = kvq.Model(models_dir(name))
    cfg = model.config
    assert cfg["vocab_size"] == 4096 and cfg["n_layers"] == 4 and cfg["mla"] == (name == "tiny-mla")
    ids = ref["input_ids"].astype(np.int32)
    cache = kvq.DenseCache(model.geometry, "f32")
    logits = model.forward(ids, cache)
    assert logits.shape == (len(ids), 4096)
    assert np.max(np.abs(logits - ref["logits"])) <= 2e-3  # the C++ parity test's bound
    assert cache.length() == len(ids)
    # Decode one more token: its logits equal those of a one-shot run over all tokens.
    nxt = model.forward(np.array([int(np.argmax(logits[-1]))], np.int32), cache, logits="last")
    cache2 = kvq.DenseCache(model.geometry, "f32")
    full = model.forward(np.append(ids, int(np.argmax(logits[-1]))).astype(np.int32), cache2, logits="last")
    np.testing.assert_allclose(nxt, full, atol=1e-4)


def test_model_with_a_quantized_cache_and_perplexity():
    model = kvq.Model(models_dir("tiny-gqa"))
    tok = kvq.Tokenizer(models_dir("tiny-gqa"))
    assert tok.vocab_size == 4096 and tok.token_id("<|eos|>") == 1
    text = open(os.path.join(ROOT, "data", "validation.txt"), encoding="utf-8").read()
    ids = tok.encode(text[:2000])
    assert ids.dtype == np.int32 and tok.decode(ids) == text[:2000]
    base = model.perplexity(tok, text, ctx=256, windows=2)
    q4 = model.perplexity(tok, text, format="tq-4bit-nc", ctx=256, windows=2)
    q3 = model.perplexity(tok, text, format="tq-3bit-nc", ctx=256, windows=2)
    assert base["windows"] == 2 and base["predictions"] == 2 * 255
    assert np.isfinite(base["ppl"]) and 5 < base["ppl"] < 200
    # Quantized caches change the result a little, 3 bits more than 4 (measured on these two
    # short windows: bf16 34.00, tq-4bit-nc 34.95, tq-3bit-nc 37.28).
    assert 0 < abs(q4["ppl"] / base["ppl"] - 1) < 0.05
    assert q4["ppl"] < q3["ppl"] < 1.2 * base["ppl"]
    # Model.cache gives the model's geometry; forward checks the cache fits.
    c = model.cache("tq-4bit-nc", sinks=4, window=64)
    lg = model.forward(ids[:50], c, logits="last")
    assert lg.shape == (4096,) and c.length() == 50
    with pytest.raises(ValueError, match="geometry"):
        model.forward(ids[:5], kvq.PagedCache(kvq.Geometry(n_layers=4, n_kv_heads=2, head_dim=64)))
    with pytest.raises(kvq.Error):
        model.forward(np.array([5000], np.int32), c)  # a token id beyond the vocabulary
    with pytest.raises(kvq.Error):
        kvq.Model(os.path.join(ROOT, "data"))  # no config.json


def test_evaluate_is_kvq_eval():
    """kvq.evaluate: kvq eval's rows, with the bf16 row as the reference of KL / top-1 and the
    perplexity equal to Model.perplexity with the same paged cache."""
    text = os.path.join(ROOT, "data", "validation.txt")
    calib = os.path.join(ROOT, "data", "validation-tech.txt")
    stages = []
    r = kvq.evaluate(models_dir("tiny-gqa"), ["bf16", "tq-4bit-nc", "tq-3bit-nc@s4,w32", "tq-3bit-nc"], text, ctx=256, windows=2,
                     needle_samples=3, needle_lengths=[256], diag_queries=8, calib_text=calib,
                     progress=lambda stage, frac: stages.append((stage, frac)))
    assert r["architecture"] == "LlamaForCausalLM" and r["windows"] == 2 and r["predictions"] == 2 * 255
    assert r["blas_kernels"] == kvq.blas_kernels() and r["blas_kernels"]  # the kernel set named, as in kvq eval --json
    bf, q4, q3, q3plain = r["rows"]
    assert [x["cache"] for x in r["rows"]] == ["bf16", "tq-4bit-nc", "tq-3bit-nc@s4,w32", "tq-3bit-nc"]
    assert (q3["sinks"], q3["window"], q4["sinks"]) == (4, 32, 0)
    assert bf["kl"] == 0 and bf["top1"] == 1 and bf["delta_ppl_pct"] == 0
    assert bf["ppl"] == pytest.approx(r["bf16_ppl"], rel=1e-12)
    model, tok = kvq.Model(models_dir("tiny-gqa")), kvq.Tokenizer(models_dir("tiny-gqa"))
    raw = open(text, encoding="utf-8").read()
    assert q4["ppl"] == pytest.approx(model.perplexity(tok, raw, format="tq-4bit-nc", ctx=256, windows=2)["ppl"], rel=1e-9)
    for row in (q4, q3, q3plain):
        assert 0 < row["kl"] < 0.5 and 0.5 < row["top1"] < 1
        tb = kvq.token_bytes(row["format"], model.geometry)
        assert row["compression"] == pytest.approx(tb["bf16_per_layer"] / tb["per_layer"], rel=1e-9)
        assert row["bits_per_value"] == pytest.approx(tb["bits_per_value"], rel=1e-9)
        assert len(row["layers"]) == 4 and all(0 < l["output_nmse"] < 1 for l in row["layers"])
        assert set(row["needle_accuracy"]) == {256} and 0 <= row["needle_accuracy"][256] <= 1
    # KL and top-1 of tq-4bit-nc recomputed here: the protocol's first two windows (documents split at
    # blank lines, each followed by <|eos|>; a window is <|bos|> + 255 stream tokens), the logits of a
    # bf16 and a tq-4bit-nc paged cache, KL(P_bf16 || P_q) in float64 averaged over predictions.
    docs, cur = [], []
    for line in raw.split("\n"):
        if line.strip(" \t\r\f\v"):
            cur.append(line)
        elif cur:
            docs.append("\n".join(cur))
            cur = []
    stream = []
    for d in docs + (["\n".join(cur)] if cur else []):
        stream += list(tok.encode(d)) + [1]
        if len(stream) >= 2 * 256:
            break
    kl = top1 = 0.0
    for w in range(2):
        win = np.array([model.config["bos_token_id"]] + stream[w * 256: w * 256 + 255], np.int32)
        ref = model.forward(win, model.cache("bf16")).astype(np.float64)[:-1]
        got = model.forward(win, model.cache("tq-4bit-nc")).astype(np.float64)[:-1]
        lp = ref - np.log(np.exp(ref - ref.max(1, keepdims=True)).sum(1, keepdims=True)) - ref.max(1, keepdims=True)
        lq = got - np.log(np.exp(got - got.max(1, keepdims=True)).sum(1, keepdims=True)) - got.max(1, keepdims=True)
        kl += np.mean(np.sum(np.exp(lp) * (lp - lq), axis=1)) / 2
        top1 += np.mean(ref.argmax(1) == got.argmax(1)) / 2
    assert q4["kl"] == pytest.approx(kl, rel=1e-6) and q4["top1"] == pytest.approx(top1, abs=1e-12)
    # bf16 sinks and a 32-token window (an eighth of each 256-token window) take error out of the 3-bit cache.
    assert q3["kl"] < q3plain["kl"] and q3["top1"] >= q3plain["top1"]
    assert stages and stages[-1][1] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        kvq.evaluate(models_dir("tiny-gqa"), [], text)
    with pytest.raises(kvq.Error, match="calibration text"):
        kvq.evaluate(models_dir("tiny-gqa"), ["tq-4bit"], text, ctx=256, windows=1, diagnostics=False)
    with pytest.raises(kvq.Error):
        kvq.evaluate(models_dir("tiny-gqa"), ["no-such-format"], text, ctx=256, windows=1)


def test_calibrate_mla_writes_a_fused_model(tmp_path):
    """A short QuantMLA run on tiny-mla: the fused model equals the original with quantization off
    (the fusion check), loads, and the held-out objectives come back per layer and path."""
    text = os.path.join(ROOT, "data", "validation-tech.txt")
    out = str(tmp_path / "tiny-mla-quantmla")
    lines = []
    r = kvq.calibrate_mla(models_dir("tiny-mla"), out, text, steps=4, train_seqs=4, heldout_seqs=2, seq_len=64, batch=2,
                          eval_every=2, check_seqs=1, dtype="f32", log=lines.append)
    assert len(r["layers"]) == 4 and lines
    for layer in r["layers"]:
        for p in ("content", "rope"):
            x = layer[p]
            assert all(np.isfinite([x["rtn"], x["init"], x["best"]])) and x["rtn"] > 0
            assert x["best"] <= x["init"] * (1 + 1e-12)  # the selected checkpoint is the best held-out one seen
    assert r["fusion_max_rel_err"] < 1e-4  # fp32, quantization off: the fused model computes the original
    assert abs(r["nll_fused_f32"] - r["nll_original"]) < 1e-4 and abs(r["nll_saved"] - r["nll_original"]) < 1e-4
    meta = json.loads(r["json"])
    assert meta == json.load(open(os.path.join(out, "kvq_calibration.json")))
    m = kvq.Model(out)
    assert m.geometry.mla and m.geometry.d_latent == kvq.Model(models_dir("tiny-mla")).geometry.d_latent
    tok = kvq.Tokenizer(models_dir("tiny-mla"))
    ev = open(os.path.join(ROOT, "data", "validation.txt"), encoding="utf-8").read()
    # Checked here too, not only by the report: with fp32 caches the fused model's logits are the original's.
    orig = kvq.Model(models_dir("tiny-mla"))
    ids = tok.encode(ev[:2000])[:96]
    a = orig.forward(ids, kvq.DenseCache(orig.geometry, "f32"))
    b = m.forward(ids, kvq.DenseCache(m.geometry, "f32"))
    assert np.max(np.abs(a - b)) < 1e-3 * np.max(np.abs(a))
    # ...while the cache it quantizes is not the original's (the transforms are not the identity).
    p_fused = m.perplexity(tok, ev, format="c4r4", ctx=128, windows=1)["ppl"]
    p_orig = orig.perplexity(tok, ev, format="c4r4", ctx=128, windows=1)["ppl"]
    assert np.isfinite(p_fused) and p_fused != p_orig
    with pytest.raises(kvq.Error):
        kvq.calibrate_mla(models_dir("tiny-gqa"), str(tmp_path / "x"), text, steps=1, train_seqs=2, heldout_seqs=1, seq_len=32)
    with pytest.raises(kvq.Error):
        kvq.calibrate_mla(models_dir("tiny-mla"), str(tmp_path / "y"), text, method="magic")
    with pytest.raises(ValueError):
        kvq.calibrate_mla(models_dir("tiny-mla"), str(tmp_path / "z"), text, paths="neither")
    # The output is never another directory: out exists (its own earlier output) -> refused unless overwrite,
    # which replaces it; the model directory itself is refused either way.
    small = dict(steps=0, train_seqs=2, heldout_seqs=1, seq_len=32, batch=1, eval_every=1, check_seqs=1)
    with pytest.raises(kvq.Error, match="not empty"):
        kvq.calibrate_mla(models_dir("tiny-mla"), out, text, **small)
    assert os.path.isfile(os.path.join(out, "kvq_calibration.json"))
    kvq.calibrate_mla(models_dir("tiny-mla"), out, text, overwrite=True, **small)
    assert json.load(open(os.path.join(out, "kvq_calibration.json")))["steps"] == 0
    with pytest.raises(kvq.Error, match="model directory"):
        kvq.calibrate_mla(models_dir("tiny-mla"), models_dir("tiny-mla"), text, overwrite=True, **small)


def test_analyze_response_and_jacobian():
    """kvq.analyze on tiny-mla with one short sequence per cell: the report's per-layer ratios and
    model ratio follow from its own r_C / r_P, the capture check holds, and the Jacobian's gain
    decomposition G = T A (1 + O) holds per path (one sequence: the means are the values)."""
    text = os.path.join(ROOT, "data", "validation.txt")
    lines = []
    r = kvq.analyze("response", models_dir("tiny-mla"), [text], seeds=[0], seqs=1, seq_len=64, log=lines.append)
    assert r["analysis"] == "response" and r["options"]["layers"] == 4 and len(r["cells"]) == 1 and lines
    o = r["options"]  # the arguments arrive (and the CLI's response defaults: NMSE 1e-2, cache c4r4)
    assert (o["seq_len"], o["seqs_per_cell"], o["seeds"], o["cache_nmse"], o["cache"]) == (64, 1, [0], 0.01, "c4r4")
    assert [os.path.basename(t) for t in o["texts"]] == ["validation.txt"]
    cell = r["cells"][0]
    rc = np.array([x["r_c"] for x in cell["layers"]])
    rp = np.array([x["r_p"] for x in cell["layers"]])
    assert np.all(rc > 0) and np.all(rp > 0)
    assert [x["ratio"] for x in cell["layers"]] == pytest.approx(list(rp / rc), rel=1e-9)
    assert cell["model_ratio"] == pytest.approx(rp.mean() / rc.mean(), rel=1e-9)
    assert r["summary"]["model_ratio_mean"] == pytest.approx(cell["model_ratio"], rel=1e-12)
    assert all(x["block_rel_err"] < 1e-3 for x in cell["layers"])  # the block reproduces the runtime's output
    j = kvq.analyze("jacobian", models_dir("tiny-mla"), [text], seeds=[0], seq_len=64, probes=8, permutations=2)
    assert len(j["cells"]) == 1 and len(j["cells"][0]["layers"]) == 4
    assert (j["options"]["seqs_per_cell"], j["options"]["cache_nmse"]) == (1, 1e-3)  # the Jacobian defaults
    for layer in j["cells"][0]["layers"]:
        for p in ("content", "rope"):
            x = layer[p]
            assert x["G"] > 0 and x["G"] == pytest.approx(x["T"] * x["A"] * (1 + x["O"]), rel=1e-9)
            assert x["finite_gain"] > 0
    assert j["jvp_vs_finite"]["n"] > 0 and -1 <= j["jvp_vs_finite"]["spearman"] <= 1
    with pytest.raises(ValueError):
        kvq.analyze("histogram", models_dir("tiny-mla"), [text])
    with pytest.raises(kvq.Error):
        kvq.analyze("response", models_dir("tiny-gqa"), [text], seeds=[0], seqs=1, seq_len=64)


def test_a_raising_callback_does_not_stop_the_call():
    """An exception in a progress / log callback is reported, not propagated through the library."""
    def boom(*args):
        raise RuntimeError("callback failed")
    seen, hook = [], sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(str(u.exc_value))
    try:
        r = kvq.analyze("response", models_dir("tiny-mla"), [os.path.join(ROOT, "data", "validation.txt")], seeds=[0], seqs=1,
                        seq_len=64, log=boom)
    finally:
        sys.unraisablehook = hook
    assert len(r["cells"]) == 1 and seen and all("callback failed" in x for x in seen)
