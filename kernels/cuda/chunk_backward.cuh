// Chunkwise backward family for the six variants (issue 4), templated on
// <Decay, Rule, element type, Dk, Dv>. Notation of chunk_forward.cuh: per
// chunk, b_t = inclusive cumsum of log gates, gamma = e^{b_{C-1}},
//   Q^ = scale q e^{b}, K^ = k e^{b}, K~ = k e^{-b}, K_ = k e^{b_{C-1} - b},
//   A = lower_incl(Q^ K~^T), KK = strict_lower(K^ K~^T), Mm = diag(beta) KK,
//   T = (I + Mm)^{-1}, W = T diag(beta) K^, U = T diag(beta) V (additive: U = V),
//   V' = U - W S_c, O = Q^ S_c + A V', S_{c+1} = diag(gamma) S_c + K_^T V'.
//
// Three stages on the caller's stream:
//   0. the forward's chunk_prepare_kernel (re-run) writes Q^, K_, W, A and
//      gamma into the forward workspace (element type T);
//   1. chunk_grad_scan_kernel_tc  (one block per (segment, head, Dv block))
//      the sequential reverse scan over chunks, fp32:
//        dV' = A^T dO + K_ dS_{c+1},  dS_c = diag(gamma) dS_{c+1} + Q^^T dO - W^T dV'
//      saving dS_{c+1} per chunk (fp32) and writing dS_0 = d_initial_state
//      (16-bit inputs: chunk_grad_scan16_kernel, chunk_grad_scan16.cuh, dS in
//      registers; STATESCAN_SCAN=wmma keeps this kernel for A/B);
//   2. chunk_grad_kernel_tc  (persistent; one (chunk, head) item at a time per block)
//      recomputes every intra-chunk quantity in fp32 from the raw inputs,
//      S_c (chunk_states) and dS_{c+1}, and writes dq, dk, dv, dg, dbeta.
//      For 16-bit inputs, a batch of items at a time, each
//      batch preceded by chunk_state_products_kernel, which computes the
//      products with S_c and dS_{c+1} (V', dV', dW and the state parts of gq,
//      gk) from the prepared 16-bit tiles with operands in shared memory.
// Linear attention on its raw path (ForwardArgs::raw_additive: 16-bit, no L2
// norm) skips stage 0 and runs the scan with q read from the inputs, then
// chunk_grad_raw16_kernel (chunk_grad_raw16.cuh) for every gradient.
// Every exponential is an exponent difference that is <= 0 (gradients are
// taken "in k-space": w.r.t. the normalised q, k, never through e^{-b}), so
// strong gates do not overflow. No atomics: every output element is written by
// exactly one thread, in a fixed order, so results are bitwise reproducible.
// The derivation is checked in fp64 by tests/chunk_bwd_model.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/options.h"
#include "kernels/cuda/chunk_forward.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/warp_mma.cuh"

namespace statescan::cuda::detail {

// Arguments of both backward kernels, by value (__grid_constant__).
struct BackwardArgs {
  ForwardArgs f;  // geometry, raw inputs and the prepare stage's tiles

  const void* d_o = nullptr;             // [B,T,H,Dv] (T)
  const float* d_final_state = nullptr;  // [N,H,Dk,Dv] or null (zero)
  const float* chunk_states = nullptr;   // S_c [chunks,H,Dk,Dv] fp32
  void* dq = nullptr;                    // [B,T,H,Dk] (T)
  void* dk = nullptr;                    // [B,T,H,Dk] (T)
  void* dv = nullptr;                    // [B,T,H,Dv] (T)
  float* dg = nullptr;                   // like g
  void* dbeta = nullptr;                 // [B,T,H] (T)
  float* d_initial_state = nullptr;      // [N,H,Dk,Dv] or null
  float* ws_ds = nullptr;                // dS_{c+1} per chunk [chunks,H,Dk,Dv] fp32, or null
  // dS_{c+1} per chunk rounded to T, in ws_ds's room (ws_ds is then null): the
  // raw linear path (f.raw_additive; chunk_grad_raw16_kernel reads it) and the
  // other ungated 16-bit variants (their products with dS round it to T,
  // and only gated variants take dgamma from fp32 dS).
  void* ws_ds_t = nullptr;
  float* ws_scratch = nullptr;  // per-block fp32 scratch of chunk_grad_kernel_tc
  // chunk_state_products_kernel's outputs for items [item_begin, num_items)
  // (StateProductTraits::kOutFloats per item): 16-bit vector gates only;
  // null where the gradient kernel computes them itself (fp32 inputs, and
  // chunk_intra_grad_kernel's scalar gates or none).
  float* ws_sp = nullptr;
  int64_t sp_batch = 0;    // items ws_sp holds: the gradient kernel runs in batches of this many
  int64_t item_begin = 0;  // the gradient kernels take items [item_begin, num_items)
  int64_t num_items = 0;   // chunks * H, or the end of this batch
};

template <int Dk, int Dv>
struct GradTraits {
  static constexpr int kMaxChunk = 64;
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  // Per-block global scratch (fp32): [C, Dk] arrays q, k, b, W, gq, gk, db,
  // dW, T^T dW, K^, K_ and [C, Dv] arrays v, dO, V', dV', T^T dV'.
  static constexpr int kScratchK = 11;
  static constexpr int kScratchV = 5;
  static constexpr int64_t kScratchFloats =
      static_cast<int64_t>(kMaxChunk) * (kScratchK * Dk + kScratchV * Dv);
  // Shared memory (fp32): the normalised q, k and the gate cumsums b ([C, Dk]
  // each: the pairwise-decay loops read them O(C) times per element), six
  // [C, C] arrays A, KK, T, dA, dT, tmp and the per-row / per-dim vectors.
  static constexpr int kCC = kMaxChunk * kMaxChunk;
  static constexpr int kSmallRows = 6;  // beta, rq, rk, cumsum of a scalar gate, dbeta, row sums
  static constexpr int kSmallDims = 2;  // dgamma, column sums
  static constexpr size_t kSmemBytes =
      sizeof(float) * (3 * kMaxChunk * Dk + 6 * kCC + kSmallRows * kMaxChunk + kSmallDims * Dk);
  static_assert(kSmemBytes <= 227 * 1024, "chunk_grad_kernel_tc exceeds Hopper shared memory");
};

// Shared-memory plan of chunk_grad_scan_kernel_tc (bytes, each piece
// 128-byte aligned). Tiles in T are padded by 16 bytes per row (as the
// forward's), fp32 tiles by 4 floats.
template <typename T, int Dk, int Dv, int BV>
struct GradScanTraits {
  static constexpr bool kF32 = std::is_same_v<T, float>;
  static constexpr int kMaxChunk = 64;
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kPadT = 16 / static_cast<int>(sizeof(T));
  static constexpr int kLdK = Dk + kPadT;         // Q^, K_, W tiles (T)
  static constexpr int kLdC = kMaxChunk + kPadT;  // A (T)
  static constexpr int kLdB = BV + kPadT;         // dO, -dV' and the dS copy (T)
  static constexpr int kLdF = BV + 4;             // dS and dV' (fp32)
  static_assert(!kF32 || kLdB == kLdF, "fp32 products read dS in place");
  static_assert(Dv % BV == 0 && BV % 16 == 0, "Dv block must be whole 16-column tiles");
  // Buffers of the per-chunk tiles: 16-bit T loads chunk c - 1's while chunk c
  // computes (cp.async); fp32 tiles are twice the size and take one.
  static constexpr int kStages = kF32 ? 1 : 2;
  static constexpr size_t kABytes = align_smem(sizeof(T) * kMaxChunk * kLdC);
  static constexpr size_t kKBytes = align_smem(sizeof(T) * kMaxChunk * kLdK);
  static constexpr size_t kDOBytes = align_smem(sizeof(T) * kMaxChunk * kLdB);
  static constexpr size_t kDSBytes = align_smem(sizeof(float) * Dk * kLdF);
  static constexpr size_t kDSCopyBytes = kF32 ? 0 : align_smem(sizeof(T) * Dk * kLdB);
  static constexpr size_t kDVBytes = align_smem(sizeof(float) * kMaxChunk * kLdF);
  static constexpr size_t kDVNegBytes = align_smem(sizeof(T) * kMaxChunk * kLdB);
  static constexpr size_t kGammaBytes = align_smem(sizeof(float) * Dk);
  static constexpr size_t kStageBytes = kABytes + 3 * kKBytes + kDOBytes + kGammaBytes;
  static constexpr size_t kBytes =
      kStages * kStageBytes + kDSBytes + kDSCopyBytes + kDVBytes + kDVNegBytes;
  static_assert(kBytes <= 227 * 1024, "chunk_grad_scan_kernel_tc exceeds Hopper shared memory");
};

// chunk_grad_scan_kernel_tc: the reverse scan over a segment's chunks, its
// products on the tensor cores (16-bit T: native 16x16x16 steps on a T-rounded
// copy of dS, as the forward scan rounds S; fp32: split-tf32 steps on dS
// itself; dS itself stays fp32).
//   grid (Dv / BV, H, N), 256 threads; block (vb, h, n) carries dS columns
//   [vb*BV, vb*BV + BV) of head h from d_final_state (or 0) back through
//   segment n's chunks, saving dS (= dS_{c+1}) per chunk to ws_ds when given;
//   at the segment's start dS is the gradient of its initial state
//   (d_initial_state). Per chunk: A, K_, Q^, W, gamma and the
// dO columns in shared memory (16-bit T: copied asynchronously one chunk
// ahead, so the copy's latency hides behind the previous chunk's products);
// dV' = A^T dO + K_ dS (one 16x16 tile per warp);
// dS <- diag(gamma) dS + Q^^T dO + W^T (-dV').
//   Shared memory: GradScanTraits::kBytes (bf16, D=128, BV=16: ~155 KB).
template <Decay kDecay, Rule kRule, typename T, int Dk, int Dv, int BV>
__global__ void __launch_bounds__(256)
    chunk_grad_scan_kernel_tc(const __grid_constant__ BackwardArgs a) {
  constexpr bool kDelta = kRule == Rule::delta;
  using Tr = GradScanTraits<T, Dk, Dv, BV>;
  using Acc = typename MmaStep<T>::Acc;
  constexpr int kK = MmaStep<T>::kK;
  constexpr int kLdK = Tr::kLdK, kLdC = Tr::kLdC, kLdB = Tr::kLdB, kLdF = Tr::kLdF;
  constexpr int kColTiles = BV / 16, kThreads = Tr::kThreads, kWarps = Tr::kWarps;
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  unsigned char* at = smem_bytes;
  auto take = [&](size_t bytes) {
    unsigned char* here = at;
    at += bytes;
    return here;
  };
  constexpr int kStages = Tr::kStages;
  // Tile buffer st: A, K_, Q^, W, dO columns, gamma at fixed offsets from
  // stage0 + st * kStageBytes (arithmetic, not an array of pointers, which
  // would live in local memory).
  unsigned char* const stage0 = take(kStages * Tr::kStageBytes);
  auto stage_tile = [&](int st, size_t offset) { return stage0 + st * Tr::kStageBytes + offset; };
  constexpr size_t kOffK = Tr::kABytes, kOffQ = kOffK + Tr::kKBytes, kOffW = kOffQ + Tr::kKBytes,
                   kOffO = kOffW + Tr::kKBytes, kOffG = kOffO + Tr::kDOBytes;
  auto stA = [&](int st) { return reinterpret_cast<T*>(stage_tile(st, 0)); };
  auto stKbar = [&](int st) { return reinterpret_cast<T*>(stage_tile(st, kOffK)); };
  auto stQh = [&](int st) { return reinterpret_cast<T*>(stage_tile(st, kOffQ)); };
  auto stW = [&](int st) { return reinterpret_cast<T*>(stage_tile(st, kOffW)); };
  auto stdO = [&](int st) { return reinterpret_cast<T*>(stage_tile(st, kOffO)); };
  auto stGamma = [&](int st) { return reinterpret_cast<float*>(stage_tile(st, kOffG)); };
  float* sdS = reinterpret_cast<float*>(take(Tr::kDSBytes));
  T* sdSop = Tr::kF32 ? reinterpret_cast<T*>(sdS) : reinterpret_cast<T*>(take(Tr::kDSCopyBytes));
  float* sdV = reinterpret_cast<float*>(take(Tr::kDVBytes));
  T* sdVneg = reinterpret_cast<T*>(take(Tr::kDVNegBytes));

  const ForwardArgs& f = a.f;
  const int col0 = blockIdx.x * BV;
  const int64_t h = blockIdx.y, n = blockIdx.z, H = f.heads;
  const int tid = threadIdx.x, warp = tid / 32;
  const int C = f.chunk, nb = C / 16;
  const T* d_o = static_cast<const T*>(a.d_o);

  int64_t first_chunk, num_chunks;
  segment_chunks(f, n, first_chunk, num_chunks);
  const int64_t state_base = (n * H + h) * Dk * Dv;
  for (int idx = tid; idx < Dk * BV; idx += kThreads) {
    const int d = idx / BV, j = idx % BV;
    const float x =
        a.d_final_state != nullptr ? a.d_final_state[state_base + d * Dv + col0 + j] : 0.f;
    sdS[d * kLdF + j] = x;
    if constexpr (!Tr::kF32) sdSop[d * kLdB + j] = from_float<T>(x);
  }
  // Queues the copies of chunk cl's tiles into buffer st (one cp.async group
  // with the caller's commit); dO rows past the chunk's end are zeros.
  auto issue_tiles = [&](int st, int64_t cl) {
    const int64_t c = first_chunk + cl, tile = c * H + h;
    int64_t token0;
    int length;
    chunk_geometry(f, c, token0, length);
    copy_tile_async<kThreads>(stA(st), kLdC, static_cast<const T*>(f.ws_a) + tile * C * C, C, C, C);
    copy_tile_async<kThreads>(stKbar(st), kLdK, static_cast<const T*>(f.ws_k) + tile * C * Dk, Dk,
                              C, Dk);
    copy_tile_async<kThreads>(stQh(st), kLdK, static_cast<const T*>(f.ws_q) + tile * C * Dk, Dk, C,
                              Dk);
    if constexpr (kDelta)
      copy_tile_async<kThreads>(stW(st), kLdK, static_cast<const T*>(f.ws_w) + tile * C * Dk, Dk, C,
                                Dk);
    constexpr int kVec = 16 / static_cast<int>(sizeof(T)), kRowVecs = BV / kVec;
    for (int idx = tid; idx < C * kRowVecs; idx += kThreads) {
      const int t = idx / kRowVecs, j = (idx % kRowVecs) * kVec;
      T* dst = stdO(st) + t * kLdB + j;
      if (t < length)
        cp_async16(dst, d_o + ((token0 + t) * H + h) * Dv + col0 + j);
      else
        *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
    copy_tile_async<kThreads>(stGamma(st), Dk, f.ws_decay + tile * Dk, Dk, 1, Dk);
  };
  if constexpr (kStages == 2) {
    if (num_chunks > 0) issue_tiles(0, num_chunks - 1);
    cp_async_commit();
  }
  for (int64_t cl = num_chunks - 1; cl >= 0; --cl) {
    const int64_t c = first_chunk + cl, tile = c * H + h;
    const int st = kStages == 2 ? static_cast<int>((num_chunks - 1 - cl) & 1) : 0;
    __syncthreads();  // dS of the previous iteration complete; its tile buffer free
    if constexpr (kStages == 2) {
      if (cl > 0) issue_tiles(st ^ 1, cl - 1);
      cp_async_commit();
      cp_async_wait<1>();  // this chunk's group landed; the next one may still fly
    } else {
      issue_tiles(0, cl);
      cp_async_commit();
      cp_async_wait<0>();
    }
    if (a.ws_ds != nullptr) {
      float* out = a.ws_ds + tile * Dk * Dv + col0;
      for (int idx = tid; idx < Dk * BV; idx += kThreads) {
        const int d = idx / BV, j = idx % BV;
        out[d * Dv + j] = sdS[d * kLdF + j];
      }
    }
    if (a.ws_ds_t != nullptr) {
      T* out = static_cast<T*>(a.ws_ds_t) + tile * Dk * Dv + col0;
      for (int idx = tid; idx < Dk * BV; idx += kThreads) {
        const int d = idx / BV, j = idx % BV;
        out[d * Dv + j] = from_float<T>(sdS[d * kLdF + j]);
      }
    }
    __syncthreads();
    const T* sA = stA(st);
    const T* sKbar = stKbar(st);
    const T* sQh = stQh(st);
    const T* sW = stW(st);
    const T* sdO = stdO(st);
    const float* sGamma = stGamma(st);

    // dV' = A^T dO + K_ dS, one 16x16 tile per warp.
    for (int w = warp; w < nb * kColTiles; w += kWarps) {
      const int I = w / kColTiles, J = w % kColTiles;
      Acc acc;
      wmma::fill_fragment(acc, 0.f);
      for (int kt = I * 16; kt < C; kt += kK)  // A^T is zero above the diagonal block
        mma_step<wmma::col_major, wmma::row_major>(acc, sA + kt * kLdC + I * 16, kLdC,
                                                   sdO + kt * kLdB + J * 16, kLdB);
      for (int kk = 0; kk < Dk; kk += kK)
        mma_step<wmma::row_major, wmma::row_major>(acc, sKbar + I * 16 * kLdK + kk, kLdK,
                                                   sdSop + kk * kLdB + J * 16, kLdB);
      wmma::store_matrix_sync(sdV + I * 16 * kLdF + J * 16, acc, kLdF, wmma::mem_row_major);
    }
    __syncthreads();  // dV' complete; every read of dS done
    for (int idx = tid; idx < C * BV; idx += kThreads) {
      const int t = idx / BV, j = idx % BV;
      sdVneg[t * kLdB + j] = from_float<T>(-sdV[t * kLdF + j]);
    }
    if constexpr (kDecay != Decay::none) {
      for (int idx = tid; idx < Dk * BV; idx += kThreads) {
        const int d = idx / BV, j = idx % BV;
        sdS[d * kLdF + j] *= sGamma[d];
      }
    }
    __syncthreads();
    // dS += Q^^T dO + W^T (-dV'); 16-bit T: each warp refreshes its tile's copy.
    for (int w = warp; w < (Dk / 16) * kColTiles; w += kWarps) {
      const int I = w / kColTiles, J = w % kColTiles;
      Acc acc;
      wmma::load_matrix_sync(acc, sdS + I * 16 * kLdF + J * 16, kLdF, wmma::mem_row_major);
      for (int kt = 0; kt < C; kt += kK) {
        mma_step<wmma::col_major, wmma::row_major>(acc, sQh + kt * kLdK + I * 16, kLdK,
                                                   sdO + kt * kLdB + J * 16, kLdB);
        if constexpr (kDelta)
          mma_step<wmma::col_major, wmma::row_major>(acc, sW + kt * kLdK + I * 16, kLdK,
                                                     sdVneg + kt * kLdB + J * 16, kLdB);
      }
      wmma::store_matrix_sync(sdS + I * 16 * kLdF + J * 16, acc, kLdF, wmma::mem_row_major);
      if constexpr (!Tr::kF32) {
        __syncwarp();
        for (int e = threadIdx.x % 32; e < 16 * 16; e += 32) {
          const int r = I * 16 + e / 16, col = J * 16 + e % 16;
          sdSop[r * kLdB + col] = from_float<T>(sdS[r * kLdF + col]);
        }
      }
    }
  }
  __syncthreads();
  if (a.d_initial_state != nullptr) {
    for (int idx = tid; idx < Dk * BV; idx += kThreads) {
      const int d = idx / BV, j = idx % BV;
      a.d_initial_state[state_base + d * Dv + col0 + j] = sdS[d * kLdF + j];
    }
  }
}

// out (M x N, row-major, ld ldo) = [out +] (kNeg ? -1 : 1) * X Y on the tensor
// cores in split tf32 (as mma_tf32: about fp32 accuracy, three mma per step;
// only chunk_grad_kernel_tc, fp32 inputs, calls it). Each warp owns a 2x2
// group of 16x16 output tiles (1 wide where M/16 or N/16 is odd), so every
// fragment it loads from X and Y feeds two tiles: the operands come from
// global scratch or shared memory, and loads, not the mma, bound this.
// X is M x K: row_major reads x[i * ldx + k], col_major reads x[k * ldx + i]
// (X^T of a row-major [K, M] array). Y is K x N: row_major reads y[k * ldy + j],
// col_major reads y[j * ldy + k] (Y^T of a row-major [N, K] array). M, N are
// multiples of 16, K of 8; every pointer is 32-byte aligned, ld's multiples
// of 4; out must not overlap X or Y. No barrier inside: the caller syncs.
template <typename LayoutX, typename LayoutY, bool kNeg = false>
__device__ __forceinline__ void block_mm(float* out, int ldo, const float* x, int ldx,
                                         const float* y, int ldy, int M, int N, int K,
                                         bool accumulate) {
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, LayoutX>;
  using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, LayoutY>;
  constexpr bool kRowX = std::is_same_v<LayoutX, wmma::row_major>;
  constexpr bool kRowY = std::is_same_v<LayoutY, wmma::row_major>;
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int row_tiles = M / 16, col_tiles = N / 16;
  const int ri = row_tiles % 2 == 0 ? 2 : 1, rj = col_tiles % 2 == 0 ? 2 : 1;
  const int group_cols = col_tiles / rj, groups = (row_tiles / ri) * group_cols;
  for (int g = warp; g < groups; g += warps) {
    const int I0 = (g / group_cols) * ri, J0 = (g % group_cols) * rj;
    AccFragment acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (i < ri && j < rj) {
          const float* o = out + (I0 + i) * 16 * ldo + (J0 + j) * 16;
          if (accumulate)
            wmma::load_matrix_sync(acc[i][j], o, ldo, wmma::mem_row_major);
          else
            wmma::fill_fragment(acc[i][j], 0.f);
        }
        // (Tried: unroll 4 without the split, and 1x2 groups where 2x2 idles
        // warps: both slower on an H200, deltanet 32K gradient kernel 19.8 ->
        // 21.4 ms, at 255 registers.)
#pragma unroll 2
    for (int kk = 0; kk < K; kk += 8) {
      FragA a_hi[2], a_lo[2];
      FragB b_hi[2], b_lo[2];
#pragma unroll
      for (int i = 0; i < 2; ++i)
        if (i < ri) {
          const int r0 = (I0 + i) * 16;
          wmma::load_matrix_sync(a_hi[i], kRowX ? x + r0 * ldx + kk : x + kk * ldx + r0, ldx);
#pragma unroll
          for (int e = 0; e < a_hi[i].num_elements; ++e) {
            const float v = kNeg ? -a_hi[i].x[e] : a_hi[i].x[e];
            const float hi = wmma::__float_to_tf32(v);
            a_hi[i].x[e] = hi;
            a_lo[i].x[e] = wmma::__float_to_tf32(v - hi);
          }
        }
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (j < rj) {
          const int c0 = (J0 + j) * 16;
          wmma::load_matrix_sync(b_hi[j], kRowY ? y + kk * ldy + c0 : y + c0 * ldy + kk, ldy);
#pragma unroll
          for (int e = 0; e < b_hi[j].num_elements; ++e) {
            const float v = b_hi[j].x[e];
            const float hi = wmma::__float_to_tf32(v);
            b_hi[j].x[e] = hi;
            b_lo[j].x[e] = wmma::__float_to_tf32(v - hi);
          }
        }
        // Same order per tile as mma_tf32: lo*hi, hi*lo, hi*hi.
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          if (i < ri && j < rj) {
            wmma::mma_sync(acc[i][j], a_lo[i], b_hi[j], acc[i][j]);
            wmma::mma_sync(acc[i][j], a_hi[i], b_lo[j], acc[i][j]);
            wmma::mma_sync(acc[i][j], a_hi[i], b_hi[j], acc[i][j]);
          }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (i < ri && j < rj)
          wmma::store_matrix_sync(out + (I0 + i) * 16 * ldo + (J0 + j) * 16, acc[i][j], ldo,
                                  wmma::mem_row_major);
  }
}

// Four consecutive elements as floats, for the elementwise passes of
// chunk_grad_kernel_tc: one 16-byte (8-byte for 16-bit T) access where there
// were four. Those passes read and write the block's global scratch, and a
// store that may alias the next element's load serialises the loop on L2
// round trips (ncu: long-scoreboard stalls were the largest share), so a
// quarter of the iterations is a quarter of the waits.
struct Quad {
  float v[4];
};
template <typename P>
__device__ __forceinline__ Quad ldq(const P* p) {
  const float4 x = load4(p);
  return {{x.x, x.y, x.z, x.w}};
}
template <typename P>
__device__ __forceinline__ void stq(P* p, const Quad& x) {
  store4(p, make_float4(x.v[0], x.v[1], x.v[2], x.v[3]));
}

// Pairwise products with a per-dimension decay, in 16-row blocks (for
// chunk_grad_kernel_tc). Gamma_tsd = e^{b_td - b_sd} (s <= t) does not factor
// out of a sum over d, but between blocks it splits at the source block's last
// row rho: Gamma_tsd = e^{b_td - b_rho,d} e^{b_rho,d - b_sd}, both exponents
// <= 0 (b is a running sum of log gates, non-increasing in t), so no factor
// overflows however strong the gates. The off-diagonal blocks are then plain
// products on the tensor cores with O(C D) exponentials; only the 16 x 16
// diagonal blocks pay one per term on the CUDA cores (a quarter of the terms
// at C = 64). C is a multiple of 16; q, k, x*, b are [C, Dk] fp32 and M is C x C
// (row-major, ld C); `tmp` holds 3 * 64 * Dk floats. No barrier at the end:
// the caller syncs before reading the outputs.

// gram: a[t,s] = sum_d x_td y_sd Gamma_tsd for s <= t, 0 above; with kTwo also
// a2[t,s] = sum_d x2_td y_sd Gamma_tsd for s < t, 0 on and above the diagonal.
template <int Dk, bool kTwo>
__device__ __forceinline__ void vector_decay_gram(float* a, float* a2, const float* x,
                                                  const float* x2, const float* y, const float* b,
                                                  int C, float* tmp) {
  using RowM = wmma::row_major;
  using ColM = wmma::col_major;
  constexpr int kPerLane = Dk / 32;
  const int tid = threadIdx.x, threads = blockDim.x, warp = tid / 32, lane = tid % 32;
  const int warps = threads / 32;
  // Diagonal blocks: one warp per row t, lanes over d, s in t's block.
  for (int t = warp; t < C; t += warps) {
    float xt[kPerLane], x2t[kPerLane], bt[kPerLane];
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int d = lane + 32 * e;
      xt[e] = x[t * Dk + d];
      if constexpr (kTwo) x2t[e] = x2[t * Dk + d];
      bt[e] = b[t * Dk + d];
    }
    for (int s = t & ~15; s <= t; ++s) {
      float acc = 0.f, acc2 = 0.f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int d = lane + 32 * e;
        const float ys = y[s * Dk + d] * __expf(bt[e] - b[s * Dk + d]);
        acc += xt[e] * ys;
        if constexpr (kTwo) acc2 += x2t[e] * ys;
      }
      acc = warp_sum(acc);
      if constexpr (kTwo) acc2 = warp_sum(acc2);
      if (lane == 0) {
        a[t * C + s] = acc;
        if constexpr (kTwo) a2[t * C + s] = s < t ? acc2 : 0.f;
      }
    }
    for (int s = t + 1 + lane; s < C; s += 32) {
      a[t * C + s] = 0.f;
      if constexpr (kTwo) a2[t * C + s] = 0.f;
    }
  }
  // Off-diagonal blocks, one source block J at a time: rows r0.. of x (and
  // x2) scaled by e^{b - b_rho}, block J of y by e^{b_rho - b}, then one
  // product each into the (rows > rho, block J) part of a (and a2).
  constexpr int kRows = 64 - 16;  // rows below the first block at the largest chunk (64)
  float* xr = tmp;
  float* x2r = xr + kRows * Dk;
  float* yj = x2r + kRows * Dk;
  for (int J = 0; J + 1 < C / 16; ++J) {
    const int r0 = 16 * J + 16, rows = C - r0, rho = 16 * J + 15;
    for (int idx = tid; idx < rows * Dk; idx += threads) {
      const int t = r0 + idx / Dk, d = idx % Dk;
      const float e = __expf(b[t * Dk + d] - b[rho * Dk + d]);
      xr[idx] = x[t * Dk + d] * e;
      if constexpr (kTwo) x2r[idx] = x2[t * Dk + d] * e;
    }
    for (int idx = tid; idx < 16 * Dk; idx += threads) {
      const int s = 16 * J + idx / Dk, d = idx % Dk;
      yj[idx] = y[s * Dk + d] * __expf(b[rho * Dk + d] - b[s * Dk + d]);
    }
    __syncthreads();
    block_mm<RowM, ColM, false>(a + r0 * C + 16 * J, C, xr, Dk, yj, Dk, rows, 16, Dk, false);
    if constexpr (kTwo)
      block_mm<RowM, ColM, false>(a2 + r0 * C + 16 * J, C, x2r, Dk, yj, Dk, rows, 16, Dk, false);
    __syncthreads();  // the next J rewrites the scaled copies
  }
}

// path: out_f[t,d] (+)= sum_{s <= t} M[t,s] Gamma_tsd xf[s,d] and
//       out_b[t,d] (+)= sum_{r >= t} M[r,t] Gamma_rtd xb[r,d];
// M is zero above its diagonal (its diagonal is used).
template <int Dk>
__device__ __forceinline__ void vector_decay_path(float* out_f, float* out_b, const float* M,
                                                  const float* xf, const float* xb, const float* b,
                                                  int C, float* tmp, bool accumulate) {
  using RowM = wmma::row_major;
  using ColM = wmma::col_major;
  const int tid = threadIdx.x, threads = blockDim.x;
  // Diagonal blocks on the CUDA cores, one thread per (16-row block, dim d):
  // it walks the block's lower triangle once with the block's b, xf (and the
  // sums) in registers, so each pair's e^{b_t - b_s} serves both the forward
  // sum of row t and the backward sum of row s (half the exponentials and a
  // third of the shared loads of one thread per (t, d) walking both).
  for (int task = tid; task < (C / 16) * Dk; task += threads) {
    const int s0 = (task / Dk) * 16, d = task % Dk;
    float bb[16], xs[16], fa[16], ba[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      bb[r] = b[(s0 + r) * Dk + d];
      xs[r] = xf[(s0 + r) * Dk + d];
      ba[r] = 0.f;
    }
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      const float xbt = xb[(s0 + t) * Dk + d];
      const float* m = M + (s0 + t) * C + s0;  // the same address across the warp: a broadcast
      float ft = 0.f;
#pragma unroll
      for (int s2 = 0; s2 <= t; ++s2) {
        const float me = m[s2] * __expf(bb[t] - bb[s2]);
        ft += me * xs[s2];
        ba[s2] += me * xbt;
      }
      fa[t] = ft;
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const int idx = (s0 + r) * Dk + d;
      out_f[idx] = (accumulate ? out_f[idx] : 0.f) + fa[r];
      out_b[idx] = (accumulate ? out_b[idx] : 0.f) + ba[r];
    }
  }
  // Off-diagonal blocks, one source block J at a time:
  //   out_f[rows > rho] += e^{b - b_rho} o (M[rows > rho, J] (xf_J o e^{b_rho - b_J}))
  //   out_b[J]          += e^{b_rho - b_J} o (M[rows > rho, J]^T (xb o e^{b - b_rho}))
  constexpr int kRows = 64 - 16;         // rows below the first block at the largest chunk (64)
  float* e_rows = tmp;                   // e^{b - b_rho}, rows > rho
  float* xb_rows = e_rows + kRows * Dk;  // xb o e_rows
  float* p_rows = xb_rows + kRows * Dk;  // the out_f product
  float* f_j = p_rows + 48 * Dk;         // e^{b_rho - b_J}
  float* xf_j = f_j + 16 * Dk;           // xf_J o f_j
  float* p_j = xf_j + 16 * Dk;           // the out_b product
  for (int J = 0; J + 1 < C / 16; ++J) {
    const int r0 = 16 * J + 16, rows = C - r0, rho = 16 * J + 15;
    __syncthreads();  // out_f/out_b (diagonal pass or the previous J) and tmp are settled
    for (int idx = tid; idx < rows * Dk; idx += threads) {
      const int t = r0 + idx / Dk, d = idx % Dk;
      const float e = __expf(b[t * Dk + d] - b[rho * Dk + d]);
      e_rows[idx] = e;
      xb_rows[idx] = xb[t * Dk + d] * e;
    }
    for (int idx = tid; idx < 16 * Dk; idx += threads) {
      const int s = 16 * J + idx / Dk, d = idx % Dk;
      const float f = __expf(b[rho * Dk + d] - b[s * Dk + d]);
      f_j[idx] = f;
      xf_j[idx] = xf[s * Dk + d] * f;
    }
    __syncthreads();
    const float* m = M + r0 * C + 16 * J;
    block_mm<RowM, RowM, false>(p_rows, Dk, m, C, xf_j, Dk, rows, Dk, 16, false);
    block_mm<ColM, RowM, false>(p_j, Dk, m, C, xb_rows, Dk, 16, Dk, rows, false);
    __syncthreads();
    for (int i = 4 * tid; i < rows * Dk; i += 4 * threads) {
      Quad o = ldq(out_f + r0 * Dk + i);
      const Quad e = ldq(e_rows + i), p = ldq(p_rows + i);
#pragma unroll
      for (int c = 0; c < 4; ++c) o.v[c] += e.v[c] * p.v[c];
      stq(out_f + r0 * Dk + i, o);
    }
    for (int i = 4 * tid; i < 16 * Dk; i += 4 * threads) {
      Quad o = ldq(out_b + 16 * J * Dk + i);
      const Quad f = ldq(f_j + i), p = ldq(p_j + i);
#pragma unroll
      for (int c = 0; c < 4; ++c) o.v[c] += f.v[c] * p.v[c];
      stq(out_b + 16 * J * Dk + i, o);
    }
  }
}

// chunk_state_products_kernel: the products of one (chunk, head) tile with
// the Dk x Dv states, taken out of the gradient kernel for 16-bit inputs.
// They are most of its arithmetic (five C x D x D products against ten
// C x C x D ones) and, streamed from global scratch in fp32 there, most of its
// waiting; here every operand sits in shared memory in the input's 16-bit
// type and the fp32 accumulators stay in registers (warp_mm_16x32).
//   V'  = U - W S_c            (delta rules; additive: V' = V, not written)
//   dV' = A^T dO + K_ dS_{c+1}
//   gq  = dO S_c^T             (d/dq of the state path before scale e^{b})
//   gk  = V' dS_{c+1}^T        (d/dk of the K_ path before e^{b_{C-1} - b})
//   dW  = -dV' S_c^T           (delta rules)
//   dgamma_d = sum_j dS_{c+1,dj} S_c,dj  (fp32, exact inputs)
// The operands are those the forward and the reverse scan use: the prepare
// stage's W, U, K_, A tiles and S, dS rounded to T (as the forward rounds S
// and the scan dS for their own products). Outputs are fp32, per item at
// ws_sp + (item - item_begin) * kOutFloats; the intra-chunk kernels
// (chunk_intra_grad*.cuh) read them.
//   grid (items in the batch), 256 threads, kBytes of dynamic shared memory
//   (162 KB at D = 128: one block per multiprocessor).
template <typename T, int Dk, int Dv>
struct StateProductTraits {
  static constexpr int kMaxChunk = 64;
  static constexpr int kThreads = 256, kWarps = 8;
  // Row pitches in elements: 16-byte aligned rows whose eight-row ldmatrix
  // groups fall on distinct banks (pitch = 8 mod 64 elements).
  static constexpr int kLdK = Dk + 8, kLdV = Dv + 8, kLdC = kMaxChunk + 8;
  static constexpr int kStateElems = Dk * kLdV;  // S, dS
  static constexpr int kKElems = kMaxChunk * kLdK;
  static constexpr int kVElems = kMaxChunk * kLdV;
  static constexpr int kAElems = kMaxChunk * kLdC;
  static constexpr size_t kBytes =
      sizeof(T) * (2 * kStateElems + 2 * kKElems + 3 * kVElems + kAElems);
  static_assert(kBytes <= 227 * 1024, "chunk_state_products_kernel exceeds Hopper shared memory");
  static_assert(Dk % 32 == 0 && Dv % 32 == 0, "16 x 32 output slabs");
  // Output layout per item (rows of the chunk's C, pitch Dk or Dv): fp32,
  // except that delta rules store V', dV' and dW in T (16-bit, at the start
  // of their fp32 slots): the intra-chunk kernels read them only as 16-bit
  // operand copies, and rounding them here is the same rounding those
  // kernels made on their load (bitwise the same operands), for half the
  // bytes each way. Additive rules keep dV' in fp32 (it is their dv).
  static constexpr int64_t kOffVp = 0;
  static constexpr int64_t kOffDVp = kOffVp + kMaxChunk * Dv;
  static constexpr int64_t kOffGq = kOffDVp + kMaxChunk * Dv;
  static constexpr int64_t kOffGk = kOffGq + kMaxChunk * Dk;
  static constexpr int64_t kOffDW = kOffGk + kMaxChunk * Dk;
  static constexpr int64_t kOffDgamma = kOffDW + kMaxChunk * Dk;
  static constexpr int64_t kOutFloats = kOffDgamma + Dk;
};

template <Rule kRule, typename T, int Dk, int Dv>
__global__ void __launch_bounds__(256, 1)
    chunk_state_products_kernel(const __grid_constant__ BackwardArgs a) {
  using Tr = StateProductTraits<T, Dk, Dv>;
  constexpr bool kDelta = kRule == Rule::delta;
  constexpr int kLdK = Tr::kLdK, kLdV = Tr::kLdV, kLdC = Tr::kLdC;
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  T* sS = reinterpret_cast<T*>(smem_bytes);
  T* sdS = sS + Tr::kStateElems;
  T* sW = sdS + Tr::kStateElems;
  T* sK = sW + Tr::kKElems;   // K_
  T* sU = sK + Tr::kKElems;   // U, then V' (delta); V (additive)
  T* sO = sU + Tr::kVElems;   // dO
  T* sdV = sO + Tr::kVElems;  // dV'
  T* sA = sdV + Tr::kVElems;

  const ForwardArgs& f = a.f;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t H = f.heads, item = a.item_begin + blockIdx.x, c = item / H, h = item % H;
  const int64_t tile = item;  // = c * H + h, the workspace's tile index
  int64_t token0;
  int L;
  chunk_geometry(f, c, token0, L);
  const int C = f.chunk;
  float* out = a.ws_sp + static_cast<int64_t>(blockIdx.x) * Tr::kOutFloats;

  // ---- 16-bit tiles by cp.async (the workspace's rows past L are zeros) ----
  copy_tile_async<Tr::kThreads>(sK, kLdK, static_cast<const T*>(f.ws_k) + tile * C * Dk, Dk, C, Dk);
  copy_tile_async<Tr::kThreads>(sU, kLdV, static_cast<const T*>(f.ws_u) + tile * C * Dv, Dv, C, Dv);
  copy_tile_async<Tr::kThreads>(sA, kLdC, static_cast<const T*>(f.ws_a) + tile * C * C, C, C, C);
  if constexpr (kDelta)
    copy_tile_async<Tr::kThreads>(sW, kLdK, static_cast<const T*>(f.ws_w) + tile * C * Dk, Dk, C,
                                  Dk);
  {
    const T* d_o = static_cast<const T*>(a.d_o);
    constexpr int kVec = 8;  // 16-bit elements per 16-byte copy
    for (int idx = tid; idx < C * Dv / kVec; idx += Tr::kThreads) {
      const int i = idx / (Dv / kVec), j = (idx % (Dv / kVec)) * kVec;
      if (i < L)
        cp_async16(sO + i * kLdV + j, d_o + ((token0 + i) * H + h) * Dv + j);
      else
        *reinterpret_cast<uint4*>(sO + i * kLdV + j) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  // dS_{c+1} saved in T (ungated variants, BackwardArgs::ws_ds_t): copied as
  // it is; the fp32 path below rounds it to the same values.
  const bool ds_in_t = a.ws_ds_t != nullptr;
  if (ds_in_t)
    copy_tile_async<Tr::kThreads>(sdS, kLdV, static_cast<const T*>(a.ws_ds_t) + tile * Dk * Dv, Dv,
                                  Dk, Dv);
  cp_async_commit();

  // ---- S and dS: fp32 -> T, and dgamma from the exact fp32 values ---------
  // Half the loads of each matrix are in flight at once (registers between),
  // then stored; a warp covers whole rows, so dgamma is a segmented shuffle sum.
  // With dS in T only S is converted, and dgamma (read only by gated
  // variants, whose dS stays fp32) is not written.
  if (ds_in_t) {
    const float* S = a.chunk_states + tile * Dk * Dv;
    constexpr int kRowVecs = Dv / 4;
    for (int idx = tid; idx < Dk * kRowVecs; idx += Tr::kThreads) {
      const int d = idx / kRowVecs, j = (idx % kRowVecs) * 4;
      const float4 x = load4(S + 4 * idx);
      *reinterpret_cast<uint2*>(sS + d * kLdV + j) =
          make_uint2(pack2<T>(x.x, x.y), pack2<T>(x.z, x.w));
    }
  } else {
    const float* S = a.chunk_states + tile * Dk * Dv;
    const float* dS = a.ws_ds + tile * Dk * Dv;
    constexpr int kRowVecs = Dv / 4;  // float4 per row
    constexpr int kIters = Dk * Dv / 4 / Tr::kThreads, kHalf = kIters / 2;
    static_assert(kHalf * 2 * Tr::kThreads * 4 == Dk * Dv, "whole load rounds");
    static_assert(kRowVecs % 32 == 0 || 32 % kRowVecs == 0, "rows tile warps");
    constexpr int kGroup = kRowVecs < 32 ? kRowVecs : 32;  // lanes per row segment
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      float4 xs[kHalf], xd[kHalf];
#pragma unroll
      for (int it = 0; it < kHalf; ++it) {
        const int idx = tid + (part * kHalf + it) * Tr::kThreads;
        xs[it] = load4(S + 4 * idx);
        xd[it] = load4(dS + 4 * idx);
      }
#pragma unroll
      for (int it = 0; it < kHalf; ++it) {
        const int idx = tid + (part * kHalf + it) * Tr::kThreads;
        const int d = idx / kRowVecs, j = (idx % kRowVecs) * 4;
        *reinterpret_cast<uint2*>(sS + d * kLdV + j) =
            make_uint2(pack2<T>(xs[it].x, xs[it].y), pack2<T>(xs[it].z, xs[it].w));
        *reinterpret_cast<uint2*>(sdS + d * kLdV + j) =
            make_uint2(pack2<T>(xd[it].x, xd[it].y), pack2<T>(xd[it].z, xd[it].w));
        float p =
            xs[it].x * xd[it].x + xs[it].y * xd[it].y + xs[it].z * xd[it].z + xs[it].w * xd[it].w;
#pragma unroll
        for (int off = kGroup / 2; off > 0; off >>= 1) p += __shfl_xor_sync(0xffffffffu, p, off);
        if constexpr (kRowVecs <= 32) {
          if (lane % kRowVecs == 0) out[Tr::kOffDgamma + d] = p;
        } else {
          static_assert(kRowVecs <= 32, "Dv <= 128");
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Each warp takes 16 x 32 output slabs in turn; lane (g, i) holds rows
  // m0 + g (+ 8) and column pairs n0 + 8 j + 2 i of each slab's four tiles.
  const int g = lane >> 2, i2 = 2 * (lane & 3), row_tiles = C / 16;
  auto for_slabs = [&](int cols, auto&& body) {
    for (int s = warp; s < row_tiles * (cols / 32); s += Tr::kWarps)
      body((s % row_tiles) * 16, (s / row_tiles) * 32);
  };
  // Writes a slab (times `sign`) to out[off] (pitch `ld`; as T with
  // `as_t`, else fp32), and with `copy` also as T into shared memory (pitch ldc).
  auto store_slab = [&](const float(&acc)[4][4], int m0, int n0, int64_t off, int ld, float sign,
                        T* copy, int ldc, bool as_t) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m0 + g + 8 * half, col = n0 + 8 * j + i2;
        const float x = sign * acc[j][2 * half], y = sign * acc[j][2 * half + 1];
        if (as_t)
          *reinterpret_cast<uint32_t*>(reinterpret_cast<T*>(out + off) + r * ld + col) =
              pack2<T>(x, y);
        else
          *reinterpret_cast<float2*>(out + off + r * ld + col) = make_float2(x, y);
        if (copy != nullptr) *reinterpret_cast<uint32_t*>(copy + r * ldc + col) = pack2<T>(x, y);
      }
  };

  // ---- V' = U - W S (into sU, in place: each slab reads only its own U) ----
  if constexpr (kDelta) {
    for_slabs(Dv, [&](int m0, int n0) {
      float acc[4][4] = {};
      warp_mm_16x32<T, false, true>(acc, sW, kLdK, sS, kLdV, m0, n0, Dk);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = m0 + g + 8 * half, col = n0 + 8 * j + i2;
          const float2 u = unpack2<T>(*reinterpret_cast<const uint32_t*>(sU + r * kLdV + col));
          acc[j][2 * half] = u.x - acc[j][2 * half];
          acc[j][2 * half + 1] = u.y - acc[j][2 * half + 1];
        }
      store_slab(acc, m0, n0, Tr::kOffVp, Dv, 1.f, sU, kLdV, true);
    });
  }
  // ---- dV' = A^T dO + K_ dS ------------------------------------------------
  for_slabs(Dv, [&](int m0, int n0) {
    float acc[4][4] = {};
    warp_mm_16x32<T, true, true>(acc, sA, kLdC, sO, kLdV, m0, n0, C);
    warp_mm_16x32<T, false, true>(acc, sK, kLdK, sdS, kLdV, m0, n0, Dk);
    store_slab(acc, m0, n0, Tr::kOffDVp, Dv, 1.f, kDelta ? sdV : nullptr, kLdV, kDelta);
  });
  // ---- gq = dO S^T ---------------------------------------------------------
  for_slabs(Dk, [&](int m0, int n0) {
    float acc[4][4] = {};
    warp_mm_16x32<T, false, false>(acc, sO, kLdV, sS, kLdV, m0, n0, Dv);
    store_slab(acc, m0, n0, Tr::kOffGq, Dk, 1.f, nullptr, 0, false);
  });
  __syncthreads();  // V' and dV' complete in shared memory
  // ---- gk = V' dS^T; dW = -dV' S^T ------------------------------------------
  for_slabs(Dk, [&](int m0, int n0) {
    float acc[4][4] = {};
    warp_mm_16x32<T, false, false>(acc, sU, kLdV, sdS, kLdV, m0, n0, Dv);
    store_slab(acc, m0, n0, Tr::kOffGk, Dk, 1.f, nullptr, 0, false);
  });
  if constexpr (kDelta) {
    for_slabs(Dk, [&](int m0, int n0) {
      float acc[4][4] = {};
      warp_mm_16x32<T, false, false>(acc, sdV, kLdV, sS, kLdV, m0, n0, Dv);
      store_slab(acc, m0, n0, Tr::kOffDW, Dk, -1.f, nullptr, 0, true);
    });
  }
}

}  // namespace statescan::cuda::detail

#include "kernels/cuda/chunk_grad_raw16.cuh"
#include "kernels/cuda/chunk_grad_scan16.cuh"
#include "kernels/cuda/chunk_intra_grad.cuh"
#include "kernels/cuda/chunk_intra_grad_vector.cuh"

namespace statescan::cuda::detail {

// chunk_grad_kernel_tc: all gradients of one chunk from S_c and dS_{c+1}, for
// fp32 inputs (16-bit inputs take chunk_state_products_kernel and the
// intra-chunk kernels of chunk_intra_grad*.cuh).
//   grid min(items, SMs), 256 threads, persistent: block i handles items
//   (chunk c, head h) = item_begin + i, + gridDim.x, ... in turn. Every plain
//   matrix product on the tensor cores in split tf32 (block_mm: about fp32's
//   accuracy); the pairwise-decay products of a vector gate
//   in 16-row blocks (vector_decay_gram/path). q, k, b and the [C, C]
//   matrices in shared memory (GradTraits::kSmemBytes, 195 KB at D = 128),
//   the [C, D] intermediates in the block's slice of ws_scratch
//   (GradTraits::kScratchFloats; its q, k, b slots unused). Phases (barriers
//   between them) follow tests/chunk_bwd_model.h. (`_tc`: the CUDA-core
//   reference versions of both backward kernels were removed on 2026-11-30,
//   once these had passed every GPU test; the fp64 reference is the check.)
template <Decay kDecay, Rule kRule, typename T, int Dk, int Dv, bool kL2Norm>
__global__ void __launch_bounds__(256, 1)
    chunk_grad_kernel_tc(const __grid_constant__ BackwardArgs a) {
  using Tr = GradTraits<Dk, Dv>;
  using RowM = wmma::row_major;
  using ColM = wmma::col_major;
  constexpr bool kDelta = kRule == Rule::delta;
  constexpr bool kVector = kDecay == Decay::vector;
  // db (the gates' gradient) exists with a gate only: without one nothing
  // writes it first or reads it after, so the delta rule's passes that add
  // to it skip it (they read never-written scratch before, which
  // compute-sanitizer's initcheck reported on DeltaNet f32).
  constexpr bool kHasDb = kDecay != Decay::none;
  static_assert(std::is_same_v<T, float>, "16-bit inputs take the intra-chunk kernels");
  constexpr int kThreads = Tr::kThreads, kWarps = Tr::kWarps, kMC = Tr::kMaxChunk;
  extern __shared__ __align__(128) float smem[];
  float* q = smem;          // normalised q (no scale)
  float* k = q + kMC * Dk;  // normalised k
  float* b = k + kMC * Dk;  // vector gates: cumsum per dim
  float* sA = b + kMC * Dk;
  float* sKK = sA + Tr::kCC;
  float* sT = sKK + Tr::kCC;
  float* sdA = sT + Tr::kCC;
  float* sdT = sdA + Tr::kCC;
  float* sTmp = sdT + Tr::kCC;
  float* sBeta = sTmp + Tr::kCC;
  float* sRq = sBeta + kMC;
  float* sRk = sRq + kMC;
  float* sGs = sRk + kMC;  // cumsum of a scalar gate
  float* sDbeta = sGs + kMC;
  float* sRow = sDbeta + kMC;
  float* sDgamma = sRow + kMC;
  float* sColsum = sDgamma + Dk;

  float* scratch = a.ws_scratch + static_cast<int64_t>(blockIdx.x) * Tr::kScratchFloats;
  float* W = scratch + 3 * kMC * Dk;  // after the (unused here) q, k, b slots
  float* gq = W + kMC * Dk;           // d loss / d (normalised q); first diag(beta) K^
  float* gk = gq + kMC * Dk;
  float* db = gk + kMC * Dk;  // d loss / d b
  float* dW = db + kMC * Dk;
  float* TdW = dW + kMC * Dk;
  float* Kh = TdW + kMC * Dk;   // K^ = k e^{b}
  float* Kbar = Kh + kMC * Dk;  // K_ = k e^{b_{C-1} - b}
  float* v = Kbar + kMC * Dk;
  float* dO = v + kMC * Dv;
  float* Vp = dO + kMC * Dv;
  float* dVp = Vp + kMC * Dv;
  float* TdU = dVp + kMC * Dv;  // first diag(beta) V
  float* Bk = gq;
  float* Bv = TdU;

  const ForwardArgs& f = a.f;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int C = f.chunk;
  const int64_t H = f.heads;
  const float scale = f.scale;
  const T* q_in = static_cast<const T*>(f.q);
  const T* k_in = static_cast<const T*>(f.k);
  const T* v_in = static_cast<const T*>(f.v);
  const T* beta_in = static_cast<const T*>(f.beta);
  const T* do_in = static_cast<const T*>(a.d_o);
  T* dq_out = static_cast<T*>(a.dq);
  T* dk_out = static_cast<T*>(a.dk);
  T* dv_out = static_cast<T*>(a.dv);
  T* dbeta_out = static_cast<T*>(a.dbeta);

  auto gate_b = [&](int t, int d) -> float {
    if constexpr (kVector) return b[t * Dk + d];
    if constexpr (kDecay == Decay::scalar) return sGs[t];
    return 0.f;
  };
  auto decay = [&](int t, int s, int d) -> float {
    if constexpr (kDecay == Decay::none) return 1.f;
    return __expf(gate_b(t, d) - gate_b(s, d));
  };
  // e^{b_t} and e^{b_{C-1} - b_t} of dimension d (1 without a gate).
  auto up_down = [&](int t, int d, float& up, float& down) {
    up = 1.f;
    down = 1.f;
    if constexpr (kDecay != Decay::none) {
      up = __expf(gate_b(t, d));
      down = __expf(gate_b(C - 1, d) - gate_b(t, d));
    }
  };
  const Quad kZero4{{0.f, 0.f, 0.f, 0.f}};
  static_assert(Dk % 4 == 0 && Dv % 4 == 0 && Dk <= 128, "4-wide passes, a lane per 4 dims");

  for (int64_t item = a.item_begin + blockIdx.x; item < a.num_items; item += gridDim.x) {
    const int64_t c = item / H, h = item % H, tile = c * H + h;
    int64_t token0;
    int L;
    chunk_geometry(f, c, token0, L);
    auto row = [&](int t) { return (token0 + t) * H + h; };
    const float* S = a.chunk_states + tile * Dk * Dv;
    const float* dS = a.ws_ds + tile * Dk * Dv;
    const float* vp = kDelta ? Vp : v;

    // ---- load; rows past the chunk's end are zeros with g = 0 --------------
    // (Elementwise passes go four elements at a time: see Quad.)
    for (int i = 4 * tid; i < C * Dk; i += 4 * kThreads) {
      const int t = i / Dk, d = i % Dk;
      const bool valid = t < L;
      const int64_t src = row(t) * Dk + d;
      stq(q + i, valid ? ldq(q_in + src) : kZero4);
      stq(k + i, valid ? ldq(k_in + src) : kZero4);
      if constexpr (kVector) stq(b + i, valid ? ldq(f.g + src) : kZero4);
    }
    for (int i = 4 * tid; i < C * Dv; i += 4 * kThreads) {
      const int t = i / Dv, j = i % Dv;
      const bool valid = t < L;
      const int64_t src = row(t) * Dv + j;
      stq(v + i, valid ? ldq(v_in + src) : kZero4);
      stq(dO + i, valid ? ldq(do_in + src) : kZero4);
    }
    if (tid < C) {
      const bool valid = tid < L;
      if constexpr (kDelta) sBeta[tid] = valid ? to_float(beta_in[row(tid)]) : 0.f;
      if constexpr (kDecay == Decay::scalar) sGs[tid] = valid ? f.g[row(tid)] : 0.f;
      sRq[tid] = 1.f;
      sRk[tid] = 1.f;
    }
    __syncthreads();

    // ---- L2 norm (as the forward: x / sqrt(|x|^2 + 1e-6)); gate cumsums ----
    if constexpr (kL2Norm) {
      for (int t = warp; t < C; t += kWarps) {
        float qq = 0.f, kk = 0.f;
        for (int d = lane; d < Dk; d += 32) {
          qq += q[t * Dk + d] * q[t * Dk + d];
          kk += k[t * Dk + d] * k[t * Dk + d];
        }
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        const float rq = 1.f / sqrtf(qq + 1e-6f), rk = 1.f / sqrtf(kk + 1e-6f);
        for (int d = lane; d < Dk; d += 32) {
          q[t * Dk + d] *= rq;
          k[t * Dk + d] *= rk;
        }
        if (lane == 0) {
          sRq[t] = rq;
          sRk[t] = rk;
        }
      }
    }
    if constexpr (kVector) {
      if (tid < Dk) {
        float run = 0.f;
        for (int t = 0; t < C; ++t) {
          run += b[t * Dk + tid];
          b[t * Dk + tid] = run;
        }
      }
    } else if constexpr (kDecay == Decay::scalar) {
      if (tid == 0) {
        float run = 0.f;
        for (int t = 0; t < C; ++t) {
          run += sGs[t];
          sGs[t] = run;
        }
      }
    }
    __syncthreads();

    // ---- A, KK; K^, K_, diag(beta) K^, diag(beta) V ------------------------
    // A scalar (or no) decay factors out of the sum over dimensions: A and KK
    // are plain products on the tensor cores, masked and decayed below. A
    // per-dimension decay does not: vector_decay_gram (16-row blocks).
    if constexpr (!kVector) {
      block_mm<RowM, ColM, false>(sA, C, q, Dk, k, Dk, C, C, Dk, false);
      if constexpr (kDelta) block_mm<RowM, ColM, false>(sKK, C, k, Dk, k, Dk, C, C, Dk, false);
    } else {
      vector_decay_gram<Dk, kDelta>(sA, sKK, q, k, k, b, C, scratch);
    }
    for (int i = 4 * tid; i < C * Dk; i += 4 * kThreads) {
      const int t = i / Dk, d = i % Dk;
      const Quad x = ldq(k + i);
      Quad kh, kbar, bk;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float up, down;
        up_down(t, d + e, up, down);
        kh.v[e] = x.v[e] * up;
        kbar.v[e] = x.v[e] * down;
        if constexpr (kDelta) bk.v[e] = sBeta[t] * x.v[e] * up;
      }
      if constexpr (kDelta) stq(Kh + i, kh);
      stq(Kbar + i, kbar);
      if constexpr (kDelta) stq(Bk + i, bk);
    }
    if constexpr (kDelta) {
      for (int i = 4 * tid; i < C * Dv; i += 4 * kThreads) {
        Quad x = ldq(v + i);
        const float beta = sBeta[i / Dv];
#pragma unroll
        for (int e = 0; e < 4; ++e) x.v[e] *= beta;
        stq(Bv + i, x);
      }
    }
    __syncthreads();
    // The scale; causal masks and the pairwise decay of a scalar gate (the
    // vector gram applied both).
    for (int idx = tid; idx < C * C; idx += kThreads) {
      const int t = idx / C, s = idx % C;
      const float f = s <= t ? (kVector ? 1.f : decay(t, s, 0)) : 0.f;
      sA[idx] *= scale * f;
      if constexpr (kDelta) sKK[idx] = s < t ? sKK[idx] * f : 0.f;
    }
    __syncthreads();

    if constexpr (kDelta) {
      // ---- T = (I + diag(beta) KK)^{-1}, one thread per column s ------------
      // Forward substitution x_t = [t == s] - beta_t sum_{r<t} KK_tr x_r with
      // the column in registers (fully unrolled; x_r = 0 for r < s, so the
      // sum may start at 0): the chain is register FMAs on broadcast loads of
      // KK's row, not ~C^2/2 dependent shared-memory round trips of 2 warps.
      if (tid < C) {
        const int s = tid;
        float x[kMC];
#pragma unroll
        for (int t = 0; t < kMC; ++t) {
          if (t < C) {
            float part = 0.f;
#pragma unroll
            for (int r = 0; r < t; ++r) part += sKK[t * C + r] * x[r];
            x[t] = (t == s ? 1.f : 0.f) - sBeta[t] * part;
            sT[t * C + s] = x[t];
          }
        }
      }
      __syncthreads();
      // ---- W = T diag(beta) K^, U = T diag(beta) V (into V') ---------------
      block_mm<RowM, RowM, false>(W, Dk, sT, C, Bk, Dk, C, Dk, C, false);
      block_mm<RowM, RowM, false>(Vp, Dv, sT, C, Bv, Dv, C, Dv, C, false);
      __syncthreads();
      // ---- V' = U - W S_c -------------------------------------------------
      block_mm<RowM, RowM, true>(Vp, Dv, W, Dk, S, Dv, C, Dv, Dk, true);
      __syncthreads();
    }

    // ---- dV' = K_ dS (+ A^T dO below), dA = dO V'^T, dO S^T, V' dS^T, dgamma
    block_mm<RowM, RowM, false>(dVp, Dv, Kbar, Dk, dS, Dv, C, Dv, Dk, false);
    block_mm<RowM, ColM, false>(sdA, C, dO, Dv, vp, Dv, C, C, Dv, false);
    block_mm<RowM, ColM, false>(gq, Dk, dO, Dv, S, Dv, C, Dk, Dv, false);
    block_mm<RowM, ColM, false>(gk, Dk, vp, Dv, dS, Dv, C, Dk, Dv, false);
    for (int d = warp; d < Dk; d += kWarps) {  // dgamma_d = dS_d . S_d (warp per row)
      float acc = 0.f;
      for (int j = lane; j < Dv; j += 32) acc += dS[d * Dv + j] * S[d * Dv + j];
      acc = warp_sum(acc);
      if (lane == 0) sDgamma[d] = acc;
    }
    __syncthreads();
    block_mm<ColM, RowM, false>(dVp, Dv, sA, C, dO, Dv, C, Dv, C, true);
    // Causal mask and scale of dA (a scalar gate's pairwise decay too: the A
    // path below is then two plain products); gate factors of the state parts
    // of gq and gk.
    for (int idx = tid; idx < C * C; idx += kThreads) {
      const int t = idx / C, s = idx % C;
      sdA[idx] = s > t ? 0.f : sdA[idx] * scale * (kVector ? 1.f : decay(t, s, 0));
    }
    for (int i = 4 * tid; i < C * Dk; i += 4 * kThreads) {
      const int t = i / Dk, d = i % Dk;
      Quad x = ldq(gq + i), y = ldq(gk + i);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float up, down;
        up_down(t, d + e, up, down);
        x.v[e] *= scale * up;
        y.v[e] *= down;  // the K_ path
      }
      stq(gq + i, x);
      stq(gk + i, y);
    }
    __syncthreads();

    // ---- dW = -dV' S_c^T; column sums of the K_ path (they land on b_{L-1}) -
    if constexpr (kDelta) block_mm<RowM, ColM, true>(dW, Dk, dVp, Dv, S, Dv, C, Dk, Dv, false);
    if (tid < Dk) {
      float acc = 0.f;
      for (int t = 0; t < C; ++t) acc += gk[t * Dk + tid] * k[t * Dk + tid];
      sColsum[tid] = acc;
    }
    __syncthreads();

    // ---- A path: gq += scale dA (k decay), gk += scale dA^T (q decay); db ---
    // dA already holds the scale (and a scalar gate's decay).
    if constexpr (kVector) {
      vector_decay_path<Dk>(gq, gk, sdA, k, q, b, C, scratch, true);
    } else {
      block_mm<RowM, RowM, false>(gq, Dk, sdA, C, k, Dk, C, Dk, C, true);
      block_mm<ColM, RowM, false>(gk, Dk, sdA, C, q, Dk, C, Dk, C, true);
    }
    if constexpr (kHasDb) {
      __syncthreads();
      for (int i = 4 * tid; i < C * Dk; i += 4 * kThreads) {
        const Quad x = ldq(gq + i), y = ldq(gk + i), xq = ldq(q + i), xk = ldq(k + i);
        Quad r;
#pragma unroll
        for (int e = 0; e < 4; ++e) r.v[e] = x.v[e] * xq.v[e] - y.v[e] * xk.v[e];
        stq(db + i, r);
      }
    }
    __syncthreads();

    if constexpr (kDelta) {
      // ---- through the UT transform: T^T dU, T^T dW, dT -------------------
      block_mm<ColM, RowM, false>(TdU, Dv, sT, C, dVp, Dv, C, Dv, C, false);
      block_mm<ColM, RowM, false>(TdW, Dk, sT, C, dW, Dk, C, Dk, C, false);
      block_mm<RowM, ColM, false>(sdT, C, dVp, Dv, v, Dv, C, C, Dv, false);
      __syncthreads();
      block_mm<RowM, ColM, false>(sdT, C, dW, Dk, Kh, Dk, C, C, Dk, true);
      __syncthreads();
      // dT_ts = beta_s (dV' V^T + dW K^^T)_ts, strictly lower (T's
      // perturbations -T dMm T are strictly lower triangular).
      for (int idx = tid; idx < C * C; idx += kThreads) {
        const int t = idx / C, s = idx % C;
        sdT[idx] = s < t ? sBeta[s] * sdT[idx] : 0.f;
      }
      __syncthreads();
      // tmp = dT T^T; dv = beta T^T dU; dbeta (direct part); gk += beta e^b T^T dW.
      block_mm<RowM, ColM, false>(sTmp, C, sdT, C, sT, C, C, C, C, false);
      for (int i = 4 * tid; i < L * Dv; i += 4 * kThreads) {
        const int t = i / Dv, j = i % Dv;
        Quad x = ldq(TdU + i);
#pragma unroll
        for (int e = 0; e < 4; ++e) x.v[e] *= sBeta[t];
        stq(dv_out + row(t) * Dv + j, x);
      }
      for (int t = warp; t < C; t += kWarps) {
        float acc = 0.f;
        for (int j = lane; j < Dv; j += 32) acc += TdU[t * Dv + j] * v[t * Dv + j];
        for (int d = lane; d < Dk; d += 32) acc += TdW[t * Dk + d] * Kh[t * Dk + d];
        acc = warp_sum(acc);
        if (lane == 0) sDbeta[t] = acc;
      }
      for (int i = 4 * tid; i < C * Dk; i += 4 * kThreads) {
        const int t = i / Dk, d = i % Dk;
        const Quad tdw = ldq(TdW + i), xk = ldq(k + i);
        Quad g = ldq(gk + i), dbq = kHasDb ? ldq(db + i) : kZero4;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float up, down;  // down unused here
          up_down(t, d + e, up, down);
          const float gkh = sBeta[t] * up * tdw.v[e];
          g.v[e] += gkh;
          dbq.v[e] += gkh * xk.v[e];
        }
        stq(gk + i, g);
        if constexpr (kHasDb) stq(db + i, dbq);
      }
      __syncthreads();
      // dMm = -strict_lower(T^T tmp), into dT (its last reader was tmp above).
      block_mm<ColM, RowM, true>(sdT, C, sT, C, sTmp, C, C, C, C, false);
      __syncthreads();
      // sA (free since the A path) takes diag(beta) dMm (with a scalar gate's
      // pairwise decay): the K^ and K~ gradients below are then sA K and
      // sA^T K (with a vector gate, vector_decay_path's blocks).
      for (int idx = tid; idx < C * C; idx += kThreads) {
        const int t = idx / C, s = idx % C;
        const float m = s < t ? sdT[idx] : 0.f;
        sdT[idx] = m;
        // Above the diagonal the decay e^{b_t - b_s} may overflow (strong
        // gates): masked by selection, never by multiplying with 0.
        sA[idx] = s < t ? sBeta[t] * m * (kVector ? 1.f : decay(t, s, 0)) : 0.f;
      }
      __syncthreads();
      // Mm_ts = beta_t KK_ts: dbeta += dMm . KK; k-space gradients of K^ and K~.
      for (int t = warp; t < C; t += kWarps) {
        float acc = 0.f;
        for (int s = lane; s < t; s += 32) acc += sdT[t * C + s] * sKK[t * C + s];
        acc = warp_sum(acc);
        if (lane == 0) sDbeta[t] += acc;
      }
      // kh = sA K, kt = sA^T K into the free dW, TdW
      if constexpr (kVector) {
        vector_decay_path<Dk>(dW, TdW, sA, k, k, b, C, scratch, false);
      } else {
        block_mm<RowM, RowM, false>(dW, Dk, sA, C, k, Dk, C, Dk, C, false);
        block_mm<ColM, RowM, false>(TdW, Dk, sA, C, k, Dk, C, Dk, C, false);
      }
      __syncthreads();
      for (int i = 4 * tid; i < C * Dk; i += 4 * kThreads) {
        const Quad kh = ldq(dW + i), kt = ldq(TdW + i), xk = ldq(k + i);
        Quad g = ldq(gk + i), dbq = kHasDb ? ldq(db + i) : kZero4;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          g.v[e] += kh.v[e] + kt.v[e];
          dbq.v[e] += (kh.v[e] - kt.v[e]) * xk.v[e];
        }
        stq(gk + i, g);
        if constexpr (kHasDb) stq(db + i, dbq);
      }
      __syncthreads();
    } else {
      for (int i = 4 * tid; i < L * Dv; i += 4 * kThreads) {
        const int t = i / Dv, j = i % Dv;
        stq(dv_out + row(t) * Dv + j, ldq(dVp + i));
      }
    }

    // ---- gate gradients: b_{L-1} collects the K_ column sums and dgamma ----
    if constexpr (kHasDb) {
      if (tid < Dk) {
        const float gamma = __expf(gate_b(C - 1, tid));
        db[(L - 1) * Dk + tid] += sColsum[tid] + sDgamma[tid] * gamma;
      }
      __syncthreads();
      if constexpr (kVector) {
        if (tid < Dk) {  // dg_t = sum_{t' >= t} db_t' (reverse cumsum)
          // The column is loaded first (all loads in flight at once), then
          // summed: loads after stores to dg would each wait out L2.
          float col[kMC];
#pragma unroll
          for (int t = 0; t < kMC; ++t) col[t] = t < L ? db[t * Dk + tid] : 0.f;
          float run = 0.f;
#pragma unroll
          for (int t = kMC - 1; t >= 0; --t) {
            run += col[t];
            if (t < L) a.dg[row(t) * Dk + tid] = run;
          }
        }
      } else {
        for (int t = warp; t < L; t += kWarps) {
          float acc = 0.f;
          for (int d = lane; d < Dk; d += 32) acc += db[t * Dk + d];
          acc = warp_sum(acc);
          if (lane == 0) sRow[t] = acc;
        }
        __syncthreads();
        if (tid == 0) {
          float run = 0.f;
          for (int t = L - 1; t >= 0; --t) {
            run += sRow[t];
            a.dg[row(t)] = run;
          }
        }
      }
    }

    // ---- dq, dk through the L2 norm: dx = r (dn - n (n . dn)); dbeta --------
    // One warp per row, one lane per 4 dims.
    for (int t = warp; t < L; t += kWarps) {
      const int d = 4 * lane;
      const bool on = d < Dk;
      Quad x = kZero4, y = kZero4, xq = kZero4, xk = kZero4;
      if (on) {
        x = ldq(gq + t * Dk + d);
        y = ldq(gk + t * Dk + d);
        xq = ldq(q + t * Dk + d);
        xk = ldq(k + t * Dk + d);
      }
      if constexpr (kL2Norm) {
        float qg = 0.f, kg = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          qg += xq.v[e] * x.v[e];
          kg += xk.v[e] * y.v[e];
        }
        qg = warp_sum(qg);
        kg = warp_sum(kg);
        const float rq = sRq[t], rk = sRk[t];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          x.v[e] = rq * (x.v[e] - xq.v[e] * qg);
          y.v[e] = rk * (y.v[e] - xk.v[e] * kg);
        }
      }
      if (on) {
        stq(dq_out + row(t) * Dk + d, x);
        stq(dk_out + row(t) * Dk + d, y);
      }
      if constexpr (kDelta)
        if (lane == 0) dbeta_out[row(t)] = from_float<T>(sDbeta[t]);
    }
    __syncthreads();  // scratch and shared memory are reused by the next item
  }
}

// Host launch of the backward kernels for one (variant, dtype, head dims,
// l2norm); the prepare stage has already run. grad_blocks: the persistent
// grid of chunk_grad_kernel_tc (the scratch holds that many slices).
template <Decay kDecay, Rule kRule, typename Elem, int Dk, int Dv, bool kL2Norm>
void launch_backward_kernels(const BackwardArgs& a, bool state_grad_only, int grad_blocks,
                             cudaStream_t stream) {
  constexpr int kBV = 16;
  const dim3 scan_grid(Dv / kBV, static_cast<unsigned>(a.f.heads),
                       static_cast<unsigned>(a.f.num_segments));
  // Linear attention's raw path (ForwardArgs::raw_additive): the scan reads q
  // and one kernel forms every gradient from the inputs; no prepared tiles.
  constexpr bool kRaw = kRawCapable<kDecay, kRule, Elem, kL2Norm>;
  SS_CHECK_ARG(kRaw || !a.f.raw_additive, "raw_additive",
               "set for a variant, dtype or L2 norm whose backward needs the prepared tiles");
  if constexpr (kRaw) {
    if (a.f.raw_additive) {
      SS_CHECK_ARG(state_grad_only || (a.ws_ds_t != nullptr && a.chunk_states != nullptr),
                   "workspace", "the raw linear backward needs dS in T and the chunk states");
      using ScanTr = GradScan16Traits<Elem, Dk, Dv, kBV, false>;
      using RawTr = GradRaw16Traits<Elem, Dk, Dv>;
      with_chunk_size(a.f.chunk, [&](auto chunk_tag) {
        constexpr int kC = decltype(chunk_tag)::value;
        launch_kernel(chunk_grad_scan16_kernel<kDecay, kRule, Elem, Dk, Dv, kBV, kC, true>,
                      scan_grid, ScanTr::kThreads, ScanTr::kBytes, stream,
                      "chunk_grad_scan16_kernel (raw)", a, ScanTileMaps{});
        if (state_grad_only) return;
        launch_kernel(chunk_grad_raw16_kernel<Elem, Dk, Dv, kC>,
                      dim3(static_cast<unsigned>(a.f.num_chunks), static_cast<unsigned>(a.f.heads)),
                      RawTr::kThreads, RawTr::kBytes, stream, "chunk_grad_raw16_kernel", a);
      });
      return;
    }
  }
  if (std::is_same_v<Elem, float> || a.f.scan_wmma) {
    using ScanTr = GradScanTraits<Elem, Dk, Dv, kBV>;
    launch_kernel(chunk_grad_scan_kernel_tc<kDecay, kRule, Elem, Dk, Dv, kBV>, scan_grid,
                  ScanTr::kThreads, ScanTr::kBytes, stream, "chunk_grad_scan_kernel_tc", a);
  } else if constexpr (!std::is_same_v<Elem, float>) {
    using ScanTr = GradScan16Traits<Elem, Dk, Dv, kBV, kRule == Rule::delta>;
    with_chunk_size(a.f.chunk, [&](auto chunk_tag) {
      constexpr int kC = decltype(chunk_tag)::value;
      auto kernel = chunk_grad_scan16_kernel<kDecay, kRule, Elem, Dk, Dv, kBV, kC>;
      if constexpr (ScanTr::kBulk) {
        // Clusters of the head's column blocks share A, K_, W and Q^
        // (chunk_grad_scan16.cuh), tensor maps as the forward's.
        const unsigned cluster = scan_cluster_ctas(kernel, scan_grid, ScanTr::kThreads,
                                                   ScanTr::kBytes, kC, a.f.scan_cluster);
        const ScanTileMaps maps =
            shared_tile_maps<Dk, ScanTr::kLdK, ScanTr::kLdC>(a.f, kC, cluster);
        launch_kernel_cluster(kernel, scan_grid, ScanTr::kThreads, ScanTr::kBytes, cluster, stream,
                              "chunk_grad_scan16_kernel", a, maps);
      } else {
        launch_kernel(kernel, scan_grid, ScanTr::kThreads, ScanTr::kBytes, stream,
                      "chunk_grad_scan16_kernel", a, ScanTileMaps{});
      }
    });
  }
  if (state_grad_only) return;
  if constexpr (!std::is_same_v<Elem, float> && kDecay != Decay::vector) {
    // 16-bit inputs, scalar gates or none: one kernel forms every gradient
    // of a (chunk, head) item, the products with the states included (b17).
    // A scalar gate's dgamma sums S . dS over the fp32 values.
    SS_CHECK_ARG(kDecay != Decay::scalar || a.ws_ds_t == nullptr, "workspace",
                 "a scalar gate's backward needs dS in fp32");
    using InTr = IntraTraits<Elem, Dk, Dv>;
    BackwardArgs all = a;
    all.item_begin = 0;
    with_chunk_size(a.f.chunk, [&](auto chunk_tag) {
      constexpr int kC = decltype(chunk_tag)::value;
      launch_kernel(chunk_intra_grad_kernel<kDecay, kRule, Elem, Dk, Dv, kL2Norm, kC>,
                    dim3(static_cast<unsigned>(a.num_items)), InTr::kThreads, InTr::kBytes, stream,
                    "chunk_intra_grad_kernel", all);
    });
  } else if constexpr (!std::is_same_v<Elem, float>) {
    // Vector gates: the state products first, then the gradient kernel, one
    // batch of sp_batch items at a time (their fp32 outputs stay bounded
    // whatever T is).
    SS_CHECK_ARG(a.ws_sp != nullptr && a.sp_batch > 0, "workspace",
                 "has no room for the state products (backward_workspace_bytes)");
    using SpTr = StateProductTraits<Elem, Dk, Dv>;
    BackwardArgs batch = a;
    for (int64_t begin = 0; begin < a.num_items; begin += a.sp_batch) {
      batch.item_begin = begin;
      batch.num_items = std::min(a.num_items, begin + a.sp_batch);
      const int64_t items = batch.num_items - begin;
      const dim3 grid(static_cast<unsigned>(items));
      launch_kernel(chunk_state_products_kernel<kRule, Elem, Dk, Dv>, grid, SpTr::kThreads,
                    SpTr::kBytes, stream, "chunk_state_products_kernel", batch);
      with_chunk_size(batch.f.chunk, [&](auto chunk_tag) {
        constexpr int kC = decltype(chunk_tag)::value;
        using InTr = IntraVecTraits<Elem, Dk, Dv>;
        launch_kernel(chunk_intra_grad_vector_kernel<kRule, Elem, Dk, Dv, kL2Norm, kC>, grid,
                      InTr::kThreads, InTr::kBytes, stream, "chunk_intra_grad_vector_kernel",
                      batch);
      });
    }
  } else {
    // fp32 inputs: one persistent kernel in split tf32 (fp32 accuracy).
    using Tr = GradTraits<Dk, Dv>;
    launch_kernel(chunk_grad_kernel_tc<kDecay, kRule, Elem, Dk, Dv, kL2Norm>, dim3(grad_blocks),
                  Tr::kThreads, Tr::kSmemBytes, stream, "chunk_grad_kernel_tc", a);
  }
}

// Dispatch of one variant over dtype x head dim x l2norm; defined once per
// variant in chunk_backward_<variant>.cu so the instantiations compile in parallel.
template <Decay kDecay, Rule kRule>
void launch_chunk_backward(const BackwardArgs& a, DType dtype, int64_t head_dim, bool l2norm,
                           bool state_grad_only, int grad_blocks, cudaStream_t stream);

// One element type of a variant over head dim x l2norm.
template <Decay kDecay, Rule kRule, typename Elem>
void launch_chunk_backward_elem(const BackwardArgs& a, int64_t head_dim, bool l2norm,
                                bool state_grad_only, int grad_blocks, cudaStream_t stream) {
  SS_DISPATCH_BOOL(l2norm, kL2Norm, [&] {
    if (head_dim == 64) {
      launch_backward_kernels<kDecay, kRule, Elem, 64, 64, kL2Norm>(a, state_grad_only, grad_blocks,
                                                                    stream);
    } else if (head_dim == 128) {
      launch_backward_kernels<kDecay, kRule, Elem, 128, 128, kL2Norm>(a, state_grad_only,
                                                                      grad_blocks, stream);
    } else {
      SS_FAIL("dk", "CUDA backward supports Dk == Dv in {64, 128}, got ", head_dim);
    }
  });
}

template <Decay kDecay, Rule kRule>
void launch_chunk_backward_impl(const BackwardArgs& a, DType dtype, int64_t head_dim, bool l2norm,
                                bool state_grad_only, int grad_blocks, cudaStream_t stream) {
  switch (dtype) {
    case DType::f32:
      launch_chunk_backward_elem<kDecay, kRule, float>(a, head_dim, l2norm, state_grad_only,
                                                       grad_blocks, stream);
      break;
    case DType::bf16:
      launch_chunk_backward_elem<kDecay, kRule, __nv_bfloat16>(a, head_dim, l2norm, state_grad_only,
                                                               grad_blocks, stream);
      break;
    case DType::f16:
      launch_chunk_backward_elem<kDecay, kRule, __half>(a, head_dim, l2norm, state_grad_only,
                                                        grad_blocks, stream);
      break;
  }
}

#define SS_INSTANTIATE_CHUNK_BACKWARD(kDecay, kRule)                                              \
  template <>                                                                                     \
  void launch_chunk_backward<kDecay, kRule>(const BackwardArgs& a, DType dtype, int64_t head_dim, \
                                            bool l2norm, bool state_grad_only, int grad_blocks,   \
                                            cudaStream_t stream) {                                \
    launch_chunk_backward_impl<kDecay, kRule>(a, dtype, head_dim, l2norm, state_grad_only,        \
                                              grad_blocks, stream);                               \
  }

// The delta rules' fp32 kernels (split-tf32 products) take as long to compile
// as their two 16-bit types together (~33 of ~56 s for KDA on one core), so
// they are instantiated in a TU of their own (chunk_backward_<variant>_f32.cu)
// that the device's parallel build runs beside the variant's main TU: the
// library's longest compile drops from ~56 to ~33 s. The main TU declares them
// (EXTERN) so that it does not instantiate them again.
#define SS_CHUNK_BACKWARD_ELEM_SIGNATURE(kDecay, kRule, Elem)                                    \
  void launch_chunk_backward_elem<kDecay, kRule, Elem>(const BackwardArgs&, int64_t, bool, bool, \
                                                       int, cudaStream_t)
#define SS_EXTERN_CHUNK_BACKWARD_ELEM(kDecay, kRule, Elem) \
  extern template SS_CHUNK_BACKWARD_ELEM_SIGNATURE(kDecay, kRule, Elem);
#define SS_INSTANTIATE_CHUNK_BACKWARD_ELEM(kDecay, kRule, Elem) \
  template SS_CHUNK_BACKWARD_ELEM_SIGNATURE(kDecay, kRule, Elem);

}  // namespace statescan::cuda::detail
