// statescan-bench --lact (launch/bench_lact.h): times the GPU LaCT forward
// and forward + backward, counts their GEMM FLOPs, and measures the bf16
// cuBLAS GEMM rate in the same process for the utilisation column.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/cli_parse.h"
#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "kernels/cuda/lact_cuda.h"
#include "launch/bench_lact.h"
#include "monitoring/flop_model.h"

namespace statescan {
namespace {

// ---- device data --------------------------------------------------------------------

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// x[i] = offset + scale * u, u uniform in [-1, 1), from a hash of (seed, i).
template <typename T>
__global__ void fill_uniform_kernel(T* x, int64_t n, uint64_t seed, float scale, float offset) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float u = static_cast<float>(mix64(seed * 0x100000001B3ull + uint64_t(i)) >> 40) *
                        (2.0f / 16777216.0f) -
                    1.0f;
    const float v = offset + scale * u;
    if constexpr (std::is_same<T, float>::value) {
      x[i] = v;
    } else {
      x[i] = __float2bfloat16_rn(v);
    }
  }
}

// A device array of n values of `dtype`, filled uniformly.
struct Filled {
  DeviceBuffer<unsigned char> bytes;
  Filled(int64_t n, DType t, uint64_t seed, float scale, float offset)
      : bytes(static_cast<std::size_t>(n) * size_of(t)) {
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65536));
    if (t == DType::f32) {
      fill_uniform_kernel<float>
          <<<blocks, 256>>>(reinterpret_cast<float*>(bytes.data()), n, seed, scale, offset);
    } else {
      fill_uniform_kernel<__nv_bfloat16>
          <<<blocks, 256>>>(reinterpret_cast<__nv_bfloat16*>(bytes.data()), n, seed, scale, offset);
    }
    SS_LAUNCH_CHECK("fill_uniform_kernel");
  }
  void* data() { return bytes.data(); }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// A CUDA event, destroyed with its owner (an error in a timing loop leaks none).
struct Event {
  cudaEvent_t e = nullptr;
  Event() { SS_CUDA_CHECK(cudaEventCreate(&e)); }
  ~Event() {
    if (e != nullptr) (void)cudaEventDestroy(e);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

// Medians over `iters` runs after `warmup` of a two-phase step on `stream`:
// GPU time (CUDA events) of `first` and of `first` then `second`, and the
// host time to enqueue each.
struct PhaseTimes {
  double first_ms = 0, both_ms = 0, host_first_ms = 0, host_second_ms = 0;
};
template <typename First, typename Second>
PhaseTimes time_phases(cudaStream_t stream, int warmup, int iters, First&& first, Second&& second) {
  Event start, mid, stop;
  std::vector<double> gpu_first, gpu_both, host_first, host_second;
  for (int it = 0; it < warmup + iters; ++it) {
    SS_CUDA_CHECK(cudaEventRecord(start.e, stream));
    const auto h0 = std::chrono::steady_clock::now();
    first();
    const auto h1 = std::chrono::steady_clock::now();
    SS_CUDA_CHECK(cudaEventRecord(mid.e, stream));
    second();
    const auto h2 = std::chrono::steady_clock::now();
    SS_CUDA_CHECK(cudaEventRecord(stop.e, stream));
    SS_CUDA_CHECK(cudaEventSynchronize(stop.e));
    float f = 0, fb = 0;
    SS_CUDA_CHECK(cudaEventElapsedTime(&f, start.e, mid.e));
    SS_CUDA_CHECK(cudaEventElapsedTime(&fb, start.e, stop.e));
    if (it < warmup) continue;
    gpu_first.push_back(f);
    gpu_both.push_back(fb);
    host_first.push_back(std::chrono::duration<double, std::milli>(h1 - h0).count());
    host_second.push_back(std::chrono::duration<double, std::milli>(h2 - h1).count());
  }
  return {median(gpu_first), median(gpu_both), median(host_first), median(host_second)};
}

// ---- FLOP model ---------------------------------------------------------------------

// Newton-Schulz FLOPs of one step of one m x n matrix (m = min(M, D), n =
// max): X X^T, A A, B X.
double ns_step_flops(const LactBenchOptions& o) {
  const double m = double(std::min(o.dim, o.hidden)), n = double(std::max(o.dim, o.hidden));
  return 2.0 * (m * m * n + m * m * m + m * m * n);
}

// Newton-Schulz FLOPs of one call (one chunk) over its 3 B H matrices: the
// forward's s steps; forward + backward: the forward recomputed (s steps),
// then per step the Gram products again (X X^T, A A) and the adjoint
// products (B dX, dX X^T, dB A, A dB, S X). The math's FLOPs: the two-part
// bf16 modes execute three times as many on the tensor cores.
struct NsCallFlops {
  double fwd = 0, fwd_bwd = 0;
};
NsCallFlops ns_call_flops(const LactBenchOptions& o) {
  const double mats = 3.0 * double(o.batch * o.heads);
  const double m = double(std::min(o.dim, o.hidden)), n = double(std::max(o.dim, o.hidden));
  const double step = ns_step_flops(o);
  const double gram = 2.0 * (m * m * n + m * m * m);
  const double back_step = 2.0 * (3.0 * m * m * n + 2.0 * m * m * m);
  const double s = double(o.muon_steps);
  NsCallFlops f;
  f.fwd = mats * s * step;
  f.fwd_bwd = f.fwd + mats * s * (step + gram + back_step);
  return f;
}

// ---- the cuBLAS reference rate --------------------------------------------------------

// bf16 x bf16 -> fp32 (fp32 accumulate) batched GEMM rate in TFLOP/s, row-major
// C[m, n] = A[m, k] B[n, k]^T with the given leading dimensions and batch strides.
double gemm_rate(int64_t m, int64_t n, int64_t k, int64_t batch, int64_t lda, int64_t sa,
                 int64_t ldb, int64_t sb, int iters) {
  const std::size_t a_count = static_cast<std::size_t>(std::max(sa * batch, lda * m));
  const std::size_t b_count = static_cast<std::size_t>(std::max(sb * batch, ldb * n));
  Filled A(static_cast<int64_t>(a_count), DType::bf16, 11, 1.0f, 0.0f);
  Filled B(static_cast<int64_t>(b_count), DType::bf16, 12, 1.0f, 0.0f);
  DeviceBuffer<float> C(static_cast<std::size_t>(m * n * batch));
  cublasHandle_t h = nullptr;
  SS_CUBLAS_CHECK(cublasCreate(&h));
  const float one = 1.0f, zero = 0.0f;
  auto call = [&] {
    SS_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
        &one, B.data(), CUDA_R_16BF, static_cast<int>(ldb), sb, A.data(), CUDA_R_16BF,
        static_cast<int>(lda), sa, &zero, C.data(), CUDA_R_32F, static_cast<int>(n), m * n,
        static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  call();
  std::vector<double> ms;
  {
    Event start, stop;
    for (int i = 0; i < iters; ++i) {
      SS_CUDA_CHECK(cudaEventRecord(start.e));
      for (int r = 0; r < 10; ++r) call();
      SS_CUDA_CHECK(cudaEventRecord(stop.e));
      SS_CUDA_CHECK(cudaEventSynchronize(stop.e));
      float t = 0;
      SS_CUDA_CHECK(cudaEventElapsedTime(&t, start.e, stop.e));
      ms.push_back(t / 10.0);
    }
  }
  (void)cublasDestroy(h);
  return 2.0 * double(m) * double(n) * double(k) * double(batch) / (median(ms) * 1e-3) / 1e12;
}

// ---- correctness on a small problem -----------------------------------------------

// Max relative RMS error (normalised by the dtype's tolerance: <= 1 passes)
// of the GPU forward + backward against the fp64 reference, on a small
// problem with the benchmark's options.
double small_problem_error(const LactBenchOptions& o, double* worst_raw) {
  // Chunks of 4 min(D, M) tokens: bf16 with Muon needs chunks well above
  // min(D, M) (tests/test_cuda_lact.cpp says why).
  const int64_t B = 1, T = 1024, H = 2, D = 64, M = 128, C = 256;
  std::mt19937_64 rng(2024);
  std::normal_distribution<double> normal(0.0, 1.0);
  auto randn = [&](int64_t n, double scale) {
    std::vector<double> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = normal(rng) * scale;
    return x;
  };
  auto round = [&](std::vector<double> x) {
    for (auto& e : x) e = round_to(o.dtype, static_cast<float>(e));
    return x;
  };
  const int64_t tok = B * T * H;
  auto unit_rows = [&](std::vector<double> x) {
    for (int64_t r = 0; r < tok; ++r) {
      double s = 0;
      for (int64_t d = 0; d < D; ++d) s += x[r * D + d] * x[r * D + d];
      for (int64_t d = 0; d < D; ++d) x[r * D + d] /= std::sqrt(s);
    }
    return x;
  };
  auto rates = [&] {
    std::vector<double> x = randn(tok, 1.0);
    for (auto& e : x) e = 0.01 + 0.1 / (1.0 + std::exp(-e));
    return x;
  };
  const std::vector<double> q = round(unit_rows(randn(tok * D, 1))),
                            k = round(unit_rows(randn(tok * D, 1))), v = round(randn(tok * D, 1)),
                            lr0 = round(rates()), lr1 = round(rates()), lr2 = round(rates()),
                            w0 = round(randn(H * M * D, 1)),
                            w1 = round(randn(H * M * D, 1.0 / std::sqrt(double(M)))),
                            w2 = round(randn(H * M * D, 1)), d_o = round(randn(tok * D, 1));
  LactConfig cfg;
  cfg.chunk = C;
  cfg.schedule = o.schedule;
  cfg.momentum = o.momentum;
  cfg.muon_steps = o.muon_steps;
  cfg.renorm = o.renorm;

  // fp64 reference.
  std::vector<double> o_ref(q.size()), dq(q.size()), dk(q.size()), dv(q.size()), dl0(lr0.size()),
      dl1(lr0.size()), dl2(lr0.size()), dw0(w0.size()), dw1(w0.size()), dw2(w0.size());
  LactParams<double> p;
  p.config = cfg;
  p.batch = B;
  p.seq_len = T;
  p.heads = H;
  p.dim = D;
  p.hidden = M;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.lr0 = lr0.data();
  p.lr1 = lr1.data();
  p.lr2 = lr2.data();
  p.w0 = w0.data();
  p.w1 = w1.data();
  p.w2 = w2.data();
  p.o = o_ref.data();
  LactCheckpoints<double> saved;
  lact_forward<double>(p, {}, &saved);
  LactGradParams<double> g{d_o.data(), dq.data(),  dk.data(),  dv.data(),  dl0.data(),
                           dl1.data(), dl2.data(), dw0.data(), dw1.data(), dw2.data()};
  lact_backward<double>(p, g, saved, {});

  // GPU.
  auto up = [&](const std::vector<double>& x) {
    std::vector<float> f(x.begin(), x.end());
    std::vector<unsigned char> raw(f.size() * size_of(o.dtype));
    convert_from_float(o.dtype, f.data(), raw.data(), f.size());
    return DeviceBuffer<unsigned char>(raw);
  };
  auto empty = [&](std::size_t n) { return DeviceBuffer<unsigned char>(n * size_of(o.dtype)); };
  auto down = [&](const DeviceBuffer<unsigned char>& d, std::size_t n) {
    const std::vector<unsigned char> raw = d.to_host();
    std::vector<float> f(n);
    convert_to_float(o.dtype, raw.data(), f.data(), n);
    return std::vector<double>(f.begin(), f.end());
  };
  auto dq_ = up(q), dk_ = up(k), dv_ = up(v), dl0_ = up(lr0), dl1_ = up(lr1), dl2_ = up(lr2),
       dw0_ = up(w0), dw1_ = up(w1), dw2_ = up(w2), ddo = up(d_o);
  auto go = empty(q.size()), gdq = empty(q.size()), gdk = empty(q.size()), gdv = empty(q.size()),
       gl0 = empty(lr0.size()), gl1 = empty(lr0.size()), gl2 = empty(lr0.size()),
       gw0 = empty(w0.size()), gw1 = empty(w0.size()), gw2 = empty(w0.size());
  cuda::LactCudaParams cp;
  cp.config = cfg;
  cp.dtype = o.dtype;
  cp.batch = B;
  cp.seq_len = T;
  cp.heads = H;
  cp.dim = D;
  cp.hidden = M;
  cp.q = dq_.data();
  cp.k = dk_.data();
  cp.v = dv_.data();
  cp.lr0 = dl0_.data();
  cp.lr1 = dl1_.data();
  cp.lr2 = dl2_.data();
  cp.w0 = dw0_.data();
  cp.w1 = dw1_.data();
  cp.w2 = dw2_.data();
  cp.o = go.data();
  cuda::LactCudaSaved csaved;
  cuda::lact_cuda_forward(cp, {}, &csaved, nullptr);
  cuda::LactCudaGrads cg{ddo.data(), gdq.data(), gdk.data(), gdv.data(), gl0.data(),
                         gl1.data(), gl2.data(), gw0.data(), gw1.data(), gw2.data()};
  cuda::lact_cuda_backward(cp, cg, csaved, {}, nullptr);
  SS_CUDA_CHECK(cudaDeviceSynchronize());

  auto rel = [](const std::vector<double>& a, const std::vector<double>& ref) -> double {
    double num = 0, den = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
      num += (a[i] - ref[i]) * (a[i] - ref[i]);
      den += ref[i] * ref[i];
    }
    return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  };
  const bool f32 = o.dtype == DType::f32;
  // DESIGN §7 / tests/test_cuda_lact.cpp: bf16 o 5e-3, dq dk dv dw 8e-3,
  // dlr 2e-2 (the dbeta-like learning-rate gradients).
  const double out_tol = f32 ? 1e-5 : 5e-3, grad_tol = f32 ? 1e-5 : 8e-3;
  const double rate_tol = f32 ? 1e-5 : 2e-2;
  double worst = rel(down(go, q.size()), o_ref), worst_norm = worst / out_tol;
  const std::pair<const DeviceBuffer<unsigned char>*, const std::vector<double>*> grads[] = {
      {&gdq, &dq},  {&gdk, &dk},  {&gdv, &dv},  {&gl0, &dl0}, {&gl1, &dl1},
      {&gl2, &dl2}, {&gw0, &dw0}, {&gw1, &dw1}, {&gw2, &dw2}};
  for (const auto& [got, ref] : grads) {
    const double e = rel(down(*got, ref->size()), *ref);
    const bool rate = got == &gl0 || got == &gl1 || got == &gl2;
    worst = std::max(worst, e);
    worst_norm = std::max(worst_norm, e / (rate ? rate_tol : grad_tol));
  }
  *worst_raw = worst;
  return worst_norm;
}

}  // namespace

const char* const kLactBenchUsage =
    "       statescan-bench --lact | --lact-ns (first) [-B 1] [-T 1048576] [-C 4096] [-H 4]\n"
    "                       [-D 256] [-M 512] [--dtype bf16|f32]\n"
    "                       [--schedule apply_then_update|update_then_apply]\n"
    "                       [--momentum 0] [--muon-steps 5] [--no-renorm] [--warmup 1]\n"
    "                       [--iters 5] [--forward-only] [--no-check]\n";

LactBenchOptions parse_lact_bench_options(int argc, char** argv) {
  // Bounds far past any real run (their products: check_tensor_elements).
  constexpr int64_t kMaxTokens = int64_t{1} << 40, kMaxCount = int64_t{1} << 20,
                    kMaxWidth = int64_t{1} << 16;
  LactBenchOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    SS_CHECK_ARG(a != "-h" && a != "--help", a.c_str(),
                 "is only taken alone (statescan-bench --lact --help)");
    auto value = [&]() -> const char* {
      SS_CHECK_ARG(i + 1 < argc, a.c_str(), "needs a value");
      return argv[++i];
    };
    if (a == "--lact" || a == "--lact-ns") continue;
    if (a == "--batch" || a == "-B") {
      o.batch = parse_int(value(), a.c_str(), 1, kMaxCount);
    } else if (a == "--seq-len" || a == "-T") {
      o.seq_len = parse_int(value(), a.c_str(), 1, kMaxTokens);
    } else if (a == "--chunk" || a == "-C") {
      o.chunk = parse_int(value(), a.c_str(), 1, kMaxTokens);
    } else if (a == "--heads" || a == "-H") {
      o.heads = parse_int(value(), a.c_str(), 1, kMaxCount);
    } else if (a == "--dim" || a == "-D") {
      o.dim = parse_int(value(), a.c_str(), 1, kMaxWidth);
    } else if (a == "--hidden" || a == "-M") {
      o.hidden = parse_int(value(), a.c_str(), 1, kMaxWidth);
    } else if (a == "--dtype") {
      o.dtype = parse_dtype(value(), "--dtype");
      SS_CHECK_ARG(o.dtype == DType::f32 || o.dtype == DType::bf16, "--dtype",
                   "LaCT runs in f32 or bf16");
    } else if (a == "--schedule") {
      o.schedule = parse_lact_schedule(value(), "--schedule");
    } else if (a == "--momentum") {
      o.momentum = parse_number(value(), a.c_str());
      SS_CHECK_ARG(o.momentum >= 0 && o.momentum < 1, a, "must be in [0, 1), got ", o.momentum);
    } else if (a == "--muon-steps") {
      o.muon_steps = static_cast<int>(parse_int(value(), a.c_str(), 0, 100));
    } else if (a == "--no-renorm") {
      o.renorm = false;
    } else if (a == "--warmup") {
      o.warmup = static_cast<int>(parse_int(value(), a.c_str(), 0, kMaxCount));
    } else if (a == "--iters") {
      o.iters = static_cast<int>(parse_int(value(), a.c_str(), 1, kMaxCount));
    } else if (a == "--forward-only") {
      o.backward = false;
    } else if (a == "--no-check") {
      o.check = false;
    } else {
      SS_CHECK_ARG(a.rfind('-', 0) != 0, a.c_str(), "unknown flag for statescan-bench --lact");
      SS_FAIL("arguments", "unknown positional argument '", a, "' for statescan-bench --lact");
    }
  }
  check_tensor_elements({{"--batch", o.batch},
                         {"--seq-len", o.seq_len},
                         {"--heads", o.heads},
                         {"max(--dim, --hidden)", std::max(o.dim, o.hidden)}},
                        "--seq-len");
  check_tensor_elements({{"--heads", o.heads}, {"--hidden", o.hidden}, {"--dim", o.dim}},
                        "--hidden");  // the fast weights
  LactConfig c;
  c.chunk = o.chunk;
  c.momentum = o.momentum;
  c.muon_steps = o.muon_steps;
  check_lact_config(c);
  return o;
}

LactBenchResult measure_lact(const LactBenchOptions& o) {
  int devices = 0;
  SS_CHECK_ARG(cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0, "device",
               "statescan-bench --lact needs a CUDA device");
  LactBenchResult r;
  const int64_t tokens = o.batch * o.seq_len * o.heads;
  r.fwd_flops = lact_step_flops(tokens, o.dim, o.hidden, false);
  r.fwd_bwd_flops = lact_step_flops(tokens, o.dim, o.hidden, true);
  const double chunks = double(lact_num_chunks(o.seq_len, o.chunk));
  const NsCallFlops ns = ns_call_flops(o);
  r.ns_fwd_flops = chunks * ns.fwd;
  r.ns_fwd_bwd_flops = chunks * ns.fwd_bwd;

  cuda::LactCudaParams p;
  p.config.chunk = o.chunk;
  p.config.schedule = o.schedule;
  p.config.momentum = o.momentum;
  p.config.muon_steps = o.muon_steps;
  p.config.renorm = o.renorm;
  p.dtype = o.dtype;
  p.batch = o.batch;
  p.seq_len = o.seq_len;
  p.heads = o.heads;
  p.dim = o.dim;
  p.hidden = o.hidden;
  const int64_t td = tokens * o.dim, w = o.heads * o.hidden * o.dim;
  const float unit = std::sqrt(3.0f / float(o.dim));  // rows of norm ~1
  Filled q(td, o.dtype, 1, unit, 0), k(td, o.dtype, 2, unit, 0), v(td, o.dtype, 3, 1.7f, 0);
  Filled lr0(tokens, o.dtype, 4, 0.05f, 0.06f), lr1(tokens, o.dtype, 5, 0.05f, 0.06f),
      lr2(tokens, o.dtype, 6, 0.05f, 0.06f);
  Filled w0(w, o.dtype, 7, 1.7f, 0), w1(w, o.dtype, 8, std::sqrt(3.0f / float(o.hidden)), 0),
      w2(w, o.dtype, 9, 1.7f, 0);
  Filled d_o(td, o.dtype, 10, 1.0f, 0), out(td, o.dtype, 20, 0, 0);
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.lr0 = lr0.data();
  p.lr1 = lr1.data();
  p.lr2 = lr2.data();
  p.w0 = w0.data();
  p.w1 = w1.data();
  p.w2 = w2.data();
  p.o = out.data();
  SS_CUDA_CHECK(cudaDeviceSynchronize());

  cudaStream_t stream;
  SS_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    cuda::LactCudaSaved saved;
    std::unique_ptr<Filled> dq, dk, dv, dl0, dl1, dl2, dw0, dw1, dw2;
    cuda::LactCudaGrads g;
    if (o.backward) {
      dq = std::make_unique<Filled>(td, o.dtype, 0, 0.f, 0.f);
      dk = std::make_unique<Filled>(td, o.dtype, 0, 0.f, 0.f);
      dv = std::make_unique<Filled>(td, o.dtype, 0, 0.f, 0.f);
      dl0 = std::make_unique<Filled>(tokens, o.dtype, 0, 0.f, 0.f);
      dl1 = std::make_unique<Filled>(tokens, o.dtype, 0, 0.f, 0.f);
      dl2 = std::make_unique<Filled>(tokens, o.dtype, 0, 0.f, 0.f);
      dw0 = std::make_unique<Filled>(w, o.dtype, 0, 0.f, 0.f);
      dw1 = std::make_unique<Filled>(w, o.dtype, 0, 0.f, 0.f);
      dw2 = std::make_unique<Filled>(w, o.dtype, 0, 0.f, 0.f);
      g = cuda::LactCudaGrads{d_o.data(),  dq->data(),  dk->data(),  dv->data(),  dl0->data(),
                              dl1->data(), dl2->data(), dw0->data(), dw1->data(), dw2->data()};
    }
    // The profiler range covers only the timed LaCT runs, so `ncu
    // --profile-from-start off` (or nsys's cudaProfilerApi capture) sees the
    // layer's kernels without the GEMM-rate reference below. No-ops unprofiled.
    SS_CUDA_CHECK(cudaProfilerStart());
    const PhaseTimes t = time_phases(
        stream, o.warmup, o.iters,
        [&] { cuda::lact_cuda_forward(p, {}, o.backward ? &saved : nullptr, stream); },
        [&] {
          if (o.backward) cuda::lact_cuda_backward(p, g, saved, {}, stream);
        });
    r.fwd_ms = t.first_ms;
    r.fwd_bwd_ms = o.backward ? t.both_ms : 0.0;
    r.host_fwd_ms = t.host_first_ms;
    r.host_bwd_ms = t.host_second_ms;
    SS_CUDA_CHECK(cudaProfilerStop());
  }
  (void)cudaStreamDestroy(stream);

  r.gemm_square_tflops = gemm_rate(4096, 4096, 4096, 1, 4096, 0, 4096, 0, 5);
  // LaCT's hidden projection h0 = X W0^T of one chunk slice: n x M x D per
  // head, X rows strided by H D, batched over the heads.
  const int64_t n_tok = std::min(o.chunk, o.seq_len);
  r.gemm_lact_tflops = gemm_rate(n_tok, o.hidden, o.dim, o.heads, o.heads * o.dim, o.dim, o.dim,
                                 o.hidden * o.dim, 5);
  return r;
}

namespace {

// The options (checked further by `check`) and the current device's
// properties; throws statescan::Error naming the flag (statescan-bench exits
// 2) or "cuda" without a device (exit 3).
template <typename Check>
void lact_bench_setup(int argc, char** argv, Check&& check, LactBenchOptions& o,
                      cudaDeviceProp& prop) {
  o = parse_lact_bench_options(argc, argv);
  check(o);
  int device = 0;
  SS_CUDA_CHECK(cudaGetDevice(&device));
  SS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
}

}  // namespace

int run_lact_bench(int argc, char** argv, std::ostream& out) {
  LactBenchOptions o;
  cudaDeviceProp prop{};
  lact_bench_setup(
      argc, argv, [](const LactBenchOptions&) {}, o, prop);
  const LactBenchResult r = measure_lact(o);
  double err_raw = -1, err_norm = -1;
  if (o.check) err_norm = small_problem_error(o, &err_raw);
  char line[512];
  out << "# statescan-bench --lact: LaCT layer forward / forward+backward on " << prop.name << " ("
      << prop.multiProcessorCount << " SMs)\n";
  std::snprintf(line, sizeof line,
                "# dtype %s, B %lld, T %lld, chunk %lld (%lld chunks), H %lld, D %lld, M %lld, %s, "
                "momentum %g, muon_steps %d, renorm %d, warm-up %d, timed %d (median)\n",
                to_string(o.dtype), (long long)o.batch, (long long)o.seq_len, (long long)o.chunk,
                (long long)lact_num_chunks(o.seq_len, o.chunk), (long long)o.heads,
                (long long)o.dim, (long long)o.hidden, to_string(o.schedule), o.momentum,
                o.muon_steps, o.renorm ? 1 : 0, o.warmup, o.iters);
  out << line;
  std::snprintf(
      line, sizeof line,
      "# cuBLAS bf16 GEMM (fp32 accumulate): 4096^3 %.1f TFLOP/s; LaCT shape %lldx%lldx%lld "
      "x%lld heads %.1f TFLOP/s. util = GEMM-model TFLOP/s / the 4096^3 rate (the goal's "
      "60%%), shape = / the LaCT-shape rate\n",
      r.gemm_square_tflops, (long long)std::min(o.chunk, o.seq_len), (long long)o.hidden,
      (long long)o.dim, (long long)o.heads, r.gemm_lact_tflops);
  out << line;
  out << "# FLOP model: token GEMMs 18 M D per token-head forward, 64 M D forward+backward; NS = "
         "Muon Newton-Schulz GEMM FLOPs (not in TFLOP/s); hidden layer "
      << cuda::lact_cuda_hidden_path(o.dtype, o.dim, o.hidden)
      << (o.muon_steps > 0
              ? std::string("; NS GEMMs ") + cuda::lact_cuda_ns_gemms(o.dtype, o.dim, o.hidden)
              : std::string())
      << (o.dtype == DType::bf16 && o.muon_steps > 0
              ? "; bf16 + Muon also runs 6 M D per token-head of hi+lo update GEMMs (not counted)"
              : "")
      << "\n";
  std::snprintf(line, sizeof line, "# %-8s %10s %12s %10s %10s %8s %9s %10s %12s %10s\n", "pass",
                "time_ms", "tokens/s", "GEMM_TF", "TFLOP/s", "util_%", "shape_%", "NS_TF",
                "TFLOP/s+NS", "err");
  out << line;
  const double tok = double(o.batch * o.seq_len);
  auto row = [&](const char* name, double ms, double flops, double ns) {
    const double tf = flops / (ms * 1e-3) / 1e12;
    std::snprintf(
        line, sizeof line, "  %-8s %10.3f %12.4g %10.2f %10.1f %8.1f %9.1f %10.2f %12.1f %10.2e\n",
        name, ms, tok / (ms * 1e-3), flops / 1e12, tf, 100.0 * tf / r.gemm_square_tflops,
        100.0 * tf / r.gemm_lact_tflops, ns / 1e12, (flops + ns) / (ms * 1e-3) / 1e12, err_raw);
    out << line;
  };
  row("fwd", r.fwd_ms, r.fwd_flops, r.ns_fwd_flops);
  if (o.backward) row("fwd+bwd", r.fwd_bwd_ms, r.fwd_bwd_flops, r.ns_fwd_bwd_flops);
  std::snprintf(
      line, sizeof line,
      "# host enqueue time (median ms): fwd %.3f, bwd %.3f (about the GPU time: launch-bound, "
      "or the launch queue filled up)\n",
      r.host_fwd_ms, r.host_bwd_ms);
  out << line;
  if (o.check) {
    out << "# check: small problem (B 1, T 1024, C 256, H 2, D 64, M 128) vs fp64 reference: max "
           "rel RMS "
        << err_raw << (err_norm <= 1.0 ? " (within tolerance)\n" : " (OVER TOLERANCE)\n");
  }
  return err_norm <= 1.0 || !o.check ? 0 : 1;
}

// ---- statescan-bench --lact-ns --------------------------------------------------------

namespace {

// Median forward and forward + backward times (us) of one Newton-Schulz mode
// on the same inputs, CUDA events around each call; at least two warm-up
// calls, so that the timed ones replay the captured graph as in a layer.
struct NsTimes {
  double fwd_us = 0, fwd_bwd_us = 0;
};
NsTimes time_ns_mode(const LactBenchOptions& o, cuda::lact_detail::NsGemms mode, const float* P,
                     float* out, const float* d_out, float* dP, cudaStream_t stream) {
  cuda::lact_detail::NewtonSchulzBf16 ns(o.batch * o.heads, o.hidden, o.dim, o.muon_steps,
                                         o.backward, mode, stream);
  const PhaseTimes t = time_phases(
      stream, std::max(o.warmup, 2), o.iters, [&] { ns.forward(P, out); },
      [&] {
        if (o.backward) ns.backward(P, d_out, dP);
      });
  return {1e3 * t.first_ms, o.backward ? 1e3 * t.both_ms : 0.0};
}

}  // namespace

int run_lact_ns_bench(int argc, char** argv, std::ostream& out) {
  using cuda::lact_detail::NsGemms;
  LactBenchOptions o;
  cudaDeviceProp prop{};
  const auto check = [](const LactBenchOptions& opt) {
    SS_CHECK_ARG(opt.dtype == DType::bf16, "--dtype",
                 "--lact-ns times a bf16 layer's Newton-Schulz (f32 layers run it in fp64)");
    SS_CHECK_ARG(opt.muon_steps > 0, "--muon-steps", "--lact-ns needs at least one step");
  };
  lact_bench_setup(argc, argv, check, o, prop);
  const int64_t count = o.batch * o.heads * 3 * o.hidden * o.dim;
  Filled P(count, DType::f32, 31, 1.0f, 0), d_out(count, DType::f32, 32, 1.0f, 0);
  Filled ns_out(count, DType::f32, 0, 0.f, 0.f), dP(count, DType::f32, 0, 0.f, 0.f);
  SS_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t stream;
  SS_CUDA_CHECK(cudaStreamCreate(&stream));
  const NsCallFlops flops = ns_call_flops(o);
  char line[512];
  out << "# statescan-bench --lact-ns: Muon's Newton-Schulz of a bf16 LaCT layer, one chunk's "
         "call, on "
      << prop.name << " (" << prop.multiProcessorCount << " SMs)\n";
  std::snprintf(line, sizeof line,
                "# %lld matrices (B %lld x H %lld x 3) of %lld x %lld (D %lld, M %lld), %d steps, "
                "warm-up %d, timed %d (median); TFLOP/s = the products' math FLOPs (%.3g fwd, "
                "%.3g fwd+bwd GFLOP; the bf16x3 paths execute 3x on the tensor cores)\n",
                (long long)(3 * o.batch * o.heads), (long long)o.batch, (long long)o.heads,
                (long long)std::min(o.dim, o.hidden), (long long)std::max(o.dim, o.hidden),
                (long long)o.dim, (long long)o.hidden, o.muon_steps, std::max(o.warmup, 2), o.iters,
                flops.fwd / 1e9, flops.fwd_bwd / 1e9);
  out << line;
  std::snprintf(line, sizeof line, "# %-8s %-15s %10s %9s %12s %9s\n", "mode", "path", "fwd_us",
                "TFLOP/s", "fwd+bwd_us", "TFLOP/s");
  out << line;
  struct Mode {
    const char* name;
    NsGemms mode;
  };
  const Mode modes[] = {{"bf16x3", NsGemms::bf16x3},
                        {"cluster", NsGemms::cluster},
                        {"fused", NsGemms::fused},
                        {"fp32", NsGemms::fp32}};
  for (const Mode& m : modes) {
    const NsTimes t = time_ns_mode(
        o, m.mode, static_cast<const float*>(P.data()), static_cast<float*>(ns_out.data()),
        static_cast<const float*>(d_out.data()), static_cast<float*>(dP.data()), stream);
    const double tf = flops.fwd / (t.fwd_us * 1e-6) / 1e12;
    const double tfb = o.backward ? flops.fwd_bwd / (t.fwd_bwd_us * 1e-6) / 1e12 : 0.0;
    std::snprintf(line, sizeof line, "  %-8s %-15s %10.1f %9.1f %12.1f %9.1f\n", m.name,
                  cuda::lact_detail::ns_gemms_name(m.mode, o.dim, o.hidden), t.fwd_us, tf,
                  t.fwd_bwd_us, tfb);
    out << line;
  }
  (void)cudaStreamDestroy(stream);
  return 0;
}

}  // namespace statescan
