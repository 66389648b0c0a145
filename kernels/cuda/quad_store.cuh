// Row stores of 16-bit accumulator tiles from the tensor-core fragment layout
// that mma.sync m16n8 and wgmma m64nN share: lane 4 g + q holds, of each
// 8-column block c8, the pair at (row g, columns 8 c8 + 2 q, + 1) (and of
// row g + 8, which the caller passes as a second row). Straight from that
// layout each store instruction writes 4 bytes into each of 8 rows, half a
// 32-byte sector each; the helpers here exchange words within the quad first
// so that each lane stores 8 (store_quad_row) or 16 bytes (store_quad_row16)
// and the quad whole sectors. Used by the fused LaCT kernels (lact_hidden.cu),
// the chunkwise backward's dq, dk, dv (chunk_intra_grad.cuh) and the forward's
// W, U and A tiles (chunk_prepare16.cuh).
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

// store_quad_row in 16-byte pieces (the LaCT gradient rows' kernel up to
// D 128, STATESCAN_LACT_ROW_STORE): for each 4 blocks g, a 4 x 4 transpose of
// words across the quad in two exchanges (lanes q ^ 1, then q ^ 2) leaves
// lane q columns 32 g + 8 q .. + 7, so that each instruction writes 64
// contiguous bytes of each of its 8 rows instead of 32: half the store
// instructions and of the cache lines they touch, for twice the shuffles and
// ~3 times the selects. Why try it: with its stores removed that kernel runs
// 55 us instead of 86, and stores half as wide (4 bytes a lane) cost 12 us
// more (PERF_NOTES, fiftieth session). Measured (H100, fifty-first session,
// the kernel alone, 4,096 tokens, H 4, M 512): slower at D 256 (90.5 against
// 87.2 us), faster at D 128 (59.7 against 63.2). `row` is 16-byte aligned.
template <int N, typename T>
__device__ __forceinline__ void store_quad_row16(T* row, const uint32_t (&w)[N], int q,
                                                 bool store) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  static_assert(N % 4 == 0, "groups of four 8-column blocks");
  const bool odd = q & 1, high = q & 2;
#pragma unroll
  for (int g = 0; g < N / 4; ++g) {
    const uint32_t* x = w + 4 * g;
    // Exchange 1: the even lane keeps blocks 0 and 2, the odd lane 1 and 3, each
    // as the pair (lane 2 (q / 2)'s word, lane 2 (q / 2) + 1's).
    const uint32_t r0 = __shfl_xor_sync(0xffffffffu, odd ? x[0] : x[1], 1);
    const uint32_t r1 = __shfl_xor_sync(0xffffffffu, odd ? x[2] : x[3], 1);
    const uint32_t o0 = odd ? x[1] : x[0], o1 = odd ? x[3] : x[2];
    const uint32_t a0 = odd ? r0 : o0, a1 = odd ? o0 : r0;  // block q % 2
    const uint32_t b0 = odd ? r1 : o1, b1 = odd ? o1 : r1;  // block q % 2 + 2
    // Exchange 2: lanes 0, 1 keep their first block and take the pair of lanes 2,
    // 3; lanes 2, 3 keep their second and take the pair of lanes 0, 1.
    const uint32_t s0 = __shfl_xor_sync(0xffffffffu, high ? a0 : b0, 2);
    const uint32_t s1 = __shfl_xor_sync(0xffffffffu, high ? a1 : b1, 2);
    const uint32_t k0 = high ? b0 : a0, k1 = high ? b1 : a1;
    const uint4 v = high ? make_uint4(s0, s1, k0, k1) : make_uint4(k0, k1, s0, s1);
    if (store) store_vector(reinterpret_cast<uint4*>(row + 32 * g + 8 * q), v);
  }
}

}  // namespace statescan::cuda::detail
