// Rotations: the orthonormal FWHT, the (randomized, block-diagonal) Hadamard rotation and a
// dense Haar rotation. See include/kvq/rotation.hpp for the conventions.
#include "kvq/rotation.hpp"

#include <cmath>

#include "kvq/common.hpp"
#include "kvq/rng.hpp"

namespace kvq {

namespace {
template <typename T>
void fwht_impl(T* x, int n) {
  for (int h = 1; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const T a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const T s = static_cast<T>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int i = 0; i < n; ++i) x[i] *= s;
}
}  // namespace

void fwht(float* x, int n) {
  if (!is_pow2(static_cast<std::uint64_t>(n))) fail("fwht: length " + std::to_string(n) + " is not a power of two");
  fwht_impl(x, n);
}
void fwht(double* x, int n) {
  if (!is_pow2(static_cast<std::uint64_t>(n))) fail("fwht: length " + std::to_string(n) + " is not a power of two");
  fwht_impl(x, n);
}

std::vector<int> hadamard_blocks(int d) {
  if (d < 1) fail("hadamard_blocks: dimension must be positive, got " + std::to_string(d));
  std::vector<int> blocks;
  for (int b = 1 << 30; b >= 1; b >>= 1) {
    if (d & b) blocks.push_back(b);
  }
  return blocks;
}

HadamardRotation::HadamardRotation(int d, bool randomize_signs, std::uint64_t key)
    : Rotation(d), randomized_(randomize_signs), signs_(static_cast<std::size_t>(d), 1.0f), blocks_(hadamard_blocks(d)) {
  if (randomize_signs) {
    SplitMix64 rng(key);
    for (auto& s : signs_) s = rng.sign();
  }
}

void HadamardRotation::forward(const float* x, float* y) const {
  for (int i = 0; i < d_; ++i) y[i] = x[i] * signs_[static_cast<std::size_t>(i)];
  int off = 0;
  for (int b : blocks_) {
    fwht_impl(y + off, b);
    off += b;
  }
}

void HadamardRotation::inverse(const float* y, float* x) const {
  for (int i = 0; i < d_; ++i) x[i] = y[i];
  int off = 0;
  for (int b : blocks_) {
    fwht_impl(x + off, b);
    off += b;
  }
  for (int i = 0; i < d_; ++i) x[i] *= signs_[static_cast<std::size_t>(i)];
}

std::string HadamardRotation::describe() const {
  std::string s = randomized_ ? "randomized-hadamard" : "hadamard";
  if (blocks_.size() > 1) {
    s += "[";
    for (std::size_t i = 0; i < blocks_.size(); ++i) s += (i ? "+" : "") + std::to_string(blocks_[i]);
    s += "]";
  }
  return s;
}

HaarRotation::HaarRotation(int d, std::uint64_t key) : Rotation(d), q_(static_cast<std::size_t>(d) * d) {
  // Gaussian matrix, then modified Gram-Schmidt on its columns (twice, for orthogonality to
  // rounding level). Fixing the sign of R's diagonal positive makes Q Haar-distributed.
  const std::size_t n = static_cast<std::size_t>(d);
  std::vector<double> a(n * n);
  SplitMix64 rng(key);
  for (auto& v : a) v = rng.normal();
  // Columns of a: a[r * n + c]. Orthonormalize column by column.
  for (std::size_t c = 0; c < n; ++c) {
    for (int pass = 0; pass < 2; ++pass) {
      for (std::size_t k = 0; k < c; ++k) {
        double dot = 0;
        for (std::size_t r = 0; r < n; ++r) dot += a[r * n + k] * a[r * n + c];
        for (std::size_t r = 0; r < n; ++r) a[r * n + c] -= dot * a[r * n + k];
      }
    }
    double nrm = 0;
    for (std::size_t r = 0; r < n; ++r) nrm += a[r * n + c] * a[r * n + c];
    nrm = std::sqrt(nrm);
    for (std::size_t r = 0; r < n; ++r) a[r * n + c] /= nrm;
  }
  // y = Q x with Q's rows the orthonormal vectors: store Q = A^T.
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t c = 0; c < n; ++c) q_[c * n + r] = a[r * n + c];
}

void HaarRotation::forward(const float* x, float* y) const {
  const std::size_t n = static_cast<std::size_t>(d_);
  for (std::size_t i = 0; i < n; ++i) {
    double s = 0;
    for (std::size_t j = 0; j < n; ++j) s += q_[i * n + j] * x[j];
    y[i] = static_cast<float>(s);
  }
}

void HaarRotation::inverse(const float* y, float* x) const {
  const std::size_t n = static_cast<std::size_t>(d_);
  for (std::size_t j = 0; j < n; ++j) {
    double s = 0;
    for (std::size_t i = 0; i < n; ++i) s += q_[i * n + j] * y[i];
    x[j] = static_cast<float>(s);
  }
}

std::unique_ptr<Rotation> make_rotation(RotationKind kind, int d, std::uint64_t key) {
  switch (kind) {
    case RotationKind::kHadamard: return std::make_unique<HadamardRotation>(d, false, key);
    case RotationKind::kRandomizedHadamard: return std::make_unique<HadamardRotation>(d, true, key);
    case RotationKind::kHaar: return std::make_unique<HaarRotation>(d, key);
  }
  fail("make_rotation: unknown kind");
}

}  // namespace kvq
