// Chunkwise forward family for the six variants (DESIGN §3-4), templated on
// <Decay, Rule, element type, Dk, Dv>. Three kernels per call, on the
// caller's stream, talking through an fp32 workspace:
//
//   1. chunk_prepare_kernel  (one block per (chunk, head); all chunks in parallel)
//      everything that does not depend on the state entering the chunk:
//      gate cumsums, decayed queries/keys, the masked intra-chunk attention A,
//      and for delta rules the UT transform W = T diag(beta) K^, U = T diag(beta) V.
//   2. chunk_state_scan_kernel  (one block per (segment, head, Dv block))
//      the only sequential part, kept minimal: walks the segment's chunks
//      carrying the fp32 state S, saving S_c, V' = U - W S_c and
//      S <- diag(decay) S + K_^T V'.
//   3. chunk_output_kernel  (one block per (chunk, head, Dv half); parallel)
//      O = Q^ S_c + A V'.
//
// Flags: l2norm is a template parameter (it changes the load stage); an
// initial state and packed sequences only change where a block starts and
// which state it loads, once per block, so they stay run-time values.
// Instantiated here: dtype in {f32, bf16, f16} x Dk == Dv in {64, 128}.
//
// Notation per chunk (rows t = 0..C-1, b_t = inclusive cumsum of log gates
// from the chunk start; padded rows past a segment's end are zero with g = 0,
// which makes them exact no-ops):
//   Q^ = scale * q_t * e^{b_t}     K^ = k_t * e^{b_t}     K_ = k_t * e^{b_C - b_t}
//   A_ts  = scale * sum_d q_td k_sd e^{b_td - b_sd}   (s <= t, else 0)
//   M_ts  = beta_t sum_d k_td k_sd e^{b_td - b_sd}      (s <  t, else 0)
//   T = (I + M)^{-1}    W = T diag(beta) K^    U = T diag(beta) V  (additive: U = V)
// Every exponent above is <= 0, so nothing overflows however negative the
// gates are; A and M for vector gates are built from 16-row blocks whose
// reference point keeps both factors <= 1 (see chunk_prepare_kernel).
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/options.h"
#include "kernels/cuda/device_math.cuh"

namespace statescan::cuda::detail {

// Everything both kernels need, by value (__grid_constant__). Pointers are
// device pointers; the ws_* buffers are this call's workspace.
struct ForwardArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* g = nullptr;
  const void* beta = nullptr;
  const float* initial_state = nullptr;
  void* o = nullptr;
  float* final_state = nullptr;
  float* chunk_states = nullptr;

  float* ws_q = nullptr;      // Q^    [chunks, H, C, Dk]
  float* ws_k = nullptr;      // K_    [chunks, H, C, Dk]
  float* ws_w = nullptr;      // W     [chunks, H, C, Dk] (delta rules only)
  float* ws_u = nullptr;      // U     [chunks, H, C, Dv]
  float* ws_a = nullptr;      // A     [chunks, H, C, C]
  float* ws_decay = nullptr;  // e^{b_C} per key dim [chunks, H, Dk]
  float* ws_vnew = nullptr;   // V' = U - W S [chunks, H, C, Dv] (delta rules only)
  float* states = nullptr;    // state entering each chunk [chunks, H, Dk, Dv]:
                              // the caller's chunk_states, or workspace
  int num_sms = 132;
  int scan_block_cols = 0;  // 16 or 32 to force the scan's Dv block; 0 = by occupancy

  int64_t heads = 0;
  int64_t seq_len = 0;
  int chunk = 64;
  float scale = 1.f;
  int64_t num_segments = 0;
  int64_t num_chunks = 0;
  int64_t chunks_per_row = 0;              // without cu_seqlens
  const int64_t* chunk_table = nullptr;    // packed: [chunks][2] = first token, token count
  const int64_t* segment_table = nullptr;  // packed: [N][2] = first chunk, chunk count
};

// First flattened token (b*T + t) and valid length of global chunk c.
__device__ __forceinline__ void chunk_geometry(const ForwardArgs& a, int64_t c, int64_t& token0,
                                               int& length) {
  if (a.chunk_table != nullptr) {
    token0 = a.chunk_table[2 * c];
    length = static_cast<int>(a.chunk_table[2 * c + 1]);
  } else {
    const int64_t row = c / a.chunks_per_row, local = c % a.chunks_per_row;
    token0 = row * a.seq_len + local * a.chunk;
    const int64_t left = a.seq_len - local * a.chunk;
    length = static_cast<int>(left < a.chunk ? left : a.chunk);
  }
}

// Compile-time tile shapes. Rows of shared tiles are padded by 4 floats so
// that wmma's column walks do not hit one bank and every 8-row offset stays
// 32-byte aligned (wmma needs 256-bit aligned tile pointers).
template <Decay kDecay, Rule kRule, int Dk, int Dv>
struct ChunkTraits {
  static constexpr int kMaxChunk = 64;
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kPad = 4;
  static constexpr int kLdK = Dk + kPad;
  static constexpr int kLdV = Dv + kPad;
  static constexpr int kLdC = kMaxChunk + kPad;
  static constexpr bool kVector = kDecay == Decay::vector;
  static constexpr bool kDelta = kRule == Rule::delta;
  static_assert(Dk % 16 == 0 && Dv % 16 == 0, "head dims must be multiples of 16");
  static_assert(Dk <= 128 && Dv <= 128, "head dims above 128 need another tiling");
  static_assert(Dk + Dv <= kThreads, "forward substitution uses one thread per column");
  static_assert(kMaxChunk % 16 == 0, "chunk must be whole 16-row blocks");

  // chunk_prepare_kernel shared memory, in floats (each piece a multiple of 8).
  static constexpr int kPrepQ = kMaxChunk * kLdK;
  static constexpr int kPrepK = kMaxChunk * kLdK;
  static constexpr int kPrepG = kVector ? kMaxChunk * kLdK : kMaxChunk;
  static constexpr int kPrepV = kDelta ? kMaxChunk * kLdV : 0;
  static constexpr int kPrepA = kMaxChunk * kLdC;
  static constexpr int kPrepM = kDelta ? kMaxChunk * kLdC : 0;
  static constexpr int kPrepBeta = kMaxChunk;
  // vector gates: K rescaled to one 16-row block's reference (up to 48 rows),
  // plus that block's rescaled q and k rows.
  static constexpr int kPrepScratch = kVector ? (kMaxChunk - 16 + 32) * kLdK : 0;
  static constexpr int kPrepFloats =
      kPrepQ + kPrepK + kPrepG + kPrepV + kPrepA + kPrepM + kPrepBeta + kPrepScratch;
  static constexpr size_t kPrepBytes = sizeof(float) * kPrepFloats;
  static_assert(kPrepBytes <= 227 * 1024, "chunk_prepare_kernel exceeds Hopper shared memory");
};

template <int Dk, int Dv, int BV, bool kDelta>
struct ScanTraits {
  static constexpr int kMaxChunk = 64;
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kLdK = Dk + 4;
  static constexpr int kLdB = BV + 4;
  static_assert(Dv % BV == 0 && BV % 16 == 0, "Dv block must be whole 16-column tiles");
  static_assert((kMaxChunk / 16) * (BV / 16) <= kWarps, "one V' tile per warp");
  static_assert(Dk % 4 == 0 && BV % 4 == 0, "16-byte asynchronous copies");
  static constexpr int kS = Dk * kLdB;
  static constexpr int kTileK = kMaxChunk * kLdK;  // K_ or W
  static constexpr int kTileB = kMaxChunk * kLdB;  // U
  // One pipeline stage: K_, W (delta), U, decay.
  static constexpr int kStage = (kDelta ? 2 : 1) * kTileK + kTileB + Dk;
  static constexpr int kFloats = kS + 2 * kStage + kTileB;
  static constexpr size_t kBytes = sizeof(float) * kFloats;
  static_assert(kBytes <= 227 * 1024, "chunk_state_scan_kernel exceeds Hopper shared memory");
};

template <int Dk, int Dv>
struct OutputTraits {
  static constexpr int kMaxChunk = 64;
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kLdK = Dk + 4;
  static constexpr int kCols = Dv / 2;  // each block writes half the columns
  static constexpr int kLdV = kCols + 4;
  static constexpr int kLdC = kMaxChunk + 4;
  static_assert(kCols % 32 == 0, "two warps per row tile, whole 16-column tiles each");
  static constexpr int kQ = kMaxChunk * kLdK;
  static constexpr int kA = kMaxChunk * kLdC;
  static constexpr int kS = Dk * kLdV;
  static constexpr int kV = kMaxChunk * kLdV;  // V', then O
  static constexpr int kFloats = kQ + kA + kS + kV;
  static constexpr size_t kBytes = sizeof(float) * kFloats;
  static_assert(kBytes <= 227 * 1024, "chunk_output_kernel exceeds Hopper shared memory");
};

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* global_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global_src));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Copies a rows x cols fp32 tile (global row stride ld_src) into shared
// memory (row stride ld_dst) with 16-byte asynchronous copies.
template <int kThreads>
__device__ __forceinline__ void copy_tile_async(float* dst, int ld_dst, const float* src,
                                                int64_t ld_src, int rows, int cols) {
  const int vec_per_row = cols / 4;
  for (int idx = threadIdx.x; idx < rows * vec_per_row; idx += kThreads) {
    const int i = idx / vec_per_row, j = (idx % vec_per_row) * 4;
    cp_async16(dst + i * ld_dst + j, src + i * ld_src + j);
  }
}

// chunk_prepare_kernel: the state-independent part of one chunk.
//   grid (num_chunks, H), 256 threads; block (c, h) reads chunk c's q, k, v,
//   g, beta of head h and writes ws_q/ws_k/ws_w/ws_u/ws_a/ws_decay tiles.
//   Shared memory: ChunkTraits::kPrepBytes (213 KB for kda at D=128).
//   Constraints: chunk in {16, 32, 64}; Dk, Dv multiples of 16, <= 128.
template <Decay kDecay, Rule kRule, typename Elem, int Dk, int Dv, bool kL2Norm>
__global__ void __launch_bounds__(256) chunk_prepare_kernel(const __grid_constant__ ForwardArgs a) {
  using Tr = ChunkTraits<kDecay, kRule, Dk, Dv>;
  constexpr bool kSplit = std::is_same_v<Elem, float>;
  constexpr int kLdK = Tr::kLdK, kLdV = Tr::kLdV, kLdC = Tr::kLdC;
  extern __shared__ __align__(128) float smem[];
  float* sQ = smem;
  float* sK = sQ + Tr::kPrepQ;
  float* sG = sK + Tr::kPrepK;
  float* sV = sG + Tr::kPrepG;
  float* sA = sV + Tr::kPrepV;
  float* sM = sA + Tr::kPrepA;
  float* sBeta = sM + Tr::kPrepM;
  float* sScratch = sBeta + Tr::kPrepBeta;

  const int64_t c = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int C = a.chunk, nb = C / 16;
  int64_t token0;
  int length;
  chunk_geometry(a, c, token0, length);
  const int64_t H = a.heads;

  // ---- load (rows past the segment's end are zeros: exact no-ops) ----------
  const Elem* q = static_cast<const Elem*>(a.q);
  const Elem* k = static_cast<const Elem*>(a.k);
  const Elem* v = static_cast<const Elem*>(a.v);
  const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int idx = tid; idx < C * Dk / 4; idx += Tr::kThreads) {
    const int i = idx / (Dk / 4), d = (idx % (Dk / 4)) * 4;
    const bool valid = i < length;
    const int64_t src = ((token0 + i) * H + h) * Dk + d;
    store4(sQ + i * kLdK + d, valid ? load4(q + src) : zero4);
    store4(sK + i * kLdK + d, valid ? load4(k + src) : zero4);
    if constexpr (Tr::kVector) store4(sG + i * kLdK + d, valid ? load4(a.g + src) : zero4);
  }
  // Delta rules transform V in shared memory; additive rules use U = V and
  // copy it straight to the workspace.
  float* out_u = a.ws_u + (c * H + h) * C * Dv;
  for (int idx = tid; idx < C * Dv / 4; idx += Tr::kThreads) {
    const int i = idx / (Dv / 4), j = (idx % (Dv / 4)) * 4;
    const float4 x = i < length ? load4(v + ((token0 + i) * H + h) * Dv + j) : zero4;
    if constexpr (Tr::kDelta)
      store4(sV + i * kLdV + j, x);
    else
      store4(out_u + i * Dv + j, x);
  }
  if (tid < C) {
    const bool valid = tid < length;
    if constexpr (kDecay == Decay::scalar) sG[tid] = valid ? a.g[(token0 + tid) * H + h] : 0.f;
    if constexpr (Tr::kDelta)
      sBeta[tid] = valid ? to_float(static_cast<const Elem*>(a.beta)[(token0 + tid) * H + h]) : 0.f;
  }
  __syncthreads();

  // ---- optional L2 normalisation of q and k, then the scale on q -----------
  for (int i = warp; i < C; i += Tr::kWarps) {
    float q_scale = a.scale;
    if constexpr (kL2Norm) {
      float qq = 0.f, kk = 0.f;
      for (int d = lane; d < Dk; d += 32) {
        qq += sQ[i * kLdK + d] * sQ[i * kLdK + d];
        kk += sK[i * kLdK + d] * sK[i * kLdK + d];
      }
      qq = warp_sum(qq);
      kk = warp_sum(kk);
      const float k_scale = 1.f / sqrtf(kk + 1e-6f);
      q_scale *= 1.f / sqrtf(qq + 1e-6f);
      for (int d = lane; d < Dk; d += 32) sK[i * kLdK + d] *= k_scale;
    }
    for (int d = lane; d < Dk; d += 32) sQ[i * kLdK + d] *= q_scale;
  }

  // ---- inclusive cumsum of log gates within the chunk ----------------------
  if constexpr (Tr::kVector) {
    if (tid < Dk) {
      float run = 0.f;
      for (int i = 0; i < C; ++i) {
        run += sG[i * kLdK + tid];
        sG[i * kLdK + tid] = run;
      }
    }
  } else if constexpr (kDecay == Decay::scalar) {
    if (tid == 0) {
      float run = 0.f;
      for (int i = 0; i < C; ++i) {
        run += sG[i];
        sG[i] = run;
      }
    }
  }
  __syncthreads();

  // ---- intra-chunk products A = Q K^T and M = K K^T (raw, masked below) ----
  if constexpr (!Tr::kVector) {
    // Scalar/no decay: the gate factor is per (t, s) and applied afterwards.
    const int lower_tiles = nb * (nb + 1) / 2;
    const int total = lower_tiles * (Tr::kDelta ? 2 : 1);
    for (int t = warp; t < total; t += Tr::kWarps) {
      const bool is_m = t >= lower_tiles;
      int rest = is_m ? t - lower_tiles : t, I = 0;
      while (rest > I) rest -= ++I;
      const int J = rest;
      const float* rows = is_m ? sK : sQ;
      AccFragment acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll 4
      for (int kk = 0; kk < Dk; kk += 8)
        mma_tf32<wmma::row_major, wmma::col_major, kSplit>(acc, rows + I * 16 * kLdK + kk, kLdK,
                                                           sK + J * 16 * kLdK + kk, kLdK);
      wmma::store_matrix_sync((is_m ? sM : sA) + I * 16 * kLdC + J * 16, acc, kLdC,
                              wmma::mem_row_major);
    }
  } else {
    // Vector decay. Diagonal 16x16 blocks exactly on the CUDA cores (their
    // exponents b_t - b_s are small and <= 0 for s <= t) ...
    constexpr int kPairs = 16 * 17 / 2;  // (r, s) with s <= r in one 16x16 block
    for (int slot = tid; slot < nb * kPairs; slot += Tr::kThreads) {
      const int I = slot / kPairs, pair = slot % kPairs;
      int r = static_cast<int>((sqrtf(8.f * pair + 1.f) - 1.f) * 0.5f);
      if ((r + 1) * (r + 2) / 2 <= pair) ++r;  // guard the float rounding
      if (r * (r + 1) / 2 > pair) --r;
      const int s = pair - r * (r + 1) / 2;
      const int i = I * 16 + r, j = I * 16 + s;
      float aq = 0.f, am = 0.f;
      for (int d = 0; d < Dk; ++d) {
        const float e = __expf(sG[i * kLdK + d] - sG[j * kLdK + d]);
        const float kj = sK[j * kLdK + d] * e;
        aq += sQ[i * kLdK + d] * kj;
        am += sK[i * kLdK + d] * kj;
      }
      sA[i * kLdC + j] = aq;
      if constexpr (Tr::kDelta) sM[i * kLdC + j] = am;
    }
    // ... and the blocks left of the diagonal on the tensor cores: for row
    // block I the reference is r = b at row 16I, so q/k rows of block I are
    // scaled by e^{b_t - b_r} <= 1 and key rows s < 16I by e^{b_r - b_s} <= 1.
    float* sKp = sScratch;                                // [16I][kLdK]
    float* sQp = sScratch + (Tr::kMaxChunk - 16) * kLdK;  // [16][kLdK]
    float* sKq = sQp + 16 * kLdK;                         // [16][kLdK]
    for (int I = 1; I < nb; ++I) {
      const int r0 = I * 16;
      for (int idx = tid; idx < (r0 + 16) * Dk; idx += Tr::kThreads) {
        const int i = idx / Dk, d = idx % Dk;
        const float ref = sG[r0 * kLdK + d];
        if (i < r0) {
          sKp[i * kLdK + d] = sK[i * kLdK + d] * __expf(ref - sG[i * kLdK + d]);
        } else {
          const float e = __expf(sG[i * kLdK + d] - ref);
          sQp[(i - r0) * kLdK + d] = sQ[i * kLdK + d] * e;
          sKq[(i - r0) * kLdK + d] = sK[i * kLdK + d] * e;
        }
      }
      __syncthreads();
      for (int t = warp; t < (Tr::kDelta ? 2 : 1) * I; t += Tr::kWarps) {
        const bool is_m = t >= I;
        const int J = is_m ? t - I : t;
        AccFragment acc;
        wmma::fill_fragment(acc, 0.f);
#pragma unroll 4
        for (int kk = 0; kk < Dk; kk += 8)
          mma_tf32<wmma::row_major, wmma::col_major, kSplit>(acc, (is_m ? sKq : sQp) + kk, kLdK,
                                                             sKp + J * 16 * kLdK + kk, kLdK);
        wmma::store_matrix_sync((is_m ? sM : sA) + r0 * kLdC + J * 16, acc, kLdC,
                                wmma::mem_row_major);
      }
      __syncthreads();
    }
  }
  __syncthreads();

  // ---- causal masks, scalar gate factors, beta rows ------------------------
  for (int idx = tid; idx < C * C; idx += Tr::kThreads) {
    const int i = idx / C, j = idx % C;
    float factor = 1.f;
    if constexpr (kDecay == Decay::scalar) factor = j <= i ? __expf(sG[i] - sG[j]) : 0.f;
    sA[i * kLdC + j] = j <= i ? sA[i * kLdC + j] * factor : 0.f;
    if constexpr (Tr::kDelta) sM[i * kLdC + j] = j < i ? sBeta[i] * sM[i * kLdC + j] * factor : 0.f;
  }

  // ---- decayed queries/keys out; delta rules turn K into diag(beta) K^ -----
  const int64_t tile = c * H + h;
  float* out_q = a.ws_q + tile * C * Dk;
  float* out_k = a.ws_k + tile * C * Dk;
  for (int idx = tid; idx < C * Dk / 4; idx += Tr::kThreads) {
    const int i = idx / (Dk / 4), d0 = (idx % (Dk / 4)) * 4;
    float qv[4], kv[4], kb[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = d0 + e;
      float up = 1.f, down = 1.f;  // e^{b_t}, e^{b_C - b_t}
      if constexpr (Tr::kVector) {
        const float b = sG[i * kLdK + d];
        up = __expf(b);
        down = __expf(sG[(C - 1) * kLdK + d] - b);
      } else if constexpr (kDecay == Decay::scalar) {
        up = __expf(sG[i]);
        down = __expf(sG[C - 1] - sG[i]);
      }
      const float kd = sK[i * kLdK + d];
      qv[e] = sQ[i * kLdK + d] * up;
      kv[e] = kd * down;
      kb[e] = sBeta[i] * kd * up;
    }
    store4(out_q + i * Dk + d0, make_float4(qv[0], qv[1], qv[2], qv[3]));
    store4(out_k + i * Dk + d0, make_float4(kv[0], kv[1], kv[2], kv[3]));
    if constexpr (Tr::kDelta) store4(sK + i * kLdK + d0, make_float4(kb[0], kb[1], kb[2], kb[3]));
  }
  if (tid < Dk) {
    float decay = 1.f;
    if constexpr (Tr::kVector) decay = __expf(sG[(C - 1) * kLdK + tid]);
    if constexpr (kDecay == Decay::scalar) decay = __expf(sG[C - 1]);
    a.ws_decay[tile * Dk + tid] = decay;
  }
  if constexpr (Tr::kDelta) {
    for (int idx = tid; idx < C * Dv; idx += Tr::kThreads) {
      const int i = idx / Dv, j = idx % Dv;
      sV[i * kLdV + j] *= sBeta[i];
    }
  }
  __syncthreads();

  // ---- UT transform: solve (I + M) [W | U] = [diag(beta) K^ | diag(beta) V]
  // in place, blockwise over 16-row blocks b: first X_b -= M[b, <b] X[<b] on
  // the tensor cores (earlier blocks are final), then forward substitution
  // inside the block, one thread per column.
  if constexpr (Tr::kDelta) {
    constexpr int kColTilesX = (Dk + Dv) / 16;
    for (int b = 0; b < nb; ++b) {
      if (b > 0) {
        for (int t = warp; t < kColTilesX; t += Tr::kWarps) {
          const bool in_k = t * 16 < Dk;
          float* x = in_k ? sK + t * 16 : sV + (t * 16 - Dk);
          const int ld = in_k ? kLdK : kLdV;
          AccFragment acc;
          wmma::load_matrix_sync(acc, x + b * 16 * ld, ld, wmma::mem_row_major);
          for (int kk = 0; kk < b * 16; kk += 8)
            mma_tf32<wmma::row_major, wmma::row_major, kSplit, true>(acc, sM + b * 16 * kLdC + kk,
                                                                     kLdC, x + kk * ld, ld);
          wmma::store_matrix_sync(x + b * 16 * ld, acc, ld, wmma::mem_row_major);
        }
        __syncthreads();
      }
      if (tid < Dk + Dv) {
        // The block's 16 entries of this column stay in registers, so the
        // dependency chain is register FMAs rather than shared-memory round trips.
        float* x = tid < Dk ? sK + tid : sV + (tid - Dk);
        const int ld = tid < Dk ? kLdK : kLdV;
        const float* m = sM + b * 16 * kLdC + b * 16;
        float xr[16];
#pragma unroll
        for (int r = 0; r < 16; ++r) xr[r] = x[(b * 16 + r) * ld];
#pragma unroll
        for (int r = 1; r < 16; ++r) {
          float acc = xr[r];
#pragma unroll
          for (int jj = 0; jj < r; ++jj) acc -= m[r * kLdC + jj] * xr[jj];
          xr[r] = acc;
        }
#pragma unroll
        for (int r = 1; r < 16; ++r) x[(b * 16 + r) * ld] = xr[r];
      }
      __syncthreads();
    }
    float* out_w = a.ws_w + tile * C * Dk;
    for (int idx = tid; idx < C * Dk / 4; idx += Tr::kThreads) {
      const int i = idx / (Dk / 4), d = (idx % (Dk / 4)) * 4;
      store4(out_w + i * Dk + d, load4(sK + i * kLdK + d));
    }
    for (int idx = tid; idx < C * Dv / 4; idx += Tr::kThreads) {
      const int i = idx / (Dv / 4), j = (idx % (Dv / 4)) * 4;
      store4(out_u + i * Dv + j, load4(sV + i * kLdV + j));
    }
  }
  float* out_a = a.ws_a + tile * C * C;
  const int c4 = C / 4;
  for (int idx = tid; idx < C * c4; idx += Tr::kThreads) {
    const int i = idx / c4, j = (idx % c4) * 4;
    store4(out_a + i * C + j, load4(sA + i * kLdC + j));
  }
}

// chunk_state_scan_kernel: the sequential boundary scan, nothing else.
//   grid (Dv / BV, H, N segments), 256 threads; block (vb, h, n) carries the
//   fp32 state columns [vb*BV, vb*BV + BV) of head h through segment n's
//   chunks. Per chunk: save S (the state entering the chunk) to a.states,
//   V' = U - W S (delta rules; saved to ws_vnew for the output kernel),
//   S <- diag(e^{b_C}) S + K_^T V'. The next chunk's K_, W, U and decay are
//   prefetched with cp.async into the other of two stages while this one runs.
//   Shared memory: ScanTraits::kBytes (182 KB at Dk=128, BV=32, delta; 161 KB at BV=16).
template <Decay kDecay, Rule kRule, typename Elem, int Dk, int Dv, int BV>
__global__ void __launch_bounds__(256)
    chunk_state_scan_kernel(const __grid_constant__ ForwardArgs a) {
  constexpr bool kDelta = kRule == Rule::delta;
  using Tr = ScanTraits<Dk, Dv, BV, kDelta>;
  constexpr bool kSplit = std::is_same_v<Elem, float>;
  constexpr int kLdK = Tr::kLdK, kLdB = Tr::kLdB;
  constexpr int kColTiles = BV / 16;
  extern __shared__ __align__(128) float smem[];
  float* sS = smem;
  float* sStage = sS + Tr::kS;
  float* sVn = sStage + 2 * Tr::kStage;
  auto stage_k = [&](int st) { return sStage + st * Tr::kStage; };
  auto stage_w = [&](int st) { return stage_k(st) + Tr::kTileK; };
  auto stage_u = [&](int st) { return stage_k(st) + (kDelta ? 2 : 1) * Tr::kTileK; };
  auto stage_decay = [&](int st) { return stage_u(st) + Tr::kTileB; };

  const int vb = blockIdx.x;
  const int64_t h = blockIdx.y, n = blockIdx.z, H = a.heads;
  const int tid = threadIdx.x, warp = tid / 32;
  const int C = a.chunk, nb = C / 16;
  const int col0 = vb * BV;

  int64_t first_chunk, num_chunks;
  if (a.segment_table != nullptr) {
    first_chunk = a.segment_table[2 * n];
    num_chunks = a.segment_table[2 * n + 1];
  } else {
    first_chunk = n * a.chunks_per_row;
    num_chunks = a.chunks_per_row;
  }

  auto prefetch = [&](int64_t c, int st) {
    const int64_t tile = c * H + h;
    copy_tile_async<Tr::kThreads>(stage_k(st), kLdK, a.ws_k + tile * C * Dk, Dk, C, Dk);
    if constexpr (kDelta)
      copy_tile_async<Tr::kThreads>(stage_w(st), kLdK, a.ws_w + tile * C * Dk, Dk, C, Dk);
    copy_tile_async<Tr::kThreads>(stage_u(st), kLdB, a.ws_u + tile * C * Dv + col0, Dv, C, BV);
    if constexpr (kDecay != Decay::none)
      copy_tile_async<Tr::kThreads>(stage_decay(st), Dk, a.ws_decay + tile * Dk, Dk, 1, Dk);
    cp_async_commit();
  };

  if (num_chunks > 0) prefetch(first_chunk, 0);
  const int64_t state_base = (n * H + h) * Dk * Dv;
  for (int idx = tid; idx < Dk * BV; idx += Tr::kThreads) {
    const int d = idx / BV, j = idx % BV;
    sS[d * kLdB + j] =
        a.initial_state != nullptr ? a.initial_state[state_base + d * Dv + col0 + j] : 0.f;
  }

  for (int64_t cl = 0; cl < num_chunks; ++cl) {
    const int64_t c = first_chunk + cl;
    const int64_t tile = c * H + h;
    const int st = static_cast<int>(cl & 1);
    // The other stage was last read in the previous iteration, which ended
    // with a barrier, so it can be refilled now.
    if (cl + 1 < num_chunks) {
      prefetch(c + 1, st ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // this chunk's stage (and S) visible to every thread

    float* out_state = a.states + tile * Dk * Dv + col0;
    for (int idx = tid; idx < Dk * BV / 4; idx += Tr::kThreads) {
      const int d = idx / (BV / 4), j = (idx % (BV / 4)) * 4;
      *reinterpret_cast<float4*>(out_state + d * Dv + j) =
          *reinterpret_cast<const float4*>(sS + d * kLdB + j);
    }

    const float* vnew = stage_u(st);  // additive rules: V' = U
    if constexpr (kDelta) {
      // V' = U - W S, one 16x16 tile per warp.
      if (warp < nb * kColTiles) {
        const int I = warp / kColTiles, J = warp % kColTiles;
        AccFragment acc;
        wmma::load_matrix_sync(acc, stage_u(st) + I * 16 * kLdB + J * 16, kLdB,
                               wmma::mem_row_major);
#pragma unroll 4
        for (int kk = 0; kk < Dk; kk += 8)
          mma_tf32<wmma::row_major, wmma::row_major, kSplit, true>(
              acc, stage_w(st) + I * 16 * kLdK + kk, kLdK, sS + kk * kLdB + J * 16, kLdB);
        wmma::store_matrix_sync(sVn + I * 16 * kLdB + J * 16, acc, kLdB, wmma::mem_row_major);
      }
      vnew = sVn;
    }
    __syncthreads();  // V' complete; every read of the old S done
    if constexpr (kDelta) {
      float* out_vn = a.ws_vnew + tile * C * Dv + col0;
      for (int idx = tid; idx < C * BV / 4; idx += Tr::kThreads) {
        const int i = idx / (BV / 4), j = (idx % (BV / 4)) * 4;
        *reinterpret_cast<float4*>(out_vn + i * Dv + j) =
            *reinterpret_cast<const float4*>(sVn + i * kLdB + j);
      }
    }
    if constexpr (kDecay != Decay::none) {
      const float* decay = stage_decay(st);
      for (int idx = tid; idx < Dk * BV; idx += Tr::kThreads) {
        const int d = idx / BV, j = idx % BV;
        sS[d * kLdB + j] *= decay[d];
      }
      __syncthreads();
    }

    // S <- S + K_^T V'.
    for (int t = warp; t < (Dk / 16) * kColTiles; t += Tr::kWarps) {
      const int I = t / kColTiles, J = t % kColTiles;
      AccFragment acc;
      wmma::load_matrix_sync(acc, sS + I * 16 * kLdB + J * 16, kLdB, wmma::mem_row_major);
      for (int kt = 0; kt < C; kt += 8)
        mma_tf32<wmma::col_major, wmma::row_major, kSplit>(acc, stage_k(st) + kt * kLdK + I * 16,
                                                           kLdK, vnew + kt * kLdB + J * 16, kLdB);
      wmma::store_matrix_sync(sS + I * 16 * kLdB + J * 16, acc, kLdB, wmma::mem_row_major);
    }
    __syncthreads();  // S updated; this stage free for the prefetch after next
  }
  if (a.final_state != nullptr) {
    for (int idx = tid; idx < Dk * BV; idx += Tr::kThreads) {
      const int d = idx / BV, j = idx % BV;
      a.final_state[state_base + d * Dv + col0 + j] = sS[d * kLdB + j];
    }
  }
}

// chunk_output_kernel: o of one chunk from the state entering it.
//   grid (num_chunks, H, 2), 256 threads; block (c, h, z): O = Q^ S_c + A V'
//   for the chunk's rows and Dv columns [z*Dv/2, z*Dv/2 + Dv/2), written in
//   the input dtype. Shared memory: OutputTraits::kBytes (103 KB at D=128, so
//   two blocks share a multiprocessor).
template <Rule kRule, typename Elem, int Dk, int Dv>
__global__ void __launch_bounds__(256) chunk_output_kernel(const __grid_constant__ ForwardArgs a) {
  using Tr = OutputTraits<Dk, Dv>;
  constexpr bool kSplit = std::is_same_v<Elem, float>;
  constexpr int kLdK = Tr::kLdK, kLdV = Tr::kLdV, kLdC = Tr::kLdC;
  extern __shared__ __align__(128) float smem[];
  float* sQ = smem;
  float* sA = sQ + Tr::kQ;
  float* sS = sA + Tr::kA;
  float* sV = sS + Tr::kS;

  const int64_t c = blockIdx.x, h = blockIdx.y, H = a.heads;
  const int tid = threadIdx.x, warp = tid / 32;
  const int C = a.chunk, nb = C / 16;
  constexpr int kCols = Tr::kCols;
  const int col0 = blockIdx.z * kCols;
  int64_t token0;
  int length;
  chunk_geometry(a, c, token0, length);
  const int64_t tile = c * H + h;
  const float* vnew = kRule == Rule::delta ? a.ws_vnew : a.ws_u;
  copy_tile_async<Tr::kThreads>(sQ, kLdK, a.ws_q + tile * C * Dk, Dk, C, Dk);
  copy_tile_async<Tr::kThreads>(sA, kLdC, a.ws_a + tile * C * C, C, C, C);
  copy_tile_async<Tr::kThreads>(sS, kLdV, a.states + tile * Dk * Dv + col0, Dv, Dk, kCols);
  copy_tile_async<Tr::kThreads>(sV, kLdV, vnew + tile * C * Dv + col0, Dv, C, kCols);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  constexpr int kColTiles = kCols / 16;
  AccFragment acc[kColTiles / 2];
  // Warp w: row tile w / 2, column tiles (w % 2) * kColTiles/2 ... (8 warps, C <= 64).
  const int I = warp / 2, J0 = (warp % 2) * (kColTiles / 2);
  const bool active = I < nb;
  if (active) {
#pragma unroll
    for (int j = 0; j < kColTiles / 2; ++j) {
      wmma::fill_fragment(acc[j], 0.f);
      for (int kk = 0; kk < Dk; kk += 8)
        mma_tf32<wmma::row_major, wmma::row_major, kSplit>(acc[j], sQ + I * 16 * kLdK + kk, kLdK,
                                                           sS + kk * kLdV + (J0 + j) * 16, kLdV);
      for (int kt = 0; kt < (I + 1) * 16; kt += 8)  // A is zero right of the diagonal block
        mma_tf32<wmma::row_major, wmma::row_major, kSplit>(acc[j], sA + I * 16 * kLdC + kt, kLdC,
                                                           sV + kt * kLdV + (J0 + j) * 16, kLdV);
    }
  }
  __syncthreads();  // every warp done reading V' before O overwrites it
  if (active) {
#pragma unroll
    for (int j = 0; j < kColTiles / 2; ++j)
      wmma::store_matrix_sync(sV + I * 16 * kLdV + (J0 + j) * 16, acc[j], kLdV,
                              wmma::mem_row_major);
  }
  __syncthreads();
  Elem* o = static_cast<Elem*>(a.o);
  for (int idx = tid; idx < length * kCols; idx += Tr::kThreads) {
    const int i = idx / kCols, j = idx % kCols;
    o[((token0 + i) * H + h) * Dv + col0 + j] = from_float<Elem>(sV[i * kLdV + j]);
  }
}

// Host launch of the three kernels for one (variant, dtype, head dims, l2norm).
// The scan's Dv block shrinks to 16 columns when 32-column blocks would leave
// most multiprocessors idle (few heads and sequences).
template <Decay kDecay, Rule kRule, typename Elem, int Dk, int Dv, bool kL2Norm>
void launch_chunk_kernels(const ForwardArgs& a, cudaStream_t stream) {
  using PrepTr = ChunkTraits<kDecay, kRule, Dk, Dv>;
  using OutTr = OutputTraits<Dk, Dv>;
  auto prepare = chunk_prepare_kernel<kDecay, kRule, Elem, Dk, Dv, kL2Norm>;
  auto output = chunk_output_kernel<kRule, Elem, Dk, Dv>;
  SS_CUDA_CHECK(cudaFuncSetAttribute(prepare, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(PrepTr::kPrepBytes)));
  SS_CUDA_CHECK(cudaFuncSetAttribute(output, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(OutTr::kBytes)));
  prepare<<<dim3(static_cast<unsigned>(a.num_chunks), static_cast<unsigned>(a.heads)),
            PrepTr::kThreads, PrepTr::kPrepBytes, stream>>>(a);
  SS_LAUNCH_CHECK("chunk_prepare_kernel");

  auto launch_scan = [&](auto bv_tag) {
    constexpr int kBV = decltype(bv_tag)::value;
    using ScanTr = ScanTraits<Dk, Dv, kBV, kRule == Rule::delta>;
    auto scan = chunk_state_scan_kernel<kDecay, kRule, Elem, Dk, Dv, kBV>;
    SS_CUDA_CHECK(cudaFuncSetAttribute(scan, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(ScanTr::kBytes)));
    scan<<<dim3(Dv / kBV, static_cast<unsigned>(a.heads), static_cast<unsigned>(a.num_segments)),
           ScanTr::kThreads, ScanTr::kBytes, stream>>>(a);
    SS_LAUNCH_CHECK("chunk_state_scan_kernel");
  };
  const int scan_bv = a.scan_block_cols != 0                             ? a.scan_block_cols
                      : a.heads * a.num_segments * (Dv / 32) < a.num_sms ? 16
                                                                         : 32;
  if (scan_bv == 16)
    launch_scan(std::integral_constant<int, 16>{});
  else
    launch_scan(std::integral_constant<int, 32>{});

  output<<<dim3(static_cast<unsigned>(a.num_chunks), static_cast<unsigned>(a.heads), 2),
           OutTr::kThreads, OutTr::kBytes, stream>>>(a);
  SS_LAUNCH_CHECK("chunk_output_kernel");
}

// Dispatch of one variant over dtype x head dim x l2norm; defined once per
// variant in chunk_forward_<variant>.cu so the instantiations compile in parallel.
template <Decay kDecay, Rule kRule>
void launch_chunk_forward(const ForwardArgs& a, DType dtype, int64_t head_dim, bool l2norm,
                          cudaStream_t stream);

#define SS_DISPATCH_BOOL(flag, kName, ...) \
  do {                                     \
    if (flag) {                            \
      constexpr bool kName = true;         \
      __VA_ARGS__();                       \
    } else {                               \
      constexpr bool kName = false;        \
      __VA_ARGS__();                       \
    }                                      \
  } while (0)

template <Decay kDecay, Rule kRule>
void launch_chunk_forward_impl(const ForwardArgs& a, DType dtype, int64_t head_dim, bool l2norm,
                               cudaStream_t stream) {
  auto with_dim = [&](auto elem_tag) {
    using Elem = decltype(elem_tag);
    SS_DISPATCH_BOOL(l2norm, kL2Norm, [&] {
      if (head_dim == 64) {
        launch_chunk_kernels<kDecay, kRule, Elem, 64, 64, kL2Norm>(a, stream);
      } else if (head_dim == 128) {
        launch_chunk_kernels<kDecay, kRule, Elem, 128, 128, kL2Norm>(a, stream);
      } else {
        SS_FAIL("dk", "CUDA forward supports Dk == Dv in {64, 128}, got ", head_dim);
      }
    });
  };
  switch (dtype) {
    case DType::f32:
      with_dim(float{});
      break;
    case DType::bf16:
      with_dim(__nv_bfloat16{});
      break;
    case DType::f16:
      with_dim(__half{});
      break;
  }
}

#define SS_INSTANTIATE_CHUNK_FORWARD(kDecay, kRule)                                             \
  template <>                                                                                   \
  void launch_chunk_forward<kDecay, kRule>(const ForwardArgs& a, DType dtype, int64_t head_dim, \
                                           bool l2norm, cudaStream_t stream) {                  \
    launch_chunk_forward_impl<kDecay, kRule>(a, dtype, head_dim, l2norm, stream);               \
  }

}  // namespace statescan::cuda::detail
