// Host side of the chunkwise CUDA forward: argument checks, the packed-sequence
// chunk tables, workspace layout and the per-variant dispatch.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_pool.h"
#include "core/env_knob.h"
#include "kernels/cuda/cuda_mixer.h"
#include "kernels/cuda/forward_plan.cuh"
#include "kernels/cuda/launch.cuh"

namespace statescan::cuda {
namespace {

using detail::aligned16;
using detail::ForwardArgs;
using detail::max_chunks;
using detail::MixerTensors;
using detail::tensors_of;
using detail::workspace_aligned;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Workspace layout, every piece 256-byte aligned. Tiles are in the input's
// element type; the per-chunk decay is fp32.
struct WorkspaceLayout {
  size_t q = 0, k = 0, w = 0, u = 0, a = 0, decay = 0, t = 0, vnew = 0, states = 0;
  size_t group_sums = 0, group_table = 0;
  size_t chunk_table = 0, segment_table = 0;
  size_t total = 0;
};

size_t align_up(size_t x) {
  return (x + 255) / 256 * 256;
}

// Tuning and A/B knobs from the environment, read once per process (speed
// and precision comparisons of two kernels in one run); each but
// STATESCAN_SCAN_BV also accepts its default's name (16, mma, grouped, auto,
// prepare), and any other value is an error naming the variable
// (core/env_knob.h):
//   STATESCAN_SCAN_BV=16|32  forces the state scan's Dv block (unset: 16 or
//                            32 by occupancy, chunk_forward.cuh);
//   STATESCAN_PREPARE=fp32   16-bit inputs through chunk_prepare_kernel
//                            (fp32 tiles) instead of chunk_prepare16_kernel;
//   STATESCAN_SCAN=wmma      16-bit inputs through chunk_state_scan_kernel
//                            instead of chunk_state_scan16_kernel;
//   STATESCAN_LINEAR=tiles   linear attention through the prepared tiles
//                            (prepare, scan, output) instead of the kernels
//                            that read q, k, v themselves;
//   STATESCAN_LINEAR=scan    those kernels' scan as one sequential chain
//                            per (segment, head, Dv block) with a separate
//                            output kernel, instead of in groups of
//                            kGroupChunks chunks (chunk_linear_grouped16.cuh);
//                            STATESCAN_LINEAR_GROUP_CHUNKS=N sets the group
//                            (the tests use 2 for many groups on short inputs).
//   STATESCAN_FWD_OUTPUT=kernel|scan  where delta rules with 16-bit inputs
//                            form o: the separate output kernel (reading
//                            16-bit states and V' from the workspace) or,
//                            the default, inside the scan (chunk_scan16.cuh,
//                            kOut; output_in_scan says why).
//   STATESCAN_SCAN_CLUSTER=auto|1|2|4|8  CTAs per thread-block cluster of
//                            the delta scans that form o (their column blocks
//                            of a head share the K_, W, Q^ and A loads,
//                            cluster_copy.cuh); auto: the largest that keeps
//                            the grid co-resident (scan_cluster_ctas).

// Chunks per group of the grouped linear forward: 16 (1,024 tokens at chunk
// 64) makes 32 groups per head at 32K, ~4 waves of 512 blocks on an H200,
// with chains of 16 steps.
constexpr int64_t kGroupChunks = 16;

struct KernelKnobs {
  int scan_block_cols = 0;
  bool prepare_fp32_tiles = false;
  bool scan_wmma = false;
  bool linear_tiles = false;
  bool linear_grouped = true;
  bool output_kernel = false;  // STATESCAN_FWD_OUTPUT=kernel (the default is the scan)
  int64_t group_chunks = kGroupChunks;  // STATESCAN_LINEAR_GROUP_CHUNKS
  int scan_cluster = 0;                  // STATESCAN_SCAN_CLUSTER, 0 = auto
  bool bwd_t_from_prepare = true;        // STATESCAN_BWD_T=solve turns it off (t_region)
};

const KernelKnobs& kernel_knobs() {
  static const KernelKnobs knobs = [] {
    KernelKnobs k;
    const int bv = env_choice("STATESCAN_SCAN_BV", {"16", "32"});
    k.scan_block_cols = bv < 0 ? 0 : bv == 0 ? 16 : 32;
    k.prepare_fp32_tiles = env_choice("STATESCAN_PREPARE", {"16", "fp32"}) == 1;
    k.scan_wmma = env_choice("STATESCAN_SCAN", {"mma", "wmma"}) == 1;
    const int linear = env_choice("STATESCAN_LINEAR", {"grouped", "scan", "tiles"});
    k.linear_grouped = linear != 1;
    k.linear_tiles = linear == 2;
    k.output_kernel = env_choice("STATESCAN_FWD_OUTPUT", {"auto", "kernel", "scan"}) == 1;
    k.group_chunks = env_int("STATESCAN_LINEAR_GROUP_CHUNKS", kGroupChunks, 1, 1 << 20);
    const int cluster = env_choice("STATESCAN_SCAN_CLUSTER", {"auto", "1", "2", "4", "8"});
    k.scan_cluster = cluster <= 0 ? 0 : 1 << (cluster - 1);
    k.bwd_t_from_prepare = env_choice("STATESCAN_BWD_T", {"prepare", "solve"}) != 1;
    return k;
  }();
  return knobs;
}

// Whether the raw linear path's scan of `p` runs in chunk groups (the
// default; STATESCAN_LINEAR=scan turns it off), and an upper bound on its
// group slots that does
// not need cu_seqlens' contents: each of N segments adds at most one partial
// group.
bool grouped_linear(const MixerParams& p) {
  return kernel_knobs().linear_grouped && reads_inputs_directly(p);
}
// Whether the forward of `p` forms o inside its scan (ForwardArgs::
// fuse_output): delta rules with 16-bit inputs and the 16-bit scan, unless
// STATESCAN_FWD_OUTPUT=kernel. Measured on an H200 (bf16, H 16, D 128,
// 2026-12-02; kernels/cuda/PERF_NOTES.md, forward v8 and v9): v8's fused scan
// (cp.async loads by the state warps) made forward + backward ~2 % faster but
// a forward alone slower (DeltaNet 32K 1.640 -> 1.666 ms), so it ran only with
// chunk states saved; v9's (a producer warp, tensor copies multicast across a
// cluster) is faster either way: DeltaNet forward 1.640 -> 1.458 ms at 32K,
// KDA 1.979 -> 1.796.
bool output_in_scan(const MixerParams& p) {
  const KernelKnobs& k = kernel_knobs();
  if (!has_beta(p.variant) || p.dtype == DType::f32 || k.scan_wmma) return false;
  return !k.output_kernel;
}
int64_t max_group_slots(const MixerParams& p) {
  const int64_t G = kernel_knobs().group_chunks;
  if (p.cu_seqlens == nullptr) return p.batch * ceil_div(ceil_div(p.seq_len, p.chunk), G);
  return ceil_div(max_chunks(p), G) + p.num_segments;
}

// Whether the workspace has room for T per chunk (ForwardArgs::ws_t), which
// chunk_prepare16_kernel then writes for chunk_intra_grad_kernel: a delta
// rule that those kernels prepare and differentiate (16-bit, no vector gate,
// not the fp32-tile prepare of STATESCAN_PREPARE=fp32), unless
// STATESCAN_BWD_T=solve (the intra kernel solves T again, as before). 8 KB per
// chunk and head at C = 64. Both plans a backward reads get it (the prepare
// re-run's and a PreparedForward's, which --keep-prepared adopts: the two
// give bitwise the same gradients, which test_cuda_cp checks; without T in
// the latter they did not). Measured 2026-12-02 (H200, bf16, H 16, D 128):
// DeltaNet fwd+bwd 32K 4.987 -> 4.792 ms, 128K 19.657 -> 18.989; Gated
// DeltaNet 5.411 -> 5.229, 21.278 -> 20.578 (PERF_NOTES, "After b17").
bool t_capable(const MixerParams& p) {
  return has_beta(p.variant) && !vector_gate(p.variant) && p.dtype != DType::f32 &&
         !kernel_knobs().prepare_fp32_tiles;
}
// A caller's saved T (MixerParams::saved_t) takes the workspace's place.
bool t_region(const MixerParams& p) {
  return kernel_knobs().bwd_t_from_prepare && t_capable(p) && p.saved_t == nullptr;
}

// prepare_only: without V' and the T-typed states, which only the scan stage
// writes (the backward re-runs the prepare stage alone).
// Kernels that read their inputs directly (reads_inputs_directly) take no
// tiles: those pieces are empty.
WorkspaceLayout layout_for(const MixerParams& p, bool prepare_only = false) {
  const size_t chunks = static_cast<size_t>(max_chunks(p));
  const size_t H = static_cast<size_t>(p.heads), C = static_cast<size_t>(p.chunk);
  const size_t elem = size_of(p.dtype);
  const bool tiles = !reads_inputs_directly(p);
  const size_t tile_k = tiles ? chunks * H * C * static_cast<size_t>(p.dk) * elem : 0;
  WorkspaceLayout l;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align_up(bytes);
    return here;
  };
  l.q = take(tile_k);
  l.k = take(tile_k);
  l.w = take(has_beta(p.variant) ? tile_k : 0);
  l.u = take(tiles ? chunks * H * C * static_cast<size_t>(p.dv) * elem : 0);
  l.a = take(tiles ? chunks * H * C * C * elem : 0);
  l.decay = take(tiles ? chunks * H * static_cast<size_t>(p.dk) * sizeof(float) : 0);
  // T per chunk for chunk_intra_grad_kernel (ForwardArgs::ws_t, t_region).
  l.t = take(t_region(p) ? chunks * H * C * C * elem : 0);
  // V' and the 16-bit states go from the scan to the output kernel; the scan
  // with the output inside keeps both in shared memory.
  const bool fused = output_in_scan(p);
  l.vnew = take(has_beta(p.variant) && !prepare_only && !fused
                    ? chunks * H * C * static_cast<size_t>(p.dv) * elem
                    : 0);
  // The output kernel reads the chunk states in the element type; fp32
  // inputs read the caller's chunk_states when given.
  // The grouped linear scan keeps them in shared memory instead.
  const bool states_in_caller = p.dtype == DType::f32 && p.chunk_states != nullptr;
  const bool grouped = grouped_linear(p);
  l.states = take(states_in_caller || prepare_only || grouped || fused
                      ? 0
                      : chunks * H * static_cast<size_t>(p.dk * p.dv) * elem);
  // Group sums also in a prepare-only plan: the backward's recompute of the
  // chunk states sums as the forward did (chunk_linear_grouped16.cuh).
  if (grouped) {
    l.group_sums = take(static_cast<size_t>(max_group_slots(p)) * H *
                        static_cast<size_t>(p.dk * p.dv) * sizeof(float));
    if (p.cu_seqlens != nullptr)
      l.group_table = take(static_cast<size_t>(p.num_segments) * sizeof(int64_t));
  }
  if (p.cu_seqlens != nullptr) {
    l.chunk_table = take(chunks * 2 * sizeof(int64_t));
    l.segment_table = take(static_cast<size_t>(p.num_segments) * 2 * sizeof(int64_t));
  }
  l.total = at;
  return l;
}

}  // namespace

bool reads_inputs_directly(const MixerParams& p) {
  // Linear attention's tiles are copies of its inputs (K_ = k, U = v) or
  // products the output kernel forms itself, unless the L2 norm rewrites q,
  // k; fp32 inputs and the A/B knobs keep the tile kernels.
  const KernelKnobs& k = kernel_knobs();
  return p.variant == Variant::linear && !p.l2norm_qk && p.dtype != DType::f32 &&
         !k.prepare_fp32_tiles && !k.scan_wmma && !k.linear_tiles;
}

bool prepare_checks_finite(const MixerParams& p) {
  return p.dtype != DType::f32 && !reads_inputs_directly(p) && !kernel_knobs().prepare_fp32_tiles;
}

namespace {

void check_supported(const MixerParams& p) {
  SS_CHECK_ARG(p.dk == p.dv && (p.dk == 64 || p.dk == 128), "dk",
               "CUDA forward supports Dk == Dv in {64, 128}, got Dk ", p.dk, ", Dv ", p.dv);
  // The kernels read rows of q, k, v and vector gates 4 elements at a time.
  SS_CHECK_ARG(aligned16(p.q), "q", "must be 16-byte aligned");
  SS_CHECK_ARG(aligned16(p.k), "k", "must be 16-byte aligned");
  SS_CHECK_ARG(aligned16(p.v), "v", "must be 16-byte aligned");
  SS_CHECK_ARG(p.g == nullptr || aligned16(p.g), "g", "must be 16-byte aligned");
  // The output stages store o in 4- to 16-byte pieces (a misaligned address
  // is a sticky CUDA error: the context, and every CP peer, would be lost).
  SS_CHECK_ARG(p.o == nullptr || aligned16(p.o), "o", "must be 16-byte aligned");
  // The state scans store chunk_states in 8- and 16-byte pieces; the backward
  // reads them 32 bytes at a time and refuses less, so the forward asks the
  // same (a forward that passes must not leave states its backward refuses).
  SS_CHECK_ARG(p.chunk_states == nullptr || reinterpret_cast<uintptr_t>(p.chunk_states) % 32 == 0,
               "chunk_states", "must be 32-byte aligned");
  check_grid_limits(p);
}

}  // namespace

void check_grid_limits(const MixerParams& p) {
  // Heads and segments index grid dimensions y and z (at most 65,535 each).
  constexpr int64_t kMaxGridYZ = 65535;
  SS_CHECK_ARG(p.heads <= kMaxGridYZ, "heads", "at most ", kMaxGridYZ, " on the GPU, got ",
               p.heads);
  SS_CHECK_ARG(p.num_segments <= kMaxGridYZ, p.cu_seqlens != nullptr ? "cu_seqlens" : "batch",
               "at most ", kMaxGridYZ, " sequences in one call on the GPU, got ", p.num_segments,
               " (split the batch)");
}

bool device_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

int multiprocessor_count() {
  // Atomic: threads driving different (or the same) GPUs fill it at once.
  static std::atomic<int> cached[64] = {};
  int device = 0;
  SS_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 64) {
    if (const int known = cached[device].load(std::memory_order_relaxed); known != 0) return known;
  }
  int count = 0;  // beyond 64 devices: asked every time
  SS_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (device < 64) cached[device].store(count, std::memory_order_relaxed);
  return count;
}

size_t forward_workspace_bytes(const MixerParams& p) {
  return layout_for(p).total;
}

bool saved_t_supported(const MixerParams& p) { return t_capable(p); }
size_t saved_t_bytes(const MixerParams& p) {
  return 2 * static_cast<size_t>(max_chunks(p)) * static_cast<size_t>(p.heads) *
         static_cast<size_t>(p.chunk * p.chunk) * size_of(p.dtype);
}

namespace detail {

int64_t max_chunks(const MixerParams& p) {
  check_sizes(p);
  if (p.cu_seqlens == nullptr) return p.batch * ceil_div(p.seq_len, p.chunk);
  return ceil_div(p.seq_len, p.chunk) + p.num_segments;
}

size_t prepare_workspace_bytes(const MixerParams& p) {
  return layout_for(p, true).total;
}

bool intra_reads_t() { return kernel_knobs().bwd_t_from_prepare; }
bool scan_wmma_forced() {
  return kernel_knobs().scan_wmma;
}

ForwardPlan plan_forward(const MixerParams& p, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream, bool prepare_only, bool for_backward) {
  ForwardPlan plan;
  // validate() reads cu_seqlens on the host; here it is a device array, so
  // check a copy that points at a host mirror.
  MixerParams host_view = p;
  std::vector<int64_t>& offsets = plan.offsets;
  if (p.cu_seqlens != nullptr) {
    SS_CHECK_ARG(p.num_segments >= 1, "cu_seqlens", "must hold at least 2 offsets");
    offsets.resize(static_cast<size_t>(p.num_segments + 1));
    SS_CUDA_CHECK(cudaMemcpyAsync(offsets.data(), p.cu_seqlens, offsets.size() * sizeof(int64_t),
                                  cudaMemcpyDeviceToHost, stream));
    SS_CUDA_CHECK(cudaStreamSynchronize(stream));
    host_view.cu_seqlens = offsets.data();
  }
  validate(host_view);
  check_supported(p);
  const WorkspaceLayout l = layout_for(p, prepare_only);
  SS_CHECK_ARG(workspace != nullptr && workspace_bytes >= l.total, "workspace", "needs ", l.total,
               " bytes, got ", workspace_bytes);
  SS_CHECK_ARG(workspace_aligned(workspace), "workspace", "must be 32-byte aligned");

  char* base = static_cast<char*>(workspace);
  ForwardArgs& a = plan.args;
  static_cast<MixerTensors&>(a) = tensors_of(p);
  a.chunk_states = p.chunk_states;
  a.raw_additive = reads_inputs_directly(p);
  const bool grouped = grouped_linear(p);
  // The raw path's layout has no tiles: null pointers, never aliases.
  auto tile = [&](size_t offset) { return a.raw_additive ? nullptr : base + offset; };
  a.ws_q = tile(l.q);
  a.ws_k = tile(l.k);
  a.ws_w = has_beta(p.variant) ? tile(l.w) : nullptr;
  a.ws_u = tile(l.u);
  a.ws_a = tile(l.a);
  a.ws_decay = reinterpret_cast<float*>(tile(l.decay));
  // Written by the plans a backward reads its tiles from: its own prepare
  // re-run, and a PreparedForward's (for_backward) that it may adopt.
  a.ws_t = t_region(p) && (prepare_only || for_backward) ? base + l.t : nullptr;
  if (p.saved_t != nullptr) {
    // The forward writes both parts; the backward's prepare re-run
    // (prepare_only) reads them instead of forming KK and solving.
    SS_CHECK_ARG(t_capable(p), "saved_t",
                 "only delta rules without a vector gate save T, with bf16/f16 inputs and the "
                 "16-bit prepare kernel (cuda::saved_t_supported)");
    SS_CHECK_ARG(aligned16(p.saved_t), "saved_t",
                 "must be 16-byte aligned (tiles move in 16 bytes)");
    a.ws_t = p.saved_t;
    a.ws_t_lo = static_cast<char*>(p.saved_t) + saved_t_bytes(p) / 2;
    a.t_given = prepare_only;
  }
  a.fuse_output = output_in_scan(p) && !prepare_only;
  a.ws_vnew = has_beta(p.variant) && !prepare_only && !a.fuse_output ? base + l.vnew : nullptr;
  a.ws_states = p.dtype == DType::f32 && p.chunk_states != nullptr
                    ? static_cast<void*>(p.chunk_states)
                : prepare_only || grouped || a.fuse_output ? nullptr
                                                           : static_cast<void*>(base + l.states);
  a.num_sms = multiprocessor_count();
  a.scan_block_cols = kernel_knobs().scan_block_cols;
  a.prepare_fp32_tiles = kernel_knobs().prepare_fp32_tiles;
  a.scan_wmma = kernel_knobs().scan_wmma;
  a.scan_cluster = kernel_knobs().scan_cluster;
  a.heads = p.heads;
  a.seq_len = p.seq_len;
  a.chunk = static_cast<int>(p.chunk);
  a.scale = p.scale;
  a.num_segments = p.num_segments;
  a.chunks_per_row = ceil_div(p.seq_len, p.chunk);
  a.num_chunks = count_chunks(host_view);
  plan.num_chunks = a.num_chunks;
  const int64_t G = kernel_knobs().group_chunks;
  if (grouped) {
    a.group_chunks = static_cast<int>(G);
    a.ws_group_sums = reinterpret_cast<float*>(base + l.group_sums);
    a.max_segment_groups = ceil_div(a.chunks_per_row, G);
  }

  if (p.cu_seqlens != nullptr) {
    // Chunks are aligned to segment starts (kernels/mixer_params.h).
    std::vector<int64_t> chunk_table, segment_table;
    chunk_table.reserve(static_cast<size_t>(2 * a.num_chunks));
    for (int64_t n = 0; n < p.num_segments; ++n) {
      segment_table.push_back(static_cast<int64_t>(chunk_table.size() / 2));
      segment_table.push_back(ceil_div(offsets[n + 1] - offsets[n], p.chunk));
      for (int64_t t = offsets[n]; t < offsets[n + 1]; t += p.chunk) {
        chunk_table.push_back(t);
        chunk_table.push_back(std::min<int64_t>(p.chunk, offsets[n + 1] - t));
      }
    }
    auto* chunk_dev = reinterpret_cast<int64_t*>(base + l.chunk_table);
    auto* segment_dev = reinterpret_cast<int64_t*>(base + l.segment_table);
    if (grouped) {
      // Each segment's first group slot, and the most groups of a segment.
      std::vector<int64_t> group_table;
      int64_t slots = 0, most = 0;
      for (int64_t n = 0; n < p.num_segments; ++n) {
        const int64_t groups = ceil_div(segment_table[2 * n + 1], G);
        group_table.push_back(slots);
        slots += groups;
        most = std::max(most, groups);
      }
      SS_CHECK_ARG(slots <= max_group_slots(p), "cu_seqlens",
                   "more chunk groups than the workspace was sized for");
      a.max_segment_groups = std::max<int64_t>(most, 1);
      auto* group_dev = reinterpret_cast<int64_t*>(base + l.group_table);
      SS_CUDA_CHECK(cudaMemcpyAsync(group_dev, group_table.data(),
                                    group_table.size() * sizeof(int64_t), cudaMemcpyHostToDevice,
                                    stream));
      a.group_table = group_dev;
    }
    // Pageable host -> device copies return once the data is staged, so the
    // vectors may go out of scope afterwards.
    SS_CUDA_CHECK(cudaMemcpyAsync(chunk_dev, chunk_table.data(),
                                  chunk_table.size() * sizeof(int64_t), cudaMemcpyHostToDevice,
                                  stream));
    SS_CUDA_CHECK(cudaMemcpyAsync(segment_dev, segment_table.data(),
                                  segment_table.size() * sizeof(int64_t), cudaMemcpyHostToDevice,
                                  stream));
    a.chunk_table = chunk_dev;
    a.segment_table = segment_dev;
  }
  return plan;
}

void launch_forward_stages(const MixerParams& p, const ForwardArgs& a, int stages,
                           cudaStream_t stream) {
  // A prepare-only plan has no V' or T-typed states for the output kernel;
  // scans that form the output themselves need neither (scan_forms_output).
  const bool scan_output = scan_forms_output(a) && (stages & kStageOutput);
  SS_CHECK_ARG(!(stages & kStageOutput) || a.ws_states != nullptr || scan_output, "stages",
               "the output stage needs a full forward plan (this one is prepare-only)");
  SS_CHECK_ARG(!(stages & kStageScan) || a.ws_states != nullptr || a.chunk_states != nullptr ||
                   a.final_state != nullptr || scan_output,
               "stages", "the scan stage has nothing to write (no states of any kind)");
  switch (p.variant) {
    case Variant::linear:
      launch_chunk_forward<Decay::none, Rule::additive>(a, p.dtype, p.dk, p.l2norm_qk, stages,
                                                        stream);
      break;
    case Variant::retention:
      launch_chunk_forward<Decay::scalar, Rule::additive>(a, p.dtype, p.dk, p.l2norm_qk, stages,
                                                          stream);
      break;
    case Variant::gla:
      launch_chunk_forward<Decay::vector, Rule::additive>(a, p.dtype, p.dk, p.l2norm_qk, stages,
                                                          stream);
      break;
    case Variant::deltanet:
      launch_chunk_forward<Decay::none, Rule::delta>(a, p.dtype, p.dk, p.l2norm_qk, stages, stream);
      break;
    case Variant::gated_deltanet:
      launch_chunk_forward<Decay::scalar, Rule::delta>(a, p.dtype, p.dk, p.l2norm_qk, stages,
                                                       stream);
      break;
    case Variant::kda:
      launch_chunk_forward<Decay::vector, Rule::delta>(a, p.dtype, p.dk, p.l2norm_qk, stages,
                                                       stream);
      break;
  }
}

}  // namespace detail

void mixer_forward(const MixerParams& p, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream) {
  const detail::ForwardPlan plan = detail::plan_forward(p, workspace, workspace_bytes, stream);
  detail::launch_forward_stages(p, plan.args, detail::forward_stages(plan.args), stream);
}

void mixer_forward(const MixerParams& p, cudaStream_t stream) {
  check_supported(p);
  const size_t bytes = forward_workspace_bytes(p);
  const PoolArray<std::byte> workspace(bytes, stream);
  mixer_forward(p, workspace.get(), bytes, stream);
}

}  // namespace statescan::cuda
