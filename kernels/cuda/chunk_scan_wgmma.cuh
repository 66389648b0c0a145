// chunk_state_scan_wgmma_kernel: a delta rule's state scan that keeps only
// the final state, one CTA per head and segment (or run of chunks) holding
// the whole 128 x 128 fp32 state: the CP summary's E, M's identity scan, and
// the two-level summary's runs (summary.cu), whose identity scans also write
// the first segments' H (WgmmaScan::maps_out).
//
// Why: chunk_state_scan16_kernel splits a head's state into 16- or 32-column
// blocks, one CTA each, so a summary scan at H = 16 fills the GPU (128 CTAs
// of ~120 KB) for a sequential chain of ~1 us a chunk, and nothing else can
// run beside it (PERF_NOTES, twentieth session). Here the two products of a
// step are warpgroup MMAs from shared memory, which read each operand tile
// once per warpgroup instead of once per 16 x 8 fragment, and every chunk's
// tiles are loaded once per head instead of once per column block:
//   V' = U - W S            (64 x 128: warpgroup wg forms columns 64 wg ..)
//   S  = diag(e^{b_C}) S + K_^T V'   (warpgroup wg holds rows 64 wg ..)
//   maps_out: o = Q^ S + A V'  (columns 64 wg .., beside the two above)
// The arithmetic is the other scans': S stays fp32 in the accumulators, the
// products read a copy of S rounded to T, V' is rounded to T once.
// Measured (H200, 128K, H = 16): ~1.5 us a step for E (~2.1 us for the maps
// with H), against the column blocks' ~1.0 (16 columns, one wave), because a
// step's two halves and their waits run in series on one CTA; but on 4-8
// times fewer multiprocessors, so it wins once there are CTAs enough to fill
// the GPU: many heads, or the two-level summary's runs (E at H = 16, 128K:
// 2.0 ms as column blocks, 0.79 ms as four runs per row). Loading the tiles
// by cp.async (12-14 copies per thread a step) the steps were 2.5-2.7 and
// ~3.7 us: the load/store path bounded them (PERF_NOTES, twentieth and
// twenty-fourth sessions).
//   grid (H, N segments or runs), 256 threads (two warpgroups),
//   ScanWgmmaTraits<mode>::kBytes of shared memory: the S copy (S^T in the
//   core-matrix layout of wgmma.cuh), V'^T, and three stages that thread 0
//   fills by TMA (WgmmaTileMaps, one mbarrier each): K_, W (64-column halves
//   in the 128-byte swizzle: W S reads them K-major, K_^T V' MN-major), U
//   (state; read by the threads through the swizzle), Q^ and A (maps_out,
//   K-major) and the decay.
// Included by chunk_forward.cuh after segment_chunks.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cluster_copy.cuh"  // named_barrier_sync
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/warp_mma.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace statescan::cuda::detail {

// What a per-head scan computes. `state`: S from initial_state (zero where
// null) through S <- diag(d) S + K_^T (U - W S), keeping the final state
// (the summary's E). `maps`: the linear part of that update, S from the
// identity with U = 0, so V' = -W S and no U tile is read (M, and the
// two-level summary's piece maps). `maps_out`: the same with the output
// stage on, o = Q^ S_c + A V' into a.o for every valid row (the first
// segments' H: d o_t / d S0).
enum class WgmmaScan { state, maps, maps_out };

template <WgmmaScan kMode>
struct ScanWgmmaTraits {
  static constexpr int kDk = 128, kDv = 128, kChunk = 64;
  static constexpr int kThreads = 256;
  static constexpr int kStages = 3;
  static constexpr bool kU = kMode == WgmmaScan::state;
  static constexpr bool kOut = kMode == WgmmaScan::maps_out;
  static constexpr size_t kSCopyBytes = 2 * kDk * kDv;
  static constexpr size_t kVnBytes = 2 * kChunk * kDv;
  // Tiles loaded by TMA in 128-byte-swizzled halves of 64 columns
  // (kHalfBytes each, 1024-byte aligned): K_, W, U, Q^ two halves, A one.
  static constexpr size_t kHalfBytes = 2 * kChunk * 64;
  static constexpr size_t kTileBytes = 2 * kHalfBytes;  // K_, W, U or Q^
  // Offsets inside a stage: K_, W, then U (state), Q^ and A (maps_out), decay.
  static constexpr size_t kUOffset = 2 * kTileBytes;
  static constexpr size_t kQOffset = kUOffset + (kU ? kTileBytes : 0);
  static constexpr size_t kAOffset = kQOffset + (kOut ? kTileBytes : 0);
  static constexpr size_t kDecayOffset = kAOffset + (kOut ? kHalfBytes : 0);
  static constexpr size_t kStageBytes = (kDecayOffset + sizeof(float) * kDk + 1023) / 1024 * 1024;
  // What TMA writes into a stage's tiles (the decay's bytes come on top
  // where the variant decays).
  static constexpr uint32_t kTileLoadBytes = static_cast<uint32_t>(kDecayOffset);
  static constexpr size_t kBarrierOffset = kSCopyBytes + kVnBytes + kStages * kStageBytes;
  // + the stages' mbarriers, + 1 KB to align the base to the swizzle's 1024 bytes.
  static constexpr size_t kBytes = kBarrierOffset + 8 * kStages + 1024;
  static_assert((kSCopyBytes + kVnBytes) % 1024 == 0, "stages must start 1024-byte aligned");
  static_assert(kBytes <= 227 * 1024, "chunk_state_scan_wgmma_kernel exceeds shared memory");
};

// The tile arrays as TMA sees them: [tiles * C][cols] row-major 16-bit,
// boxes of 64 x 64 with the 128-byte swizzle (wgmma_desc_sw128). u only for
// WgmmaScan::state, q and a only for maps_out (else unset, never read).
struct WgmmaTileMaps {
  CUtensorMap k, w, u, q, a;
};

// One CTA's scan of head h, segment (or run) n: from initial_state (state
// mode; zero where null) or the identity, into final_state where non-null.
// kLockstep: the CTA is one of a cluster of two scanning the same chunks
// (chunk_state_scan_wgmma_pair_kernel), and neither runs more than a step
// ahead of the other.
template <typename T, bool kDecayed, WgmmaScan kMode, bool kLockstep>
__device__ __forceinline__ void wgmma_scan_cta(const ForwardArgs& a, const WgmmaTileMaps& maps,
                                               int64_t h, int64_t n, const float* initial_state,
                                               float* final_state) {
  using Tr = ScanWgmmaTraits<kMode>;
  constexpr int D = Tr::kDk, C = Tr::kChunk;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr bool kIdentity = kMode != WgmmaScan::state;
  static_assert(kBf16 || std::is_same_v<T, __half>, "16-bit tiles only");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // The 128-byte swizzle repeats every 1024 bytes: align the base to that.
  unsigned char* smem_bytes = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  T* sS = reinterpret_cast<T*>(smem_bytes);                      // S^T [Dv][Dk], core layout
  T* sV = reinterpret_cast<T*>(smem_bytes + Tr::kSCopyBytes);    // V'^T [Dv][C], core layout
  unsigned char* stages = smem_bytes + Tr::kSCopyBytes + Tr::kVnBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_bytes + Tr::kBarrierOffset);
  auto stage_at = [&](int st, size_t offset) { return stages + st * Tr::kStageBytes + offset; };
  auto stage_k = [&](int st) { return stage_at(st, 0); };
  auto stage_w = [&](int st) { return stage_at(st, Tr::kTileBytes); };
  auto stage_u = [&](int st) { return stage_at(st, Tr::kUOffset); };
  auto stage_q = [&](int st) { return stage_at(st, Tr::kQOffset); };
  auto stage_a = [&](int st) { return stage_at(st, Tr::kAOffset); };
  auto stage_decay = [&](int st) {
    return reinterpret_cast<float*>(stage_at(st, Tr::kDecayOffset));
  };

  const int64_t H = a.heads;
  const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  const int g = lane / 4, i2 = 2 * (lane % 4);
  // stmatrix: lane gives stored row lane % 8 of matrix lane / 8.
  const int mat = lane / 8, mrow = lane % 8;
  int64_t first_chunk, num_chunks;
  segment_chunks(a, n, first_chunk, num_chunks);
  const int chunks = static_cast<int>(num_chunks);
  const int64_t first_tile = first_chunk * H + h;
  const float* ws_decay = kDecayed ? a.ws_decay + first_tile * D : nullptr;
  [[maybe_unused]] const SegmentTokens seg =
      Tr::kOut ? segment_tokens(a, first_chunk, num_chunks) : SegmentTokens{};

  // Chunk cl into stage st, issued by thread 0: each tile as TMA boxes of
  // 64 rows x 64 columns, 128-byte swizzled, all completing on full[st]
  // (armed with the stage's bytes). The 12-14 cp.async per thread a step of
  // the first version held ~40 % of the kernel's stall samples: the
  // load/store path, not the products, bounded the step (PERF_NOTES,
  // twenty-fourth session).
  auto prefetch = [&](int cl, int st) {
    if (tid != 0 || cl >= chunks) return;
    mbarrier_arrive_expect_tx(full + st, Tr::kTileLoadBytes + (kDecayed ? sizeof(float) * D : 0));
    const int row = static_cast<int>((first_tile + int64_t{cl} * H) * C);
    auto tile = [&](unsigned char* dst, const CUtensorMap& map) {
      tensor_copy_to_shared(dst, &map, 0, row, full + st);
      tensor_copy_to_shared(dst + Tr::kHalfBytes, &map, 64, row, full + st);
    };
    tile(stage_k(st), maps.k);
    tile(stage_w(st), maps.w);
    if constexpr (Tr::kU) tile(stage_u(st), maps.u);
    if constexpr (Tr::kOut) {
      tile(stage_q(st), maps.q);
      tensor_copy_to_shared(stage_a(st), &maps.a, 0, row, full + st);
    }
    if constexpr (kDecayed)
      bulk_copy_to_shared(stage_decay(st), ws_decay + int64_t{cl} * H * D, sizeof(float) * D,
                          full + st);
  };

  // This thread's part of S: rows row0 and row0 + 8, columns 8 j + i2 (+1),
  // j = 0..15 (the m64n128 accumulator layout of warpgroup wg).
  const int row0 = 64 * wg + 16 * warp + g;
  const int64_t state_base = (n * H + h) * D * D;
  float S[64];
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + 8 * (e / 2), col = 8 * j + i2 + e % 2;
      if constexpr (kIdentity)
        S[4 * j + e] = row == col ? 1.f : 0.f;
      else
        S[4 * j + e] = initial_state != nullptr ? initial_state[state_base + row * D + col] : 0.f;
    }
  // The rounded copy S^T: stmatrix matrix m holds column block j + m / 2,
  // rows 8 (m % 2) .. of the warp's 16.
  auto store_copy = [&] {
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
      const int jm = j + mat / 2, hm = mat % 2;
      stmatrix_x4_trans(sS + core_offset(8 * jm + mrow, 64 * wg + 16 * warp + 8 * hm, D),
                        pack2<T>(S[4 * j], S[4 * j + 1]), pack2<T>(S[4 * j + 2], S[4 * j + 3]),
                        pack2<T>(S[4 * j + 4], S[4 * j + 5]), pack2<T>(S[4 * j + 6], S[4 * j + 7]));
    }
  };

  if (tid == 0) {
    for (int st = 0; st < Tr::kStages; ++st) mbarrier_init(full + st, 1);
    fence_mbarrier_init();
  }
  __syncthreads();  // barriers initialised before any copy completes on them
  for (int st = 0; st < Tr::kStages; ++st) prefetch(st, st);
  store_copy();
  fence_proxy_async_shared();
  __syncthreads();
  for (int cl = 0, st = 0; cl < chunks; ++cl, st = st + 1 == Tr::kStages ? 0 : st + 1) {
    mbarrier_wait(full + st, (cl / Tr::kStages) & 1);  // chunk cl has landed
    // V' columns [64 wg, 64 wg + 64) = U - W S: K = Dk in 8 steps of 16.
    // maps_out: the output's columns of Q^ S_c from the same S copy, in the
    // same group (8 more MMAs back to back cost ~0.15 us; a second group
    // left running across the barrier would still read the S copy when the
    // other warpgroup rewrites it, and waiting on it separately made ptxas
    // insert its own waits).
    // The chains' first products write their accumulators (scale-d 0).
    float v[32];
    [[maybe_unused]] float o[Tr::kOut ? 32 : 1];
    // The swizzled K-major tile: k16 step kk is 32 bytes into its half
    // (the hardware applies the swizzle to the address it forms).
    auto chain_s = [&](float(&acc)[32], const unsigned char* tile) {
      auto a_desc = [&](int kk) {
        return wgmma_desc_sw128(tile + (kk / 4) * Tr::kHalfBytes + 32 * (kk % 4), 1024);
      };
      wgmma_m64n64k16_first<kBf16, false>(
          acc, a_desc(0), wgmma_desc(sS + core_offset(64 * wg, 0, D), 128, D / 8 * 128));
#pragma unroll
      for (int kk = 1; kk < D / 16; ++kk)
        wgmma_m64n64k16<kBf16, false>(
            acc, a_desc(kk), wgmma_desc(sS + core_offset(64 * wg, 16 * kk, D), 128, D / 8 * 128));
    };
    wgmma_fence();
    chain_s(v, stage_w(st));
    if constexpr (Tr::kOut) chain_s(o, stage_q(st));
    wgmma_commit();
    wgmma_wait<0>();
    // V' rounded to T once, stored transposed (the next product's B operand).
    [[maybe_unused]] const unsigned char* u = Tr::kU ? stage_u(st) : nullptr;
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      uint32_t r[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int jj = j + m / 2, e = 2 * (m % 2);
        if constexpr (Tr::kU) {
          // U's half wg, row `row`, 16-byte piece jj (swizzled by row % 8 = g).
          const int row = 16 * warp + g + 4 * e;
          const float2 uu = unpack2<T>(*reinterpret_cast<const uint32_t*>(
              u + wg * Tr::kHalfBytes + row * 128 + 16 * (jj ^ g) + 2 * i2));
          r[m] = pack2<T>(uu.x - v[4 * jj + e], uu.y - v[4 * jj + e + 1]);
        } else {
          r[m] = pack2<T>(-v[4 * jj + e], -v[4 * jj + e + 1]);
        }
      }
      const int jm = j + mat / 2, hm = mat % 2;
      stmatrix_x4_trans(sV + core_offset(64 * wg + 8 * jm + mrow, 16 * warp + 8 * hm, C), r[0],
                        r[1], r[2], r[3]);
    }
    fence_proxy_async_shared();
    __syncthreads();  // V' complete; every read of the S copy done
    if constexpr (kDecayed) {
      const float d0 = stage_decay(st)[row0], d1 = stage_decay(st)[row0 + 8];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        S[4 * j] *= d0;
        S[4 * j + 1] *= d0;
        S[4 * j + 2] *= d1;
        S[4 * j + 3] *= d1;
      }
    }
    // S += K_^T V': A = K_^T is the K_ tile read MN-major (M = key dims
    // 64 wg .., K = the chunk's rows), K = C in 4 steps of 16.
    // maps_out: o += A V' for the warpgroup's columns (A K-major, K = C).
    wgmma_fence();
    // K_^T: half wg of the K_ tile (key dims 64 wg ..) read MN-major; a k16
    // step is 16 of its 128-byte rows, 8-row swizzle atoms 1024 bytes apart.
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk)
      wgmma_m64n128k16<kBf16, true>(
          S, wgmma_desc_sw128(stage_k(st) + wg * Tr::kHalfBytes + 2048 * kk, 1024),
          wgmma_desc(sV + core_offset(0, 16 * kk, C), 128, C / 8 * 128));
    if constexpr (Tr::kOut)
#pragma unroll
      for (int kk = 0; kk < C / 16; ++kk)
        wgmma_m64n64k16<kBf16, false>(
            o, wgmma_desc_sw128(stage_a(st) + 32 * kk, 1024),
            wgmma_desc(sV + core_offset(64 * wg, 16 * kk, C), 128, C / 8 * 128));
    wgmma_commit();
    wgmma_wait<0>();
    if constexpr (Tr::kOut) {
      // The warpgroup's 64 x 64 output tile through shared memory, so that
      // global memory sees whole 128-byte row pieces (the fragment layout
      // stores 4 bytes to each of 8 rows per instruction: 8 transactions).
      // Staged in the S copy: nothing reads it between the V' barrier and
      // store_copy, and the bytes used here are those only this warpgroup's
      // store_copy rewrites (key dims 64 wg ..: 1 KB of every 2 KB block).
      // Row r at block r / 8, 128 bytes per row, its 16-byte pieces
      // swizzled by r % 8 against bank conflicts.
      unsigned char* stage = reinterpret_cast<unsigned char*>(sS) + 1024 * wg;
      auto piece_at = [&](int r, int c) {
        return stage + (r / 8) * 2048 + (r % 8) * 128 + 16 * (c ^ (r % 8));
      };
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = 16 * warp + g + 8 * hr;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          *reinterpret_cast<uint32_t*>(piece_at(r, j) + 2 * i2) =
              pack2<T>(o[4 * j + 2 * hr], o[4 * j + 2 * hr + 1]);
      }
      named_barrier_sync(1 + wg, 128);
      const int rows = seg.length(cl, C), wt = tid % 128;
      T* out = static_cast<T*>(a.o) + (seg.token0(cl, C) * H + h) * D + 64 * wg;
#pragma unroll
      for (int it = 0; it < 4; ++it) {
        const int r = wt / 8 + 16 * it, c = wt % 8;
        if (r < rows)
          *reinterpret_cast<uint4*>(out + static_cast<int64_t>(r) * H * D + 8 * c) =
              *reinterpret_cast<const uint4*>(piece_at(r, c));
      }
      named_barrier_sync(1 + wg, 128);  // read back before store_copy rewrites it
    }
    store_copy();
    fence_proxy_async_shared();
    __syncthreads();  // S copy complete; stage st free
    prefetch(cl + Tr::kStages, st);
    if constexpr (kLockstep) {
      // Wait for the other CTA's end of the previous step, then mark this
      // one's: the CTA ahead (E's, whose steps are shorter) stays within a
      // step of the other, so the chunks' K_ and W tiles that both load are
      // read from HBM once and found in L2 the second time.
      if (cl > 0) cluster_wait();
      cluster_arrive_relaxed();
    }
  }
  if (final_state != nullptr) {
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        final_state[state_base + (row0 + 8 * (e / 2)) * D + 8 * j + i2 + e % 2] = S[4 * j + e];
  }
}

//   grid (H, N segments or runs), ScanWgmmaTraits<kMode>::kBytes.
template <typename T, bool kDecayed, WgmmaScan kMode>
__global__ void __launch_bounds__(ScanWgmmaTraits<kMode>::kThreads, 1)
    chunk_state_scan_wgmma_kernel(const __grid_constant__ ForwardArgs a,
                                  const __grid_constant__ WgmmaTileMaps maps) {
  wgmma_scan_cta<T, kDecayed, kMode, false>(a, maps, blockIdx.x, blockIdx.y, a.initial_state,
                                            a.final_state);
}

// The two-level summary's E beside its maps, one cluster of two CTAs per head
// and run: rank 0 scans from zero into a.scan_pair_state (E's runs), rank 1
// the identity (kMaps: maps or maps_out) into a.final_state, in lockstep.
// Why: run side by side as two grids the two scans drift apart (E's step is
// ~1.5 us, the maps' with H ~2.1) and every chunk's K_ and W (32 KB a chunk
// and head) is read from HBM twice; in lockstep the second read is an L2 hit
// (KDA, 128K, H = 16: 3.4 -> 2.43 GB read from HBM, ncu), one launch instead
// of two on two streams. The time hardly moved (1.118 -> 1.10 ms): the
// maps' step is bound by its own chain, not by HBM (3.5 TB/s was reached,
// but not the limit; PERF_NOTES, twenty-fifth session). What it buys is a
// gigabyte less HBM traffic beside whatever else runs.
//   grid (2, H, N runs), clusters of 2 along x, the larger kBytes of the two.
template <typename T, bool kDecayed, WgmmaScan kMaps>
__global__ void __launch_bounds__(ScanWgmmaTraits<kMaps>::kThreads, 1)
    chunk_state_scan_wgmma_pair_kernel(const __grid_constant__ ForwardArgs a,
                                       const __grid_constant__ WgmmaTileMaps maps) {
  static_assert(kMaps != WgmmaScan::state, "the pair is E beside a linear part's scan");
  if (blockIdx.x == 0)
    wgmma_scan_cta<T, kDecayed, WgmmaScan::state, true>(a, maps, blockIdx.y, blockIdx.z, nullptr,
                                                        a.scan_pair_state);
  else
    wgmma_scan_cta<T, kDecayed, kMaps, true>(a, maps, blockIdx.y, blockIdx.z, nullptr,
                                             a.final_state);
}

// Shared memory of chunk_state_scan_wgmma_pair_kernel<..., kMaps>.
template <WgmmaScan kMaps>
constexpr size_t pair_scan_bytes() {
  return ScanWgmmaTraits<WgmmaScan::state>::kBytes > ScanWgmmaTraits<kMaps>::kBytes
             ? ScanWgmmaTraits<WgmmaScan::state>::kBytes
             : ScanWgmmaTraits<kMaps>::kBytes;
}

}  // namespace statescan::cuda::detail
