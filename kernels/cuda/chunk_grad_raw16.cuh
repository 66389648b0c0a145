// chunk_grad_raw16_kernel: the per-chunk gradients of linear attention (no
// gate, no L2 norm) for 16-bit inputs, read straight from q, k, v, dO, the
// forward's fp32 chunk states and the reverse scan's dS (rounded to T).
//
// Why: for this variant every prepared tile is a copy of an input (or scale
// times one), and the general 16-bit path (prepare stage, state products in
// fp32 through global memory, intra-chunk kernel) spent ~3.2 ms of a 3.9 ms
// forward + backward at T = 32K, H = 16, D = 128 on an H200. Here one block
// forms every term of a chunk's gradients on the tensor cores from its
// operands in shared memory. With o = scale (q S_c + mask(q k^T) v),
// S_{c+1} = S_c + k^T v and dS = dS_{c+1}:
//   A  = scale mask(q k^T),  dA = scale mask(dO v^T)      (s <= t, rounded to T)
//   dq = scale dO S_c^T + dA k
//   dk = dA^T q + v dS^T
//   dv = A^T dO + k dS
// S_c and dS enter the products rounded to T, as in the forward's output
// kernel and the general path's chunk_state_products_kernel. A and dA are zero
// right of the diagonal block, so each product over chunk rows stops (dq) or
// starts (dk, dv) at the row tile's diagonal.
// Each warp forms its own 16-row slabs of dA, dA^T and A^T in registers (as
// mma operands, FlashAttention-style) rather than sharing them through shared
// memory: a little more arithmetic for room for two blocks per multiprocessor,
// and S_c and dS take turns in one buffer (dS loads while the slabs of dA^T
// and A^T are formed).
//   grid (num_chunks, H), 256 threads (warp w: row tile w % 4, column half
//   w / 4 of each of dq, dk, dv), shared memory GradRaw16Traits::kBytes
//   (D = 128, bf16: 102 KB, two blocks per multiprocessor).
// Included by chunk_backward.cuh after BackwardArgs.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/warp_mma.cuh"

namespace statescan::cuda::detail {

template <typename T, int Dk, int Dv>
struct GradRaw16Traits {
  static_assert(!std::is_same_v<T, float>, "16-bit inputs only");
  static_assert(Dk == Dv, "dq and dk share the column split of dv");
  static constexpr int kMaxChunk = 64;
  static constexpr int kThreads = 256;
  // Row pitches of 8 (mod 64) elements: the eight rows of every ldmatrix
  // 8 x 8 load fall on distinct banks.
  static constexpr int kLdK = Dk + 8, kLdV = Dv + 8;
  static constexpr size_t kKBytes = align_smem(sizeof(T) * kMaxChunk * kLdK);  // q, k
  static constexpr size_t kVBytes = align_smem(sizeof(T) * kMaxChunk * kLdV);  // v, dO
  static constexpr size_t kSBytes = align_smem(sizeof(T) * Dk * kLdV);         // S_c, then dS
  static constexpr size_t kOffK = kKBytes, kOffV = 2 * kKBytes, kOffO = kOffV + kVBytes;
  static constexpr size_t kOffS = kOffO + kVBytes;
  static constexpr size_t kBytes = kOffS + kSBytes;
  // Two blocks per multiprocessor (D = 128, bf16: 102 KB each): one block's
  // loads overlap the other's products.
  static_assert(2 * (kBytes + 1024) <= 228 * 1024, "chunk_grad_raw16_kernel: two blocks per SM");
};

// One warp's 16-row slab of a chunk-by-chunk matrix as mma.sync A operands:
//   P[t][s] = scale (X_t . Y_s) where keep(t, s) (rows t = r0 + .., columns s
// of the chunk), zero elsewhere, rounded to T; pair p holds columns
// 16 p .. 16 p + 16, the k-step p of a product over the chunk. Only pairs in
// [p_begin, p_end) are formed (the rest are never read). X, Y stored [chunk][K].
template <typename T, int kPairs, typename Keep>
__device__ __forceinline__ void chunk_slab_operands(uint32_t (&frag)[kPairs][4], const T* x,
                                                    const T* y, int ld, int K, int r0, int p_begin,
                                                    int p_end, float scale, Keep&& keep) {
  const int lane = threadIdx.x & 31, g = lane / 4, i2 = 2 * (lane % 4);
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    if (p < p_begin || p >= p_end) continue;
    float acc[2][4] = {};
    warp_mm_16xn<T, false, false, 2>(acc, x, ld, y, ld, r0, 16 * p, K);
    // Accumulator tile j, elements (e, e + 1) are (row r0 + g + 8 (e / 2),
    // columns 16 p + 8 j + i2, + 1); operand register 2 j + e / 2 holds them.
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int t = r0 + g + 4 * e, s = 16 * p + 8 * j + i2;
        frag[p][2 * j + e / 2] = pack2<T>(keep(t, s) ? scale * acc[j][e] : 0.f,
                                          keep(t, s + 1) ? scale * acc[j][e + 1] : 0.f);
      }
  }
}

// acc += P Y over the k-steps p in [p_begin, p_end) of register operands P
// (chunk_slab_operands), Y's rows 16 p .. stored as warp_mm_16xn's kYKN says.
template <typename T, bool kYKN, int kNT, int kPairs>
__device__ __forceinline__ void warp_mm_operands(float (&acc)[kNT][4],
                                                 const uint32_t (&frag)[kPairs][4], const T* y,
                                                 int ldy, int n0, int p_begin, int p_end) {
#pragma unroll
  for (int p = 0; p < kPairs; ++p)
    if (p >= p_begin && p < p_end) warp_mm_b_tiles<T, kYKN, kNT>(acc, frag[p], y, ldy, n0, 16 * p);
}

template <typename T, int Dk, int Dv, int kChunk>
__global__ void __launch_bounds__(256, 2)
    chunk_grad_raw16_kernel(const __grid_constant__ BackwardArgs a) {
  using Tr = GradRaw16Traits<T, Dk, Dv>;
  constexpr int kLdK = Tr::kLdK, kLdV = Tr::kLdV, kThreads = Tr::kThreads;
  static_assert(kChunk == 16 || kChunk == 32 || kChunk == 64, "chunk in {16, 32, 64}");
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  T* sQ = reinterpret_cast<T*>(smem_bytes);
  T* sK = reinterpret_cast<T*>(smem_bytes + Tr::kOffK);
  T* sV = reinterpret_cast<T*>(smem_bytes + Tr::kOffV);
  T* sO = reinterpret_cast<T*>(smem_bytes + Tr::kOffO);
  T* sS = reinterpret_cast<T*>(smem_bytes + Tr::kOffS);  // S_c, then dS

  const ForwardArgs& f = a.f;
  const int64_t c = blockIdx.x, h = blockIdx.y, H = f.heads;
  const int tid = threadIdx.x, warp = tid / 32;
  int64_t token0;
  int length;
  chunk_geometry(f, c, token0, length);
  const int64_t row0 = token0 * H + h;
  constexpr int64_t kStateElems = static_cast<int64_t>(Dk) * Dv;
  const int64_t state_off = (c * H + h) * kStateElems;

  copy_chunk_rows_async<kThreads, kChunk, Dk, Dk, T>(sQ, kLdK, f.q, token0, H, h, 0, tid, length);
  copy_chunk_rows_async<kThreads, kChunk, Dk, Dk, T>(sK, kLdK, f.k, token0, H, h, 0, tid, length);
  copy_chunk_rows_async<kThreads, kChunk, Dv, Dv, T>(sV, kLdV, f.v, token0, H, h, 0, tid, length);
  copy_chunk_rows_async<kThreads, kChunk, Dv, Dv, T>(sO, kLdV, a.d_o, token0, H, h, 0, tid, length);
  cp_async_commit();
  // S_c is the forward's fp32 chunk state: rounded to T on the way in, while
  // the copies above are in flight.
  {
    const float* src = a.chunk_states + state_off;
    constexpr int kPerRow = Dv / 4, kIters = Dk * kPerRow / kThreads;
    static_assert(Dk * kPerRow % kThreads == 0, "whole float4 rows per thread");
#pragma unroll 4
    for (int it = 0; it < kIters; ++it) {
      const int idx = tid + it * kThreads;
      const int i = idx / kPerRow, j = 4 * (idx % kPerRow);
      const float4 x = *reinterpret_cast<const float4*>(src + i * Dv + j);
      *reinterpret_cast<uint2*>(sS + i * kLdV + j) =
          make_uint2(pack2<T>(x.x, x.y), pack2<T>(x.z, x.w));
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Warp w: row tile I = w % 4 of the chunk, columns n0 .. n0 + D / 2 of each
  // gradient (warps whose row tile lies past a short chunk only copy).
  constexpr int kPairs = kChunk / 16, kNT = Dv / 16;
  const int I = warp % 4, n0 = (warp / 4) * (Dv / 2), r0 = 16 * I;
  const bool active = I < kPairs;
  const float scale = f.scale;
  auto causal = [](int t, int s) { return s <= t; };      // P[t][s], s <= t
  auto anticausal = [](int s, int t) { return t >= s; };  // P^T[s][t], t >= s
  auto store = [&](void* out, const float(&acc)[kNT][4]) {
    store_chunk_slab<T, Dv>(out, row0, H, r0, n0, length, acc, 1.f);
  };

  if (active) {
    // dq = scale dO S_c^T + dA k, dA = scale mask(dO v^T) (columns s <= t:
    // k-steps 0 .. I). S stored [d][v]: Y as [N][K].
    uint32_t dA[kPairs][4];
    chunk_slab_operands<T, kPairs>(dA, sO, sV, kLdV, Dv, r0, 0, I + 1, scale, causal);
    float acc[kNT][4] = {};
    warp_mm_16xn<T, false, false, kNT>(acc, sO, kLdV, sS, kLdV, r0, n0, Dv);
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] *= scale;
    warp_mm_operands<T, true, kNT, kPairs>(acc, dA, sK, kLdK, n0, 0, I + 1);
    store(a.dq, acc);
  }
  __syncthreads();  // every read of S_c done: its room takes dS
  copy_rows_async<kThreads, Dk, Dv>(sS, kLdV, static_cast<const T*>(a.ws_ds_t) + state_off, Dv,
                                    tid);
  cp_async_commit();
  // While dS loads: this warp's rows s of dA^T = scale mask(v dO^T) and
  // A^T = scale mask(k q^T) (columns t >= s: k-steps I .. kPairs).
  uint32_t dAT[kPairs][4], AT[kPairs][4];
  if (active) {
    chunk_slab_operands<T, kPairs>(dAT, sV, sO, kLdV, Dv, r0, I, kPairs, scale, anticausal);
    chunk_slab_operands<T, kPairs>(AT, sK, sQ, kLdK, Dk, r0, I, kPairs, scale, anticausal);
  }
  cp_async_wait<0>();
  __syncthreads();
  if (!active) return;
  {
    // dk = dA^T q + v dS^T (dS stored [d][v]: Y as [N][K]).
    float acc[kNT][4] = {};
    warp_mm_operands<T, true, kNT, kPairs>(acc, dAT, sQ, kLdK, n0, I, kPairs);
    warp_mm_16xn<T, false, false, kNT>(acc, sV, kLdV, sS, kLdV, r0, n0, Dv);
    store(a.dk, acc);
  }
  {
    // dv = A^T dO + k dS.
    float acc[kNT][4] = {};
    warp_mm_operands<T, true, kNT, kPairs>(acc, AT, sO, kLdV, n0, I, kPairs);
    warp_mm_16xn<T, false, true, kNT>(acc, sK, kLdK, sS, kLdV, r0, n0, Dk);
    store(a.dv, acc);
  }
}

}  // namespace statescan::cuda::detail
