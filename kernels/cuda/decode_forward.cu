// Recurrent (token-by-token) forward for the six variants: the serving path
// and an independent cross-check of the chunkwise kernels.
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/cuda_check.h"
#include "core/options.h"
#include "kernels/cuda/cuda_mixer.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/mixer_tensors.cuh"

namespace statescan::cuda {
namespace detail {
namespace {

struct DecodeArgs : MixerTensors {
  const int64_t* cu_seqlens = nullptr;  // device; null: batch rows
  int64_t heads = 0, seq_len = 0, dv = 0;
  float scale = 1.f;
};

constexpr int kDecodeColumns = 32;  // state columns per block, one per lane
constexpr int kDecodeWarps = 4;     // warps per block, each a quarter of the rows
constexpr int kDecodeThreads = kDecodeColumns * kDecodeWarps;

// recurrent_decode_kernel: DESIGN §3's recurrence, one token at a time.
//   grid (Dv / 32, H, N segments), 128 threads: lane j of every warp owns
//   state column vb*32 + j, warp w rows w, w + 4, w + 8, ... (Dk / 4 of
//   them) in registers (Dk is a template parameter so the array is never
//   indexed at run time). Sums over a column (the delta rule's prediction,
//   o) meet in shared memory.
//   Why the rows over four warps: one lane holding a whole 128-row column
//   needed 130-200 registers and spilled (up to 212 bytes a thread; KDA's
//   state once sat wholly in local memory, at 21 % of HBM's peak). Four
//   lanes a column inside one warp (8 columns a warp) fixed that but read
//   32-byte pieces of four rows an instruction, and ran linear attention at
//   84 % of HBM's peak against 87 % for whole 128-byte rows (H100,
//   sixty-ninth session); here every warp reads whole rows and the shared
//   q, k reads are broadcasts.
//   The token's q, k and decay factors are staged in 3*Dk floats of shared
//   memory for all four warps; the next token's inputs are loaded into
//   registers while this one runs, so a multi-token call does not wait on
//   memory latency once a token.
//   Dk and Dv are independent (Dk in {32, 64, 128, 256}, Dv a multiple of 32):
//   GLA's and Mamba-2's heads have Dk != Dv.
template <Decay kDecay, Rule kRule, typename Elem, int Dk, bool kL2Norm>
__global__ void __launch_bounds__(kDecodeThreads)
    recurrent_decode_kernel(const __grid_constant__ DecodeArgs a) {
  static_assert(Dk % kDecodeWarps == 0, "Dk");
  constexpr int kRows = Dk / kDecodeWarps;
  constexpr int kStaged = (Dk + kDecodeThreads - 1) / kDecodeThreads;  // q, k elements a thread
  __shared__ float s_q[Dk], s_k[Dk], s_decay[Dk];
  __shared__ float s_predicted[kDecodeWarps][kDecodeColumns], s_out[kDecodeWarps][kDecodeColumns];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t h = blockIdx.y, n = blockIdx.z, H = a.heads, Dv = a.dv;
  const int64_t col = blockIdx.x * kDecodeColumns + lane;
  const int64_t begin = a.cu_seqlens ? a.cu_seqlens[n] : n * a.seq_len;
  const int64_t end = a.cu_seqlens ? a.cu_seqlens[n + 1] : (n + 1) * a.seq_len;
  const Elem* q = static_cast<const Elem*>(a.q);
  const Elem* k = static_cast<const Elem*>(a.k);
  const Elem* v = static_cast<const Elem*>(a.v);
  const Elem* beta_in = static_cast<const Elem*>(a.beta);

  float state[kRows];  // state[i]: row i * 4 + warp of column col
  const int64_t state_base = (n * H + h) * Dk * Dv + warp * Dv + col;
  const int64_t row_step = kDecodeWarps * Dv;
#pragma unroll
  for (int i = 0; i < kRows; ++i)
    state[i] = a.initial_state ? a.initial_state[state_base + i * row_step] : 0.f;

  // A token's inputs in registers: this thread's staged q, k (and log gate)
  // elements, its column's v, and the token's beta and scalar log gate.
  float in_q[kStaged], in_k[kStaged], in_g[kStaged], in_v = 0.f, in_beta = 0.f, in_alpha = 0.f;
  auto load_token = [&](int64_t t) {
    const int64_t row = t * H + h;
#pragma unroll
    for (int j = 0; j < kStaged; ++j) {
      const int d = tid + j * kDecodeThreads;
      if (d < Dk) {
        in_q[j] = to_float(q[row * Dk + d]);
        in_k[j] = to_float(k[row * Dk + d]);
        if constexpr (kDecay == Decay::vector) in_g[j] = a.g[row * Dk + d];
      }
    }
    in_v = to_float(v[row * Dv + col]);
    if constexpr (kRule == Rule::delta) in_beta = to_float(beta_in[row]);
    if constexpr (kDecay == Decay::scalar) in_alpha = a.g[row];
  };
  if (begin < end) load_token(begin);
  // The sum of every warp's share of this lane's column.
  auto column_total = [lane](const float(&shares)[kDecodeWarps][kDecodeColumns]) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) total += shares[w][lane];
    return total;
  };

  for (int64_t t = begin; t < end; ++t) {
    const int64_t row = t * H + h;
#pragma unroll
    for (int j = 0; j < kStaged; ++j) {
      const int d = tid + j * kDecodeThreads;
      if (d < Dk) {
        s_q[d] = in_q[j];
        s_k[d] = in_k[j];
        if constexpr (kDecay == Decay::vector) s_decay[d] = expf(in_g[j]);
      }
    }
    const float v_col = in_v, beta = in_beta;
    const float alpha = kDecay == Decay::scalar ? expf(in_alpha) : 1.f;
    if (t + 1 < end) load_token(t + 1);
    __syncthreads();  // (1) the token staged
    float q_scale = a.scale, k_scale = 1.f;
    if constexpr (kL2Norm) {  // every warp sums the staged token itself
      float qq = 0.f, kk = 0.f;
      for (int d = lane; d < Dk; d += 32) {
        qq += s_q[d] * s_q[d];
        kk += s_k[d] * s_k[d];
      }
      q_scale *= 1.f / sqrtf(warp_sum(qq) + 1e-6f);
      k_scale = 1.f / sqrtf(warp_sum(kk) + 1e-6f);
    }

    // The decay and the delta rule's prediction in one pass over the state.
    float predicted = 0.f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int d = i * kDecodeWarps + warp;
      if constexpr (kDecay == Decay::vector) state[i] *= s_decay[d];
      if constexpr (kDecay == Decay::scalar) state[i] *= alpha;
      if constexpr (kRule == Rule::delta) predicted += state[i] * s_k[d];
    }
    float update = v_col;
    if constexpr (kRule == Rule::delta) {
      s_predicted[warp][lane] = predicted;
      __syncthreads();  // (2) every warp's share of the prediction
      update = beta * (v_col - column_total(s_predicted) * k_scale);
    }
    float out = 0.f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int d = i * kDecodeWarps + warp;
      state[i] += s_k[d] * k_scale * update;
      out += state[i] * s_q[d];
    }
    s_out[warp][lane] = out;
    // (3) every warp's share of o, and every read of this token's s_q, s_k,
    // s_decay and s_predicted done: the next token may stage over them
    // (warp 0 reads s_out below; the next write of it follows two more
    // barriers that warp 0 must reach first).
    __syncthreads();
    if (warp == 0)
      static_cast<Elem*>(a.o)[row * Dv + col] = from_float<Elem>(column_total(s_out) * q_scale);
  }
  if (a.final_state) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) a.final_state[state_base + i * row_step] = state[i];
  }
}

template <Decay kDecay, Rule kRule>
void launch_decode(const DecodeArgs& a, DType dtype, int64_t dk, bool l2norm, int64_t segments,
                   cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.dv / kDecodeColumns), static_cast<unsigned>(a.heads),
                  static_cast<unsigned>(segments));
  auto with_type = [&](auto elem_tag) {
    using Elem = decltype(elem_tag);
    auto go = [&](auto kernel) {
      kernel<<<grid, kDecodeThreads, 0, stream>>>(a);
      SS_LAUNCH_CHECK("recurrent_decode_kernel");
    };
    // Dk as a template parameter: each thread's Dk / 4 state rows stay in
    // registers only when the array is never indexed at run time.
    auto with_dk = [&](auto dk_tag) {
      constexpr int kDk = decltype(dk_tag)::value;
      l2norm ? go(recurrent_decode_kernel<kDecay, kRule, Elem, kDk, true>)
             : go(recurrent_decode_kernel<kDecay, kRule, Elem, kDk, false>);
    };
    switch (dk) {
      case 32:
        with_dk(std::integral_constant<int, 32>{});
        break;
      case 64:
        with_dk(std::integral_constant<int, 64>{});
        break;
      case 128:
        with_dk(std::integral_constant<int, 128>{});
        break;
      case 256:
        with_dk(std::integral_constant<int, 256>{});
        break;
      default:  // decode_forward refuses the others first
        SS_CHECK_ARG(false, "dk", "no CUDA decode kernel for Dk ", dk);
    }
  };
  switch (dtype) {
    case DType::f32:
      with_type(float{});
      break;
    case DType::bf16:
      with_type(__nv_bfloat16{});
      break;
    case DType::f16:
      with_type(__half{});
      break;
  }
}

}  // namespace
}  // namespace detail

void decode_forward(const MixerParams& p, cudaStream_t stream) {
  // validate() reads cu_seqlens on the host; here it is a device array, so
  // check a copy that points at a host mirror.
  MixerParams host_view = p;
  std::vector<int64_t> host_offsets;
  if (p.cu_seqlens != nullptr) {
    SS_CHECK_ARG(p.num_segments >= 1, "cu_seqlens", "must hold at least 2 offsets");
    // The host waits for that copy, which a stream being captured into a CUDA
    // graph cannot do (the copy would fail inside the capture and void it).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    SS_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    SS_CHECK_ARG(capture == cudaStreamCaptureStatusNone, "cu_seqlens",
                 "packed sequences are checked on the host and cannot be captured into a CUDA "
                 "graph; capture batch rows (cu_seqlens null) instead");
    host_offsets.resize(static_cast<size_t>(p.num_segments + 1));
    SS_CUDA_CHECK(cudaMemcpyAsync(host_offsets.data(), p.cu_seqlens,
                                  host_offsets.size() * sizeof(int64_t), cudaMemcpyDeviceToHost,
                                  stream));
    SS_CUDA_CHECK(cudaStreamSynchronize(stream));
    host_view.cu_seqlens = host_offsets.data();
  }
  validate(host_view);
  check_grid_limits(p);
  // Unlike the chunkwise kernels (Dk == Dv in {64, 128}), the decode takes
  // GLA's and Mamba-2's head shapes, Dk != Dv.
  SS_CHECK_ARG(p.dk == 32 || p.dk == 64 || p.dk == 128 || p.dk == 256, "dk",
               "CUDA decode supports Dk in {32, 64, 128, 256}, got ", p.dk);
  SS_CHECK_ARG(p.dv % detail::kDecodeColumns == 0, "dv", "CUDA decode needs Dv a multiple of ",
               detail::kDecodeColumns, ", got ", p.dv);
  // In place is the same pointer: each thread then reads its own columns
  // before it writes them. A final_state that overlaps initial_state from
  // another address would let threads overwrite columns others still read.
  if (p.initial_state != nullptr && p.final_state != nullptr && p.initial_state != p.final_state) {
    const auto in = reinterpret_cast<std::uintptr_t>(p.initial_state);
    const auto out = reinterpret_cast<std::uintptr_t>(p.final_state);
    const auto bytes =
        static_cast<std::uintptr_t>(p.num_segments * p.heads * p.dk * p.dv) * sizeof(float);
    SS_CHECK_ARG(in + bytes <= out || out + bytes <= in, "final_state",
                 "overlaps initial_state without being it (to update the state in place, pass "
                 "the same pointer for both)");
  }

  detail::DecodeArgs a;
  static_cast<detail::MixerTensors&>(a) = detail::tensors_of(p);
  a.cu_seqlens = p.cu_seqlens;
  a.heads = p.heads;
  a.seq_len = p.seq_len;
  a.dv = p.dv;
  a.scale = p.scale;
  const int64_t segments = p.num_segments;
  switch (p.variant) {
    case Variant::linear:
      detail::launch_decode<Decay::none, Rule::additive>(a, p.dtype, p.dk, p.l2norm_qk, segments,
                                                         stream);
      break;
    case Variant::retention:
      detail::launch_decode<Decay::scalar, Rule::additive>(a, p.dtype, p.dk, p.l2norm_qk, segments,
                                                           stream);
      break;
    case Variant::gla:
      detail::launch_decode<Decay::vector, Rule::additive>(a, p.dtype, p.dk, p.l2norm_qk, segments,
                                                           stream);
      break;
    case Variant::deltanet:
      detail::launch_decode<Decay::none, Rule::delta>(a, p.dtype, p.dk, p.l2norm_qk, segments,
                                                      stream);
      break;
    case Variant::gated_deltanet:
      detail::launch_decode<Decay::scalar, Rule::delta>(a, p.dtype, p.dk, p.l2norm_qk, segments,
                                                        stream);
      break;
    case Variant::kda:
      detail::launch_decode<Decay::vector, Rule::delta>(a, p.dtype, p.dk, p.l2norm_qk, segments,
                                                        stream);
      break;
  }
}

}  // namespace statescan::cuda
