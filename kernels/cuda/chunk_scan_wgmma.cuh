// chunk_state_scan_wgmma_kernel: a delta rule's state scan that keeps only
// the final state, one CTA per head and segment (or run of chunks) holding
// the whole 128 x 128 fp32 state: the CP summary's E, M's identity scan, and
// the two-level summary's runs (summary.cu), whose identity scans also write
// the first segments' H (WgmmaScan::maps_out).
//
// Why: chunk_state_scan16_kernel splits a head's state into 16- or 32-column
// blocks, one CTA each, so a summary scan at H = 16 fills the GPU (128 CTAs
// of ~120 KB) for a sequential chain of ~1 us a chunk, and nothing else can
// run beside it (PERF_NOTES, twentieth session). Here the products of a step
// are warpgroup MMAs, and every chunk's tiles are loaded once per head
// instead of once per column block. The scan runs transposed: warpgroup wg
// holds S^T's rows 64 wg .. (S's value columns) and every product of a step
// is separable by them:
//   V'^T = U^T - S^T W^T                  (A = S^T rounded to T, registers)
//   S^T  = S^T diag(e^{b_C}) + V'^T K_    (A = V'^T rounded to T, registers)
//   maps_out: o^T = S^T Q^T + V'^T A^T
// so the warpgroups share only the stages. The arithmetic is the other
// scans': S stays fp32 in the accumulators, the products read S rounded to T,
// V' is rounded to T once.
// Measured (H200, 128K, H = 16, the warpgroups in ping-pong): ~1.65 us a step
// for a pair of E and the maps with H (E waits for the maps at the cluster
// barrier), against the column blocks' ~1.0 (16 columns, one wave), because a
// step's two products and their waits run in series; but on 4-8 times fewer
// multiprocessors, so it wins once there are CTAs enough to fill the GPU:
// many heads, or the two-level summary's runs (E at H = 16, 128K: 2.0 ms as
// column blocks, 0.75 ms as four runs per row). Untransposed (each
// warpgroup holding S's rows, an S copy and V' written to shared memory by
// each warpgroup and read by both, two CTA barriers a step) the summary took
// 1.078 ms instead of 1.005 (PERF_NOTES, twenty-seventh session); loading the
// tiles by cp.async (12-14 copies per thread a step) the steps were 2.5-2.7
// and ~3.7 us: the load/store path bounded them (twentieth and twenty-fourth
// sessions).
//   grid (H, N segments or runs), 256 threads (two warpgroups),
//   ScanWgmmaTraits<mode>::kBytes of shared memory: four stages (three for
//   maps_out) that thread 0 fills by TMA (WgmmaTileMaps; a full and an empty
//   mbarrier each): K_, W (64-column halves in the 128-byte swizzle: W^T and
//   Q^T read K-major, K_ MN-major), U (state; read by the threads through
//   the swizzle), Q^ and A (maps_out) and the decay; maps_out also stages
//   each warpgroup's output tile.
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
  static constexpr bool kU = kMode == WgmmaScan::state;
  static constexpr bool kOut = kMode == WgmmaScan::maps_out;
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
  // Four stages (three with the outputs' Q^ and A, which must leave room for
  // the output's staging): a step is short, the copies need the lead.
  static constexpr int kStages = kOut ? 3 : 4;
  // What TMA writes into a stage's tiles (the decay's bytes come on top
  // where the variant decays).
  static constexpr uint32_t kTileLoadBytes = static_cast<uint32_t>(kDecayOffset);
  // maps_out: each warpgroup's 64 x 64 output tile, staged for row stores.
  static constexpr size_t kOutStageBytes = kOut ? 2 * 2 * kChunk * 64 : 0;
  static constexpr size_t kBarrierOffset = kStages * kStageBytes + kOutStageBytes;
  // + full and empty mbarriers per stage, + 1 KB to align the base to the
  // swizzle's 1024 bytes.
  static constexpr size_t kBytes = kBarrierOffset + 16 * kStages + 1024;
  static_assert(kBytes <= 227 * 1024, "chunk_state_scan_wgmma_kernel exceeds shared memory");
};

// The tile arrays as TMA sees them: [tiles * C][cols] row-major 16-bit,
// boxes of 64 x 64 with the 128-byte swizzle (wgmma_desc_sw128). u only for
// WgmmaScan::state, q and a only for maps_out (else unset, never read).
struct WgmmaTileMaps {
  CUtensorMap k, w, u, q, a;
};

// The m64nNk16 accumulator's k16 column slice kk as wgmma's A operand from
// registers (16-bit pairs: rows g and g + 8, then the next 8 columns).
template <typename T, int kSlices>
__device__ __forceinline__ void accumulator_fragments(const float* acc, uint32_t* frag) {
#pragma unroll
  for (int kk = 0; kk < kSlices; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      frag[4 * kk + r] = pack2<T>(acc[8 * kk + 2 * r], acc[8 * kk + 2 * r + 1]);
}

// One CTA's scan of head h, segment (or run) n: from initial_state (state
// mode; zero where null) or the identity, into final_state where non-null.
// kLockstep: the CTA is one of a cluster of two scanning the same chunks
// (chunk_state_scan_wgmma_pair_kernel), and neither runs more than a step
// ahead of the other.
//
// Transposed, so that the two warpgroups need nothing from each other: warpgroup
// wg holds S^T's rows dv in [64 wg, 64 wg + 64) (S's columns) as an m64n128
// fp32 accumulator, and everything in a step is separable by those columns:
//   V'^T = U^T - S^T W^T          (A = S^T rounded to T, from registers)
//   S^T  = S^T diag(d) + V'^T K_  (A = V'^T rounded to T, from registers)
//   maps_out: o^T = S^T Q^T + V'^T A^T
// With both A operands in registers no S copy or V' goes through shared
// memory and no data passes between the warpgroups; only the stages are
// shared (full: TMA landed; empty: both warpgroups done with them), and turn
// barriers interleave their products on the tensor pipe (ping-pong, below).
// Why: the untransposed scan's step (S copy and V' written by each warpgroup
// and read by both, two CTA barriers) was bound by shared memory traffic and
// those joins, not by its products (PERF_NOTES, twenty-seventh session).
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
  unsigned char* stages = smem_bytes;
  unsigned char* out_stage = smem_bytes + Tr::kStages * Tr::kStageBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_bytes + Tr::kBarrierOffset);
  uint64_t* empty = full + Tr::kStages;
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
  // wg by shuffle: ptxas then knows it warp-uniform and builds the
  // descriptors that depend on it in uniform registers (as lact_hidden.cu).
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), warp = (tid % 128) / 32,
            lane = tid % 32;
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

  // This thread's part of S^T: rows (value dims) dv0 and dv0 + 8, columns
  // (key dims) 8 j + i2 (+1), j = 0..15 (the m64n128 accumulator layout of
  // warpgroup wg); S^T[dv][dk] = S[dk][dv].
  const int dv0 = 64 * wg + 16 * warp + g;
  const int64_t state_base = (n * H + h) * D * D;
  float S[64];
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int dv = dv0 + 8 * (e / 2), dk = 8 * j + i2 + e % 2;
      if constexpr (kIdentity)
        S[4 * j + e] = dv == dk ? 1.f : 0.f;
      else
        S[4 * j + e] = initial_state != nullptr ? initial_state[state_base + dk * D + dv] : 0.f;
    }
  // S^T's key-dim halves as m64n64 accumulators (the S update's products).
  float(&S_lo)[32] = *reinterpret_cast<float(*)[32]>(S);
  float(&S_hi)[32] = *reinterpret_cast<float(*)[32]>(S + 32);

  if (tid == 0) {
    for (int st = 0; st < Tr::kStages; ++st) {
      mbarrier_init(full + st, 1);
      mbarrier_init(empty + st, 8);  // one arrival per warp
    }
    fence_mbarrier_init();
  }
  __syncthreads();  // barriers initialised before any copy completes on them
  for (int st = 0; st < Tr::kStages; ++st) prefetch(st, st);
  // Ping-pong: a warpgroup issues its products only in its turn (named
  // barrier kTurn + wg) and hands the turn over as soon as they are issued,
  // so the tensor pipe runs one warpgroup's products while the other rounds,
  // subtracts and waits. Left to themselves the two ran in phase, both
  // products queued at once and both epilogues with the pipe idle (with U^T
  // read by ldmatrix and the refill a step later, GDN at 128K: summary 0.976
  // -> 0.89 ms, E alone 0.75 -> 0.68; PERF_NOTES, twenty-eighth session).
  constexpr int kTurn = 3;  // 1 and 2 are the output staging's
  auto take_turn = [&] { named_barrier_sync(kTurn + wg, 2 * 128); };
  auto pass_turn = [&] { named_barrier_arrive(kTurn + 1 - wg, 2 * 128); };
  if (wg == 1 && chunks > 0) pass_turn();  // warpgroup 0 goes first
  for (int cl = 0, st = 0; cl < chunks; ++cl, st = st + 1 == Tr::kStages ? 0 : st + 1) {
    mbarrier_wait(full + st, (cl / Tr::kStages) & 1);  // chunk cl has landed
    // S^T rounded to T once, as the A operand of this step's first products.
    uint32_t sf[32];
    accumulator_fragments<T, 8>(S, sf);
    // The swizzled K-major tile (W, or Q^) as B, N = the chunk's rows: k16
    // step kk is 32 bytes into its half (the hardware applies the swizzle).
    auto kmajor = [&](const unsigned char* tile, int kk) {
      return wgmma_desc_sw128(tile + (kk / 4) * Tr::kHalfBytes + 32 * (kk % 4), 1024);
    };
    float vt[32];
    [[maybe_unused]] float o[Tr::kOut ? 32 : 1];
    take_turn();
    wgmma_fence();
    wgmma_m64n64k16_rs_first<kBf16, false>(vt, sf, kmajor(stage_w(st), 0));
#pragma unroll
    for (int kk = 1; kk < D / 16; ++kk)
      wgmma_m64n64k16_rs<kBf16, false>(vt, sf + 4 * kk, kmajor(stage_w(st), kk));
    wgmma_commit();
    // maps_out: o = S^T Q^T as a group of its own that the chain does not
    // wait for (its next products accumulate into o in issue order).
    if constexpr (Tr::kOut) {
      wgmma_m64n64k16_rs_first<kBf16, false>(o, sf, kmajor(stage_q(st), 0));
#pragma unroll
      for (int kk = 1; kk < D / 16; ++kk)
        wgmma_m64n64k16_rs<kBf16, false>(o, sf + 4 * kk, kmajor(stage_q(st), kk));
      wgmma_commit();
    }
    pass_turn();
    wgmma_wait<Tr::kOut ? 1 : 0>();
    // V'^T = U^T - S^T W^T (maps: -S^T W^T), rounded to T once: the A
    // operand of the S update (and of the output's A V'). U^T[dv][t] is
    // U's row t, column dv (half wg, 16-byte piece (dv % 64) / 8 swizzled
    // by t % 8).
    uint32_t vf[16];
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk) {
      // U^T's four 8 x 8 blocks of k16 slice kk in the fragment layout: one
      // ldmatrix.trans, lane l giving row t = 16 kk + 8 (m / 2) + l % 8 of
      // block m = l / 8 (value dims 16 warp + 8 (m % 2) ..).
      uint32_t u4[4] = {0u, 0u, 0u, 0u};
      if constexpr (Tr::kU) {
        const int m = lane / 8, t = 16 * kk + 8 * (m / 2) + lane % 8;
        ldmatrix_x4<true>(
            u4, stage_u(st) + wg * Tr::kHalfBytes + t * 128 + 16 * ((2 * warp + m % 2) ^ (t % 8)));
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int at = 8 * kk + 2 * r;  // vt's pair behind fragment register r
        const float2 uu = Tr::kU ? unpack2<T>(u4[r]) : float2{0.f, 0.f};
        vf[4 * kk + r] = pack2<T>(uu.x - vt[at], uu.y - vt[at + 1]);
      }
    }
    if constexpr (kDecayed) {
      const float* dd = stage_decay(st);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 d = *reinterpret_cast<const float2*>(dd + 8 * j + i2);
        S[4 * j] *= d.x;
        S[4 * j + 1] *= d.y;
        S[4 * j + 2] *= d.x;
        S[4 * j + 3] *= d.y;
      }
    }
    // S^T += V'^T K_: K_ as B read MN-major (N = key dims, half by half;
    // K = the chunk's rows, a k16 step 16 of its 128-byte rows, 8-row
    // swizzle atoms 1024 bytes apart). maps_out: o^T += V'^T A^T (A's
    // query rows as N, K-major).
    take_turn();
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk) {
      wgmma_m64n64k16_rs<kBf16, true>(S_lo, vf + 4 * kk,
                                      wgmma_desc_sw128(stage_k(st) + 2048 * kk, 1024));
      wgmma_m64n64k16_rs<kBf16, true>(
          S_hi, vf + 4 * kk, wgmma_desc_sw128(stage_k(st) + Tr::kHalfBytes + 2048 * kk, 1024));
    }
    if constexpr (Tr::kOut)
#pragma unroll
      for (int kk = 0; kk < C / 16; ++kk)
        wgmma_m64n64k16_rs<kBf16, false>(o, vf + 4 * kk,
                                         wgmma_desc_sw128(stage_a(st) + 32 * kk, 1024));
    wgmma_commit();
    // Warpgroup 1's last turn hands nothing over: warpgroup 0 has had its last.
    if (wg == 0 || cl + 1 < chunks) pass_turn();
    // Refill the stage of chunk cl - 1 (thread 0, warpgroup 0): in this turn
    // warpgroup 1 has issued chunk cl's first products, so both are done
    // with it and the wait does not stall (waiting on chunk cl's stage here
    // would hold warpgroup 0 until warpgroup 1 caught up, in phase again).
    if (tid == 0 && cl >= 1 && cl - 1 + Tr::kStages < chunks) {
      const int prev = st == 0 ? Tr::kStages - 1 : st - 1;
      mbarrier_wait(empty + prev, ((cl - 1) / Tr::kStages) & 1);
      prefetch(cl - 1 + Tr::kStages, prev);
    }
    wgmma_wait<0>();
    // This warp is done with stage st (its products waited on, its U and
    // decay reads consumed).
    __syncwarp();
    if (lane == 0) mbarrier_arrive(empty + st);
    if constexpr (Tr::kOut) {
      // o^T's tile (value dims 64 wg .., the chunk's rows) to o[t][dv]
      // through shared memory: stmatrix.trans writes o's rows, 128 bytes
      // each, their 16-byte pieces swizzled by row % 8; then whole 128-byte
      // row pieces to global memory (the fragment layout would store 4
      // bytes to each of 8 rows per instruction).
      unsigned char* staged = out_stage + wg * (2 * C * 64);
      auto piece_at = [&](int r, int c) { return staged + r * 128 + 16 * (c ^ (r % 8)); };
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        uint32_t r[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int jj = j + m / 2, e = 2 * (m % 2);
          r[m] = pack2<T>(o[4 * jj + e], o[4 * jj + e + 1]);
        }
        const int jm = j + mat / 2, hm = mat % 2;
        stmatrix_x4_trans(piece_at(8 * jm + mrow, 2 * warp + hm), r[0], r[1], r[2], r[3]);
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
      named_barrier_sync(1 + wg, 128);  // read back before the next chunk's staging
    }
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
        final_state[state_base + (8 * j + i2 + e % 2) * D + dv0 + 8 * (e / 2)] = S[4 * j + e];
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
// ~1.5 us, the maps' with H ~2.0) and every chunk's K_ and W (32 KB a chunk
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
