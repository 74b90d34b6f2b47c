// python/kvq_py.cpp: the `kvq._kvq` extension module (pybind11): kvq's library from Python with
// NumPy arrays, and its CUDA kernels (GQA and MLA) on torch tensors (kvq.cuda, at the end of this file).
//
// What it exposes, one class or function per library concept, nothing computed here:
//  - the format registry (Format, formats(), format(), token_bytes());
//  - the per-vector quantizers of a (layer, head) (Quantizer: encode / decode / scores /
//    weighted_sum, the paths attention uses on packed codes);
//  - the caches the model runtime writes to (PagedCache with its protection policy and memory
//    accounting, DenseCache) and their attention;
//  - the CPU model runtime, the tokenizer, the perplexity protocol, format calibration,
//    `kvq eval`'s measurements (evaluate), QuantMLA calibration (calibrate_mla) and the
//    sensitivity analysis of the MLA cache paths (analyze).
// Arrays are taken as C-contiguous float32 / int32 (other dtypes are converted, as NumPy would);
// a wrong shape is a ValueError naming the argument, and every kvq::Error (bad format name, NaN
// input, malformed model, exhausted page pool) is raised as kvq.Error with the library's message.
// Long calls (encode / decode of many rows, attention, forward, perplexity) release the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvq/common.hpp"
#include "kvq/formats.hpp"
#if KVQ_PY_RUNTIME
#include "kvq/analysis.hpp"
#include "kvq/calibrate.hpp"
#include "kvq/dense_cache.hpp"
#include "kvq/eval.hpp"
#include "kvq/model.hpp"
#include "kvq/paged_cache.hpp"
#include "kvq/quality.hpp"
#include "kvq/tokenizer.hpp"
#endif
#if KVQ_PY_CUDA
#include <cuda_runtime.h>

#include "kvq_cuda.hpp"
#include "kvq_cuda_mla.hpp"
#endif

namespace py = pybind11;

namespace {

using kvq::fail;
template <class T>
using Arr = py::array_t<T, py::array::c_style | py::array::forcecast>;

[[noreturn]] void bad_arg(const std::string& what) { throw py::value_error(what); }

// A batch of fixed-width items (float rows of a vector width, uint8 records of a byte size):
// shape (w,) is one item, (n, w) n items.
template <class T>
struct Batch {
  const T* p = nullptr;
  std::size_t n = 0;
  bool single = false;
};
template <class T>
Batch<T> batch_of(const Arr<T>& a, std::size_t w, const char* name) {
  if (a.ndim() == 1 && static_cast<std::size_t>(a.shape(0)) == w) return {a.data(), 1, true};
  if (a.ndim() == 2 && static_cast<std::size_t>(a.shape(1)) == w) return {a.data(), static_cast<std::size_t>(a.shape(0)), false};
  std::string shape = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) shape += (i ? ", " : "") + std::to_string(a.shape(i));
  bad_arg(std::string(name) + ": expected shape (" + std::to_string(w) + ",) or (n, " + std::to_string(w) + "), got " +
          shape + (a.ndim() == 1 ? ",)" : ")"));
}
// The output of a batch call: (w,) for one input item, (n, w) for n.
template <class T, class U>
py::array_t<T> batch_out(const Batch<U>& in, std::size_t w) {
  if (in.single) return py::array_t<T>({static_cast<py::ssize_t>(w)});
  return py::array_t<T>({static_cast<py::ssize_t>(in.n), static_cast<py::ssize_t>(w)});
}

const kvq::FormatSpec& spec_of(const py::object& f) {
  if (py::isinstance<py::str>(f)) return kvq::find_format(f.cast<std::string>());
  return *f.cast<const kvq::FormatSpec*>();
}

std::string family_name(kvq::FormatFamily f) {
  switch (f) {
    case kvq::FormatFamily::kKV: return "kv";
    case kvq::FormatFamily::kMLA: return "mla";
    default: return "any";
  }
}
std::string kind_name(kvq::FormatKind k) {
  switch (k) {
    case kvq::FormatKind::kBf16: return "bf16";
    case kvq::FormatKind::kFp8: return "fp8";
    case kvq::FormatKind::kTqVllm: return "tq-vllm";
    case kvq::FormatKind::kTqOurs: return "tq";
    case kvq::FormatKind::kTqSplit: return "tq-split";
    case kvq::FormatKind::kTqQjl: return "tq-qjl";
    case kvq::FormatKind::kMlaAffine: return "mla-affine";
    case kvq::FormatKind::kMlaTq: return "mla-tq";
  }
  return "?";
}

kvq::CacheGeometry make_geometry(int n_layers, int n_kv_heads, int head_dim, int v_head_dim, int d_latent, int d_rope) {
  kvq::CacheGeometry g;
  if (n_layers <= 0) bad_arg("n_layers must be positive");
  g.n_layers = n_layers;
  if (d_latent > 0 || d_rope > 0) {
    if (n_kv_heads != 0 || head_dim != 0) bad_arg("an MLA geometry (d_latent, d_rope) takes no n_kv_heads / head_dim");
    if (d_latent <= 0 || d_rope <= 0) bad_arg("an MLA geometry needs d_latent > 0 and d_rope > 0");
    g.mla = true;
    g.d_latent = d_latent;
    g.d_rope = d_rope;
  } else {
    if (n_kv_heads <= 0 || head_dim <= 0) bad_arg("a GQA geometry needs n_kv_heads > 0 and head_dim > 0 (or give d_latent, d_rope)");
    g.n_kv_heads = n_kv_heads;
    g.head_dim = head_dim;
    g.v_head_dim = v_head_dim > 0 ? v_head_dim : head_dim;
  }
  return g;
}
std::string geometry_repr(const kvq::CacheGeometry& g) {
  if (g.mla)
    return "Geometry(n_layers=" + std::to_string(g.n_layers) + ", d_latent=" + std::to_string(g.d_latent) +
           ", d_rope=" + std::to_string(g.d_rope) + ")";
  return "Geometry(n_layers=" + std::to_string(g.n_layers) + ", n_kv_heads=" + std::to_string(g.n_kv_heads) +
         ", head_dim=" + std::to_string(g.head_dim) + ", v_head_dim=" + std::to_string(g.v_head_dim) + ")";
}

// Calibration (outlier channels and channel means) of a format, as kvq::PagedCache and
// make_quantizers take it.
struct Calibration {
  std::shared_ptr<const kvq::FormatCalibration> c;
};
// The `calibration` argument of quantizers, caches and kvq.cuda.Layer: None or a Calibration.
std::shared_ptr<const kvq::FormatCalibration> calibration_of(const py::object& calibration) {
  if (calibration.is_none()) return nullptr;
  return calibration.cast<const Calibration&>().c;
}

// One quantizer of a (layer, head); holds what it was made from.
struct Quantizer {
  std::shared_ptr<const kvq::VectorQuantizer> q;
  std::shared_ptr<const kvq::FormatCalibration> calib;  // kept alive with the quantizer
  std::string side;

  std::size_t dim() const { return static_cast<std::size_t>(q->dim()); }
  py::array_t<std::uint8_t> encode(const Arr<float>& x) const {
    const Batch<float> r = batch_of(x, dim(), "x");
    py::array_t<std::uint8_t> out = batch_out<std::uint8_t>(r, q->bytes());
    std::uint8_t* dst = out.mutable_data();
    {
      py::gil_scoped_release nogil;
      q->encode_batch(r.p, r.n, dst);
    }
    return out;
  }
  py::array_t<float> decode(const Arr<std::uint8_t>& rec) const {
    const Batch<std::uint8_t> r = batch_of(rec, q->bytes(), "records");
    py::array_t<float> out = batch_out<float>(r, dim());
    float* dst = out.mutable_data();
    {
      py::gil_scoped_release nogil;
      q->decode_batch(r.p, r.n, dst);
    }
    return out;
  }
  // <query, decode(record)> for every record, from the packed codes (prepare_query once).
  py::array_t<float> scores(const Arr<float>& query, const Arr<std::uint8_t>& rec) const {
    const Batch<float> qr = batch_of(query, dim(), "query");
    if (!qr.single) bad_arg("query: one vector of shape (" + std::to_string(dim()) + ",)");
    for (std::size_t i = 0; i < dim(); ++i)
      if (!std::isfinite(qr.p[i])) fail("query: element " + std::to_string(i) + " is not finite");
    const Batch<std::uint8_t> r = batch_of(rec, q->bytes(), "records");
    py::array_t<float> out({static_cast<py::ssize_t>(r.n)});
    float* dst = out.mutable_data();
    {
      py::gil_scoped_release nogil;
      std::vector<float> qp(static_cast<std::size_t>(q->query_dim()));
      q->prepare_query(qr.p, qp.data());
      const std::size_t b = q->bytes(), cb = q->code_bytes();
      for (std::size_t i = 0; i < r.n; ++i) dst[i] = q->score(qp.data(), r.p + i * b, r.p + i * b + cb);
    }
    return out;
  }
  // sum_i w_i decode(record_i), accumulated in the quantizer's own domain (rotated for
  // TurboQuant values) and mapped back once.
  py::array_t<float> weighted_sum(const Arr<float>& w, const Arr<std::uint8_t>& rec) const {
    const Batch<std::uint8_t> r = batch_of(rec, q->bytes(), "records");
    if (w.ndim() != 1 || static_cast<std::size_t>(w.shape(0)) != r.n)
      bad_arg("weights: expected shape (" + std::to_string(r.n) + ",), one per record");
    for (std::size_t i = 0; i < r.n; ++i)
      if (!std::isfinite(w.data()[i])) fail("weights: element " + std::to_string(i) + " is not finite");
    py::array_t<float> out({static_cast<py::ssize_t>(dim())});
    float* dst = out.mutable_data();
    const float* wp = w.data();
    {
      py::gil_scoped_release nogil;
      std::vector<float> acc(static_cast<std::size_t>(q->acc_dim()), 0.0f);
      const std::size_t b = q->bytes(), cb = q->code_bytes();
      for (std::size_t i = 0; i < r.n; ++i) q->accumulate(wp[i], r.p + i * b, r.p + i * b + cb, acc.data());
      q->finish(acc.data(), dst);
    }
    return out;
  }
};

py::tuple make_quantizer_pair(const py::object& fmt, const kvq::CacheGeometry& g, int layer, int head,
                              const py::object& calibration) {
  const kvq::FormatSpec& f = spec_of(fmt);
  kvq::check_format_fits(f, g);
  if (layer < 0 || layer >= g.n_layers) bad_arg("layer " + std::to_string(layer) + " outside 0.." + std::to_string(g.n_layers - 1));
  if (!g.mla && (head < 0 || head >= g.n_kv_heads))
    bad_arg("head " + std::to_string(head) + " outside 0.." + std::to_string(g.n_kv_heads - 1));
  const std::shared_ptr<const kvq::FormatCalibration> c = calibration_of(calibration);
  kvq::QuantizerPair p = kvq::make_quantizers(f, g, layer, head, c.get());
  Quantizer k{std::shared_ptr<const kvq::VectorQuantizer>(std::move(p.key)), c, "key"};
  Quantizer v{std::shared_ptr<const kvq::VectorQuantizer>(std::move(p.value)), c, "value"};
  return py::make_tuple(k, v);
}

// A calibration from explicit per-(layer, head) channels and means (lists indexed [layer][head]).
Calibration calibration_from(const py::object& key_channels, const py::object& value_channels, const py::object& key_mean,
                             const py::object& value_mean) {
  auto c = std::make_shared<kvq::FormatCalibration>();
  if (!key_channels.is_none()) c->key = key_channels.cast<std::vector<std::vector<std::vector<int>>>>();
  if (!value_channels.is_none()) c->value = value_channels.cast<std::vector<std::vector<std::vector<int>>>>();
  if (!key_mean.is_none()) c->key_mean = key_mean.cast<std::vector<std::vector<std::vector<float>>>>();
  if (!value_mean.is_none()) c->value_mean = value_mean.cast<std::vector<std::vector<std::vector<float>>>>();
  if (c->key.size() != c->value.size()) bad_arg("key_channels and value_channels must cover the same layers");
  if (c->key_mean.size() != c->value_mean.size()) bad_arg("key_mean and value_mean must cover the same layers");
  return Calibration{std::move(c)};
}

#if KVQ_PY_RUNTIME
// Row widths of one append: GQA all KV heads; MLA latent and RoPE key.
std::size_t key_width(const kvq::CacheGeometry& g) {
  return g.mla ? static_cast<std::size_t>(g.d_latent) : static_cast<std::size_t>(g.n_kv_heads) * g.head_dim;
}
std::size_t value_width(const kvq::CacheGeometry& g) {
  return g.mla ? static_cast<std::size_t>(g.d_rope) : static_cast<std::size_t>(g.n_kv_heads) * g.v_head_dim;
}

// Cache wrapper: the library's KvCache plus what Python needs to check arguments.
struct Cache {
  std::unique_ptr<kvq::KvCache> c;
  kvq::PagedCache* paged = nullptr;  // null for the dense cache
  int max_seqs = 1;
  std::shared_ptr<const kvq::FormatCalibration> calib;

  const kvq::CacheGeometry& geo() const { return c->geometry(); }
  void check_seq(int seq) const {
    if (seq < 0 || seq >= max_seqs) bad_arg("seq " + std::to_string(seq) + " outside 0.." + std::to_string(max_seqs - 1));
  }
  void check_layer(int layer) const {
    if (layer < 0 || layer >= geo().n_layers)
      bad_arg("layer " + std::to_string(layer) + " outside 0.." + std::to_string(geo().n_layers - 1));
  }
  void append(int layer, const Arr<float>& k, const Arr<float>& v, int seq) {
    check_seq(seq);
    check_layer(layer);
    const Batch<float> kr = batch_of(k, key_width(geo()), "k"), vr = batch_of(v, value_width(geo()), "v");
    if (kr.n != vr.n) bad_arg("k and v must hold the same number of rows");
    if (kr.n == 0) return;
    py::gil_scoped_release nogil;
    c->append(seq, layer, static_cast<int>(kr.n), kr.p, vr.p);
  }
  py::array_t<float> attend(int layer, const Arr<float>& q, int n_heads, float scale, py::object pos0, int seq) const {
    check_seq(seq);
    check_layer(layer);
    const kvq::CacheGeometry& g = geo();
    if (n_heads <= 0) bad_arg("n_heads must be positive");
    if (!g.mla && n_heads % g.n_kv_heads != 0)
      bad_arg("n_heads (" + std::to_string(n_heads) + ") must be a multiple of the cache's n_kv_heads (" +
              std::to_string(g.n_kv_heads) + ")");
    const std::size_t qd = static_cast<std::size_t>(n_heads) * (g.mla ? g.d_latent + g.d_rope : g.head_dim);
    const std::size_t od = static_cast<std::size_t>(n_heads) * (g.mla ? g.d_latent : g.v_head_dim);
    const Batch<float> qr = batch_of(q, qd, "q");
    if (!std::isfinite(scale)) bad_arg("scale must be finite");
    const int len = c->length(seq);
    // Queries default to the last positions of the stored sequence (decode: one query at len - 1).
    const int p0 = pos0.is_none() ? len - static_cast<int>(qr.n) : pos0.cast<int>();
    if (qr.n == 0) bad_arg("q: no query rows");
    if (p0 < 0 || p0 + static_cast<int>(qr.n) > len)
      bad_arg("query positions " + std::to_string(p0) + ".." + std::to_string(p0 + static_cast<int>(qr.n) - 1) +
              " outside the " + std::to_string(len) + " stored tokens of seq " + std::to_string(seq));
    for (std::size_t i = 0; i < qr.n * qd; ++i)
      if (!std::isfinite(qr.p[i])) fail("q: element " + std::to_string(i) + " is not finite");
    py::array_t<float> out = batch_out<float>(qr, od);
    float* dst = out.mutable_data();
    {
      py::gil_scoped_release nogil;
      c->attend(seq, layer, static_cast<int>(qr.n), p0, n_heads, scale, qr.p, dst);
    }
    return out;
  }
  kvq::PagedCache& need_paged(const char* what) const {
    if (!paged) bad_arg(std::string(what) + " is a PagedCache method");
    return *paged;
  }
};

py::dict memory_dict(const kvq::CacheMemory& m) {
  py::dict d;
  d["blocks"] = m.blocks;
  d["packed_bytes"] = m.packed_bytes;
  d["protection_bytes"] = m.protection_bytes;
  d["reverse_map_bytes"] = m.reverse_map_bytes;
  d["total"] = m.total();
  return d;
}

kvq::ProtectionPolicy policy_of(int sinks, int window, int boundary_layers) {
  if (sinks < 0 || window < 0 || boundary_layers < 0) bad_arg("sinks, window and boundary_layers must be >= 0");
  return kvq::ProtectionPolicy{sinks, window, boundary_layers};
}

// Format, protection policy and calibration of a PagedCache (the other options keep their defaults).
kvq::CacheOptions cache_options(const py::object& fmt, int sinks, int window, int boundary_layers, const py::object& calibration) {
  kvq::CacheOptions o;
  o.format = spec_of(fmt).name;
  o.protect = policy_of(sinks, window, boundary_layers);
  o.outliers = calibration_of(calibration);
  return o;
}

Cache make_paged(const kvq::CacheGeometry& g, const py::object& fmt, int sinks, int window, int boundary_layers,
                 int page_tokens, std::size_t pool_bytes, int max_seqs, bool preempt, const std::string& path,
                 const py::object& calibration) {
  if (max_seqs <= 0) bad_arg("max_seqs must be positive");
  if (path != "fast" && path != "reference") bad_arg("path must be 'fast' or 'reference'");
  kvq::CacheOptions o = cache_options(fmt, sinks, window, boundary_layers, calibration);
  o.page_tokens = page_tokens;
  o.pool_bytes = pool_bytes;
  o.preempt = preempt;
  Cache c;
  c.calib = o.outliers;
  auto p = std::make_unique<kvq::PagedCache>(g, o, max_seqs);
  p->set_attention_path(path == "fast" ? kvq::AttentionPath::kFast : kvq::AttentionPath::kReference);
  c.paged = p.get();
  c.c = std::move(p);
  c.max_seqs = max_seqs;
  return c;
}

py::dict config_dict(const kvq::ModelConfig& c) {
  py::dict d;
  d["architecture"] = c.architecture;
  d["model_type"] = c.model_type;
  d["vocab_size"] = c.vocab_size;
  d["hidden_size"] = c.hidden_size;
  d["n_layers"] = c.n_layers;
  d["n_heads"] = c.n_heads;
  d["n_kv_heads"] = c.n_kv_heads;
  d["head_dim"] = c.head_dim;
  d["mla"] = c.mla;
  d["kv_lora_rank"] = c.kv_lora_rank;
  d["qk_nope_head_dim"] = c.qk_nope_head_dim;
  d["qk_rope_head_dim"] = c.qk_rope_head_dim;
  d["v_head_dim"] = c.v_head_dim;
  d["max_position_embeddings"] = c.max_position_embeddings;
  d["softmax_scale"] = c.softmax_scale;
  d["bos_token_id"] = c.bos_token_id;
  d["eos_token_ids"] = c.eos_token_ids;
  d["moe_experts"] = c.moe.n_routed_experts;
  return d;
}

struct PyModel {
  std::unique_ptr<kvq::Model> m;
};

std::vector<std::int32_t> tokens_of(const Arr<std::int32_t>& t) {
  if (t.ndim() != 1) bad_arg("tokens: expected a 1-D array of token ids");
  return std::vector<std::int32_t>(t.data(), t.data() + t.shape(0));
}

std::unique_ptr<kvq::Tokenizer> load_tokenizer(const std::string& path) {
  std::string p = path;
  if (p.size() < 5 || p.compare(p.size() - 5, 5, ".json") != 0) p += "/tokenizer.json";
  return kvq::Tokenizer::load(p);
}
void bind_runtime(py::module_& m);
#endif
#if KVQ_PY_CUDA
void bind_cuda(py::module_& m);
#endif

}  // namespace

PYBIND11_MODULE(_kvq, m) {
  m.doc() = "kvq: low-bit KV caches (TurboQuant, QuantMLA) - bindings of the C++ library (and its CUDA kernels: kvq.cuda)";
  static py::exception<kvq::Error> error(m, "Error", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kvq::Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });
  m.attr("format_version") = kvq::kFormatVersion;
  m.attr("has_runtime") = static_cast<bool>(KVQ_PY_RUNTIME);  // caches, model, tokenizer (the full CPU build)
  m.attr("has_cuda") = static_cast<bool>(KVQ_PY_CUDA);        // the kvq.cuda submodule
  m.attr("default_page_tokens") = kvq::kDefaultPageTokens;

  py::class_<kvq::FormatSpec>(m, "Format", "A cache format of the registry (docs/formats.md).")
      .def_readonly("name", &kvq::FormatSpec::name)
      .def_property_readonly("family", [](const kvq::FormatSpec& f) { return family_name(f.family); })
      .def_property_readonly("kind", [](const kvq::FormatSpec& f) { return kind_name(f.kind); })
      .def_readonly("key_bits", &kvq::FormatSpec::key_bits, "code bits of keys (MLA: the content latent)")
      .def_readonly("value_bits", &kvq::FormatSpec::value_bits, "code bits of values (MLA: the RoPE key)")
      .def_readonly("fp8_keys", &kvq::FormatSpec::fp8_keys)
      .def_readonly("outlier_channels", &kvq::FormatSpec::outlier_channels)
      .def_readonly("keys", &kvq::FormatSpec::keys)
      .def_readonly("values", &kvq::FormatSpec::values)
      .def_readonly("pair", &kvq::FormatSpec::pair, "the vLLM preset this format is compared with ('' if none)")
      .def_readonly("summary", &kvq::FormatSpec::summary)
      .def_property_readonly("needs_outliers", [](const kvq::FormatSpec& f) { return f.kind == kvq::FormatKind::kTqSplit; },
                             "true for the outlier splits, which need channels from calibration")
      .def_property_readonly("uses_centering", [](const kvq::FormatSpec& f) { return kvq::format_uses_centering(f); },
                             "true for the formats that subtract calibration means when given")
      .def("__repr__", [](const kvq::FormatSpec& f) { return "<kvq.Format '" + f.name + "'>"; });

  m.def("formats", [](const std::string& family) {
        std::vector<const kvq::FormatSpec*> out;
        if (family != "" && family != "kv" && family != "mla") bad_arg("family must be '', 'kv' or 'mla'");
        for (const kvq::FormatSpec& f : kvq::all_formats()) {
          const bool any = f.family == kvq::FormatFamily::kAny;
          if (family.empty() || any || (family == "kv") == (f.family == kvq::FormatFamily::kKV)) out.push_back(&f);
        }
        return out;
      }, py::arg("family") = "", py::return_value_policy::reference,
      "The registry's formats; family 'kv' or 'mla' keeps those that fit (bf16 and fp8 fit both).");
  m.def("format", [](const std::string& name) { return &kvq::find_format(name); }, py::arg("name"),
        py::return_value_policy::reference, "The format called `name` (kvq.Error listing the names if unknown).");

  py::class_<kvq::CacheGeometry>(m, "Geometry", "Per-layer cache shape: GQA (n_kv_heads, head_dim) or MLA (d_latent, d_rope).")
      .def(py::init(&make_geometry), py::arg("n_layers") = 1, py::arg("n_kv_heads") = 0, py::arg("head_dim") = 0,
           py::arg("v_head_dim") = 0, py::arg("d_latent") = 0, py::arg("d_rope") = 0)
      .def_readonly("n_layers", &kvq::CacheGeometry::n_layers)
      .def_readonly("mla", &kvq::CacheGeometry::mla)
      .def_readonly("n_kv_heads", &kvq::CacheGeometry::n_kv_heads)
      .def_readonly("head_dim", &kvq::CacheGeometry::head_dim)
      .def_readonly("v_head_dim", &kvq::CacheGeometry::v_head_dim)
      .def_readonly("d_latent", &kvq::CacheGeometry::d_latent)
      .def_readonly("d_rope", &kvq::CacheGeometry::d_rope)
      .def("__repr__", &geometry_repr);

  m.def("token_bytes", [](const py::object& fmt, const kvq::CacheGeometry& g) {
        const kvq::FormatSpec& f = spec_of(fmt);
        kvq::check_format_fits(f, g);
        const kvq::TokenBytes t = kvq::token_bytes(f, g);
        py::dict d;
        d["key_code"] = t.key_code;
        d["key_meta"] = t.key_meta;
        d["value_code"] = t.value_code;
        d["value_meta"] = t.value_meta;
        d["record"] = t.record;
        d["per_layer"] = t.per_layer;
        d["bits_per_value"] = t.bits_per_value;
        d["bf16_per_layer"] = kvq::bf16_token_bytes(g);
        return d;
      }, py::arg("format"), py::arg("geometry"),
      "Bytes per token and layer (codes, metadata, record with padding) and the bf16 cache's for comparison.");

  py::class_<Calibration>(m, "Calibration", "Outlier channels and channel means of kvq's calibrated formats.")
      .def(py::init(&calibration_from), py::arg("key_channels") = py::none(), py::arg("value_channels") = py::none(),
           py::arg("key_mean") = py::none(), py::arg("value_mean") = py::none(),
           "From explicit lists indexed [layer][head]: channels (ints) of the split formats, means (floats) of the "
           "centering formats.")
      .def_property_readonly("key_channels", [](const Calibration& c) { return c.c->key; })
      .def_property_readonly("value_channels", [](const Calibration& c) { return c.c->value; })
      .def_property_readonly("key_mean", [](const Calibration& c) { return c.c->key_mean; })
      .def_property_readonly("value_mean", [](const Calibration& c) { return c.c->value_mean; });

  py::class_<Quantizer>(m, "Quantizer", "The per-vector quantizer of one side of a (layer, head).")
      .def_property_readonly("name", [](const Quantizer& q) { return q.q->name(); })
      .def_readonly("side", &Quantizer::side)
      .def_property_readonly("dim", &Quantizer::dim)
      .def_property_readonly("code_bytes", [](const Quantizer& q) { return q.q->code_bytes(); })
      .def_property_readonly("meta_bytes", [](const Quantizer& q) { return q.q->meta_bytes(); })
      .def_property_readonly("bytes", [](const Quantizer& q) { return q.q->bytes(); }, "bytes of one record (codes then metadata)")
      .def_property_readonly("code_bits", [](const Quantizer& q) { return q.q->code_bits(); })
      .def("encode", &Quantizer::encode, py::arg("x"), "float32 (d,) or (n, d) -> uint8 records (bytes,) or (n, bytes)")
      .def("decode", &Quantizer::decode, py::arg("records"), "records -> float32 vectors")
      .def("scores", &Quantizer::scores, py::arg("query"), py::arg("records"),
           "<query, decode(r)> for every record, computed from the packed codes")
      .def("weighted_sum", &Quantizer::weighted_sum, py::arg("weights"), py::arg("records"),
           "sum_i weights[i] * decode(records[i]), accumulated in the quantizer's domain")
      .def("__repr__", [](const Quantizer& q) { return "<kvq.Quantizer " + q.side + " '" + q.q->name() + "'>"; });

  m.def("quantizers", &make_quantizer_pair, py::arg("format"), py::arg("geometry"), py::arg("layer") = 0,
        py::arg("head") = 0, py::arg("calibration") = py::none(),
        "(key, value) quantizers of a (layer, head); for MLA formats (latent, RoPE key).");

#if KVQ_PY_RUNTIME
  bind_runtime(m);
#endif
#if KVQ_PY_CUDA
  bind_cuda(m);
#endif
}

namespace {
#if KVQ_PY_RUNTIME
// A Python callback (progress, log lines) called from a long library call that runs without the
// GIL: takes the GIL, and an exception the callback raises is reported as unraisable (printed) instead
// of unwinding through the library's threads.
template <class... Args>
void call_back(const py::object& fn, const Args&... args) {
  py::gil_scoped_acquire gil;
  try {
    fn(args...);
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("kvq callback");
  }
}

void bind_runtime(py::module_& m) {
  py::class_<Cache>(m, "Cache", "A KV cache the model runtime writes to (kvq.PagedCache() or kvq.DenseCache()).")
      .def_property_readonly("geometry", [](const Cache& c) { return c.geo(); })
      .def_readonly("max_seqs", &Cache::max_seqs)
      .def_property_readonly("paged", [](const Cache& c) { return c.paged != nullptr; })
      .def("length", [](const Cache& c, int seq) { c.check_seq(seq); return c.c->length(seq); }, py::arg("seq") = 0)
      .def("append", &Cache::append, py::arg("layer"), py::arg("k"), py::arg("v"), py::arg("seq") = 0,
           "Appends rows to one layer (GQA: k (n, H*d) after RoPE, v (n, H*dv); MLA: latent (n, d_c), RoPE key (n, d_r)); "
           "the length advances with the last layer.")
      .def("attend", &Cache::attend, py::arg("layer"), py::arg("q"), py::arg("n_heads"), py::arg("scale"),
           py::arg("pos0") = py::none(), py::arg("seq") = 0,
           "Causal attention of query rows at positions pos0.. (default: the last stored positions); GQA q (n, heads*d) -> "
           "(n, heads*dv); MLA absorbed q (n, heads*(d_c+d_r)) -> (n, heads*d_c).")
      .def("reset", [](Cache& c, int seq) { c.check_seq(seq); c.c->reset(seq); }, py::arg("seq") = 0)
      .def("describe", [](const Cache& c) { return c.c->describe(); })
      // PagedCache only (a DenseCache raises ValueError):
      .def("memory", [](const Cache& c, py::object seq) {
             kvq::PagedCache& p = c.need_paged("memory");
             if (seq.is_none()) return memory_dict(p.memory_total());
             c.check_seq(seq.cast<int>());
             return memory_dict(p.memory(seq.cast<int>()));
           }, py::arg("seq") = py::none(), "Persistent bytes of one sequence (or of the whole cache): pages, protection rows, reverse map.")
      .def("read_row", [](const Cache& c, int layer, int t, py::object as_of, int seq) {
             kvq::PagedCache& p = c.need_paged("read_row");
             c.check_seq(seq);
             c.check_layer(layer);
             if (t < 0 || t >= c.c->length(seq)) bad_arg("t outside the stored tokens");
             py::array_t<float> k({static_cast<py::ssize_t>(key_width(c.geo()))});
             py::array_t<float> v({static_cast<py::ssize_t>(value_width(c.geo()))});
             p.read_row(seq, layer, t, as_of.is_none() ? -1 : as_of.cast<int>(), k.mutable_data(), v.mutable_data());
             return py::make_tuple(k, v);
           }, py::arg("layer"), py::arg("t"), py::arg("as_of") = py::none(), py::arg("seq") = 0,
           "The row attention reads for token t (as seen by a query at position as_of; default: the packed copy).")
      .def("layer_format", [](const Cache& c, int layer) {
             c.check_layer(layer);
             return &c.need_paged("layer_format").layer_format(layer);
           }, py::arg("layer"), py::return_value_policy::reference)
      .def("preempted", [](const Cache& c, int seq) { c.check_seq(seq); return c.need_paged("preempted").preempted(seq); },
           py::arg("seq") = 0)
      .def("__repr__", [](const Cache& c) { return "<kvq.Cache " + c.c->describe() + ">"; });

  m.def("PagedCache", &make_paged, py::arg("geometry"), py::arg("format") = "bf16", py::arg("sinks") = 0,
        py::arg("window") = 0, py::arg("boundary_layers") = 0, py::arg("page_tokens") = kvq::kDefaultPageTokens,
        py::arg("pool_bytes") = 0, py::arg("max_seqs") = 1, py::arg("preempt") = false, py::arg("path") = "fast",
        py::arg("calibration") = py::none(),
        "The paged packed cache: a format, the protection policy (bf16 sinks, recent window, boundary layers), an "
        "optional page-pool budget in bytes (0: grow as needed); path 'fast' or 'reference' attention.");
  m.def("DenseCache", [](const kvq::CacheGeometry& g, const std::string& storage, int max_seqs) {
        if (storage != "bf16" && storage != "f32") bad_arg("storage must be 'bf16' or 'f32'");
        if (max_seqs <= 0) bad_arg("max_seqs must be positive");
        Cache c;
        c.c = kvq::make_dense_cache(g, max_seqs, 0, storage == "bf16" ? kvq::DenseStorage::kBF16 : kvq::DenseStorage::kF32);
        c.max_seqs = max_seqs;
        return c;
      }, py::arg("geometry"), py::arg("storage") = "bf16", py::arg("max_seqs") = 1,
      "The dense cache: bf16 rows (the baseline) or exact f32 rows.");
  m.def("account", [](const kvq::CacheGeometry& g, const py::object& fmt, int tokens, int sinks, int window,
                      int boundary_layers, int page_tokens) {
        if (tokens < 0) bad_arg("tokens must be >= 0");
        const kvq::FormatSpec& f = spec_of(fmt);
        kvq::check_format_fits(f, g);
        return memory_dict(kvq::PagedCache::account(g, f.name, policy_of(sinks, window, boundary_layers), tokens, page_tokens));
      }, py::arg("geometry"), py::arg("format"), py::arg("tokens"), py::arg("sinks") = 0, py::arg("window") = 0,
      py::arg("boundary_layers") = 0, py::arg("page_tokens") = kvq::kDefaultPageTokens,
      "Analytic persistent bytes of one request of `tokens` tokens (what `kvq budget` prints).");

  py::class_<kvq::Tokenizer>(m, "Tokenizer", "tokenizer.json byte-level BPE.")
      .def(py::init(&load_tokenizer), py::arg("path"), "From a tokenizer.json file or a model directory.")
      .def("encode", [](const kvq::Tokenizer& t, const std::string& text) {
             std::vector<std::int32_t> ids = t.encode(text);
             py::array_t<std::int32_t> a({static_cast<py::ssize_t>(ids.size())});
             if (!ids.empty()) std::memcpy(a.mutable_data(), ids.data(), ids.size() * sizeof(std::int32_t));
             return a;
           }, py::arg("text"), "Token ids (no BOS / EOS added).")
      .def("decode_bytes", [](const kvq::Tokenizer& t, const Arr<std::int32_t>& ids) { return py::bytes(t.decode(tokens_of(ids))); },
           py::arg("ids"))
      .def("decode", [](const kvq::Tokenizer& t, const Arr<std::int32_t>& ids) {
             return py::bytes(t.decode(tokens_of(ids))).attr("decode")("utf-8", "replace");
           }, py::arg("ids"), "Text of the ids (invalid UTF-8 of partial tokens replaced).")
      .def("token_id", [](const kvq::Tokenizer& t, const std::string& s) { return t.token_id(s); }, py::arg("content"))
      .def("token_text", &kvq::Tokenizer::token_text, py::arg("id"))
      .def_property_readonly("vocab_size", &kvq::Tokenizer::vocab_size);

  py::class_<PyModel>(m, "Model", "The CPU model runtime (Llama family, DeepSeek-V2/V3) loaded from a Hugging Face directory.")
      .def(py::init([](const std::string& dir) { return PyModel{kvq::Model::load(dir)}; }), py::arg("dir"))
      .def_property_readonly("config", [](const PyModel& pm) { return config_dict(pm.m->config()); })
      .def_property_readonly("geometry", [](const PyModel& pm) { return pm.m->cache_geometry(); })
      .def_property_readonly("weight_bytes", [](const PyModel& pm) { return pm.m->weight_bytes(); })
      .def("cache", [](const PyModel& pm, const py::object& fmt, int sinks, int window, int boundary_layers, std::size_t pool_bytes,
                       int max_seqs, const py::object& calibration) {
             return make_paged(pm.m->cache_geometry(), fmt, sinks, window, boundary_layers, kvq::kDefaultPageTokens, pool_bytes,
                               max_seqs, false, "fast", calibration);
           }, py::arg("format") = "bf16", py::arg("sinks") = 0, py::arg("window") = 0, py::arg("boundary_layers") = 0,
           py::arg("pool_bytes") = 0, py::arg("max_seqs") = 1, py::arg("calibration") = py::none(),
           "A PagedCache for this model's geometry.")
      .def("forward", [](PyModel& pm, const Arr<std::int32_t>& tokens, Cache& cache, int seq, const std::string& logits) {
             cache.check_seq(seq);
             const std::vector<std::int32_t> t = tokens_of(tokens);
             if (t.empty()) bad_arg("tokens: at least one token");
             const kvq::CacheGeometry g = pm.m->cache_geometry(), cg = cache.geo();
             if (g.n_layers != cg.n_layers || g.mla != cg.mla || g.n_kv_heads != cg.n_kv_heads || g.head_dim != cg.head_dim ||
                 g.v_head_dim != cg.v_head_dim || g.d_latent != cg.d_latent || g.d_rope != cg.d_rope)
               bad_arg("cache geometry " + geometry_repr(cg) + " does not match the model's " + geometry_repr(g));
             const int vocab = pm.m->config().vocab_size;
             kvq::LogitsMode mode;
             py::array_t<float> out;
             if (logits == "all") {
               mode = kvq::LogitsMode::kAll;
               out = py::array_t<float>({static_cast<py::ssize_t>(t.size()), static_cast<py::ssize_t>(vocab)});
             } else if (logits == "last") {
               mode = kvq::LogitsMode::kLast;
               out = py::array_t<float>({static_cast<py::ssize_t>(vocab)});
             } else if (logits == "none") {
               mode = kvq::LogitsMode::kNone;
             } else {
               bad_arg("logits must be 'all', 'last' or 'none'");
             }
             float* dst = mode == kvq::LogitsMode::kNone ? nullptr : out.mutable_data();
             {
               py::gil_scoped_release nogil;
               pm.m->forward(t.data(), static_cast<int>(t.size()), *cache.c, seq, dst, mode);
             }
             return mode == kvq::LogitsMode::kNone ? py::object(py::none()) : py::object(out);
           }, py::arg("tokens"), py::arg("cache"), py::arg("seq") = 0, py::arg("logits") = "all",
           "Runs tokens at the next positions of `seq`, appending their rows to `cache`; returns the logits.")
      .def("calibrate", [](PyModel& pm, const kvq::Tokenizer& tok, const std::string& text, const py::object& fmt, int tokens,
                           int ctx) {
             const kvq::FormatSpec& f = spec_of(fmt);
             std::shared_ptr<kvq::FormatCalibration> c;
             {
               py::gil_scoped_release nogil;
               c = kvq::calibrate_format(*pm.m, tok, text, f, tokens, ctx);
             }
             return Calibration{std::move(c)};
           }, py::arg("tokenizer"), py::arg("text"), py::arg("format"), py::arg("tokens") = 16384, py::arg("ctx") = 2048,
           "Outlier channels / channel means of a calibrated format from calibration text (never the evaluation text).")
      .def("perplexity", [](PyModel& pm, const kvq::Tokenizer& tok, const std::string& text, const py::object& fmt, int sinks,
                            int window, int boundary_layers, const py::object& calibration, int ctx, int windows) {
             if (ctx < 2) bad_arg("ctx must be >= 2");
             if (windows < 0) bad_arg("windows must be >= 0");
             const kvq::ModelConfig& cfg = pm.m->config();
             const std::int32_t eos = cfg.eos_token_ids.empty() ? tok.token_id("<|eos|>") : cfg.eos_token_ids.front();
             kvq::PerplexityOptions o;
             o.ctx = ctx;
             o.windows = windows;
             o.bos_id = cfg.bos_token_id >= 0 ? cfg.bos_token_id : tok.token_id("<|bos|>");
             if (!fmt.is_none()) {  // the paged cache in that format, as `kvq ppl --cache`
               kvq::check_format_fits(spec_of(fmt), pm.m->cache_geometry());
               const kvq::CacheOptions co = cache_options(fmt, sinks, window, boundary_layers, calibration);
               o.make_cache = [co](const kvq::CacheGeometry& g) {
                 return std::unique_ptr<kvq::KvCache>(std::make_unique<kvq::PagedCache>(g, co));
               };
             }
             kvq::PerplexityResult r;
             {
               py::gil_scoped_release nogil;
               const std::vector<std::int32_t> stream =
                   kvq::ppl_token_stream(text, [&](std::string_view s) { return tok.encode(s); }, eos);
               r = kvq::perplexity_windows(*pm.m, stream, o);
             }
             py::dict d;
             d["ppl"] = r.ppl;
             d["mean_nll"] = r.mean_nll;
             d["windows"] = r.windows;
             d["predictions"] = r.predictions;
             d["stream_tokens"] = r.stream_tokens;
             d["window_nll"] = r.window_nll;
             d["seconds"] = r.seconds;
             return d;
           }, py::arg("tokenizer"), py::arg("text"), py::arg("format") = py::none(), py::arg("sinks") = 0, py::arg("window") = 0,
           py::arg("boundary_layers") = 0, py::arg("calibration") = py::none(), py::arg("ctx") = 2048, py::arg("windows") = 0,
           "Perplexity by the protocol of models/README.md with the dense bf16 cache (format None) or a PagedCache in `format`.");

  // kvq eval as a library call: the same measurements and field names as `kvq eval --json`.
  m.def("evaluate", [](const std::string& model_dir, const std::vector<std::string>& caches, const std::string& text, int ctx,
                       int windows, int needle_samples, const std::vector<int>& needle_lengths, std::uint64_t seed, bool diagnostics,
                       int diag_queries, int calib_tokens, const std::string& calib_text, const std::string& baseline_model,
                       int sinks, int window, int boundary_layers, const py::object& progress) {
    if (caches.empty()) bad_arg("caches: at least one FORMAT or FORMAT@policy");
    if (ctx < 2) bad_arg("ctx must be >= 2");
    if (windows < 0 || needle_samples < 0 || diag_queries < 1 || calib_tokens < 1)
      bad_arg("windows and needle_samples must be >= 0, diag_queries and calib_tokens >= 1");
    std::vector<kvq::CacheConfig> configs;
    for (const auto& c : caches) configs.push_back(kvq::parse_cache_config(c, policy_of(sinks, window, boundary_layers)));
    kvq::EvalOptions o;
    o.ctx = ctx;
    o.windows = windows;
    o.needle_samples = needle_samples;
    if (!needle_lengths.empty()) o.needle_lengths = needle_lengths;
    o.seed = seed;
    o.diagnostics = diagnostics;
    o.diag_queries = diag_queries;
    o.calib_tokens = calib_tokens;
    o.calib_text = calib_text;
    o.needle_words_text = calib_text;
    o.baseline_model = baseline_model;
    if (!progress.is_none()) o.progress = [progress](const std::string& stage, double frac) { call_back(progress, stage, frac); };
    kvq::ModelEvalResult r;
    {
      py::gil_scoped_release nogil;
      r = kvq::evaluate_model(model_dir, configs, text, o);
    }
    py::list rows;
    for (const auto& c : r.rows) {
      py::list layers;
      for (const auto& l : c.layers) {
        py::dict d;
        d["logit_rmse"] = l.logit_rmse;
        d["tv"] = l.tv;
        d["top8_overlap"] = l.top8;
        d["output_nmse"] = l.out_nmse;
        layers.append(d);
      }
      py::dict d;
      d["cache"] = c.config.label;
      d["format"] = c.config.format;
      d["sinks"] = c.config.protect.sinks;
      d["window"] = c.config.protect.window;
      d["boundary_layers"] = c.config.protect.boundary_layers;
      d["bits_per_value"] = c.bits_per_value;
      d["bytes_per_token"] = c.bytes_per_token;
      d["compression"] = c.compression;
      d["ppl"] = c.ppl;
      d["delta_ppl_pct"] = c.delta_ppl_pct;
      d["kl"] = c.kl;
      d["top1"] = c.top1;
      d["needle_accuracy"] = c.needle_acc;
      d["needle_disagreements_vs_bf16"] = c.needle_disagree;
      d["layers"] = layers;
      d["seconds"] = c.seconds;
      rows.append(d);
    }
    py::dict out;
    out["model"] = r.model_dir;
    out["architecture"] = r.architecture;
    out["windows"] = r.windows;
    out["predictions"] = r.predictions;
    out["bf16_ppl"] = r.bf16_ppl;
    out["bf16_needle_accuracy"] = r.bf16_needle;
    out["needle_samples"] = r.needle_samples;
    out["baseline_model"] = r.baseline_model;
    out["blas_kernels"] = r.blas_kernels;
    out["rows"] = rows;
    return out;
  }, py::arg("model"), py::arg("caches"), py::arg("text"), py::arg("ctx") = 2048, py::arg("windows") = 8,
     py::arg("needle_samples") = 0, py::arg("needle_lengths") = std::vector<int>{}, py::arg("seed") = 20261129ull,
     py::arg("diagnostics") = true, py::arg("diag_queries") = 64, py::arg("calib_tokens") = 16384, py::arg("calib_text") = "",
     py::arg("baseline_model") = "", py::arg("sinks") = 0, py::arg("window") = 0, py::arg("boundary_layers") = 0,
     py::arg("progress") = py::none(),
     "kvq eval on one model directory: perplexity, delta-ppl, KL and top-1 against the bf16 cache, needle retrieval "
     "(needle_samples per length; needle words from calib_text) and per-layer attention diagnostics for each cache "
     "('FORMAT' or 'FORMAT@paper' / '@s4,w128,n1'; sinks / window / boundary_layers are the default policy). "
     "calib_text: the calibration text of calibrated formats (never the evaluation text). Returns the fields of "
     "`kvq eval --json`; progress(stage, fraction) is called as it goes.");
  m.def("blas_kernels", [] { return std::string(kvq::blas_kernels()); },
        "The OpenBLAS kernel set (chosen per CPU) that the model's matrix products use; its rounding moves perplexity's "
        "last digits between machines, so kvq.evaluate and `kvq eval` report it.");

  // kvq calibrate as a library call (kvq/calibrate.hpp): QuantMLA or a baseline, fused into a new
  // model directory.
  m.def("calibrate_mla", [](const std::string& model_dir, const std::string& out_dir, const std::string& text,
                            const std::string& method, const std::string& cache, const std::string& paths, int steps,
                            int train_seqs, int heldout_seqs, int seq_len, int rope_seq_len, int batch, int eval_every,
                            int check_seqs, std::uint64_t seed, double lr_rotation, double lr_scale, double lr_angle,
                            const std::string& dtype, const py::object& log, bool overwrite) {
    kvq::CalibOptions o;
    o.overwrite = overwrite;
    o.model_dir = model_dir;
    o.text_file = text;
    o.out_dir = out_dir;
    o.method = kvq::parse_calib_method(method);
    o.cache = cache;
    if (paths != "both" && paths != "content" && paths != "rope") bad_arg("paths must be 'both', 'content' or 'rope'");
    o.content_path = paths != "rope";
    o.rope_path = paths != "content";
    if (steps < 0 || train_seqs < 1 || heldout_seqs < 1 || seq_len < 2 || rope_seq_len < 0 || batch < 1 || eval_every < 1 ||
        check_seqs < 1)
      bad_arg("steps >= 0; train_seqs, heldout_seqs, batch, eval_every, check_seqs >= 1; seq_len >= 2; rope_seq_len >= 0");
    o.steps = steps;
    o.train_seqs = train_seqs;
    o.heldout_seqs = heldout_seqs;
    o.seq_len = seq_len;
    o.rope_seq_len = rope_seq_len;
    o.batch = batch;
    o.eval_every = eval_every;
    o.check_seqs = check_seqs;
    o.seed = seed;
    o.lr_rotation = lr_rotation;
    o.lr_scale = lr_scale;
    o.lr_angle = lr_angle;
    if (dtype == "f32") o.dtype = kvq::FuseDtype::kF32;
    else if (dtype != "source") bad_arg("dtype must be 'source' or 'f32'");
    if (!log.is_none()) o.log = [log](const std::string& line) { call_back(log, line); };
    kvq::CalibResult r;
    {
      py::gil_scoped_release nogil;
      r = kvq::calibrate(o);
    }
    auto path = [](const kvq::PathResult& p) {
      py::dict d;
      d["rtn"] = p.rtn;
      d["init"] = p.init;
      d["best"] = p.best;
      d["alpha"] = p.alpha;
      d["best_step"] = p.best_step;
      return d;
    };
    py::list layers;
    for (const auto& l : r.layers) {
      py::dict d;
      d["content"] = path(l.content);
      d["rope"] = path(l.rope);
      d["rope_output_rtn"] = l.rope_output_rtn;
      d["rope_output_best"] = l.rope_output_best;
      layers.append(d);
    }
    py::dict out;
    out["layers"] = layers;
    out["fusion_max_rel_err"] = r.fusion_max_rel_err;
    out["nll_original"] = r.nll_original;
    out["nll_fused_f32"] = r.nll_fused_f32;
    out["nll_saved"] = r.nll_saved;
    out["checksum"] = r.checksum;
    out["seconds"] = r.seconds;
    out["json"] = r.json;
    return out;
  }, py::arg("model"), py::arg("out"), py::arg("text"), py::arg("method") = "quantmla", py::arg("cache") = "c4r4",
     py::arg("paths") = "both", py::arg("steps") = 300, py::arg("train_seqs") = 128, py::arg("heldout_seqs") = 32,
     py::arg("seq_len") = 256, py::arg("rope_seq_len") = 0, py::arg("batch") = 4, py::arg("eval_every") = 25,
     py::arg("check_seqs") = 4, py::arg("seed") = 0ull, py::arg("lr_rotation") = 2e-3, py::arg("lr_scale") = 1e-2,
     py::arg("lr_angle") = 1e-2, py::arg("dtype") = "source", py::arg("log") = py::none(), py::arg("overwrite") = false,
     "kvq calibrate: QuantMLA ('quantmla') or a baseline ('smoothquant', 'quarot') calibration of an MLA model's cXrY "
     "cache on `text` (calibration text, never the evaluation text), fused into a new Hugging Face model directory "
     "`out`, which must be absent or empty, or with overwrite=True an earlier output of calibrate_mla (written beside "
     "it, then renamed). Returns the per-layer held-out objectives (RTN, initial, best), the "
     "fusion check (quantization off) and the kvq_calibration.json written; log(line) receives progress lines.");

  // kvq analyze as a library call (kvq/analysis.hpp); the result is the JSON report, parsed.
  m.def("analyze", [](const std::string& kind, const std::string& model_dir, const std::vector<std::string>& texts,
                      const std::vector<std::uint64_t>& seeds, const std::string& cache, int seqs, int seq_len, double nmse,
                      int probes, int permutations, const py::object& log) {
    const bool jac = kind == "jacobian";
    if (!jac && kind != "response") bad_arg("kind must be 'response' or 'jacobian'");
    if (texts.empty() || seeds.empty()) bad_arg("texts and seeds: at least one each");
    if (seqs < 0 || seq_len < 0 || nmse < 0 || probes < 1 || permutations < 1)
      bad_arg("seqs, seq_len, nmse >= 0 (0: the defaults), probes and permutations >= 1");
    kvq::AnalysisOptions o;
    o.model_dir = model_dir;
    o.texts = texts;
    o.seeds = seeds;
    o.cache = cache;
    // The CLI's defaults (docs/analysis.md): response 8 x 512 tokens at NMSE 1e-2; Jacobian 1 x 256 at 1e-3.
    o.seqs = seqs > 0 ? seqs : (jac ? 1 : 8);
    o.seq_len = seq_len > 0 ? seq_len : (jac ? 256 : 512);
    o.nmse = nmse > 0 ? nmse : (jac ? 1e-3 : 1e-2);
    o.probes = probes;
    o.permutations = permutations;
    if (!log.is_none()) o.log = [log](const std::string& line) { call_back(log, line); };
    std::string json;
    {
      py::gil_scoped_release nogil;
      json = jac ? kvq::analyze_jacobian(o).json : kvq::analyze_response(o).json;
    }
    return py::module_::import("json").attr("loads")(json);
  }, py::arg("kind"), py::arg("model"), py::arg("texts"), py::arg("seeds") = std::vector<std::uint64_t>{0, 1, 2},
     py::arg("cache") = "c4r4", py::arg("seqs") = 0, py::arg("seq_len") = 0, py::arg("nmse") = 0.0, py::arg("probes") = 256,
     py::arg("permutations") = 16, py::arg("log") = py::none(),
     "kvq analyze response | jacobian on an MLA model (docs/analysis.md): the sensitivity of the content-latent and RoPE-key "
     "cache paths, one cell per (text, seed); returns the JSON report as a dict.");
}
#endif

#if KVQ_PY_CUDA
// ---- CUDA kernels on torch tensors ----------------------------------------------------------
// Tensors are taken duck-typed (data_ptr(), dtype, shape, is_cuda, is_contiguous(): torch's), so
// the module does not link torch. The launchers are the C++ ones (src/cuda/kvq_cuda.hpp).

void check_cuda(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) fail(what + ": " + cudaGetErrorString(e));
}

struct TensorArg {
  std::uintptr_t ptr = 0;
  std::vector<std::int64_t> shape;
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    return n;
  }
};
TensorArg tensor_arg(const py::object& t, const std::string& name, const char* dtype) {
  if (!py::hasattr(t, "data_ptr") || !py::hasattr(t, "is_cuda")) bad_arg(name + ": expected a torch tensor");
  if (!t.attr("is_cuda").cast<bool>()) bad_arg(name + ": must be a CUDA tensor");
  if (!t.attr("is_contiguous")().cast<bool>()) bad_arg(name + ": must be contiguous");
  const std::string dt = py::str(t.attr("dtype"));
  if (dt != std::string("torch.") + dtype) bad_arg(name + ": expected dtype torch." + dtype + ", got " + dt);
  TensorArg a;
  a.shape = t.attr("shape").cast<std::vector<std::int64_t>>();
  a.ptr = t.attr("data_ptr")().cast<std::uintptr_t>();
  return a;
}
template <class T>
std::vector<T> to_host(const TensorArg& a, cudaStream_t s) {
  std::vector<T> h(static_cast<std::size_t>(a.numel()));
  if (!h.empty()) {
    check_cuda(cudaMemcpyAsync(h.data(), reinterpret_cast<const void*>(a.ptr), h.size() * sizeof(T), cudaMemcpyDeviceToHost, s),
               "copying an index tensor to the host");
    check_cuda(cudaStreamSynchronize(s), "copying an index tensor to the host");
  }
  return h;
}

// Index checks of validate=True (host copies of the index tensors): a slot, page id or length
// outside the pool is a ValueError here instead of an out-of-bounds access in a kernel.
void check_slots(const TensorArg& sm, std::int64_t cap, cudaStream_t s) {
  const std::vector<std::int64_t> h = to_host<std::int64_t>(sm, s);
  for (std::size_t i = 0; i < h.size(); ++i)
    if (h[i] >= cap)
      bad_arg("slot_mapping[" + std::to_string(i) + "] = " + std::to_string(h[i]) + " is beyond the pool's " + std::to_string(cap) +
              " slots");
}
// Returns the longest sequence.
int check_block_tables(const TensorArg& bt, const TensorArg& sl, std::int64_t pages, int page_tokens, cudaStream_t s) {
  const std::int64_t batch = bt.shape[0], max_pages = bt.shape[1];
  const std::vector<std::int32_t> lens = to_host<std::int32_t>(sl, s), tab = to_host<std::int32_t>(bt, s);
  int longest = 0;
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int32_t len = lens[static_cast<std::size_t>(b)];
    if (len < 0 || static_cast<std::int64_t>(len) > max_pages * page_tokens)
      bad_arg("seq_lens[" + std::to_string(b) + "] = " + std::to_string(len) + " outside 0.." + std::to_string(max_pages * page_tokens) +
              " (max_pages x page tokens)");
    const std::int64_t used = (len + page_tokens - 1) / page_tokens;
    for (std::int64_t j = 0; j < used; ++j) {
      const std::int32_t id = tab[static_cast<std::size_t>(b * max_pages + j)];
      if (id < 0 || id >= pages)
        bad_arg("block_tables[" + std::to_string(b) + ", " + std::to_string(j) + "] = " + std::to_string(id) +
                " is not a page of the pool (" + std::to_string(pages) + " pages)");
    }
    longest = std::max(longest, static_cast<int>(len));
  }
  return longest;
}

// The protected bf16 rows of a layer (attention sinks and the recent window, kvq/cuda_protect.hpp):
// the policy, the shape of the rows buffer, and the checks of the arguments that use it.
struct Protection {
  int sinks = 0, window = 0;
  std::int64_t per_seq = 0;  // bf16 elements per sequence row of the buffer
  std::string shape;         // the buffer's shape, for messages
  bool enabled() const { return sinks + window > 0; }
  std::int32_t slot(std::int64_t pos) const { return kvq::ProtectLayout{sinks, window, 1, 1}.slot(pos); }
  // Sequences the rows buffer holds (its first dimension).
  std::int64_t seqs(const TensorArg& r) const {
    if (r.shape.empty() || r.shape[0] <= 0 || r.numel() != r.shape[0] * per_seq)
      bad_arg("protect_rows: bfloat16 " + shape + " (seqs rows of " + std::to_string(per_seq) + " elements)");
    if (r.ptr % 16 != 0) bad_arg("protect_rows: must be 16-byte aligned");
    return r.shape[0];
  }
  void refuse_args(bool any) const {
    if (any) bad_arg("protect_rows / positions / seq_ids: this layer keeps no protected rows (construct it with sinks or window)");
  }
};
struct StoreProtect {
  const std::int32_t* positions = nullptr;
  const std::int32_t* seq_ids = nullptr;
  std::uint16_t* rows = nullptr;
  const std::int32_t* seq_lens = nullptr;
};
// A store call's protection arguments: positions and seq_ids (int32 (n,)), the rows buffer, and
// optionally the sequences' lengths after the call (int32 (seqs,)); without them no two positions
// of one sequence in the call may share a slot (validate checks it).
StoreProtect store_protect(const Protection& pr, std::int64_t n, const py::object& positions, const py::object& seq_ids,
                           const py::object& rows, const py::object& seq_lens, bool validate, cudaStream_t s) {
  if (!pr.enabled()) {
    pr.refuse_args(!positions.is_none() || !seq_ids.is_none() || !rows.is_none() || !seq_lens.is_none());
    return {};
  }
  if (positions.is_none() || seq_ids.is_none() || rows.is_none())
    bad_arg("store: a layer with protected rows needs positions, seq_ids and protect_rows");
  const TensorArg pos = tensor_arg(positions, "positions", "int32"), ids = tensor_arg(seq_ids, "seq_ids", "int32");
  if (pos.shape != std::vector<std::int64_t>{n}) bad_arg("positions: int32 (n,), one per token");
  if (ids.shape != std::vector<std::int64_t>{n}) bad_arg("seq_ids: int32 (n,), one per token (the row of protect_rows)");
  const TensorArg r = tensor_arg(rows, "protect_rows", "bfloat16");
  const std::int64_t seqs = pr.seqs(r);
  TensorArg lens;
  if (!seq_lens.is_none()) {
    lens = tensor_arg(seq_lens, "seq_lens", "int32");
    if (lens.shape != std::vector<std::int64_t>{seqs}) bad_arg("seq_lens: int32 (seqs,), the lengths after this call");
  }
  if (validate) {
    const std::vector<std::int32_t> hp = to_host<std::int32_t>(pos, s), hi = to_host<std::int32_t>(ids, s);
    const std::vector<std::int32_t> hl = seq_lens.is_none() ? std::vector<std::int32_t>{} : to_host<std::int32_t>(lens, s);
    std::vector<std::pair<std::int64_t, std::int32_t>> used;  // (seq x slots + slot, position)
    for (std::size_t i = 0; i < hp.size(); ++i) {
      const std::string at = "[" + std::to_string(i) + "]";
      if (hp[i] < 0) bad_arg("positions" + at + " = " + std::to_string(hp[i]) + " is negative");
      if (hi[i] < 0 || hi[i] >= seqs)
        bad_arg("seq_ids" + at + " = " + std::to_string(hi[i]) + " is not a row of protect_rows (" + std::to_string(seqs) + ")");
      if (!hl.empty() && hp[i] >= hl[static_cast<std::size_t>(hi[i])])
        bad_arg("positions" + at + " = " + std::to_string(hp[i]) + " is not below seq_lens[" + std::to_string(hi[i]) + "] = " +
                std::to_string(hl[static_cast<std::size_t>(hi[i])]));
      const std::int32_t sl = pr.slot(hp[i]);
      if (hl.empty() && sl >= 0) used.emplace_back(static_cast<std::int64_t>(hi[i]) * (pr.sinks + pr.window) + sl, hp[i]);
    }
    std::sort(used.begin(), used.end());
    for (std::size_t i = 1; i < used.size(); ++i)
      if (used[i].first == used[i - 1].first && used[i].second != used[i - 1].second)
        bad_arg("positions " + std::to_string(used[i - 1].second) + " and " + std::to_string(used[i].second) +
                " of one sequence share a protection slot: pass seq_lens (the lengths after this call) so that only the "
                "last window positions are kept");
  }
  StoreProtect p;
  p.positions = reinterpret_cast<const std::int32_t*>(pos.ptr);
  p.seq_ids = reinterpret_cast<const std::int32_t*>(ids.ptr);
  p.rows = reinterpret_cast<std::uint16_t*>(r.ptr);
  if (!seq_lens.is_none()) p.seq_lens = reinterpret_cast<const std::int32_t*>(lens.ptr);
  return p;
}
// A decode call's rows buffer: one row per batch entry at least.
const std::uint16_t* decode_protect(const Protection& pr, std::int64_t batch, const py::object& rows) {
  if (!pr.enabled()) {
    pr.refuse_args(!rows.is_none());
    return nullptr;
  }
  if (rows.is_none()) bad_arg("decode: a layer with protected rows needs protect_rows");
  const TensorArg r = tensor_arg(rows, "protect_rows", "bfloat16");
  if (pr.seqs(r) < batch) bad_arg("protect_rows: fewer rows than the batch (row b serves sequence b of block_tables)");
  return reinterpret_cast<const std::uint16_t*>(r.ptr);
}

// The index tensors of a decode call and the pool they point into (for validate=True).
struct DecodeIndex {
  TensorArg bt, sl;
  std::int64_t pages = 0;
  int page_tokens = 0;
};

// What the GQA and MLA layers share: the device they were built on, the decode workspace (grown on
// demand; one launch at a time), the store's refusal counter and the protection policy.
struct LayerBase {
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  std::uint32_t* rejected = nullptr;
  int device = -1;
  Protection prot;

  LayerBase(int sinks, int window) {
    if (sinks < 0 || window < 0) bad_arg("sinks and window must be >= 0");
    prot.sinks = sinks;
    prot.window = window;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    check_cuda(cudaMalloc(&rejected, sizeof(std::uint32_t)), "cudaMalloc");
  }
  ~LayerBase() {
    cudaFree(workspace);
    cudaFree(rejected);
  }
  LayerBase(const LayerBase&) = delete;
  LayerBase& operator=(const LayerBase&) = delete;
  void on_device() const {
    int d = -1;
    check_cuda(cudaGetDevice(&d), "cudaGetDevice");
    if (d != device) bad_arg("this Layer's tables live on device " + std::to_string(device) + ", the current device is " + std::to_string(d));
  }
  static std::int64_t pool_pages(const TensorArg& pool, std::uint64_t page_bytes) {
    if (pool.shape.size() != 1) bad_arg("pool: a 1-D uint8 tensor of n_pages * page_bytes bytes");
    if (pool.numel() % static_cast<std::int64_t>(page_bytes) != 0)
      bad_arg("pool: " + std::to_string(pool.numel()) + " bytes is not a whole number of " + std::to_string(page_bytes) + "-byte pages");
    if (pool.ptr % 16 != 0) bad_arg("pool: must be 16-byte aligned");
    return pool.numel() / static_cast<std::int64_t>(page_bytes);
  }
  // Runs a store launcher with the refusal counter and returns the count (synchronizes the stream).
  // Runs a store launcher. Without `counter`: with the layer's refusal counter, returning the count
  // (synchronizes the stream). With an int32 (1,) CUDA tensor: the kernel adds the refused records to
  // it and the call returns None at once (no synchronization: decode loops, CUDA graph capture).
  template <class Launch>
  py::object counted_store(cudaStream_t s, const py::object& counter, Launch&& launch) {
    if (!counter.is_none()) {
      const TensorArg c = tensor_arg(counter, "counter", "int32");
      if (c.shape != std::vector<std::int64_t>{1}) bad_arg("counter: an int32 CUDA tensor of shape (1,)");
      {
        py::gil_scoped_release nogil;
        check_cuda(launch(reinterpret_cast<std::uint32_t*>(c.ptr)), "kvq.cuda store");
      }
      return py::none();
    }
    std::uint32_t count = 0;
    {
      py::gil_scoped_release nogil;
      check_cuda(cudaMemsetAsync(rejected, 0, sizeof(std::uint32_t), s), "kvq.cuda store");
      check_cuda(launch(rejected), "kvq.cuda store");
      check_cuda(cudaMemcpyAsync(&count, rejected, sizeof(count), cudaMemcpyDeviceToHost, s), "kvq.cuda store");
      check_cuda(cudaStreamSynchronize(s), "kvq.cuda store");
    }
    return py::int_(count);
  }
  // A workspace of at least `need` bytes (call without the GIL).
  void ensure_workspace(std::size_t need, cudaStream_t s) {
    if (need <= workspace_bytes) return;
    check_cuda(cudaStreamSynchronize(s), "kvq.cuda decode");  // the old workspace may still be in use
    cudaFree(workspace);
    workspace = nullptr;
    workspace_bytes = 0;
    check_cuda(cudaMalloc(&workspace, need), "kvq.cuda decode workspace");
    check_cuda(cudaMemsetAsync(workspace, 0, need, s), "kvq.cuda decode workspace");
    workspace_bytes = need;
  }
  // The shape checks of a decode call; `ix` keeps what the index checks need.
  static void decode_shapes(const TensorArg& bt, const TensorArg& sl, float scale, int num_splits) {
    if (bt.shape.size() != 2) bad_arg("block_tables: int32 (batch, max_pages)");
    if (sl.shape != std::vector<std::int64_t>{bt.shape[0]}) bad_arg("seq_lens: int32 (batch,)");
    if (!std::isfinite(scale)) bad_arg("scale must be finite");
    if (num_splits < 0) bad_arg("num_splits must be >= 0 (0: chosen by the launcher)");
  }
  // max_seq_len of a launch: checked against (validate) or read from seq_lens.
  static int resolve_max_seq_len(const DecodeIndex& ix, int max_seq_len, bool validate, cudaStream_t s) {
    if (validate) {
      const int longest = check_block_tables(ix.bt, ix.sl, ix.pages, ix.page_tokens, s);
      if (max_seq_len <= 0) max_seq_len = longest;
      if (max_seq_len < longest) bad_arg("max_seq_len is below the longest sequence");
    }
    if (max_seq_len <= 0) bad_arg("max_seq_len: the longest seq_lens entry (or validate=True to read it)");
    return max_seq_len;
  }
  // The tensors of a decode call (shapes checked but q's and out's, which depend on the family) and
  // the parameters GQA and MLA decode share (P: kvq::cuda::DecodeParams or MlaDecodeParams).
  template <class P>
  void decode_inputs(P& p, const py::object& pool_t, const py::object& tables_t, const py::object& lens_t, const py::object& q_t,
                     const py::object& out_t, float scale, int num_splits, const kvq::PageLayout& page, DecodeIndex& ix,
                     TensorArg& q, TensorArg& out) const {
    on_device();
    const TensorArg pool = tensor_arg(pool_t, "pool", "uint8");
    ix.pages = pool_pages(pool, page.page_bytes);
    ix.page_tokens = page.tokens;
    ix.bt = tensor_arg(tables_t, "block_tables", "int32");
    ix.sl = tensor_arg(lens_t, "seq_lens", "int32");
    q = tensor_arg(q_t, "q", "float32");
    out = tensor_arg(out_t, "out", "float32");
    decode_shapes(ix.bt, ix.sl, scale, num_splits);
    p.pool = reinterpret_cast<const std::uint8_t*>(pool.ptr);
    p.block_tables = reinterpret_cast<const std::int32_t*>(ix.bt.ptr);
    p.max_pages = static_cast<std::int32_t>(ix.bt.shape[1]);
    p.seq_lens = reinterpret_cast<const std::int32_t*>(ix.sl.ptr);
    p.batch = static_cast<std::int32_t>(ix.bt.shape[0]);
    p.q = reinterpret_cast<const float*>(q.ptr);
    p.out = reinterpret_cast<float*>(out.ptr);
    p.scale = scale;
    p.num_splits = num_splits;
  }
  // One decode launch with a workspace of the size `bytes(p)` asks for.
  template <class P, class Bytes, class Launch>
  void launch_with_workspace(P p, int max_seq_len, cudaStream_t s, Bytes bytes, Launch launch, const char* what) {
    p.max_seq_len = max_seq_len;
    py::gil_scoped_release nogil;
    ensure_workspace(bytes(p), s);
    p.workspace = workspace;
    p.workspace_bytes = workspace_bytes;
    check_cuda(launch(p, s), what);
  }
  // The slot mapping, pool and protection arguments of a store call, into the parameters both
  // families share (P: kvq::cuda::StoreParams or MlaStoreParams, L: its protection layout); returns n.
  template <class P, class L>
  std::int64_t store_inputs(P& p, const py::object& slots, const py::object& pool_t, const kvq::PageLayout& page, L layout,
                            bool validate, cudaStream_t s, const py::object& positions, const py::object& seq_ids,
                            const py::object& protect_rows, const py::object& seq_lens) const {
    on_device();
    const TensorArg sm = tensor_arg(slots, "slot_mapping", "int64");
    if (sm.shape.size() != 1) bad_arg("slot_mapping: a 1-D int64 tensor, one slot per token (< 0 skips it)");
    const std::int64_t n = sm.shape[0];
    if (n > INT32_MAX) bad_arg("slot_mapping: too many tokens for one call");
    const TensorArg pool = tensor_arg(pool_t, "pool", "uint8");
    const std::int64_t pages = pool_pages(pool, page.page_bytes);
    const StoreProtect sp = store_protect(prot, n, positions, seq_ids, protect_rows, seq_lens, validate, s);
    if (validate) check_slots(sm, pages * page.tokens, s);
    p.slot_mapping = reinterpret_cast<const std::int64_t*>(sm.ptr);
    p.n_tokens = static_cast<std::int32_t>(n);
    p.pool = reinterpret_cast<std::uint8_t*>(pool.ptr);
    if (sp.rows) {
      p.protect = layout;
      p.protect_rows = sp.rows;
      p.positions = sp.positions;
      p.seq_ids = sp.seq_ids;
      p.protect_seq_lens = sp.seq_lens;
    }
    return n;
  }
};

// One layer of a GQA cache on the GPU: the format's device tables (kvq::cuda::LayerTables).
struct CudaLayer : LayerBase {
  std::unique_ptr<kvq::cuda::LayerTables> tables;
  kvq::CacheGeometry geo;
  std::shared_ptr<const kvq::FormatCalibration> calib;

  CudaLayer(const py::object& fmt, const kvq::CacheGeometry& g, int layer, const py::object& calibration, int sinks, int window)
      : LayerBase(sinks, window), geo(g) {
    const kvq::FormatSpec& f = spec_of(fmt);
    if (g.mla) bad_arg("kvq.cuda.Layer: a GQA geometry (kvq.cuda.MlaLayer runs the MLA caches)");
    kvq::check_format_fits(f, g);
    if (layer < 0 || layer >= g.n_layers) bad_arg("layer " + std::to_string(layer) + " outside 0.." + std::to_string(g.n_layers - 1));
    calib = calibration_of(calibration);
    tables = std::make_unique<kvq::cuda::LayerTables>(f, g, layer, calib.get());
    prot.per_seq = static_cast<std::int64_t>(g.n_kv_heads) * (sinks + window) * 2 * g.head_dim;
    prot.shape = "(seqs, n_kv_heads, sinks + window, 2, head_dim)";
  }
  const kvq::cuda::FormatDesc& desc() const { return tables->desc(); }
  const kvq::PageLayout& page() const { return desc().page; }
  kvq::ProtectLayout protect_layout() const { return kvq::ProtectLayout{prot.sinks, prot.window, geo.n_kv_heads, geo.head_dim}; }
  std::size_t row_elems() const { return static_cast<std::size_t>(geo.n_kv_heads) * static_cast<std::size_t>(geo.head_dim); }
  void check_rows(const TensorArg& a, const char* name, std::int64_t n) const {
    if (a.shape.empty() || a.shape[0] != n || a.numel() != n * static_cast<std::int64_t>(row_elems()))
      bad_arg(std::string(name) + ": expected bf16 (n, n_kv_heads, head_dim) or (n, n_kv_heads * head_dim) with n = " +
              std::to_string(n) + " and n_kv_heads * head_dim = " + std::to_string(row_elems()));
  }

  // Returns the number of (token, head) records refused (non-finite rows, norms beyond fp16).
  py::object store(const py::object& key, const py::object& value, const py::object& slots, const py::object& pool_t,
                   std::uintptr_t stream_handle, bool validate, const py::object& positions, const py::object& seq_ids,
                   const py::object& protect_rows, const py::object& seq_lens, const py::object& counter) {
    auto s = reinterpret_cast<cudaStream_t>(stream_handle);
    kvq::cuda::StoreParams p;
    p.fmt = desc();
    const std::int64_t n =
        store_inputs(p, slots, pool_t, page(), protect_layout(), validate, s, positions, seq_ids, protect_rows, seq_lens);
    const TensorArg k = tensor_arg(key, "key", "bfloat16"), v = tensor_arg(value, "value", "bfloat16");
    check_rows(k, "key", n);
    check_rows(v, "value", n);
    p.key = reinterpret_cast<const std::uint16_t*>(k.ptr);
    p.value = reinterpret_cast<const std::uint16_t*>(v.ptr);
    return counted_store(s, counter, [&](std::uint32_t* rej) {
      p.rejected = rej;
      return kvq::cuda::store(p, s);
    });
  }

  // Checks a decode call's tensors and builds its parameters (all but max_seq_len).
  kvq::cuda::DecodeParams prepare_decode(const py::object& pool_t, const py::object& tables_t, const py::object& lens_t,
                                         const py::object& q_t, const py::object& out_t, float scale, int num_splits,
                                         const py::object& protect_rows, DecodeIndex& ix) const {
    if (!kvq::cuda::decode_supported(desc())) bad_arg("kvq.cuda decode: no kernel for this format and head_dim");
    kvq::cuda::DecodeParams p;
    p.fmt = desc();
    TensorArg q, out;
    decode_inputs(p, pool_t, tables_t, lens_t, q_t, out_t, scale, num_splits, page(), ix, q, out);
    if (q.shape.size() != 3 || q.shape[0] != p.batch || q.shape[2] != geo.head_dim || q.shape[1] % geo.n_kv_heads != 0)
      bad_arg("q: float32 (batch, q_heads, head_dim) with q_heads a multiple of n_kv_heads = " + std::to_string(geo.n_kv_heads));
    if (out.shape != q.shape) bad_arg("out: float32 of q's shape");
    p.q_heads = static_cast<std::int32_t>(q.shape[1]);
    if ((p.protect_rows = decode_protect(prot, p.batch, protect_rows)) != nullptr) p.protect = protect_layout();
    return p;
  }
  // decode(programmatic=True): every GQA decode kernel waits for the kernel before it ahead of its first read of the
  // query, pages, protected rows or workspace.
  static void set_programmatic(kvq::cuda::DecodeParams& p, bool on) { p.programmatic = on; }
  void launch_decode(const kvq::cuda::DecodeParams& p, int max_seq_len, cudaStream_t s) {
    launch_with_workspace(p, max_seq_len, s, [](const kvq::cuda::DecodeParams& d) { return kvq::cuda::decode_workspace_bytes(d); },
                          [](const kvq::cuda::DecodeParams& d, cudaStream_t st) { return kvq::cuda::decode(d, st); }, "kvq.cuda decode");
  }
};

// One layer of an MLA cache on the GPU (kvq_cuda_mla.hpp): bf16, the QuantMLA affine formats
// (c8r8, c4r8, c4r4, c3r4, c2r4) and mla-tq4 / mla-tq3, absorbed decode in latent space.
struct CudaMlaLayer : LayerBase {
  kvq::cuda::MlaFormat fmt;
  kvq::CacheGeometry geo;
  kvq::cuda::MlaKernel kernel = kvq::cuda::MlaKernel::kAuto;  // which decode kernel where the warpgroup one applies

  CudaMlaLayer(const py::object& format, const kvq::CacheGeometry& g, int layer, int sinks, int window, const std::string& kern)
      : LayerBase(sinks, window), geo(g) {
    if (kern == "fragment") kernel = kvq::cuda::MlaKernel::kFragment;
    else if (kern == "wgmma") kernel = kvq::cuda::MlaKernel::kWarpgroup;
    else if (kern != "auto") bad_arg("kernel must be 'auto', 'fragment' or 'wgmma'");
    const kvq::FormatSpec& f = spec_of(format);
    if (!g.mla) bad_arg("kvq.cuda.MlaLayer: an MLA geometry (d_latent, d_rope)");
    kvq::check_format_fits(f, g);
    if (layer < 0 || layer >= g.n_layers) bad_arg("layer " + std::to_string(layer) + " outside 0.." + std::to_string(g.n_layers - 1));
    fmt = kvq::cuda::mla_format(f, g.d_latent, g.d_rope, layer);
    if (!kvq::cuda::mla_supported(fmt))
      bad_arg("kvq.cuda.MlaLayer: no kernel for " + f.name + " at d_latent " + std::to_string(g.d_latent) + ", d_rope " +
              std::to_string(g.d_rope) + " (d_latent 512 / d_rope 64, or multiples of 64 up to 1024 / 256)");
    prot.per_seq = static_cast<std::int64_t>(sinks + window) * (g.d_latent + g.d_rope);
    prot.shape = "(seqs, sinks + window, d_latent + d_rope)";
  }
  const kvq::PageLayout& page() const { return fmt.page; }
  kvq::MlaProtectLayout protect_layout() const { return kvq::MlaProtectLayout{prot.sinks, prot.window, geo.d_latent, geo.d_rope}; }
  void check_rows(const TensorArg& a, const char* name, std::int64_t n, int d) const {
    if (a.shape.size() != 2 || a.shape[0] != n || a.shape[1] != d)
      bad_arg(std::string(name) + ": expected bf16 (n, " + std::to_string(d) + ") with n = " + std::to_string(n));
  }

  py::object store(const py::object& latent, const py::object& rope, const py::object& slots, const py::object& pool_t,
                   std::uintptr_t stream_handle, bool validate, const py::object& positions, const py::object& seq_ids,
                   const py::object& protect_rows, const py::object& seq_lens, const py::object& counter) {
    auto s = reinterpret_cast<cudaStream_t>(stream_handle);
    kvq::cuda::MlaStoreParams p;
    p.fmt = fmt;
    const std::int64_t n =
        store_inputs(p, slots, pool_t, page(), protect_layout(), validate, s, positions, seq_ids, protect_rows, seq_lens);
    const TensorArg c = tensor_arg(latent, "latent", "bfloat16"), r = tensor_arg(rope, "rope", "bfloat16");
    check_rows(c, "latent", n, geo.d_latent);
    check_rows(r, "rope", n, geo.d_rope);
    p.latent = reinterpret_cast<const std::uint16_t*>(c.ptr);
    p.rope = reinterpret_cast<const std::uint16_t*>(r.ptr);
    return counted_store(s, counter, [&](std::uint32_t* rej) {
      p.rejected = rej;
      return kvq::cuda::mla_store(p, s);
    });
  }

  kvq::cuda::MlaDecodeParams prepare_decode(const py::object& pool_t, const py::object& tables_t, const py::object& lens_t,
                                            const py::object& q_t, const py::object& out_t, float scale, int num_splits,
                                            const py::object& protect_rows, DecodeIndex& ix) const {
    kvq::cuda::MlaDecodeParams p;
    p.fmt = fmt;
    TensorArg q, out;
    decode_inputs(p, pool_t, tables_t, lens_t, q_t, out_t, scale, num_splits, page(), ix, q, out);
    if (q.shape.size() != 3 || q.shape[0] != p.batch || q.shape[2] != geo.d_latent + geo.d_rope || q.shape[1] < 1 || q.shape[1] > 128)
      bad_arg("q: float32 (batch, heads, d_latent + d_rope) with 1..128 heads (absorbed: the latent part is q W_UK)");
    if (out.shape != std::vector<std::int64_t>{p.batch, q.shape[1], geo.d_latent}) bad_arg("out: float32 (batch, heads, d_latent)");
    p.heads = static_cast<std::int32_t>(q.shape[1]);
    p.kernel = kernel;
    if ((p.protect_rows = decode_protect(prot, p.batch, protect_rows)) != nullptr) p.protect = protect_layout();
    return p;
  }
  // The MLA decode's first kernel copies pages before any wait, so it cannot be launched programmatically after a store.
  static void set_programmatic(kvq::cuda::MlaDecodeParams&, bool on) {
    if (on) bad_arg("programmatic=True: GQA layers only (the MLA decode reads its pages before it could wait)");
  }
  void launch_decode(const kvq::cuda::MlaDecodeParams& p, int max_seq_len, cudaStream_t s) {
    launch_with_workspace(p, max_seq_len, s,
                          [](const kvq::cuda::MlaDecodeParams& d) { return kvq::cuda::mla_decode_workspace_bytes(d); },
                          [](const kvq::cuda::MlaDecodeParams& d, cudaStream_t st) { return kvq::cuda::mla_decode(d, st); },
                          "kvq.cuda MLA decode");
  }
};

// Layer.decode: checks, then one launch.
template <class L>
void layer_decode(L& l, const py::object& pool, const py::object& tables, const py::object& lens, const py::object& q,
                  const py::object& out, float scale, int max_seq_len, int num_splits, std::uintptr_t stream, bool validate,
                  const py::object& protect_rows, bool programmatic) {
  DecodeIndex ix;
  auto p = l.prepare_decode(pool, tables, lens, q, out, scale, num_splits, protect_rows, ix);
  L::set_programmatic(p, programmatic);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  l.launch_decode(p, LayerBase::resolve_max_seq_len(ix, max_seq_len, validate, s), s);
}

// Layer.plan_decode: a decode call whose tensors are checked once and bound (kept alive by the plan),
// so that run() only launches; a decode loop over persistent buffers (block tables, lengths, query,
// output) skips reading the tensors' attributes through Python on every step.
template <class L, class P>
struct DecodePlan {
  py::object layer_ref;  // keeps the layer alive
  py::tuple tensors;     // keeps the bound tensors alive
  L* layer = nullptr;
  P params;
  DecodeIndex ix;
  void run(int max_seq_len, std::uintptr_t stream, bool validate) {
    layer->on_device();
    const auto s = reinterpret_cast<cudaStream_t>(stream);
    layer->launch_decode(params, LayerBase::resolve_max_seq_len(ix, max_seq_len, validate, s), s);
  }
};
template <class L, class P>
DecodePlan<L, P> plan_decode(const py::object& self, const py::object& pool, const py::object& tables, const py::object& lens,
                             const py::object& q, const py::object& out, float scale, int num_splits, const py::object& protect_rows,
                             bool programmatic) {
  DecodePlan<L, P> plan;
  plan.layer_ref = self;
  plan.layer = &self.cast<L&>();
  plan.params = plan.layer->prepare_decode(pool, tables, lens, q, out, scale, num_splits, protect_rows, plan.ix);
  L::set_programmatic(plan.params, programmatic);
  plan.tensors = py::make_tuple(pool, tables, lens, q, out, protect_rows);
  return plan;
}

// (byte offset in the page, length) of a record's code and metadata regions.
py::dict record_offsets(const kvq::PageLayout& pg, int head, int tok, int heads) {
  if (head < 0 || head >= heads || tok < 0 || tok >= pg.tokens) bad_arg("head or token outside the page");
  py::dict d;
  d["key_code"] = py::make_tuple(pg.key_code(head, tok), pg.key_code_bytes);
  d["value_code"] = py::make_tuple(pg.value_code(head, tok), pg.value_code_bytes);
  d["key_meta"] = py::make_tuple(pg.key_meta(head, tok), pg.key_meta_bytes);
  d["value_meta"] = py::make_tuple(pg.value_meta(head, tok), pg.value_meta_bytes);
  return d;
}

// The members Layer and MlaLayer share (L: CudaLayer or CudaMlaLayer, P: its decode parameters):
// page geometry, protection policy, store, decode, decode plans and the plan's run().
template <class L, class P>
void def_layer_common(py::module_& c, py::class_<L>& cls, const char* row_a, const char* row_b, const char* store_doc,
                      const char* decode_doc, const char* plan_name, const char* plan_doc) {
  py::class_<DecodePlan<L, P>>(c, plan_name, plan_doc)
      .def("run", &DecodePlan<L, P>::run, py::arg("max_seq_len") = 0, py::arg("stream") = 0, py::arg("validate") = true,
           "Launches the planned decode on the bound tensors' current contents. max_seq_len: a bound of seq_lens (0 with "
           "validate=True: read from them); validate=True copies seq_lens and block_tables to the host and checks them "
           "(a sync), as decode() does.");
  const std::string store_help =
      std::string(store_doc) +
      " Protected layers (sinks / window) also take positions and seq_ids (int32 (n,): each token's position and its row "
      "of protect_rows), protect_rows (bf16, protect_rows_shape(seqs)) and optionally seq_lens (int32 (seqs,), the lengths "
      "after this call: only the sinks and the last window positions are kept). Returns the count of records refused "
      "(written nowhere: non-finite rows, values beyond fp16) and synchronizes the stream; with counter (an int32 (1,) "
      "CUDA tensor) adds that count to it on the device and returns None without synchronizing.";
  const std::string decode_help =
      std::string(decode_doc) +
      " programmatic=True (GQA only) launches the decode as a programmatic dependent launch: its CTAs may start while "
      "the kernel before it on the stream (a store, say) still runs, and wait for it before they read anything it may "
      "write (KVQ_NO_PDL=1 turns it off). It saves a few microseconds only with validate=False, which does not "
      "synchronize.";
  const std::string plan_help = std::string("decode() with these tensors bound: checked once here; ") + plan_name +
                                ".run(max_seq_len, stream, validate) launches over their contents at the time of the call "
                                "(host cost without validate: docs/python.md).";
  cls.def_property_readonly("page_bytes", [](const L& l) { return l.page().page_bytes; })
      .def_property_readonly("page_tokens", [](const L& l) { return l.page().tokens; })
      .def_property_readonly("sinks", [](const L& l) { return l.prot.sinks; })
      .def_property_readonly("window", [](const L& l) { return l.prot.window; })
      .def("store", &L::store, py::arg(row_a), py::arg(row_b), py::arg("slot_mapping"), py::arg("pool"), py::arg("stream") = 0,
           py::arg("validate") = true, py::kw_only(), py::arg("positions") = py::none(), py::arg("seq_ids") = py::none(),
           py::arg("protect_rows") = py::none(), py::arg("seq_lens") = py::none(), py::arg("counter") = py::none(),
           store_help.c_str())
      .def("decode", &layer_decode<L>, py::arg("pool"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("q"), py::arg("out"),
           py::arg("scale"), py::arg("max_seq_len") = 0, py::arg("num_splits") = 0, py::arg("stream") = 0,
           py::arg("validate") = true, py::kw_only(), py::arg("protect_rows") = py::none(), py::arg("programmatic") = false,
           decode_help.c_str())
      .def("plan_decode", &plan_decode<L, P>, py::arg("pool"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("q"),
           py::arg("out"), py::arg("scale"), py::arg("num_splits") = 0, py::kw_only(), py::arg("protect_rows") = py::none(),
           py::arg("programmatic") = false, plan_help.c_str());
}

void bind_cuda(py::module_& m) {
  py::module_ c = m.def_submodule("cuda", "kvq's CUDA kernels (sm_90a) on torch tensors: fused store and paged split-KV decode.");
  c.def("device_count", []() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
  py::class_<CudaLayer> gqa(c, "Layer", "One layer of a paged GQA cache on the current GPU (its format's device tables).");
  gqa.def(py::init<const py::object&, const kvq::CacheGeometry&, int, const py::object&, int, int>(), py::arg("format"),
          py::arg("geometry"), py::arg("layer") = 0, py::arg("calibration") = py::none(), py::arg("sinks") = 0, py::arg("window") = 0)
      .def_property_readonly("decode_supported", [](const CudaLayer& l) { return kvq::cuda::decode_supported(l.desc()); })
      .def("protect_rows_shape", [](const CudaLayer& l, int seqs) {
             return py::make_tuple(seqs, l.geo.n_kv_heads, l.prot.sinks + l.prot.window, 2, l.geo.head_dim);
           }, py::arg("seqs"), "Shape of the bf16 buffer of protected rows: [seq][kv_head][slot][key, value][head_dim].")
      .def("offsets", [](const CudaLayer& l, int head, int tok) { return record_offsets(l.page(), head, tok, l.geo.n_kv_heads); },
           py::arg("head"), py::arg("token"),
           "(byte offset in the page, length) of a record's key codes, value codes and metadata (docs/formats.md).");
  def_layer_common<CudaLayer, kvq::cuda::DecodeParams>(
      c, gqa, "key", "value", "Quantizes bf16 rows (n, n_kv_heads, head_dim) into their slots (int64, page * page_tokens + offset; "
                           "< 0 skips) of a uint8 pool.",
      "One query token per sequence: out (batch, q_heads, head_dim) float32 = softmax(scale q K^T) V over the "
      "first seq_lens[b] positions of sequence b's pages (block_tables int32 (batch, max_pages)); protected positions "
      "from row b of protect_rows.",
      "DecodePlan", "A GQA decode call with its tensors bound (Layer.plan_decode).");
  py::class_<CudaMlaLayer> mla(c, "MlaLayer",
                               "One layer of a paged MLA cache on the current GPU: bf16, c8r8, c4r8, c4r4, c3r4, c2r4, mla-tq4, mla-tq3.");
  mla.def(py::init<const py::object&, const kvq::CacheGeometry&, int, int, int, const std::string&>(), py::arg("format"),
          py::arg("geometry"), py::arg("layer") = 0, py::arg("sinks") = 0, py::arg("window") = 0, py::arg("kernel") = "auto")
      .def_property_readonly("kernel", [](const CudaMlaLayer& l) {
             return l.kernel == kvq::cuda::MlaKernel::kFragment ? "fragment" : l.kernel == kvq::cuda::MlaKernel::kWarpgroup ? "wgmma" : "auto";
           }, "The decode kernel where the warpgroup (wgmma) one applies (c4r4 / c4r8 / c2r4 at 512 / 64, no protection): "
              "'auto' (the launcher's choice), 'fragment' or 'wgmma'.")
      .def("protect_rows_shape", [](const CudaMlaLayer& l, int seqs) {
             return py::make_tuple(seqs, l.prot.sinks + l.prot.window, l.geo.d_latent + l.geo.d_rope);
           }, py::arg("seqs"), "Shape of the bf16 buffer of protected rows: [seq][slot][latent, RoPE key].")
      .def("offsets", [](const CudaMlaLayer& l, int tok) { return record_offsets(l.page(), 0, tok, 1); }, py::arg("token"),
           "(byte offset in the page, length) of a token's latent codes (key_code), RoPE-key codes (value_code) and "
           "their metadata (key_meta, value_meta).");
  def_layer_common<CudaMlaLayer, kvq::cuda::MlaDecodeParams>(
      c, mla, "latent", "rope", "Quantizes bf16 latent (n, d_latent) and RoPE-key (n, d_rope, after RoPE) rows into their slots "
                             "(int64, page * page_tokens + offset; < 0 skips) of a uint8 pool.",
      "Absorbed MLA decode, one query token per sequence: q float32 (batch, heads, d_latent + d_rope) (the latent part "
      "already times W_UK), out float32 (batch, heads, d_latent) = softmax(scale (q_c . c_j + q_r . r_j)) c_j over the "
      "first seq_lens[b] positions; protected positions from row b of protect_rows.",
      "MlaDecodePlan", "An MLA decode call with its tensors bound (MlaLayer.plan_decode).");
}
#endif
}  // namespace
