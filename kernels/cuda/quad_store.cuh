// Row stores of 16-bit accumulator tiles from the tensor-core fragment layout
// that mma.sync m16n8 and wgmma m64nN share: lane 4 g + q holds, of each
// 8-column block c8, the pair at (row g, columns 8 c8 + 2 q, + 1) (and of
// row g + 8, which the caller passes as a second row). Straight from that
// layout each store instruction writes 4 bytes into each of 8 rows, half a
// 32-byte sector each; the helpers here exchange words within the quad first
// so that each lane stores 8 (store_quad_row) or 16 bytes (store_quad_row16)
// and the quad whole sectors. Used by the fused LaCT kernels (lact_hidden.cu)
// and the chunkwise backward's dq, dk, dv (chunk_intra_grad.cuh).
#pragma once

#include <cstdint>

namespace statescan::cuda::detail {

// One 8- or 16-byte piece of a row, as one vector store instruction. Why asm:
// from `*reinterpret_cast<uint2*>(p) = make_uint2(a, b)` after the quad's
// selects, NVVM emitted half of the LaCT key side's pieces (and of the
// gradient rows') as two 4-byte stores, so each such instruction half-filled
// the 8 sectors it touched (ncu: 21.3 bytes a sector, 1.5 times the requests
// expected). With vector pieces the LaCT forward at its issue's shape ran
// 27.09 ms against 27.94 (H100, fifty-first session, three rounds in each of
// two calls).
__device__ __forceinline__ void store_vector(uint2* at, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(at), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void store_vector(uint4* at, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(at), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

template <bool kVector>
__device__ __forceinline__ void store_row_piece(uint2* at, uint2 v) {
  if constexpr (kVector)
    store_vector(at, v);
  else
    *at = v;
}

// Stores the N x 8 16-bit columns of one row that a quad holds (w[c8]: this
// lane's pair of block c8) in 8-byte pieces that the quad writes as 32
// contiguous bytes (whole sectors): one exchange between lanes q and q ^ 1
// leaves the even lane of a pair columns 8 c8 .. + 3 of the even c8 and the
// odd lane those of the odd c8 (lanes 2, 3: + 4). Every lane of the warp
// must call it (the exchange); `store` says whether this lane's row is
// written. `row` is 8-byte aligned. Why not straight from the layout: the
// LaCT key side with its low terms (six arrays) took 151 us a chunk against
// 63 without them (ncu, H200). Why not 16-byte pieces everywhere: a second
// exchange costs more instructions than the stores it saves where the
// epilogue's issue slots bound the kernel. kVector: each piece one vector
// store (store_vector); else as the compiler makes it (the LaCT gradient
// rows', lact_hidden.cu says why).
template <int N, bool kVector = true, typename T>
__device__ __forceinline__ void store_quad_row(T* row, const uint32_t (&w)[N], int q, bool store) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  static_assert(N % 2 == 0, "pairs of 8-column blocks");
  const bool odd = q & 1;
#pragma unroll
  for (int m = 0; m < N / 2; ++m) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? w[2 * m] : w[2 * m + 1], 1);
    const uint32_t a = odd ? got : w[2 * m], b = odd ? w[2 * m + 1] : got;
    if (store)
      store_row_piece<kVector>(reinterpret_cast<uint2*>(row + 8 * (2 * m + (q & 1)) + 4 * (q >> 1)),
                               make_uint2(a, b));
  }
}

}  // namespace statescan::cuda::detail
