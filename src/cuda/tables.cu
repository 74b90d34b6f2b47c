// Host side of the CUDA kernels: device copies of a layer's format constants (sign diagonals,
// outlier-split channel order, codebooks, centering means), read off the same kvq_quant
// quantizers the CPU cache uses, and the byte count a decode launch must read.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kvq/codebook.hpp"
#include "kvq/quantizers.hpp"
#include "kvq/rotation.hpp"
#include "kvq_cuda.hpp"

namespace kvq::cuda {

namespace {

// Sign diagonal of every segment of a TurboQuant-family quantizer, in segment order, read from
// prepare_query on unit vectors: column i of a Sylvester Hadamard block is positive in the
// block's first row, so the sign of that output is the sign applied to input i. Segment s's
// outputs start at qoffs[s] (a centered instance appends q . mu to its outputs, so the second
// segment of a centered outlier split starts one place later than its first input).
void extract_signs(const VectorQuantizer& q, const std::vector<int>& perm, const std::vector<int>& seg_dims,
                   const std::vector<int>& qoffs, float* signs) {
  const int d = q.dim();
  std::vector<float> e(static_cast<std::size_t>(d), 0.0f), out(static_cast<std::size_t>(q.query_dim()));
  int seg_off = 0;
  for (std::size_t s = 0; s < seg_dims.size(); ++s) {
    const int sd = seg_dims[s], qoff = qoffs[s];
    const std::vector<int> blocks = hadamard_blocks(sd);
    for (int i = 0; i < sd; ++i) {
      int boff = 0;
      for (int b : blocks) {
        if (i < boff + b) break;
        boff += b;
      }
      const int ch = perm[static_cast<std::size_t>(seg_off + i)];
      e[static_cast<std::size_t>(ch)] = 1.0f;
      q.prepare_query(e.data(), out.data());
      e[static_cast<std::size_t>(ch)] = 0.0f;
      signs[seg_off + i] = out[static_cast<std::size_t>(qoff + boff)] < 0 ? -1.0f : 1.0f;
    }
    seg_off += sd;
  }
}

void put_codebook(const Codebook& cb, float* cent, float* edges) {
  for (std::size_t i = 0; i < cb.centroids_f.size(); ++i) cent[i] = cb.centroids_f[i];
  for (std::size_t i = 0; i < cb.edges_f.size(); ++i) edges[i] = cb.edges_f[i];
}

// The norm-correction sum's terms of a TurboQuant instance (kvq::grid_squares, as its CPU encoder adds them).
void put_terms(const TurboQuantMse& q, float* terms) {
  const std::vector<float>& t = q.centroid_squares();
  for (std::size_t i = 0; i < t.size(); ++i) terms[i] = t[i];
}

}  // namespace

LayerTables::LayerTables(const FormatSpec& f, const CacheGeometry& g, int layer, const OutlierChannels* outliers) {
  require(!g.mla, "LayerTables: MLA formats have their own kernels");
  require(g.head_dim == g.v_head_dim, "LayerTables: the CUDA kernels need equal key and value head dims");
  const int d = g.head_dim, h = g.n_kv_heads;
  FormatDesc& fd = desc_;
  fd.head_dim = d;
  fd.kv_heads = h;
  fd.page = page_layout(f, g);
  const bool split = f.kind == FormatKind::kTqSplit;
  const int n_hi = split ? split_outlier_count(f, d) : d;
  fd.segments = split ? 2 : 1;
  fd.seg_dims[0] = n_hi;
  fd.seg_dims[1] = split ? d - n_hi : 0;
  switch (f.kind) {
    case FormatKind::kBf16:
      fd.key = KeyCode::kBf16;
      fd.value = ValueCode::kBf16;
      fd.key_bits[0] = fd.value_bits[0] = 16;
      break;
    case FormatKind::kTqVllm:
      fd.key = f.fp8_keys ? KeyCode::kFp8 : KeyCode::kTq;
      fd.key_bits[0] = f.fp8_keys ? 8 : f.key_bits;
      fd.value = ValueCode::kUniform;
      fd.value_bits[0] = f.value_bits;
      break;
    case FormatKind::kTqOurs:
      fd.key = KeyCode::kTq;
      fd.value = ValueCode::kTq;
      fd.key_bits[0] = f.key_bits;
      fd.value_bits[0] = f.value_bits;
      break;
    case FormatKind::kTqSplit:
      fd.key = KeyCode::kTq;
      fd.value = ValueCode::kTq;
      fd.key_bits[0] = f.key_bits + 1;
      fd.key_bits[1] = f.key_bits;
      fd.value_bits[0] = f.value_bits + 1;
      fd.value_bits[1] = f.value_bits;
      break;
    default:
      fail("format '" + f.name + "' has no CUDA kernel");
  }
  const std::size_t hd = static_cast<std::size_t>(h) * static_cast<std::size_t>(d);
  std::vector<float> ks(hd, 1.0f), vs(hd, 1.0f);
  std::vector<std::int32_t> kp(hd), vp(hd);
  std::vector<float> kc(2 * kMaxCodebook, 0.0f), ke(2 * kMaxCodebook, 0.0f), vc(2 * kMaxCodebook, 0.0f),
      ve(2 * kMaxCodebook, 0.0f), kq(2 * kMaxCodebook, 0.0f), vq(2 * kMaxCodebook, 0.0f);
  const std::vector<int> seg_dims = split ? std::vector<int>{n_hi, d - n_hi} : std::vector<int>{d};
  std::vector<float> km(hd, 0.0f), vm(hd, 0.0f);  // centering means, channel order
  bool centered = false;
  for (int head = 0; head < h; ++head) {
    const QuantizerPair qp = make_quantizers(f, g, layer, head, outliers);
    for (int which = 0; which < 2; ++which) {
      const VectorQuantizer& q = which == 0 ? *qp.key : *qp.value;
      std::int32_t* perm = (which == 0 ? kp.data() : vp.data()) + static_cast<std::size_t>(head) * d;
      float* signs = (which == 0 ? ks.data() : vs.data()) + static_cast<std::size_t>(head) * d;
      float* cent = which == 0 ? kc.data() : vc.data();
      float* edges = which == 0 ? ke.data() : ve.data();
      float* terms = which == 0 ? kq.data() : vq.data();  // the norm-correction terms
      std::vector<int> order(static_cast<std::size_t>(d));
      for (int i = 0; i < d; ++i) order[static_cast<std::size_t>(i)] = i;
      float* mean = (which == 0 ? km.data() : vm.data()) + static_cast<std::size_t>(head) * d;
      if (const auto* os = dynamic_cast<const OutlierSplit*>(&q)) {
        // Each instance holds the means of its channels, in the order of its elements; the segment
        // order is the instances' (outlier_split_order), hi then lo.
        const std::vector<float>& mh = os->hi().offset();
        const std::vector<float>& ml = os->lo().offset();
        require(static_cast<int>(os->hi_order().size()) == n_hi, "LayerTables: outlier count differs from the format's");
        std::copy(os->hi_order().begin(), os->hi_order().end(), order.begin());
        std::copy(os->lo_order().begin(), os->lo_order().end(), order.begin() + n_hi);
        if (!mh.empty() || !ml.empty()) {
          require(mh.size() == static_cast<std::size_t>(n_hi) && ml.size() == static_cast<std::size_t>(d - n_hi),
                  "LayerTables: outlier-split means do not cover both instances");
          for (int i = 0; i < d; ++i)
            mean[order[static_cast<std::size_t>(i)]] = i < n_hi ? mh[static_cast<std::size_t>(i)] : ml[static_cast<std::size_t>(i - n_hi)];
          centered = true;
        }
        extract_signs(q, order, seg_dims, {0, os->hi().query_dim()}, signs);
        const int bits_hi = which == 0 ? fd.key_bits[0] : fd.value_bits[0];
        const int bits_lo = which == 0 ? fd.key_bits[1] : fd.value_bits[1];
        put_codebook(sphere_codebook(n_hi, bits_hi), cent, edges);
        put_codebook(sphere_codebook(d - n_hi, bits_lo), cent + kMaxCodebook, edges + kMaxCodebook);
        require(os->hi().norm_correction() && os->lo().norm_correction(), "LayerTables: outlier split without norm correction has no kernel");
        put_terms(os->hi(), terms);
        put_terms(os->lo(), terms + kMaxCodebook);
      } else if (const auto* tq = dynamic_cast<const TurboQuantMse*>(&q)) {
        require(tq->norm_correction(), "LayerTables: TurboQuant without norm correction has no kernel");
        if (!tq->offset().empty()) {
          std::copy(tq->offset().begin(), tq->offset().end(), mean);
          centered = true;
        }
        extract_signs(q, order, seg_dims, {0}, signs);
        put_codebook(tq->codebook(), cent, edges);
        put_terms(*tq, terms);
      } else if (const auto* ua = dynamic_cast<const UniformAffine*>(&q)) {
        require(ua->group() == d, "LayerTables: only per-vector uniform values have a kernel");
        for (int i = 0; i < (1 << ua->bits()); ++i) cent[i] = static_cast<float>(i);
      }
      for (int i = 0; i < d; ++i) perm[i] = order[static_cast<std::size_t>(i)];
    }
  }
  fd.shared_codebook = kc == vc;
  // The store kernel's bucket thresholds: each segment's midpoints moved before the FWHT's final
  // 1 / sqrt(block) (prescale_threshold), for power-of-two segments (the fast kernel's); others
  // keep the midpoints (scale 1), which no kernel reads.
  std::vector<float> kt(2 * kMaxCodebook, 0.0f), vt(2 * kMaxCodebook, 0.0f);
  for (int s = 0; s < fd.segments; ++s) {
    const int bs = fd.seg_dims[s];
    const bool pow2 = bs > 0 && (bs & (bs - 1)) == 0;
    const float sc = pow2 ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(bs))) : 1.0f;
    for (int i = 0; i < kMaxCodebook; ++i) {
      const std::size_t j = static_cast<std::size_t>(s * kMaxCodebook + i);
      kt[j] = prescale_threshold(ke[j], sc);
      vt[j] = prescale_threshold(ve[j], sc);
    }
  }
  // Centered formats: the means in segment order, times the signs (the fast store kernel's).
  std::vector<float> kms(hd, 0.0f), vms(hd, 0.0f);
  for (std::size_t i = 0; i < hd; ++i) {
    const std::size_t hb = i - i % static_cast<std::size_t>(d);
    kms[i] = km[hb + static_cast<std::size_t>(kp[i])] * ks[i];
    vms[i] = vm[hb + static_cast<std::size_t>(vp[i])] * vs[i];
  }
  // One allocation: key signs, value signs, 4 codebook tables, 2 threshold tables, 2 term tables, key perm,
  // value perm, key and value means (channel order), the same in segment order and signed. Every
  // array is a multiple of 16 bytes long, so each starts 16-byte aligned.
  const std::size_t nf = 6 * hd, ni = 2 * hd, nc = 16 * static_cast<std::size_t>(kMaxCodebook);
  const std::size_t bytes = (nf + nc) * sizeof(float) + ni * sizeof(std::int32_t);
  if (cudaMalloc(&dev_, bytes) != cudaSuccess) fail("LayerTables: cudaMalloc of " + std::to_string(bytes) + " bytes failed");
  std::vector<std::uint8_t> host(bytes);
  std::uint8_t* p = host.data();
  auto put = [&](const void* src, std::size_t n) {
    std::memcpy(p, src, n);
    p += n;
  };
  put(ks.data(), hd * 4);
  put(vs.data(), hd * 4);
  put(kc.data(), kMaxCodebook * 8);
  put(ke.data(), kMaxCodebook * 8);
  put(vc.data(), kMaxCodebook * 8);
  put(ve.data(), kMaxCodebook * 8);
  put(kt.data(), kMaxCodebook * 8);
  put(vt.data(), kMaxCodebook * 8);
  put(kq.data(), kMaxCodebook * 8);
  put(vq.data(), kMaxCodebook * 8);
  put(kp.data(), hd * 4);
  put(vp.data(), hd * 4);
  put(km.data(), hd * 4);
  put(vm.data(), hd * 4);
  put(kms.data(), hd * 4);
  put(vms.data(), hd * 4);
  if (cudaMemcpy(dev_, host.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
    cudaFree(dev_);
    fail("LayerTables: cudaMemcpy failed");
  }
  const auto* base = static_cast<const std::uint8_t*>(dev_);
  fd.key_signs = reinterpret_cast<const float*>(base);
  fd.value_signs = reinterpret_cast<const float*>(base + hd * 4);
  fd.key_centroids = reinterpret_cast<const float*>(base + hd * 8);
  fd.key_edges = fd.key_centroids + 2 * kMaxCodebook;
  fd.value_centroids = fd.key_edges + 2 * kMaxCodebook;
  fd.value_edges = fd.value_centroids + 2 * kMaxCodebook;
  fd.key_thresholds = fd.value_edges + 2 * kMaxCodebook;
  fd.value_thresholds = fd.key_thresholds + 2 * kMaxCodebook;
  fd.key_terms = fd.value_thresholds + 2 * kMaxCodebook;
  fd.value_terms = fd.key_terms + 2 * kMaxCodebook;
  fd.key_perm = reinterpret_cast<const std::int32_t*>(fd.value_terms + 2 * kMaxCodebook);
  fd.value_perm = fd.key_perm + hd;
  if (centered) {
    fd.key_mean = reinterpret_cast<const float*>(fd.value_perm + hd);
    fd.value_mean = fd.key_mean + hd;
    fd.key_mean_seg = fd.value_mean + hd;
    fd.value_mean_seg = fd.key_mean_seg + hd;
  }
  // The store's setup image, built once on the device from these tables (FormatDesc::store_image).
  if (const std::size_t ib = store_image_bytes(fd); ib > 0) {
    if (cudaMalloc(&image_, ib) != cudaSuccess) {
      cudaFree(dev_);
      fail("LayerTables: cudaMalloc of the store image (" + std::to_string(ib) + " bytes) failed");
    }
    cudaError_t e = build_store_image(fd, image_, ib, nullptr);
    if (e == cudaSuccess) e = cudaStreamSynchronize(nullptr);
    if (e != cudaSuccess) {
      cudaFree(image_);
      cudaFree(dev_);
      fail(std::string("LayerTables: building the store image failed: ") + cudaGetErrorString(e));
    }
    fd.store_image = image_;
    fd.store_image_bytes = static_cast<std::uint32_t>(ib);
  }
}

LayerTables::~LayerTables() {
  if (image_) cudaFree(image_);
  if (dev_) cudaFree(dev_);
}

std::size_t decode_bytes_read(const FormatDesc& f, const int* seq_lens_host, int batch, const ProtectLayout& prot) {
  const PageLayout& pg = f.page;
  const std::size_t per_token_head = pg.key_code_bytes + pg.value_code_bytes + pg.meta_bytes;
  std::size_t total = 0;
  for (int b = 0; b < batch; ++b) {
    const std::int64_t L = seq_lens_host[b];
    std::int64_t lo = 0, hi = L, nprot = 0;
    if (prot.enabled()) {
      lo = prot.packed_begin(L);
      hi = prot.packed_end(L);
      nprot = L - (hi - lo);
    }
    total += static_cast<std::size_t>(hi - lo) * per_token_head * static_cast<std::size_t>(f.kv_heads);
    total += static_cast<std::size_t>(nprot) * 4u * static_cast<std::size_t>(f.head_dim) * static_cast<std::size_t>(f.kv_heads);
    total += static_cast<std::size_t>((L + pg.tokens - 1) / pg.tokens) * 4u;
  }
  return total;
}

}  // namespace kvq::cuda
