// Recurrent (token-by-token) forward for the six variants: the serving path
// and an independent cross-check of the chunkwise kernels.
#include <cstdint>
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

// recurrent_decode_kernel: DESIGN §3's recurrence, one token at a time.
//   grid (Dv / 32, H, N segments), one warp per block; lane j owns state
//   column vb*32 + j, all Dk rows in registers (Dk is a template parameter so
//   the array is never indexed at run time). q, k and the decay factors of the
//   current token are staged in 3*Dk floats of static shared memory.
//   Constraints: Dv a multiple of 32; Dk <= 128.
template <Decay kDecay, Rule kRule, typename Elem, int Dk, bool kL2Norm>
__global__ void __launch_bounds__(kDecodeColumns)
    recurrent_decode_kernel(const __grid_constant__ DecodeArgs a) {
  __shared__ float s_q[Dk], s_k[Dk], s_decay[Dk];
  const int lane = threadIdx.x;
  const int64_t h = blockIdx.y, n = blockIdx.z, H = a.heads, Dv = a.dv;
  const int64_t col = blockIdx.x * kDecodeColumns + lane;
  const int64_t begin = a.cu_seqlens ? a.cu_seqlens[n] : n * a.seq_len;
  const int64_t end = a.cu_seqlens ? a.cu_seqlens[n + 1] : (n + 1) * a.seq_len;
  const Elem* q = static_cast<const Elem*>(a.q);
  const Elem* k = static_cast<const Elem*>(a.k);
  const Elem* v = static_cast<const Elem*>(a.v);

  float state[Dk];
  const int64_t state_base = (n * H + h) * Dk * Dv + col;
#pragma unroll
  for (int d = 0; d < Dk; ++d)
    state[d] = a.initial_state ? a.initial_state[state_base + d * Dv] : 0.f;

  for (int64_t t = begin; t < end; ++t) {
    const int64_t row = t * H + h;
    float qq = 0.f, kk = 0.f;
    for (int d = lane; d < Dk; d += 32) {
      const float qd = to_float(q[row * Dk + d]), kd = to_float(k[row * Dk + d]);
      s_q[d] = qd;
      s_k[d] = kd;
      qq += qd * qd;
      kk += kd * kd;
      if constexpr (kDecay == Decay::vector) s_decay[d] = expf(a.g[row * Dk + d]);
    }
    float q_scale = a.scale, k_scale = 1.f;
    if constexpr (kL2Norm) {
      q_scale *= 1.f / sqrtf(warp_sum(qq) + 1e-6f);
      k_scale = 1.f / sqrtf(warp_sum(kk) + 1e-6f);
    }
    const float alpha = kDecay == Decay::scalar ? expf(a.g[row]) : 1.f;
    const float v_col = to_float(v[row * Dv + col]);
    __syncwarp();

    // The decay and the delta rule's prediction in one pass over the state.
    float predicted = 0.f;
#pragma unroll
    for (int d = 0; d < Dk; ++d) {
      if constexpr (kDecay == Decay::vector) state[d] *= s_decay[d];
      if constexpr (kDecay == Decay::scalar) state[d] *= alpha;
      if constexpr (kRule == Rule::delta) predicted += state[d] * s_k[d];
    }
    float update = v_col;
    if constexpr (kRule == Rule::delta) {
      const float beta = to_float(static_cast<const Elem*>(a.beta)[row]);
      update = beta * (v_col - predicted * k_scale);
    }
    // A compiler barrier: the pass below reads s_k and s_q from shared memory
    // again. Left free, the compiler kept the shared values of the passes
    // before (with a vector gate 2 Dk of them) in registers beside the
    // Dk-float state and spilled: KDA at Dk 128 wrote 1.2 KB of spills a
    // thread with the L2 norm and held its state in local memory without it
    // (3.6 KB), at 21 % of HBM's peak against Gated DeltaNet's 74 % (H100,
    // sixty-eighth session). With it no delta rule with the L2 norm spills;
    // at Dk 128 those without it (100-210 bytes) and GLA with it (160) still
    // do: ptxas's own scheduling, which an empty asm does not reach.
    asm volatile("" ::: "memory");
    float out = 0.f;
#pragma unroll
    for (int d = 0; d < Dk; ++d) {
      state[d] += s_k[d] * k_scale * update;
      out += state[d] * s_q[d];
    }
    static_cast<Elem*>(a.o)[row * Dv + col] = from_float<Elem>(out * q_scale);
    __syncwarp();  // s_q/s_k are overwritten by the next token
  }
  if (a.final_state) {
#pragma unroll
    for (int d = 0; d < Dk; ++d) a.final_state[state_base + d * Dv] = state[d];
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
      kernel<<<grid, kDecodeColumns, 0, stream>>>(a);
      SS_LAUNCH_CHECK("recurrent_decode_kernel");
    };
    if (dk == 64) {
      l2norm ? go(recurrent_decode_kernel<kDecay, kRule, Elem, 64, true>)
             : go(recurrent_decode_kernel<kDecay, kRule, Elem, 64, false>);
    } else {
      l2norm ? go(recurrent_decode_kernel<kDecay, kRule, Elem, 128, true>)
             : go(recurrent_decode_kernel<kDecay, kRule, Elem, 128, false>);
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
    host_offsets.resize(static_cast<size_t>(p.num_segments + 1));
    SS_CUDA_CHECK(cudaMemcpyAsync(host_offsets.data(), p.cu_seqlens,
                                  host_offsets.size() * sizeof(int64_t), cudaMemcpyDeviceToHost,
                                  stream));
    SS_CUDA_CHECK(cudaStreamSynchronize(stream));
    host_view.cu_seqlens = host_offsets.data();
  }
  validate(host_view);
  check_grid_limits(p);
  SS_CHECK_ARG(p.dk == p.dv && (p.dk == 64 || p.dk == 128), "dk",
               "CUDA decode supports Dk == Dv in {64, 128}, got Dk ", p.dk, ", Dv ", p.dv);
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
