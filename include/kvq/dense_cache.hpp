// kvq/dense_cache.hpp: the bf16 KV cache, the baseline every quantized cache is measured against.
//
// Rows are stored as bf16 (round to nearest even) exactly as appended (or as fp32, on request); attention reads them back
// to fp32 and computes scores, softmax and the weighted sum in fp32. Prefill attends with blocked
// OpenBLAS sgemm over query tiles (one BLAS thread per OpenMP thread); decode-sized calls use
// AVX2 dot products straight from the bf16 rows.
#pragma once

#include <memory>

#include "kvq/kv_cache.hpp"

namespace kvq {

enum class DenseStorage {
  kBF16,  // the baseline cache
  kF32,   // exact rows: isolates the forward pass from cache rounding (parity and path tests)
};

// A dense cache for `max_seqs` sequences; storage grows as tokens are appended, up to
// `max_tokens` per sequence (0: unbounded), past which append throws kvq::Error. Decode-sized
// attention uses a second thread only for every `decode_rows_per_thread` visible rows (waking a
// thread costs more than a short decode step on a busy machine).
std::unique_ptr<KvCache> make_dense_cache(const CacheGeometry& geometry, int max_seqs = 1, int max_tokens = 0,
                                          DenseStorage storage = DenseStorage::kBF16, int decode_rows_per_thread = 4096);

}  // namespace kvq
