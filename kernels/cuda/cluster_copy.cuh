// Thread-block-cluster loads for the sequential scans (sm_90): tensor copies
// (cp.async.bulk.tensor, TMA) from global into shared memory, multicast to
// every CTA of a cluster, completed on mbarriers, and the barrier operations
// a producer/consumer pipeline across a cluster needs.
//
// Why: a delta-rule scan runs Dv / BV CTAs per head, and every one of them
// loads the chunk's whole K_ and W tiles (32 KB per step at Dk = 128). ncu
// (deltanet 32K, 2026-12-02) put chunk_state_scan16_kernel at 88.7 % of L2
// throughput: the step waited on L2, not on its products. A cluster of a
// head's column blocks loads each tile once: CTA r copies rows
// [r C / CS, (r + 1) C / CS) into the same offset of every CTA's shared
// memory, so the L2 reads of those tiles drop CS-fold. One tensor copy per
// tile: a first version copied row by row (cp.async.bulk, 256 B each) and
// ran 4x slower, ~35 ns per copy instruction on the CTA's path (the
// output-in-scan kernel, with 1.5x the row copies, 1.5x slower again).
//
// Protocol (one pipeline stage st of kStages; chunk c uses stage c % kStages):
//   full[st]  (count 1, in each CTA): the CTA's producer arms it with the
//             stage's total bytes (arrive.expect_tx); every copy into the
//             CTA, its own and the other CTAs' multicasts, completes bytes on
//             it. Consumers wait on parity (c / kStages) & 1.
//   empty[st] (count CS, in each CTA): after all of a CTA's consumers are done
//             with chunk c's stage, one thread arrives on empty[st] of every
//             CTA of the cluster. A producer refilling stage st with chunk
//             c + kStages waits for that phase first: nobody still reads the
//             rows it is about to overwrite anywhere in the cluster.
// A remote copy may complete bytes on full[st] before the local producer
// arms it: the transaction count goes negative and the phase still waits for
// the pending arrival, so the order does not matter. The kernel must sync the
// cluster after initialising the barriers and before any CTA exits (remote
// arrivals and copies may still target it).
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>

#include "kernels/cuda/warp_mma.cuh"  // shared_address

namespace statescan::cuda::detail {

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ uint32_t cluster_size() {
  uint32_t n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
}

// Every thread of every CTA of the cluster (also a plain block barrier when
// the cluster is one CTA). Release/acquire: barrier initialisation and shared
// memory writes before it are visible to the cluster after it.
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
}

// The two halves of a cluster barrier, split so that work can run between
// a CTA's arrival and its wait (every thread of the cluster arrives, then
// waits, then may arrive again). Relaxed: it orders progress, not memory.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}

// A barrier over the first `threads` threads of the block (a multiple of 32),
// id 1..15 (0 is __syncthreads'): the consumers' step barriers when a
// producer warp runs its own loop.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Arrives on named barrier `id` without waiting: the threads that bar.sync
// on it pass once `threads` arrivals in all (theirs included) are counted.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count)
               : "memory");
}

// Makes the initialisations visible to the cluster's other CTAs and to the
// async proxy (the bulk copies); a cluster_sync_all must follow.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// In a kernel launched by launch_kernel_dependent: waits until the stream's
// previous kernel has completed and its writes are visible (a no-op in a
// kernel launched otherwise).
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Arrives once on the local barrier and expects `bytes` more transaction bytes.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(
                   shared_address(bar)),
               "r"(bytes)
               : "memory");
}

// Arrives once on this CTA's barrier (release: this thread's shared memory
// reads and writes before it are ordered before the phase completes).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar))
               : "memory");
}

// The shared::cluster address of `local`'s offset in CTA `cta` of the cluster.
__device__ __forceinline__ uint32_t cluster_shared_address(const void* local, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(shared_address(local)), "r"(cta));
  return remote;
}

// Arrives once on the barrier at the same offset in CTA `cta` of the cluster.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(
                   cluster_shared_address(bar, cta))
               : "memory");
}

// Arrives once on the barrier at the same offset in CTA `cta`, ordering only
// this CTA's earlier shared-memory accesses (release at CTA scope, as
// CUTLASS's pipelines release a stage): a consumer handing a stage back.
// The cluster-scope release above is a memory barrier on every call; a
// per-stage release of it dominated LaCT's Newton-Schulz kernel (ncu: "stall
// membar").
__device__ __forceinline__ void mbarrier_arrive_cluster_cta(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_shared_address(bar, cta))
      : "memory");
}

// Waits until the barrier's phase of parity `parity` has completed, with an
// acquire at cluster scope (kCluster: the arrivals may come from other CTAs
// and order their memory accesses at that scope) or at CTA scope (stages
// filled by bulk copies, whose bytes complete the phase, and stage hand-backs
// through mbarrier_arrive_cluster_cta, as CUTLASS's pipelines wait).
template <bool kCluster>
__device__ __forceinline__ void mbarrier_wait_scoped(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = shared_address(bar);
  uint32_t done = 0;
  do {
    if constexpr (kCluster) {
      asm volatile(
          "{\n\t.reg .pred p;\n\t"
          "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
          "selp.u32 %0, 1, 0, p;\n\t}"
          : "=r"(done)
          : "r"(addr), "r"(parity)
          : "memory");
    } else {
      asm volatile(
          "{\n\t.reg .pred p;\n\t"
          "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
          "selp.u32 %0, 1, 0, p;\n\t}"
          : "=r"(done)
          : "r"(addr), "r"(parity)
          : "memory");
    }
  } while (!done);
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  mbarrier_wait_scoped<true>(bar, parity);
}
__device__ __forceinline__ void mbarrier_wait_cta(uint64_t* bar, uint32_t parity) {
  mbarrier_wait_scoped<false>(bar, parity);
}

// bytes (a multiple of 16; both addresses 16-byte aligned) from global to this
// CTA's shared memory, completed on `bar`.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes,
                                                    uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}

// The same bytes into the same offset of every CTA in `mask` (cluster ranks),
// each completed on the barrier at `bar`'s offset in that CTA.
__device__ __forceinline__ void bulk_copy_multicast(void* dst, const void* src, uint32_t bytes,
                                                    uint64_t* bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1], %2, [%3], %4;" ::"r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar)), "h"(mask)
      : "memory");
}

// Orders this thread's generic-proxy global writes before later async-proxy
// (bulk copy) reads of them: writers fence, then release to the readers.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// A box of a 2D tensor map (tensor_map_2d) at column c0, row c1 into this
// CTA's shared memory (128-byte aligned), completed on `bar`: one instruction
// for a whole tile, its row padding included (the box is wider than the
// tensor; columns past its end arrive as zeros).
__device__ __forceinline__ void tensor_copy_to_shared(void* dst, const CUtensorMap* map, int c0,
                                                      int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// Fetches a tensor map (a __grid_constant__ parameter) into the descriptor
// cache ahead of its first copy.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// A box of a 3D tensor map at coordinates (c0, c1, c2), as above.
__device__ __forceinline__ void tensor_copy_to_shared_3d(void* dst, const CUtensorMap* map, int c0,
                                                         int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Four floats at a shared::cluster address (cluster_shared_address), 16-byte
// aligned: another CTA's shared memory after a cluster barrier.
__device__ __forceinline__ float4 load_shared_cluster_f4(uint32_t address) {
  float4 v;
  // No memory clobber: the cluster barrier before the reads orders them, and
  // without it the compiler may issue a tile's loads back to back instead of
  // one remote round trip at a time.
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(address));
  return v;
}

// The same box into the same offset of every CTA in `mask` (cluster ranks),
// each completed on the barrier at `bar`'s offset in that CTA.
__device__ __forceinline__ void tensor_copy_multicast(void* dst, const CUtensorMap* map, int c0,
                                                      int c1, uint64_t* bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%4, %5}], [%2], %3;" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(bar)), "h"(mask), "r"(c0), "r"(c1)
      : "memory");
}

// The barriers of a kStages-deep pipeline across the cluster (the protocol
// above): 2 kStages mbarriers in shared memory. Default-constructed empty;
// init() by every thread of the CTA.
template <int kStages>
struct ClusterPipeline {
  uint64_t* full = nullptr;
  uint64_t* empty = nullptr;
  uint32_t ctas = 1;
  int row0 = 0;  // this CTA's first row of a shared tile

  // Thread 0 initialises the barriers at `bars`, then the whole cluster
  // syncs: no remote arrival or copy may reach a barrier before that. Tiles
  // shared by the cluster have `chunk` rows, chunk / ctas per CTA.
  __device__ void init(unsigned char* bars, int tid, int chunk) {
    full = reinterpret_cast<uint64_t*>(bars);
    empty = full + kStages;
    ctas = cluster_size();
    row0 = static_cast<int>(cluster_rank() * chunk / ctas);
    if (tid == 0) {
      for (int st = 0; st < kStages; ++st) {
        mbarrier_init(full + st, 1);
        mbarrier_init(empty + st, ctas);
      }
      fence_mbarrier_init();
    }
    cluster_sync_all();
  }
  // Producer warp, step i into stage st: waits until every CTA of the
  // cluster is done with the step the stage held; lane 0 arms full[st] with
  // the stage's `bytes` and returns true: it issues the step's copies.
  __device__ bool acquire(int i, int st, int lane, uint32_t bytes) {
    if (i >= kStages) mbarrier_wait(empty + st, (i / kStages - 1) & 1);
    if (lane != 0) return false;
    mbarrier_arrive_expect_tx(full + st, bytes);
    return true;
  }
  // Consumers: step i's stage has landed.
  __device__ void wait(int i, int st) { mbarrier_wait(full + st, (i / kStages) & 1); }
  // One warp, after the barrier that ends this CTA's reads of stage st: each
  // lane below the cluster size tells one CTA.
  __device__ void release(int st, int lane) {
    if (lane < static_cast<int>(ctas)) mbarrier_arrive_cluster(empty + st, lane);
  }
  // This CTA's share of a tile every CTA of the cluster needs (the map's
  // box: chunk / ctas rows, padded to `ld`), into every CTA's copy at dst,
  // for stage st; the tile starts at row `tile_row` of the map.
  template <typename T>
  __device__ void shared_tile(T* dst, int ld, const CUtensorMap& map, int tile_row,
                              int st) const {
    if (ctas == 1) {
      tensor_copy_to_shared(dst, &map, 0, tile_row, full + st);
      return;
    }
    tensor_copy_multicast(dst + row0 * ld, &map, 0, tile_row + row0, full + st,
                          static_cast<uint16_t>((1u << ctas) - 1u));
  }
  // Every thread at the end: no CTA leaves while arrivals may still target it.
  __device__ void finish() { cluster_sync_all(); }
};

}  // namespace statescan::cuda::detail
