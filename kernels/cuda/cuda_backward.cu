// Host side of the chunkwise CUDA backward (issue 4): argument checks, the
// workspace layout and the per-variant dispatch. The kernels are in
// chunk_backward.cuh; the forward's prepare stage is re-run (forward_plan.cuh)
// to recompute the tiles the reverse scan reads.
//
// Workspace, every piece 256-byte aligned (the raw linear path,
// reads_inputs_directly, has no tiles and no state-product region):
//   [prepare-stage workspace (detail::prepare_workspace_bytes)]  Q^, K_, W, U,
//        A, gamma in T (with recompute_chunk_states the scan stage runs on the
//        same plan and writes only the fp32 chunk states at the end)
//   [dS_{c+1} per chunk, fp32 [chunks, H, Dk, Dv]; in T on the raw linear path]
//   [fp32 inputs: chunk_grad_kernel_tc scratch, fp32, one slice per persistent block]
//   [16-bit inputs with vector gates: chunk_state_products_kernel's outputs
//    for one batch of (chunk, head) items, fp32 (StateProductTraits::kOutFloats
//    per item); scalar gates or none form them inside chunk_intra_grad_kernel]
//   [recompute_chunk_states only: the fp32 chunk states]
#include <algorithm>
#include <cstdint>
#include <memory>

#include "core/cuda_check.h"
#include "core/device_pool.h"
#include "core/env_knob.h"
#include "core/error.h"
#include "kernels/cuda/chunk_backward.cuh"
#include "kernels/cuda/cp_kernels.h"
#include "kernels/cuda/cuda_mixer.h"
#include "kernels/cuda/forward_plan.cuh"

namespace statescan::cuda {
namespace {

using detail::aligned16;
using detail::BackwardArgs;
using detail::GradTraits;
using detail::max_chunks;
using detail::workspace_aligned;

size_t align_up(size_t x) {
  return (x + 255) / 256 * 256;
}

int64_t scratch_floats_per_block(const MixerParams& p) {
  return p.dk == 64 ? GradTraits<64, 64>::kScratchFloats : GradTraits<128, 128>::kScratchFloats;
}

// Persistent grid of chunk_grad_kernel_tc (one block per multiprocessor: its
// shared memory allows no more), never more blocks than (chunk, head) items.
int grad_blocks(const MixerParams& p) {
  const int64_t items = max_chunks(p) * p.heads;
  return static_cast<int>(std::min<int64_t>(items, multiprocessor_count()));
}

// 16-bit inputs with vector gates take the state products from their own
// kernel (chunk_state_products_kernel), in batches of this many
// items per persistent block: 32 keep the launch tails small and bound the
// batch's fp32 outputs at ~0.7 GB (D = 128, 132 SMs) whatever T is.
constexpr int64_t kStateProductItemsPerBlock = 32;

bool uses_state_products(const MixerParams& p) {
  return p.dtype != DType::f32 && !reads_inputs_directly(p) && vector_gate(p.variant);
}

// STATESCAN_BWD_BATCH=<items> overrides the batch (less memory, more launches;
// the gradients do not depend on it, which a test checks). Read on every call.
int64_t state_product_batch(const MixerParams& p) {
  if (!uses_state_products(p)) return 0;
  int64_t batch = grad_blocks(p) * kStateProductItemsPerBlock;
  batch = env_int("STATESCAN_BWD_BATCH", batch, 1, INT64_MAX);
  return std::min<int64_t>(max_chunks(p) * p.heads, batch);
}

int64_t state_product_floats_per_item(const MixerParams& p) {
  return p.dk == 64 ? detail::StateProductTraits<__nv_bfloat16, 64, 64>::kOutFloats
                    : detail::StateProductTraits<__nv_bfloat16, 128, 128>::kOutFloats;
}

struct BackwardLayout {
  size_t forward = 0, ds = 0, scratch = 0, sp = 0, states = 0, total = 0;
  int64_t sp_batch = 0;  // items the state-product region holds (0: none)
};

// Whether the backward keeps dS_{c+1} per chunk in the input's 16-bit type
// (BackwardArgs::ws_ds_t) instead of fp32: every ungated 16-bit problem (the
// raw linear path, DeltaNet, linear attention through the tiles) — their
// gradient kernels read dS only as 16-bit operands rounded from the same fp32
// values (bitwise the same gradients), and only gated variants take dgamma
// from the fp32 values. Half the bytes: 0.27 GB less written and read at 32K
// (H 16, D 128), 8.6 GB less memory at 1M tokens. With b17's one-kernel
// gradients DeltaNet's forward + backward measured 5.03 -> 4.94 ms at 32K
// (2026-12-02, H200; with chunk_state_products_kernel it had been 0.08 ms
// slower: PERF_NOTES, "After b14"). STATESCAN_BWD_DS=f32 keeps fp32 dS for
// the tiled ungated variants (ctest test_cuda_{backward,cp}_ds_f32).
bool ds_in_t(const MixerParams& p) {
  static const bool f32_requested = env_choice("STATESCAN_BWD_DS", {"t", "f32"}) == 1;
  if (p.dtype == DType::f32) return false;
  return reads_inputs_directly(p) || (!f32_requested && !has_gate(p.variant));
}

// `recompute`: room for the fp32 chunk states the backward re-derives.
BackwardLayout layout_for(const MixerParams& p, bool recompute) {
  BackwardLayout l;
  const size_t state_elems = static_cast<size_t>(max_chunks(p) * p.heads * p.dk * p.dv);
  const size_t states = align_up(state_elems * sizeof(float));
  // No V' or T-typed states: the output kernel never runs here (the
  // recompute's scan writes only the fp32 chunk states, at the end).
  size_t at = align_up(detail::prepare_workspace_bytes(p));
  l.forward = 0;
  l.ds = at;
  // dS_{c+1} per chunk: fp32, or in T (ds_in_t).
  at += ds_in_t(p) ? align_up(state_elems * size_of(p.dtype)) : states;
  l.scratch = at;
  // chunk_grad_kernel_tc's per-block scratch: fp32 inputs only (16-bit inputs
  // take the state-product and intra-chunk kernels, or the raw linear
  // gradient kernel, which need none).
  if (p.dtype == DType::f32)
    at +=
        align_up(static_cast<size_t>(grad_blocks(p) * scratch_floats_per_block(p)) * sizeof(float));
  l.sp = at;
  l.sp_batch = state_product_batch(p);
  at +=
      align_up(static_cast<size_t>(l.sp_batch * state_product_floats_per_item(p)) * sizeof(float));
  l.states = at;
  if (recompute) at += states;
  l.total = at;
  return l;
}

// The chunk states a backward reads: saved by forward (32-byte aligned: the
// tensor-core gradient kernel reads 16x16 tiles of them directly), or
// recomputed.
void check_chunk_states(const MixerBwdParams& p) {
  SS_CHECK_ARG(p.chunk_states != nullptr || p.recompute_chunk_states, "chunk_states",
               "backward needs the chunk states saved by forward (or recompute_chunk_states)");
  SS_CHECK_ARG(p.recompute_chunk_states || reinterpret_cast<uintptr_t>(p.chunk_states) % 32 == 0,
               "chunk_states", "must be 32-byte aligned");
}

// The backward-only arguments, before anything is launched or allocated (the
// problem itself is validated by plan_forward).
void check_backward_args(const MixerBwdParams& p) {
  SS_CHECK_ARG(p.dk == p.dv && (p.dk == 64 || p.dk == 128), "dk",
               "CUDA backward supports Dk == Dv in {64, 128}, got Dk ", p.dk, ", Dv ", p.dv);
  SS_CHECK_ARG(p.d_o != nullptr, "do", "must not be null");
  SS_CHECK_ARG(aligned16(p.d_o), "do", "must be 16-byte aligned");
  if (p.state_grad_only) {
    SS_CHECK_ARG(p.d_initial_state != nullptr, "d_initial_state",
                 "state_grad_only needs an output for the state gradient");
    return;
  }
  check_chunk_states(p);
  SS_CHECK_ARG(p.dq != nullptr, "dq", "gradient pointer must not be null");
  SS_CHECK_ARG(p.dk_out != nullptr, "dk_out", "gradient pointer must not be null");
  SS_CHECK_ARG(p.dv_out != nullptr, "dv_out", "gradient pointer must not be null");
  // The gradient kernels read do and store dq, dk, dv in 8- to 16-byte pieces
  // (a misaligned address is a sticky CUDA error, not an exception).
  SS_CHECK_ARG(aligned16(p.dq), "dq", "must be 16-byte aligned");
  SS_CHECK_ARG(aligned16(p.dk_out), "dk_out", "must be 16-byte aligned");
  SS_CHECK_ARG(aligned16(p.dv_out), "dv_out", "must be 16-byte aligned");
  SS_CHECK_ARG((p.dg != nullptr) == (p.g != nullptr), "dg", "must be given exactly when g is");
  SS_CHECK_ARG((p.dbeta != nullptr) == (p.beta != nullptr), "dbeta",
               "must be given exactly when beta is");
}

void launch_variant(const MixerBwdParams& p, const BackwardArgs& a, int blocks,
                    cudaStream_t stream) {
  using detail::launch_chunk_backward;
  const bool sgo = p.state_grad_only;
  switch (p.variant) {
    case Variant::linear:
      launch_chunk_backward<Decay::none, Rule::additive>(a, p.dtype, p.dk, p.l2norm_qk, sgo, blocks,
                                                         stream);
      break;
    case Variant::retention:
      launch_chunk_backward<Decay::scalar, Rule::additive>(a, p.dtype, p.dk, p.l2norm_qk, sgo,
                                                           blocks, stream);
      break;
    case Variant::gla:
      launch_chunk_backward<Decay::vector, Rule::additive>(a, p.dtype, p.dk, p.l2norm_qk, sgo,
                                                           blocks, stream);
      break;
    case Variant::deltanet:
      launch_chunk_backward<Decay::none, Rule::delta>(a, p.dtype, p.dk, p.l2norm_qk, sgo, blocks,
                                                      stream);
      break;
    case Variant::gated_deltanet:
      launch_chunk_backward<Decay::scalar, Rule::delta>(a, p.dtype, p.dk, p.l2norm_qk, sgo, blocks,
                                                        stream);
      break;
    case Variant::kda:
      launch_chunk_backward<Decay::vector, Rule::delta>(a, p.dtype, p.dk, p.l2norm_qk, sgo, blocks,
                                                        stream);
      break;
  }
}

}  // namespace

size_t backward_workspace_bytes(const MixerParams& p, bool recompute_chunk_states) {
  return layout_for(p, recompute_chunk_states).total;
}

namespace {

// The queued prepare stage of one backward: the forward's plan over the
// workspace and the fp32 chunk states the backward kernels read.
struct Prepared {
  detail::ForwardPlan plan;
  float* chunk_states = nullptr;
};

// Queues the forward's prepare stage into the workspace at `base` (layout
// `l`), and with `recompute` also its state scan, which re-derives the chunk
// states (the same kernel, so the same values forward would have saved); the
// caller's final_state is not touched.
Prepared prepare_backward(const MixerBwdParams& p, bool recompute, const BackwardLayout& l,
                          char* base, cudaStream_t stream) {
  // plan_forward validates the problem as a forward call, which needs an
  // output pointer; the prepare stage never writes o, so any non-null
  // pointer stands in when the caller passed none.
  MixerParams fwd = p;
  if (fwd.o == nullptr) fwd.o = base;
  int stages = 0;
  if (recompute) {
    fwd.chunk_states = reinterpret_cast<float*>(base + l.states);
    fwd.final_state = nullptr;
    stages |= detail::kStageScan;
  }
  // Prepare-only: the backward never runs the output stage, so its workspace
  // has no room for V' or the T-typed states (see BackwardLayout).
  constexpr bool kPrepareOnly = true;
  Prepared prep;
  prep.plan = detail::plan_forward(fwd, base + l.forward, l.ds - l.forward, stream, kPrepareOnly);
  prep.chunk_states = fwd.chunk_states;
  if (detail::backward_reads_tiles(prep.plan.args)) stages |= detail::kStagePrepare;
  if (stages != 0) detail::launch_forward_stages(fwd, prep.plan.args, stages, stream);
  return prep;
}

// The reverse scan and the per-chunk gradients of `p` (or, with
// p.state_grad_only, only the scan's d_initial_state) from prepared tiles.
// `rest`: the layout's backward-only part (from l.ds on), wherever the
// prepared tiles are.
void run_backward(const MixerBwdParams& p, const Prepared& prep, const BackwardLayout& l,
                  char* rest, cudaStream_t stream) {
  BackwardArgs a;
  a.f = prep.plan.args;
  if (!detail::intra_reads_t()) a.f.ws_t = nullptr;  // STATESCAN_BWD_T=solve
  a.d_o = p.d_o;
  a.d_final_state = p.d_final_state;
  a.chunk_states = prep.chunk_states;
  a.dq = p.dq;
  a.dk = p.dk_out;
  a.dv = p.dv_out;
  a.dg = p.dg;
  a.dbeta = p.dbeta;
  a.d_initial_state = p.d_initial_state;
  a.ws_ds = p.state_grad_only ? nullptr : reinterpret_cast<float*>(rest);
  if (ds_in_t(p)) {
    a.ws_ds_t = a.ws_ds;
    a.ws_ds = nullptr;
  }
  a.ws_scratch =
      p.dtype == DType::f32 ? reinterpret_cast<float*>(rest + (l.scratch - l.ds)) : nullptr;
  if (l.sp_batch > 0) {
    a.ws_sp = reinterpret_cast<float*>(rest + (l.sp - l.ds));
    a.sp_batch = l.sp_batch;
  }
  a.num_items = prep.plan.num_chunks * p.heads;
  const int blocks =
      static_cast<int>(std::min<int64_t>(a.num_items, static_cast<int64_t>(grad_blocks(p))));
  launch_variant(p, a, blocks, stream);
}

// Everything of the problem the prepared tiles depend on.
bool same_problem(const MixerParams& a, const MixerParams& b) {
  return a.variant == b.variant && a.batch == b.batch && a.seq_len == b.seq_len &&
         a.heads == b.heads && a.dk == b.dk && a.dv == b.dv && a.chunk == b.chunk &&
         a.scale == b.scale && a.l2norm_qk == b.l2norm_qk && a.dtype == b.dtype &&
         a.cu_seqlens == b.cu_seqlens && a.num_segments == b.num_segments && a.q == b.q &&
         a.k == b.k && a.v == b.v && a.g == b.g && a.beta == b.beta &&
         a.initial_state == b.initial_state;
}

}  // namespace

void mixer_backward(const MixerBwdParams& p, void* workspace, size_t workspace_bytes,
                    cudaStream_t stream) {
  check_backward_args(p);
  const bool recompute = p.recompute_chunk_states && !p.state_grad_only;
  const BackwardLayout l = layout_for(p, recompute);
  SS_CHECK_ARG(workspace != nullptr && workspace_bytes >= l.total, "workspace", "needs ", l.total,
               " bytes, got ", workspace_bytes);
  SS_CHECK_ARG(workspace_aligned(workspace), "workspace", "must be 32-byte aligned");
  char* base = static_cast<char*>(workspace);
  const Prepared prep = prepare_backward(p, recompute, l, base, stream);
  run_backward(p, prep, l, base + l.ds, stream);
}

struct PreparedBackward::Impl {
  MixerBwdParams problem;
  BackwardLayout layout;
  Prepared prep;
  void* workspace = nullptr;          // the layout from l.ds on, or all of it
  void* forward_workspace = nullptr;  // adopted from a PreparedForward
  char* rest = nullptr;               // where the layout's l.ds part lies
  cudaStream_t stream = nullptr;
};

PreparedBackward::PreparedBackward(const MixerBwdParams& p, cudaStream_t stream)
    : impl_(std::make_unique<Impl>()) {
  SS_CHECK_ARG(p.dk == p.dv && (p.dk == 64 || p.dk == 128), "dk",
               "CUDA backward supports Dk == Dv in {64, 128}, got Dk ", p.dk, ", Dv ", p.dv);
  check_chunk_states(p);
  Impl& m = *impl_;
  m.problem = p;
  m.stream = stream;
  m.layout = layout_for(p, p.recompute_chunk_states);
  m.workspace = pool_alloc(m.layout.total, stream);
  try {
    m.prep = prepare_backward(p, p.recompute_chunk_states, m.layout,
                              static_cast<char*>(m.workspace), stream);
  } catch (...) {
    pool_free(m.workspace, stream);
    throw;
  }
  m.rest = static_cast<char*>(m.workspace) + m.layout.ds;
}

PreparedBackward::PreparedBackward(const MixerBwdParams& p, PreparedForward& forward,
                                   cudaStream_t stream)
    : impl_(std::make_unique<Impl>()) {
  SS_CHECK_ARG(!p.recompute_chunk_states, "recompute_chunk_states",
               "a backward from the forward's prepared tiles reads saved chunk states");
  check_chunk_states(p);
  // Checked before the hand-over: a refused backward leaves the forward whole.
  detail::AdoptedForward f = detail::adopt(forward, [&](const MixerParams& prepared,
                                                        cudaStream_t prepared_stream) {
    SS_CHECK_ARG(stream == prepared_stream, "stream",
                 "must be the stream the forward was prepared on");
    SS_CHECK_ARG(same_problem(p, prepared), "p", "is not the problem the forward was prepared for");
  });
  Impl& m = *impl_;
  m.forward_workspace = f.workspace;
  m.stream = stream;
  try {
    m.problem = p;
    m.layout = layout_for(p, /*recompute=*/false);
    // Only the backward's own part: the tiles are the forward's.
    m.workspace = pool_alloc(m.layout.total - m.layout.ds, stream);
    m.rest = static_cast<char*>(m.workspace);
    m.prep.plan = std::move(f.plan);
    // As the backward's own prepare-only plan: the forward's V' and 16-bit
    // states are not the backward's to read.
    detail::ForwardArgs& a = m.prep.plan.args;
    a.ws_vnew = nullptr;
    if (p.dtype != DType::f32) a.ws_states = nullptr;
    m.prep.chunk_states = p.chunk_states;
  } catch (...) {
    pool_free(m.workspace, stream);
    pool_free(m.forward_workspace, f.stream);
    throw;
  }
}

PreparedBackward::~PreparedBackward() {
  if (!impl_) return;
  pool_free(impl_->workspace, impl_->stream);
  pool_free(impl_->forward_workspace, impl_->stream);
}

void PreparedBackward::run(const MixerBwdParams& p, cudaStream_t stream) {
  Impl& m = *impl_;
  check_backward_args(p);
  SS_CHECK_ARG(same_problem(p, m.problem), "p",
               "PreparedBackward::run needs the problem it was prepared for");
  SS_CHECK_ARG(stream == m.stream, "stream", "must be the stream PreparedBackward was built on");
  if (!p.state_grad_only) {
    SS_CHECK_ARG(p.recompute_chunk_states == m.problem.recompute_chunk_states &&
                     (p.recompute_chunk_states || p.chunk_states == m.problem.chunk_states),
                 "chunk_states", "must be those PreparedBackward was built with");
  }
  run_backward(p, m.prep, m.layout, m.rest, stream);
}

void mixer_backward(const MixerBwdParams& p, cudaStream_t stream) {
  check_backward_args(p);
  const size_t bytes = backward_workspace_bytes(p, p.recompute_chunk_states && !p.state_grad_only);
  const PoolArray<std::byte> workspace(bytes, stream);
  mixer_backward(p, workspace.get(), bytes, stream);
}

}  // namespace statescan::cuda
