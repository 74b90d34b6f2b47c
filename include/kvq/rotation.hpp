// kvq/rotation.hpp: orthogonal transforms applied before scalar quantization.
//
//  - fwht: the orthonormal fast Walsh-Hadamard transform (Sylvester order), O(n log n);
//    it is its own inverse.
//  - HadamardRotation: y = H D x with D a +-1 diagonal drawn from splitmix64 (TurboQuant
//    chapter, section 2) or D = I (plain Hadamard, vLLM's choice). Dimensions that are not a
//    power of two use a block-diagonal H over power-of-two blocks, largest first
//    (96 = 64 + 32, 192 = 128 + 64, 576 = 512 + 64); docs/formats.md.
//  - HaarRotation: a dense uniformly random orthogonal matrix (QR of a Gaussian matrix with
//    the signs of R's diagonal fixed), O(d^2) per vector; the chapter's reference rotation.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvq {

void fwht(float* x, int n);
void fwht(double* x, int n);

// Power-of-two block sizes of the block-diagonal Hadamard for dimension d, largest first.
std::vector<int> hadamard_blocks(int d);

class Rotation {
 public:
  explicit Rotation(int d) : d_(d) {}
  virtual ~Rotation() = default;
  int dim() const { return d_; }
  virtual void forward(const float* x, float* y) const = 0;  // y = Pi x
  virtual void inverse(const float* y, float* x) const = 0;  // x = Pi^T y
  virtual std::string describe() const = 0;

 protected:
  int d_;
};

class HadamardRotation final : public Rotation {
 public:
  // key: a stream key from mix_seed(); ignored when randomize_signs is false.
  HadamardRotation(int d, bool randomize_signs, std::uint64_t key);
  void forward(const float* x, float* y) const override;
  void inverse(const float* y, float* x) const override;
  std::string describe() const override;
  const std::vector<float>& signs() const { return signs_; }
  const std::vector<int>& blocks() const { return blocks_; }
  bool randomized() const { return randomized_; }

 private:
  bool randomized_;
  std::vector<float> signs_;
  std::vector<int> blocks_;
};

class HaarRotation final : public Rotation {
 public:
  HaarRotation(int d, std::uint64_t key);
  void forward(const float* x, float* y) const override;
  void inverse(const float* y, float* x) const override;
  std::string describe() const override { return "haar"; }
  const std::vector<double>& matrix() const { return q_; }  // row-major d x d, y = Q x

 private:
  std::vector<double> q_;
};

enum class RotationKind { kHadamard, kRandomizedHadamard, kHaar };
std::unique_ptr<Rotation> make_rotation(RotationKind kind, int d, std::uint64_t key);

}  // namespace kvq
