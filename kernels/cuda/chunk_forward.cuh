// Chunkwise forward family for the six variants (DESIGN §3-4), templated on
// <Decay, Rule, element type, Dk, Dv>. Three kernels per call, on the
// caller's stream, talking through a workspace whose tiles are in the input's
// element type T (bf16/f16 tiles halve the traffic and feed 16x16x16
// tensor-core steps; fp32 inputs keep fp32 tiles and split-tf32 products):
//
//   1. chunk_prepare_kernel  (one block per (chunk, head); all chunks in parallel;
//      16-bit inputs: chunk_prepare16_kernel, chunk_prepare16.cuh, same outputs)
//      everything that does not depend on the state entering the chunk:
//      gate cumsums, decayed queries/keys, the masked intra-chunk attention A,
//      and for delta rules the UT transform W = T diag(beta) K^, U = T diag(beta) V.
//   2. chunk_state_scan_kernel  (one block per (segment, head, Dv block);
//      16-bit inputs: chunk_state_scan16_kernel, chunk_scan16.cuh, same outputs)
//      the only sequential part, kept minimal: walks the segment's chunks
//      carrying the fp32 state S, saving S_c, V' = U - W S_c and
//      S <- diag(decay) S + K_^T V'.
//   3. chunk_output_kernel  (one block per (chunk, head, Dv half); parallel)
//      O = Q^ S_c + A V'. Delta rules with 16-bit inputs form it inside the
//      scan instead (ForwardArgs::fuse_output; chunk_scan16.cuh kOut, its
//      tiles loaded by a producer warp with tensor copies multicast across a
//      cluster of the head's Dv blocks: cluster_copy.cuh): no 16-bit states or
//      V' in the workspace.
//
// Flags: l2norm is a template parameter (it changes the load stage); an
// initial state and packed sequences only change where a block starts and
// which state it loads, once per block, so they stay run-time values.
// Instantiated here: dtype in {f32, bf16, f16} x Dk == Dv in {64, 128}.
//
// Notation per chunk (rows t = 0..C-1, b_t = inclusive cumsum of log gates
// from the chunk start; padded rows past a segment's end are zero with g = 0,
// which makes them exact no-ops):
//   Q^ = scale * q_t * e^{b_t}     K^ = k_t * e^{b_t}     K_ = k_t * e^{b_C - b_t}
//   A_ts  = scale * sum_d q_td k_sd e^{b_td - b_sd}   (s <= t, else 0)
//   M_ts  = beta_t sum_d k_td k_sd e^{b_td - b_sd}      (s <  t, else 0)
//   T = (I + M)^{-1}    W = T diag(beta) K^    U = T diag(beta) V  (additive: U = V)
// Every exponent above is <= 0, so nothing overflows however negative the
// gates are; A and M for vector gates are built from 16-row blocks whose
// reference point keeps both factors <= 1 (see chunk_prepare_kernel).
#pragma once

#include <cuda.h>  // CUtensorMap

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/options.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mixer_tensors.cuh"
#include "kernels/cuda/tensor_map.cuh"

namespace statescan::cuda::detail {

// Everything both kernels need, by value (__grid_constant__). Pointers are
// device pointers; the ws_* buffers are this call's workspace.
struct ForwardArgs : MixerTensors {
  float* chunk_states = nullptr;  // fp32 states for the caller, or null

  // Workspace tiles, element type T (the input dtype):
  void* ws_q = nullptr;       // Q^    [chunks, H, C, Dk]
  void* ws_k = nullptr;       // K_    [chunks, H, C, Dk]
  void* ws_w = nullptr;       // W     [chunks, H, C, Dk] (delta rules only)
  void* ws_u = nullptr;       // U     [chunks, H, C, Dv]
  void* ws_a = nullptr;       // A     [chunks, H, C, C]
  float* ws_decay = nullptr;  // e^{b_C} per key dim [chunks, H, Dk], fp32
  // T = (I + diag(beta) KK)^{-1} [chunks, H, C, C] in T, rounded once: written
  // by chunk_prepare16_kernel where non-null (the plans a backward reads,
  // delta rules with a scalar gate or none; STATESCAN_BWD_T=solve: none), so that
  // chunk_intra_grad_kernel does not solve it a second time; null elsewhere.
  void* ws_t = nullptr;
  // With ws_t, T's low part T - hi (two-part T, what the prepare's W and U
  // products take) [chunks, H, C, C] where non-null: MixerParams::saved_t's
  // second half. t_given: the prepare stage reads T (hi and lo) from ws_t and
  // ws_t_lo instead of forming KK and solving (the backward's re-run with a
  // saved T); otherwise it writes them.
  void* ws_t_lo = nullptr;
  bool t_given = false;
  void* ws_vnew = nullptr;    // V' = U - W S [chunks, H, C, Dv] (delta rules only)
  void* ws_states = nullptr;  // state entering each chunk [chunks, H, Dk, Dv] in T,
                              // read by the output kernel (fp32 inputs: the
                              // caller's chunk_states when given)
  // Delta rules, 16-bit: o formed inside the scan (chunk_scan16.cuh, kOut)
  // whenever the scan and output stages run together; ws_states and ws_vnew
  // are then absent (the plan leaves them null). The plan decides
  // (cuda_mixer.cu output_in_scan: by default; STATESCAN_FWD_OUTPUT=kernel
  // keeps the output kernel).
  bool fuse_output = false;
  int num_sms = 132;
  int scan_block_cols = 0;          // 16 or 32 to force the scan's Dv block; 0 = by occupancy
  bool prepare_fp32_tiles = false;  // 16-bit inputs through chunk_prepare_kernel (A/B knob)
  // The NaN/Inf check inside chunk_prepare16_kernel (PreparedForward's
  // `nonfinite`, cp_kernels.h): where non-null, a thread that reads a
  // non-finite element of q, k, v, g or beta ORs that input's NonFiniteInput
  // bit into it. Only the 16-bit prepare reads it (prepare_checks_finite).
  unsigned* nonfinite = nullptr;
  bool scan_wmma = false;           // 16-bit inputs through chunk_state_scan_kernel (A/B knob)
  // A scan that keeps only the final state (no chunk states, V' or output:
  // the CP summary's E and M) as one CTA per head and segment
  // (chunk_scan_wgmma.cuh): delta rules, 16-bit, Dk = Dv = 128, chunk 64, a
  // build for sm_90a. Never set by plan_forward; summary.cu sets it where
  // per_head_scan() says so.
  bool scan_per_head = false;
  // With scan_per_head: scan the linear part of the update instead (S from
  // the identity, U = 0; ws_u and initial_state are not read), the
  // summary's M and piece maps; with the output stage its outputs are the
  // first segments' H (WgmmaScan::maps_out).
  bool scan_identity = false;
  // With scan_identity (one segment per row or the two-level summary's runs):
  // also scan every segment from zero, E's runs, into this [N, H, Dk, Dv]
  // fp32, beside the identity scan in clusters of two CTAs that share the
  // chunks' loads through L2 (chunk_state_scan_wgmma_pair_kernel).
  float* scan_pair_state = nullptr;
  // CTAs per cluster of the 16-bit delta scans (cluster_copy.cuh): 0 = the
  // largest that keeps every CTA co-resident (scan_cluster_ctas), else 1, 2,
  // 4 or 8 (STATESCAN_SCAN_CLUSTER).
  int scan_cluster = 0;
  // Linear attention without the L2 norm, 16-bit (cuda::reads_inputs_directly):
  // the scan and output kernels, and the backward's, read q, k, v themselves
  // (chunk_output_raw16.cuh, chunk_grad_raw16.cuh); the workspace has no tiles
  // and the prepare stage never runs.
  bool raw_additive = false;
  // The raw path's scan in chunk groups (chunk_linear_grouped16.cuh; the
  // default, STATESCAN_LINEAR=scan turns it off): G chunks per group (0 =
  // off; then ws_states carries the 16-bit states), fp32 group sums
  // [slots, H, Dk, Dv], the largest group count of a segment (the grid), and
  // packed: each segment's first slot (else n * max_segment_groups).
  int group_chunks = 0;
  float* ws_group_sums = nullptr;
  int64_t max_segment_groups = 0;
  const int64_t* group_table = nullptr;

  int64_t heads = 0;
  int64_t seq_len = 0;
  int chunk = 64;
  float scale = 1.f;
  int64_t num_segments = 0;
  int64_t num_chunks = 0;
  int64_t chunks_per_row = 0;              // without cu_seqlens
  const int64_t* chunk_table = nullptr;    // packed: [chunks][2] = first token, token count
  const int64_t* segment_table = nullptr;  // packed: [N][2] = first chunk, chunk count
};

// CTAs per cluster for a scan grid (x = the head's column blocks): `forced`
// when given (it must divide grid.x and leave each CTA >= 8 rows of a
// chunk's tiles: 128-byte aligned tensor-copy targets), else the largest
// allowed of 8, 4, 2 whose clusters still hold as many CTAs at once as single
// CTAs do (up to the grid): a sequential scan whose CTAs do not all fit in
// one wave takes twice as long, and GPCs hold whole clusters only. Cached per
// kernel and grid.
template <typename Kernel>
unsigned scan_cluster_ctas(Kernel kernel, dim3 grid, int threads, size_t smem, int chunk,
                           int forced) {
  auto allowed = [&](unsigned c) { return grid.x % c == 0 && chunk / static_cast<int>(c) >= 8; };
  if (forced > 0) {
    SS_CHECK_ARG(allowed(static_cast<unsigned>(forced)), "STATESCAN_SCAN_CLUSTER",
                 "must divide the scan's ", grid.x, " column blocks per head and leave >= 8 of ",
                 chunk, " chunk rows per CTA, got ", forced);
    return static_cast<unsigned>(forced);
  }
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, unsigned, int64_t>, unsigned> cache;
  const int64_t total = int64_t{grid.x} * grid.y * grid.z;
  int device = 0;  // the pick depends on the GPU's clusters: one per device
  SS_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), grid.x, total);
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  const int64_t single = std::min<int64_t>(total, active_clusters(kernel, threads, smem, 1));
  unsigned pick = 1;
  for (unsigned c = 8; c >= 2; c /= 2)
    if (allowed(c) && int64_t{active_clusters(kernel, threads, smem, c)} * c >= single) {
      pick = c;
      break;
    }
  cache.emplace(key, pick);
  return pick;
}

// The delta scans' tensor maps (chunk_state_scan16_kernel, kBulk): K_, W, Q^
// and A in boxes of one cluster CTA's rows, U in boxes of the CTA's columns.
struct ScanTileMaps {
  CUtensorMap k, w, u, q, a;
};

// The maps of the tiles a head's column blocks share (K_, W, Q^, A; U is
// per block, left null here): arrays of [tiles * C][cols], a cluster CTA's
// box its share of a tile's rows, padded to the shared-memory rows kLdK, kLdA.
template <int Dk, int kLdK, int kLdA>
ScanTileMaps shared_tile_maps(const ForwardArgs& a, int chunk, unsigned cluster) {
  const int64_t rows = a.num_chunks * a.heads * chunk;
  SS_CHECK_ARG(rows < (int64_t{1} << 31), "q",
               "too many chunk tiles for the scans' 32-bit tensor coordinates");
  const int share = chunk / static_cast<int>(cluster);
  ScanTileMaps maps{};
  maps.k = tile_map_2d(a.ws_k, rows, Dk, kLdK, share);
  maps.w = tile_map_2d(a.ws_w, rows, Dk, kLdK, share);
  maps.q = tile_map_2d(a.ws_q, rows, Dk, kLdK, share);
  maps.a = tile_map_2d(a.ws_a, rows, chunk, kLdA, share);
  return maps;
}

// First flattened token (b*T + t) and valid length of global chunk c.
__device__ __forceinline__ void chunk_geometry(const ForwardArgs& a, int64_t c, int64_t& token0,
                                               int& length) {
  if (a.chunk_table != nullptr) {
    token0 = a.chunk_table[2 * c];
    length = static_cast<int>(a.chunk_table[2 * c + 1]);
  } else {
    const int64_t row = c / a.chunks_per_row, local = c % a.chunks_per_row;
    token0 = row * a.seq_len + local * a.chunk;
    const int64_t left = a.seq_len - local * a.chunk;
    length = static_cast<int>(left < a.chunk ? left : a.chunk);
  }
}

// Segment n's chunks: global chunks [first, first + count).
__device__ __forceinline__ void segment_chunks(const ForwardArgs& a, int64_t n, int64_t& first,
                                               int64_t& count) {
  if (a.segment_table != nullptr) {
    first = a.segment_table[2 * n];
    count = a.segment_table[2 * n + 1];
  } else {
    first = n * a.chunks_per_row;
    count = a.chunks_per_row;
  }
}

// The tokens of a segment's chunks [first, first + count): consecutive
// pieces of one sequence (the host builds chunk_table so), chunk first + i
// starting at begin + i C with min(C, end - start) valid rows. The sequential
// scans take it once: chunk_geometry per step (a 64-bit division, or a
// dependent table load) was a third of the raw scan's instructions per step.
struct SegmentTokens {
  int64_t begin = 0, end = 0;
  __device__ __forceinline__ int64_t token0(int i, int chunk) const {
    return begin + static_cast<int64_t>(i) * chunk;
  }
  __device__ __forceinline__ int length(int i, int chunk) const {
    const int64_t left = end - token0(i, chunk);
    return static_cast<int>(left < chunk ? left : chunk);
  }
};
__device__ __forceinline__ SegmentTokens segment_tokens(const ForwardArgs& a, int64_t first,
                                                        int64_t count) {
  SegmentTokens s;
  if (count > 0) {
    int64_t last0;
    int last_len;
    chunk_geometry(a, first, s.begin, last_len);
    chunk_geometry(a, first + count - 1, last0, last_len);
    s.end = last0 + last_len;
  }
  return s;
}

// Calls f(std::integral_constant<int, C>{}) for the chunk size C in
// {16, 32, 64} (kernels that take the chunk as a template parameter); any
// other size is an error, never a silent substitute.
template <typename F>
void with_chunk_size(int chunk, F&& f) {
  if (chunk == 64)
    f(std::integral_constant<int, 64>{});
  else if (chunk == 32)
    f(std::integral_constant<int, 32>{});
  else if (chunk == 16)
    f(std::integral_constant<int, 16>{});
  else
    SS_FAIL("chunk", "CUDA kernels take chunk sizes 16, 32 or 64, got ", chunk);
}

// Compile-time tile shapes. Rows of shared tiles are padded by 4 floats so
// that wmma's column walks do not hit one bank and every 8-row offset stays
// 32-byte aligned (wmma needs 256-bit aligned tile pointers).
template <Decay kDecay, Rule kRule, int Dk, int Dv>
struct ChunkTraits {
  static constexpr int kMaxChunk = 64;
  static constexpr int kPad = 4;
  static constexpr int kLdK = Dk + kPad;
  static constexpr int kLdV = Dv + kPad;
  static constexpr int kLdC = kMaxChunk + kPad;
  static constexpr bool kVector = kDecay == Decay::vector;
  static constexpr bool kDelta = kRule == Rule::delta;
  static_assert(Dk % 16 == 0 && Dv % 16 == 0, "head dims must be multiples of 16");
  static_assert(Dk <= 128 && Dv <= 128, "head dims above 128 need another tiling");
  static_assert(kMaxChunk % 16 == 0, "chunk must be whole 16-row blocks");

  // chunk_prepare_kernel shared memory, in floats (each piece a multiple of 8).
  static constexpr int kPrepQ = kMaxChunk * kLdK;
  static constexpr int kPrepK = kMaxChunk * kLdK;
  static constexpr int kPrepG = kVector ? kMaxChunk * kLdK : kMaxChunk;
  static constexpr int kPrepV = kDelta ? kMaxChunk * kLdV : 0;
  static constexpr int kPrepA = kMaxChunk * kLdC;
  static constexpr int kPrepM = kDelta ? kMaxChunk * kLdC : 0;
  static constexpr int kPrepBeta = kMaxChunk;
  // vector gates: K rescaled to one 16-row block's reference (up to 48 rows),
  // plus that block's rescaled q and k rows.
  static constexpr int kPrepScratch = kVector ? (kMaxChunk - 16 + 32) * kLdK : 0;
  static constexpr int kPrepFloats =
      kPrepQ + kPrepK + kPrepG + kPrepV + kPrepA + kPrepM + kPrepBeta + kPrepScratch;
  static constexpr size_t kPrepBytes = sizeof(float) * kPrepFloats;
  static_assert(kPrepBytes <= 227 * 1024, "chunk_prepare_kernel exceeds Hopper shared memory");
  // Two blocks per multiprocessor where shared memory allows (cap registers
  // at 128 so that the register file does not become the limit).
  static constexpr int kPrepBlocksPerSm = kPrepBytes <= 113 * 1024 ? 2 : 1;
  // Threads per block: 256 where two blocks share a multiprocessor, else 512
  // (kda/gla/deltanet/gdn at D=128: one 136-213 KB block per SM). Its phases
  // are short and separated by barriers, so with 8 warps per SM most of the
  // time went to waiting on memory; 16 warps halve the element loops and give
  // every (Dk+Dv)/16 column tile of the UT solve its own warp. The register
  // cap (128 at 512 threads) fits: the load stage's arrays halve with it.
  static constexpr int kThreads = kPrepBlocksPerSm == 2 ? 256 : 512;
  static constexpr int kWarps = kThreads / 32;
  static_assert(Dk + Dv <= kThreads, "forward substitution uses one thread per column");
};

constexpr size_t align_smem(size_t bytes) {
  return (bytes + 127) / 128 * 128;
}

// Tiles in T are padded by 16 bytes per row: 16-byte copies stay aligned,
// wmma's ldm stays a multiple of 16 bytes, and rows shift banks.
template <typename T, int Dk, int Dv, int BV, bool kDelta>
struct ScanTraits {
  static constexpr bool kF32 = std::is_same_v<T, float>;
  static constexpr int kMaxChunk = 64;
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kPadT = 16 / static_cast<int>(sizeof(T));
  static constexpr int kLdK = Dk + kPadT;  // K_, W tiles (T)
  static constexpr int kLdB = BV + kPadT;  // U, V' and the S copy (T)
  static constexpr int kLdF = BV + 4;      // S and W S (fp32)
  static_assert(Dv % BV == 0 && BV % 16 == 0, "Dv block must be whole 16-column tiles");
  static_assert((kMaxChunk / 16) * (BV / 16) <= kWarps, "one V' tile per warp");
  static_assert(!kF32 || kLdB == kLdF, "fp32 products read S in place");
  static constexpr size_t kSBytes = align_smem(sizeof(float) * Dk * kLdF);
  static constexpr size_t kSCopyBytes = kF32 ? 0 : align_smem(sizeof(T) * Dk * kLdB);
  static constexpr size_t kTileKBytes = align_smem(sizeof(T) * kMaxChunk * kLdK);  // K_ or W
  static constexpr size_t kTileBBytes = align_smem(sizeof(T) * kMaxChunk * kLdB);  // U
  // One pipeline stage: K_, W (delta), U, decay.
  static constexpr size_t kUOffset = (kDelta ? 2 : 1) * kTileKBytes;
  static constexpr size_t kStageBytes = kUOffset + kTileBBytes + align_smem(sizeof(float) * Dk);
  static constexpr size_t kProdBytes = kDelta ? align_smem(sizeof(float) * kMaxChunk * kLdF) : 0;
  static constexpr size_t kVnBytes = kDelta && !kF32 ? kTileBBytes : 0;
  // cp.async pipeline depth: the next chunks' tiles load while this one
  // runs; 16-bit stages are small enough for three (two chunks ahead).
  static constexpr int kStages = kF32 ? 2 : 3;
  static constexpr size_t kBytes =
      kSBytes + kSCopyBytes + kStages * kStageBytes + kProdBytes + kVnBytes;
  static_assert(kBytes <= 227 * 1024, "chunk_state_scan_kernel exceeds Hopper shared memory");
};

template <typename T, int Dk, int Dv>
struct OutputTraits {
  static constexpr bool kF32 = std::is_same_v<T, float>;
  static constexpr int kMaxChunk = 64;
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kPadT = 16 / static_cast<int>(sizeof(T));
  static constexpr int kLdK = Dk + kPadT;
  static constexpr int kCols = Dv / 2;  // each block writes half the columns
  static constexpr int kLdV = kCols + kPadT;
  static constexpr int kLdC = kMaxChunk + kPadT;
  static constexpr int kLdO = kCols + 4;  // O, fp32
  static_assert(kCols % 32 == 0, "two warps per row tile, whole 16-column tiles each");
  static_assert(!kF32 || kLdO == kLdV, "fp32 O reuses the V' tile");
  static constexpr size_t kQBytes = align_smem(sizeof(T) * kMaxChunk * kLdK);
  static constexpr size_t kABytes = align_smem(sizeof(T) * kMaxChunk * kLdC);
  static constexpr size_t kSBytes = align_smem(sizeof(T) * Dk * kLdV);
  static constexpr size_t kVBytes = align_smem(sizeof(T) * kMaxChunk * kLdV);  // V'
  static constexpr size_t kOBytes = kF32 ? 0 : align_smem(sizeof(float) * kMaxChunk * kLdO);
  static constexpr size_t kBytes = kQBytes + kABytes + kSBytes + kVBytes + kOBytes;
  static_assert(kBytes <= 227 * 1024, "chunk_output_kernel exceeds Hopper shared memory");
};

// Copies a rows x cols tile (global row stride ld_src, in elements) into
// shared memory (row stride ld_dst) with 16-byte asynchronous copies.
template <int kThreads, typename T>
__device__ __forceinline__ void copy_tile_async(T* dst, int ld_dst, const T* src, int64_t ld_src,
                                                int rows, int cols) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const int vec_per_row = cols / kVec;
  for (int idx = threadIdx.x; idx < rows * vec_per_row; idx += kThreads) {
    const int i = idx / vec_per_row, j = (idx % vec_per_row) * kVec;
    cp_async16(dst + i * ld_dst + j, src + i * ld_src + j);
  }
}

// chunk_prepare_kernel: the state-independent part of one chunk.
//   grid (num_chunks, H), ChunkTraits::kThreads threads (256 or 512); block (c, h) reads chunk c's
//   q, k, v, g, beta of head h and writes ws_q/ws_k/ws_w/ws_u/ws_a/ws_decay tiles. Shared memory:
//   ChunkTraits::kPrepBytes (213 KB for kda at D=128). Constraints: chunk in {16, 32, 64}; Dk, Dv
//   multiples of 16, <= 128.
template <Decay kDecay, Rule kRule, typename Elem, int Dk, int Dv, bool kL2Norm>
__global__ void __launch_bounds__((ChunkTraits<kDecay, kRule, Dk, Dv>::kThreads),
                                  (ChunkTraits<kDecay, kRule, Dk, Dv>::kPrepBlocksPerSm))
    chunk_prepare_kernel(const __grid_constant__ ForwardArgs a) {
  using Tr = ChunkTraits<kDecay, kRule, Dk, Dv>;
  constexpr bool kSplit = std::is_same_v<Elem, float>;
  constexpr int kLdK = Tr::kLdK, kLdV = Tr::kLdV, kLdC = Tr::kLdC;
  extern __shared__ __align__(128) float smem[];
  float* sQ = smem;
  float* sK = sQ + Tr::kPrepQ;
  float* sG = sK + Tr::kPrepK;
  float* sV = sG + Tr::kPrepG;
  float* sA = sV + Tr::kPrepV;
  float* sM = sA + Tr::kPrepA;
  float* sBeta = sM + Tr::kPrepM;
  float* sScratch = sBeta + Tr::kPrepBeta;

  const int64_t c = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int C = a.chunk, nb = C / 16;
  int64_t token0;
  int length;
  chunk_geometry(a, c, token0, length);
  const int64_t H = a.heads;

  // ---- load (rows past the segment's end are zeros: exact no-ops) ----------
  const Elem* q = static_cast<const Elem*>(a.q);
  const Elem* k = static_cast<const Elem*>(a.k);
  const Elem* v = static_cast<const Elem*>(a.v);
  // Every load of the chunk is issued before the first store (fully
  // unrolled over kMaxChunk rows, registers in between): with one or two
  // blocks per multiprocessor, a load-store loop would wait out the memory
  // latency once per iteration. Rows in [C, kMaxChunk) of the shared tiles
  // are unused and just receive zeros.
  const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
  constexpr int kLoadsK = Tr::kMaxChunk * Dk / 4 / Tr::kThreads;
  constexpr int kLoadsV = Tr::kMaxChunk * Dv / 4 / Tr::kThreads;
  static_assert(kLoadsK * Tr::kThreads * 4 == Tr::kMaxChunk * Dk &&
                    kLoadsV * Tr::kThreads * 4 == Tr::kMaxChunk * Dv,
                "whole load rounds");
  float4 xq[kLoadsK], xk[kLoadsK], xg[Tr::kVector ? kLoadsK : 1], xv[kLoadsV];
  // Per-row scalar gate and beta of row tid, in the same batch.
  float g_row = 0.f, beta_row = 0.f;
  if (tid < length) {
    if constexpr (kDecay == Decay::scalar) g_row = a.g[(token0 + tid) * H + h];
    if constexpr (Tr::kDelta)
      beta_row = to_float(static_cast<const Elem*>(a.beta)[(token0 + tid) * H + h]);
  }
#pragma unroll
  for (int it = 0; it < kLoadsK; ++it) {
    const int idx = tid + it * Tr::kThreads;
    const int i = idx / (Dk / 4), d = (idx % (Dk / 4)) * 4;
    const bool valid = i < length;
    const int64_t src = ((token0 + i) * H + h) * Dk + d;
    xq[it] = valid ? load4(q + src) : zero4;
    xk[it] = valid ? load4(k + src) : zero4;
    if constexpr (Tr::kVector) xg[it] = valid ? load4(a.g + src) : zero4;
  }
#pragma unroll
  for (int it = 0; it < kLoadsV; ++it) {
    const int idx = tid + it * Tr::kThreads;
    const int i = idx / (Dv / 4), j = (idx % (Dv / 4)) * 4;
    xv[it] = i < length ? load4(v + ((token0 + i) * H + h) * Dv + j) : zero4;
  }
#pragma unroll
  for (int it = 0; it < kLoadsK; ++it) {
    const int idx = tid + it * Tr::kThreads;
    const int i = idx / (Dk / 4), d = (idx % (Dk / 4)) * 4;
    store4(sQ + i * kLdK + d, xq[it]);
    store4(sK + i * kLdK + d, xk[it]);
    if constexpr (Tr::kVector) store4(sG + i * kLdK + d, xg[it]);
  }
  // Delta rules transform V in shared memory; additive rules use U = V and
  // copy it straight to the workspace.
  Elem* out_u = static_cast<Elem*>(a.ws_u) + (c * H + h) * C * Dv;
#pragma unroll
  for (int it = 0; it < kLoadsV; ++it) {
    const int idx = tid + it * Tr::kThreads;
    const int i = idx / (Dv / 4), j = (idx % (Dv / 4)) * 4;
    if constexpr (Tr::kDelta)
      store4(sV + i * kLdV + j, xv[it]);
    else if (i < C)
      store4(out_u + i * Dv + j, xv[it]);
  }
  if (tid < C) {
    if constexpr (kDecay == Decay::scalar) sG[tid] = g_row;
    if constexpr (Tr::kDelta) sBeta[tid] = beta_row;
  }
  __syncthreads();

  // ---- optional L2 normalisation of q and k, then the scale on q -----------
  for (int i = warp; i < C; i += Tr::kWarps) {
    float q_scale = a.scale;
    if constexpr (kL2Norm) {
      float qq = 0.f, kk = 0.f;
      for (int d = lane; d < Dk; d += 32) {
        qq += sQ[i * kLdK + d] * sQ[i * kLdK + d];
        kk += sK[i * kLdK + d] * sK[i * kLdK + d];
      }
      qq = warp_sum(qq);
      kk = warp_sum(kk);
      const float k_scale = 1.f / sqrtf(kk + 1e-6f);
      q_scale *= 1.f / sqrtf(qq + 1e-6f);
      for (int d = lane; d < Dk; d += 32) sK[i * kLdK + d] *= k_scale;
    }
    for (int d = lane; d < Dk; d += 32) sQ[i * kLdK + d] *= q_scale;
  }

  // ---- inclusive cumsum of log gates within the chunk ----------------------
  if constexpr (Tr::kVector) {
    if (tid < Dk) {
      float run = 0.f;
      for (int i = 0; i < C; ++i) {
        run += sG[i * kLdK + tid];
        sG[i * kLdK + tid] = run;
      }
    }
  } else if constexpr (kDecay == Decay::scalar) {
    if (tid == 0) {
      float run = 0.f;
      for (int i = 0; i < C; ++i) {
        run += sG[i];
        sG[i] = run;
      }
    }
  }
  __syncthreads();

  // ---- intra-chunk products A = Q K^T and M = K K^T (raw, masked below) ----
  if constexpr (!Tr::kVector) {
    // Scalar/no decay: the gate factor is per (t, s) and applied afterwards.
    const int lower_tiles = nb * (nb + 1) / 2;
    const int total = lower_tiles * (Tr::kDelta ? 2 : 1);
    for (int t = warp; t < total; t += Tr::kWarps) {
      const bool is_m = t >= lower_tiles;
      int rest = is_m ? t - lower_tiles : t, I = 0;
      while (rest > I) rest -= ++I;
      const int J = rest;
      const float* rows = is_m ? sK : sQ;
      AccFragment acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll 4
      for (int kk = 0; kk < Dk; kk += 8)
        mma_tf32<wmma::row_major, wmma::col_major, kSplit>(acc, rows + I * 16 * kLdK + kk, kLdK,
                                                           sK + J * 16 * kLdK + kk, kLdK);
      wmma::store_matrix_sync((is_m ? sM : sA) + I * 16 * kLdC + J * 16, acc, kLdC,
                              wmma::mem_row_major);
    }
  } else {
    // Vector decay. Diagonal 16x16 blocks exactly on the CUDA cores (their
    // exponents b_t - b_s are small and <= 0 for s <= t) ...
    constexpr int kPairs = 16 * 17 / 2;  // (r, s) with s <= r in one 16x16 block
    for (int slot = tid; slot < nb * kPairs; slot += Tr::kThreads) {
      const int I = slot / kPairs, pair = slot % kPairs;
      int r = static_cast<int>((sqrtf(8.f * pair + 1.f) - 1.f) * 0.5f);
      if ((r + 1) * (r + 2) / 2 <= pair) ++r;  // guard the float rounding
      if (r * (r + 1) / 2 > pair) --r;
      const int s = pair - r * (r + 1) / 2;
      const int i = I * 16 + r, j = I * 16 + s;
      float aq = 0.f, am = 0.f;
      for (int d = 0; d < Dk; ++d) {
        const float e = __expf(sG[i * kLdK + d] - sG[j * kLdK + d]);
        const float kj = sK[j * kLdK + d] * e;
        aq += sQ[i * kLdK + d] * kj;
        am += sK[i * kLdK + d] * kj;
      }
      sA[i * kLdC + j] = aq;
      if constexpr (Tr::kDelta) sM[i * kLdC + j] = am;
    }
    // ... and the blocks left of the diagonal on the tensor cores: for row
    // block I the reference is r = b at row 16I, so q/k rows of block I are
    // scaled by e^{b_t - b_r} <= 1 and key rows s < 16I by e^{b_r - b_s} <= 1.
    float* sKp = sScratch;                                // [16I][kLdK]
    float* sQp = sScratch + (Tr::kMaxChunk - 16) * kLdK;  // [16][kLdK]
    float* sKq = sQp + 16 * kLdK;                         // [16][kLdK]
    for (int I = 1; I < nb; ++I) {
      const int r0 = I * 16;
      for (int idx = tid; idx < (r0 + 16) * Dk; idx += Tr::kThreads) {
        const int i = idx / Dk, d = idx % Dk;
        const float ref = sG[r0 * kLdK + d];
        if (i < r0) {
          sKp[i * kLdK + d] = sK[i * kLdK + d] * __expf(ref - sG[i * kLdK + d]);
        } else {
          const float e = __expf(sG[i * kLdK + d] - ref);
          sQp[(i - r0) * kLdK + d] = sQ[i * kLdK + d] * e;
          sKq[(i - r0) * kLdK + d] = sK[i * kLdK + d] * e;
        }
      }
      __syncthreads();
      for (int t = warp; t < (Tr::kDelta ? 2 : 1) * I; t += Tr::kWarps) {
        const bool is_m = t >= I;
        const int J = is_m ? t - I : t;
        AccFragment acc;
        wmma::fill_fragment(acc, 0.f);
#pragma unroll 4
        for (int kk = 0; kk < Dk; kk += 8)
          mma_tf32<wmma::row_major, wmma::col_major, kSplit>(acc, (is_m ? sKq : sQp) + kk, kLdK,
                                                             sKp + J * 16 * kLdK + kk, kLdK);
        wmma::store_matrix_sync((is_m ? sM : sA) + r0 * kLdC + J * 16, acc, kLdC,
                                wmma::mem_row_major);
      }
      __syncthreads();
    }
  }
  __syncthreads();

  // ---- causal masks, scalar gate factors, beta rows ------------------------
  for (int idx = tid; idx < C * C; idx += Tr::kThreads) {
    const int i = idx / C, j = idx % C;
    float factor = 1.f;
    if constexpr (kDecay == Decay::scalar) factor = j <= i ? __expf(sG[i] - sG[j]) : 0.f;
    sA[i * kLdC + j] = j <= i ? sA[i * kLdC + j] * factor : 0.f;
    if constexpr (Tr::kDelta) sM[i * kLdC + j] = j < i ? sBeta[i] * sM[i * kLdC + j] * factor : 0.f;
  }

  // ---- decayed queries/keys out; delta rules turn K into diag(beta) K^ -----
  const int64_t tile = c * H + h;
  Elem* out_q = static_cast<Elem*>(a.ws_q) + tile * C * Dk;
  Elem* out_k = static_cast<Elem*>(a.ws_k) + tile * C * Dk;
  for (int idx = tid; idx < C * Dk / 4; idx += Tr::kThreads) {
    const int i = idx / (Dk / 4), d0 = (idx % (Dk / 4)) * 4;
    float qv[4], kv[4], kb[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = d0 + e;
      float up = 1.f, down = 1.f;  // e^{b_t}, e^{b_C - b_t}
      if constexpr (Tr::kVector) {
        const float b = sG[i * kLdK + d];
        up = __expf(b);
        down = __expf(sG[(C - 1) * kLdK + d] - b);
      } else if constexpr (kDecay == Decay::scalar) {
        up = __expf(sG[i]);
        down = __expf(sG[C - 1] - sG[i]);
      }
      const float kd = sK[i * kLdK + d];
      qv[e] = sQ[i * kLdK + d] * up;
      kv[e] = kd * down;
      kb[e] = sBeta[i] * kd * up;
    }
    store4(out_q + i * Dk + d0, make_float4(qv[0], qv[1], qv[2], qv[3]));
    store4(out_k + i * Dk + d0, make_float4(kv[0], kv[1], kv[2], kv[3]));
    if constexpr (Tr::kDelta) store4(sK + i * kLdK + d0, make_float4(kb[0], kb[1], kb[2], kb[3]));
  }
  if (tid < Dk) {
    float decay = 1.f;
    if constexpr (Tr::kVector) decay = __expf(sG[(C - 1) * kLdK + tid]);
    if constexpr (kDecay == Decay::scalar) decay = __expf(sG[C - 1]);
    a.ws_decay[tile * Dk + tid] = decay;
  }
  if constexpr (Tr::kDelta) {
    for (int idx = tid; idx < C * Dv; idx += Tr::kThreads) {
      const int i = idx / Dv, j = idx % Dv;
      sV[i * kLdV + j] *= sBeta[i];
    }
  }
  __syncthreads();

  // ---- UT transform: solve (I + M) [W | U] = [diag(beta) K^ | diag(beta) V]
  // in place, blockwise over 16-row blocks b: first X_b -= M[b, <b] X[<b] on
  // the tensor cores (earlier blocks are final), then forward substitution
  // inside the block, one thread per column.
  if constexpr (Tr::kDelta) {
    constexpr int kColTilesX = (Dk + Dv) / 16;
    for (int b = 0; b < nb; ++b) {
      if (b > 0) {
        for (int t = warp; t < kColTilesX; t += Tr::kWarps) {
          const bool in_k = t * 16 < Dk;
          float* x = in_k ? sK + t * 16 : sV + (t * 16 - Dk);
          const int ld = in_k ? kLdK : kLdV;
          AccFragment acc;
          wmma::load_matrix_sync(acc, x + b * 16 * ld, ld, wmma::mem_row_major);
          for (int kk = 0; kk < b * 16; kk += 8)
            mma_tf32<wmma::row_major, wmma::row_major, kSplit, true>(acc, sM + b * 16 * kLdC + kk,
                                                                     kLdC, x + kk * ld, ld);
          wmma::store_matrix_sync(x + b * 16 * ld, acc, ld, wmma::mem_row_major);
        }
        __syncthreads();
      }
      if (tid < Dk + Dv) {
        // The block's 16 entries of this column stay in registers, so the
        // dependency chain is register FMAs rather than shared-memory round trips.
        float* x = tid < Dk ? sK + tid : sV + (tid - Dk);
        const int ld = tid < Dk ? kLdK : kLdV;
        const float* m = sM + b * 16 * kLdC + b * 16;
        float xr[16];
#pragma unroll
        for (int r = 0; r < 16; ++r) xr[r] = x[(b * 16 + r) * ld];
#pragma unroll
        for (int r = 1; r < 16; ++r) {
          float acc = xr[r];
#pragma unroll
          for (int jj = 0; jj < r; ++jj) acc -= m[r * kLdC + jj] * xr[jj];
          xr[r] = acc;
        }
#pragma unroll
        for (int r = 1; r < 16; ++r) x[(b * 16 + r) * ld] = xr[r];
      }
      __syncthreads();
    }
    Elem* out_w = static_cast<Elem*>(a.ws_w) + tile * C * Dk;
    for (int idx = tid; idx < C * Dk / 4; idx += Tr::kThreads) {
      const int i = idx / (Dk / 4), d = (idx % (Dk / 4)) * 4;
      store4(out_w + i * Dk + d, load4(sK + i * kLdK + d));
    }
    for (int idx = tid; idx < C * Dv / 4; idx += Tr::kThreads) {
      const int i = idx / (Dv / 4), j = (idx % (Dv / 4)) * 4;
      store4(out_u + i * Dv + j, load4(sV + i * kLdV + j));
    }
  }
  Elem* out_a = static_cast<Elem*>(a.ws_a) + tile * C * C;
  const int c4 = C / 4;
  for (int idx = tid; idx < C * c4; idx += Tr::kThreads) {
    const int i = idx / c4, j = (idx % c4) * 4;
    store4(out_a + i * C + j, load4(sA + i * kLdC + j));
  }
}

// chunk_state_scan_kernel: the sequential boundary scan, nothing else.
//   grid (Dv / BV, H, N segments), 256 threads; block (vb, h, n) carries the
//   fp32 state columns [vb*BV, vb*BV + BV) of head h through segment n's
//   chunks. Per chunk: save S (the state entering the chunk; in T to
//   ws_states for the output kernel, and in fp32 to chunk_states when the
//   caller asked for them), V' = U - W S (delta rules; saved to ws_vnew),
//   S <- diag(e^{b_C}) S + K_^T V'. For 16-bit T the matrix products read a
//   copy of S rounded to T (as FLA does); S itself stays fp32. The next
//   chunks' K_, W, U and decay are prefetched with cp.async, kStages - 1
//   chunks ahead (two for 16-bit T, one for fp32).
//   Shared memory: ScanTraits::kBytes (bf16, Dk=128, delta: 164 KB at BV=32,
//   140 KB at BV=16; fp32: 182 KB at BV=32).
template <Decay kDecay, Rule kRule, typename T, int Dk, int Dv, int BV>
__global__ void __launch_bounds__(256)
    chunk_state_scan_kernel(const __grid_constant__ ForwardArgs a) {
  constexpr bool kDelta = kRule == Rule::delta;
  using Tr = ScanTraits<T, Dk, Dv, BV, kDelta>;
  using Acc = typename MmaStep<T>::Acc;
  constexpr int kK = MmaStep<T>::kK;
  constexpr int kLdK = Tr::kLdK, kLdB = Tr::kLdB, kLdF = Tr::kLdF;
  constexpr int kColTiles = BV / 16;
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  float* sS = reinterpret_cast<float*>(smem_bytes);
  // The matrix products' view of S: S itself for fp32, else its copy in T.
  T* sSop = Tr::kF32 ? reinterpret_cast<T*>(sS) : reinterpret_cast<T*>(smem_bytes + Tr::kSBytes);
  unsigned char* stages = smem_bytes + Tr::kSBytes + Tr::kSCopyBytes;
  float* sProd = reinterpret_cast<float*>(stages + Tr::kStages * Tr::kStageBytes);  // W S, fp32
  // V' as the S update reads it (fp32: in place over W S).
  T* sVn = Tr::kF32 ? reinterpret_cast<T*>(sProd)
                    : reinterpret_cast<T*>(stages + Tr::kStages * Tr::kStageBytes + Tr::kProdBytes);
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
  const int C = a.chunk, nb = C / 16;
  const int col0 = vb * BV;
  const T* ws_k = static_cast<const T*>(a.ws_k);
  const T* ws_w = static_cast<const T*>(a.ws_w);
  const T* ws_u = static_cast<const T*>(a.ws_u);

  int64_t first_chunk, num_chunks;
  segment_chunks(a, n, first_chunk, num_chunks);

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

  constexpr int kStages = Tr::kStages;
  for (int p = 0; p < kStages - 1; ++p)
    if (p < num_chunks) prefetch(first_chunk + p, p);
  const int64_t state_base = (n * H + h) * Dk * Dv;
  for (int idx = tid; idx < Dk * BV; idx += Tr::kThreads) {
    const int d = idx / BV, j = idx % BV;
    const float s0 =
        a.initial_state != nullptr ? a.initial_state[state_base + d * Dv + col0 + j] : 0.f;
    sS[d * kLdF + j] = s0;
    if constexpr (!Tr::kF32) sSop[d * kLdB + j] = from_float<T>(s0);
  }

  for (int64_t cl = 0; cl < num_chunks; ++cl) {
    const int64_t c = first_chunk + cl;
    const int64_t tile = c * H + h;
    const int st = static_cast<int>(cl % kStages);
    // Chunk cl + kStages - 1 goes into the stage read in the previous
    // iteration (which ended with a barrier). One cp.async group per chunk,
    // committed in order: chunk cl's group is complete once at most `ahead`
    // younger groups are pending.
    if (cl + kStages - 1 < num_chunks)
      prefetch(c + kStages - 1, static_cast<int>((cl + kStages - 1) % kStages));
    const int64_t later = num_chunks - 1 - cl;  // chunks after this one
    const int ahead = later < kStages - 1 ? static_cast<int>(later) : kStages - 1;
    if (ahead >= 2)
      cp_async_wait<2>();
    else if (ahead == 1)
      cp_async_wait<1>();
    else
      cp_async_wait<0>();
    __syncthreads();  // this chunk's stage (and S) visible to every thread

    // Save the state entering this chunk: exactly the values the products use
    // (for the output kernel; a plan without it, the backward's recompute,
    // leaves ws_states null and keeps only the fp32 chunk_states).
    if (a.ws_states != nullptr) {
      T* out_state = static_cast<T*>(a.ws_states) + tile * Dk * Dv + col0;
      constexpr int kVec = 16 / sizeof(T);
      for (int idx = tid; idx < Dk * BV / kVec; idx += Tr::kThreads) {
        const int d = idx / (BV / kVec), j = (idx % (BV / kVec)) * kVec;
        *reinterpret_cast<uint4*>(out_state + d * Dv + j) =
            *reinterpret_cast<const uint4*>(sSop + d * kLdB + j);
      }
    }
    if constexpr (!Tr::kF32) {
      if (a.chunk_states != nullptr) {
        float* out_f32 = a.chunk_states + tile * Dk * Dv + col0;
        for (int idx = tid; idx < Dk * BV / 4; idx += Tr::kThreads) {
          const int d = idx / (BV / 4), j = (idx % (BV / 4)) * 4;
          store4(out_f32 + d * Dv + j, load4(sS + d * kLdF + j));
        }
      }
    }

    if constexpr (kDelta) {
      // W S, one 16x16 tile per warp.
      if (warp < nb * kColTiles) {
        const int I = warp / kColTiles, J = warp % kColTiles;
        Acc acc;
        wmma::fill_fragment(acc, 0.f);
#pragma unroll 4
        for (int kk = 0; kk < Dk; kk += kK)
          mma_step<wmma::row_major, wmma::row_major>(acc, stage_w(st) + I * 16 * kLdK + kk, kLdK,
                                                     sSop + kk * kLdB + J * 16, kLdB);
        wmma::store_matrix_sync(sProd + I * 16 * kLdF + J * 16, acc, kLdF, wmma::mem_row_major);
      }
    }
    __syncthreads();  // W S complete; every read of the old S done

    const T* vnew = stage_u(st);  // additive rules: V' = U
    if constexpr (kDelta) {
      // V' = U - W S, rounded to T once: the update below and the output
      // kernel read the same values (saved only for the output kernel: null
      // ws_vnew in the backward's recompute).
      T* out_vn =
          a.ws_vnew != nullptr ? static_cast<T*>(a.ws_vnew) + tile * C * Dv + col0 : nullptr;
      const T* u = stage_u(st);
      for (int idx = tid; idx < C * BV / 4; idx += Tr::kThreads) {
        const int i = idx / (BV / 4), j = (idx % (BV / 4)) * 4;
        const float4 x = load4(u + i * kLdB + j), p = load4(sProd + i * kLdF + j);
        const float4 vn = make_float4(x.x - p.x, x.y - p.y, x.z - p.z, x.w - p.w);
        store4(sVn + i * kLdB + j, vn);
        if (out_vn != nullptr) store4(out_vn + i * Dv + j, vn);
      }
      vnew = sVn;
    }
    if constexpr (kDecay != Decay::none) {
      const float* decay = stage_decay(st);
      for (int idx = tid; idx < Dk * BV; idx += Tr::kThreads) {
        const int d = idx / BV, j = idx % BV;
        sS[d * kLdF + j] *= decay[d];
      }
    }
    if constexpr (kDelta || kDecay != Decay::none) __syncthreads();

    // S <- S + K_^T V'; for 16-bit T each warp then refreshes the rounded
    // copy of its own tile (read again only after the next barrier).
    for (int t = warp; t < (Dk / 16) * kColTiles; t += Tr::kWarps) {
      const int I = t / kColTiles, J = t % kColTiles;
      Acc acc;
      wmma::load_matrix_sync(acc, sS + I * 16 * kLdF + J * 16, kLdF, wmma::mem_row_major);
      for (int kt = 0; kt < C; kt += kK)
        mma_step<wmma::col_major, wmma::row_major>(acc, stage_k(st) + kt * kLdK + I * 16, kLdK,
                                                   vnew + kt * kLdB + J * 16, kLdB);
      wmma::store_matrix_sync(sS + I * 16 * kLdF + J * 16, acc, kLdF, wmma::mem_row_major);
      if constexpr (!Tr::kF32) {
        __syncwarp();
        for (int e = lane; e < 16 * 16; e += 32) {
          const int r = I * 16 + e / 16, col = J * 16 + e % 16;
          sSop[r * kLdB + col] = from_float<T>(sS[r * kLdF + col]);
        }
      }
    }
    __syncthreads();  // S updated; this stage may be refilled next iteration
  }
  if (a.final_state != nullptr) {
    for (int idx = tid; idx < Dk * BV; idx += Tr::kThreads) {
      const int d = idx / BV, j = idx % BV;
      a.final_state[state_base + d * Dv + col0 + j] = sS[d * kLdF + j];
    }
  }
}

// chunk_output_kernel: o of one chunk from the state entering it.
//   grid (2 * num_chunks, H), 256 threads; block (2c + z, h): O = Q^ S_c + A V'
//   for the chunk's rows and Dv columns [z*Dv/2, z*Dv/2 + Dv/2), written in
//   the input dtype; operands in T, fp32 accumulation. Shared memory:
//   OutputTraits::kBytes (D=128: 71 KB for 16-bit T, 103 KB for fp32).
template <Rule kRule, typename T, int Dk, int Dv>
__global__ void __launch_bounds__(256) chunk_output_kernel(const __grid_constant__ ForwardArgs a) {
  using Tr = OutputTraits<T, Dk, Dv>;
  using Acc = typename MmaStep<T>::Acc;
  constexpr int kK = MmaStep<T>::kK;
  constexpr int kLdK = Tr::kLdK, kLdV = Tr::kLdV, kLdC = Tr::kLdC, kLdO = Tr::kLdO;
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  T* sQ = reinterpret_cast<T*>(smem_bytes);
  T* sA = reinterpret_cast<T*>(smem_bytes + Tr::kQBytes);
  T* sS = reinterpret_cast<T*>(smem_bytes + Tr::kQBytes + Tr::kABytes);
  T* sV = reinterpret_cast<T*>(smem_bytes + Tr::kQBytes + Tr::kABytes + Tr::kSBytes);
  // O in fp32: over V' for fp32 T (after a barrier), else its own tile.
  float* sO = Tr::kF32 ? reinterpret_cast<float*>(sV)
                       : reinterpret_cast<float*>(smem_bytes + Tr::kQBytes + Tr::kABytes +
                                                  Tr::kSBytes + Tr::kVBytes);

  // The two halves of a chunk are neighbours in the grid, so the second
  // block's Q^ and A come from L2 rather than device memory.
  const int64_t c = blockIdx.x / 2, h = blockIdx.y, H = a.heads;
  const int tid = threadIdx.x, warp = tid / 32;
  const int C = a.chunk, nb = C / 16;
  constexpr int kCols = Tr::kCols;
  const int col0 = static_cast<int>(blockIdx.x % 2) * kCols;
  int64_t token0;
  int length;
  chunk_geometry(a, c, token0, length);
  const int64_t tile = c * H + h;
  const T* vnew = static_cast<const T*>(kRule == Rule::delta ? a.ws_vnew : a.ws_u);
  copy_tile_async<Tr::kThreads>(sQ, kLdK, static_cast<const T*>(a.ws_q) + tile * C * Dk, Dk, C, Dk);
  copy_tile_async<Tr::kThreads>(sA, kLdC, static_cast<const T*>(a.ws_a) + tile * C * C, C, C, C);
  copy_tile_async<Tr::kThreads>(
      sS, kLdV, static_cast<const T*>(a.ws_states) + tile * Dk * Dv + col0, Dv, Dk, kCols);
  copy_tile_async<Tr::kThreads>(sV, kLdV, vnew + tile * C * Dv + col0, Dv, C, kCols);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  constexpr int kColTiles = kCols / 16;
  Acc acc[kColTiles / 2];
  // Warp w: row tile w / 2, column tiles (w % 2) * kColTiles/2 ... (8 warps, C <= 64).
  const int I = warp / 2, J0 = (warp % 2) * (kColTiles / 2);
  const bool active = I < nb;
  if (active) {
#pragma unroll
    for (int j = 0; j < kColTiles / 2; ++j) {
      wmma::fill_fragment(acc[j], 0.f);
      for (int kk = 0; kk < Dk; kk += kK)
        mma_step<wmma::row_major, wmma::row_major>(acc[j], sQ + I * 16 * kLdK + kk, kLdK,
                                                   sS + kk * kLdV + (J0 + j) * 16, kLdV);
      for (int kt = 0; kt < (I + 1) * 16; kt += kK)  // A is zero right of the diagonal block
        mma_step<wmma::row_major, wmma::row_major>(acc[j], sA + I * 16 * kLdC + kt, kLdC,
                                                   sV + kt * kLdV + (J0 + j) * 16, kLdV);
    }
  }
  if constexpr (Tr::kF32) __syncthreads();  // every warp done reading V' before O overwrites it
  if (active) {
#pragma unroll
    for (int j = 0; j < kColTiles / 2; ++j)
      wmma::store_matrix_sync(sO + I * 16 * kLdO + (J0 + j) * 16, acc[j], kLdO,
                              wmma::mem_row_major);
  }
  __syncthreads();
  T* o = static_cast<T*>(a.o);
  for (int idx = tid; idx < length * kCols; idx += Tr::kThreads) {
    const int i = idx / kCols, j = idx % kCols;
    o[((token0 + i) * H + h) * Dv + col0 + j] = from_float<T>(sO[i * kLdO + j]);
  }
}

}  // namespace statescan::cuda::detail

#include "kernels/cuda/chunk_output_raw16.cuh"
#include "kernels/cuda/chunk_prepare16.cuh"
#include "kernels/cuda/chunk_scan16.cuh"
#include "kernels/cuda/chunk_scan_wgmma.cuh"

// After the scan and output kernels: it builds on their WarpStateTiles,
// store_chunk_slab and store_causal_scores.
#include "kernels/cuda/chunk_linear_grouped16.cuh"

namespace statescan::cuda::detail {

// Which of the three kernels a launch runs (a bit mask). The full forward runs
// all three; context parallelism runs prepare + scan from a zero state for its
// summary, and the backward re-runs prepare alone to recompute the tiles.
enum ForwardStage : int {
  kStagePrepare = 1,
  kStageScan = 2,
  kStageOutput = 4,
  kAllStages = kStagePrepare | kStageScan | kStageOutput,
};

// Whether the scan stage forms the output itself, so that the output stage
// reads no V' and no T-typed states: the grouped linear scan (raw path), the
// fused delta scan (fuse_output) and the per-head identity scan of the
// two-level summary (its runs' H). launch_chunk_kernels dispatches on these
// flags (and refuses them for an instance without that scan);
// launch_forward_stages asks here before it launches anything, so that the
// two cannot disagree (they once did: STATESCAN_FWD_OUTPUT=kernel refused
// every two-level summary with first-segment maps).
inline bool scan_forms_output(const ForwardArgs& a) {
  return (a.raw_additive && a.group_chunks > 0) || a.fuse_output ||
         (a.scan_per_head && a.scan_identity);
}

// The instantiations whose kernels can read their inputs in place
// (ForwardArgs::raw_additive), forward and backward; the host sets
// raw_additive only for them (plan_forward), and a mismatch is a bug.
template <Decay kDecay, Rule kRule, typename Elem, bool kL2Norm>
inline constexpr bool kRawCapable = (kDecay == Decay::none) && (kRule == Rule::additive) && !kL2Norm
                                    && !std::is_same_v<Elem, float>;

// Host launch of the three kernels for one (variant, dtype, head dims, l2norm).
// The scan's Dv block is 16 columns when those blocks all fit in one wave
// (one block per multiprocessor; few heads and sequences), else 32: a second
// wave of a sequential scan would double its time.
template <Decay kDecay, Rule kRule, typename Elem, int Dk, int Dv, bool kL2Norm>
void launch_chunk_kernels(const ForwardArgs& a, int stages, cudaStream_t stream) {
  using OutTr = OutputTraits<Elem, Dk, Dv>;
  constexpr bool kRaw = kRawCapable<kDecay, kRule, Elem, kL2Norm>;
  SS_CHECK_ARG(kRaw || !a.raw_additive, "raw_additive",
               "set for a variant, dtype or L2 norm whose tiles need the prepare stage");
  SS_CHECK_ARG(!a.raw_additive || !(a.scan_wmma || a.prepare_fp32_tiles), "raw_additive",
               "cannot be combined with the STATESCAN_SCAN / STATESCAN_PREPARE A/B knobs");
  SS_CHECK_ARG(!a.raw_additive || !(stages & kStagePrepare), "stages",
               "the raw linear path has no tile workspace for the prepare stage");
  if (stages & kStagePrepare) {
    const dim3 grid(static_cast<unsigned>(a.num_chunks), static_cast<unsigned>(a.heads));
    if (std::is_same_v<Elem, float> || a.prepare_fp32_tiles) {
      using PrepTr = ChunkTraits<kDecay, kRule, Dk, Dv>;
      launch_kernel(chunk_prepare_kernel<kDecay, kRule, Elem, Dk, Dv, kL2Norm>, grid,
                    PrepTr::kThreads, PrepTr::kPrepBytes, stream, "chunk_prepare_kernel", a);
    } else if constexpr (!std::is_same_v<Elem, float>) {
      using PrepTr = Prepare16Traits<kDecay, kRule, Elem, Dk, Dv, kL2Norm>;
      with_chunk_size(a.chunk, [&](auto chunk_tag) {
        launch_kernel(chunk_prepare16_kernel<kDecay, kRule, Elem, Dk, Dv, kL2Norm,
                                             decltype(chunk_tag)::value>,
                      grid, PrepTr::kThreads, PrepTr::kBytes, stream, "chunk_prepare16_kernel", a);
      });
    }
  }

  // The output inside the scan (ForwardArgs::fuse_output): needs both stages.
  SS_CHECK_ARG(!a.fuse_output || (kRule == Rule::delta && !std::is_same_v<Elem, float> &&
                                  !a.scan_wmma && !a.raw_additive),
               "fuse_output", "set for a variant, dtype or scan without the fused output");
  SS_CHECK_ARG(!a.fuse_output || !(stages & kStageOutput) || (stages & kStageScan), "stages",
               "the output is formed inside the scan: the output stage needs the scan stage");
  const bool fuse = a.fuse_output && (stages & kStageScan) && (stages & kStageOutput);
  auto launch_scan = [&](auto bv_tag) {
    constexpr int kBV = decltype(bv_tag)::value;
    const dim3 grid(Dv / kBV, static_cast<unsigned>(a.heads),
                    static_cast<unsigned>(a.num_segments));
    if (std::is_same_v<Elem, float> || a.scan_wmma) {
      using ScanTr = ScanTraits<Elem, Dk, Dv, kBV, kRule == Rule::delta>;
      launch_kernel(chunk_state_scan_kernel<kDecay, kRule, Elem, Dk, Dv, kBV>, grid,
                    ScanTr::kThreads, ScanTr::kBytes, stream, "chunk_state_scan_kernel", a);
    } else if constexpr (!std::is_same_v<Elem, float>) {
      using ScanTr = Scan16Traits<Elem, Dk, Dv, kBV, kRule == Rule::delta>;
      with_chunk_size(a.chunk, [&](auto chunk_tag) {
        constexpr int kC = decltype(chunk_tag)::value;
        if constexpr (kRaw) {
          if (a.raw_additive) {
            launch_kernel(chunk_state_scan16_kernel<kDecay, kRule, Elem, Dk, Dv, kBV, kC, true>,
                          grid, ScanTr::kThreads, ScanTr::kBytes, stream,
                          "chunk_state_scan16_kernel (raw)", a, ScanTileMaps{});
            return;
          }
        }
        if constexpr (kRule == Rule::delta) {
          if (fuse) {
            // Clusters of the head's column blocks share their tile loads
            // (Scan16Traits::kBulk): tensor maps of the tile arrays as
            // [tiles * C][cols], a CTA's box its share of a tile's rows
            // padded to the shared-memory row.
            using FusedTr = Scan16Traits<Elem, Dk, Dv, kBV, true, true>;
            auto kernel =
                chunk_state_scan16_kernel<kDecay, kRule, Elem, Dk, Dv, kBV, kC, false, true>;
            const unsigned cluster = scan_cluster_ctas(kernel, grid, FusedTr::kThreads,
                                                       FusedTr::kBytes, kC, a.scan_cluster);
            ScanTileMaps maps =
                shared_tile_maps<Dk, FusedTr::kLdK, FusedTr::kLdA>(a, kC, cluster);
            maps.u = tile_map_2d(a.ws_u, a.num_chunks * a.heads * kC, Dv, FusedTr::kLdB, kC);
            launch_kernel_cluster(kernel, grid, FusedTr::kThreads, FusedTr::kBytes, cluster,
                                  stream, "chunk_state_scan16_kernel (output)", a, maps);
            return;
          }
        }
        launch_kernel(chunk_state_scan16_kernel<kDecay, kRule, Elem, Dk, Dv, kBV, kC>, grid,
                      ScanTr::kThreads, ScanTr::kBytes, stream, "chunk_state_scan16_kernel", a,
                      ScanTileMaps{});
      });
    }
  };
  if constexpr (kRaw) {
    // The scan in chunk groups (chunk_linear_grouped16.cuh): the group sums
    // and their prefix, then the fused scan + output, or, without the output,
    // the chunk states alone when asked for.
    if (a.raw_additive && a.group_chunks > 0 && (stages & kStageScan)) {
      using GrTr = Grouped16Traits<Elem, Dk, Dv>;
      SS_CHECK_ARG(a.ws_group_sums != nullptr && a.max_segment_groups > 0, "workspace",
                   "has no group sums for the grouped linear forward");
      const dim3 grid(static_cast<unsigned>(a.max_segment_groups), static_cast<unsigned>(a.heads),
                      static_cast<unsigned>(a.num_segments));
      with_chunk_size(a.chunk, [&](auto chunk_tag) {
        constexpr int kC = decltype(chunk_tag)::value;
        launch_kernel(chunk_group_sums16_kernel<Elem, Dk, Dv, kC, false>, grid, GrTr::kThreads,
                      GrTr::kSumBytes, stream, "chunk_group_sums16_kernel", a);
        launch_kernel(group_prefix_kernel<Dk, Dv>,
                      dim3(static_cast<unsigned>((Dk * Dv + 255) / 256),
                           static_cast<unsigned>(a.heads), static_cast<unsigned>(a.num_segments)),
                      256, 0, stream, "group_prefix_kernel", a);
        if (stages & kStageOutput)
          launch_kernel(chunk_forward_grouped16_kernel<Elem, Dk, Dv, kC>, grid, GrTr::kThreads,
                        GrTr::kBytes, stream, "chunk_forward_grouped16_kernel", a);
        else if (a.chunk_states != nullptr)
          launch_kernel(chunk_group_sums16_kernel<Elem, Dk, Dv, kC, true>, grid, GrTr::kThreads,
                        GrTr::kSumBytes, stream, "chunk_group_sums16_kernel (states)", a);
      });
      return;
    }
  }
  if constexpr (kRule == Rule::delta && !std::is_same_v<Elem, float> && Dk == 128 && Dv == 128) {
    if (a.scan_per_head && (stages & kStageScan)) {
      const bool out = (stages & kStageOutput) != 0;
      SS_CHECK_ARG((!out || a.scan_identity) && a.chunk_states == nullptr &&
                       a.ws_states == nullptr && a.ws_vnew == nullptr,
                   "scan_per_head",
                   "the per-head scan keeps only the final state (and the identity scan's "
                   "outputs)");
      SS_CHECK_ARG(a.chunk == 64 && !a.scan_wmma, "scan_per_head", "needs chunk 64 (got ", a.chunk,
                   ") and not the STATESCAN_SCAN A/B knob");
      SS_CHECK_ARG(!out || (a.o != nullptr && a.ws_q != nullptr && a.ws_a != nullptr),
                   "scan_per_head", "the identity scan's outputs need o, Q^ and A");
      const dim3 grid(static_cast<unsigned>(a.heads), static_cast<unsigned>(a.num_segments));
      // The tiles as TMA boxes of 64 x 64, 128-byte swizzled (WgmmaTileMaps).
      const int64_t rows = a.num_chunks * a.heads * 64;
      SS_CHECK_ARG(rows < (int64_t{1} << 31), "q",
                   "too many chunk tiles for the scans' 32-bit tensor coordinates");
      auto map = [&](const void* tiles, int64_t cols) {
        return tile_map_2d(tiles, rows, cols, 64, 64, CU_TENSOR_MAP_SWIZZLE_128B);
      };
      WgmmaTileMaps maps{};
      maps.k = map(a.ws_k, Dk);
      maps.w = map(a.ws_w, Dk);
      const bool pair = a.scan_pair_state != nullptr;
      SS_CHECK_ARG(!pair || a.scan_identity, "scan_pair_state",
                   "E beside the maps needs the identity scan (scan_identity)");
      auto launch = [&](auto mode) {
        constexpr WgmmaScan kMode = decltype(mode)::value;
        using Tr = ScanWgmmaTraits<kMode>;
        if (Tr::kU || pair) maps.u = map(a.ws_u, Dv);
        if constexpr (Tr::kOut) {
          maps.q = map(a.ws_q, Dk);
          maps.a = map(a.ws_a, a.chunk);
        }
        if constexpr (kMode != WgmmaScan::state) {
          if (pair) {
            auto kernel = chunk_state_scan_wgmma_pair_kernel<Elem, kDecay != Decay::none, kMode>;
            constexpr size_t bytes = pair_scan_bytes<kMode>();
            const int64_t clusters = a.heads * a.num_segments;
            struct FitTag {};  // one cache per instance, one entry per device
            const int fit = cached_device_check<FitTag>(0, 0, [&](int, int64_t, int64_t) {
              return active_clusters(kernel, Tr::kThreads, bytes, 2);
            });
            SS_CHECK_ARG(clusters <= fit, "scan_pair_state", clusters,
                         " pairs of CTAs do not fit the GPU at once (cuda::summary_pieces "
                         "sizes the runs so that they do)");
            launch_kernel_cluster(kernel, dim3(2, grid.x, grid.y), Tr::kThreads, bytes, 2, stream,
                                  "chunk_state_scan_wgmma_pair_kernel", a, maps);
            return;
          }
        }
        launch_kernel(chunk_state_scan_wgmma_kernel<Elem, kDecay != Decay::none, kMode>, grid,
                      Tr::kThreads, Tr::kBytes, stream, "chunk_state_scan_wgmma_kernel", a, maps);
      };
      if (out)
        launch(std::integral_constant<WgmmaScan, WgmmaScan::maps_out>{});
      else if (a.scan_identity)
        launch(std::integral_constant<WgmmaScan, WgmmaScan::maps>{});
      else
        launch(std::integral_constant<WgmmaScan, WgmmaScan::state>{});
      return;
    }
  }
  SS_CHECK_ARG(!(a.scan_per_head && (stages & kStageScan)), "scan_per_head",
               "set for a variant, dtype or head dim without the per-head scan");
  SS_CHECK_ARG(!a.scan_identity, "scan_identity", "needs the per-head scan");
  SS_CHECK_ARG(a.scan_pair_state == nullptr, "scan_pair_state", "needs the per-head scan");
  const int scan_bv = a.scan_block_cols != 0                              ? a.scan_block_cols
                      : a.heads * a.num_segments * (Dv / 16) <= a.num_sms ? 16
                                                                          : 32;
  if (stages & kStageScan) {
    if (scan_bv == 16)
      launch_scan(std::integral_constant<int, 16>{});
    else
      launch_scan(std::integral_constant<int, 32>{});
  }
  if constexpr (kRaw) {
    if ((stages & kStageOutput) && a.raw_additive) {
      using RawTr = OutputRaw16Traits<Elem, Dk, Dv>;
      with_chunk_size(a.chunk, [&](auto chunk_tag) {
        launch_kernel(chunk_output_raw16_kernel<Elem, Dk, Dv, decltype(chunk_tag)::value>,
                      dim3(static_cast<unsigned>(a.num_chunks), static_cast<unsigned>(a.heads)),
                      RawTr::kThreads, RawTr::kBytes, stream, "chunk_output_raw16_kernel", a);
      });
      return;
    }
  }
  if ((stages & kStageOutput) && !fuse)
    launch_kernel(chunk_output_kernel<kRule, Elem, Dk, Dv>,
                  dim3(static_cast<unsigned>(2 * a.num_chunks), static_cast<unsigned>(a.heads)),
                  OutTr::kThreads, OutTr::kBytes, stream, "chunk_output_kernel", a);
}

// Dispatch of one variant over dtype x head dim x l2norm; defined once per
// variant in chunk_forward_<variant>.cu so the instantiations compile in parallel.
template <Decay kDecay, Rule kRule>
void launch_chunk_forward(const ForwardArgs& a, DType dtype, int64_t head_dim, bool l2norm,
                          int stages, cudaStream_t stream);

#define SS_DISPATCH_BOOL(flag, kName, ...) \
  do {                                     \
    if (flag) {                            \
      constexpr bool kName = true;         \
      __VA_ARGS__();                       \
    } else {                               \
      constexpr bool kName = false;        \
      __VA_ARGS__();                       \
    }                                      \
  } while (0)

template <Decay kDecay, Rule kRule>
void launch_chunk_forward_impl(const ForwardArgs& a, DType dtype, int64_t head_dim, bool l2norm,
                               int stages, cudaStream_t stream) {
  auto with_dim = [&](auto elem_tag) {
    using Elem = decltype(elem_tag);
    SS_DISPATCH_BOOL(l2norm, kL2Norm, [&] {
      if (head_dim == 64) {
        launch_chunk_kernels<kDecay, kRule, Elem, 64, 64, kL2Norm>(a, stages, stream);
      } else if (head_dim == 128) {
        launch_chunk_kernels<kDecay, kRule, Elem, 128, 128, kL2Norm>(a, stages, stream);
      } else {
        SS_FAIL("dk", "CUDA forward supports Dk == Dv in {64, 128}, got ", head_dim);
      }
    });
  };
  switch (dtype) {
    case DType::f32:
      with_dim(float{});
      break;
    case DType::bf16:
      with_dim(__nv_bfloat16{});
      break;
    case DType::f16:
      with_dim(__half{});
      break;
  }
}

#define SS_INSTANTIATE_CHUNK_FORWARD(kDecay, kRule)                                             \
  template <>                                                                                   \
  void launch_chunk_forward<kDecay, kRule>(const ForwardArgs& a, DType dtype, int64_t head_dim, \
                                           bool l2norm, int stages, cudaStream_t stream) {      \
    launch_chunk_forward_impl<kDecay, kRule>(a, dtype, head_dim, l2norm, stages, stream);       \
  }

}  // namespace statescan::cuda::detail
