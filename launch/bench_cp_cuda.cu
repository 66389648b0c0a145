// statescan-bench --cp-measure (launch/bench_cp_cuda.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "core/side_stream.h"
#include "core/text_file.h"
#include "kernels/cuda/cp_kernels.h"
#include "kernels/cuda/cuda_mixer.h"
#include "launch/bench_cp_cuda.h"
#include "parallel/cp_mixer.h"
#include "parallel/cp_model.h"

namespace statescan {
namespace {

enum class Fill { normal, gate, sigmoid };

__device__ __forceinline__ uint32_t mix32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

__device__ __forceinline__ void store(float* p, float x) {
  *p = x;
}
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16(x);
}
__device__ __forceinline__ void store(__half* p, float x) {
  *p = __float2half(x);
}

// fill_kernel: out[i] = f(N(0,1) from a hash of (seed, i)), f per Fill:
// the identity, logsigmoid(x + 4) (realistic gates) or sigmoid(x) (beta).
template <typename T>
__global__ void fill_kernel(T* out, int64_t n, uint64_t seed, Fill fill) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float u1 = (mix32(seed * 0x9E3779B97F4A7C15ull + 2 * i) + 1.f) * 2.3283064e-10f;
    const float u2 = mix32(seed * 0x9E3779B97F4A7C15ull + 2 * i + 1) * 2.3283064e-10f;
    float x = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    if (fill == Fill::gate) x = -log1pf(expf(-(x + 4.f)));
    if (fill == Fill::sigmoid) x = 1.f / (1.f + expf(-x));
    store(out + i, x);
  }
}

void fill(void* out, int64_t n, DType t, uint64_t seed, Fill f) {
  const unsigned blocks = 2048;
  switch (t) {
    case DType::f32:
      fill_kernel<<<blocks, 256>>>(static_cast<float*>(out), n, seed, f);
      break;
    case DType::bf16:
      fill_kernel<<<blocks, 256>>>(static_cast<__nv_bfloat16*>(out), n, seed, f);
      break;
    case DType::f16:
      fill_kernel<<<blocks, 256>>>(static_cast<__half*>(out), n, seed, f);
      break;
    default:
      SS_FAIL("dtype", "f32, bf16 or f16");
  }
  SS_LAUNCH_CHECK("fill_kernel");
}

// Median ms of each of `stages` consecutive stages over `iters` runs (after
// `warmup` untimed ones): run(mark) queues one iteration on `stream` and calls
// mark() stages + 1 times, before its first stage, between stages and after
// the last (what it queues after the last mark is untimed).
template <typename F>
std::vector<double> median_stage_ms(int warmup, int iters, cudaStream_t stream, int stages,
                                    F&& run) {
  std::vector<cudaEvent_t> marks(static_cast<std::size_t>(stages) + 1);
  for (auto& e : marks) SS_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<std::vector<double>> ms(static_cast<std::size_t>(stages));
  for (int i = 0; i < warmup + iters; ++i) {
    std::size_t at = 0;
    run([&] {
      SS_CHECK_ARG(at < marks.size(), "stages", "more than stages + 1 marks");
      SS_CUDA_CHECK(cudaEventRecord(marks[at++], stream));
    });
    SS_CHECK_ARG(at == marks.size(), "stages", at, " marks, expected ", marks.size());
    SS_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (i < warmup) continue;
    for (std::size_t k = 0; k < ms.size(); ++k) {
      float t = 0.f;
      SS_CUDA_CHECK(cudaEventElapsedTime(&t, marks[k], marks[k + 1]));
      ms[k].push_back(t);
    }
  }
  for (auto& e : marks) SS_CUDA_CHECK(cudaEventDestroy(e));
  std::vector<double> medians;
  for (auto& x : ms) {
    std::sort(x.begin(), x.end());
    medians.push_back(x[x.size() / 2]);
  }
  return medians;
}

// Median over `iters` timed runs (after `warmup` untimed ones) of the work
// fn() queues on `stream`.
template <typename F>
double median_ms(int warmup, int iters, cudaStream_t stream, F&& fn) {
  return median_stage_ms(warmup, iters, stream, 1, [&](auto&& mark) {
    mark();
    fn();
    mark();
  })[0];
}

struct Measured {
  Variant variant;
  double fwd_ms = 0, bwd_ms = std::numeric_limits<double>::quiet_NaN();
  double prepare_ms = 0, summary_ms = 0, finish_ms = 0;
  // The pre-pass as CpMixer runs it: from the backward's prepared tiles
  // (cuda::PreparedBackward), which the local backward then reuses, so only
  // its reverse scan is CP's; prepass_alone_ms is a standalone one (prepare
  // + scan), what it cost before the tiles were shared.
  // Delta rules: the pre-pass is one GEMM from the forward's first-segment
  // maps (cuda::first_segment_state_grad), which the summary computes;
  // prepass_scan_ms and summary_scan_ms are the reverse scan it replaced and
  // the summary without those maps. Additive rules: the scan.
  double prepass_ms = std::numeric_limits<double>::quiet_NaN();
  double prepass_scan_ms = std::numeric_limits<double>::quiet_NaN();
  double summary_scan_ms = std::numeric_limits<double>::quiet_NaN();
  double summary_first_ms = std::numeric_limits<double>::quiet_NaN();  // the maps alone
  double prepass_alone_ms = std::numeric_limits<double>::quiet_NaN();
  double bwd_prepare_ms = std::numeric_limits<double>::quiet_NaN();
  // Delta rules: what the pre-pass adds where CpMixer runs it, on the
  // exchange stream beside the backward's prepare stage (both queued at once;
  // the prepare's time alone subtracted, both medians of the same loop).
  // prepass_ms, the GEMMs on an idle GPU, is the figure `overhead` uses.
  double prepass_beside_ms = std::numeric_limits<double>::quiet_NaN();
  double beside_prepare_ms = std::numeric_limits<double>::quiet_NaN();
  double merge_fwd_ms = 0, merge_bwd_ms = 0;
  double summary_other_ms = std::numeric_limits<double>::quiet_NaN();
  double summary_e_ms = 0;  // E only (no M), the default method
  std::string other_name;   // the linear-part method of summary_other_ms
  // P = 1 (the issue's measured case): forward + backward through CpMixer on
  // one rank against the plain mixer with the same saved state, both by wall
  // clock (host work included: argument agreement, input checks, copies).
  double cp1_step_ms = std::numeric_limits<double>::quiet_NaN();
  double plain_step_ms = std::numeric_limits<double>::quiet_NaN();
  double cp1_unchecked_ms = std::numeric_limits<double>::quiet_NaN();  // check_finite off
  double cp1_min_ms = 0, cp1_max_ms = 0;                               // CpMixer's spread
  double plain_fwd_gpu_ms = 0, plain_bwd_gpu_ms = 0;                   // by events
  double cp1_overhead() const { return (cp1_step_ms - plain_step_ms) / plain_step_ms; }
  double cp1_unchecked_overhead() const {
    return (cp1_unchecked_ms - plain_step_ms) / plain_step_ms;
  }
  // CpMixer's own account of its last P = 1 step: wall time of forward and
  // backward, and the GPU time of their local work (events).
  CpStepStats cp1_fwd, cp1_bwd;
  std::string bwd_note;
  double overhead() const {
    return (summary_ms + prepass_ms + merge_fwd_ms + merge_bwd_ms) / (fwd_ms + bwd_ms);
  }
};

// The delta rules' pre-pass as CpMixer schedules it (parallel/cp_mixer_cuda.cpp,
// backward step 1): first_segment_state_grad on a second stream, forked when
// the backward's prepare stage is queued on `stream`, joined after it. Each
// iteration times the prepare stage alone, then both; the difference of the
// medians is the pre-pass's cost there (the exchange that follows it at P > 1
// is not included: none runs on one GPU).
void measure_prepass_beside_prepare(const CpMeasureOptions& o, const MixerParams& p,
                                    const MixerBwdParams& bp, const cuda::FirstSegmentMaps& first,
                                    const void* d_o, float* d_init, cudaStream_t stream,
                                    Measured& m) {
  SideStream side(stream);
  const std::vector<double> ms = median_stage_ms(o.warmup, o.iters, stream, 2, [&](auto&& mark) {
    mark();
    { cuda::PreparedBackward alone(bp, stream); }
    mark();
    side.fork();
    cuda::first_segment_state_grad(p, first, d_o, 0, 0, p.seq_len, nullptr, d_init, side.stream());
    { cuda::PreparedBackward beside(bp, stream); }
    side.join();
    mark();
  });
  m.beside_prepare_ms = ms[0];
  m.prepass_beside_ms = ms[1] - ms[0];
}

// P = 1, the issue's measured case: forward + backward through CpMixer on
// one rank (SingleRankCommunicator: what a one-GPU user of the CP layer runs)
// against the plain mixer (cuda::mixer_forward / mixer_backward) keeping the
// same state for backward (fp32 chunk states, and T where the variant saves
// it), both by wall clock. A second CpMixer with MixerConfig::check_finite off
// splits the NaN/Inf scan's share from the rest. The three steps take turns
// within every iteration, so that clock and power drift reach all of them
// alike, and the plain passes' GPU time is taken by events as well (against
// the mixer's own local_s). p, bp: the problem of measure() with its device
// buffers (its outputs and gradients are overwritten).
void measure_cp_single_rank(const CpMeasureOptions& o, Variant variant, const MixerParams& p,
                            const MixerBwdParams& bp, cudaStream_t stream, Measured& m) {
  const bool save_t = cuda::saved_t_supported(p);
  DeviceBuffer<unsigned char> saved_t(save_t ? cuda::saved_t_bytes(p) : 1);
  MixerParams pf = p;
  pf.saved_t = save_t ? saved_t.data() : nullptr;
  MixerBwdParams pb = bp;
  pb.saved_t = pf.saved_t;
  const size_t ws_bytes = cuda::forward_workspace_bytes(pf);
  DeviceBuffer<unsigned char> ws(ws_bytes);

  SingleRankCommunicator comm;
  MixerConfig cfg;
  cfg.variant = variant;
  cfg.chunk = p.chunk;
  cfg.l2norm_qk = p.l2norm_qk;  // the scale: Dk^-1/2 in both
  cfg.save_t = save_t;
  CpMixer mixer(comm, cfg, Exchange::automatic);
  MixerConfig unchecked_cfg = cfg;
  unchecked_cfg.check_finite = false;
  CpMixer unchecked(comm, unchecked_cfg, Exchange::automatic);
  const Memory dev = Memory::device;
  const Shape qk{1, p.seq_len, p.heads, p.dk}, bth{1, p.seq_len, p.heads};
  const Shape states{1, p.heads, p.dk, p.dv};
  const Shape gate = vector_gate(variant) ? qk : bth;
  // TensorView holds mutable pointers; the inputs are only read.
  const auto in = [](const void* x) { return const_cast<void*>(x); };
  CpForwardArgs fa;
  fa.q = TensorView(in(p.q), p.dtype, qk, dev);
  fa.k = TensorView(in(p.k), p.dtype, qk, dev);
  fa.v = TensorView(in(p.v), p.dtype, qk, dev);
  if (p.g != nullptr) fa.g = TensorView(in(p.g), DType::f32, gate, dev);
  if (p.beta != nullptr) fa.beta = TensorView(in(p.beta), p.dtype, bth, dev);
  fa.o = TensorView(p.o, p.dtype, qk, dev);
  fa.final_state = TensorView(p.final_state, DType::f32, states, dev);
  CpBackwardArgs ba;
  ba.d_o = TensorView(in(bp.d_o), p.dtype, qk, dev);
  ba.dq = TensorView(bp.dq, p.dtype, qk, dev);
  ba.dk = TensorView(bp.dk_out, p.dtype, qk, dev);
  ba.dv = TensorView(bp.dv_out, p.dtype, qk, dev);
  if (bp.dg != nullptr) ba.dg = TensorView(bp.dg, DType::f32, gate, dev);
  if (bp.dbeta != nullptr) ba.dbeta = TensorView(bp.dbeta, p.dtype, bth, dev);
  ba.d_initial_state = TensorView(bp.d_initial_state, DType::f32, states, dev);

  cudaEvent_t marks[3];
  for (auto& e : marks) SS_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<double> plain, cp, cp_unchecked, plain_fwd, plain_bwd;
  const auto wall = [](auto&& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    const double t_plain = wall([&] {
      SS_CUDA_CHECK(cudaEventRecord(marks[0], stream));
      cuda::mixer_forward(pf, ws.data(), ws_bytes, stream);
      SS_CUDA_CHECK(cudaEventRecord(marks[1], stream));
      cuda::mixer_backward(pb, stream);
      SS_CUDA_CHECK(cudaEventRecord(marks[2], stream));
      SS_CUDA_CHECK(cudaStreamSynchronize(stream));
    });
    const double t_cp = wall([&] {
      mixer.forward(fa);
      mixer.backward(ba);
    });
    const double t_unchecked = wall([&] {
      unchecked.forward(fa);
      unchecked.backward(ba);
    });
    if (i < o.warmup) continue;
    float f = 0.f, b = 0.f;
    SS_CUDA_CHECK(cudaEventElapsedTime(&f, marks[0], marks[1]));
    SS_CUDA_CHECK(cudaEventElapsedTime(&b, marks[1], marks[2]));
    plain.push_back(t_plain);
    cp.push_back(t_cp);
    cp_unchecked.push_back(t_unchecked);
    plain_fwd.push_back(f);
    plain_bwd.push_back(b);
  }
  for (auto& e : marks) SS_CUDA_CHECK(cudaEventDestroy(e));
  const auto median = [](std::vector<double>& x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  m.plain_step_ms = median(plain);
  m.cp1_step_ms = median(cp);
  m.cp1_min_ms = cp.front();  // the spread shows steps that vary (PERF_NOTES,
  m.cp1_max_ms = cp.back();   // twenty-second session: workspace placement)
  m.cp1_unchecked_ms = median(cp_unchecked);
  m.plain_fwd_gpu_ms = median(plain_fwd);
  m.plain_bwd_gpu_ms = median(plain_bwd);
  m.cp1_fwd = mixer.last_forward_stats();
  m.cp1_bwd = mixer.last_backward_stats();
}

Measured measure(const CpMeasureOptions& o, Variant variant, cudaStream_t stream) {
  const int64_t T = o.seq_len, H = o.heads, D = o.dim;
  const int64_t tokens = T * H;
  const int64_t chunks = (T + o.chunk - 1) / o.chunk;
  const std::size_t elem = size_of(o.dtype);
  DeviceBuffer<unsigned char> q(tokens * D * elem), k(tokens * D * elem), v(tokens * D * elem),
      out(tokens * D * elem), d_o(tokens * D * elem), dq(tokens * D * elem), dk(tokens * D * elem),
      dv(tokens * D * elem), beta(tokens * elem), dbeta(tokens * elem);
  const int64_t g_count = has_gate(variant) ? (vector_gate(variant) ? tokens * D : tokens) : 0;
  DeviceBuffer<float> g(std::max<int64_t>(g_count, 1)), dg(std::max<int64_t>(g_count, 1));
  DeviceBuffer<float> states(static_cast<std::size_t>(chunks * H * D * D)), final_state(H * D * D),
      d_init(H * D * D), M(H * D * D), E(H * D * D), S(H * D * D), S_out(H * D * D), Mt(H * D * D),
      first_P(H * D * D);
  const bool delta = has_beta(variant);
  DeviceBuffer<unsigned char> first_H(delta ? tokens * D * elem : 1);
  // The first segment's maps as the summary about to run makes them (its
  // piece count depends on whether E runs beside, and on the method); the
  // pre-pass below reads the last ones made.
  cuda::FirstSegmentMaps first{first_P.data(), first_H.data()};
  std::unique_ptr<DeviceBuffer<float>> piece_P;
  auto first_maps_for = [&](const MixerParams& mp, bool with_E) -> cuda::FirstSegmentMaps* {
    if (!delta) return nullptr;
    first.pieces = cuda::summary_pieces(mp, with_E);
    const std::size_t need = static_cast<std::size_t>(first.pieces * H * D * D);
    if (first.pieces > 1 && (!piece_P || piece_P->size() < need))
      piece_P = std::make_unique<DeviceBuffer<float>>(need);
    first.piece_P = first.pieces > 1 ? piece_P->data() : nullptr;
    return &first;
  };
  fill(q.data(), tokens * D, o.dtype, 1, Fill::normal);
  fill(k.data(), tokens * D, o.dtype, 2, Fill::normal);
  fill(v.data(), tokens * D, o.dtype, 3, Fill::normal);
  fill(d_o.data(), tokens * D, o.dtype, 4, Fill::normal);
  fill(beta.data(), tokens, o.dtype, 5, Fill::sigmoid);
  if (g_count > 0) fill(g.data(), g_count, DType::f32, 6, Fill::gate);
  fill(S.data(), H * D * D, DType::f32, 7, Fill::normal);
  SS_CUDA_CHECK(cudaDeviceSynchronize());

  MixerParams p;
  p.variant = variant;
  p.batch = 1;
  p.seq_len = T;
  p.heads = H;
  p.dk = p.dv = D;
  p.chunk = o.chunk;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  p.l2norm_qk = true;  // random q, k: let the op normalise them, as KDA/GDN models do
  p.dtype = o.dtype;
  p.num_segments = 1;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.g = has_gate(variant) ? g.data() : nullptr;
  p.beta = has_beta(variant) ? beta.data() : nullptr;
  p.o = out.data();
  p.final_state = final_state.data();
  p.chunk_states = states.data();

  Measured m;
  m.variant = variant;
  const size_t ws_bytes = cuda::forward_workspace_bytes(p);
  DeviceBuffer<unsigned char> ws(ws_bytes);
  m.fwd_ms = median_ms(o.warmup, o.iters, stream,
                       [&] { cuda::mixer_forward(p, ws.data(), ws_bytes, stream); });

  // The CP forward's pieces: prepare once, summary (with the first-segment
  // maps where the backward takes its pre-pass from them), then scan + output.
  const std::vector<double> fwd_pieces =
      median_stage_ms(o.warmup, o.iters, stream, 3, [&](auto&& mark) {
        mark();
        cuda::PreparedForward prepared(p, stream);
        mark();
        prepared.summary(M.data(), E.data(), stream, true, first_maps_for(p, true));
        mark();
        prepared.finish(stream);
        mark();
      });
  m.prepare_ms = fwd_pieces[0];
  m.summary_ms = fwd_pieces[1];
  m.finish_ms = fwd_pieces[2];

  // E alone (what the first rank computes), by the default method; and the
  // summary without the first-segment maps.
  {
    cuda::PreparedForward prepared(p, stream);
    m.summary_e_ms = median_ms(o.warmup, o.iters, stream,
                               [&] { prepared.summary(M.data(), E.data(), stream, false); });
    if (delta) {
      m.summary_scan_ms = median_ms(o.warmup, o.iters, stream,
                                    [&] { prepared.summary(M.data(), E.data(), stream); });
      m.summary_first_ms = median_ms(o.warmup, o.iters, stream, [&] {
        prepared.summary(M.data(), nullptr, stream, false, first_maps_for(p, false));
      });
    }
  }
  // The summary again with the other way of computing the delta rules' (M, E).
  if (has_beta(variant)) {
    const cuda::LinearPart saved = cuda::summary_linear_part();
    cuda::set_summary_linear_part(saved == cuda::LinearPart::scan ? cuda::LinearPart::products
                                                                  : cuda::LinearPart::scan);
    cuda::PreparedForward prepared(p, stream);
    m.summary_other_ms = median_ms(o.warmup, o.iters, stream, [&] {
      prepared.summary(M.data(), E.data(), stream, true, first_maps_for(p, true));
    });
    cuda::set_summary_linear_part(saved);
    m.other_name = saved == cuda::LinearPart::scan ? "products" : "scan";
    // Back to the default method's maps (and M, E) for the pre-pass below.
    prepared.summary(M.data(), E.data(), stream, true, first_maps_for(p, true));
  }

  // Merge-side map work: S_in = M S + E for every head (forward), plus M^T
  // (backward; the reverse scan applies M^T S + D).
  cuda::DeviceMaps maps;
  maps.maps = H;
  maps.dk = D;
  maps.dv = D;
  maps.diagonal = !has_beta(variant);
  maps.M = M.data();
  maps.E = E.data();
  m.merge_fwd_ms = median_ms(o.warmup, o.iters, stream, [&] {
    cuda::apply_affine_maps(maps, S.data(), S_out.data(), 0, D, stream);
  });
  m.merge_bwd_ms = median_ms(o.warmup, o.iters, stream, [&] {
    if (!maps.diagonal) cuda::transpose_maps(M.data(), Mt.data(), H, D, stream);
    cuda::apply_affine_maps(maps, S.data(), S_out.data(), 0, D, stream);
  });

  // Backward: the local pass and the CP pre-pass. The chunk states are the
  // last forward's (the same inputs), as in training.
  MixerBwdParams bp;
  static_cast<MixerParams&>(bp) = p;
  bp.d_o = d_o.data();
  bp.d_initial_state = d_init.data();
  try {
    MixerBwdParams pre = bp;
    pre.state_grad_only = true;
    m.prepass_alone_ms =
        median_ms(o.warmup, o.iters, stream, [&] { cuda::mixer_backward(pre, stream); });
    bp.dq = dq.data();
    bp.dk_out = dk.data();
    bp.dv_out = dv.data();
    bp.dg = has_gate(variant) ? dg.data() : nullptr;
    bp.dbeta = has_beta(variant) ? dbeta.data() : nullptr;
    m.bwd_ms = median_ms(o.warmup, o.iters, stream, [&] { cuda::mixer_backward(bp, stream); });
    // A middle rank's backward: prepare once, the pre-pass, the local pass
    // (untimed here: bwd_ms is the whole local backward).
    const std::vector<double> bwd_pieces =
        median_stage_ms(o.warmup, o.iters, stream, 2, [&](auto&& mark) {
          mark();
          cuda::PreparedBackward prepared(bp, stream);
          mark();
          prepared.run(pre, stream);
          mark();
          prepared.run(bp, stream);
        });
    m.bwd_prepare_ms = bwd_pieces[0];
    m.prepass_ms = bwd_pieces[1];
    if (delta) {
      // A middle rank's pre-pass from the maps of the last summary above.
      m.prepass_scan_ms = bwd_pieces[1];
      m.prepass_ms = median_ms(o.warmup, o.iters, stream, [&] {
        cuda::first_segment_state_grad(p, first, d_o.data(), 0, 0, T, nullptr, d_init.data(),
                                       stream);
      });
      measure_prepass_beside_prepare(o, p, bp, first, d_o.data(), d_init.data(), stream, m);
    }
    measure_cp_single_rank(o, variant, p, bp, stream, m);
  } catch (const Error& err) {
    m.bwd_note = err.what();
    SS_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return m;
}

std::string fmt(const char* format, double x) {
  if (!std::isfinite(x)) return "N/A";
  char buf[64];
  std::snprintf(buf, sizeof buf, format, x);
  return buf;
}

}  // namespace

int run_cp_measure(const CpMeasureOptions& o, std::ostream& out) {
  // No GPU is a failed run (exit 3), as for the other tables, not a usage error.
  if (!cuda::device_available()) SS_FAIL("cuda", "--cp-measure needs a CUDA device");
  SS_CHECK_ARG(o.dim == 64 || o.dim == 128, "--dim", "must be 64 or 128");
  SS_CHECK_ARG(o.iters >= 1 && o.warmup >= 0, "-n", "iters >= 1, warmup >= 0");
  SS_CHECK_ARG(!o.variants.empty(), "--variant", "at least one variant");
  cudaStream_t stream;
  SS_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaDeviceProp prop{};
  int device = 0;
  SS_CUDA_CHECK(cudaGetDevice(&device));
  SS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));

  char line[1024];
  std::snprintf(
      line, sizeof line,
      "# statescan-bench --cp-measure: context-parallel overhead on one GPU (%s)\n"
      "#  T=%lld tokens/rank  H=%lld  D=%lld  chunk=%lld  dtype=%s  l2norm on  "
      "median of %d after %d warm-up\n"
      "#  overhead = (summary + pre-pass + merge fwd + merge bwd) / (fwd + bwd); "
      "target < 5%% (issue 5)\n"
      "#  a middle rank's work (the first and last ranks skip parts); summary M by %s;\n"
      "#  pre-pass: its reverse scan on the prepared tiles the local backward reuses\n#\n",
      prop.name, static_cast<long long>(o.seq_len), static_cast<long long>(o.heads),
      static_cast<long long>(o.dim), static_cast<long long>(o.chunk), to_string(o.dtype), o.iters,
      o.warmup, cuda::summary_linear_part() == cuda::LinearPart::scan ? "scan" : "products");
  out << line;
  std::snprintf(line, sizeof line,
                "# %-15s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n"
                "# %-15s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n",
                "variant", "fwd", "bwd", "prepare", "summary", "scan+out", "pre-pass", "merge-f",
                "merge-b", "overhead", "target", "", "(ms)", "(ms)", "(ms)", "(ms)", "(ms)", "(ms)",
                "(ms)", "(ms)", "(%)", "");
  out << line;
  std::vector<Measured> rows;
  int code = 0;
  for (Variant v : o.variants) {
    const Measured m = measure(o, v, stream);
    const double overhead = m.overhead();
    const bool met = std::isfinite(overhead) && overhead < 0.05;
    if (std::isfinite(overhead) && !met) code = 1;
    std::snprintf(line, sizeof line, "  %-15s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n",
                  to_string(v), fmt("%.3f", m.fwd_ms).c_str(), fmt("%.3f", m.bwd_ms).c_str(),
                  fmt("%.3f", m.prepare_ms).c_str(), fmt("%.3f", m.summary_ms).c_str(),
                  fmt("%.3f", m.finish_ms).c_str(), fmt("%.3f", m.prepass_ms).c_str(),
                  fmt("%.4f", m.merge_fwd_ms).c_str(), fmt("%.4f", m.merge_bwd_ms).c_str(),
                  fmt("%.2f", 100 * overhead).c_str(),
                  std::isfinite(overhead) ? (met ? "met" : "MISSED") : "N/A");
    out << line;
    if (!m.bwd_note.empty()) out << "#   bwd/pre-pass not measured: " << m.bwd_note << "\n";
    if (std::isfinite(m.prepass_alone_ms)) {
      std::snprintf(line, sizeof line,
                    "#   pre-pass = its scan on the backward's prepared tiles (shared with the "
                    "local backward, prepare %.3f ms); standalone (prepare + scan): %.3f ms\n",
                    m.bwd_prepare_ms, m.prepass_alone_ms);
      out << line;
    }
    std::snprintf(line, sizeof line, "#   summary E only (first rank): %.3f ms\n", m.summary_e_ms);
    out << line;
    if (std::isfinite(m.prepass_scan_ms)) {
      const double before = (m.summary_scan_ms + m.prepass_scan_ms + m.merge_fwd_ms +
                             m.merge_bwd_ms) /
                            (m.fwd_ms + m.bwd_ms);
      std::snprintf(line, sizeof line,
                    "#   pre-pass = one GEMM from the summary's first-segment maps (H, P); "
                    "the maps alone (last rank) %.3f ms; without them: summary %.3f ms, "
                    "pre-pass scan %.3f ms -> overhead %s%%\n",
                    m.summary_first_ms, m.summary_scan_ms, m.prepass_scan_ms,
                    fmt("%.2f", 100 * before).c_str());
      out << line;
    }
    if (std::isfinite(m.prepass_beside_ms)) {
      const double beside = (m.summary_ms + m.prepass_beside_ms + m.merge_fwd_ms + m.merge_bwd_ms) /
                            (m.fwd_ms + m.bwd_ms);
      std::snprintf(line, sizeof line,
                    "#   pre-pass beside the backward's prepare stage, as CpMixer runs it (a "
                    "second stream): adds %.3f ms to the prepare's %.3f -> overhead %s%% with "
                    "that figure (the exchange after it, at P > 1, not included)\n",
                    m.prepass_beside_ms, m.beside_prepare_ms, fmt("%.2f", 100 * beside).c_str());
      out << line;
    }
    if (std::isfinite(m.summary_other_ms)) {
      const double other = (m.summary_other_ms + m.prepass_ms + m.merge_fwd_ms + m.merge_bwd_ms) /
                           (m.fwd_ms + m.bwd_ms);
      std::snprintf(line, sizeof line,
                    "#   summary with M by %s (STATESCAN_CP_LINEAR=%s): %.3f ms -> overhead %s%%\n",
                    m.other_name.c_str(), m.other_name.c_str(), m.summary_other_ms,
                    fmt("%.2f", 100 * other).c_str());
      out << line;
    }
    if (std::isfinite(m.cp1_step_ms)) {
      std::snprintf(line, sizeof line,
                    "#   P = 1 (wall clock, host work included, the three taking turns): forward + "
                    "backward through CpMixer %.3f ms (%.3f-%.3f), the plain mixer %.3f ms -> "
                    "overhead %s%%; without the NaN/Inf scan (check_finite off) %.3f ms -> %s%%\n",
                    m.cp1_step_ms, m.cp1_min_ms, m.cp1_max_ms, m.plain_step_ms,
                    fmt("%.2f", 100 * m.cp1_overhead()).c_str(), m.cp1_unchecked_ms,
                    fmt("%.2f", 100 * m.cp1_unchecked_overhead()).c_str());
      out << line;
      std::snprintf(
          line, sizeof line,
          "#     GPU time by events: plain forward %.3f, backward %.3f ms; CpMixer's last "
          "step: forward %.3f ms wall (local %.3f), backward %.3f ms wall (local %.3f "
          "+ prepare %.3f)\n",
          m.plain_fwd_gpu_ms, m.plain_bwd_gpu_ms, 1e3 * m.cp1_fwd.total_s, 1e3 * m.cp1_fwd.local_s,
          1e3 * m.cp1_bwd.total_s, 1e3 * m.cp1_bwd.local_s, 1e3 * m.cp1_bwd.prepare_s);
      out << line;
    }
    rows.push_back(m);
  }
  out << "#\n";

  // The scaling model with the measured local times (bwd modelled as 2 x fwd
  // where it could not be measured, and said so).
  for (const Measured& m : rows) {
    CpLayer layer;
    layer.variant = m.variant;
    layer.batch = 1;
    layer.seq_len = o.seq_len;
    layer.heads = o.heads;
    layer.dk = layer.dv = o.dim;
    layer.chunk = o.chunk;
    layer.dtype = o.dtype;
    const bool have_bwd = std::isfinite(m.bwd_ms);
    CpLocalTimes times = estimate_local_times(layer, m.fwd_ms, have_bwd ? m.bwd_ms : -1);
    times.summary_fwd_ms = m.summary_ms;
    // P = 2: the first rank's E beside the last rank's maps (delta rules).
    times.summary_fwd_first_ms = std::isfinite(m.summary_first_ms)
                                     ? std::max(m.summary_e_ms, m.summary_first_ms)
                                     : m.summary_e_ms;
    if (std::isfinite(m.prepass_ms)) times.summary_bwd_ms = m.prepass_ms;
    // The reverse exchange hides behind the backward's prepare stage (delta
    // rules, CpLocalTimes): the one measured now.
    if (std::isfinite(m.beside_prepare_ms)) times.bwd_prepare_ms = m.beside_prepare_ms;
    times.merge_ms = 0.5 * (m.merge_fwd_ms + m.merge_bwd_ms);
    CpModelConfig config;
    config.link = link_preset(o.link, o.gpus_per_node);
    config.overlap = o.overlap;
    config.max_ranks = o.max_ranks;
    std::vector<std::string> notes{
        std::string("fwd, summary fwd, merge: measured now on ") + prop.name,
        have_bwd ? "bwd, summary bwd (pre-pass): measured now"
                 : "bwd: ASSUMED from the README's bwd/fwd ratio, summary bwd MODELLED (the GPU "
                   "backward did not run)",
        std::string("link preset: ") + to_string(o.link)};
    if (std::isfinite(m.beside_prepare_ms))
      notes.push_back("bwd prepare (the reverse exchange hides behind it): measured now");
    else if (times.bwd_prepare_ms > 0)
      notes.push_back(
          "bwd prepare: NOT measured here: its share of bwd in an H200 --cp-measure run "
          "(parallel/cp_model.cpp)");
    const CpModelResult result = predict_cp_scaling(layer, times, config);
    out << format_cp_model_table(layer, times, config, result, notes);
  }

  if (!o.json_path.empty()) {
    std::ostringstream f;
    f << "[";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Measured& m = rows[i];
      const auto num = json_number;
      f << (i ? ",\n " : "\n ") << "{\"variant\": \"" << to_string(m.variant)
        << "\", \"seq_len\": " << o.seq_len << ", \"heads\": " << o.heads << ", \"dim\": " << o.dim
        << ", \"dtype\": \"" << to_string(o.dtype) << "\", \"fwd_ms\": " << num(m.fwd_ms)
        << ", \"bwd_ms\": " << num(m.bwd_ms) << ", \"prepare_ms\": " << num(m.prepare_ms)
        << ", \"summary_ms\": " << num(m.summary_ms) << ", \"scan_output_ms\": " << num(m.finish_ms)
        << ", \"prepass_ms\": " << num(m.prepass_ms)
        << ", \"prepass_alone_ms\": " << num(m.prepass_alone_ms)
        << ", \"prepass_beside_ms\": " << num(m.prepass_beside_ms)
        << ", \"cp1_step_ms\": " << num(m.cp1_step_ms)
        << ", \"plain_step_ms\": " << num(m.plain_step_ms)
        << ", \"cp1_unchecked_ms\": " << num(m.cp1_unchecked_ms)
        << ", \"cp1_min_ms\": " << num(m.cp1_min_ms) << ", \"cp1_max_ms\": " << num(m.cp1_max_ms)
        << ", \"plain_fwd_gpu_ms\": " << num(m.plain_fwd_gpu_ms)
        << ", \"plain_bwd_gpu_ms\": " << num(m.plain_bwd_gpu_ms)
        << ", \"summary_scan_ms\": " << num(m.summary_scan_ms)
        << ", \"prepass_scan_ms\": " << num(m.prepass_scan_ms)
        << ", \"bwd_prepare_ms\": " << num(m.bwd_prepare_ms)
        << ", \"merge_fwd_ms\": " << num(m.merge_fwd_ms)
        << ", \"merge_bwd_ms\": " << num(m.merge_bwd_ms) << ", \"overhead\": " << num(m.overhead())
        << "}";
    }
    f << "\n]\n";
    write_text_file(o.json_path, f.str(), "--json");
  }
  SS_CUDA_CHECK(cudaStreamDestroy(stream));
  return code;
}

}  // namespace statescan
