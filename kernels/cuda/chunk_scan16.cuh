// chunk_state_scan16_kernel (forward v4): chunk_state_scan_kernel for 16-bit
// tiles with the fp32 state in registers.
//
// Why: the scan is the forward's only sequential part, and ncu (KDA 8K,
// 2026-12-01) showed chunk_state_scan_kernel spending ~880 warp instructions
// per warp per chunk at 5.7 cycles each (2 warps per scheduler, stalls on
// fixed-latency dependencies and shared loads): wmma round-trips the fp32
// state through shared memory twice per chunk (load as an accumulator, store,
// re-read to round the operand copy), loads its col-major operands element by
// element, and three barriers split each step. Here each warp owns 16 rows of
// the state (Dk x BV, fp32) as mma.sync accumulators for the whole segment:
// the decay and S += K_^T V' act on registers, operands come in with
// ldmatrix (transposed where the tile is stored the other way), and a step
// has two barriers (one for additive rules).
//
// The arithmetic is chunk_state_scan_kernel's: S stays fp32; the products read
// a copy of S rounded to T; V' = U - W S is rounded to T once and both the
// update and the output kernel read that value; S <- diag(e^{b_C}) S + K_^T V'.
//   grid (Dv / BV, H, N segments), Dk / 16 warps (each warp: state rows
//   [16 w, 16 w + 16), all BV columns); shared memory Scan16Traits::kBytes
//   (Dk = 128, bf16, delta: 122 KB at BV = 16, 134 KB at BV = 32), three
//   cp.async stages (the next two chunks' K_, W, U and decay load during a
//   step).
// Included by chunk_forward.cuh after ScanTraits' kernel and copy_tile_async.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/warp_mma.cuh"

namespace statescan::cuda::detail {

template <typename T, int Dk, int Dv, int BV, bool kDelta>
struct Scan16Traits {
  static_assert(!std::is_same_v<T, float>, "fp32 tiles keep chunk_state_scan_kernel");
  static constexpr int kMaxChunk = 64;
  static constexpr int kWarps = Dk / 16;  // one 16-row slab of S per warp
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kSNT = BV / 8;  // 16 x 8 accumulator tiles per warp
  // W S: (chunk / 16) row tiles x kSNT column tiles, kWNT column tiles per
  // warp at chunk 64 (smaller chunks leave warps idle in this product).
  static constexpr int kWNT = (kMaxChunk / 16) * kSNT / kWarps;
  static constexpr int kLdK = Dk + 8;  // K_, W tiles (16 bytes of padding per row)
  static constexpr int kLdB = BV + 8;  // U, V', the copy of S
  static_assert(Dv % BV == 0 && kSNT % 2 == 0, "Dv block: whole pairs of 8-column tiles");
  static_assert(kWNT >= 1 && kSNT % kWNT == 0, "W S tiles split evenly over the warps");
  static constexpr size_t kSCopyBytes = align_smem(sizeof(T) * Dk * kLdB);
  static constexpr size_t kTileKBytes = align_smem(sizeof(T) * kMaxChunk * kLdK);
  static constexpr size_t kTileBBytes = align_smem(sizeof(T) * kMaxChunk * kLdB);
  static constexpr size_t kUOffset = (kDelta ? 2 : 1) * kTileKBytes;
  static constexpr size_t kStageBytes = kUOffset + kTileBBytes + align_smem(sizeof(float) * Dk);
  static constexpr int kStages = 3;
  static constexpr size_t kVnBytes = kDelta ? kTileBBytes : 0;
  static constexpr size_t kBytes =
      (kDelta ? kSCopyBytes : 0) + kVnBytes + kStages * kStageBytes;
  static_assert(kBytes <= 227 * 1024, "chunk_state_scan16_kernel exceeds Hopper shared memory");
};

// acc (one 16 x 8 tile) += X[m0 .. m0+16, 0 .. K) Y[0 .. K, n0 .. n0+8) with
// X row-major [M][K] and Y row-major [K][N], 16-bit in shared memory, K a
// multiple of 32: one transposed x4 load gives Y's fragments for two k steps
// (warp_mm_16xn needs column tiles in pairs). Two accumulators halve the
// dependent chain of mma steps; acc0 returns their sum.
template <typename T>
__device__ __forceinline__ void warp_mm_16x8(float (&acc0)[4], const T* x, int ldx, const T* y,
                                             int ldy, int m0, int n0, int K) {
  const int lane = threadIdx.x & 31;
  const int r8 = lane & 7, m1 = (lane >> 3) & 1, m2 = lane >> 4;
  float acc1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int k0 = 0; k0 < K; k0 += 32) {
    uint32_t a0[4], a1[4], b[4];
    ldmatrix_x4<false>(a0, x + (m0 + r8 + 8 * m1) * ldx + k0 + 8 * m2);
    ldmatrix_x4<false>(a1, x + (m0 + r8 + 8 * m1) * ldx + k0 + 16 + 8 * m2);
    // matrices: rows k0 + 8 q .. k0 + 8 q + 8 for q = lane / 8
    ldmatrix_x4<true>(b, y + (k0 + r8 + 8 * (lane >> 3)) * ldy + n0);
    mma_m16n8k16<T>(acc0, a0, b[0], b[1]);
    mma_m16n8k16<T>(acc1, a1, b[2], b[3]);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) acc0[e] += acc1[e];
}

template <Decay kDecay, Rule kRule, typename T, int Dk, int Dv, int BV>
__global__ void __launch_bounds__(Dk * 2)
    chunk_state_scan16_kernel(const __grid_constant__ ForwardArgs a) {
  constexpr bool kDelta = kRule == Rule::delta;
  using Tr = Scan16Traits<T, Dk, Dv, BV, kDelta>;
  constexpr int kLdK = Tr::kLdK, kLdB = Tr::kLdB, kSNT = Tr::kSNT, kWNT = Tr::kWNT;
  constexpr int kStages = Tr::kStages;
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  // The products' 16-bit copy of S (delta rules only: W S reads every row).
  T* sSop = reinterpret_cast<T*>(smem_bytes);
  T* sVn = reinterpret_cast<T*>(smem_bytes + (kDelta ? Tr::kSCopyBytes : 0));
  unsigned char* stages = smem_bytes + (kDelta ? Tr::kSCopyBytes : 0) + Tr::kVnBytes;
  auto stage = [&](int st, size_t offset) { return stages + st * Tr::kStageBytes + offset; };
  auto stage_k = [&](int st) { return reinterpret_cast<T*>(stage(st, 0)); };
  auto stage_w = [&](int st) { return reinterpret_cast<T*>(stage(st, Tr::kTileKBytes)); };
  auto stage_u = [&](int st) { return reinterpret_cast<T*>(stage(st, Tr::kUOffset)); };
  auto stage_decay = [&](int st) {
    return reinterpret_cast<float*>(stage(st, Tr::kUOffset + Tr::kTileBBytes));
  };

  const int vb = blockIdx.x;
  const int64_t h = blockIdx.y, n = blockIdx.z, H = a.heads;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, i2 = 2 * (lane % 4);  // accumulator row, column pair
  const int C = a.chunk, nb = C / 16;
  const int col0 = vb * BV;
  const int r0 = 16 * warp;  // this warp's state rows r0 + g, r0 + g + 8
  const T* ws_k = static_cast<const T*>(a.ws_k);
  const T* ws_w = static_cast<const T*>(a.ws_w);
  const T* ws_u = static_cast<const T*>(a.ws_u);

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
    copy_tile_async<Tr::kThreads>(stage_k(st), kLdK, ws_k + tile * C * Dk, Dk, C, Dk);
    if constexpr (kDelta)
      copy_tile_async<Tr::kThreads>(stage_w(st), kLdK, ws_w + tile * C * Dk, Dk, C, Dk);
    copy_tile_async<Tr::kThreads>(stage_u(st), kLdB, ws_u + tile * C * Dv + col0, Dv, C, BV);
    if constexpr (kDecay != Decay::none)
      copy_tile_async<Tr::kThreads>(stage_decay(st), Dk, a.ws_decay + tile * Dk, Dk, 1, Dk);
    cp_async_commit();
  };
  for (int p = 0; p < kStages - 1; ++p)
    if (p < num_chunks) prefetch(first_chunk + p, p);

  // s[j]: rows r0 + g (elements 0, 1) and r0 + g + 8 (2, 3), columns
  // 8 j + i2, 8 j + i2 + 1 of the block.
  float s[kSNT][4];
  const int64_t state_base = (n * H + h) * Dk * Dv + col0;
  auto state_at = [&](int j, int e) { return (r0 + g + 8 * (e / 2)) * Dv + 8 * j + i2; };
#pragma unroll
  for (int j = 0; j < kSNT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)  // element-wise: the caller's state may be only 4-byte aligned
      s[j][e] = a.initial_state != nullptr
                    ? a.initial_state[state_base + state_at(j, e & 2) + (e & 1)]
                    : 0.f;
  // The rounded copy of this warp's rows (read by every warp's W S).
  auto store_copy = [&] {
    if constexpr (kDelta) {
#pragma unroll
      for (int j = 0; j < kSNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          *reinterpret_cast<uint32_t*>(sSop + (r0 + g + 4 * e) * kLdB + 8 * j + i2) =
              pack2<T>(s[j][e], s[j][e + 1]);
    }
  };
  store_copy();

  // W S tiles of this warp: row tile wi, column tiles wj .. wj + kWNT.
  const int wi = warp / (kSNT / kWNT), wj = (warp % (kSNT / kWNT)) * kWNT;

  for (int64_t cl = 0; cl < num_chunks; ++cl) {
    const int64_t c = first_chunk + cl;
    const int64_t tile = c * H + h;
    const int st = static_cast<int>(cl % kStages);
    // One cp.async group per chunk, committed in order: chunk cl's group is
    // complete once at most `ahead` younger groups are pending.
    const int64_t later = num_chunks - 1 - cl;
    if (later >= kStages - 2)
      cp_async_wait<kStages - 2>();
    else
      cp_async_wait<0>();
    // This chunk's stage and the copy of S visible to every warp; every warp
    // is done with the previous chunk, so its stage can be refilled.
    __syncthreads();
    if (cl + kStages - 1 < num_chunks)
      prefetch(c + kStages - 1, static_cast<int>((cl + kStages - 1) % kStages));

    // The state entering the chunk: fp32 for the backward, rounded to T for
    // the output kernel (the values the products read).
    if (a.chunk_states != nullptr || a.ws_states != nullptr) {
      float* out_f32 = a.chunk_states != nullptr ? a.chunk_states + tile * Dk * Dv + col0 : nullptr;
      T* out_t = a.ws_states != nullptr ? static_cast<T*>(a.ws_states) + tile * Dk * Dv + col0
                                        : nullptr;
#pragma unroll
      for (int j = 0; j < kSNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          if (out_f32 != nullptr)
            *reinterpret_cast<float2*>(out_f32 + state_at(j, e)) = make_float2(s[j][e], s[j][e + 1]);
          if (out_t != nullptr)
            *reinterpret_cast<uint32_t*>(out_t + state_at(j, e)) = pack2<T>(s[j][e], s[j][e + 1]);
        }
    }

    const T* vnew = stage_u(st);  // additive rules: V' = U
    if constexpr (kDelta) {
      // V' = U - W S, rounded to T once (the update below and the output
      // kernel read the same values).
      if (wi < nb) {
        float p[kWNT][4] = {};
        if constexpr (kWNT == 1) {
          warp_mm_16x8<T>(p[0], stage_w(st), kLdK, sSop, kLdB, 16 * wi, 8 * wj, Dk);
        } else {
          warp_mm_16xn<T, false, true, kWNT>(p, stage_w(st), kLdK, sSop, kLdB, 16 * wi, 8 * wj,
                                             Dk);
        }
        const T* u = stage_u(st);
#pragma unroll
        for (int j = 0; j < kWNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; e += 2) {
            const int off = (16 * wi + g + 4 * e) * kLdB + 8 * (wj + j) + i2;
            const float2 x = unpack2<T>(*reinterpret_cast<const uint32_t*>(u + off));
            *reinterpret_cast<uint32_t*>(sVn + off) = pack2<T>(x.x - p[j][e], x.y - p[j][e + 1]);
          }
      }
      vnew = sVn;
    }
    if constexpr (kDecay != Decay::none) {
      const float* decay = stage_decay(st);
      const float d0 = decay[r0 + g], d1 = decay[r0 + g + 8];
#pragma unroll
      for (int j = 0; j < kSNT; ++j) {
        s[j][0] *= d0;
        s[j][1] *= d0;
        s[j][2] *= d1;
        s[j][3] *= d1;
      }
    }
    if constexpr (kDelta) __syncthreads();  // V' complete; every read of the copy of S done

    // S <- S + K_^T V' (K_ stored [t][d]: the transposed operand).
    warp_mm_16xn<T, true, true, kSNT>(s, stage_k(st), kLdK, vnew, kLdB, r0, 0, C);
    store_copy();
    if constexpr (kDelta) {
      if (a.ws_vnew != nullptr) {
        // V' for the output kernel, 16 bytes per thread per step.
        T* out_vn = static_cast<T*>(a.ws_vnew) + tile * C * Dv + col0;
        constexpr int kVec = 16 / sizeof(T);
        for (int idx = tid; idx < C * BV / kVec; idx += Tr::kThreads) {
          const int i = idx / (BV / kVec), j = (idx % (BV / kVec)) * kVec;
          *reinterpret_cast<uint4*>(out_vn + i * Dv + j) =
              *reinterpret_cast<const uint4*>(sVn + i * kLdB + j);
        }
      }
    }
  }
  cp_async_wait<0>();
  if (a.final_state != nullptr) {
#pragma unroll
    for (int j = 0; j < kSNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        a.final_state[state_base + state_at(j, e & 2) + (e & 1)] = s[j][e];
  }
}

}  // namespace statescan::cuda::detail
