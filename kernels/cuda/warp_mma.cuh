// Warp-level 16-bit tensor-core products from shared memory: ldmatrix
// fragment loads and mma.sync m16n8k16 with fp32 accumulation, for bf16 and
// f16 operands. wmma hides the fragment layout, so it cannot load a
// transposed operand from a row-major tile or keep accumulators across
// products without a round trip through memory; these helpers do both, which
// is what chunk_state_products_kernel (and any kernel that keeps its
// accumulators in registers) needs.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16/.f16): lane = 4 g + i
// (g = groupID 0..7, i = thread in group 0..3) holds accumulator elements
//   c[0], c[1] at (row g,     columns 2i, 2i + 1) and
//   c[2], c[3] at (row g + 8, columns 2i, 2i + 1)
// of its 16 x 8 tile.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace statescan::cuda::detail {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 matrices of 16-bit elements from a shared-window address
// (shared_address()); lane l gives the address of row (l % 8) of matrix l / 8.
// kTrans transposes each matrix on the way. Loops that step one base address
// by constants call this directly instead of converting a pointer per load.
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4_at(uint32_t (&r)[4], uint32_t addr) {
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
}

// The same from a generic pointer into shared memory.
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  ldmatrix_x4_at<kTrans>(r, shared_address(row));
}

// Two transposed 8 x 8 matrices: lanes 0-7 give the rows of the first,
// lanes 8-15 of the second (the other lanes' addresses are not read).
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared_address(row)));
}

// c += a b for one 16 x 8 x 16 step (a: 16 x 16 row fragment, b: 16 x 8 column fragment).
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>,
                "mma_m16n8k16 takes bf16 or f16 operands");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// c += a b for one 16 x 8 x 8 step in ~fp32 precision on the tf32 tensor
// cores: each fp32 operand x is split into tf32 parts hi + lo (hi = x to 10
// mantissa bits, lo = tf32(x - hi)) and three products are summed, small
// terms first (a_lo b_hi + a_hi b_lo + a_hi b_hi; the a_lo b_lo term is below
// fp32's rounding). Fragments (PTX ISA, mma.m16n8k8 .tf32), lane = 4 g + i:
//   a[0] (row g, col i), a[1] (row g + 8, col i), a[2] (row g, col i + 4),
//   a[3] (row g + 8, col i + 4); b[0] (row i, col g), b[1] (row i + 4, col g);
// c as in mma_m16n8k16.
__device__ __forceinline__ void mma_m16n8k8_tf32x3(float (&c)[4], const float (&a)[4],
                                                   const float (&b)[2]) {
  auto split = [](float x, uint32_t& hi, uint32_t& lo) {
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(x));
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
  };
  uint32_t ah[4], al[4], bh[2], bl[2];
#pragma unroll
  for (int r = 0; r < 4; ++r) split(a[r], ah[r], al[r]);
  split(b[0], bh[0], bl[0]);
  split(b[1], bh[1], bl[1]);
  auto mma = [&](const uint32_t(&x)[4], const uint32_t(&y)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]), "r"(y[0]), "r"(y[1]));
  };
  mma(al, bh);
  mma(ah, bl);
  mma(ah, bh);
}

// Two floats as one 32-bit pair of T (element 0 in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&x));
  }
}

// x = hi + lo for two adjacent fp32 values as bf16 pairs (hi = bf16_rn(x), lo =
// bf16_rn(x - hi); the subtraction is exact), each pair packed as pack2 does:
// the two-part operands of LaCT's Newton-Schulz products.
__device__ __forceinline__ void split_bf16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack2<__nv_bfloat16>(x0, x1);
  const float2 h = unpack2<__nv_bfloat16>(hi);
  lo = pack2<__nv_bfloat16>(x0 - h.x, x1 - h.y);
}

// acc's kNT tiles += the A fragment `a` (16 x 16, k0 .. k0+16) times Y's
// rows k0 .. k0+16, columns n0 .. n0+8 kNT (the layouts of warp_mm_16xn).
template <typename T, bool kYKN, int kNT>
__device__ __forceinline__ void warp_mm_b_tiles(float (&acc)[kNT][4], const uint32_t (&a)[4],
                                                const T* y, int ldy, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  const int r8 = lane & 7, m1 = (lane >> 3) & 1, m2 = lane >> 4;
#pragma unroll
  for (int p = 0; p < kNT / 2; ++p) {
    const int nb = n0 + 16 * p;
    uint32_t b[4];
    // b[0], b[1] = tile nb (k 0-7, k 8-15); b[2], b[3] = tile nb + 8
    if constexpr (!kYKN)
      ldmatrix_x4<false>(b, y + (nb + r8 + 8 * m2) * ldy + k0 + 8 * m1);
    else
      ldmatrix_x4<true>(b, y + (k0 + r8 + 8 * m1) * ldy + nb + 8 * m2);
    mma_m16n8k16<T>(acc[2 * p], a, b[0], b[1]);
    mma_m16n8k16<T>(acc[2 * p + 1], a, b[2], b[3]);
  }
}

// One warp: acc (a 16 x 8*kNT slab: kNT 16 x 8 tiles, kNT even) +=
// X[m0 .. m0+16, 0 .. K) * Y[0 .. K, n0 .. n0+8*kNT), operands 16-bit in
// shared memory, K a multiple of 16.
//   kXKM = false: X stored row-major as [M][K] (x[m * ldx + k]);
//          true:  X stored as [K][M] (x[k * ldx + m]: X^T of a row-major array).
//   kYKN = false: Y stored as [N][K] (y[n * ldy + k]: Y^T of a row-major array);
//          true:  Y stored row-major as [K][N] (y[k * ldy + n]).
// Row addresses must be 16-byte aligned (ld a multiple of 8 elements); an ld of
// 8 (mod 64) elements keeps the eight rows of each 8 x 8 load on distinct banks.
template <typename T, bool kXKM, bool kYKN, int kNT>
__device__ __forceinline__ void warp_mm_16xn(float (&acc)[kNT][4], const T* x, int ldx, const T* y,
                                             int ldy, int m0, int n0, int K) {
  static_assert(kNT % 2 == 0, "n8 tiles come in pairs (one x4 load)");
  const int lane = threadIdx.x & 31;
  const int r8 = lane & 7, m1 = (lane >> 3) & 1, m2 = lane >> 4;
#pragma unroll 4
  for (int k0 = 0; k0 < K; k0 += 16) {
    uint32_t a[4];
    // a[0..3] = (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
    if constexpr (!kXKM)
      ldmatrix_x4<false>(a, x + (m0 + r8 + 8 * m1) * ldx + k0 + 8 * m2);
    else
      ldmatrix_x4<true>(a, x + (k0 + r8 + 8 * m2) * ldx + m0 + 8 * m1);
    warp_mm_b_tiles<T, kYKN, kNT>(acc, a, y, ldy, n0, k0);
  }
}

// acc (one 16 x 8 tile) += X[m0 .. m0+16, 0 .. K) Y[0 .. K, n0 .. n0+8), Y
// row-major [K][N] and X stored as warp_mm_16xn's kXKM says, 16-bit in shared
// memory, K a multiple of 16: one transposed x4 load gives Y's fragments for
// two k steps (warp_mm_16xn takes column tiles in pairs), an x2 load the last
// step of an odd count. Two accumulators halve the chain of dependent mma
// steps; acc returns their sum.
template <typename T, bool kXKM>
__device__ __forceinline__ void warp_mm_16x8(float (&acc)[4], const T* x, int ldx, const T* y,
                                             int ldy, int m0, int n0, int K) {
  const int lane = threadIdx.x & 31;
  const int r8 = lane & 7, m1 = (lane >> 3) & 1, m2 = lane >> 4;
  auto load_a = [&](uint32_t(&a)[4], int k0) {
    if constexpr (!kXKM)
      ldmatrix_x4<false>(a, x + (m0 + r8 + 8 * m1) * ldx + k0 + 8 * m2);
    else
      ldmatrix_x4<true>(a, x + (k0 + r8 + 8 * m2) * ldx + m0 + 8 * m1);
  };
  float acc1[4] = {0.f, 0.f, 0.f, 0.f};
  int k0 = 0;
#pragma unroll 4
  for (; k0 + 32 <= K; k0 += 32) {
    uint32_t a0[4], a1[4], b[4];
    load_a(a0, k0);
    load_a(a1, k0 + 16);
    // matrices: Y rows k0 + 8 q .. k0 + 8 q + 8 for q = lane / 8
    ldmatrix_x4<true>(b, y + (k0 + r8 + 8 * (lane >> 3)) * ldy + n0);
    mma_m16n8k16<T>(acc, a0, b[0], b[1]);
    mma_m16n8k16<T>(acc1, a1, b[2], b[3]);
  }
  if (k0 < K) {
    uint32_t a0[4], b[2];
    load_a(a0, k0);
    ldmatrix_x2_trans(b, y + (k0 + r8 + 8 * m1) * ldy + n0);
    mma_m16n8k16<T>(acc, a0, b[0], b[1]);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] += acc1[e];
}

// As warp_mm_16xn with X row-major ([M][K]), X's column k multiplied by
// xscale(k) on the way in (fp32, rounded back to T): a per-dimension factor
// inside the contraction (the vector-gate kernels' products between two
// reference rows). With kSplitX, X is given as two 16-bit parts x + x_lo
// (~16 bits) and the scaled value enters as two operands again (hi + the
// rest: two products), so X keeps ~16 bits through the scaling instead of
// two roundings to 16-bit.
template <typename T, bool kYKN, int kNT, bool kSplitX = false, typename Scale>
__device__ __forceinline__ void warp_mm_16xn_xscaled(float (&acc)[kNT][4], const T* x, int ldx,
                                                     const T* y, int ldy, int m0, int n0, int K,
                                                     Scale&& xscale, const T* x_lo = nullptr) {
  static_assert(kNT % 2 == 0, "n8 tiles come in pairs (one x4 load)");
  const int lane = threadIdx.x & 31;
  const int r8 = lane & 7, m1 = (lane >> 3) & 1, m2 = lane >> 4, i2 = 2 * (lane & 3);
  for (int k0 = 0; k0 < K; k0 += 16) {
    uint32_t a[4], a_lo[4];
    const int offset = (m0 + r8 + 8 * m1) * ldx + k0 + 8 * m2;
    ldmatrix_x4<false>(a, x + offset);
    if constexpr (kSplitX) ldmatrix_x4<false>(a_lo, x_lo + offset);
    // a[0], a[1] hold columns k0 + i2, + 1; a[2], a[3] columns k0 + 8 + i2, + 1.
    const float s0 = xscale(k0 + i2), s1 = xscale(k0 + i2 + 1);
    const float s2 = xscale(k0 + 8 + i2), s3 = xscale(k0 + 9 + i2);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      float2 v = unpack2<T>(a[r]);
      if constexpr (kSplitX) {
        const float2 w = unpack2<T>(a_lo[r]);
        v.x += w.x;
        v.y += w.y;
      }
      v = r < 2 ? make_float2(v.x * s0, v.y * s1) : make_float2(v.x * s2, v.y * s3);
      a[r] = pack2<T>(v.x, v.y);
      if constexpr (kSplitX) {
        const float2 h = unpack2<T>(a[r]);
        a_lo[r] = pack2<T>(v.x - h.x, v.y - h.y);
      }
    }
    warp_mm_b_tiles<T, kYKN, kNT>(acc, a, y, ldy, n0, k0);
    if constexpr (kSplitX) warp_mm_b_tiles<T, kYKN, kNT>(acc, a_lo, y, ldy, n0, k0);
  }
}

// The 16 x 32 slab (four tiles) chunk_state_products_kernel takes.
template <typename T, bool kXKM, bool kYKN>
__device__ __forceinline__ void warp_mm_16x32(float (&acc)[4][4], const T* x, int ldx, const T* y,
                                              int ldy, int m0, int n0, int K) {
  warp_mm_16xn<T, kXKM, kYKN, 4>(acc, x, ldx, y, ldy, m0, n0, K);
}

}  // namespace statescan::cuda::detail
