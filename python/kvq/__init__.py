"""kvq: low-bit KV caches (TurboQuant, QuantMLA) from Python.

Bindings over kvq's CPU library (the extension module kvq._kvq, built by CMake into
build/python/kvq; use it with PYTHONPATH=build/python and /usr/bin/python3 on Debian):

    import numpy as np, kvq
    g = kvq.Geometry(n_layers=1, n_kv_heads=8, head_dim=128)
    kq, vq = kvq.quantizers("tq-3bit-nc", g, layer=0, head=0)
    rec = kq.encode(np.random.randn(1000, 128).astype(np.float32))   # uint8 (1000, kq.bytes)
    scores = kq.scores(query, rec)          # <query, key> straight from the packed codes

    model = kvq.Model("models/tiny-gqa")
    cache = model.cache("tq-3bit-nc", sinks=4, window=128)
    logits = model.forward(tokens, cache)   # attention reads the packed pages

Everything is computed by the C++ library; kvq.Error carries its messages (unknown format,
NaN input, malformed model files, exhausted page pools). docs/python.md has the whole API.
"""

from ._kvq import (  # noqa: F401
    Cache,
    Calibration,
    DenseCache,
    Error,
    Format,
    Geometry,
    Model,
    PagedCache,
    Quantizer,
    Tokenizer,
    account,
    default_page_tokens,
    format,
    format_version,
    formats,
    quantizers,
    token_bytes,
)

__all__ = [
    "Cache", "Calibration", "DenseCache", "Error", "Format", "Geometry", "Model", "PagedCache", "Quantizer",
    "Tokenizer", "account", "default_page_tokens", "format", "format_version", "formats", "quantizers", "token_bytes",
]
