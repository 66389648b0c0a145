// The CP summary on the GPU (DESIGN §5): the affine map S_end = M S_start + E
// of the last segment of every batch row, from the chunkwise forward's own
// prepare and scan kernels, plus PreparedForward, which lets the CP mixer
// share one prepare stage between the summary and the local forward.
//
// E is the scan from the segment's initial state with outputs switched off.
// M for delta rules: the scan's per-chunk update S <- diag(d) S + K_^T (U - W S)
// is affine in S with linear part (diag(d) - K_^T W); scanning from S = I with
// U = 0 therefore yields the product of the chunk maps, i.e. M (the kernels
// need Dk == Dv, so the Dk x Dk map fits the Dk x Dv state exactly). Reusing
// the scan keeps M bit-consistent with how the forward carries states (bf16
// operands rounded as the forward rounds them, fp32 accumulation).
// The first segments' maps (FirstSegmentMaps, the CP backward's pre-pass):
// the same identity scan over each row's first segment with the output stage
// on, whose outputs are then H_t = d o_t / d S0 (o_t = Q^_t S + the intra
// terms through V' = U - W S, with U = 0 and S = P_c) and whose final state is
// P; it replaces M's scan where that segment is also the last.
// M for additive rules: the diagonal prod alpha = exp(sum of g over the
// segment), summed in fp64 as the CPU path does.
#include <cublas_v2.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_pool.h"
#include "core/env_knob.h"
#include "core/side_stream.h"
#include "kernels/cuda/blas_handle.h"
#include "kernels/cuda/cp_kernels.h"
#include "kernels/cuda/cuda_mixer.h"
#include "kernels/cuda/forward_plan.cuh"
#include "kernels/cuda/launch.cuh"

namespace statescan::cuda {
namespace {

using detail::ForwardArgs;
using detail::ForwardPlan;

// additive_decay_kernel: M[row, h, d] = exp(sum_{t in [begin, end)} g[row, t, h, d])
// (scalar gates broadcast over d; ones without decay).
//   grid (rows * H, ceil(Dk / 32)), 256 threads = 32 key dims x 8 token lanes;
//   each lane sums every 8th token in fp64, the lanes reduce in shared memory.
__global__ void additive_decay_kernel(const float* g, bool vector_gate, int64_t seq_len,
                                      int64_t heads, int64_t dk, int64_t begin, int64_t end,
                                      float* M) {
  __shared__ double partial[8][32];
  const int64_t row = blockIdx.x / heads, h = blockIdx.x % heads;
  const int lane_d = threadIdx.x % 32, lane_t = threadIdx.x / 32;
  const int64_t d = blockIdx.y * 32 + lane_d;
  double sum = 0.0;
  if (g != nullptr && d < dk) {
    for (int64_t t = begin + lane_t; t < end; t += 8) {
      const int64_t token = row * seq_len + t;
      sum += vector_gate ? g[(token * heads + h) * dk + d] : g[token * heads + h];
    }
  }
  partial[lane_t][lane_d] = sum;
  __syncthreads();
  if (lane_t == 0 && d < dk) {
    double total = 0.0;
    for (int i = 0; i < 8; ++i) total += partial[i][lane_d];
    M[(row * heads + h) * dk + d] = static_cast<float>(exp(total));
  }
}

// diag_kernel: maps[b] = diag(decay[first_tile + b]) for b < count, Dk x Dk
// fp32 each (decay: [tiles, Dk], the per-chunk e^{b_C}); one thread per element.
__global__ void diag_kernel(float* maps, const float* decay, int64_t first_tile, int64_t count,
                            int64_t dk) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= count * dk * dk) return;
  const int64_t b = idx / (dk * dk), i = (idx / dk) % dk, j = idx % dk;
  maps[idx] = i == j ? decay[(first_tile + b) * dk + i] : 0.f;
}

// The process-wide choice of summary_linear_part(): STATESCAN_CP_LINEAR=products
// selects the product tree (M and E), unset or `scan` the scans (any other
// value is an error naming the variable).
LinearPart& linear_part_setting() {
  static LinearPart part = env_choice("STATESCAN_CP_LINEAR", {"scan", "products"}) == 1
                               ? LinearPart::products
                               : LinearPart::scan;
  return part;
}

bool linear_part_by_products_enabled() {
  return linear_part_setting() == LinearPart::products;
}

SummaryScan& summary_scan_setting() {
  static SummaryScan scan = [] {
    switch (env_choice("STATESCAN_SUMMARY_SCAN", {"auto", "per-head", "blocks", "two-level"})) {
      case 1:
        return SummaryScan::per_head;
      case 2:
        return SummaryScan::blocks;
      case 3:
        return SummaryScan::two_level;
      default:
        return SummaryScan::automatic;
    }
  }();
  return scan;
}

// Whether the per-head scans (chunk_scan_wgmma.cuh) can run `p`: delta
// rules, 16-bit, Dk = Dv = 128, chunk 64, a build with sm_90a code on a 9.0
// device, and not STATESCAN_SCAN=wmma (the A/B knob the block scans honour:
// the per-head launch refuses it, which failed every CP step under it).
bool per_head_supported(const MixerParams& p) {
  // Two attribute queries once per summary: cheap enough not to cache.
  int device = 0;
  SS_CUDA_CHECK(cudaGetDevice(&device));
  return detail::wgmma_device(device) && has_beta(p.variant) && p.dtype != DType::f32 &&
         p.dk == 128 && p.dv == 128 && p.chunk == 64 && !detail::scan_wmma_forced();
}

// Whether the summary's final-state-only scans (E, and M's identity scan) run
// as one CTA per head and segment (chunk_scan_wgmma.cuh) where
// summary_scan() asks for it. `automatic` takes it where the column
// blocks would need more than one wave even at 32 columns
// (heads x segments x Dv / 32 > SMs): a per-head step was ~2.6 us against
// ~1.0 (16 columns, one wave) or ~1.45 us per wave (32 columns), so it lost
// at H = 16 (E 5.1 ms against 2.0 at 128K tokens) and won from H = 64
// (1.30 against 1.49 ms at 32K; 0.63 against 1.49 at H = 128, 16K: H200,
// 2026-12-03, PERF_NOTES). Its tiles now come by TMA (~1.5 us a step): the
// threshold may now be conservative, not re-measured.
bool per_head_scan(const MixerParams& p, int64_t heads_segments, int num_sms) {
  const SummaryScan want = summary_scan_setting();
  if (want == SummaryScan::blocks || !per_head_supported(p)) return false;
  return want == SummaryScan::per_head || heads_segments * (p.dv / 32) > num_sms;
}

// Occupancy probe for the pair kernel's shape: one CTA of 256 threads per
// multiprocessor, bound by shared memory whatever the instance (every one
// needs fewer than 256 registers a thread, so registers never bind).
__global__ void pair_scan_probe_kernel() {}

// Pairs of CTAs (E's run beside its maps, chunk_state_scan_wgmma_pair_kernel)
// the device holds at once: clusters of two must fit inside a GPC, so this
// can be less than half the multiprocessors. Once per device.
struct PairScanCapacityTag {};
int64_t pair_scan_capacity() {
  return detail::cached_device_check<PairScanCapacityTag>(0, 0, [](int, int64_t, int64_t) {
    constexpr size_t bytes = std::max(detail::pair_scan_bytes<detail::WgmmaScan::maps>(),
                                      detail::pair_scan_bytes<detail::WgmmaScan::maps_out>());
    return static_cast<int64_t>(detail::active_clusters(
        pair_scan_probe_kernel, detail::ScanWgmmaTraits<detail::WgmmaScan::state>::kThreads, bytes,
        2));
  });
}

// Run g of `pieces` nearly equal runs of n chunks: chunks [first, first + count).
void piece_chunks(int64_t n, int64_t pieces, int64_t g, int64_t& first, int64_t& count) {
  first = n * g / pieces;
  count = n * (g + 1) / pieces - first;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

// The delta rules' summary (M, E) of `count` chunks starting at global chunk
// `first`, as a product tree instead of a scan: each chunk's affine map
//   M_c = diag(d_c) - K_c^T W_c,   E_c = K_c^T U_c
// (two batched GEMMs over every chunk and head, from the prepared tiles), then
// log2(count) levels of batched GEMMs composing neighbours,
//   (M', E') = (M_{2i+1} M_{2i}, M_{2i+1} E_{2i} + E_{2i+1}),
// and finally E += M S_0 for an initial state S_0 ([H, Dk, Dv], may be null).
// Parallel over chunks where the scan walks them one by one. 16-bit inputs
// compose on TF32 tensor cores (their states are carried at 16-bit precision
// anyway), fp32 inputs with fp32 GEMMs. Writes M [H, Dk, Dk] (when M_out is
// not null) and E [H, Dk, Dv].
//
// cuBLAS is column-major: a row-major r x c array with row stride c is its
// c x r transpose there, so row-major Y = A B + C is computed as
// Y^T = B^T A^T + C^T (operands swapped).
void summary_by_products(const MixerParams& p, const ForwardArgs& a, int64_t first, int64_t count,
                         const float* initial_state, float* M_out, float* E_out,
                         cudaStream_t stream) {
  const int64_t H = p.heads, D = p.dk, Dv = p.dv, C = p.chunk, D2 = D * D, DE = D * Dv;
  cublasHandle_t handle = detail::blas_handle(stream, detail::BlasSlot::summary);
  // Two levels' worth of maps: level L in (m_a, e_a) or (m_b, e_b) alternately.
  const int64_t half = (count + 1) / 2;
  auto floats = [&](int64_t n) { return PoolArray<float>(static_cast<size_t>(n), stream); };
  const PoolArray<float> maps_a = floats(count * H * D2), adds_a = floats(count * H * DE),
                         maps_b = floats(half * H * D2), adds_b = floats(half * H * DE);
  float *m_a = maps_a.get(), *e_a = adds_a.get(), *m_b = maps_b.get(), *e_b = adds_b.get();
  const int64_t n = count * H * D2;
  diag_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(m_a, a.ws_decay,
                                                                          first * H, count * H, D);
  SS_LAUNCH_CHECK("diag_kernel");
  const float minus_one = -1.f, one = 1.f, zero = 0.f;
  const size_t elem = size_of(p.dtype);
  const size_t tile0 = static_cast<size_t>(first * H);
  const char* ws_k = static_cast<const char*>(a.ws_k) + tile0 * C * D * elem;
  const char* ws_w = static_cast<const char*>(a.ws_w) + tile0 * C * D * elem;
  const char* ws_u = static_cast<const char*>(a.ws_u) + tile0 * C * Dv * elem;
  const cudaDataType_t t = cuda_type(p.dtype);
  const int batch0 = static_cast<int>(count * H);
  // M_c = diag - K^T W:  M^T = -(W^T)(K^T)^T + diag.
  SS_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(D), static_cast<int>(D),
      static_cast<int>(C), &minus_one, ws_w, t, static_cast<int>(D), C * D, ws_k, t,
      static_cast<int>(D), C * D, &one, m_a, CUDA_R_32F, static_cast<int>(D), D2, batch0,
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  // E_c = K^T U:  E^T = (U^T)(K^T)^T.
  SS_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(Dv), static_cast<int>(D),
      static_cast<int>(C), &one, ws_u, t, static_cast<int>(Dv), C * Dv, ws_k, t,
      static_cast<int>(D), C * D, &zero, e_a, CUDA_R_32F, static_cast<int>(Dv), DE, batch0,
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));

  const cublasComputeType_t tree_compute =
      p.dtype == DType::f32 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32;
  // Device pointer arrays of one level: M pairs (A, B, C) then E pairs (A, B, C).
  const int64_t max_batch = (count / 2 + 1) * H;
  const PoolArray<void*> pointers(static_cast<size_t>(6 * max_batch), stream);
  void** ptrs = pointers.get();
  std::vector<void*> host;
  float *cur_m = m_a, *cur_e = e_a, *nxt_m = m_b, *nxt_e = e_b;
  int64_t m = count;
  while (m > 1) {
    const int64_t pairs = m / 2;
    const int64_t batch = pairs * H;
    host.assign(static_cast<size_t>(6 * batch), nullptr);
    for (int64_t i = 0; i < pairs; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t b = i * H + h;
        const int64_t lo = (2 * i) * H + h, hi = (2 * i + 1) * H + h, out = i * H + h;
        // M' = M_hi M_lo:  M'^T = M_lo^T M_hi^T.
        host[b] = cur_m + lo * D2;
        host[batch + b] = cur_m + hi * D2;
        host[2 * batch + b] = nxt_m + out * D2;
        // E' = M_hi E_lo + E_hi:  E'^T = E_lo^T M_hi^T + E_hi^T (E_hi copied in first).
        host[3 * batch + b] = cur_e + lo * DE;
        host[4 * batch + b] = cur_m + hi * D2;
        host[5 * batch + b] = nxt_e + out * DE;
      }
    // Pageable host -> device: staged before the call returns.
    SS_CUDA_CHECK(cudaMemcpyAsync(ptrs, host.data(), host.size() * sizeof(void*),
                                  cudaMemcpyHostToDevice, stream));
    // E_hi of every pair into the output slots ([pairs] rows of H*DE floats).
    SS_CUDA_CHECK(cudaMemcpy2DAsync(nxt_e, static_cast<size_t>(H * DE) * sizeof(float),
                                    cur_e + H * DE, static_cast<size_t>(2 * H * DE) * sizeof(float),
                                    static_cast<size_t>(H * DE) * sizeof(float),
                                    static_cast<size_t>(pairs), cudaMemcpyDeviceToDevice, stream));
    auto cptr = [&](int64_t k) { return const_cast<const void**>(ptrs + k * batch); };
    SS_CUBLAS_CHECK(cublasGemmBatchedEx(
        handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(D), static_cast<int>(D),
        static_cast<int>(D), &one, cptr(0), CUDA_R_32F, static_cast<int>(D), cptr(1), CUDA_R_32F,
        static_cast<int>(D), &zero, ptrs + 2 * batch, CUDA_R_32F, static_cast<int>(D),
        static_cast<int>(batch), tree_compute, CUBLAS_GEMM_DEFAULT));
    SS_CUBLAS_CHECK(cublasGemmBatchedEx(
        handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(Dv), static_cast<int>(D),
        static_cast<int>(D), &one, cptr(3), CUDA_R_32F, static_cast<int>(Dv), cptr(4), CUDA_R_32F,
        static_cast<int>(D), &one, ptrs + 5 * batch, CUDA_R_32F, static_cast<int>(Dv),
        static_cast<int>(batch), tree_compute, CUBLAS_GEMM_DEFAULT));
    if (m % 2 == 1) {  // the unpaired last map passes through
      SS_CUDA_CHECK(cudaMemcpyAsync(nxt_m + pairs * H * D2, cur_m + (m - 1) * H * D2,
                                    static_cast<size_t>(H * D2) * sizeof(float),
                                    cudaMemcpyDeviceToDevice, stream));
      SS_CUDA_CHECK(cudaMemcpyAsync(nxt_e + pairs * H * DE, cur_e + (m - 1) * H * DE,
                                    static_cast<size_t>(H * DE) * sizeof(float),
                                    cudaMemcpyDeviceToDevice, stream));
    }
    std::swap(cur_m, nxt_m);
    std::swap(cur_e, nxt_e);
    m = pairs + m % 2;
  }
  // E = M S_0 + E_tree:  E^T = S_0^T M^T + E_tree^T, per head.
  if (initial_state != nullptr)
    SS_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(Dv), static_cast<int>(D),
        static_cast<int>(D), &one, initial_state, CUDA_R_32F, static_cast<int>(Dv), DE, cur_m,
        CUDA_R_32F, static_cast<int>(D), D2, &one, cur_e, CUDA_R_32F, static_cast<int>(Dv), DE,
        static_cast<int>(H),
        p.dtype == DType::f32 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32,
        CUBLAS_GEMM_DEFAULT));
  if (M_out != nullptr)
    SS_CUDA_CHECK(cudaMemcpyAsync(M_out, cur_m, static_cast<size_t>(H * D2) * sizeof(float),
                                  cudaMemcpyDeviceToDevice, stream));
  SS_CUDA_CHECK(cudaMemcpyAsync(E_out, cur_e, static_cast<size_t>(H * DE) * sizeof(float),
                                cudaMemcpyDeviceToDevice, stream));
}

// The plan's scan arguments with every output off; the caller points
// final_state (and o, for the first segments' maps) where it wants them.
ForwardArgs final_state_only_args(const ForwardPlan& plan) {
  ForwardArgs a = plan.args;
  a.o = nullptr;
  a.chunk_states = nullptr;
  a.final_state = nullptr;
  // The summary keeps only final states: no per-chunk copies of S or V' for
  // an output kernel that does not run (less traffic per chunk step).
  a.ws_states = nullptr;
  a.ws_vnew = nullptr;
  return a;
}

// The scan arguments that cover only the last segment of every batch row:
// all rows without cu_seqlens, the last segment (as segment 0) with it.
ForwardArgs last_segment_args(const MixerParams& p, const ForwardPlan& plan) {
  ForwardArgs a = final_state_only_args(plan);
  if (p.cu_seqlens != nullptr) {
    const int64_t last = p.num_segments - 1;
    a.segment_table += 2 * last;
    if (a.group_table != nullptr) a.group_table += last;  // its first group slot
    a.num_segments = 1;
    if (a.initial_state != nullptr) a.initial_state += last * p.heads * p.dk * p.dv;
  }
  return a;
}

// The scan + output arguments of the first segment of every batch row
// (FirstSegmentMaps), started from `ident` with U = 0: its outputs are H,
// its final state P. Packed: segment 0, where the tables start.
ForwardArgs first_segment_args(const MixerParams& p, const ForwardPlan& plan,
                               const FirstSegmentMaps& first, void* zero_u, const float* ident) {
  ForwardArgs h = plan.args;
  h.o = first.H;
  h.final_state = first.P;
  h.chunk_states = nullptr;
  h.ws_u = zero_u;
  h.initial_state = ident;
  if (p.cu_seqlens != nullptr) h.num_segments = 1;
  return h;
}

// With the first segments' maps, M (`floats` of them) is their P: copied
// where the caller gave separate buffers.
void copy_m_from_first_maps(float* M, const FirstSegmentMaps* first, bool with_linear_part,
                            int64_t floats, cudaStream_t stream) {
  if (first != nullptr && with_linear_part && M != first->P)
    SS_CUDA_CHECK(cudaMemcpyAsync(M, first->P, static_cast<size_t>(floats) * sizeof(float),
                                  cudaMemcpyDeviceToDevice, stream));
}

// The two-level summary (summary_pieces > 1; delta rules, one segment per row,
// per-head scans): every row's chunks in `pieces` runs, each run scanned
// from the identity with U = 0 (its map P_g; with `first` also its outputs,
// each run's own H) and, for E, from zero (E_g), the two scans of a run and
// head as one cluster of two CTAs in lockstep; then, per row, in fp32:
//   P = P_{G-1} ... P_0,   E = P_{G-1} (... (P_0 S0 + E_0) ...) + E_{G-1}.
// A sequential chain of n chunk steps becomes G chains of n / G on G times
// the multiprocessors, plus one launch of 2 (G - 1) small fp32 map products
// per row (chain_maps).
void summary_two_level(const MixerParams& p, const ForwardPlan& plan, float* M, float* E,
                       bool with_linear_part, const FirstSegmentMaps* first, int64_t pieces,
                       cudaStream_t stream) {
  const int64_t rows = p.cu_seqlens != nullptr ? 1 : p.batch;
  const int64_t H = p.heads, D = p.dk, map = H * D * D;  // Dv == Dk (per_head_supported)
  // Chunks of a row: row r's start at r n (packed: the one segment's at 0).
  const int64_t n = p.cu_seqlens != nullptr ? plan.num_chunks : plan.args.chunks_per_row;
  std::vector<int64_t> table(static_cast<size_t>(2 * rows * pieces));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < pieces; ++g) {
      int64_t f = 0, c = 0;
      piece_chunks(n, pieces, g, f, c);
      table[static_cast<size_t>(2 * (r * pieces + g))] = r * n + f;
      table[static_cast<size_t>(2 * (r * pieces + g) + 1)] = c;
    }
  const PoolArray<int64_t> runs(table.size(), stream);
  // Pageable host -> device: staged before the call returns.
  SS_CUDA_CHECK(cudaMemcpyAsync(runs.get(), table.data(), table.size() * sizeof(int64_t),
                                cudaMemcpyHostToDevice, stream));
  ForwardArgs base = final_state_only_args(plan);
  base.initial_state = nullptr;
  base.segment_table = runs.get();
  base.group_table = nullptr;
  base.num_segments = rows * pieces;
  base.scan_per_head = true;

  PoolArray<float> own_maps;
  if (first == nullptr)
    own_maps = PoolArray<float>(static_cast<size_t>(rows * pieces * map), stream);
  float* piece_P = first != nullptr ? first->piece_P : own_maps.get();
  ForwardArgs m = base;
  m.scan_identity = true;
  m.final_state = piece_P;
  int m_stages = detail::kStageScan;
  if (first != nullptr) {
    m.o = first->H;
    m_stages |= detail::kStageOutput;
  }
  // E's runs beside the maps', one cluster of two CTAs per run and head.
  PoolArray<float> piece_E;
  if (E != nullptr) {
    piece_E = PoolArray<float>(static_cast<size_t>(rows * pieces * map), stream);
    m.scan_pair_state = piece_E.get();
  }
  detail::launch_forward_stages(p, m, m_stages, stream);

  // The fold, per row: P as the chain P_0 -> P_1 P_0 -> ..., E as
  // E_0 (or S0) -> P_1 E_0 + E_1 -> ..., both in one launch.
  for (int64_t r = 0; r < rows; ++r) {
    auto P_g = [&](int64_t g) { return piece_P + (r * pieces + g) * map; };
    auto E_g = [&](int64_t g) { return piece_E.get() + (r * pieces + g) * map; };
    MapsChain chains[2];
    int count = 0;
    float* p_out = first != nullptr ? first->P + r * map : with_linear_part ? M + r * map : nullptr;
    if (p_out != nullptr) {
      MapsChain& c = chains[count++];
      c.maps = H;
      c.dk = c.width = D;
      c.x0 = P_g(0);
      for (int64_t g = 1; g < pieces; ++g) c.A[c.steps++] = P_g(g);
      c.out = p_out;
    }
    if (E != nullptr) {
      // Without S0 the first run's E_0 is the running value as it stands.
      const float* s0 = p.initial_state != nullptr ? p.initial_state + r * map : nullptr;
      MapsChain& c = chains[count++];
      c.maps = H;
      c.dk = c.width = D;
      c.x0 = s0 != nullptr ? s0 : E_g(0);
      for (int64_t g = s0 != nullptr ? 0 : 1; g < pieces; ++g) {
        c.A[c.steps] = P_g(g);
        c.bias[c.steps++] = E_g(g);
      }
      c.out = E + r * map;
    }
    if (count > 0) chain_maps(chains, count, stream);
  }
  copy_m_from_first_maps(M, first, with_linear_part, rows * map, stream);
}

void summary_from_plan(const MixerParams& p, const ForwardPlan& plan, float* M, float* E,
                       bool with_linear_part, const FirstSegmentMaps* first,
                       cudaStream_t stream) {
  const bool delta = has_beta(p.variant);
  SS_CHECK_ARG(M != nullptr || !with_linear_part, "M", "summary output must not be null");
  SS_CHECK_ARG(E != nullptr || first != nullptr, "E", "summary output must not be null");
  if (first != nullptr) {
    SS_CHECK_ARG(delta, "first",
                 "the first segments' maps are for delta rules, got variant ",
                 to_string(p.variant));
    SS_CHECK_ARG(first->P != nullptr && first->H != nullptr, "first",
                 "P and H must not be null");
    // H is written as o is, in 16-byte vector stores (check_supported's rule
    // for o: a misaligned store is a sticky error).
    SS_CHECK_ARG(detail::aligned16(first->H), "first", "H must be 16-byte aligned");
    SS_CHECK_ARG(!with_linear_part || p.cu_seqlens == nullptr || p.num_segments == 1, "M",
                 "taken from the first segments' maps, needs one segment per row (got ",
                 p.num_segments, " segments)");
  }
  const int64_t rows = p.cu_seqlens != nullptr ? 1 : p.batch;
  const bool products = delta && linear_part_by_products_enabled();
  const int64_t pieces = summary_pieces(p, E != nullptr);
  if (first != nullptr)
    SS_CHECK_ARG(first->pieces == pieces && (pieces == 1 || first->piece_P != nullptr), "first",
                 "holds ", first->pieces, " piece maps where the summary makes ", pieces,
                 " (cuda::summary_pieces)");
  if (pieces > 1) {
    summary_two_level(p, plan, M, E, with_linear_part, first, pieces, stream);
    return;
  }
  // A delta rule's linear part is the scan of the identity with U = 0: M's
  // (last segment, outputs off), or the first segments' maps (outputs on).
  const bool m_scan = delta && with_linear_part && first == nullptr && !products;
  PoolArray<std::byte> zero_u;
  PoolArray<float> ident;
  if (m_scan || first != nullptr) {
    zero_u = PoolArray<std::byte>(
        static_cast<size_t>(plan.num_chunks) * p.heads * p.chunk * p.dv * size_of(p.dtype), stream);
    ident = PoolArray<float>(static_cast<size_t>(rows * p.heads * p.dk * p.dv), stream);
    zero_u.zero();
    fill_identity(ident.get(), rows * p.heads, p.dk, p.dv, stream);
  }
  ForwardArgs a = last_segment_args(p, plan);
  a.final_state = E;
  std::optional<SideStream> side;
  ForwardArgs m;  // the linear part's scan, when there is one
  int m_stages = detail::kStageScan;
  if (first != nullptr) {
    m = first_segment_args(p, plan, *first, zero_u.get(), ident.get());
    m_stages |= detail::kStageOutput;
  } else if (m_scan) {
    m = last_segment_args(p, plan);
    m.ws_u = zero_u.get();
    m.initial_state = ident.get();
    m.final_state = M;
  }
  // E and M (outputs off) as one CTA per head and segment where supported:
  // a short chain on few multiprocessors, the rest left to the scan beside.
  const bool per_head = per_head_scan(p, p.heads * a.num_segments, a.num_sms);
  a.scan_per_head = per_head;
  if (m_scan) {
    m.scan_per_head = per_head;
    m.scan_identity = per_head;  // reads neither zero_u nor ident
  }
  const bool linear_scan = first != nullptr || m_scan;
  if (linear_scan && E != nullptr && !products) {
    // E's scan and the linear part's are independent sequential chains over
    // the same tiles, each about one wave of 16-column blocks on its own: run
    // them side by side (the linear part on a side stream), each planned on
    // half of the multiprocessors, so the block width follows (32 columns
    // where 16-column blocks of both would not fit one wave) and the pair
    // costs about one chain instead of two.
    // With E per head (H x segments CTAs) the maps' column blocks are
    // planned on the multiprocessors it leaves.
    const int e_ctas = static_cast<int>(p.heads * a.num_segments);
    const int half = std::max(1, a.num_sms / 2);
    m.num_sms = per_head ? std::max(1, a.num_sms - e_ctas) : half;
    a.num_sms = per_head ? e_ctas : half;
    // Beside the first segments' maps (which also write H) in clusters of two
    // CTAs unless STATESCAN_SCAN_CLUSTER forces a size: with the automatic
    // four, the two grids' clusters did not always find room in the GPCs
    // together, and the pair took 3.9 ms in some runs and 6.8 ms in others
    // (one after the other 5.1 ms); with two it took 3.89 ms in every run,
    // single CTAs 4.0 (H200, KDA and Gated DeltaNet; PERF_NOTES, nineteenth
    // session).
    if (first != nullptr && a.scan_cluster == 0) a.scan_cluster = m.scan_cluster = 2;
    side.emplace(stream);  // forks from `stream` here
    detail::launch_forward_stages(p, m, m_stages, side->stream());
  }
  if (E != nullptr && products) {
    // E (and M, unless it comes from the first segments' maps) by the
    // product tree, per row; no scan.
    const int64_t state = p.heads * p.dk * p.dv;
    const bool tree_m = with_linear_part && first == nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      int64_t first_chunk = r * plan.args.chunks_per_row, count = plan.args.chunks_per_row;
      int64_t segment = r;
      if (p.cu_seqlens != nullptr) {
        segment = p.num_segments - 1;
        first_chunk = 0;
        for (int64_t n = 0; n < segment; ++n)
          first_chunk += (plan.offsets[n + 1] - plan.offsets[n] + p.chunk - 1) / p.chunk;
        count = plan.num_chunks - first_chunk;
      }
      const float* s0 = p.initial_state != nullptr ? p.initial_state + segment * state : nullptr;
      summary_by_products(p, plan.args, first_chunk, count, s0,
                          tree_m ? M + r * p.heads * p.dk * p.dk : nullptr, E + r * state,
                          stream);
    }
  } else if (E != nullptr) {
    detail::launch_forward_stages(p, a, detail::kStageScan, stream);
  }
  // Without E beside it (the last rank, or E by products) the linear part's
  // scan has the whole GPU.
  if (linear_scan && !side) detail::launch_forward_stages(p, m, m_stages, stream);
  if (side) side->join();  // `stream` waits for the side scan
  copy_m_from_first_maps(M, first, with_linear_part, rows * p.heads * p.dk * p.dk, stream);
  if (!delta && with_linear_part) {
    int64_t begin = 0, end = p.seq_len;
    if (p.cu_seqlens != nullptr) {
      begin = plan.offsets[static_cast<size_t>(p.num_segments - 1)];
      end = plan.offsets[static_cast<size_t>(p.num_segments)];
    }
    const dim3 grid(static_cast<unsigned>(rows * p.heads), static_cast<unsigned>((p.dk + 31) / 32));
    additive_decay_kernel<<<grid, 256, 0, stream>>>(p.g, vector_gate(p.variant), p.seq_len, p.heads,
                                                    p.dk, begin, end, M);
    SS_LAUNCH_CHECK("additive_decay_kernel");
  }
}

}  // namespace

// The two-level summary's piece count (delta rules, M by scan): every row
// (one segment each) split into G runs of chunks, each run scanned by the
// per-head kernels from zero (E) and from the identity (its map) in
// parallel, then composed in order.
// G fills the multiprocessors with one CTA each: rows x H x G <= SMs alone,
// or, with E, rows x H x G pairs of CTAs (E's run beside its maps, in
// clusters of two) <= the pairs the GPCs hold at once. 1 = not two-level
// (setting, shape, or rows x H already filling the GPU).
int64_t summary_pieces(const MixerParams& p, bool with_E) {
  if (!has_beta(p.variant) || linear_part_by_products_enabled()) return 1;
  const SummaryScan want = summary_scan_setting();
  if (want != SummaryScan::two_level && want != SummaryScan::automatic) return 1;
  if (p.cu_seqlens != nullptr && p.num_segments != 1) return 1;
  if (!per_head_supported(p)) return 1;
  const int64_t rows = p.cu_seqlens != nullptr ? 1 : p.batch;
  const int64_t slots = with_E ? pair_scan_capacity() : multiprocessor_count();
  const int64_t pieces = std::min<int64_t>(slots / (rows * p.heads), 64);
  return pieces >= 2 ? pieces : 1;
}

LinearPart summary_linear_part() {
  return linear_part_setting();
}

void set_summary_linear_part(LinearPart part) {
  linear_part_setting() = part;
}

SummaryScan summary_scan() {
  return summary_scan_setting();
}

void set_summary_scan(SummaryScan scan) {
  summary_scan_setting() = scan;
}

struct PreparedForward::Impl {
  MixerParams params;
  void* workspace = nullptr;
  size_t bytes = 0;
  cudaStream_t stream = nullptr;
  ForwardPlan plan;
};

PreparedForward::PreparedForward(const MixerParams& p, cudaStream_t stream, unsigned* nonfinite)
    : impl_(std::make_unique<Impl>()) {
  SS_CHECK_ARG(nonfinite == nullptr || prepare_checks_finite(p), "nonfinite",
               "the prepare stage checks 16-bit inputs only (prepare_checks_finite)");
  Impl& s = *impl_;
  s.params = p;
  s.stream = stream;
  s.bytes = forward_workspace_bytes(p);
  s.workspace = pool_alloc(s.bytes, stream);
  try {
    s.plan = detail::plan_forward(p, s.workspace, s.bytes, stream, /*prepare_only=*/false,
                                  /*for_backward=*/true);
    // Kernels that read the inputs need no tiles: not for the summary, not
    // for finish(), not for a backward that adopts this workspace.
    if (detail::forward_stages(s.plan.args) & detail::kStagePrepare) {
      ForwardArgs prep = s.plan.args;
      prep.nonfinite = nonfinite;
      detail::launch_forward_stages(p, prep, detail::kStagePrepare, stream);
    }
  } catch (...) {
    pool_free(s.workspace, stream);
    throw;
  }
}

PreparedForward::~PreparedForward() {
  if (impl_) pool_free(impl_->workspace, impl_->stream);
}

// After a PreparedBackward adopted the workspace, the plan's pointers still
// lead into it: the backward's memory now (or freed).
static const char* const kHandedOver =
    "its workspace was handed to a PreparedBackward; prepare the forward again";

void PreparedForward::summary(float* M, float* E, cudaStream_t stream, bool with_linear_part,
                              const FirstSegmentMaps* first) {
  SS_CHECK_ARG(impl_->workspace != nullptr, "forward", kHandedOver);
  // The tiles are written on the construction stream and freed there: work
  // on another stream could read them half-written, or after they are freed.
  SS_CHECK_ARG(stream == impl_->stream, "stream",
               "must be the stream PreparedForward was built on");
  summary_from_plan(impl_->params, impl_->plan, M, E, with_linear_part, first, stream);
}

void PreparedForward::finish(cudaStream_t stream) {
  SS_CHECK_ARG(impl_->workspace != nullptr, "forward", kHandedOver);
  SS_CHECK_ARG(stream == impl_->stream, "stream",
               "must be the stream PreparedForward was built on");
  detail::launch_forward_stages(impl_->params, impl_->plan.args,
                                detail::kStageScan | detail::kStageOutput, stream);
}

void first_segment_state_grad(const MixerParams& p, const FirstSegmentMaps& maps, const void* d_o,
                              int64_t row, int64_t t_begin, int64_t t_end, const float* dS_end,
                              float* dS0, cudaStream_t stream) {
  SS_CHECK_ARG(maps.H != nullptr && maps.P != nullptr, "maps",
               "maps.H and maps.P must not be null");
  SS_CHECK_ARG(d_o != nullptr, "d_o", "must not be null");
  SS_CHECK_ARG(dS0 != nullptr, "dS0", "must not be null");
  SS_CHECK_ARG(0 <= t_begin && t_begin < t_end && t_end <= p.seq_len, "t_begin",
               "token range [", t_begin, ", ", t_end, ") outside the local length ", p.seq_len);
  SS_CHECK_ARG(row >= 0 && row < p.batch, "row", row, " outside the batch of ", p.batch);
  const int64_t pieces = maps.pieces;
  SS_CHECK_ARG(pieces >= 1 && (pieces == 1 || maps.piece_P != nullptr), "maps", "pieces ", pieces,
               " without piece maps");
  // The summary splits whole rows (one segment each) into its runs.
  SS_CHECK_ARG(pieces == 1 || (t_begin == 0 && t_end == p.seq_len), "t_begin",
               "a two-level summary's maps cover whole rows, got tokens [", t_begin, ", ", t_end,
               ") of ", p.seq_len);
  const int64_t Hh = p.heads, Dk = p.dk, Dv = p.dv, C = p.chunk;
  SS_CHECK_ARG(t_end - t_begin <= INT32_MAX, "t_end", "more than 2^31 - 1 tokens in one segment");
  cublasHandle_t handle = detail::blas_handle(stream, detail::BlasSlot::summary);
  const size_t elem = size_of(p.dtype);
  const cudaDataType_t t = cuda_type(p.dtype);
  const float one = 1.f, zero = 0.f;
  // The runs with tokens, in order: [begin, end) and the run's map.
  struct Run {
    int64_t begin, end;
    const float* P;
  };
  std::vector<Run> runs;
  const int64_t n = (t_end - t_begin + C - 1) / C;
  for (int64_t g = 0; g < pieces; ++g) {
    int64_t f = 0, c = 0;
    piece_chunks(n, pieces, g, f, c);
    const int64_t b = t_begin + f * C, e = std::min(t_begin + (f + c) * C, t_end);
    const float* P = pieces == 1 ? maps.P + row * Hh * Dk * Dk
                                 : maps.piece_P + (row * pieces + g) * Hh * Dk * Dk;
    if (b < e) runs.push_back({b, e, P});
  }
  // Horner from the last run: dS <- X_g + P_g^T dS with X_g = sum over the
  // run's tokens of H_t^T dO_t (each run's H starts from its own identity).
  // Column-major: dO of head h is a Dv x tokens matrix (ld H Dv), H's a
  // Dk x tokens one (ld H Dk), and row-major X [Dk, Dv] is its Dv x Dk
  // transpose: X^T = dO H^T, one GEMM per run and head contracting over
  // tokens. Every run's GEMMs go in one batched call per run length (runs
  // differ by at most a chunk, the last may be partial): at 128K, H = 16,
  // four runs, one call of 64 reads H and dO in 0.259 ms (4.15 TB/s) where a
  // strided call of 16 heads per run took 0.348 in all (3.09 TB/s; H200,
  // PERF_NOTES, twenty-fifth session). X_0 lands in dS0, the others in `xs`,
  // and the Horner steps accumulate into them in place.
  const size_t state = static_cast<size_t>(Hh * Dk * Dv);
  const PoolArray<float> xs(runs.size() > 1 ? (runs.size() - 1) * state : 0, stream);
  auto x_of = [&](size_t i) { return i == 0 ? dS0 : xs.get() + (i - 1) * state; };
  const PoolArray<void*> pointers(3 * runs.size() * static_cast<size_t>(Hh), stream);
  std::vector<void*> host(3 * runs.size() * static_cast<size_t>(Hh));
  std::vector<int64_t> lengths;  // distinct run lengths, in order of first use
  std::vector<size_t> order;     // runs grouped by length
  for (size_t i = 0; i < runs.size(); ++i) {
    const int64_t len = runs[i].end - runs[i].begin;
    if (std::find(lengths.begin(), lengths.end(), len) == lengths.end()) lengths.push_back(len);
  }
  for (const int64_t len : lengths)
    for (size_t i = 0; i < runs.size(); ++i)
      if (runs[i].end - runs[i].begin == len) order.push_back(i);
  const size_t batch_all = order.size() * static_cast<size_t>(Hh);
  for (size_t k = 0; k < order.size(); ++k) {
    const Run& run = runs[order[k]];
    const int64_t first_token = row * p.seq_len + run.begin;
    for (int64_t h = 0; h < Hh; ++h) {
      const size_t b = k * static_cast<size_t>(Hh) + static_cast<size_t>(h);
      host[b] =
          const_cast<char*>(static_cast<const char*>(d_o)) + (first_token * Hh + h) * Dv * elem;
      host[batch_all + b] =
          const_cast<char*>(static_cast<const char*>(maps.H)) + (first_token * Hh + h) * Dk * elem;
      host[2 * batch_all + b] = x_of(order[k]) + h * Dk * Dv;
    }
  }
  // Pageable host -> device: staged before the call returns.
  SS_CUDA_CHECK(cudaMemcpyAsync(pointers.get(), host.data(), host.size() * sizeof(void*),
                                cudaMemcpyHostToDevice, stream));
  size_t done = 0;
  for (const int64_t len : lengths) {
    size_t count = 0;
    while (done + count < order.size() &&
           runs[order[done + count]].end - runs[order[done + count]].begin == len)
      ++count;
    const size_t b0 = done * static_cast<size_t>(Hh), nb = count * static_cast<size_t>(Hh);
    void** ptrs = pointers.get();
    SS_CUBLAS_CHECK(cublasGemmBatchedEx(
        handle, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(Dv), static_cast<int>(Dk),
        static_cast<int>(len), &one, const_cast<const void**>(ptrs + b0), t,
        static_cast<int>(Hh * Dv), const_cast<const void**>(ptrs + batch_all + b0), t,
        static_cast<int>(Hh * Dk), &zero, ptrs + 2 * batch_all + b0, CUDA_R_32F,
        static_cast<int>(Dv), static_cast<int>(nb), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    done += count;
  }
  // + P_g^T dS from the last run back, adding each run's X_g: one chain
  // into dS0 (X_0, the last step's bias, read before it is overwritten).
  const size_t last = runs.size() - 1;
  if (last > 0 || dS_end != nullptr) {
    MapsChain c;
    c.maps = Hh;
    c.dk = Dk;
    c.width = Dv;
    c.transpose_a = true;
    c.x0 = dS_end != nullptr ? dS_end : x_of(last);
    for (size_t i = dS_end != nullptr ? runs.size() : last; i-- > 0;) {
      c.A[c.steps] = runs[i].P;
      c.bias[c.steps++] = x_of(i);
    }
    c.out = dS0;
    chain_maps(&c, 1, stream);
  }
}

namespace detail {

AdoptedForward adopt(PreparedForward& forward,
                     const std::function<void(const MixerParams&, cudaStream_t)>& check) {
  SS_CHECK_ARG(forward.impl_ && forward.impl_->workspace != nullptr, "forward",
               "holds no prepared workspace (already handed over)");
  PreparedForward::Impl& s = *forward.impl_;
  check(s.params, s.stream);
  AdoptedForward a;
  a.params = s.params;
  a.workspace = std::exchange(s.workspace, nullptr);
  a.stream = s.stream;
  a.plan = std::move(s.plan);
  return a;
}

}  // namespace detail

void mixer_summary(const MixerParams& p, float* M, float* E, cudaStream_t stream) {
  SS_CHECK_ARG(M != nullptr, "M", "summary output must not be null");
  SS_CHECK_ARG(E != nullptr, "E", "summary output must not be null");
  // E stands in for o below, whose alignment the forward's checks test: test
  // it here under its own name first.
  SS_CHECK_ARG(detail::aligned16(E), "E", "must be 16-byte aligned");
  // No outputs: o only has to pass validation (it is never written), and
  // the caller's chunk_states / final_state are left alone.
  MixerParams q = p;
  q.o = E;
  q.final_state = nullptr;
  q.chunk_states = nullptr;
  PreparedForward prepared(q, stream);
  prepared.summary(M, E, stream);
}

}  // namespace statescan::cuda
