// AVX2 batch paths of the quantizers (runtime-dispatched; this file is compiled for x86-64
// baseline and each kernel carries target("avx2,fma,f16c")). They perform the scalar
// references' operations in the same order with no contraction (-ffp-contract=off), so their
// output is bit-identical to the references; tests/quant/test_simd.cpp checks it.
#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kvq/bitpack.hpp"
#include "kvq/numeric.hpp"
#include "kvq/quantizers.hpp"
#include "simd.hpp"

#define KVQ_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace kvq::simd {

namespace {
std::atomic<bool> g_enabled{true};
}

void set_enabled(bool on) { g_enabled.store(on); }

bool available() {
  static const bool ok = [] {
    if (std::getenv("KVQ_NO_SIMD")) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok && g_enabled.load(std::memory_order_relaxed);
}

namespace {

// In-place orthonormal FWHT of one power-of-two block n >= 8, same butterflies as fwht().
KVQ_AVX2 void fwht_avx2(float* x, int n) {
  // h = 1, 2, 4 inside each 8-float register.
  for (int i = 0; i < n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    // h = 1: pairs (0,1),(2,3)...: a+b in even, a-b in odd.
    __m256 sw = _mm256_permute_ps(v, 0xB1);  // swap adjacent
    __m256 sum = _mm256_add_ps(v, sw), dif = _mm256_sub_ps(sw, v);  // even lanes: a+b; odd lanes: a-b = sw - v
    v = _mm256_blend_ps(sum, dif, 0xAA);
    // h = 2: (0,2),(1,3)
    sw = _mm256_permute_ps(v, 0x4E);
    sum = _mm256_add_ps(v, sw);
    dif = _mm256_sub_ps(sw, v);
    v = _mm256_blend_ps(sum, dif, 0xCC);
    // h = 4: (0,4)...
    sw = _mm256_permute2f128_ps(v, v, 0x01);
    sum = _mm256_add_ps(v, sw);
    dif = _mm256_sub_ps(sw, v);
    v = _mm256_blend_ps(sum, dif, 0xF0);
    _mm256_storeu_ps(x + i, v);
  }
  for (int h = 8; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; j += 8) {
        const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + h);
        _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
        _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
      }
    }
  }
  const __m256 s = _mm256_set1_ps(static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))));
  for (int i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), s));
}

// n = 128: all seven stages with the 16 vectors in registers (same butterflies, same order per
// element as fwht_avx2, so the same bits).
KVQ_AVX2 inline __m256 butterfly_in_register(__m256 v) {
  __m256 sw = _mm256_permute_ps(v, 0xB1);
  v = _mm256_blend_ps(_mm256_add_ps(v, sw), _mm256_sub_ps(sw, v), 0xAA);
  sw = _mm256_permute_ps(v, 0x4E);
  v = _mm256_blend_ps(_mm256_add_ps(v, sw), _mm256_sub_ps(sw, v), 0xCC);
  sw = _mm256_permute2f128_ps(v, v, 0x01);
  return _mm256_blend_ps(_mm256_add_ps(v, sw), _mm256_sub_ps(sw, v), 0xF0);
}
KVQ_AVX2 void fwht128_avx2(float* x) {
  __m256 r[16];
  for (int i = 0; i < 16; ++i) r[i] = butterfly_in_register(_mm256_loadu_ps(x + 8 * i));
  for (int h = 1; h < 16; h *= 2) {
    for (int i = 0; i < 16; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const __m256 a = r[j], b = r[j + h];
        r[j] = _mm256_add_ps(a, b);
        r[j + h] = _mm256_sub_ps(a, b);
      }
    }
  }
  const __m256 s = _mm256_set1_ps(static_cast<float>(1.0 / std::sqrt(128.0)));
  for (int i = 0; i < 16; ++i) _mm256_storeu_ps(x + 8 * i, _mm256_mul_ps(r[i], s));
}

KVQ_AVX2 void fwht_any_avx2(float* x, int n) {
  if (n == 128) fwht128_avx2(x);
  else fwht_avx2(x, n);
}

// kvq::sum_squares for n % 4 == 0, n <= 2048: lane r of a block's 4-wide accumulator is its chain r
// (one FMA per step, k = r, r + 4, ... in order), and two horizontal adds give (s0 + s1) + (s2 + s3):
// the reference's operations, so its bits.
KVQ_AVX2 float sum_squares_avx2(const float* x, int n) {
  float b[kSumSquaresMaxBlocks];
  int nb = 0;
  for (int off = 0; off < n; off += kSumSquaresBlock, ++nb) {
    const int len = n - off < kSumSquaresBlock ? n - off : kSumSquaresBlock;
    __m128 acc = _mm_setzero_ps();
    for (int k = 0; k < len; k += 4) {
      const __m128 v = _mm_loadu_ps(x + off + k);
      acc = _mm_fmadd_ps(v, v, acc);
    }
    const __m128 h = _mm_hadd_ps(acc, acc);  // s0 + s1, s2 + s3, s0 + s1, s2 + s3
    b[nb] = _mm_cvtss_f32(_mm_hadd_ps(h, h));
  }
  return sum_blocks_pairwise(b, nb);
}

// 8 codes of b bits (b = 1..4) <-> b bytes of the LSB-first stream (code k at bits b*k).
KVQ_AVX2 inline __m256i lane_shifts(int b) {
  switch (b) {
    case 1: return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    case 2: return _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    case 3: return _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
    default: return _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  }
}
KVQ_AVX2 inline void pack8(__m256i c, int b, std::uint8_t* out) {
  const __m256i sh = lane_shifts(b);
  __m256i v = _mm256_sllv_epi32(c, sh);
  v = _mm256_or_si256(v, _mm256_permute2x128_si256(v, v, 0x01));
  v = _mm256_or_si256(v, _mm256_shuffle_epi32(v, 0x4E));
  v = _mm256_or_si256(v, _mm256_shuffle_epi32(v, 0xB1));
  const std::uint32_t w = static_cast<std::uint32_t>(_mm256_cvtsi256_si32(v));
  switch (b) {  // fixed-size copies (a variable-length memcpy is a library call)
    case 1: out[0] = static_cast<std::uint8_t>(w); break;
    case 2: std::memcpy(out, &w, 2); break;
    case 3: std::memcpy(out, &w, 2); out[2] = static_cast<std::uint8_t>(w >> 16); break;
    default: std::memcpy(out, &w, 4); break;
  }
}
KVQ_AVX2 inline __m256i unpack8(const std::uint8_t* p, int b) {
  std::uint32_t w = 0;
  switch (b) {
    case 1: w = p[0]; break;
    case 2: { std::uint16_t h; std::memcpy(&h, p, 2); w = h; break; }
    case 3: { std::uint16_t h; std::memcpy(&h, p, 2); w = h | static_cast<std::uint32_t>(p[2]) << 16; break; }
    default: std::memcpy(&w, p, 4); break;
  }
  const __m256i sh = lane_shifts(b);
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), sh), _mm256_set1_epi32((1 << b) - 1));
}
// Codes of lanes as int32 -> packed output for group j (8 codes) of a b-bit stream, b = 1..8.
KVQ_AVX2 inline void store_codes(__m256i c, int b, std::uint8_t* stream, int j) {
  if (b == 8) {
    const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
    const __m128i w = _mm_packus_epi16(_mm_packus_epi32(lo, hi), _mm_setzero_si128());
    _mm_storel_epi64(reinterpret_cast<__m128i*>(stream + 8 * j), w);
  } else if (b <= 4) {
    pack8(c, b, stream + static_cast<std::size_t>(j) * static_cast<std::size_t>(b));
  } else {
    alignas(32) std::int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), c);
    for (int k = 0; k < 8; ++k) {
      const std::size_t bit = static_cast<std::size_t>(8 * j + k) * static_cast<std::size_t>(b);
      const std::uint32_t v = static_cast<std::uint32_t>(t[k]) << (bit & 7);
      stream[bit >> 3] = static_cast<std::uint8_t>(stream[bit >> 3] | v);
      if ((bit & 7) + static_cast<std::size_t>(b) > 8) stream[(bit >> 3) + 1] = static_cast<std::uint8_t>(v >> 8);
    }
  }
}
KVQ_AVX2 inline __m256i load_codes(const std::uint8_t* stream, int b, int j) {
  if (b == 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(stream + 8 * j)));
  if (b <= 4) return unpack8(stream + static_cast<std::size_t>(j) * static_cast<std::size_t>(b), b);
  alignas(32) std::int32_t t[8];
  for (int k = 0; k < 8; ++k) t[k] = static_cast<std::int32_t>(unpack_one(stream, static_cast<std::size_t>(8 * j + k), b));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
}

// Centroid lookup of 8 codes: register permutes for up to 16 centroids (1-4 bits), a gather
// beyond that. Same values as centroids_f[code].
struct CentroidTable {
  __m256 lo, hi;
  const float* all;
  int k;
};
KVQ_AVX2 inline CentroidTable make_table(const std::vector<float>& c) {
  CentroidTable t;
  alignas(32) float a[16] = {};
  for (std::size_t i = 0; i < c.size() && i < 16; ++i) a[i] = c[i];
  t.lo = _mm256_load_ps(a);
  t.hi = _mm256_load_ps(a + 8);
  t.all = c.data();
  t.k = static_cast<int>(c.size());
  return t;
}
KVQ_AVX2 inline __m256 lookup(const CentroidTable& t, __m256i idx) {
  if (t.k <= 8) return _mm256_permutevar8x32_ps(t.lo, idx);
  if (t.k <= 16) {
    const __m256 a = _mm256_permutevar8x32_ps(t.lo, idx), b = _mm256_permutevar8x32_ps(t.hi, idx);
    const __m256 use_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7)));
    return _mm256_blendv_ps(a, b, use_hi);
  }
  return _mm256_i32gather_ps(t.all, idx, 4);
}

// Minimum and maximum of a group of g floats (g % 8 == 0); false if any is NaN or Inf.
KVQ_AVX2 bool group_minmax(const float* xg, int g, float& l, float& h) {
  __m256 lo = _mm256_loadu_ps(xg), hi = lo, bad = _mm256_setzero_ps();
  for (int i = 0; i < g; i += 8) {
    const __m256 t = _mm256_loadu_ps(xg + i);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(t, t), _mm256_setzero_ps(), _CMP_NEQ_UQ));
    lo = _mm256_min_ps(lo, t);
    hi = _mm256_max_ps(hi, t);
  }
  alignas(32) float l8[8], h8[8];
  _mm256_store_ps(l8, lo);
  _mm256_store_ps(h8, hi);
  l = l8[0];
  h = h8[0];
  for (int k = 1; k < 8; ++k) l = std::fmin(l, l8[k]), h = std::fmax(h, h8[k]);
  return _mm256_movemask_ps(bad) == 0;
}

bool blocks_ok(const HadamardRotation& r) {
  for (int b : r.blocks())
    if (b < 8) return false;
  return true;
}

}  // namespace

KVQ_AVX2 bool bf16_to_float(const std::uint16_t* in, std::size_t n, float* out) {
  if (!available()) return false;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < n; ++i) out[i] = kvq::bf16_to_float(in[i]);
  return true;
}

KVQ_AVX2 bool tq_encode_batch(const TurboQuantMse& q, const HadamardRotation& r, const float* x, std::size_t n,
                              std::uint8_t* rec) {
  const int d = q.dim();
  if (!available() || d % 16 != 0 || d > kSumSquaresBlock * kSumSquaresMaxBlocks || !blocks_ok(r)) return false;
  const auto& cb = q.codebook();
  const int ne = static_cast<int>(cb.edges_f.size());
  const std::size_t rb = q.bytes(), cbytes = q.code_bytes();
  std::vector<float> y(static_cast<std::size_t>(d));
  const float* signs = r.signs().data();
  const CentroidTable table = make_table(q.centroid_squares());  // the norm-correction sum's terms (empty without)
  __m256 ev[255];
  for (int e = 0; e < ne; ++e) ev[e] = _mm256_set1_ps(cb.edges_f[static_cast<std::size_t>(e)]);
  for (std::size_t v = 0; v < n; ++v) {
    const float* xv = x + v * static_cast<std::size_t>(d);
    std::uint8_t* out = rec + v * rb;
    // A non-finite input makes the sum of squares non-finite, and so do squares beyond the float
    // range: the reference reports the coordinate, or refuses the norm (beyond fp16 either way).
    const float ss = sum_squares_avx2(xv, d);
    if (!std::isfinite(ss)) {
      q.encode_centered_reference(xv, out, out + cbytes);
      continue;
    }
    const float norm = std::sqrt(ss);
    const __m256 inv = _mm256_set1_ps(norm > 0 ? 1.0f / norm : 0.0f);
    for (int i = 0; i < d; i += 8)
      _mm256_storeu_ps(&y[static_cast<std::size_t>(i)],
                       _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xv + i), inv), _mm256_loadu_ps(signs + i)));
    int off = 0;
    for (int b : r.blocks()) {
      fwht_any_avx2(&y[static_cast<std::size_t>(off)], b);
      off += b;
    }
    const int b = q.bits();
    if (b > 4) std::memset(out, 0, cbytes);
    // The norm-correction sum on its grid (kvq::grid_squares): float adds the terms exactly, so eight lanes and the
    // final horizontal adds give kvq::grid_square_sum's value.
    __m256 c2v = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
      const __m256 yv = _mm256_loadu_ps(&y[static_cast<std::size_t>(i)]);
      __m256i cnt = _mm256_setzero_si256();
      for (int e = 0; e < ne; ++e) cnt = _mm256_sub_epi32(cnt, _mm256_castps_si256(_mm256_cmp_ps(ev[e], yv, _CMP_LT_OQ)));
      store_codes(cnt, b, out, i / 8);
      if (q.norm_correction()) c2v = _mm256_add_ps(c2v, lookup(table, cnt));
    }
    float stored = norm;
    if (q.norm_correction() && norm > 0) {
      alignas(32) float h[8];
      _mm256_store_ps(h, c2v);
      stored = norm / std::sqrt(((h[0] + h[1]) + (h[2] + h[3])) + ((h[4] + h[5]) + (h[6] + h[7])));
    }
    if (!(std::fabs(stored) <= 65504.0f)) {
      q.encode_centered_reference(xv, out, out + cbytes);  // throws with the message
      continue;
    }
    const std::uint16_t h = float_to_fp16(stored);
    std::memcpy(out + cbytes, &h, 2);
  }
  return true;
}

KVQ_AVX2 bool tq_decode_batch(const TurboQuantMse& q, const HadamardRotation& r, const std::uint8_t* rec, std::size_t n,
                              float* x) {
  const int d = q.dim();
  if (!available() || d % 8 != 0 || !blocks_ok(r)) return false;
  const auto& cb = q.codebook();
  const std::size_t rb = q.bytes(), cbytes = q.code_bytes();
  const float* signs = r.signs().data();
  const CentroidTable table = make_table(cb.centroids_f);
  for (std::size_t v = 0; v < n; ++v) {
    const std::uint8_t* in = rec + v * rb;
    float* y = x + v * static_cast<std::size_t>(d);
    std::uint16_t h;
    std::memcpy(&h, in + cbytes, 2);
    const __m256 nv = _mm256_set1_ps(fp16_to_float(h));
    for (int i = 0; i < d; i += 8)
      _mm256_storeu_ps(y + i, _mm256_mul_ps(nv, lookup(table, load_codes(in, q.bits(), i / 8))));
    int off = 0;
    for (int b : r.blocks()) {
      fwht_any_avx2(y + off, b);
      off += b;
    }
    for (int i = 0; i < d; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(signs + i)));
  }
  return true;
}

KVQ_AVX2 bool uniform_encode_batch(const UniformAffine& q, const float* x, std::size_t n, std::uint8_t* rec) {
  const int d = q.dim(), g = q.group();
  if (!available() || g % 8 != 0) return false;
  const std::size_t rb = q.bytes(), cbytes = q.code_bytes();
  const float m = static_cast<float>((1 << q.bits()) - 1);
  for (std::size_t v = 0; v < n; ++v) {
    const float* xv = x + v * static_cast<std::size_t>(d);
    std::uint8_t* out = rec + v * rb;
    if (q.bits() > 4 && q.bits() < 8) std::memset(out, 0, cbytes);
    bool fallback = false;
    for (int gi = 0; gi < q.groups() && !fallback; ++gi) {
      const float* xg = xv + gi * g;
      float l, hh;
      if (!group_minmax(xg, g, l, hh) || !(std::fabs(l) <= 65504.0f && std::fabs(hh) <= 65504.0f)) {
        fallback = true;
        break;
      }
      float s = (hh - l) / m;
      if (!(s > 1e-8f)) s = 1e-8f;
      const std::uint16_t sh = float_to_fp16(s), zh = float_to_fp16(l);
      std::memcpy(out + cbytes + 4 * static_cast<std::size_t>(gi), &sh, 2);
      std::memcpy(out + cbytes + 4 * static_cast<std::size_t>(gi) + 2, &zh, 2);
      const __m256 lv = _mm256_set1_ps(l), sv = _mm256_set1_ps(s), half = _mm256_set1_ps(0.5f), mv = _mm256_set1_ps(m);
      for (int i = 0; i < g; i += 8) {
        __m256 t = _mm256_floor_ps(_mm256_add_ps(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(xg + i), lv), sv), half));
        t = _mm256_min_ps(_mm256_max_ps(t, _mm256_setzero_ps()), mv);
        store_codes(_mm256_cvttps_epi32(t), q.bits(), out, (gi * g + i) / 8);
      }
    }
    if (fallback) q.encode_reference(xv, out, out + cbytes);
  }
  return true;
}

KVQ_AVX2 bool uniform_decode_batch(const UniformAffine& q, const std::uint8_t* rec, std::size_t n, float* x) {
  const int d = q.dim(), g = q.group();
  if (!available() || g % 8 != 0) return false;
  const std::size_t rb = q.bytes(), cbytes = q.code_bytes();
  for (std::size_t v = 0; v < n; ++v) {
    const std::uint8_t* in = rec + v * rb;
    float* y = x + v * static_cast<std::size_t>(d);
    for (int gi = 0; gi < q.groups(); ++gi) {
      std::uint16_t sh, zh;
      std::memcpy(&sh, in + cbytes + 4 * static_cast<std::size_t>(gi), 2);
      std::memcpy(&zh, in + cbytes + 4 * static_cast<std::size_t>(gi) + 2, 2);
      const __m256 sv = _mm256_set1_ps(fp16_to_float(sh)), zv = _mm256_set1_ps(fp16_to_float(zh));
      for (int i = gi * g; i < (gi + 1) * g; i += 8) {
        const __m256 c = _mm256_cvtepi32_ps(load_codes(in, q.bits(), i / 8));
        _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_mul_ps(c, sv), zv));
      }
    }
  }
  return true;
}

KVQ_AVX2 bool affine_encode_batch(const AffineGroup& q, const float* x, std::size_t n, std::uint8_t* rec) {
  const int d = q.dim(), g = q.group();
  if (!available() || g % 8 != 0) return false;
  const std::size_t rb = q.bytes(), cbytes = q.code_bytes();
  const bool bf = q.scale_type() == ScaleType::kBf16;
  const std::size_t zoff = static_cast<std::size_t>(q.groups()) * (bf ? 2 : 4);
  const float m = static_cast<float>((1 << q.bits()) - 1);
  for (std::size_t v = 0; v < n; ++v) {
    const float* xv = x + v * static_cast<std::size_t>(d);
    std::uint8_t* out = rec + v * rb;
    std::uint8_t* meta = out + cbytes;
    if (q.bits() > 4 && q.bits() < 8) std::memset(out, 0, cbytes);
    bool fallback = false;
    for (int gi = 0; gi < q.groups(); ++gi) {
      const float* xg = xv + gi * g;
      float l, hh;
      if (!group_minmax(xg, g, l, hh) || !std::isfinite(hh - l)) {
        fallback = true;
        break;
      }
      const float s = affine_group_scale(l, hh, q.bits(), q.scale_type());
      const float z = std::fmin(std::fmax(std::rint(-l / s), 0.0f), m);
      if (bf) {
        const std::uint16_t sb = float_to_bf16(s);
        std::memcpy(meta + 2 * static_cast<std::size_t>(gi), &sb, 2);
      } else {
        std::memcpy(meta + 4 * static_cast<std::size_t>(gi), &s, 4);
      }
      meta[zoff + static_cast<std::size_t>(gi)] = static_cast<std::uint8_t>(z);
      const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z), mv = _mm256_set1_ps(m);
      for (int i = 0; i < g; i += 8) {
        __m256 t = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xg + i), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(t, zv), _mm256_setzero_ps()), mv);
        store_codes(_mm256_cvttps_epi32(t), q.bits(), out, (gi * g + i) / 8);
      }
    }
    if (fallback) q.encode_reference(xv, out, meta);
  }
  return true;
}

KVQ_AVX2 bool affine_decode_batch(const AffineGroup& q, const std::uint8_t* rec, std::size_t n, float* x) {
  const int d = q.dim(), g = q.group();
  if (!available() || g % 8 != 0) return false;
  const std::size_t rb = q.bytes(), cbytes = q.code_bytes();
  for (std::size_t v = 0; v < n; ++v) {
    const std::uint8_t* in = rec + v * rb;
    float* y = x + v * static_cast<std::size_t>(d);
    for (int gi = 0; gi < q.groups(); ++gi) {
      const __m256 sv = _mm256_set1_ps(q.scale_of(in + cbytes, gi));
      const __m256 zv = _mm256_set1_ps(static_cast<float>(q.zero_of(in + cbytes, gi)));
      for (int i = gi * g; i < (gi + 1) * g; i += 8) {
        const __m256 c = _mm256_cvtepi32_ps(load_codes(in, q.bits(), i / 8));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(sv, _mm256_sub_ps(c, zv)));
      }
    }
  }
  return true;
}

}  // namespace kvq::simd
