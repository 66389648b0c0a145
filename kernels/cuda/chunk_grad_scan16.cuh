// chunk_grad_scan16_kernel (backward v4): chunk_grad_scan_kernel_tc for
// 16-bit tiles in the form of the forward's chunk_state_scan16_kernel
// (chunk_scan16.cuh): the fp32 dS block lives in registers as mma.sync
// accumulators (one or two 16 x 8 tiles per warp, up to 16 warps), operands
// come in with ldmatrix, the chunk is a template parameter, and within a
// step the dV' warps go straight to the barrier while the others prefetch
// the next chunk's tiles, save their part of dS and apply the decay.
//
// The arithmetic is chunk_grad_scan_kernel_tc's, walking a segment's chunks
// backwards from d_final_state (or 0):
//   ws_ds[c] = dS (= dS_{c+1}, fp32),
//   dV' = A^T dO + K_ dS            (delta rules; dS read as its T copy),
//   dS <- diag(gamma) dS + Q^^T dO - W^T dV'   (-dV' rounded to T once),
// and dS at the segment's start is d_initial_state. Additive rules have no
// dV' term, and so one barrier per step.
//   grid (Dv / BV, H, N segments), GradScan16Traits::kThreads threads, shared
//   memory GradScan16Traits::kBytes (D = 128, bf16, BV = 16, delta: 200 KB);
//   three tile buffers for delta rules (the next two chunks' tiles load
//   during a step), four for additive ones.
// Included by chunk_backward.cuh after BackwardArgs.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/chunk_scan16.cuh"
#include "kernels/cuda/warp_mma.cuh"

namespace statescan::cuda::detail {

template <typename T, int Dk, int Dv, int BV, bool kDelta>
struct GradScan16Traits {
  using Warps = Scan16Traits<T, Dk, Dv, BV, kDelta>;  // the same split of the state block
  // Delta rules (backward b16): one more warp, the producer, loads A, K_, W,
  // Q^ and gamma with tensor copies, the first four multicast across a
  // cluster of the head's column blocks (as the forward's output-in-scan
  // kernel, cluster_copy.cuh); dO, whose rows past a sequence's end must read
  // as zeros, stays with the state warps' cp.async.
  static constexpr bool kBulk = kDelta;
  static constexpr int kComputeThreads = Warps::kComputeThreads;
  static constexpr int kThreads = kComputeThreads + (kBulk ? 32 : 0);
  static constexpr int kMaxChunk = 64;
  static constexpr int kLdK = Dk + 8;         // Q^, K_, W (16-bit, 16 bytes of padding)
  static constexpr int kLdC = kMaxChunk + 8;  // A
  static constexpr int kLdB = BV + 8;         // dO, -dV', the copy of dS
  // Tile buffers: additive rules have no product on the path to a step's
  // barrier, so a step is as short as its loads allow and more chunks in
  // flight pay (the raw linear scan at 32K on an H200: 2 -> 4 buffers,
  // 0.70 -> 0.46 ms); delta rules fit three (D = 128: 2 -> 3 buffers,
  // deltanet 1.00 -> 0.87 ms).
  static constexpr int kStages = kDelta ? 3 : 4;
  static constexpr size_t kABytes = kDelta ? align_smem(sizeof(T) * kMaxChunk * kLdC) : 0;
  static constexpr size_t kKBytes = align_smem(sizeof(T) * kMaxChunk * kLdK);
  static constexpr size_t kDOBytes = align_smem(sizeof(T) * kMaxChunk * kLdB);
  static constexpr size_t kGammaBytes = align_smem(sizeof(float) * Dk);
  // A, K_, W (delta rules) and Q^, dO, gamma per stage.
  static constexpr size_t kOffQ = kDelta ? kABytes + 2 * kKBytes : 0;
  static constexpr size_t kOffO = kOffQ + kKBytes, kOffG = kOffO + kDOBytes;
  static constexpr size_t kStageBytes = kOffG + kGammaBytes;
  static constexpr size_t kCopyBytes = kDelta ? align_smem(sizeof(T) * Dk * kLdB) : 0;
  static constexpr size_t kDVBytes = kDelta ? align_smem(sizeof(T) * kMaxChunk * kLdB) : 0;
  // The stages' full and empty mbarriers (kBulk) after everything else.
  static constexpr size_t kBarOffset = kStages * kStageBytes + kCopyBytes + kDVBytes;
  static constexpr size_t kBytes = kBarOffset + (kBulk ? align_smem(2 * kStages * 8) : 0);
  static_assert(kBytes <= 227 * 1024, "chunk_grad_scan16_kernel exceeds Hopper shared memory");
  // Bytes the producer's copies land in one stage (kBulk): whole padded rows.
  static constexpr uint32_t stage_tx(int chunk, bool decay) {
    return static_cast<uint32_t>(sizeof(T) * chunk * (kLdC + 3 * kLdK) +
                                 (decay ? sizeof(float) * Dk : 0));
  }
};

// kRaw (linear attention without the L2 norm, ForwardArgs::raw_additive):
// Q^ = scale q, so q comes straight from the inputs (rows past the sequence's
// end zeroed), dS += scale (q^T dO) with the scale applied to the fp32
// product, and dS_{c+1} is saved rounded to T (ws_ds_t) for
// chunk_grad_raw16_kernel, whose products read it in T anyway (as other
// ungated variants save it for the state products: BackwardArgs::ws_ds_t).
template <Decay kDecay, Rule kRule, typename T, int Dk, int Dv, int BV, int kChunk,
          bool kRaw = false>
__global__ void __launch_bounds__((GradScan16Traits<T, Dk, Dv, BV, kRule == Rule::delta>::kThreads))
    chunk_grad_scan16_kernel(const __grid_constant__ BackwardArgs a,
                             const __grid_constant__ ScanTileMaps maps) {
  static_assert(!kRaw || (kDecay == Decay::none && kRule == Rule::additive),
                "only ungated additive rules read q from the inputs");
  constexpr bool kDelta = kRule == Rule::delta;
  using Tr = GradScan16Traits<T, Dk, Dv, BV, kDelta>;
  using Wr = typename Tr::Warps;
  constexpr int kLdK = Tr::kLdK, kLdC = Tr::kLdC, kLdB = Tr::kLdB, kOwnNT = Wr::kOwnNT;
  constexpr int kStages = Tr::kStages, kWarps = Wr::kWarps;
  constexpr bool kBulk = Tr::kBulk;
  static_assert(kChunk == 16 || kChunk == 32 || kChunk == 64, "chunk in {16, 32, 64}");
  // Roles as in chunk_state_scan16_kernel: product warps compute one dV'
  // tile each; copy warps prefetch, save and decay before the barrier.
  constexpr int kProdWarps = kDelta ? (kChunk / 16) * (BV / 8) : 0;
  constexpr int kCopyWarp0 = kProdWarps < kWarps ? kProdWarps : 0;
  constexpr int kCopyThreads = 32 * (kWarps - kCopyWarp0);
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  unsigned char* stages = smem_bytes;
  auto stage = [&](int st, size_t offset) { return stages + st * Tr::kStageBytes + offset; };
  auto stA = [&](int st) { return reinterpret_cast<T*>(stage(st, 0)); };
  auto stK = [&](int st) { return reinterpret_cast<T*>(stage(st, Tr::kABytes)); };
  auto stW = [&](int st) { return reinterpret_cast<T*>(stage(st, Tr::kABytes + Tr::kKBytes)); };
  auto stQ = [&](int st) { return reinterpret_cast<T*>(stage(st, Tr::kOffQ)); };
  auto stO = [&](int st) { return reinterpret_cast<T*>(stage(st, Tr::kOffO)); };
  auto stGamma = [&](int st) { return reinterpret_cast<float*>(stage(st, Tr::kOffG)); };
  T* sdSop = reinterpret_cast<T*>(smem_bytes + kStages * Tr::kStageBytes);
  T* sdVneg = reinterpret_cast<T*>(smem_bytes + kStages * Tr::kStageBytes + Tr::kCopyBytes);

  const ForwardArgs& f = a.f;
  const int vb = blockIdx.x;
  const int64_t h = blockIdx.y, n = blockIdx.z, H = f.heads;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, i2 = 2 * (lane % 4);
  const int col0 = vb * BV;
  const bool prod_warp = warp < kProdWarps;
  const bool producer = kBulk && warp == kWarps;  // last; holds no dS
  const bool copy_warp = warp >= kCopyWarp0 && !producer;
  const int copy_tid = tid - 32 * kCopyWarp0;
  const int r0 = 16 * (warp / Wr::kWarpsPerRow), c0 = 8 * kOwnNT * (warp % Wr::kWarpsPerRow);
  const int wi = warp / (BV / 8), wc = 8 * (warp % (BV / 8));  // dV' tile (product warps)

  int64_t first_chunk, num_chunks;
  segment_chunks(f, n, first_chunk, num_chunks);
  const int chunks = static_cast<int>(num_chunks);
  const int64_t first_tile = first_chunk * H + h;
  const SegmentTokens seg = segment_tokens(f, first_chunk, num_chunks);

  // Queues chunk cl's dO into buffer st, and its Q^ (or q) and gamma unless
  // the producer loads them (kBulk: delta rules, whose A, K_ and W it loads
  // too); copy warps, the caller commits. dO rows past the chunk's end are
  // zeros.
  auto prefetch = [&](int cl, int st) {
    const int64_t tile = first_tile + cl * H;
    const int64_t token0 = seg.token0(cl, kChunk);
    const int length = seg.length(cl, kChunk);
    if constexpr (kRaw)
      copy_chunk_rows_async<kCopyThreads, kChunk, Dk, Dk, T>(stQ(st), kLdK, f.q, token0, H, h, 0,
                                                             copy_tid, length);
    else if constexpr (!kBulk)
      copy_rows_async<kCopyThreads, kChunk, Dk>(
          stQ(st), kLdK, static_cast<const T*>(f.ws_q) + tile * kChunk * Dk, Dk, copy_tid);
    copy_chunk_rows_async<kCopyThreads, kChunk, BV, Dv, T>(stO(st), kLdB, a.d_o, token0, H, h, col0,
                                                           copy_tid, length);
    if constexpr (kDecay != Decay::none && !kBulk)
      copy_rows_async<kCopyThreads, 1, Dk>(stGamma(st), Dk, f.ws_decay + tile * Dk, Dk, copy_tid);
  };
  // kBulk: the stages' barriers across the cluster (cluster_copy.cuh's
  // protocol; step i is chunk chunks - 1 - i).
  [[maybe_unused]] ClusterPipeline<kStages> pipe;
  if constexpr (kBulk) pipe.init(smem_bytes + Tr::kBarOffset, tid, kChunk);
  // Step i takes chunk chunks - 1 - i from buffer i % kStages; every thread
  // commits one group per chunk (empty for threads that copy nothing).
  if (!producer)
    for (int p = 0; p < kStages - 1; ++p) {
      if (p < chunks && copy_warp) prefetch(chunks - 1 - p, p);
      cp_async_commit();
    }
  // The producer (kBulk): step i's A, K_, W, Q^ (this CTA's rows, to every
  // CTA of the cluster) and gamma into buffer i % kStages once every CTA is
  // done with the step that buffer held.
  [[maybe_unused]] auto produce = [&]() {
    constexpr uint32_t kTx = Tr::stage_tx(kChunk, kDecay != Decay::none);
    for (int i = 0, st = 0; i < chunks; ++i, st = st + 1 == kStages ? 0 : st + 1) {
      if (!pipe.acquire(i, st, lane, kTx)) continue;
      const int64_t tile = first_tile + int64_t{chunks - 1 - i} * H;
      const int tile_row = static_cast<int>(tile * kChunk);
      pipe.shared_tile(stA(st), kLdC, maps.a, tile_row, st);
      pipe.shared_tile(stK(st), kLdK, maps.k, tile_row, st);
      pipe.shared_tile(stW(st), kLdK, maps.w, tile_row, st);
      pipe.shared_tile(stQ(st), kLdK, maps.q, tile_row, st);
      if constexpr (kDecay != Decay::none)
        bulk_copy_to_shared(stGamma(st), f.ws_decay + tile * Dk, Dk * sizeof(float),
                            pipe.full + st);
    }
  };
  auto step_barrier = [] { named_barrier_sync(1, Tr::kComputeThreads); };

  WarpStateTiles<Dv, kOwnNT> ds(r0, c0);
  constexpr int64_t kStateElems = static_cast<int64_t>(Dk) * Dv;
  const int64_t state_base = (n * H + h) * kStateElems + col0;
  if (!producer) ds.load(a.d_final_state != nullptr ? a.d_final_state + state_base : nullptr);
  auto store_copy = [&] {
    if constexpr (kDelta)
      if (!producer) ds.store_copy(sdSop, kLdB);
  };
  store_copy();

  float* ws_ds = a.ws_ds != nullptr ? a.ws_ds + first_tile * kStateElems + col0 : nullptr;
  T* ws_ds_t =
      a.ws_ds_t != nullptr ? static_cast<T*>(a.ws_ds_t) + first_tile * kStateElems + col0 : nullptr;
  // Saves dS (= dS_{c+1}) for chunk cl, then dS <- diag(gamma) dS.
  auto save_and_decay = [&](int cl, int st) {
    if (ws_ds != nullptr) ds.store_pairs(ws_ds + cl * H * kStateElems);
    if (ws_ds_t != nullptr) ds.store_pairs(ws_ds_t + cl * H * kStateElems);
    if constexpr (kDecay != Decay::none) ds.scale_rows(stGamma(st));
  };

  if constexpr (kBulk)
    if (producer) produce();
  for (int cl = chunks - 1, st = 0; !producer && cl >= 0;
       --cl, st = st + 1 == kStages ? 0 : st + 1) {
    const int prev_st = st == 0 ? kStages - 1 : st - 1;
    // This chunk's group is complete once at most kStages - 2 younger ones
    // are pending.
    cp_async_wait<kStages - 2>();
    if constexpr (kBulk) pipe.wait(chunks - 1 - cl, st);
    // Its tiles and the copy of dS visible to every warp; every warp is done
    // with the previous (later) chunk, so that buffer can be refilled (kBulk:
    // tell the cluster).
    step_barrier();
    if constexpr (kBulk)
      if (cl < chunks - 1 && warp == kCopyWarp0) pipe.release(prev_st, lane);
    if (copy_warp && cl - (kStages - 1) >= 0) prefetch(cl - (kStages - 1), prev_st);
    cp_async_commit();

    if constexpr (kDelta) {
      if (!prod_warp) save_and_decay(cl, st);
      if (prod_warp) {
        // dV' = A^T dO + K_ dS (A^T is zero above its diagonal block: k from
        // 16 wi), stored as -dV' rounded to T.
        float dv[4] = {0.f, 0.f, 0.f, 0.f};
        warp_mm_16x8<T, true>(dv, stA(st) + 16 * wi * kLdC, kLdC, stO(st) + 16 * wi * kLdB, kLdB,
                              16 * wi, wc, kChunk - 16 * wi);
        warp_mm_16x8<T, false>(dv, stK(st), kLdK, sdSop, kLdB, 16 * wi, wc, Dk);
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          *reinterpret_cast<uint32_t*>(sdVneg + (16 * wi + g + 4 * e) * kLdB + wc + i2) =
              pack2<T>(-dv[e], -dv[e + 1]);
      }
      step_barrier();  // -dV' complete; every read of the copy of dS done
      if (prod_warp) save_and_decay(cl, st);
    } else {
      save_and_decay(cl, st);
    }

    // dS += Q^^T dO (+ W^T (-dV')): Q^, W stored [t][d], the transposed operands.
    if constexpr (kRaw)
      ds.add_scaled_xt_y(f.scale, stQ(st), kLdK, stO(st), kLdB, kChunk);
    else
      ds.add_xt_y(stQ(st), kLdK, stO(st), kLdB, kChunk);
    if constexpr (kDelta) ds.add_xt_y(stW(st), kLdK, sdVneg, kLdB, kChunk);
    store_copy();
  }
  cp_async_wait<0>();
  if (a.d_initial_state != nullptr && !producer) ds.store(a.d_initial_state + state_base);
  // No CTA leaves while the cluster's arrivals may still target it.
  if constexpr (kBulk) pipe.finish();
}

}  // namespace statescan::cuda::detail
