// TurboQuant quantizers (TurboQuant chapter, sections 3, 6, 7, 8): MSE with optional norm
// correction, the inner-product variant with a QJL residual sketch, and the outlier split.
// Scalar references; the AVX2 batch paths live in simd_avx2.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kvq/bitpack.hpp"
#include "kvq/common.hpp"
#include "kvq/numeric.hpp"
#include "kvq/quantizers.hpp"
#include "kvq/rng.hpp"
#include "simd.hpp"

namespace kvq {

namespace {
void store_fp16(std::uint8_t* p, float v, const std::string& who) {
  if (!(std::fabs(v) <= 65504.0f)) fail(who + ": norm " + std::to_string(v) + " exceeds the fp16 range of the stored norm");
  const std::uint16_t h = float_to_fp16(v);
  std::memcpy(p, &h, 2);
}
float load_fp16(const std::uint8_t* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_float(h);
}
}  // namespace

namespace {
// ||x|| as every encoder computes it: kvq::sum_squares (include/kvq/numeric.hpp), then a float sqrt.
float l2norm(const float* x, int n) { return std::sqrt(sum_squares(x, n)); }
}  // namespace

// ---- TurboQuantMse -------------------------------------------------------------------------

TurboQuantMse::TurboQuantMse(int dim, int bits, std::shared_ptr<const Rotation> rotation, bool norm_correction,
                             const Codebook* codebook, std::vector<float> offset)
    : VectorQuantizer(dim), bits_(bits), nc_(norm_correction), rot_(std::move(rotation)),
      cb_(codebook ? codebook : &sphere_codebook(dim, bits)), offset_(std::move(offset)) {
  require(offset_.empty() || static_cast<int>(offset_.size()) == dim, "TurboQuantMse: offset must have dim floats");
  for (float v : offset_) require(std::isfinite(v), "TurboQuantMse: non-finite calibration offset");
  require(cb_->bits == bits && cb_->dim == dim, "TurboQuantMse: codebook does not match dimension and bits");
  require(rot_ && rot_->dim() == dim, "TurboQuantMse: rotation dimension must equal " + std::to_string(dim));
  if (nc_) sq_ = kvq::grid_squares(cb_->centroids_f, dim);  // refuses a codebook without a grid
}

std::string TurboQuantMse::name() const {
  return "turboquant-mse-" + std::to_string(bits_) + "bit" + (nc_ ? "-nc" : "") + (offset_.empty() ? "" : "-centered") + "/" +
         rot_->describe();
}

std::size_t TurboQuantMse::code_bytes() const { return packed_bytes(static_cast<std::size_t>(dim_), bits_); }

void TurboQuantMse::encode_reference(const float* x, std::uint8_t* codes, std::uint8_t* meta) const {
  check_finite(x);
  if (offset_.empty()) {
    encode_centered_reference(x, codes, meta);
    return;
  }
  std::vector<float> xc(static_cast<std::size_t>(dim_));
  for (int i = 0; i < dim_; ++i) xc[static_cast<std::size_t>(i)] = x[i] - offset_[static_cast<std::size_t>(i)];
  encode_centered_reference(xc.data(), codes, meta);
}

void TurboQuantMse::encode_centered_reference(const float* x, std::uint8_t* codes, std::uint8_t* meta) const {
  check_finite(x);
  const std::size_t d = static_cast<std::size_t>(dim_);
  std::vector<float> u(d), y(d);
  std::vector<std::uint8_t> idx(d);
  const float norm = l2norm(x, dim_);
  const float inv = norm > 0 ? 1.0f / norm : 0.0f;
  for (std::size_t i = 0; i < d; ++i) u[i] = x[i] * inv;
  rot_->forward(u.data(), y.data());
  const int ne = static_cast<int>(cb_->edges_f.size());
  for (std::size_t i = 0; i < d; ++i) idx[i] = static_cast<std::uint8_t>(bucketize(cb_->edges_f.data(), ne, y[i]));
  float stored = norm;
  if (nc_ && norm > 0) stored = norm / std::sqrt(grid_square_sum(sq_.data(), idx.data(), dim_));
  pack_bits(idx.data(), d, bits_, codes);
  store_fp16(meta, stored, "TurboQuantMse");
}

void TurboQuantMse::rotated_codeword(const std::uint8_t* codes, const std::uint8_t* meta, float* y) const {
  const float n = load_fp16(meta);
  for (int i = 0; i < dim_; ++i) y[i] = n * cb_->centroids_f[unpack_one(codes, static_cast<std::size_t>(i), bits_)];
}

void TurboQuantMse::decode_reference(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const {
  std::vector<float> y(static_cast<std::size_t>(dim_));
  rotated_codeword(codes, meta, y.data());
  rot_->inverse(y.data(), x);
  for (std::size_t i = 0; i < offset_.size(); ++i) x[i] += offset_[i];
}

void TurboQuantMse::encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const {
  encode_reference(x, codes, meta);
}
void TurboQuantMse::decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const {
  decode_reference(codes, meta, x);
}

void TurboQuantMse::prepare_query(const float* q, float* qp) const {
  rot_->forward(q, qp);
  if (!offset_.empty()) {
    double c = 0;
    for (int i = 0; i < dim_; ++i) c += static_cast<double>(q[i]) * offset_[static_cast<std::size_t>(i)];
    qp[dim_] = static_cast<float>(c);
  }
}

float TurboQuantMse::score(const float* qp, const std::uint8_t* codes, const std::uint8_t* meta) const {
  float s = 0;
  const float* c = cb_->centroids_f.data();
  for (int i = 0; i < dim_; ++i) s += qp[i] * c[unpack_one(codes, static_cast<std::size_t>(i), bits_)];
  return s * load_fp16(meta) + (offset_.empty() ? 0.0f : qp[dim_]);
}

void TurboQuantMse::accumulate(float w, const std::uint8_t* codes, const std::uint8_t* meta, float* acc) const {
  const float wn = w * load_fp16(meta);
  const float* c = cb_->centroids_f.data();
  for (int i = 0; i < dim_; ++i) acc[i] += wn * c[unpack_one(codes, static_cast<std::size_t>(i), bits_)];
  if (!offset_.empty()) acc[dim_] += w;
}

void TurboQuantMse::finish(const float* acc, float* out) const {
  rot_->inverse(acc, out);
  if (!offset_.empty())
    for (int i = 0; i < dim_; ++i) out[i] += acc[dim_] * offset_[static_cast<std::size_t>(i)];
}

void TurboQuantMse::encode_batch(const float* x, std::size_t n, std::uint8_t* records) const {
  const auto* hr = dynamic_cast<const HadamardRotation*>(rot_.get());
  if (hr && simd::available()) {
    if (offset_.empty()) {
      if (simd::tq_encode_batch(*this, *hr, x, n, records)) return;
    } else {
      // Center in chunks, then the SIMD path (non-finite input falls back to the reference).
      const std::size_t d = static_cast<std::size_t>(dim_), chunk = 64;
      std::vector<float> xc(chunk * d);
      bool ok = true;
      for (std::size_t v0 = 0; v0 < n && ok; v0 += chunk) {
        const std::size_t m = std::min(chunk, n - v0);
        for (std::size_t v = 0; v < m; ++v)
          for (std::size_t i = 0; i < d; ++i) xc[v * d + i] = x[(v0 + v) * d + i] - offset_[i];
        ok = simd::tq_encode_batch(*this, *hr, xc.data(), m, records + v0 * bytes());
      }
      if (ok) return;
    }
  }
  VectorQuantizer::encode_batch(x, n, records);
}

void TurboQuantMse::decode_batch(const std::uint8_t* records, std::size_t n, float* x) const {
  const auto* hr = dynamic_cast<const HadamardRotation*>(rot_.get());
  if (hr && simd::tq_decode_batch(*this, *hr, records, n, x)) {
    if (!offset_.empty())
      for (std::size_t v = 0; v < n; ++v)
        for (std::size_t i = 0; i < offset_.size(); ++i) x[v * offset_.size() + i] += offset_[i];
    return;
  }
  VectorQuantizer::decode_batch(records, n, x);
}

// ---- TurboQuantProd ------------------------------------------------------------------------

TurboQuantProd::TurboQuantProd(int dim, int bits, std::shared_ptr<const Rotation> rotation, std::uint64_t qjl_key)
    : VectorQuantizer(dim), bits_(bits), mse_(dim, bits - 1, std::move(rotation), false),
      s_(static_cast<std::size_t>(dim) * dim) {
  require(bits >= 2 && bits <= 9, "TurboQuantProd: bits must be 2..9");
  SplitMix64 rng(qjl_key);
  for (auto& v : s_) v = static_cast<float>(rng.normal());
}

std::string TurboQuantProd::name() const { return "turboquant-prod-" + std::to_string(bits_) + "bit"; }

std::size_t TurboQuantProd::code_bytes() const {
  return mse_.code_bytes() + packed_bytes(static_cast<std::size_t>(dim_), 1);
}

void TurboQuantProd::encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const {
  check_finite(x);
  const std::size_t d = static_cast<std::size_t>(dim_);
  mse_.encode(x, codes, meta);
  std::vector<float> xh(d), r(d);
  mse_.decode(codes, meta, xh.data());
  for (std::size_t i = 0; i < d; ++i) r[i] = x[i] - xh[i];
  std::vector<std::uint8_t> sg(d);
  for (std::size_t j = 0; j < d; ++j) {
    double p = 0;
    for (std::size_t i = 0; i < d; ++i) p += static_cast<double>(s_[j * d + i]) * r[i];
    sg[j] = p < 0 ? 0 : 1;  // bit 1 = +1
  }
  pack_bits(sg.data(), d, 1, codes + mse_.code_bytes());
  store_fp16(meta + 2, l2norm(r.data(), dim_), "TurboQuantProd residual");
}

void TurboQuantProd::decode_residual(const std::uint8_t* codes, const std::uint8_t* meta, float* r) const {
  const std::size_t d = static_cast<std::size_t>(dim_);
  const std::uint8_t* sg = codes + mse_.code_bytes();
  const float k = static_cast<float>(std::sqrt(M_PI / 2.0) / static_cast<double>(d)) * load_fp16(meta + 2);
  for (std::size_t i = 0; i < d; ++i) r[i] = 0;
  for (std::size_t j = 0; j < d; ++j) {
    const float s = unpack_one(sg, j, 1) ? k : -k;
    for (std::size_t i = 0; i < d; ++i) r[i] += s * s_[j * d + i];
  }
}

void TurboQuantProd::decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const {
  const std::size_t d = static_cast<std::size_t>(dim_);
  std::vector<float> r(d);
  mse_.decode(codes, meta, x);
  decode_residual(codes, meta, r.data());
  for (std::size_t i = 0; i < d; ++i) x[i] += r[i];
}

void TurboQuantProd::prepare_query(const float* q, float* qp) const {
  const std::size_t d = static_cast<std::size_t>(dim_);
  mse_.prepare_query(q, qp);
  for (std::size_t j = 0; j < d; ++j) {
    double p = 0;
    for (std::size_t i = 0; i < d; ++i) p += static_cast<double>(s_[j * d + i]) * q[i];
    qp[d + j] = static_cast<float>(p);
  }
}

float TurboQuantProd::score(const float* qp, const std::uint8_t* codes, const std::uint8_t* meta) const {
  const std::size_t d = static_cast<std::size_t>(dim_);
  const float base = mse_.score(qp, codes, meta);
  const std::uint8_t* sg = codes + mse_.code_bytes();
  float acc = 0;
  for (std::size_t j = 0; j < d; ++j) acc += unpack_one(sg, j, 1) ? qp[d + j] : -qp[d + j];
  return base + static_cast<float>(std::sqrt(M_PI / 2.0) / static_cast<double>(d)) * load_fp16(meta + 2) * acc;
}

// ---- OutlierSplit --------------------------------------------------------------------------

int split_bank_class(int dim, int c) {
  // The fast store kernel stages a vector's bf16 row with its 16-byte chunks XOR-swizzled by the row
  // (Stage<D> in src/cuda/store.cu). The lanes of one gather load read 8 rows (head_dim 64: 16; 256: 4)
  // at one channel per lane column; a channel's bank is 4 (chunk ^ row mod 8) + its 32-bit word in the
  // chunk, so two columns meet on a bank only where their words in the chunk agree (head_dim 256, four
  // rows: and their chunks' bit 2, channel bit 5).
  switch (dim) {
    case 64:
    case 128: return (c >> 1) & 3;
    case 256: return ((c >> 5) & 1) * 4 + ((c >> 1) & 3);
    default: return -1;
  }
}

std::pair<std::vector<int>, std::vector<int>> outlier_split_order(int dim, const std::vector<int>& outliers) {
  std::vector<char> is_hi(static_cast<std::size_t>(dim), 0);
  for (int c : outliers) {
    require(c >= 0 && c < dim && !is_hi[static_cast<std::size_t>(c)], "outlier_split_order: outliers must be distinct and < dim");
    is_hi[static_cast<std::size_t>(c)] = 1;
  }
  std::vector<int> hi, lo;
  for (int c = 0; c < dim; ++c) (is_hi[static_cast<std::size_t>(c)] ? hi : lo).push_back(c);
  if (2 * static_cast<int>(hi.size()) != dim || split_bank_class(dim, 0) < 0) return {hi, lo};
  // Halves of dim / 2: element i of an instance is element i % 32 of lane column i / 32 (32 per lane),
  // so the columns' loads of element k read elements k, k + 32, ... of both instances.
  const int nc = dim == 256 ? 8 : 4, cols = dim / 64;
  auto cls = [&](int c) { return split_bank_class(dim, c); };
  std::stable_sort(hi.begin(), hi.end(), [&](int a, int b) { return cls(a) < cls(b); });  // class by class
  if (cols == 1) {
    // Head_dim 64: one column each, four classes of 16 channels. The lo channels by descending class:
    // class w's hi run [S, S + n_w) and lo run [16 (3 - w) - T, 16 (4 - w) - T - n_w) (S, T: the hi channels
    // of the classes below and above w; S + n_w + T = 32) are disjoint, the lo run ending first for w >= 2.
    std::stable_sort(lo.begin(), lo.end(), [&](int a, int b) { return cls(a) > cls(b); });
    return {hi, lo};
  }
  // Each class holds at most 32 hi channels, so the hi elements k, k + 32, ... are of distinct classes.
  // The lo elements at k take the classes left free (as many as there are columns), each class as many
  // times as it has lo channels: a class with n hi channels has 32 - n lo ones and is free at 32 - n
  // elements k.
  std::vector<std::vector<int>> pool(static_cast<std::size_t>(nc));  // lo channels by class, ascending
  for (int c : lo) pool[static_cast<std::size_t>(cls(c))].push_back(c);
  std::vector<std::size_t> next(static_cast<std::size_t>(nc), 0);
  std::vector<int> out(lo.size());
  for (int k = 0; k < 32; ++k) {
    std::vector<char> used(static_cast<std::size_t>(nc), 0);
    for (int j = 0; j < cols; ++j) used[static_cast<std::size_t>(cls(hi[static_cast<std::size_t>(32 * j + k)]))] = 1;
    for (int j = 0; j < cols; ++j) {  // the free classes, ascending
      std::size_t w = 0;
      while (w < used.size() && used[w]) ++w;
      require(w < used.size() && next[w] < pool[w].size(), "outlier_split_order: no free class");  // not reached (the counts above)
      used[w] = 1;
      out[static_cast<std::size_t>(32 * j + k)] = pool[w][next[w]++];
    }
  }
  return {hi, out};
}

OutlierSplit::OutlierSplit(int dim, std::vector<int> outliers, int bits_hi, int bits_lo, bool randomize_signs,
                           std::uint64_t key_hi, std::uint64_t key_lo, bool norm_correction, std::vector<float> offset)
    : VectorQuantizer(dim), hi_idx_(std::move(outliers)) {
  require(offset.empty() || static_cast<int>(offset.size()) == dim, "OutlierSplit: offset must have dim floats");
  for (std::size_t i = 0; i < hi_idx_.size(); ++i) {
    const int c = hi_idx_[i];
    require(c >= 0 && c < dim && (i == 0 || c > hi_idx_[i - 1]),
            "OutlierSplit: outlier channels must be sorted, distinct and < " + std::to_string(dim));
  }
  std::tie(hi_ord_, lo_ord_) = outlier_split_order(dim, hi_idx_);
  const int nh = static_cast<int>(hi_ord_.size()), nl = static_cast<int>(lo_ord_.size());
  require(nh >= 3 && nl >= 3, "OutlierSplit: each channel subset needs at least 3 channels");
  std::vector<float> oh, ol;
  if (!offset.empty()) {
    for (int c : hi_ord_) oh.push_back(offset[static_cast<std::size_t>(c)]);
    for (int c : lo_ord_) ol.push_back(offset[static_cast<std::size_t>(c)]);
  }
  hi_ = std::make_unique<TurboQuantMse>(nh, bits_hi, std::make_shared<HadamardRotation>(nh, randomize_signs, key_hi),
                                        norm_correction, nullptr, std::move(oh));
  lo_ = std::make_unique<TurboQuantMse>(nl, bits_lo, std::make_shared<HadamardRotation>(nl, randomize_signs, key_lo),
                                        norm_correction, nullptr, std::move(ol));
}

std::string OutlierSplit::name() const {
  return "outlier-split-" + std::to_string(hi_ord_.size()) + "x" + std::to_string(hi_->bits()) + "+" +
         std::to_string(lo_ord_.size()) + "x" + std::to_string(lo_->bits());
}

double OutlierSplit::code_bits() const {
  return (static_cast<double>(hi_ord_.size()) * hi_->bits() + static_cast<double>(lo_ord_.size()) * lo_->bits()) / dim_;
}

void OutlierSplit::encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const {
  check_finite(x);
  std::vector<float> h(hi_ord_.size()), l(lo_ord_.size());
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = x[hi_ord_[i]];
  for (std::size_t i = 0; i < l.size(); ++i) l[i] = x[lo_ord_[i]];
  hi_->encode(h.data(), codes, meta);
  lo_->encode(l.data(), codes + hi_->code_bytes(), meta + 2);
}

void OutlierSplit::decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const {
  std::vector<float> h(hi_ord_.size()), l(lo_ord_.size());
  hi_->decode(codes, meta, h.data());
  lo_->decode(codes + hi_->code_bytes(), meta + 2, l.data());
  for (std::size_t i = 0; i < h.size(); ++i) x[hi_ord_[i]] = h[i];
  for (std::size_t i = 0; i < l.size(); ++i) x[lo_ord_[i]] = l[i];
}

void OutlierSplit::prepare_query(const float* q, float* qp) const {
  std::vector<float> h(hi_ord_.size()), l(lo_ord_.size());
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = q[hi_ord_[i]];
  for (std::size_t i = 0; i < l.size(); ++i) l[i] = q[lo_ord_[i]];
  hi_->prepare_query(h.data(), qp);
  lo_->prepare_query(l.data(), qp + hi_->query_dim());
}

float OutlierSplit::score(const float* qp, const std::uint8_t* codes, const std::uint8_t* meta) const {
  return hi_->score(qp, codes, meta) + lo_->score(qp + hi_->query_dim(), codes + hi_->code_bytes(), meta + 2);
}

void OutlierSplit::accumulate(float w, const std::uint8_t* codes, const std::uint8_t* meta, float* acc) const {
  hi_->accumulate(w, codes, meta, acc);
  lo_->accumulate(w, codes + hi_->code_bytes(), meta + 2, acc + hi_->acc_dim());
}

void OutlierSplit::finish(const float* acc, float* out) const {
  std::vector<float> h(hi_ord_.size()), l(lo_ord_.size());
  hi_->finish(acc, h.data());
  lo_->finish(acc + hi_->acc_dim(), l.data());
  for (std::size_t i = 0; i < h.size(); ++i) out[hi_ord_[i]] = h[i];
  for (std::size_t i = 0; i < l.size(); ++i) out[lo_ord_[i]] = l[i];
}

}  // namespace kvq
