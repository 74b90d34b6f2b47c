"""kvq: low-bit KV caches (TurboQuant, QuantMLA) from Python.

Bindings over kvq's C++ library (the extension module kvq._kvq, built by CMake into
build/python/kvq; use it with PYTHONPATH=build/python and /usr/bin/python3 on Debian):

    import numpy as np, kvq
    g = kvq.Geometry(n_layers=1, n_kv_heads=8, head_dim=128)
    kq, vq = kvq.quantizers("tq-3bit-nc", g, layer=0, head=0)
    rec = kq.encode(np.random.randn(1000, 128).astype(np.float32))   # uint8 (1000, kq.bytes)
    scores = kq.scores(query, rec)          # <query, key> straight from the packed codes

    model = kvq.Model("models/tiny-gqa")
    cache = model.cache("tq-3bit-nc", sinks=4, window=128)
    logits = model.forward(tokens, cache)   # attention reads the packed pages

What the extension holds follows the build (kvq.has_runtime: caches, model, tokenizer;
kvq.has_cuda: kvq.cuda, the store and decode kernels on torch tensors). Everything is computed
by the C++ library; kvq.Error carries its messages (unknown format, NaN input, malformed model
files, exhausted page pools). docs/python.md has the whole API.
"""

from . import _kvq

__all__ = [name for name in dir(_kvq) if not name.startswith("_")]
globals().update({name: getattr(_kvq, name) for name in __all__})
