// Hopper warpgroup MMA (wgmma) with A from registers or shared memory and B
// from shared memory, and the pieces around it: the descriptor for the 128-byte-swizzled
// layout TMA writes, the fences, and stmatrix (transposed) for staging an
// accumulator through shared memory. sm_90a only: the host picks these
// kernels only in a build for 90a (STATESCAN_CUDA_SM90A) on a device of
// compute capability 9.0, and anything else traps rather than computing
// garbage. (The no-swizzle core-matrix layout and the MMAs with A from shared
// memory went with the untransposed per-head scan, their only user:
// PERF_NOTES, twenty-seventh session.)
#pragma once

#include <cstdint>

namespace statescan::cuda::detail {

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SS_WGMMA_UNAVAILABLE 1
#endif

// A descriptor for the 128-byte-swizzled layout TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B: rows of 64 16-bit elements (128 bytes), the
// 16-byte pieces of row r at piece index ^ (r % 8), 8-row atoms of 1024
// bytes (1024-byte aligned) `sbo` bytes apart. K-major (rows = M or N): the
// k16 slice kk of a 64-wide atom starts 32 kk bytes in; MN-major (rows = K,
// the 64 columns M): the atoms run along K, a k16 step is two of them. LBO
// is unused for either with one atom across (encoded 1, as CUTLASS does).
__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void* smem, uint32_t sbo_bytes) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (static_cast<uint64_t>(sbo_bytes >> 4) << 32) | (uint64_t{1} << 62);
}

// The same layout MN-major with more than one 64-column atom across MN: the
// atoms along MN `lbo_bytes` apart (a TMA box of 64 columns each), along K
// `sbo_bytes` apart (1024: consecutive 8-row atoms of one box).
__device__ __forceinline__ uint64_t wgmma_desc_sw128_mn(const void* smem, uint32_t lbo_bytes,
                                                        uint32_t sbo_bytes) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>(sbo_bytes >> 4) << 32) | (uint64_t{1} << 62);
}

// A descriptor `bytes` further into shared memory: the start address is the
// low 14 bits (address >> 4) and shared memory (< 256 KB) keeps the sum
// inside them, so the other fields stay as they are. One add instead of
// rebuilding the descriptor from a pointer (conversion, mask, shift and or:
// ~8 instructions before each wgmma of an unrolled loop).
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) {
  return (desc & 0xFFFFFFFF00000000ull) | (static_cast<uint32_t>(desc) + (bytes >> 4));
}

// Whether warpgroup budgets fit the registers a one-CTA-an-SM launch of
// `threads` holds: the launch gives every thread (65536 / threads) rounded
// down to the allocation unit of 8, and setmaxnreg only moves registers
// within that pool. A setmaxnreg.inc past it waits for registers that never
// come (the CTA hangs), so this, not the register file's 65536, is the bound:
// 640 threads hold 640 x 96 = 61440, not 65536.
constexpr int launch_regs_per_thread(int threads) {
  const int regs = (65536 / threads) / 8 * 8;
  return regs > 256 ? 256 : regs;
}
constexpr bool fits_register_pool(int threads, int consumer_warpgroups, int consumer_regs,
                                  int producer_regs) {
  return 128 * (consumer_warpgroups * consumer_regs + producer_regs) <=
         threads * launch_regs_per_thread(threads);
}
// The thirty-sixth session's hang (four consumer warpgroups at 120 and a
// producer at 24 in 640 threads: 64512 > 61440) and the budgets in use.
static_assert(launch_regs_per_thread(640) == 96 && !fits_register_pool(640, 4, 120, 24) &&
                  fits_register_pool(640, 4, 112, 24) && fits_register_pool(384, 2, 240, 24) &&
                  !fits_register_pool(384, 2, 248, 24),
              "fits_register_pool");

// The warpgroup's per-thread register budget, raised (consumers) or lowered
// (a producer that only issues copies) at run time: every warp of the
// warpgroup executes the same one. A kernel launched with the budget its
// thread count allows (65536 / threads) can move registers from its producer
// warpgroup to its consumers' accumulators this way.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: 24..256, step 8");
#ifndef SS_WGMMA_UNAVAILABLE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: 24..256, step 8");
#ifndef SS_WGMMA_UNAVAILABLE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#ifndef SS_WGMMA_UNAVAILABLE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifndef SS_WGMMA_UNAVAILABLE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most N of this warpgroup's committed groups are pending
// (their accumulators may then be read).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifndef SS_WGMMA_UNAVAILABLE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Generic-proxy shared-memory writes (st.shared, stmatrix, cp.async) made
// visible to the async proxy that wgmma reads through; then a barrier.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Four 8 x 8 16-bit matrices stored transposed: lane l gives the address of
// stored row l % 8 of matrix l / 8 (16 bytes), matrix m's fragment in r[m].
__device__ __forceinline__ void stmatrix_x4_trans(const void* row, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(a),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// The accumulator's eight registers from i as asm operands: read and written
// (scale-d 1: d += A B) or written only (scale-d 0: d = A B, the first
// product of a chain, with no zeroed registers for the compiler to place
// between the chain's MMAs, where ptxas then inserted waits of its own).
#define SS_WG_F8(i)                                                                           \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define SS_WG_F8_OUT(i)                                                                       \
  "=f"(d[i]), "=f"(d[i + 1]), "=f"(d[i + 2]), "=f"(d[i + 3]), "=f"(d[i + 4]), "=f"(d[i + 5]), \
      "=f"(d[i + 6]), "=f"(d[i + 7])

// One m64n64k16 MMA with A from registers (four .b32 of 16-bit pairs a
// thread, the layout of the m64nNk16 accumulator's k16 column slice: a0 row
// g, a1 row g + 8, a2 / a3 the same 8 columns on), B from shared memory,
// MN-major where TB is "1"; scale-d SCALE with the matching operand list F8.
#define SS_WGRS(TY, TB, SCALE, F8)                                                             \
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY                         \
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
               "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
               "{%32, %33, %34, %35}, %36, " SCALE ", 1, 1, " TB ";\n"                         \
               : F8(0), F8(8), F8(16), F8(24)                                                  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
#define SS_WGRS_TYPED(SCALE, F8)     \
  if constexpr (kBf16 && kTransB)    \
    SS_WGRS("bf16", "1", SCALE, F8); \
  else if constexpr (kBf16)          \
    SS_WGRS("bf16", "0", SCALE, F8); \
  else if constexpr (kTransB)        \
    SS_WGRS("f16", "1", SCALE, F8);  \
  else                               \
    SS_WGRS("f16", "0", SCALE, F8)

// d (64 x 64, fp32) += A B, A (64 x 16) from registers, B from shared memory
// (K-major, or MN-major where kTransB). 16-bit type: bf16 (kBf16) or fp16.
// The registers must stay unchanged until the MMA's group has been waited on.
template <bool kBf16, bool kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t* a, uint64_t b) {
#ifdef SS_WGMMA_UNAVAILABLE
  __trap();
#else
  SS_WGRS_TYPED("1", SS_WG_F8);
#endif
}

// d = A B (scale-d 0), as wgmma_m64n64k16_rs.
template <bool kBf16, bool kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_rs_first(float (&d)[32], const uint32_t* a,
                                                         uint64_t b) {
#ifdef SS_WGMMA_UNAVAILABLE
  __trap();
#else
  SS_WGRS_TYPED("0", SS_WG_F8_OUT);
#endif
}

// One m64n64k16 MMA with both operands from shared memory: A K-major (its
// descriptor a), B K-major or MN-major where TB is "1".
#define SS_WGSS(TY, TB, SCALE, F8)                                                             \
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY                         \
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
               "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
               "%32, %33, " SCALE ", 1, 1, 0, " TB ";\n"                                       \
               : F8(0), F8(8), F8(16), F8(24)                                                  \
               : "l"(a), "l"(b))
#define SS_WGSS_TYPED(SCALE, F8)     \
  if constexpr (kBf16 && kTransB)    \
    SS_WGSS("bf16", "1", SCALE, F8); \
  else if constexpr (kBf16)          \
    SS_WGSS("bf16", "0", SCALE, F8); \
  else if constexpr (kTransB)        \
    SS_WGSS("f16", "1", SCALE, F8);  \
  else                               \
    SS_WGSS("f16", "0", SCALE, F8)

// d (64 x 64, fp32) += A B with A (64 x 16, K-major) and B from shared
// memory by their descriptors; scale_d 0 (kFirst) writes d = A B instead, as
// wgmma_m64n64k16_rs_first does.
template <bool kBf16, bool kTransB, bool kFirst = false>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t a, uint64_t b) {
#ifdef SS_WGMMA_UNAVAILABLE
  __trap();
#else
  if constexpr (kFirst) {
    SS_WGSS_TYPED("0", SS_WG_F8_OUT);
  } else {
    SS_WGSS_TYPED("1", SS_WG_F8);
  }
#endif
}

// One m64n128k16 bf16 MMA, both operands from shared memory: K-major (TNSP
// "0, 0") or MN-major (TNSP "1, 1": tnsp-a and tnsp-b).
#define SS_WGSS128(SCALE, F8, TNSP)                                   \
  asm volatile(                                                       \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, " \
      "%14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, "  \
      "%26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, "  \
      "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "  \
      "%62, %63}, %64, %65, " SCALE ", 1, 1, " TNSP ";\n"             \
      : F8(0), F8(8), F8(16), F8(24), F8(32), F8(40), F8(48), F8(56)  \
      : "l"(a), "l"(b))

// d (64 x 128, fp32) += A B, bf16, A (64 x 16) and B (128 x 16) K-major from
// shared memory by their descriptors; kFirst: d = A B (scale-d 0). The
// accumulator layout is m64n64's with 16 column blocks of 8.
template <bool kFirst = false>
__device__ __forceinline__ void wgmma_m64n128k16_ss_bf16(float (&d)[64], uint64_t a, uint64_t b) {
#ifdef SS_WGMMA_UNAVAILABLE
  __trap();
#else
  if constexpr (kFirst) {
    SS_WGSS128("0", SS_WG_F8_OUT, "0, 0");
  } else {
    SS_WGSS128("1", SS_WG_F8, "0, 0");
  }
#endif
}

// One m64n256k16 bf16 MMA, both operands from shared memory and MN-major
// (tnsp-a and tnsp-b 1).
#define SS_WGSS256MN(SCALE, F8)                                                               \
  asm volatile(                                                                               \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "                                \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, "                         \
      "%14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, "                \
      "%28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "                \
      "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "                \
      "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, "                \
      "%70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "                \
      "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, "                \
      "%98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "    \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, "  \
      "%126, %127}, "                                                                         \
      "%128, %129, " SCALE ", 1, 1, 1, 1;\n"                                                  \
      : F8(0), F8(8), F8(16), F8(24), F8(32), F8(40), F8(48), F8(56), F8(64), F8(72), F8(80), \
        F8(88), F8(96), F8(104), F8(112), F8(120)                                             \
      : "l"(a), "l"(b))

// d (64 x N, fp32) += A B, bf16, A (64 x 16) and B (16 x N) MN-major from
// shared memory (rows = K, as TMA writes a token-major tile) by their
// descriptors (wgmma_desc_sw128_mn); N = 128 or 256, d's layout m64n64's
// with N / 8 column blocks of 8.
template <int N>
__device__ __forceinline__ void wgmma_m64k16_ss_bf16_mn(float (&d)[N / 2], uint64_t a, uint64_t b) {
  static_assert(N == 128 || N == 256, "m64n128k16 or m64n256k16");
#ifdef SS_WGMMA_UNAVAILABLE
  __trap();
#else
  if constexpr (N == 128) {
    SS_WGSS128("1", SS_WG_F8, "1, 1");
  } else {
    SS_WGSS256MN("1", SS_WG_F8);
  }
#endif
}

#undef SS_WGSS256MN
#undef SS_WGSS128
#undef SS_WGSS_TYPED
#undef SS_WGSS
#undef SS_WGRS_TYPED
#undef SS_WGRS
#undef SS_WG_F8_OUT
#undef SS_WG_F8

}  // namespace statescan::cuda::detail
