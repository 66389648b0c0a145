// chunk_output_raw16_kernel: the output stage of linear attention (no gate,
// no L2 norm) for 16-bit inputs, read straight from q, k, v.
//
// Why: for that variant every prepared tile is a copy (Q^ = scale q,
// K_ = k, U = v) or a product the output kernel can form itself
// (A = scale mask(q k^T), 0.5 M MAC per chunk against 2 M for the rest), so
// the prepare kernel (0.44 ms of a 1.04 ms forward at 32K, H = 16, D = 128 on
// an H200) and its ~0.8 GB of workspace traffic go away: the scan reads k, v
// (chunk_state_scan16_kernel<..., kRaw>) and this kernel reads q, k, v and the
// chunk's entering state. The scale multiplies the fp32 result once,
//   o = scale (q S_c + mask(q k^T) v),
// so q and k enter the products exactly as given (the tile path rounds
// scale q to T first).
//   grid (num_chunks, H), 256 threads (warp w: row tile w % 4, Dv half w / 4),
//   shared memory OutputRaw16Traits::kBytes (D = 128, bf16: 96 KB, two blocks
//   per multiprocessor). Included by chunk_forward.cuh after the scan.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/warp_mma.cuh"

namespace statescan::cuda::detail {

template <typename T, int Dk, int Dv>
struct OutputRaw16Traits {
  static_assert(!std::is_same_v<T, float>, "16-bit inputs only");
  static constexpr int kMaxChunk = 64;
  static constexpr int kThreads = 256;
  // Row pitches of 8 (mod 64) elements: the eight rows of every ldmatrix
  // 8 x 8 load fall on distinct banks.
  static constexpr int kLdK = Dk + 8, kLdV = Dv + 8, kLdC = kMaxChunk + 8;
  static constexpr size_t kQBytes = align_smem(sizeof(T) * kMaxChunk * kLdK);  // q or k
  static constexpr size_t kSBytes = align_smem(sizeof(T) * Dk * kLdV);
  static constexpr size_t kVBytes = align_smem(sizeof(T) * kMaxChunk * kLdV);
  static constexpr size_t kABytes = align_smem(sizeof(T) * kMaxChunk * kLdC);
  static constexpr size_t kBytes = 2 * kQBytes + kSBytes + kVBytes + kABytes;
  static_assert(Dv % 32 == 0, "each warp takes a whole Dv half of 8-column tile pairs");
};

// A warp's 16 x 8 kNT accumulator slab (rows r0 + g, r0 + g + 8 of a chunk,
// columns n0 + 8 j + i2, + 1) times `scale`, to the chunk's rows t < length of
// head h in a [tokens, H, D] 16-bit tensor (row0 = token0 H + h).
template <typename T, int D, int kNT>
__device__ __forceinline__ void store_chunk_slab(void* out, int64_t row0, int64_t H, int r0, int n0,
                                                 int length, const float (&acc)[kNT][4],
                                                 float scale) {
  const int lane = threadIdx.x & 31, g = lane / 4, i2 = 2 * (lane % 4);
#pragma unroll
  for (int e = 0; e < 4; e += 2) {
    const int t = r0 + g + 4 * e;
    if (t < length) {
      T* row = static_cast<T*>(out) + (row0 + static_cast<int64_t>(t) * H) * D + n0 + i2;
#pragma unroll
      for (int j = 0; j < kNT; ++j)
        *reinterpret_cast<uint32_t*>(row + 8 * j) =
            pack2<T>(scale * acc[j][e], scale * acc[j][e + 1]);
    }
  }
}

// A = mask(q k^T) (s <= t) of a chunk, rounded to T into sA (pitch ldc):
// each 16-row tile I's kChunk columns as kAHalves slabs of kANT 8-column
// tiles, slab `half` for the calling warp (warps outside the grid of slabs
// return at once). q, k: [kChunk][Dk] 16-bit tiles, pitch ldk.
template <typename T, int Dk, int kChunk>
__device__ __forceinline__ void store_causal_scores(T* sA, int ldc, const T* q, const T* k, int ldk,
                                                    int I, int half) {
  constexpr int kRowTiles = kChunk / 16;
  constexpr int kANT = kChunk / 16 < 2 ? 2 : kChunk / 16;
  constexpr int kAHalves = (kChunk / 8) / kANT;
  if (I >= kRowTiles || half >= kAHalves) return;
  const int lane = threadIdx.x & 31, g = lane / 4, i2 = 2 * (lane % 4);
  const int r0 = 16 * I, n0 = 8 * kANT * half;
  float acc[kANT][4] = {};
  if (n0 <= r0 + 15)  // slabs right of the diagonal block stay zero
    warp_mm_16xn<T, false, false, kANT>(acc, q, ldk, k, ldk, r0, n0, Dk);
#pragma unroll
  for (int j = 0; j < kANT; ++j)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int t = r0 + g + 4 * e, s = n0 + 8 * j + i2;
      *reinterpret_cast<uint32_t*>(sA + t * ldc + s) =
          pack2<T>(s <= t ? acc[j][e] : 0.f, s + 1 <= t ? acc[j][e + 1] : 0.f);
    }
}

template <typename T, int Dk, int Dv, int kChunk>
__global__ void __launch_bounds__(256)
    chunk_output_raw16_kernel(const __grid_constant__ ForwardArgs a) {
  using Tr = OutputRaw16Traits<T, Dk, Dv>;
  constexpr int kLdK = Tr::kLdK, kLdV = Tr::kLdV, kLdC = Tr::kLdC, kThreads = Tr::kThreads;
  static_assert(kChunk == 16 || kChunk == 32 || kChunk == 64, "chunk in {16, 32, 64}");
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  T* sQ = reinterpret_cast<T*>(smem_bytes);
  T* sK = reinterpret_cast<T*>(smem_bytes + Tr::kQBytes);
  T* sS = reinterpret_cast<T*>(smem_bytes + 2 * Tr::kQBytes);
  T* sV = reinterpret_cast<T*>(smem_bytes + 2 * Tr::kQBytes + Tr::kSBytes);
  T* sA = reinterpret_cast<T*>(smem_bytes + 2 * Tr::kQBytes + Tr::kSBytes + Tr::kVBytes);

  const int64_t c = blockIdx.x, h = blockIdx.y, H = a.heads;
  const int tid = threadIdx.x, warp = tid / 32;
  int64_t token0;
  int length;
  chunk_geometry(a, c, token0, length);
  const int64_t row0 = token0 * H + h;
  copy_chunk_rows_async<kThreads, kChunk, Dk, Dk, T>(sQ, kLdK, a.q, token0, H, h, 0, tid, length);
  copy_chunk_rows_async<kThreads, kChunk, Dk, Dk, T>(sK, kLdK, a.k, token0, H, h, 0, tid, length);
  copy_chunk_rows_async<kThreads, kChunk, Dv, Dv, T>(sV, kLdV, a.v, token0, H, h, 0, tid, length);
  copy_rows_async<kThreads, Dk, Dv>(
      sS, kLdV, static_cast<const T*>(a.ws_states) + (c * H + h) * static_cast<int64_t>(Dk) * Dv,
      Dv, tid);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  constexpr int kRowTiles = kChunk / 16;
  const int I = warp % 4, half = warp / 4;
  const int r0 = 16 * I;

  store_causal_scores<T, Dk, kChunk>(sA, kLdC, sQ, sK, kLdK, I, half);
  __syncthreads();

  // O (rows r0.., columns n0 .. n0 + Dv / 2) = scale (q S_c + A v); A is
  // zero right of the diagonal block, so its product stops at row tile I.
  constexpr int kNT = Dv / 16;
  if (I < kRowTiles) {
    const int n0 = half * (Dv / 2);
    float acc[kNT][4] = {};
    warp_mm_16xn<T, false, true, kNT>(acc, sQ, kLdK, sS, kLdV, r0, n0, Dk);
    warp_mm_16xn<T, false, true, kNT>(acc, sA, kLdC, sV, kLdV, r0, n0, r0 + 16);
    store_chunk_slab<T, Dv>(a.o, row0, H, r0, n0, length, acc, a.scale);
  }
}

}  // namespace statescan::cuda::detail
