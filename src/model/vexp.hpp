// Internal: vectorized softmax pieces for attention rows and the perplexity loss. exp is the
// Cephes single-precision polynomial (range reduction by ln 2 split in two constants, degree-6
// polynomial, exponent built by integer shift): within 2 ulp of expf over [-87, 88], 0 below.
// AVX2+FMA when the CPU has them (runtime check), else the scalar std::exp.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace kvq::vexp {

inline bool have_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

[[gnu::target("avx2,fma")]] inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 x2 = _mm256_mul_ps(x, x);
  __m256 y = _mm256_fmadd_ps(p, x2, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

[[gnu::target("avx2,fma")]] inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
[[gnu::target("avx2,fma")]] inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// row[0..n) := exp(row * scale - max) / sum, the softmax of the scaled row, in place.
[[gnu::target("avx2,fma")]] inline void softmax_avx2(float* row, int n, float scale) {
  const __m256 vs = _mm256_set1_ps(scale);
  __m256 vm = _mm256_set1_ps(-INFINITY);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(row + i), vs);
    _mm256_storeu_ps(row + i, v);
    vm = _mm256_max_ps(vm, v);
  }
  float mx = hmax8(vm);
  for (; i < n; ++i) {
    row[i] *= scale;
    mx = std::max(mx, row[i]);
  }
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), vmx));
    _mm256_storeu_ps(row + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum8(acc);
  for (; i < n; ++i) {
    row[i] = std::exp(row[i] - mx);
    sum += row[i];
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(row + i, _mm256_mul_ps(_mm256_loadu_ps(row + i), inv));
  for (; i < n; ++i) row[i] *= 1.0f / sum;
}

inline void softmax(float* row, int n, float scale) {
  if (have_avx2()) return softmax_avx2(row, n, scale);
  float mx = -INFINITY;
  for (int j = 0; j < n; ++j) {
    row[j] *= scale;
    mx = std::max(mx, row[j]);
  }
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) {
    row[j] = std::exp(row[j] - mx);
    sum += row[j];
  }
  const float inv = 1.0f / sum;
  for (int j = 0; j < n; ++j) row[j] *= inv;
}

// row[j] := exp(row[j] - m) for j < n; returns the sum.
[[gnu::target("avx2,fma")]] inline float exp_shift_sum_avx2(float* row, int n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), vm));
    _mm256_storeu_ps(row + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum8(acc);
  for (; i < n; ++i) sum += row[i] = std::exp(row[i] - m);
  return sum;
}

inline float exp_shift_sum(float* row, int n, float m) {
  if (have_avx2()) return exp_shift_sum_avx2(row, n, m);
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) sum += row[i] = std::exp(row[i] - m);
  return sum;
}

// log(sum_j exp(row[j])) with the max taken out; partial sums in float lanes, total in double.
[[gnu::target("avx2,fma")]] inline double logsumexp_avx2(const float* row, int n) {
  __m256 vm = _mm256_set1_ps(-INFINITY);
  int i = 0;
  for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(row + i));
  float mx = hmax8(vm);
  for (; i < n; ++i) mx = std::max(mx, row[i]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  double sum = 0.0;
  for (i = 0; i + 8 <= n; i += 8) {
    acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), vmx)));
    if ((i & 1023) == 1016) {
      sum += hsum8(acc);
      acc = _mm256_setzero_ps();
    }
  }
  sum += hsum8(acc);
  for (; i < n; ++i) sum += std::exp(static_cast<double>(row[i] - mx));
  return std::log(sum) + mx;
}

inline double logsumexp(const float* row, int n) {
  if (have_avx2()) return logsumexp_avx2(row, n);
  float mx = row[0];
  for (int v = 1; v < n; ++v) mx = std::max(mx, row[v]);
  double z = 0.0;
  for (int v = 0; v < n; ++v) z += std::exp(static_cast<double>(row[v] - mx));
  return std::log(z) + mx;
}

}  // namespace kvq::vexp
