#include "launch/run_inputs.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <utility>

#include "core/dtype.h"
#include "core/error.h"
#include "core/npy.h"
#include "core/parallel_for.h"
#include "core/tensor.h"

namespace statescan::launch {
namespace {

// ---- synthetic values ------------------------------------------------------------

// SplitMix64: a bijective 64-bit mixer; feeding it (key + index) gives a
// counter-based generator, so element i of a tensor does not depend on how
// the sequence is split over ranks.
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1].
double unit_uniform(uint64_t bits) {
  return (static_cast<double>(bits >> 11) + 1.0) * 0x1p-53;
}

enum class Stream : uint64_t { q = 1, k, v, g, beta, d_o, lr0, lr1, lr2, w0, w1, w2 };

// N(0, 1) for elements 2m and 2m + 1 of tensor `stream`: Box-Muller's two
// outputs from the two draws of pair m (one log and one sqrt per pair; at 1M
// tokens the inputs are ~10^10 values, generated before the first step).
std::pair<double, double> normal_pair(uint64_t key, uint64_t m) {
  const double u1 = unit_uniform(splitmix64(key + 2 * m));
  const double u2 = unit_uniform(splitmix64(key + 2 * m + 1));
  const double r = std::sqrt(-2.0 * std::log(u1)), theta = 6.283185307179586 * u2;
  return {r * std::cos(theta), r * std::sin(theta)};
}

uint64_t stream_key(uint64_t seed, Stream stream) {
  return splitmix64(seed ^ splitmix64(static_cast<uint64_t>(stream)));
}

// N(0, 1) for element `index` of tensor `stream`.
double normal_at(uint64_t seed, Stream stream, uint64_t index) {
  const auto [c, s] = normal_pair(stream_key(seed, stream), index / 2);
  return index % 2 == 0 ? c : s;
}

// Elements [first, first + count) of tensor `stream` into out: the same
// values as normal_at, a pair at a time where both halves are wanted.
void normals(uint64_t seed, Stream stream, uint64_t first, int64_t count, double* out) {
  const uint64_t key = stream_key(seed, stream);
  int64_t j = 0;
  if (count > 0 && first % 2 == 1) out[j++] = normal_pair(key, first / 2).second;
  for (; j + 1 < count; j += 2) {
    const auto [c, s] = normal_pair(key, (first + static_cast<uint64_t>(j)) / 2);
    out[j] = c;
    out[j + 1] = s;
  }
  if (j < count) out[j] = normal_pair(key, (first + static_cast<uint64_t>(j)) / 2).first;
}

double log_sigmoid(double x) {
  return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x));
}

// ---- loaded files -------------------------------------------------------------------

struct Loaded {
  std::string path;
  NpyArray array;
};

Loaded load_float(const std::string& dir, const char* name) {
  Loaded l;
  l.path = (std::filesystem::path(dir) / name).string();
  l.array = read_npy(l.path);
  SS_CHECK_ARG(l.array.descr == "<f4" || l.array.descr == "<f8", l.path, l.path,
               " must be float32 or float64, got dtype '", l.array.descr, "'");
  return l;
}

void expect_shape(const Loaded& l, const Shape& expected, const char* meaning) {
  SS_CHECK_ARG(l.array.shape == expected, l.path, l.path, " has shape ",
               shape_string(l.array.shape), " but ", meaning, " needs ", shape_string(expected));
}

std::vector<float> to_float(const NpyArray& a, DType round_as) {
  std::vector<float> out(a.data.size());
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = round_to(round_as, static_cast<float>(a.data[i]));
  return out;
}

// What a loaded array's values must be.
enum class ValueRule {
  finite,
  log_gates,  // also <= 0 (alpha = exp(g) must be in (0, 1])
  rates,      // also > 0 (LaCT's learning rates)
};

// A loaded array's values as the run uses them (to_float), each checked by
// `rule`: rounding to the dtype can overflow a float64 file's value to Inf,
// and the error names the file and the element's index in it, where the
// library's check sees only one rank's shard of the tensor. `hint` ends the
// message.
std::vector<float> checked_values(const Loaded& l, DType round_as, ValueRule rule,
                                  const char* hint = "") {
  std::vector<float> x = to_float(l.array, round_as);
  const auto n = static_cast<int64_t>(x.size());
  int64_t i = -1;
  if (rule == ValueRule::rates) {
    const auto bad =
        std::find_if(x.begin(), x.end(), [](float v) { return !(std::isfinite(v) && v > 0); });
    if (bad != x.end()) i = bad - x.begin();
  } else {
    i = first_invalid(x.data(), n, rule == ValueRule::log_gates);
  }
  if (i < 0) return x;
  const char* why = rule == ValueRule::rates       ? " (learning rates must be finite and > 0)"
                    : rule == ValueRule::log_gates ? " (log gates must be finite and <= 0)"
                                                   : " (NaN/Inf not allowed)";
  SS_FAIL(l.path, l.path, " element ", index_string(l.array.shape, i), " is ",
          x[static_cast<std::size_t>(i)], why, hint);
}

// The mixer's inputs, checked unless --no-check-finite (`check` false);
// log_gates: g's rule.
std::vector<float> loaded_values(const Loaded& l, DType round_as, bool check,
                                 bool log_gates = false) {
  if (!check) return to_float(l.array, round_as);
  return checked_values(l, round_as, log_gates ? ValueRule::log_gates : ValueRule::finite,
                        "; --no-check-finite lets it through");
}

// LaCT's inputs, always checked (LaCT refuses --no-check-finite: the layer
// checks every input too, but sees one rank's slice of the file); learning
// rates (`rate`) also must be > 0.
std::vector<float> lact_values(const Loaded& l, DType round_as, bool rate = false) {
  return checked_values(l, round_as, rate ? ValueRule::rates : ValueRule::finite);
}

// Tokens [t0, t1) of a [B, T, inner] tensor.
std::vector<float> slice_tokens(const std::vector<float>& x, int64_t batch, int64_t seq_len,
                                int64_t inner, int64_t t0, int64_t t1) {
  if (x.empty()) return {};
  std::vector<float> out(static_cast<std::size_t>(batch * (t1 - t0) * inner));
  for (int64_t b = 0; b < batch; ++b)
    std::copy_n(x.begin() + (b * seq_len + t0) * inner, (t1 - t0) * inner,
                out.begin() + b * (t1 - t0) * inner);
  return out;
}

}  // namespace

InputSource InputSource::synthetic(const RunOptions& options) {
  InputSource s;
  s.options_ = options;
  s.dims_ = {options.batch, options.seq_len, options.heads, options.dk, options.dv, options.batch};
  s.has_do_ = true;
  return s;
}

InputSource InputSource::from_directory(const RunOptions& options) {
  const std::string& dir = options.load_dir;
  SS_CHECK_ARG(std::filesystem::is_directory(dir), "--load", "'", dir, "' is not a directory");
  InputSource s;
  s.options_ = options;
  s.loaded_ = true;
  const Variant variant = options.variant;
  auto path_of = [&](const char* name) { return (std::filesystem::path(dir) / name).string(); };

  const Loaded q = load_float(dir, "q.npy");
  SS_CHECK_ARG(q.array.shape.size() == 4, q.path, q.path, " must be [B, T, H, Dk], got shape ",
               shape_string(q.array.shape));
  const Loaded v = load_float(dir, "v.npy");
  SS_CHECK_ARG(v.array.shape.size() == 4, v.path, v.path, " must be [B, T, H, Dv], got shape ",
               shape_string(v.array.shape));
  Dims& d = s.dims_;
  d.batch = q.array.shape[0];
  d.seq_len = q.array.shape[1];
  d.heads = q.array.shape[2];
  d.dk = q.array.shape[3];
  d.dv = v.array.shape[3];
  for (int64_t extent : q.array.shape)
    SS_CHECK_ARG(extent >= 1, q.path, q.path,
                 " has an empty dimension: ", shape_string(q.array.shape));
  SS_CHECK_ARG(d.dv >= 1, v.path, v.path, " has Dv = 0");
  const Shape qk{d.batch, d.seq_len, d.heads, d.dk}, vo{d.batch, d.seq_len, d.heads, d.dv};
  const Shape bth{d.batch, d.seq_len, d.heads};
  expect_shape(v, vo, "[B, T, H] of q.npy with Dv");
  const Loaded k = load_float(dir, "k.npy");
  expect_shape(k, qk, "q.npy's shape");

  const DType dt = options.dtype;
  TokenRange& f = s.full_;
  f.t_begin = 0;
  f.t_end = d.seq_len;
  const bool check = options.check_finite;
  f.q = loaded_values(q, dt, check);
  f.k = loaded_values(k, dt, check);
  f.v = loaded_values(v, dt, check);

  d.sequences = d.batch;
  if (npy_exists(path_of("cu_seqlens.npy"))) {
    const std::string path = path_of("cu_seqlens.npy");
    const NpyArray cu = read_npy(path);
    SS_CHECK_ARG(cu.descr == "<i8", path, path, " must be int64, got dtype '", cu.descr, "'");
    SS_CHECK_ARG(cu.shape.size() == 1 && cu.shape[0] >= 2, path, path,
                 " must be 1-D with N + 1 >= 2 offsets, got shape ", shape_string(cu.shape));
    SS_CHECK_ARG(d.batch == 1, path, "packed sequences need B = 1, but q.npy has B = ", d.batch);
    f.cu_seqlens.assign(cu.data.begin(), cu.data.end());
    d.sequences = cu.shape[0] - 1;
    s.packed_ = true;
  }
  const Shape states{d.sequences, d.heads, d.dk, d.dv};

  const bool want_g = has_gate(variant), want_beta = has_beta(variant);
  const bool have_g = npy_exists(path_of("g.npy")), have_beta = npy_exists(path_of("beta.npy"));
  SS_CHECK_ARG(have_g == want_g, path_of("g.npy"),
               want_g ? "is required by variant " : "must not be given for variant ",
               to_string(variant), want_g ? " (log decay)" : " (it has no decay)");
  SS_CHECK_ARG(have_beta == want_beta, path_of("beta.npy"),
               want_beta ? "is required by variant " : "must not be given for variant ",
               to_string(variant), want_beta ? " (delta rule)" : " (additive rule)");
  if (want_g) {
    const Loaded g = load_float(dir, "g.npy");
    expect_shape(g, vector_gate(variant) ? qk : bth,
                 vector_gate(variant) ? "a vector gate [B, T, H, Dk]" : "a scalar gate [B, T, H]");
    f.g = loaded_values(g, DType::f32, check, true);  // gates stay fp32 (DESIGN §2)
  }
  if (want_beta) {
    const Loaded beta = load_float(dir, "beta.npy");
    expect_shape(beta, bth, "beta [B, T, H]");
    f.beta = loaded_values(beta, dt, check);
  }
  if (npy_exists(path_of("h0.npy"))) {
    const Loaded h0 = load_float(dir, "h0.npy");
    expect_shape(h0, states, "the initial state [N, H, Dk, Dv]");
    f.h0 = loaded_values(h0, DType::f32, check);
    s.has_h0_ = true;
  }
  if (npy_exists(path_of("do.npy"))) {
    const Loaded d_o = load_float(dir, "do.npy");
    expect_shape(d_o, vo, "the output gradient [B, T, H, Dv]");
    f.d_o = loaded_values(d_o, dt, check);
    s.has_do_ = true;
  }
  if (npy_exists(path_of("dht.npy"))) {
    SS_CHECK_ARG(s.has_do_, path_of("dht.npy"),
                 "needs do.npy (the backward pass runs only with do)");
    const Loaded dht = load_float(dir, "dht.npy");
    expect_shape(dht, states, "the final-state gradient [N, H, Dk, Dv]");
    f.dht = loaded_values(dht, DType::f32, check);
  }
  return s;
}

std::string InputSource::description() const {
  std::ostringstream os;
  if (loaded_) {
    os << "loaded from " << options_.load_dir;
  } else {
    os << "synthetic (seed " << options_.seed << ")";
  }
  return os.str();
}

TokenRange InputSource::tokens(int64_t t_begin, int64_t t_end) const {
  SS_CHECK_ARG(t_begin >= 0 && t_begin <= t_end && t_end <= dims_.seq_len, "tokens", "range [",
               t_begin, ", ", t_end, ") is outside [0, ", dims_.seq_len, ")");
  if (!loaded_) return synthesize(t_begin, t_end);
  const Dims& d = dims_;
  const int64_t B = d.batch, T = d.seq_len, H = d.heads;
  TokenRange r;
  r.t_begin = t_begin;
  r.t_end = t_end;
  r.q = slice_tokens(full_.q, B, T, H * d.dk, t_begin, t_end);
  r.k = slice_tokens(full_.k, B, T, H * d.dk, t_begin, t_end);
  r.v = slice_tokens(full_.v, B, T, H * d.dv, t_begin, t_end);
  r.g = slice_tokens(full_.g, B, T, vector_gate(options_.variant) ? H * d.dk : H, t_begin, t_end);
  r.beta = slice_tokens(full_.beta, B, T, H, t_begin, t_end);
  r.d_o = slice_tokens(full_.d_o, B, T, H * d.dv, t_begin, t_end);
  r.h0 = full_.h0;
  r.dht = full_.dht;
  r.cu_seqlens = full_.cu_seqlens;
  return r;
}

TokenRange InputSource::synthesize(int64_t t_begin, int64_t t_end) const {
  const Dims& d = dims_;
  const Variant variant = options_.variant;
  const int64_t B = d.batch, T = d.seq_len, H = d.heads, Dk = d.dk, Dv = d.dv;
  const int64_t L = t_end - t_begin;
  const uint64_t seed = options_.seed;
  const DType dt = options_.dtype;
  const bool unit_qk = has_beta(variant) && !options_.l2norm;
  const bool vec_gate = vector_gate(variant);

  TokenRange r;
  r.t_begin = t_begin;
  r.t_end = t_end;
  r.q.resize(static_cast<std::size_t>(B * L * H * Dk));
  r.k.resize(r.q.size());
  r.v.resize(static_cast<std::size_t>(B * L * H * Dv));
  r.d_o.resize(r.v.size());
  if (has_gate(variant)) r.g.resize(static_cast<std::size_t>(B * L * H * (vec_gate ? Dk : 1)));
  if (has_beta(variant)) r.beta.resize(static_cast<std::size_t>(B * L * H));

  // Fills `width` values of `stream` for global (b, t, h) into dst.
  auto fill_normal = [&](Stream stream, int64_t global_row, int64_t width, float* dst,
                         bool normalise) {
    double values[256];
    normals(seed, stream, static_cast<uint64_t>(global_row * width), width, values);
    double sum_sq = 0;
    for (int64_t j = 0; j < width; ++j) sum_sq += values[j] * values[j];
    const double inv = normalise ? 1.0 / std::sqrt(sum_sq + 1e-12) : 1.0;
    for (int64_t j = 0; j < width; ++j) dst[j] = round_to(dt, static_cast<float>(values[j] * inv));
  };

  // One work item per (b, local token): all heads of that token.
  parallel_for(B * L, [&](int64_t item) {
    const int64_t b = item / L, t = item % L;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t global_row = (b * T + t_begin + t) * H + h;  // index of (b, t, h)
      const int64_t local_row = item * H + h;
      fill_normal(Stream::q, global_row, Dk, r.q.data() + local_row * Dk, unit_qk);
      fill_normal(Stream::k, global_row, Dk, r.k.data() + local_row * Dk, unit_qk);
      fill_normal(Stream::v, global_row, Dv, r.v.data() + local_row * Dv, false);
      fill_normal(Stream::d_o, global_row, Dv, r.d_o.data() + local_row * Dv, false);
      if (!r.g.empty()) {
        const int64_t width = vec_gate ? Dk : 1;
        double x[256];
        normals(seed, Stream::g, static_cast<uint64_t>(global_row * width), width, x);
        for (int64_t j = 0; j < width; ++j)
          r.g[static_cast<std::size_t>(local_row * width + j)] =
              static_cast<float>(log_sigmoid(x[j] + 4.0));
      }
      if (!r.beta.empty()) {
        const double x = normal_at(seed, Stream::beta, static_cast<uint64_t>(global_row));
        r.beta[static_cast<std::size_t>(local_row)] =
            round_to(dt, static_cast<float>(1.0 / (1.0 + std::exp(-x))));
      }
    }
  });
  return r;
}

std::vector<int64_t> shard_offsets(const RunOptions& options, int64_t seq_len, int ranks) {
  std::vector<int64_t> offsets(static_cast<std::size_t>(ranks) + 1, 0);
  if (!options.shards.empty()) {
    SS_CHECK_ARG(static_cast<int>(options.shards.size()) == ranks, "--shards", "has ",
                 options.shards.size(), " entries but the job has ", ranks,
                 " ranks (one length per rank)");
    for (int r = 0; r < ranks; ++r) offsets[r + 1] = offsets[r] + options.shards[r];
    SS_CHECK_ARG(offsets[ranks] == seq_len, "--shards", "lengths sum to ", offsets[ranks],
                 " but the sequence has T = ", seq_len, " tokens");
    return offsets;
  }
  // Under --load, T comes from the files rather than from --seq-len.
  SS_CHECK_ARG(seq_len >= ranks, options.load_dir.empty() ? "--seq-len" : "--load", "T = ", seq_len,
               " is smaller than the ", ranks, " ranks (every rank needs at least one token)");
  for (int r = 0; r <= ranks; ++r) offsets[r] = r * seq_len / ranks;
  return offsets;
}

LactData lact_synthetic(const RunOptions& options) {
  LactData data;
  LactDims& d = data.dims;
  d = {options.batch, options.seq_len, options.heads, options.dk,
       options.lact_hidden_for(options.dk)};
  data.description = "synthetic (seed " + std::to_string(options.seed) + ")";
  const uint64_t seed = options.seed;
  const DType dt = options.dtype;
  const int64_t rows = d.batch * d.seq_len * d.heads;  // (b, t, h)
  const auto tokens = static_cast<std::size_t>(rows * d.dim);
  const auto weights = static_cast<std::size_t>(d.heads * d.hidden * d.dim);
  for (auto* x : {&data.q, &data.k, &data.v, &data.d_o}) x->resize(tokens);
  for (auto* x : {&data.lr0, &data.lr1, &data.lr2}) x->resize(static_cast<std::size_t>(rows));
  for (auto* x : {&data.w0, &data.w1, &data.w2}) x->resize(weights);

  // Row `row` (width D) of a token tensor, unit-normalised or not.
  auto fill_row = [&](Stream stream, int64_t row, float* dst, bool normalise) {
    std::vector<double> values(static_cast<std::size_t>(d.dim));
    normals(seed, stream, static_cast<uint64_t>(row * d.dim), d.dim, values.data());
    double sum_sq = 0;
    for (int64_t j = 0; j < d.dim; ++j) sum_sq += values[j] * values[j];
    const double inv = normalise ? 1.0 / std::sqrt(sum_sq + 1e-12) : 1.0;
    for (int64_t j = 0; j < d.dim; ++j) dst[j] = round_to(dt, static_cast<float>(values[j] * inv));
  };
  parallel_for(rows, [&](int64_t row) {
    const std::size_t at = static_cast<std::size_t>(row * d.dim);
    fill_row(Stream::q, row, data.q.data() + at, true);
    fill_row(Stream::k, row, data.k.data() + at, true);
    fill_row(Stream::v, row, data.v.data() + at, false);
    fill_row(Stream::d_o, row, data.d_o.data() + at, false);
    const std::pair<Stream, std::vector<float>*> rates[] = {
        {Stream::lr0, &data.lr0}, {Stream::lr1, &data.lr1}, {Stream::lr2, &data.lr2}};
    for (const auto& [stream, lr] : rates) {
      const double x = normal_at(seed, stream, static_cast<uint64_t>(row));
      (*lr)[static_cast<std::size_t>(row)] = static_cast<float>(0.01 + 0.1 / (1.0 + std::exp(-x)));
    }
  });
  const double w1_scale = 1.0 / std::sqrt(static_cast<double>(d.hidden));
  for (std::size_t i = 0; i < weights; ++i) {
    data.w0[i] = static_cast<float>(normal_at(seed, Stream::w0, i));
    data.w1[i] = static_cast<float>(w1_scale * normal_at(seed, Stream::w1, i));
    data.w2[i] = static_cast<float>(normal_at(seed, Stream::w2, i));
  }
  return data;
}

LactData lact_from_directory(const RunOptions& options) {
  const std::string& dir = options.load_dir;
  SS_CHECK_ARG(std::filesystem::is_directory(dir), "--load", "'", dir, "' is not a directory");
  LactData data;
  data.description = "loaded from " + dir;
  LactDims& d = data.dims;

  const Loaded q = load_float(dir, "q.npy");
  SS_CHECK_ARG(q.array.shape.size() == 4, q.path, q.path, " must be [B, T, H, D], got shape ",
               shape_string(q.array.shape));
  for (int64_t extent : q.array.shape)
    SS_CHECK_ARG(extent >= 1, q.path, q.path,
                 " has an empty dimension: ", shape_string(q.array.shape));
  d.batch = q.array.shape[0];
  d.seq_len = q.array.shape[1];
  d.heads = q.array.shape[2];
  d.dim = q.array.shape[3];
  const Loaded w0 = load_float(dir, "w0.npy");
  SS_CHECK_ARG(w0.array.shape.size() == 3 && w0.array.shape[0] == d.heads &&
                   w0.array.shape[2] == d.dim && w0.array.shape[1] >= 1,
               w0.path, w0.path, " must be [H, M, D] = [", d.heads, ", M, ", d.dim,
               "] with M >= 1 (H, D from q.npy), got shape ", shape_string(w0.array.shape));
  d.hidden = w0.array.shape[1];

  const Shape tokens{d.batch, d.seq_len, d.heads, d.dim}, rates{d.batch, d.seq_len, d.heads};
  const Shape wide{d.heads, d.hidden, d.dim}, narrow{d.heads, d.dim, d.hidden};
  const DType dt = options.dtype;
  data.q = lact_values(q, dt);
  const std::pair<const char*, std::vector<float>*> token_files[] = {{"k.npy", &data.k},
                                                                     {"v.npy", &data.v}};
  for (const auto& [name, dst] : token_files) {
    const Loaded l = load_float(dir, name);
    expect_shape(l, tokens, "q.npy's shape [B, T, H, D]");
    *dst = lact_values(l, dt);
  }
  const std::pair<const char*, std::vector<float>*> rate_files[] = {
      {"lr0.npy", &data.lr0}, {"lr1.npy", &data.lr1}, {"lr2.npy", &data.lr2}};
  for (const auto& [name, dst] : rate_files) {
    const Loaded l = load_float(dir, name);
    expect_shape(l, rates, "a learning rate [B, T, H]");
    *dst = lact_values(l, DType::f32, /*rate=*/true);
  }
  data.w0 = lact_values(w0, DType::f32);
  const Loaded w1 = load_float(dir, "w1.npy");
  expect_shape(w1, narrow, "W1 [H, D, M]");
  data.w1 = lact_values(w1, DType::f32);
  const Loaded w2 = load_float(dir, "w2.npy");
  expect_shape(w2, wide, "W2 [H, M, D]");
  data.w2 = lact_values(w2, DType::f32);
  if (npy_exists((std::filesystem::path(dir) / "do.npy").string())) {
    const Loaded d_o = load_float(dir, "do.npy");
    expect_shape(d_o, tokens, "the output gradient [B, T, H, D]");
    data.d_o = lact_values(d_o, dt);
  }
  return data;
}

void note_ignored_shape_flags(const RunOptions& options, const char* shape_files) {
  if (options.load_dir.empty() || options.shape_flags_given.empty()) return;
  std::string flags;
  for (const auto& f : options.shape_flags_given) flags += (flags.empty() ? "" : ", ") + f;
  std::fprintf(stderr, "statescan-run: note: %s ignored with --load (shapes come from %s)\n",
               flags.c_str(), shape_files);
}

}  // namespace statescan::launch
