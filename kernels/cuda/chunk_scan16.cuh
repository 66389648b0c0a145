// chunk_state_scan16_kernel (forward v4): chunk_state_scan_kernel for 16-bit
// tiles with the fp32 state in registers.
//
// Why: the scan is the forward's only sequential part, and ncu (KDA 8K,
// 2026-12-01) showed chunk_state_scan_kernel spending ~880 warp instructions
// per warp per chunk at 5.7 cycles each (2 warps per scheduler, stalls on
// fixed-latency dependencies and shared loads): wmma round-trips the fp32
// state through shared memory twice per chunk (load as an accumulator, store,
// re-read to round the operand copy), loads its col-major operands element by
// element, and three barriers split each step. Here the state block
// (Dk x BV, fp32) is spread over up to 16 warps as mma.sync accumulators (one
// or two 16 x 8 tiles each) for the whole segment: the decay and
// S += K_^T V' act on registers, operands come in with ldmatrix (transposed
// where the tile is stored the other way), the chunk is a template parameter
// (products fully unrolled, copy offsets loop-invariant), and a step has two
// barriers (one for additive rules). Between them, the warps that compute
// W S go straight to the second barrier while the others prefetch, save
// their part of the entering state and apply the decay (a source-level
// profile showed the W S warps' path to that barrier as the step's length).
// KDA 32K on an H200: 1.89 ms (wmma) -> 0.73 ms.
//
// The arithmetic is chunk_state_scan_kernel's: S stays fp32; the products read
// a copy of S rounded to T; V' = U - W S is rounded to T once and both the
// update and the output kernel read that value; S <- diag(e^{b_C}) S + K_^T V'.
//   grid (Dv / BV, H, N segments), Scan16Traits::kThreads threads (512 at
//   Dk = 128); shared memory Scan16Traits::kBytes (Dk = 128, bf16, delta:
//   122 KB at BV = 16, 134 KB at BV = 32), three cp.async stages for delta
//   rules (the next two chunks' K_, W, U and decay load during a step), four
//   for additive ones.
// Included by chunk_forward.cuh after copy_tile_async.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cluster_copy.cuh"
#include "kernels/cuda/warp_mma.cuh"

namespace statescan::cuda::detail {

// kOut (delta rules): the output fused into the scan (forward v8, PERF_NOTES):
// kOutWarps more warps form O = Q^ S_c + A V' for the block's Dv columns
// while the state warps update S, from the rounded copy of S_c and V' the
// step already holds in shared memory; Q^ and A come in with the chunk's
// other tiles. No T-typed states or V' go through device memory and no
// output kernel runs.
template <typename T, int Dk, int Dv, int BV, bool kDelta, bool kOut = false>
struct Scan16Traits {
  static_assert(!std::is_same_v<T, float>, "fp32 tiles keep chunk_state_scan_kernel");
  static_assert(!kOut || kDelta, "the fused output reads the delta rule's copy of S");
  static constexpr int kMaxChunk = 64;
  // The state block is (Dk / 16) x (BV / 8) accumulator tiles of 16 x 8,
  // spread over up to 16 warps: latency, not arithmetic, bounds a step, and
  // each warp's chain of dependent steps shrinks with its share.
  static constexpr int kTiles = (Dk / 16) * (BV / 8);
  static constexpr int kWarps = kTiles < 16 ? kTiles : 16;  // the state warps
  // Output warps: warp w takes rows 16 (w / 2) .. + 16 of the chunk and half
  // the block's columns (kOutNT 8-column tiles).
  static constexpr int kOutWarps = kOut ? 2 * (kMaxChunk / 16) : 0;
  static constexpr int kOutNT = BV / 16;
  // With the output (forward v9): one more warp, the producer, fills the
  // stages with tensor copies multicast across the cluster of a head's column
  // blocks (cluster_copy.cuh); the others sync their steps on a named
  // barrier. (The scan without the output keeps its state warps' cp.async
  // loads: through the producer it ran 0.574 -> 0.636 ms, deltanet 32K, in
  // clusters of 2; the output-in-scan kernel 0.922 -> 0.718.)
  static constexpr bool kBulk = kOut;
  static constexpr int kComputeThreads = 32 * (kWarps + kOutWarps);
  static constexpr int kThreads = kComputeThreads + (kBulk ? 32 : 0);
  static constexpr int kOwnNT = kTiles / kWarps;          // column tiles per warp (1 or 2)
  static constexpr int kWarpsPerRow = (BV / 8) / kOwnNT;  // warps sharing a 16-row slab
  static constexpr int kLdK = Dk + 8;  // K_, W tiles (16 bytes of padding per row)
  static constexpr int kLdB = BV + 8;  // U, V', the copy of S
  static constexpr int kLdA = kMaxChunk + 8;  // A (fused output)
  static_assert(Dv % BV == 0 && BV % 16 == 0, "Dv block: whole pairs of 8-column tiles");
  static_assert(kOwnNT == 1 || kOwnNT == 2, "one or two column tiles per warp");
  // W S: (chunk / 16) x (BV / 8) tiles, one per warp (the rest wait).
  static_assert((kMaxChunk / 16) * (BV / 8) <= kWarps, "one W S tile per warp");
  // The copy of S, twice with the fused output: the output warps read S_c's
  // while the state warps write S_{c+1}'s.
  static constexpr size_t kSCopyOne = align_smem(sizeof(T) * Dk * kLdB);
  static constexpr size_t kSCopyBytes = (kOut ? 2 : 1) * kSCopyOne;
  static constexpr size_t kTileKBytes = align_smem(sizeof(T) * kMaxChunk * kLdK);
  static constexpr size_t kTileBBytes = align_smem(sizeof(T) * kMaxChunk * kLdB);
  static constexpr size_t kUOffset = (kDelta ? 2 : 1) * kTileKBytes;
  static constexpr size_t kTileABytes = align_smem(sizeof(T) * kMaxChunk * kLdA);
  // One stage: K_, W (delta), U, the decay, then Q^ and A (fused output).
  static constexpr size_t kQOffset = kUOffset + kTileBBytes + align_smem(sizeof(float) * Dk);
  static constexpr size_t kAOffset = kQOffset + kTileKBytes;
  static constexpr size_t kStageBytes = kOut ? kAOffset + kTileABytes : kQOffset;
  // Additive rules have no product on the path to a step's barrier, so a step
  // is as short as its loads allow: one more chunk in flight.
  static constexpr int kStages = kDelta ? 3 : 4;
  static constexpr size_t kVnBytes = kDelta ? kTileBBytes : 0;
  // The stages' full and empty mbarriers (kBulk) after the stages.
  static constexpr size_t kBarOffset =
      (kDelta ? kSCopyBytes : 0) + kVnBytes + kStages * kStageBytes;
  static constexpr size_t kBytes = kBarOffset + (kBulk ? align_smem(2 * kStages * 8) : 0);
  // Bytes the producer's copies land in one stage (kBulk) per chunk of
  // `chunk` rows: K_, W, Q^, U and A in whole padded rows, and the decay.
  static constexpr uint32_t stage_tx(int chunk, bool decay) {
    return static_cast<uint32_t>(sizeof(T) * chunk * (3 * kLdK + kLdB + kLdA) +
                                 (decay ? sizeof(float) * Dk : 0));
  }
  static_assert(kBytes <= 227 * 1024, "chunk_state_scan16_kernel exceeds Hopper shared memory");
};

// One warp's part of a scan's fp32 state block, held as kOwnNT mma.sync
// accumulator tiles (16 x 8) for a whole segment: v[j][0], v[j][1] at row
// r0 + g, v[j][2], v[j][3] at row r0 + g + 8, columns c0 + 8 j + i2 and + 1
// of the block (g = lane / 4, i2 = 2 (lane % 4)). Pointers passed in point at
// the block's first column of a row-major [Dk][Dv] state. Shared by the
// forward scan (S) and the reverse scan (dS).
template <int Dv, int kOwnNT>
struct WarpStateTiles {
  float v[kOwnNT][4];
  int r0, c0, g, i2;

  __device__ WarpStateTiles(int row0, int col0)
      : r0(row0), c0(col0), g((threadIdx.x & 31) / 4), i2(2 * (threadIdx.x & 3)) {}
  // Offset of the pair (j, e & ~1) in the state.
  __device__ int at(int j, int e) const { return (r0 + g + 4 * (e & 2)) * Dv + c0 + 8 * j + i2; }
  // Element-wise: a caller's state may be only 4-byte aligned. Null = zeros.
  __device__ void load(const float* state) {
#pragma unroll
    for (int j = 0; j < kOwnNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) v[j][e] = state != nullptr ? state[at(j, e) + (e & 1)] : 0.f;
  }
  __device__ void store(float* state) const {
#pragma unroll
    for (int j = 0; j < kOwnNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) state[at(j, e) + (e & 1)] = v[j][e];
  }
  // Pairs (8 bytes fp32, 4 bytes rounded to T): workspace arrays.
  template <typename T>
  __device__ void store_pairs(T* state) const {
#pragma unroll
    for (int j = 0; j < kOwnNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        if constexpr (std::is_same_v<T, float>)
          *reinterpret_cast<float2*>(state + at(j, e)) = make_float2(v[j][e], v[j][e + 1]);
        else
          *reinterpret_cast<uint32_t*>(state + at(j, e)) = pack2<T>(v[j][e], v[j][e + 1]);
      }
  }
  // The copy rounded to T in shared memory, block row r at copy + r * ld.
  template <typename T>
  __device__ void store_copy(T* copy, int ld) const {
#pragma unroll
    for (int j = 0; j < kOwnNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2)
        *reinterpret_cast<uint32_t*>(copy + (r0 + g + 4 * e) * ld + c0 + 8 * j + i2) =
            pack2<T>(v[j][e], v[j][e + 1]);
  }
  // v += X^T Y over K rows of X (stored [K][Dk]: the transposed operand, the
  // warp's rows r0..) and Y (stored [K][BV]: the warp's columns c0..), 16-bit
  // in shared memory: the scans' state updates S += K_^T V', dS += Q^^T dO.
  template <typename T>
  __device__ void add_xt_y(const T* x, int ldx, const T* y, int ldy, int K) {
    xt_y(v, x, ldx, y, ldy, K);
  }
  // v += scale X^T Y, the product formed in fp32 first: the raw linear
  // backward scan's dS += scale q^T dO, with q entering the product as given.
  template <typename T>
  __device__ void add_scaled_xt_y(float scale, const T* x, int ldx, const T* y, int ldy, int K) {
    float p[kOwnNT][4] = {};
    xt_y(p, x, ldx, y, ldy, K);
#pragma unroll
    for (int j = 0; j < kOwnNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) v[j][e] += scale * p[j][e];
  }
  template <typename T>
  __device__ void xt_y(float (&acc)[kOwnNT][4], const T* x, int ldx, const T* y, int ldy,
                       int K) const {
    if constexpr (kOwnNT == 1)
      warp_mm_16x8<T, true>(acc[0], x, ldx, y, ldy, r0, c0, K);
    else
      warp_mm_16xn<T, true, true, kOwnNT>(acc, x, ldx, y, ldy, r0, c0, K);
  }
  // v <- diag(factor) v (factor indexed by the block's rows).
  __device__ void scale_rows(const float* factor) {
    const float f0 = factor[r0 + g], f1 = factor[r0 + g + 8];
#pragma unroll
    for (int j = 0; j < kOwnNT; ++j) {
      v[j][0] *= f0;
      v[j][1] *= f0;
      v[j][2] *= f1;
      v[j][3] *= f1;
    }
  }
};

// kRaw (linear attention without the L2 norm: ForwardArgs::raw_additive):
// K_ = k and U = v exactly, so the chunks' tiles come straight from the
// inputs (rows past a sequence's end zeroed) and no prepare stage runs.
// kOut: the output fused in (Scan16Traits): o written for every chunk, no
// ws_states or ws_vnew (the host passes them null).
template <Decay kDecay, Rule kRule, typename T, int Dk, int Dv, int BV, int kChunk,
          bool kRaw = false, bool kOut = false>
__global__ void __launch_bounds__((Scan16Traits<T, Dk, Dv, BV, kRule == Rule::delta,
                                                kOut>::kThreads))
    chunk_state_scan16_kernel(const __grid_constant__ ForwardArgs a,
                              const __grid_constant__ ScanTileMaps maps) {
  static_assert(!kRaw || (kDecay == Decay::none && kRule == Rule::additive),
                "only ungated additive rules read their tiles from the inputs");
  static_assert(!kOut || !kRaw, "the fused output reads Q^ and A tiles");
  constexpr bool kDelta = kRule == Rule::delta;
  using Tr = Scan16Traits<T, Dk, Dv, BV, kDelta, kOut>;
  constexpr int kLdK = Tr::kLdK, kLdB = Tr::kLdB, kOwnNT = Tr::kOwnNT;
  constexpr int kStages = Tr::kStages, kWarps = Tr::kWarps;
  constexpr bool kBulk = Tr::kBulk;
  static_assert(kChunk == 16 || kChunk == 32 || kChunk == 64, "chunk in {16, 32, 64}");
  // Roles within a step. Delta rules: warps [0, kProdWarps) compute W S and
  // V' (one 16 x 8 tile each) while the others ("copy" warps) prefetch the
  // chunk after next, save their part of the entering state and apply the
  // decay; the product warps do those after the barrier, so the path to it
  // is the product alone. When every warp has a product tile (or for
  // additive rules, which have none) every warp does everything.
  constexpr int kProdWarps = kDelta ? (kChunk / 16) * (BV / 8) : 0;
  constexpr int kCopyWarp0 = kProdWarps < kWarps ? kProdWarps : 0;
  constexpr int kCopyThreads = 32 * (kWarps - kCopyWarp0);
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
  auto stage_q = [&](int st) { return reinterpret_cast<T*>(stage(st, Tr::kQOffset)); };
  auto stage_a = [&](int st) { return reinterpret_cast<T*>(stage(st, Tr::kAOffset)); };
  // The copy of S entering chunk cl (two alternating with the fused output).
  auto s_copy = [&](int cl) {
    return kOut ? sSop + (cl & 1) * (Tr::kSCopyOne / sizeof(T)) : sSop;
  };

  const int vb = blockIdx.x;
  const int64_t h = blockIdx.y, n = blockIdx.z, H = a.heads;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, i2 = 2 * (lane % 4);  // accumulator row, column pair (V')
  const int col0 = vb * BV;
  const bool prod_warp = warp < kProdWarps;
  // Output warps (kOut) come after the state warps and hold no state; the
  // producer warp (kBulk) comes last and only loads.
  const bool state_warp = warp < kWarps;
  const bool out_warp = kOut && warp >= kWarps && warp < kWarps + Tr::kOutWarps;
  const bool producer = kBulk && warp == kWarps + Tr::kOutWarps;
  const bool copy_warp = state_warp && warp >= kCopyWarp0;
  const int copy_tid = tid - 32 * kCopyWarp0;
  // This warp's part of the state block: rows r0 + g, r0 + g + 8, column
  // tiles c0 / 8 .. c0 / 8 + kOwnNT.
  const int r0 = 16 * (warp / Tr::kWarpsPerRow), c0 = 8 * kOwnNT * (warp % Tr::kWarpsPerRow);
  // Its W S tile (product warps).
  const int wi = warp / (BV / 8), wc = 8 * (warp % (BV / 8));

  int64_t first_chunk, num_chunks;
  segment_chunks(a, n, first_chunk, num_chunks);
  const int chunks = static_cast<int>(num_chunks);
  [[maybe_unused]] const SegmentTokens seg =
      kRaw || kOut ? segment_tokens(a, first_chunk, num_chunks) : SegmentTokens{};

  // Chunk c's tiles are tile (c H + h) of each workspace array: the loop
  // only advances element offsets by one chunk's stride.
  const int64_t first_tile = first_chunk * H + h;
  const T* ws_k = static_cast<const T*>(a.ws_k) + first_tile * kChunk * Dk;
  const T* ws_w = kDelta ? static_cast<const T*>(a.ws_w) + first_tile * kChunk * Dk : nullptr;
  const T* ws_u = static_cast<const T*>(a.ws_u) + first_tile * kChunk * Dv + col0;
  const float* ws_decay = a.ws_decay + first_tile * Dk;
  [[maybe_unused]] auto prefetch = [&](int cl, int st) {
    if constexpr (kRaw) {
      const int64_t token0 = seg.token0(cl, kChunk);
      const int length = seg.length(cl, kChunk);
      copy_chunk_rows_async<kCopyThreads, kChunk, Dk, Dk, T>(stage_k(st), kLdK, a.k, token0, H, h,
                                                             0, copy_tid, length);
      copy_chunk_rows_async<kCopyThreads, kChunk, BV, Dv, T>(stage_u(st), kLdB, a.v, token0, H, h,
                                                             col0, copy_tid, length);
      return;
    }
    const int64_t step = cl * H;
    copy_rows_async<kCopyThreads, kChunk, Dk>(stage_k(st), kLdK, ws_k + step * kChunk * Dk, Dk,
                                              copy_tid);
    if constexpr (kDelta)
      copy_rows_async<kCopyThreads, kChunk, Dk>(stage_w(st), kLdK, ws_w + step * kChunk * Dk, Dk,
                                                copy_tid);
    copy_rows_async<kCopyThreads, kChunk, BV>(stage_u(st), kLdB, ws_u + step * kChunk * Dv, Dv,
                                              copy_tid);
    if constexpr (kDecay != Decay::none)
      copy_rows_async<kCopyThreads, 1, Dk>(stage_decay(st), Dk, ws_decay + step * Dk, Dk, copy_tid);
  };
  // kBulk: the stages' barriers across the cluster of the head's column
  // blocks (one CTA when launched without a cluster).
  [[maybe_unused]] ClusterPipeline<kStages> pipe;
  if constexpr (kBulk) {
    pipe.init(smem_bytes + Tr::kBarOffset, tid, kChunk);
  } else {
    // Every thread commits one group per chunk (empty for threads that copy
    // nothing), so the wait counts below hold for all.
    for (int p = 0; p < kStages - 1; ++p) {
      if (p < chunks && copy_warp) prefetch(p, p);
      cp_async_commit();
    }
  }
  // The producer (kBulk): chunk cl into stage cl % kStages once every CTA of
  // the cluster is done with the chunk that stage held. This CTA's rows of
  // K_, W, Q^ and A go to every CTA; U (its own columns) and the decay only
  // here.
  [[maybe_unused]] auto produce = [&]() {
    constexpr uint32_t kTx = Tr::stage_tx(kChunk, kDecay != Decay::none);
    for (int cl = 0, st = 0; cl < chunks; ++cl, st = st + 1 == kStages ? 0 : st + 1) {
      if (!pipe.acquire(cl, st, lane, kTx)) continue;
      const int tile_row = static_cast<int>((first_tile + int64_t{cl} * H) * kChunk);
      pipe.shared_tile(stage_k(st), kLdK, maps.k, tile_row, st);
      pipe.shared_tile(stage_w(st), kLdK, maps.w, tile_row, st);
      pipe.shared_tile(stage_q(st), kLdK, maps.q, tile_row, st);
      pipe.shared_tile(stage_a(st), Tr::kLdA, maps.a, tile_row, st);
      tensor_copy_to_shared(stage_u(st), &maps.u, col0, tile_row, pipe.full + st);
      if constexpr (kDecay != Decay::none)
        bulk_copy_to_shared(stage_decay(st), ws_decay + int64_t{cl} * H * Dk, Dk * sizeof(float),
                            pipe.full + st);
    }
  };
  // The step barriers: the compute warps only (the producer runs ahead).
  auto step_barrier = [] { named_barrier_sync(1, Tr::kComputeThreads); };

  WarpStateTiles<Dv, kOwnNT> s(r0, c0);
  constexpr int64_t kStateElems = static_cast<int64_t>(Dk) * Dv;
  const int64_t state_base = (n * H + h) * kStateElems + col0;
  if (state_warp) s.load(a.initial_state != nullptr ? a.initial_state + state_base : nullptr);
  // The rounded copy of this warp's part of the state entering chunk cl
  // (read by every warp's W S, and by the output warps).
  auto store_copy = [&](int cl) {
    if constexpr (kDelta)
      if (state_warp) s.store_copy(s_copy(cl), kLdB);
  };
  store_copy(0);

  // Saves the state entering chunk cl (fp32 for the backward, rounded to T
  // for the output kernel: the values the products read), then applies the
  // chunk's decay: S <- diag(e^{b_C}) S.
  float* chunk_states =
      a.chunk_states != nullptr ? a.chunk_states + first_tile * kStateElems + col0 : nullptr;
  T* ws_states = a.ws_states != nullptr
                     ? static_cast<T*>(a.ws_states) + first_tile * kStateElems + col0
                     : nullptr;
  auto save_and_decay = [&](int64_t state_off, int st) {
    if (chunk_states != nullptr) s.store_pairs(chunk_states + state_off);
    if (ws_states != nullptr) s.store_pairs(ws_states + state_off);
    if constexpr (kDecay != Decay::none) s.scale_rows(stage_decay(st));
  };
  T* ws_vnew =
      a.ws_vnew != nullptr ? static_cast<T*>(a.ws_vnew) + first_tile * kChunk * Dv + col0 : nullptr;

  if constexpr (kBulk)
    if (producer) produce();
  for (int cl = 0, st = 0; !producer && cl < chunks;
       ++cl, st = st + 1 == kStages ? 0 : st + 1) {
    const int64_t state_off = cl * H * kStateElems;
    const int prev_st = st == 0 ? kStages - 1 : st - 1;
    if constexpr (kBulk) {
      pipe.wait(cl, st);
      // The copy of S visible to every warp; every warp is done with the
      // previous chunk: its stage is free here, so tell the cluster.
      step_barrier();
      if (cl > 0 && warp == kCopyWarp0) pipe.release(prev_st, lane);
    } else {
      // One group per chunk, committed in order: chunk cl's is complete once
      // at most kStages - 2 younger ones are pending.
      cp_async_wait<kStages - 2>();
      // This chunk's stage and the copy of S visible to every warp; every
      // warp is done with the previous chunk, so its stage can be refilled.
      step_barrier();
      if (copy_warp && cl + kStages - 1 < chunks) prefetch(cl + kStages - 1, prev_st);
      cp_async_commit();
    }

    const T* vnew = stage_u(st);  // additive rules: V' = U
    // Output warps (kOut): O = Q^ S_c + A V' for the chunk's valid rows, in
    // the two halves of the step, so that neither half gets longer: Q^ S_c
    // (a K = Dk product, as W S_c on the product warps) before the V'
    // barrier, A V' (K <= C, as the state update) after it.
    [[maybe_unused]] float out_acc[kOut ? Tr::kOutNT : 1][4] = {};
    [[maybe_unused]] const int out_m0 = 16 * ((warp - kWarps) / 2);
    [[maybe_unused]] const int out_n0 = ((warp - kWarps) % 2) * (BV / 2);
    [[maybe_unused]] const int out_rows = kOut ? seg.length(cl, kChunk) : 0;
    if constexpr (kOut) {
      if (out_warp && out_m0 < out_rows) {
        if constexpr (Tr::kOutNT == 1)
          warp_mm_16x8<T, false>(out_acc[0], stage_q(st), kLdK, s_copy(cl), kLdB, out_m0, out_n0,
                                 Dk);
        else
          warp_mm_16xn<T, false, true, Tr::kOutNT>(out_acc, stage_q(st), kLdK, s_copy(cl), kLdB,
                                                   out_m0, out_n0, Dk);
      }
    }
    if constexpr (kDelta) {
      if (!prod_warp && state_warp) save_and_decay(state_off, st);
      // V' = U - W S, rounded to T once (the update below and the output
      // read the same values).
      if (prod_warp) {
        float p[4] = {0.f, 0.f, 0.f, 0.f};
        warp_mm_16x8<T, false>(p, stage_w(st), kLdK, s_copy(cl), kLdB, 16 * wi, wc, Dk);
        const T* u = stage_u(st);
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int off = (16 * wi + g + 4 * e) * kLdB + wc + i2;
          const float2 x = unpack2<T>(*reinterpret_cast<const uint32_t*>(u + off));
          *reinterpret_cast<uint32_t*>(sVn + off) = pack2<T>(x.x - p[e], x.y - p[e + 1]);
        }
      }
      step_barrier();  // V' complete; every read of the copy of S done
      if (prod_warp) save_and_decay(state_off, st);
      vnew = sVn;
    } else {
      save_and_decay(state_off, st);
    }

    if constexpr (kOut) {
      // + A V' (V' is rewritten only after the next step's first barrier,
      // this stage's Q^ and A refilled only after it too; the state warps
      // write S_{c+1}'s copy into the other buffer meanwhile).
      if (out_warp && out_m0 < out_rows) {
        constexpr int kNT = Tr::kOutNT;
        // A is zero right of the diagonal block.
        if constexpr (kNT == 1)
          warp_mm_16x8<T, false>(out_acc[0], stage_a(st), Tr::kLdA, vnew, kLdB, out_m0, out_n0,
                                 out_m0 + 16);
        else
          warp_mm_16xn<T, false, true, kNT>(out_acc, stage_a(st), Tr::kLdA, vnew, kLdB, out_m0,
                                            out_n0, out_m0 + 16);
        T* o = static_cast<T*>(a.o) + (seg.token0(cl, kChunk) * H + h) * Dv + col0 + out_n0 + i2;
#pragma unroll
        for (int j = 0; j < kNT; ++j)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const int r = out_m0 + g + 8 * hr;
            if (r < out_rows)
              *reinterpret_cast<uint32_t*>(o + static_cast<int64_t>(r) * H * Dv + 8 * j) =
                  pack2<T>(out_acc[j][2 * hr], out_acc[j][2 * hr + 1]);
          }
      }
    }
    // S <- S + K_^T V' (K_ stored [t][d]: the transposed operand).
    if (state_warp) s.add_xt_y(stage_k(st), kLdK, vnew, kLdB, kChunk);
    store_copy(cl + 1);
    if constexpr (kDelta) {
      if (ws_vnew != nullptr && copy_warp) {
        // V' for the output kernel, 16 bytes per thread per step.
        constexpr int kVec = 16 / sizeof(T), kPerRow = BV / kVec;
        constexpr int kIters = (kChunk * kPerRow + kCopyThreads - 1) / kCopyThreads;
        T* out = ws_vnew + cl * H * kChunk * Dv;
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
          const int idx = copy_tid + it * kCopyThreads;
          const int i = idx / kPerRow, j = (idx % kPerRow) * kVec;
          if (i < kChunk)
            *reinterpret_cast<uint4*>(out + (i * Dv + j)) =
                *reinterpret_cast<const uint4*>(sVn + i * kLdB + j);
        }
      }
    }
  }
  if constexpr (!kBulk) cp_async_wait<0>();
  if (a.final_state != nullptr && state_warp) s.store(a.final_state + state_base);
  // No CTA leaves while the cluster's arrivals may still target it.
  if constexpr (kBulk) pipe.finish();
}

}  // namespace statescan::cuda::detail
