// Linear attention's forward in chunk groups (raw path, 16-bit, no L2 norm;
// the default for it: ForwardArgs::group_chunks > 0, STATESCAN_LINEAR=scan
// keeps the sequential raw scan).
//
// Why: without a gate the state update is a plain sum, S_c = S_0 + sum_{c' < c}
// k_c'^T v_c', so the 512-step chain of the raw scan (chunk_scan16.cuh, ~0.7 us
// a step on an H200) is not needed: the chunks split into groups of G, and
//   1. chunk_group_sums16_kernel<..., false>: each group's sum of k^T v (fp32,
//      in registers; every group in parallel);
//   2. group_prefix_kernel: per (segment, head) the exclusive prefix of those
//      sums from the initial state (in place: group g's slot becomes the state
//      entering it) and the final state;
//   3. chunk_forward_grouped16_kernel: each group from its entering state
//      runs its G chunks as the raw scan and output kernels would, fused: o =
//      scale (q S_c + mask(q k^T) v) with S_c's 16-bit copy in shared memory,
//      then S += k^T v in registers; the fp32 chunk states when the caller
//      asks (the backward's).
//   A scan without the output (the backward's recompute of the chunk states,
//   the CP summary's final state) runs 1 and 2, then, for chunk states,
//   chunk_group_sums16_kernel<..., true> in place of 3: the same fp32 sums in
//   the same order, so recomputed states equal the saved ones bitwise.
// The 16-bit states never reach global memory (the raw scan wrote them and
// the output kernel read them back: 2 x 268 MB at 32K, H = 16, D = 128) and
// the chains are G steps long. The arithmetic is the raw path's (S in fp32,
// the products read its copy rounded to T, the scale on the fp32 result); only
// the order of the fp32 sums that build S differs.
// H200, bf16, H = 16, D = 128 (2026-12-02): 32K 0.588 -> 0.407 ms, 128K 2.339
// -> 1.602 ms against the raw scan + output kernels.
//   grids (max groups per segment, H, segments), 512 threads; shared memory
//   Grouped16Traits::kSumBytes / kBytes (D = 128, bf16: 70 KB / 148 KB).
// Included by chunk_forward.cuh after the scan and output kernels.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/warp_mma.cuh"

namespace statescan::cuda::detail {

template <typename T, int Dk, int Dv>
struct Grouped16Traits {
  static_assert(!std::is_same_v<T, float>, "16-bit inputs only");
  static constexpr int kMaxChunk = 64, kWarps = 16, kThreads = 32 * kWarps;
  // The whole Dk x Dv state over the 16 warps as 16 x 8 accumulator tiles.
  static constexpr int kTiles = (Dk / 16) * (Dv / 8);
  static constexpr int kOwnNT = kTiles / kWarps;          // 8 at D = 128, 2 at D = 64
  static constexpr int kWarpsPerRow = (Dv / 8) / kOwnNT;  // warps sharing a 16-row slab
  static_assert(kOwnNT % 2 == 0 && kOwnNT * kWarps == kTiles, "whole n8 pairs per warp");
  static constexpr int kLdK = Dk + 8, kLdV = Dv + 8, kLdC = kMaxChunk + 8;
  static constexpr size_t kKBytes = align_smem(sizeof(T) * kMaxChunk * kLdK);  // q or k
  static constexpr size_t kVBytes = align_smem(sizeof(T) * kMaxChunk * kLdV);
  // Group sums: two stages of (k, v).
  static constexpr size_t kSumStage = kKBytes + kVBytes;
  static constexpr size_t kSumBytes = 2 * kSumStage;
  // Fused forward: two stages of (q, k, v), the 16-bit copy of S, A.
  static constexpr size_t kStage = 2 * kKBytes + kVBytes;
  static constexpr size_t kSBytes = align_smem(sizeof(T) * Dk * kLdV);
  static constexpr size_t kABytes = align_smem(sizeof(T) * kMaxChunk * kLdC);
  static constexpr size_t kBytes = 2 * kStage + kSBytes + kABytes;
  static_assert(kBytes <= 227 * 1024, "chunk_forward_grouped16_kernel exceeds shared memory");
};

// Segment n's groups: its chunks [gi G, min(count, (gi + 1) G)) form group gi,
// whose fp32 Dk x Dv slot in ws_group_sums is group_first(n) + gi.
struct SegmentGroups {
  int64_t first_chunk = 0, count = 0, first_slot = 0;
  int groups = 0;
};
__device__ __forceinline__ SegmentGroups segment_groups(const ForwardArgs& a, int64_t n) {
  SegmentGroups s;
  segment_chunks(a, n, s.first_chunk, s.count);
  const int64_t G = a.group_chunks;
  s.groups = static_cast<int>((s.count + G - 1) / G);
  s.first_slot = a.group_table != nullptr ? a.group_table[n] : n * a.max_segment_groups;
  return s;
}

// Block (gi, h, n)'s work: group gi of segment n, its chunks [c_begin, c_end)
// (segment-relative); inactive past the segment's last group.
struct GroupWork {
  SegmentGroups sg;
  SegmentTokens seg;
  int c_begin = 0, c_end = 0;
  bool active = false;
};
__device__ __forceinline__ GroupWork group_work(const ForwardArgs& a, int64_t gi, int64_t n) {
  GroupWork w;
  w.sg = segment_groups(a, n);
  if (gi >= w.sg.groups) return w;
  w.seg = segment_tokens(a, w.sg.first_chunk, w.sg.count);
  const int64_t G = a.group_chunks, end = (gi + 1) * G;
  w.c_begin = static_cast<int>(gi * G);
  w.c_end = static_cast<int>(w.sg.count < end ? w.sg.count : end);
  w.active = true;
  return w;
}

// Head h's fp32 Dk x Dv slot of group gi in ws_group_sums, and its fp32 state
// entering the segment's first chunk in chunk_states (chunk c at + c H Dk Dv;
// null without chunk_states): the same addresses in every grouped kernel.
template <int Dk, int Dv>
__device__ __forceinline__ float* group_slot(const ForwardArgs& a, const GroupWork& w, int64_t gi,
                                             int64_t h) {
  constexpr int64_t kStateElems = static_cast<int64_t>(Dk) * Dv;
  return a.ws_group_sums + ((w.sg.first_slot + gi) * a.heads + h) * kStateElems;
}
template <int Dk, int Dv>
__device__ __forceinline__ float* group_chunk_states(const ForwardArgs& a, const GroupWork& w,
                                                     int64_t h) {
  constexpr int64_t kStateElems = static_cast<int64_t>(Dk) * Dv;
  return a.chunk_states != nullptr ? a.chunk_states + (w.sg.first_chunk * a.heads + h) * kStateElems
                                   : nullptr;
}

// Warp `warp`'s part of the Dk x Dv state (Grouped16Traits' layout).
template <typename Tr, int Dv>
__device__ __forceinline__ WarpStateTiles<Dv, Tr::kOwnNT> group_state_tiles(int warp) {
  return WarpStateTiles<Dv, Tr::kOwnNT>(16 * (warp / Tr::kWarpsPerRow),
                                        8 * Tr::kOwnNT * (warp % Tr::kWarpsPerRow));
}

// Chunk c of a segment (all D columns of head h of a [tokens, H, D] 16-bit
// input) into a tile by cp.async, rows past the sequence's end zeroed.
template <int kThreads, int kChunk, int D, typename T>
__device__ __forceinline__ void copy_segment_chunk_async(T* dst, int ld, const void* src,
                                                         const SegmentTokens& seg, int c, int64_t H,
                                                         int64_t h, int tid) {
  copy_chunk_rows_async<kThreads, kChunk, D, D, T>(dst, ld, src, seg.token0(c, kChunk), H, h, 0,
                                                   tid, seg.length(c, kChunk));
}

// kStates = false: each group's sum of k^T v into its slot of ws_group_sums.
// kStates = true (after group_prefix_kernel): from the state entering the
// group (its slot), the fp32 state entering each of its chunks into
// chunk_states, summed as chunk_forward_grouped16_kernel sums them.
template <typename T, int Dk, int Dv, int kChunk, bool kStates>
__global__ void __launch_bounds__(512)
    chunk_group_sums16_kernel(const __grid_constant__ ForwardArgs a) {
  using Tr = Grouped16Traits<T, Dk, Dv>;
  constexpr int kLdK = Tr::kLdK, kLdV = Tr::kLdV, kThreads = Tr::kThreads;
  static_assert(kChunk == 16 || kChunk == 32 || kChunk == 64, "chunk in {16, 32, 64}");
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  auto stK = [&](int st) { return reinterpret_cast<T*>(smem_bytes + st * Tr::kSumStage); };
  auto stV = [&](int st) {
    return reinterpret_cast<T*>(smem_bytes + st * Tr::kSumStage + Tr::kKBytes);
  };
  const int64_t gi = blockIdx.x, h = blockIdx.y, H = a.heads;
  const GroupWork w = group_work(a, gi, blockIdx.z);
  if (!w.active) return;  // the whole block: no barrier is skipped by a part of it
  const int tid = threadIdx.x, warp = tid / 32;

  auto prefetch = [&](int c, int st) {
    copy_segment_chunk_async<kThreads, kChunk, Dk>(stK(st), kLdK, a.k, w.seg, c, H, h, tid);
    copy_segment_chunk_async<kThreads, kChunk, Dv>(stV(st), kLdV, a.v, w.seg, c, H, h, tid);
  };
  constexpr int64_t kStateElems = static_cast<int64_t>(Dk) * Dv;
  float* slot = group_slot<Dk, Dv>(a, w, gi, h);
  float* chunk_states = kStates ? group_chunk_states<Dk, Dv>(a, w, h) : nullptr;
  auto s = group_state_tiles<Tr, Dv>(warp);
  s.load(kStates ? slot : nullptr);  // the entering state, or zeros
  prefetch(w.c_begin, 0);
  cp_async_commit();
  for (int c = w.c_begin, st = 0; c < w.c_end; ++c, st ^= 1) {
    cp_async_wait<0>();
    // Chunk c's stage visible to every warp; every warp is done with chunk
    // c - 1's, which the next prefetch refills.
    __syncthreads();
    if (c + 1 < w.c_end) prefetch(c + 1, st ^ 1);
    cp_async_commit();
    if constexpr (kStates) s.store_pairs(chunk_states + c * H * kStateElems);
    s.add_xt_y(stK(st), kLdK, stV(st), kLdV, kChunk);
  }
  cp_async_wait<0>();
  if constexpr (!kStates) s.store_pairs(slot);
}

// One thread per state element and (head, segment): the exclusive prefix over
// the segment's groups, in place, from the initial state; the final state.
template <int Dk, int Dv>
__global__ void __launch_bounds__(256) group_prefix_kernel(const __grid_constant__ ForwardArgs a) {
  constexpr int64_t kStateElems = static_cast<int64_t>(Dk) * Dv;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t h = blockIdx.y, n = blockIdx.z, H = a.heads;
  if (e >= kStateElems) return;
  const SegmentGroups sg = segment_groups(a, n);
  const int64_t state = (n * H + h) * kStateElems + e;
  float run = a.initial_state != nullptr ? a.initial_state[state] : 0.f;
  float* slot = a.ws_group_sums + sg.first_slot * H * kStateElems + h * kStateElems + e;
  const int64_t stride = H * kStateElems;  // one group slot
  // Each group's sum is loaded one group ahead of its store, so the loads
  // are not serialised behind the stores to the same array.
  float next = sg.groups > 0 ? slot[0] : 0.f;
  for (int g = 0; g < sg.groups; ++g) {
    const float sum = next;
    if (g + 1 < sg.groups) next = slot[(g + 1) * stride];
    slot[g * stride] = run;
    run += sum;
  }
  if (a.final_state != nullptr) a.final_state[state] = run;
}

template <typename T, int Dk, int Dv, int kChunk>
__global__ void __launch_bounds__(512)
    chunk_forward_grouped16_kernel(const __grid_constant__ ForwardArgs a) {
  using Tr = Grouped16Traits<T, Dk, Dv>;
  constexpr int kLdK = Tr::kLdK, kLdV = Tr::kLdV, kLdC = Tr::kLdC, kThreads = Tr::kThreads;
  static_assert(kChunk == 16 || kChunk == 32 || kChunk == 64, "chunk in {16, 32, 64}");
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  auto stQ = [&](int st) { return reinterpret_cast<T*>(smem_bytes + st * Tr::kStage); };
  auto stK = [&](int st) {
    return reinterpret_cast<T*>(smem_bytes + st * Tr::kStage + Tr::kKBytes);
  };
  auto stV = [&](int st) {
    return reinterpret_cast<T*>(smem_bytes + st * Tr::kStage + 2 * Tr::kKBytes);
  };
  T* sS = reinterpret_cast<T*>(smem_bytes + 2 * Tr::kStage);
  T* sA = reinterpret_cast<T*>(smem_bytes + 2 * Tr::kStage + Tr::kSBytes);

  const int64_t gi = blockIdx.x, h = blockIdx.y, H = a.heads;
  const GroupWork w = group_work(a, gi, blockIdx.z);
  if (!w.active) return;  // the whole block: no barrier is skipped by a part of it
  const int tid = threadIdx.x, warp = tid / 32;

  auto prefetch = [&](int c, int st) {
    copy_segment_chunk_async<kThreads, kChunk, Dk>(stQ(st), kLdK, a.q, w.seg, c, H, h, tid);
    copy_segment_chunk_async<kThreads, kChunk, Dk>(stK(st), kLdK, a.k, w.seg, c, H, h, tid);
    copy_segment_chunk_async<kThreads, kChunk, Dv>(stV(st), kLdV, a.v, w.seg, c, H, h, tid);
  };
  constexpr int64_t kStateElems = static_cast<int64_t>(Dk) * Dv;
  auto s = group_state_tiles<Tr, Dv>(warp);
  s.load(group_slot<Dk, Dv>(a, w, gi, h));  // the state entering the group (group_prefix_kernel's)
  float* chunk_states = group_chunk_states<Dk, Dv>(a, w, h);
  prefetch(w.c_begin, 0);
  cp_async_commit();

  // Warp (I, part): A's slab `part` of row tile I (store_causal_scores),
  // then o's row tile I, Dv quarter `part`.
  constexpr int kRowTiles = kChunk / 16;
  constexpr int kONT = Dv / 32;
  static_assert(kONT % 2 == 0, "o slabs of whole n8 pairs");
  const int I = warp % 4, part = warp / 4, r0 = 16 * I;

  for (int c = w.c_begin, st = 0; c < w.c_end; ++c, st ^= 1) {
    cp_async_wait<0>();
    // Chunk c's stage visible; every warp is done with chunk c - 1 (its
    // stage, the copy of S and A), so they can be rewritten.
    __syncthreads();
    if (c + 1 < w.c_end) prefetch(c + 1, st ^ 1);
    cp_async_commit();
    const T* q = stQ(st);
    const T* k = stK(st);
    const T* v = stV(st);

    // The state entering chunk c: the caller's fp32 copy, and the 16-bit
    // operand copy the output product reads.
    if (chunk_states != nullptr) s.store_pairs(chunk_states + c * H * kStateElems);
    s.store_copy(sS, kLdV);
    store_causal_scores<T, Dk, kChunk>(sA, kLdC, q, k, kLdK, I, part);  // A = mask(q k^T)
    __syncthreads();  // the copy of S and A complete

    // o (rows r0.., Dv quarter) = scale (q S_c + A v); A is zero right of the
    // diagonal block, so its product stops at row tile I.
    if (I < kRowTiles) {
      const int n0 = part * (Dv / 4);
      float acc[kONT][4] = {};
      warp_mm_16xn<T, false, true, kONT>(acc, q, kLdK, sS, kLdV, r0, n0, Dk);
      warp_mm_16xn<T, false, true, kONT>(acc, sA, kLdC, v, kLdV, r0, n0, r0 + 16);
      store_chunk_slab<T, Dv>(a.o, w.seg.token0(c, kChunk) * H + h, H, r0, n0,
                              w.seg.length(c, kChunk), acc, a.scale);
    }
    // S <- S + k^T v (rows past the sequence's end are zeros).
    s.add_xt_y(k, kLdK, v, kLdV, kChunk);
  }
  cp_async_wait<0>();
}

}  // namespace statescan::cuda::detail
