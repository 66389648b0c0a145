// chunk_prepare16_kernel (forward v3): chunk_prepare_kernel's tiles for
// 16-bit inputs, in the form of the backward's intra-chunk kernels
// (kernels/cuda/PERF_NOTES.md, backward b11): q, k, v as 16-bit operand
// copies in shared memory, every product on mma.sync with fp32 accumulators
// in registers, the UT inverse solved blockwise (chunk_tile_ops.cuh). fp32
// inputs keep chunk_prepare_kernel (tf32 split products).
//
// Outputs (ForwardArgs' ws_* tiles, the same as chunk_prepare_kernel's):
//   Q^ = scale q_t e^{b_t}, K_ = k_t e^{b_C - b_t}, the decay e^{b_C},
//   A (lower, the scale included), and for delta rules W = T diag(beta) K^,
//   U = T diag(beta) V with T = (I + diag(beta) KK)^{-1}; additive rules copy
//   U = V.
//
// Vector gates use the backward's reference rows (chunk_intra_grad_vector.cuh):
// with rho(J) the last row of 16-row block J (b_rho(-1) = 0),
//   Y~(x)_t = x_t e^{b_t - b_rho(I-1)}   (t in block I, factor <= 1)
//   X~(k)_s = k_s e^{b_rho(J) - b_s}     (s in block J, factor <= 1)
// and block (I, J <= I) of A or KK is Y~ diag(e^{b_rho(I-1) - b_rho(J)}) X~^T,
// a tensor-core product whose A operand is scaled per dimension on the way
// in (warp_mm_16xn_xscaled). The middle factor is <= 1 for J < I; on the
// diagonal it is e^{drop}, drop = the gate's decay over the block, so the
// diagonal blocks take this form only while every drop of the chunk is
// <= kMaxDrop (the f16 range); otherwise they are summed exactly on the CUDA
// cores (one exponential per term), decided once per chunk.
//
// Precision: Q^ and K_ come from the exact normalised inputs (rounded once,
// on the store). Without vector gates every product takes the raw 16-bit
// input rows, exact operands, and the row factors enter as fp32 scalings:
//   A_ts = scale rq_t rk_s (q_t . k_s) e^{G_t - G_s},  KK_ts = rk_t rk_s (k_t . k_s) e^{G_t - G_s},
//   W = (T diag(c)) K,  U = (T diag(beta)) V,  c_s = beta_s rk_s e^{G_s},
// with rq, rk the L2 norm's factors (1 without it) and the two C x C factors
// as two 16-bit parts (hi + lo, ~16 bits; T itself enters them as its two
// parts, so a saved T gives bitwise the same W and U): one mma chain for A
// and KK and two for W and U, where normalised operands took three each
// (hi hi + hi lo + lo hi). Vector gates scale per dimension, so there W and
// U = T X are products of two-part copies of T and X = diag(beta) [K^ | V],
// the query side of A and KK enters as two parts, and only the key side
// X~(k) is one 16-bit rounding (PERF_NOTES, v3: what each two-part operand
// is worth, measured and in tests/chunk_fwd_model.h).
//   grid (chunks, H), 512 threads, Prepare16Traits::kBytes of dynamic shared
//   memory (D = 128: kda 111 KB, gla 85 KB, deltanet 105 KB, linear 35 KB),
//   two blocks per multiprocessor.
// Included by chunk_forward.cuh after ForwardArgs and chunk_geometry.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/chunk_tile_ops.cuh"
#include "kernels/cuda/cp_kernels.h"
#include "kernels/cuda/quad_store.cuh"
#include "kernels/cuda/warp_mma.cuh"

namespace statescan::cuda::detail {

template <Decay kDecay, Rule kRule, typename T, int Dk, int Dv, bool kL2Norm>
struct Prepare16Traits {
  static constexpr int kMaxChunk = 64, kThreads = 512, kWarps = 16, kParts = kWarps / 4;
  static constexpr bool kVector = kDecay == Decay::vector;
  static constexpr bool kDelta = kRule == Rule::delta;
  // Without vector gates: the raw input rows as operands, the row factors
  // applied to the products (see the kernel's comment).
  static constexpr bool kRaw = !kVector;
  static constexpr int kLdK = Dk + 8, kLdC = kMaxChunk + 8;  // 16-bit pitches
  static constexpr int kLdB = Dk + 4, kLdF = kMaxChunk + 4;  // fp32 pitches
  static constexpr size_t kKTile = sizeof(T) * kMaxChunk * kLdK;
  // Slots of [C, D] 16-bit tiles. Vector gates: S1 Y~(q), then Y~(k), then
  // diag(beta) K^ = X_K; S2 X~(k), then diag(beta) V = X_V; S3 the low part
  // of S1's Y~, then X_K's low part. Otherwise: S1 q, S2 k and (delta rules)
  // S3 v, the raw input rows. Then the gate cumsum b (fp32, vector gates; for
  // delta rules it later holds X_V's low part and, at D = 128, T's), KK
  // (fp32, T in its upper triangle), T (16-bit; without vector gates the two
  // parts of T diag(c) and of T diag(beta)) and the row vectors. With vector
  // gates v is read only once S2 is free, so that every variant fits two
  // blocks per multiprocessor (kda at D = 128: 111 KB).
  static constexpr int kSlots = 2 + (kVector || kDelta ? 1 : 0);
  static constexpr size_t kOffS1 = 0, kOffS2 = kKTile, kOffS3 = 2 * kKTile;
  static constexpr size_t kBBytes = kVector ? sizeof(float) * kMaxChunk * kLdB : 0;
  static constexpr size_t kTBytes = kDelta ? sizeof(T) * kMaxChunk * kLdC : 0;
  static constexpr bool kTLoInB = kVector && kKTile + kTBytes <= kBBytes;
  static constexpr size_t kOffB = kSlots * kKTile;
  static constexpr size_t kOffKK = kOffB + kBBytes;
  static constexpr size_t kOffT = kOffKK + (kDelta ? sizeof(float) * kMaxChunk * kLdF : 0);
  static constexpr size_t kOffTLoOwn = kOffT + kTBytes;
  // Without vector gates: T diag(beta)'s two parts after T diag(c)'s.
  static constexpr size_t kOffT2 = kOffTLoOwn + (kTLoInB ? 0 : kTBytes);
  static constexpr size_t kOffRows = kOffT2 + (kRaw && kDelta ? 2 * kTBytes : 0);
  static constexpr size_t kOffLoK = kOffS3, kOffLoV = kOffB;  // vector gates only
  static constexpr size_t kOffTLo = kTLoInB ? kOffB + kKTile : kOffTLoOwn;
  // Row vectors: scalar gate cumsum G, beta, the L2 norm's row factors rq, rk.
  static constexpr size_t kBytes = kOffRows + sizeof(float) * 4 * kMaxChunk;
  static_assert(kBytes <= 113 * 1024, "chunk_prepare16_kernel: two blocks per multiprocessor");
  static_assert(!kVector || !kDelta || kKTile <= kBBytes, "X_V's low part fits b's slot");
  static_assert(Dk == Dv, "S2 holds k, then diag(beta) V; v's rows split as q's and k's");
  static_assert(Dk % (16 * kParts) == 0, "each warp takes a column quarter of W and U in n8 pairs");
};

// x0, x1 as a 16-bit pair hi and its rounding lo = x - hi: hi + lo carries
// ~16 bits of x.
template <typename T>
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack2<T>(x0, x1);
  const float2 h = unpack2<T>(hi);
  lo = pack2<T>(x0 - h.x, x1 - h.y);
}
// split_pair's two parts stored at p_hi and p_lo.
template <typename T>
__device__ __forceinline__ void split_store(T* p_hi, T* p_lo, float x0, float x1) {
  split_pair<T>(x0, x1, *reinterpret_cast<uint32_t*>(p_hi), *reinterpret_cast<uint32_t*>(p_lo));
}

// The CP mixer's NaN/Inf check inside the prepare stage (ForwardArgs::
// nonfinite): the prepare reads every element of q, k, v, g and beta once
// anyway, so testing them as they arrive replaces a separate pass over the
// inputs (~0.7 ms of a 28 ms KDA step at 128K tokens, H = 16: PERF_NOTES,
// twenty-third session). A value is non-finite when its exponent bits are
// all set.
// nonfinite_bits: bit 15 (31) set where the low (high) 16-bit half of w has
// every exponent bit set, i.e. is NaN or Inf: the exponent's lowest bit added
// to an all-ones exponent carries into the sign position; smaller exponents
// stay below it, and no carry crosses from the low half into the high one.
// Three instructions per pair (and, add, or into the accumulator): the
// prepare stage issues an instruction on most cycles.
template <typename T>
__device__ __forceinline__ uint32_t nonfinite_bits(uint32_t w) {
  constexpr uint32_t e = std::is_same_v<T, __half> ? 0x7C00u : 0x7F80u;
  constexpr uint32_t one = std::is_same_v<T, __half> ? 0x0400u : 0x0080u;
  return (w & (e | e << 16)) + (one | one << 16);
}
template <typename T>
__device__ __forceinline__ uint32_t nonfinite_bits(uint4 w) {
  return nonfinite_bits<T>(w.x) | nonfinite_bits<T>(w.y) | nonfinite_bits<T>(w.z) |
         nonfinite_bits<T>(w.w);
}
// The same for an fp32 value: bit 31.
__device__ __forceinline__ uint32_t nonfinite_bits(float x) {
  return (__float_as_uint(x) & 0x7F800000u) + 0x00800000u;
}
__device__ __forceinline__ uint32_t nonfinite_bits(float4 x) {
  return nonfinite_bits(x.x) | nonfinite_bits(x.y) | nonfinite_bits(x.z) | nonfinite_bits(x.w);
}
// The same bit for a log gate (DESIGN §2): set where it is NaN, +-Inf or > 0
// (a gate above 1 grows the state to inf within a few dozen tokens).
__device__ __forceinline__ uint32_t bad_log_gate_bits(float x) {
  return nonfinite_bits(x) | (x > 0.f ? 0x80000000u : 0u);
}
__device__ __forceinline__ uint32_t bad_log_gate_bits(float4 x) {
  return bad_log_gate_bits(x.x) | bad_log_gate_bits(x.y) | bad_log_gate_bits(x.z) |
         bad_log_gate_bits(x.w);
}
// Whether an OR of nonfinite_bits (or bad_log_gate_bits) results saw a bad value.
__device__ __forceinline__ bool any_nonfinite(uint32_t acc) {
  return (acc & 0x80008000u) != 0;
}
// ORs `bit` (NonFiniteInput) into *flags: only threads that saw a non-finite
// value get here, so a finite chunk issues no atomics.
__device__ __forceinline__ void flag_nonfinite(unsigned* flags, bool bad, unsigned bit) {
  if (flags != nullptr && bad) atomicOr(flags, bit);
}

template <Decay kDecay, Rule kRule, typename T, int Dk, int Dv, bool kL2Norm, int kChunk>
__global__ void __launch_bounds__(512, 2)
    chunk_prepare16_kernel(const __grid_constant__ ForwardArgs a) {
  static_assert(kChunk == 16 || kChunk == 32 || kChunk == 64, "chunk in {16, 32, 64}");
  static_assert(!std::is_same_v<T, float>, "16-bit inputs only");
  using Tr = Prepare16Traits<kDecay, kRule, T, Dk, Dv, kL2Norm>;
  constexpr bool kVector = Tr::kVector, kDelta = Tr::kDelta;
  constexpr bool kScalar = kDecay == Decay::scalar;
  constexpr int kLdK = Tr::kLdK, kLdC = Tr::kLdC, kLdB = Tr::kLdB;
  constexpr int kLdF = Tr::kLdF, kMC = Tr::kMaxChunk, kWarps = Tr::kWarps;
  constexpr int kThreads = Tr::kThreads, kParts = Tr::kParts;
  // The largest per-block gate decay (e-folds) the diagonal blocks take on
  // the tensor cores: x e^{-drop} must stay a normal f16 (the backward's
  // bound, chunk_intra_grad_vector.cuh, for the same reason).
  constexpr float kMaxDrop = 4.f;
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  T* s1 = reinterpret_cast<T*>(smem_bytes + Tr::kOffS1);
  T* s2 = reinterpret_cast<T*>(smem_bytes + Tr::kOffS2);
  T* s3 = reinterpret_cast<T*>(smem_bytes + Tr::kOffS3);
  float* sB = reinterpret_cast<float*>(smem_bytes + Tr::kOffB);
  float* fKK = reinterpret_cast<float*>(smem_bytes + Tr::kOffKK);
  T* hT = reinterpret_cast<T*>(smem_bytes + Tr::kOffT);
  T* hTlo = reinterpret_cast<T*>(smem_bytes + Tr::kOffTLo);
  // Without vector gates hT, hTlo hold T diag(c) and hU, hUlo T diag(beta).
  T* hU = reinterpret_cast<T*>(smem_bytes + Tr::kOffT2);
  T* hUlo = hU + kMC * kLdC;
  T* sLoK = reinterpret_cast<T*>(smem_bytes + Tr::kOffLoK);
  T* sLoV = reinterpret_cast<T*>(smem_bytes + Tr::kOffLoV);
  float* sG = reinterpret_cast<float*>(smem_bytes + Tr::kOffRows);
  float* sBeta = sG + kMC;
  float* sRq = sBeta + kMC;
  float* sRk = sRq + kMC;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, i2 = 2 * (lane & 3);
  const int64_t c = blockIdx.x, h = blockIdx.y, H = a.heads;
  int64_t token0;
  int L;
  chunk_geometry(a, c, token0, L);
  // The chunk is a compile-time constant: the loops over its rows and 16-row
  // blocks unroll with constant trip counts and strides (a runtime chunk cost
  // the T solve's 16-bit copy a division per element: ncu, 2026-12-02).
  constexpr int C = kChunk, nb = kChunk / 16;
  const float scale = a.scale;
  auto row = [&](int t) { return (token0 + t) * H + h; };
  const T* q_in = static_cast<const T*>(a.q);
  const T* k_in = static_cast<const T*>(a.k);
  const T* v_in = static_cast<const T*>(a.v);
  const int64_t tile = c * H + h;
  T* out_q = static_cast<T*>(a.ws_q) + tile * C * Dk;
  T* out_k = static_cast<T*>(a.ws_k) + tile * C * Dk;
  T* out_u = static_cast<T*>(a.ws_u) + tile * C * Dv;
  T* out_a = static_cast<T*>(a.ws_a) + tile * C * C;
  auto bv = [&](int t, int d) { return sB[t * kLdB + d]; };
  // b at block I's last row; 0 before the chunk (I = -1).
  auto bref = [&](int I, int d) { return I >= 0 ? sB[(16 * I + 15) * kLdB + d] : 0.f; };
  // The exact normalised input (the 16-bit value times the fp32 row factor);
  // 0 past the chunk's valid rows (the diagonal blocks' exact sums).
  auto exact1 = [&](const T* x_in, const float* sR, int t, int d) {
    return t < L ? to_float(x_in[row(t) * Dk + d]) * sR[t] : 0.f;
  };
  // e^{b_t} per column pair (1 without a gate).
  auto up2 = [&](int t, int d) {
    if constexpr (kVector) return make_float2(__expf(bv(t, d)), __expf(bv(t, d + 1)));
    if constexpr (kScalar) return make_float2(__expf(sG[t]), __expf(sG[t]));
    return make_float2(1.f, 1.f);
  };

  // ---- P0: load (rows past the chunk's end are zeros: exact no-ops) --------
  // q and k stay in registers (QKRows: a warp per row) for every phase that
  // reads them; their loads are issued first.
  QKRows<kWarps, Dk, T> qk;
  qk.load(q_in, k_in, row, C, L);
  if (a.nonfinite != nullptr) {  // rows past the chunk's end are zeros
    uint32_t bad_q = 0, bad_k = 0;
#pragma unroll
    for (int i = 0; i < decltype(qk)::kRows; ++i)
#pragma unroll
      for (int e = 0; e < decltype(qk)::kPairs; ++e) {
        bad_q |= nonfinite_bits<T>(qk.wq[i][e]);
        bad_k |= nonfinite_bits<T>(qk.wk[i][e]);
      }
    flag_nonfinite(a.nonfinite, any_nonfinite(bad_q), kNonFiniteQ);
    flag_nonfinite(a.nonfinite, any_nonfinite(bad_k), kNonFiniteK);
  }
  // Delta rules without vector gates: v's raw rows (U's exact operand) by
  // cp.async into S3, and a saved T's two parts (ForwardArgs::t_given: the
  // backward's re-run; the host refuses it with vector gates) into
  // T diag(beta)'s slots, which P3 turns them into; waited for in P3.
  const bool t_given = Tr::kRaw && kDelta && a.t_given;
  if constexpr (Tr::kRaw && kDelta) {
    copy_input_rows_async<kThreads, Dv>(s3, kLdK, v_in, row, C, L);
    if (t_given) {
      copy_tile_async<kThreads>(hU, kLdC, static_cast<const T*>(a.ws_t) + tile * C * C, C, C, C);
      copy_tile_async<kThreads>(hUlo, kLdC, static_cast<const T*>(a.ws_t_lo) + tile * C * C, C,
                                C, C);
    }
    cp_async_commit();
  }
  using Rows = decltype(qk);
  auto for_own_pairs = [&](auto&& f) { Rows::for_each_pair(C, f); };
  if constexpr (!kDelta) {  // additive rules: U = V, straight to the workspace
    constexpr int kVec = 8, kRowVecs = Dv / kVec;  // 16-byte pieces of a v row
#pragma unroll 4  // independent loads in flight together
    for (int idx = tid; idx < C * kRowVecs; idx += kThreads) {
      const int t = idx / kRowVecs, j = (idx % kRowVecs) * kVec;
      const uint4 x = t < L ? *reinterpret_cast<const uint4*>(v_in + row(t) * Dv + j)
                            : make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(out_u + t * Dv + j) = x;
      flag_nonfinite(a.nonfinite, any_nonfinite(nonfinite_bits<T>(x)), kNonFiniteV);
    }
  }
  if constexpr (kVector) {
#pragma unroll 4  // independent loads in flight together
    for (int idx = tid; idx < C * Dk / 4; idx += kThreads) {
      const int t = idx / (Dk / 4), d = (idx % (Dk / 4)) * 4;
      const float4 x = t < L ? load4(a.g + row(t) * Dk + d) : make_float4(0.f, 0.f, 0.f, 0.f);
      *reinterpret_cast<float4*>(sB + t * kLdB + d) = x;
      flag_nonfinite(a.nonfinite, any_nonfinite(bad_log_gate_bits(x)), kNonFiniteG);
    }
  }
  if (tid < kMC) {
    const bool valid = tid < L;
    sBeta[tid] = kDelta && valid ? to_float(static_cast<const T*>(a.beta)[row(tid)]) : 0.f;
    sG[tid] = kScalar && valid ? a.g[row(tid)] : 0.f;
    flag_nonfinite(a.nonfinite, any_nonfinite(nonfinite_bits(sBeta[tid])), kNonFiniteBeta);
    flag_nonfinite(a.nonfinite, any_nonfinite(bad_log_gate_bits(sG[tid])), kNonFiniteG);
  }
  qk.template normalise<kL2Norm>();
  qk.store_factors(sRq, sRk, C);
  __syncthreads();

  // ---- inclusive cumsums of the log gates ------------------------------------
  if constexpr (kVector) {
    // Four threads per column (adjacent lanes), 16 rows each in registers;
    // the quarters' totals are combined by shuffles (a walk of 64 dependent
    // shared-memory steps per column would be the chunk's longest chain).
    if (tid < 4 * Dk) {
      const int d = tid / 4, qtr = tid % 4;
      float x[16], run = 0.f;
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const int t = 16 * qtr + r;
        run += t < C ? sB[t * kLdB + d] : 0.f;
        x[r] = run;
      }
      float before = 0.f;
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        const float total = __shfl_sync(0xffffffffu, run, j, 4);
        before += j < qtr ? total : 0.f;
      }
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const int t = 16 * qtr + r;
        if (t < C) sB[t * kLdB + d] = x[r] + before;
      }
    }
  } else if constexpr (kScalar) {
    if (warp == 0) warp_cumsum64(sG);
  }
  bool fast = true;  // every diagonal block on the tensor cores
  if constexpr (kVector) {
    __syncthreads();
    bool within = true;
    for (int task = tid; task < nb * Dk; task += kThreads) {
      const int I = task / Dk, d = task % Dk;
      within = within && bref(I - 1, d) - bref(I, d) <= kMaxDrop;
    }
    fast = __syncthreads_and(within);
  } else {
    __syncthreads();
  }

  // ---- P1: Q^, K_, the decay out; the operand copies of q and k ------------
  for_own_pairs([&](int t, int i, int e, int d) {
    const int J = t / 16;
    const float2 q2 = qk.q(i, e), k2 = qk.k(i, e);
    const float2 up = up2(t, d);
    float2 down = make_float2(1.f, 1.f);  // e^{b_C - b_t}
    if constexpr (kVector) {
      down = make_float2(__expf(bv(C - 1, d) - bv(t, d)), __expf(bv(C - 1, d + 1) - bv(t, d + 1)));
      const float y0 = __expf(bv(t, d) - bref(J - 1, d));
      const float y1 = __expf(bv(t, d + 1) - bref(J - 1, d + 1));
      const float x0 = __expf(bref(J, d) - bv(t, d));
      const float x1 = __expf(bref(J, d + 1) - bv(t, d + 1));
      split_store(s1 + t * kLdK + d, s3 + t * kLdK + d, q2.x * y0, q2.y * y1);  // Y~(q)
      *reinterpret_cast<uint32_t*>(s2 + t * kLdK + d) = pack2<T>(k2.x * x0, k2.y * x1);
    } else {
      if constexpr (kScalar) down.x = down.y = __expf(sG[C - 1] - sG[t]);
      *reinterpret_cast<uint32_t*>(s1 + t * kLdK + d) = qk.wq[i][e];  // the raw rows
      *reinterpret_cast<uint32_t*>(s2 + t * kLdK + d) = qk.wk[i][e];
    }
    *reinterpret_cast<uint32_t*>(out_q + t * Dk + d) =
        pack2<T>(scale * q2.x * up.x, scale * q2.y * up.y);
    *reinterpret_cast<uint32_t*>(out_k + t * Dk + d) = pack2<T>(k2.x * down.x, k2.y * down.y);
  });
  if (tid < Dk) {
    float decay = 1.f;
    if constexpr (kVector) decay = __expf(bv(C - 1, tid));
    if constexpr (kScalar) decay = __expf(sG[C - 1]);
    a.ws_decay[tile * Dk + tid] = decay;
  }
  // A's blocks above the diagonal are zeros.
  for (int idx = tid; idx < C * C / 2; idx += kThreads) {
    const int t = idx / (C / 2), s = 2 * (idx % (C / 2));
    if (s / 16 > t / 16) *reinterpret_cast<uint32_t*>(out_a + t * C + s) = 0u;
  }
  __syncthreads();

  // ---- P2: A and KK, one warp per 16 x 16 block on and below the diagonal --
  // Vector gates: A's blocks, then (delta rules) Y~(k) replaces Y~(q) in S1
  // and S3 and KK's blocks follow; the query side enters as two parts.
  {
    const int nlow = nb * (nb + 1) / 2;
    auto blocks = [&](int first, int last) {
      for (int task = first + warp; task < last; task += kWarps) {
        const bool is_m = task >= nlow;
        int I = 0, J = is_m ? task - nlow : task;
        while (J > I) J -= ++I;
        if (kVector && J == I && !fast) continue;  // summed exactly below
        float acc[2][4] = {};
        [[maybe_unused]] const T* x = is_m ? s2 : s1;
        if constexpr (kVector)
          warp_mm_16xn_xscaled<T, false, 2, true>(
              acc, s1, kLdK, s2, kLdK, 16 * I, 16 * J, Dk,
              [&](int d) { return __expf(bref(I - 1, d) - bref(J, d)); }, s3);
        else
          warp_mm_16xn<T, false, false, 2>(acc, x, kLdK, s2, kLdK, 16 * I, 16 * J, Dk);
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int t = 16 * I + g + 8 * hr;
          uint32_t w[2];  // A's row t, columns 16 J .. + 15: whole sectors (quad_store.cuh)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int s = 16 * J + 8 * j + i2;
            float v0 = acc[j][2 * hr], v1 = acc[j][2 * hr + 1];
            if constexpr (Tr::kRaw && kL2Norm) {  // the raw rows' products, normalised
              const float rt = is_m ? sRk[t] : sRq[t];
              v0 *= rt * sRk[s];
              v1 *= rt * sRk[s + 1];
            }
            if constexpr (kScalar) {  // selected, not multiplied: e^{G_t - G_s} is inf above
              v0 = s <= t ? v0 * __expf(sG[t] - sG[s]) : 0.f;
              v1 = s + 1 <= t ? v1 * __expf(sG[t] - sG[s + 1]) : 0.f;
            }
            if (!is_m) {
              w[j] = pack2<T>(s <= t ? v0 * scale : 0.f, s + 1 <= t ? v1 * scale : 0.f);
            } else {
              if (s < t) fKK[t * kLdF + s] = v0;
              if (s + 1 < t) fKK[t * kLdF + s + 1] = v1;
            }
          }
          if (!is_m) store_quad_row(out_a + t * C + 16 * J, w, lane & 3, true);  // warp-uniform
        }
      }
    };
    if constexpr (kVector && kDelta) {
      blocks(0, nlow);
      __syncthreads();
      for_own_pairs([&](int t, int i, int e, int d) {
        const int J = t / 16;
        const float2 k2 = qk.k(i, e);
        split_store(s1 + t * kLdK + d, s3 + t * kLdK + d, k2.x * __expf(bv(t, d) - bref(J - 1, d)),
                    k2.y * __expf(bv(t, d + 1) - bref(J - 1, d + 1)));  // Y~(k)
      });
      __syncthreads();
      blocks(nlow, 2 * nlow);
    } else {
      // With T given (a saved T: the backward's re-run), KK is not needed.
      blocks(0, (kDelta && !t_given ? 2 : 1) * nlow);
    }
    if constexpr (kVector) {
      if (!fast) {
        // The diagonal blocks exactly: a warp per pair (t, s <= t) of a
        // block, lanes over d, one exponential per term.
        constexpr int kPairs = 16 * 17 / 2;
        for (int p = warp; p < nb * kPairs; p += kWarps) {
          int u = 0, w = p % kPairs;
          while (w > u) w -= ++u;
          const int t = 16 * (p / kPairs) + u, s = t - u + w;
          float aq = 0.f, am = 0.f;
#pragma unroll
          for (int e = 0; e < Dk / 32; ++e) {
            const int d = lane + 32 * e;
            const float ks = exact1(k_in, sRk, s, d) * __expf(bv(t, d) - bv(s, d));
            aq += exact1(q_in, sRq, t, d) * ks;
            am += exact1(k_in, sRk, t, d) * ks;
          }
          aq = warp_sum(aq);
          am = warp_sum(am);
          if (lane == 0) {
            out_a[t * C + s] = from_float<T>(aq * scale);
            if (kDelta && s < t) fKK[t * kLdF + s] = am;
          }
        }
        for (int idx = tid; idx < nb * 256; idx += kThreads) {  // their upper halves
          const int t = 16 * (idx / 256) + (idx % 256) / 16, s = 16 * (idx / 256) + idx % 16;
          if (s > t) out_a[t * C + s] = from_float<T>(0.f);
        }
      }
    }
  }
  if constexpr (kDelta) {  // additive rules are done
    __syncthreads();

    if constexpr (kVector) {
      // (ForwardArgs::ws_t and ws_t_lo are null with vector gates: the host
      // hands T over and saves it only for the other delta rules, t_capable.)
      // ---- P3: X = diag(beta) [K^ | V] as 16-bit hi + lo parts; T (hi + lo) -
      // X_K first (it reads b, whose slot X_V's low part takes), then X_V
      // after a barrier. v's loads (a warp per row, as q and k) are issued
      // first, so their latency passes under X_K and T's diagonal blocks (two
      // warps' work) instead of after the barrier.
      uint32_t wv[Rows::kRows][Rows::kPairs];
#pragma unroll
      for (int i = 0; i < Rows::kRows; ++i) {
        const int t = Rows::row_of(i);
#pragma unroll
        for (int e = 0; e < Rows::kPairs; ++e)
          wv[i][e] = t < L && t < C ? *reinterpret_cast<const uint32_t*>(v_in + row(t) * Dv +
                                                                         Rows::col_of(e))
                                    : 0u;
      }
      if (a.nonfinite != nullptr) {
        uint32_t bad_v = 0;
#pragma unroll
        for (int i = 0; i < Rows::kRows; ++i)
#pragma unroll
          for (int e = 0; e < Rows::kPairs; ++e) bad_v |= nonfinite_bits<T>(wv[i][e]);
        flag_nonfinite(a.nonfinite, any_nonfinite(bad_v), kNonFiniteV);
      }
      for_own_pairs([&](int t, int i, int e, int d) {
        const float2 k2 = qk.k(i, e), up = up2(t, d);
        split_store(s1 + t * kLdK + d, sLoK + t * kLdK + d, sBeta[t] * k2.x * up.x,
                    sBeta[t] * k2.y * up.y);
      });
      intra_solve_t_diagonal<kMC>(fKK, kLdF, sBeta, C);
      __syncthreads();
      for_own_pairs([&](int t, int i, int e, int j) {
        const float2 v2 = unpack2<T>(wv[i][e]);
        split_store(s2 + t * kLdK + j, sLoV + t * kLdK + j, sBeta[t] * v2.x, sBeta[t] * v2.y);
      });
      // Ends with a barrier (after T's block rows, before P4).
      intra_solve_t_blocks<kThreads, true>(hT, kLdC, fKK, kLdF, sBeta, nb, hTlo);
    } else {
      // ---- P3: T, then the two C x C factors of W and U, two parts each ----
      if (!t_given) {
        intra_solve_t_diagonal<kMC>(fKK, kLdF, sBeta, C);
        __syncthreads();
        intra_solve_t_rows<kWarps>(fKK, kLdF, sBeta, nb);
      }
      cp_async_wait<0>();  // v's rows, a saved T's parts
      __syncthreads();
      if (a.nonfinite != nullptr) {  // v's raw rows, now in S3 (zeros past the end)
        constexpr int kRowVecs = Dv / 8;
        uint32_t bad_v = 0;
        for (int idx = tid; idx < C * kRowVecs; idx += kThreads)
          bad_v |= nonfinite_bits<T>(
              *reinterpret_cast<const uint4*>(s3 + (idx / kRowVecs) * kLdK + (idx % kRowVecs) * 8));
        flag_nonfinite(a.nonfinite, any_nonfinite(bad_v), kNonFiniteV);
      }
      // T as its two 16-bit parts (solved here or saved: the same values
      // either way), then T diag(c) into hT, hTlo and T diag(beta) into hU,
      // hUlo (in place of a saved T's parts: each pair is read, then written,
      // by the same thread). A solved T's parts also go out: the hi part for
      // the backward's chunk_intra_grad_kernel (ForwardArgs::ws_t), the lo
      // part where T is saved for the backward's prepare re-run (ws_t_lo).
      T* out_t = a.ws_t != nullptr && !t_given ? static_cast<T*>(a.ws_t) + tile * C * C : nullptr;
      T* out_t_lo =
          a.ws_t_lo != nullptr && !t_given ? static_cast<T*>(a.ws_t_lo) + tile * C * C : nullptr;
      for (int idx = tid; idx < C * C / 2; idx += kThreads) {
        const int t = idx / (C / 2), s = 2 * (idx % (C / 2));
        uint32_t hi, lo;
        if (t_given) {
          hi = *reinterpret_cast<const uint32_t*>(hU + t * kLdC + s);
          lo = *reinterpret_cast<const uint32_t*>(hUlo + t * kLdC + s);
        } else {
          split_pair<T>(intra_t_entry(fKK, kLdF, t, s), intra_t_entry(fKK, kLdF, t, s + 1), hi,
                        lo);
          if (out_t != nullptr) *reinterpret_cast<uint32_t*>(out_t + t * C + s) = hi;
          if (out_t_lo != nullptr) *reinterpret_cast<uint32_t*>(out_t_lo + t * C + s) = lo;
        }
        const float2 h = unpack2<T>(hi), l = unpack2<T>(lo);
        const float t0 = h.x + l.x, t1 = h.y + l.y;
        const float b0 = sBeta[s], b1 = sBeta[s + 1];
        float c0 = b0 * sRk[s], c1 = b1 * sRk[s + 1];
        if constexpr (kScalar) {
          c0 *= __expf(sG[s]);
          c1 *= __expf(sG[s + 1]);
        }
        split_store(hT + t * kLdC + s, hTlo + t * kLdC + s, t0 * c0, t1 * c1);
        split_store(hU + t * kLdC + s, hUlo + t * kLdC + s, t0 * b0, t1 * b1);
      }
      __syncthreads();
    }

    // ---- P4: W and U ------------------------------------------------------------
    // Vector gates: [W | U] = T X as T_hi X_hi + T_hi X_lo + T_lo X_hi (~16
    // bits, as the fp32 kernel's tf32 split; one 16-bit product: the host
    // model's deltanet o 4.53e-3 -> 4.95e-3, KDA 3.96e-3 -> 4.36e-3).
    // Otherwise W = (T diag(c))_hi K + (T diag(c))_lo K and U likewise with
    // T diag(beta) and V: the raw rows are exact. Warp (rt, part): rows
    // 16 rt .. 16 rt + 16, column quarter `part`; T is lower triangular, so
    // the contraction stops at the slab's last row.
    const int rt = warp & 3, part = warp >> 2, m0 = 16 * rt;
    if (rt < nb) {
      auto product = [&](auto nt_tag, const T* t_hi, const T* t_lo, const T* x_hi,
                         [[maybe_unused]] const T* x_lo, int D, T* out) {
        constexpr int kNT = decltype(nt_tag)::value;
        const int n0 = part * (D / kParts);
        float acc[kNT][4] = {};
        warp_mm_16xn<T, false, true, kNT>(acc, t_hi, kLdC, x_hi, kLdK, m0, n0, m0 + 16);
        if constexpr (kVector)
          warp_mm_16xn<T, false, true, kNT>(acc, t_hi, kLdC, x_lo, kLdK, m0, n0, m0 + 16);
        warp_mm_16xn<T, false, true, kNT>(acc, t_lo, kLdC, x_hi, kLdK, m0, n0, m0 + 16);
        // Whole sectors: one quad exchange, then 8-byte pieces (quad_store.cuh;
        // straight from the fragment layout each store wrote 4 bytes into each
        // of 8 rows). The workspace tile is C rows whatever L is, so every row
        // is written.
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          uint32_t w[kNT];
#pragma unroll
          for (int j = 0; j < kNT; ++j) w[j] = pack2<T>(acc[j][2 * hr], acc[j][2 * hr + 1]);
          store_quad_row(out + (m0 + g + 8 * hr) * D + n0, w, lane & 3, true);
        }
      };
      using KTiles = std::integral_constant<int, Dk / (8 * kParts)>;
      using VTiles = std::integral_constant<int, Dv / (8 * kParts)>;
      T* out_w = static_cast<T*>(a.ws_w) + tile * C * Dk;
      if constexpr (kVector) {
        product(KTiles{}, hT, hTlo, s1, sLoK, Dk, out_w);
        product(VTiles{}, hT, hTlo, s2, sLoV, Dv, out_u);
      } else {
        product(KTiles{}, hT, hTlo, s2, nullptr, Dk, out_w);
        product(VTiles{}, hU, hUlo, s3, nullptr, Dv, out_u);
      }
    }
  }
}

}  // namespace statescan::cuda::detail
