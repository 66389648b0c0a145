// The LaCT GPU forward and backward (lact_cuda.h), templated on the token
// storage type T (float | __nv_bfloat16) and the Newton-Schulz type U
// (double for f32, float for bf16). Included by one .cu per instantiation so
// that nvcc builds them in parallel; lact_cuda.cu dispatches on the dtype.
//
// Weight blocks on the GPU are laid out [W0 | W2 | W1] per (batch row, head)
// (the CPU uses [W0 | W1 | W2]): W0 and W2 then form one 2M x D matrix, so
// that h0 and h2 (and every product that pairs them) are one GEMM with twice
// the width. Row norms follow the same order: W0's M rows, W2's M rows, W1's
// D rows. The saved checkpoints use this layout too.
//
// Structure mirrors kernels/cpu/lact.cpp function by function: the same
// two-phase chunk loop around the all-reduce, the same saved state (W_c and
// the update P of each chunk), the same recomputation in backward. Where the
// CPU loops over (batch row, head) pairs, the GPU issues one GEMM per batch
// row batched over the heads, and one fused kernel over all pairs.
//
// The shared GEMM helpers and sizes are in lact_common.cuh, the elementwise
// kernels in lact_layer_kernels.cuh, Muon's Newton-Schulz in
// lact_newton_schulz.cuh; this file holds the layer (LactGpu) itself.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

#include "core/cuda_check.h"
#include "core/device_pool.h"
#include "core/error.h"
#include "kernels/cuda/lact_common.cuh"
#include "kernels/cuda/lact_cuda.h"
#include "kernels/cuda/lact_hidden.cuh"
#include "kernels/cuda/lact_layer_kernels.cuh"
#include "kernels/cuda/lact_newton_schulz.cuh"
#include "kernels/cuda/lact_token_gemm.cuh"

namespace statescan::cuda {
namespace lact_detail {

// ---- the layer ------------------------------------------------------------------

template <typename T, typename U>
class LactGpu {
 public:
  LactGpu(const LactCudaParams& p, cudaStream_t stream)
      : p_(p),
        g_(make_geo(p)),
        stream_(stream),
        blas_(detail::blas_handle(stream, detail::BlasSlot::lact)),
        causal_(p.config.schedule == LactSchedule::apply_then_update),
        momentum_(p.config.momentum > 0),
        split_update_(!std::is_same<T, float>::value && p.config.muon_steps > 0),
        fused_hidden_(std::is_same<T, bf16>::value && hidden_fused_requested() &&
                      lact_hidden_supported(g_.D, g_.M) && lact_hidden_aligned(p.q, p.k, p.v) &&
                      lact_hidden_addressable(g_.pairs, g_.B * g_.local_len, g_.D, g_.M)),
        w_init_(g_.H * g_.block(), stream),
        norm0_(g_.H * g_.norms(), stream) {
    load_weights_kernel<T><<<grid_for(w_init_.size(), kThreads), kThreads, 0, stream_>>>(
        tok(p.w0), tok(p.w1), tok(p.w2), g_.H, g_.H, g_.md(), w_init_.get());
    SS_LAUNCH_CHECK("load_weights_kernel");
    row_norms_kernel<<<grid_for(g_.H * g_.norms() * 32, kThreads), kThreads, 0, stream_>>>(
        w_init_.get(), g_.H, g_.M, g_.D, norm0_.get());
    SS_LAUNCH_CHECK("row_norms_kernel");
    const std::size_t nm = rows_alloc();
    z_ = PoolArray<T>(2 * nm, stream);
    gate_ = PoolArray<T>(nm, stream);
    if (split_update_) {
      z_lo_ = PoolArray<T>(2 * nm, stream);
      gate_lo_ = PoolArray<T>(nm, stream);
    }
    if (!std::is_same<T, float>::value) w_op_ = PoolArray<T>(g_.state(), stream);
    if (fused_hidden_ && side_stream_requested()) side_ = Lane::open();
  }
  LactGpu(const LactGpu&) = delete;
  LactGpu& operator=(const LactGpu&) = delete;
  ~LactGpu() {
    // Work still queued on a lane (an exception left a loop between its
    // fork and join) reads arrays that stream_ frees in its order.
    side_.release(stream_);
  }

  void forward(const LactDeviceAllReduce& all_reduce, LactCudaSaved* saved) {
    const std::size_t state = static_cast<std::size_t>(g_.state());
    PoolArray<float> W(state, stream_), grads, vel, step;
    if (momentum_) {
      vel = PoolArray<float>(state, stream_);
      vel.zero();
    }
    const bool muon = p_.config.muon_steps > 0;
    std::unique_ptr<NewtonSchulz<U>> ns;
    if (muon) {
      step = PoolArray<float>(state, stream_);
      ns = std::make_unique<NewtonSchulz<U>>(g_, p_.config.muon_steps, false, stream_);
    }
    // Checkpoints: reused when a previous forward of the same size left them
    // (repeated steps then allocate nothing; cudaMalloc would sync the device).
    const std::size_t saved_count = static_cast<std::size_t>(g_.chunks) * state;
    if (saved && saved->weights.size() != saved_count) {
      saved->weights = DeviceBuffer<float>();
      saved->updates = DeviceBuffer<float>();
      saved->weights = DeviceBuffer<float>(saved_count);
      saved->updates = DeviceBuffer<float>(saved_count);
    }
    // With checkpoints, chunk c's weights live in their slot (step_renorm
    // writes the next chunk's there, the last chunk's into W) and, without
    // momentum or Muon, its update is formed in its slot: no copies. (Muon's
    // Newton-Schulz replays a graph while its input pointer repeats.)
    auto weights_of = [&](int64_t c) {
      return saved && c < g_.chunks ? saved->weights.data() + c * state : W.get();
    };
    const bool update_in_slot = saved && !momentum_ && !muon;
    if (!update_in_slot) grads = PoolArray<float>(state, stream_);
    load_weights_kernel<T><<<grid_for(state, kThreads), kThreads, 0, stream_>>>(
        tok(p_.w0), tok(p_.w1), tok(p_.w2), g_.pairs, g_.H, g_.md(), weights_of(0));
    SS_LAUNCH_CHECK("load_weights_kernel");
    const T* w_op = nullptr;
    // The fused apply writes only o and reads the chunk's weight copy: it
    // runs on the side stream beside the update (key side, G, Newton-Schulz),
    // joined before step_renorm overwrites that copy.
    const bool side = side_ && fused_apply();
    auto apply = [&](const T* w, int64_t n, int64_t t0) {
      if (side)
        on_lane(side_, [&] { apply_forward(w, n, t0); });
      else
        apply_forward(w, n, t0);
    };
    for (int64_t c = 0; c < g_.chunks; ++c) {
      const int64_t n = g_.slice_len(p_.seq_len, c), t0 = g_.slice_start(c);
      // The operand copy of W: made here for the first chunk, after that by
      // the previous chunk's step_renorm.
      if (c == 0) w_op = operand_weights(weights_of(0));
      if (causal_) apply(w_op, n, t0);
      float* G = update_in_slot ? saved->updates.data() + c * state : grads.get();
      partial_gradients(w_op, n, t0, G);
      if (all_reduce) all_reduce(G, state, stream_);
      float* update = G;
      if (momentum_) {
        momentum_kernel<<<grid_for(state, kThreads), kThreads, 0, stream_>>>(
            G, state, static_cast<float>(p_.config.momentum), vel.get());
        SS_LAUNCH_CHECK("momentum_kernel");
        update = vel.get();
      }
      if (saved && !update_in_slot)
        SS_CUDA_CHECK(cudaMemcpyAsync(saved->updates.data() + c * state, update,
                                      state * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
      const float* d = update;
      if (muon) {
        ns->forward(update, step.get());
        d = step.get();
      }
      join(side_);
      w_op = step_renorm(weights_of(c), weights_of(c + 1), d);
      if (!causal_) apply(w_op, n, t0);
    }
    join(side_);
  }

  void backward(const LactCudaGrads& gr, const LactCudaSaved& saved,
                const LactDeviceAllReduce& all_reduce) {
    const std::size_t state = static_cast<std::size_t>(g_.state());
    SS_CHECK_ARG(saved.weights.size() == static_cast<std::size_t>(g_.chunks) * state &&
                     saved.updates.size() == saved.weights.size(),
                 "saved", "checkpoints do not match this problem (run lact_cuda_forward first)");
    PoolArray<float> dW(state, stream_), dG(state, stream_), d_step, dvel, step, w_next;
    PoolArray<float> d_norm0(g_.pairs * g_.norms(), stream_);
    dW.zero();
    d_norm0.zero();
    if (momentum_) {
      dvel = PoolArray<float>(state, stream_);
      dvel.zero();
    }
    const bool muon = p_.config.muon_steps > 0;
    std::unique_ptr<NewtonSchulz<U>> ns;
    PoolArray<float> p_stage;
    if (muon) {
      step = PoolArray<float>(state, stream_);
      d_step = PoolArray<float>(state, stream_);
      p_stage = PoolArray<float>(state, stream_);
      ns = std::make_unique<NewtonSchulz<U>>(g_, p_.config.muon_steps, true, stream_);
    }
    if (!causal_) w_next = PoolArray<float>(state, stream_);
    dh_ = PoolArray<T>(2 * rows_alloc(), stream_);
    // The causal schedule's apply backward on the side stream: fused, its
    // outputs gate_ and dh_ are not the buffers of the update's gradient rows
    // (zdh_, gde_: fused too wherever side_ exists).
    const bool side = causal_ && side_ && fused_apply_backward(gr);

    for (int64_t c = g_.chunks - 1; c >= 0; --c) {
      const int64_t n = g_.slice_len(p_.seq_len, c), t0 = g_.slice_start(c);
      const float* Wc = saved.weights.data() + c * state;
      const float* Pc = saved.updates.data() + c * state;
      const float* d = Pc;
      if (muon) {
        // Through a fixed buffer, so that Newton-Schulz replays one graph.
        SS_CUDA_CHECK(cudaMemcpyAsync(p_stage.get(), Pc, state * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream_));
        Pc = p_stage.get();
        ns->forward(Pc, step.get());  // keeps the iterates for ns->backward
        d = step.get();
      }
      if (!causal_) apply_backward(gr, step_renorm(Wc, w_next.get(), d), n, t0, dW.get());
      // Without Muon the step's adjoint is dG itself. For bf16 the kernel
      // also writes Wc's operand copy (into w_op_, whose copy of the next
      // weights apply_backward has consumed by now, in stream order).
      T* w_copy = nullptr;
      if constexpr (!std::is_same<T, float>::value) w_copy = w_op_.get();
      step_renorm_backward_kernel<T>
          <<<grid_for(g_.pairs * g_.norms() * 32, kThreads), kThreads, 0, stream_>>>(
              Wc, d, norm0_.get(), g_.pairs, g_.H, g_.M, g_.D, p_.config.renorm, dW.get(),
              muon ? d_step.get() : dG.get(), d_norm0.get(), w_copy);
      SS_LAUNCH_CHECK("step_renorm_backward_kernel");
      const T* w_op = std::is_same<T, float>::value ? reinterpret_cast<const T*>(Wc) : w_copy;
      // The apply's token side (gate, dh, dq) reads only Wc's copy and d_o:
      // on the side stream beside the update's backward, joined before its
      // dW products (added after the update's, the order of the sums as
      // without the side stream) and before the next chunk's
      // step_renorm_backward overwrites the copy.
      if (side) on_lane(side_, [&] { apply_backward_tokens(gr, w_op, n, t0); });
      if (muon) ns->backward(Pc, d_step.get(), dG.get());
      if (momentum_) {
        momentum_backward_kernel<<<grid_for(state, kThreads), kThreads, 0, stream_>>>(
            dG.get(), state, static_cast<float>(p_.config.momentum), dvel.get());
        SS_LAUNCH_CHECK("momentum_backward_kernel");
      }
      if (all_reduce) all_reduce(dG.get(), state, stream_);
      gradients_backward(gr, w_op, dG.get(), n, t0, dW.get());
      if (side) {
        join(side_);
        apply_backward_weights(gr, n, t0, dW.get());
      } else if (causal_) {
        apply_backward(gr, w_op, n, t0, dW.get());
      }
    }

    PoolArray<float> d_init(g_.H * g_.block(), stream_);
    initial_grad_kernel<<<grid_for(d_init.size(), kThreads), kThreads, 0, stream_>>>(
        dW.get(), d_norm0.get(), w_init_.get(), norm0_.get(), g_.B, g_.H, g_.M, g_.D,
        p_.config.renorm, d_init.get());
    SS_LAUNCH_CHECK("initial_grad_kernel");
    if (all_reduce) all_reduce(d_init.get(), d_init.size(), stream_);
    store_weight_grads_kernel<T><<<grid_for(d_init.size(), kThreads), kThreads, 0, stream_>>>(
        d_init.get(), g_.H, g_.md(), static_cast<T*>(gr.dw0), static_cast<T*>(gr.dw1),
        static_cast<T*>(gr.dw2));
    SS_LAUNCH_CHECK("store_weight_grads_kernel");
  }

 private:
  static const T* tok(const void* p) { return static_cast<const T*>(p); }
  static constexpr cudaDataType_t kT = data_type<T>();

  // Views of one batch row b for a GEMM batched over its H heads.
  Operand tokens(const void* base, int64_t b, int64_t t0) const {
    const int64_t hd = g_.H * g_.D;
    return {tok(base) + (b * g_.local_len + t0) * hd, kT, hd, g_.D};
  }
  // Slot 0 of a block as [W0; W2] (2M x D, or W0 alone with M rows), slot 2
  // as W1 (D x M).
  Operand weights(const T* w, int64_t b, int slot) const {
    const int64_t ld = slot == 2 ? g_.M : g_.D;
    return {w + b * g_.H * g_.block() + slot * g_.md(), kT, ld, g_.block()};
  }
  Output weight_grad(float* dW, int64_t b, int slot) const {
    const int64_t ld = slot == 2 ? g_.M : g_.D;
    return {dW + b * g_.H * g_.block() + slot * g_.md(), CUDA_R_32F, ld, g_.block()};
  }
  // Per-pair intermediates of n rows of `width` (M or 2M), pair-major.
  template <typename X>
  Operand rows_in(const X* buf, int64_t b, int64_t n, int64_t width) const {
    return {buf + b * g_.H * n * width, data_type<X>(), width, n * width};
  }
  template <typename X>
  Output rows_out(X* buf, int64_t b, int64_t n, int64_t width) const {
    return {buf + b * g_.H * n * width, data_type<X>(), width, n * width};
  }
  // fp32 token accumulators [B, n, H D].
  Output acc_out(float* buf, int64_t b, int64_t n) const {
    const int64_t hd = g_.H * g_.D;
    return {buf + b * n * hd, CUDA_R_32F, hd, g_.D};
  }
  // A token gradient of batch row b from local row t0, written by a GEMM in
  // the storage type (one rounding of its fp32 sum, as store_tokens).
  Output tokens_out(void* base, int64_t b, int64_t t0) const {
    const int64_t hd = g_.H * g_.D;
    return {static_cast<T*>(base) + (b * g_.local_len + t0) * hd, kT, hd, g_.D};
  }

  // Token-contracted products (A^T B over the slice's tokens into fp32) of
  // bf16 layers go to lact_token_gemm where it fits (lact_token_gemm.cuh).
  void gemm_t(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const Operand& A,
              const Operand& B, double beta, const Output& C) {
    if constexpr (std::is_same<T, bf16>::value) {
      if (token_gemm_ && ta && !tb && C.type == CUDA_R_32F) {
        LactTokenGemmParams t;
        t.a = {static_cast<const T*>(A.data), A.ld, A.stride};
        t.b = {static_cast<const T*>(B.data), B.ld, B.stride};
        t.c = static_cast<float*>(C.data), t.ldc = C.ld, t.c_stride = C.stride;
        t.pairs = g_.H, t.m = m, t.n = n, t.k = k;
        t.alpha = static_cast<float>(alpha), t.beta = static_cast<float>(beta);
        if (lact_token_gemm_fits(t)) {
          lact_token_gemm(t, stream_);
          return;
        }
      }
    }
    gemm_sliced(blas_, stream_, ta, tb, m, n, k, alpha, A, B, beta, C, g_.H, token_compute<T>(),
                split_k_);
  }

  // The cuBLAS path's fp32 h = [h0 | h2] (rows of 2M) and e (rows of M),
  // allocated on first use: a forward through lact_hidden_kernel never needs
  // them (100 MB at the benchmark's shape).
  float* h_buf() { return lazy(h_, 2 * rows_alloc(), stream_); }
  float* e_buf() { return lazy(e_, rows_alloc(), stream_); }
  // Elements of a per-pair array of rows of M over the longest slice.
  std::size_t rows_alloc() const { return static_cast<std::size_t>(g_.pairs * g_.max_n * g_.M); }
  // `a`, allocated with `size` elements on first use.
  template <typename X>
  static X* lazy(PoolArray<X>& a, std::size_t size, cudaStream_t stream) {
    if (a.get() == nullptr) a = PoolArray<X>(size, stream);
    return a.get();
  }
  // The same for the backward's cuBLAS path: u = [u0 | u2], u1 (fp32), de;
  // and the token gradients' fp32 sums of its GEMM pairs.
  float* u_buf() { return lazy(u_, 2 * rows_alloc(), stream_); }
  float* u1_buf() { return lazy(u1_, rows_alloc(), stream_); }
  T* de_buf() { return lazy(de_, rows_alloc(), stream_); }
  float* token_acc(PoolArray<float>& a) {
    return lazy(a, static_cast<std::size_t>(g_.B * g_.max_n * g_.H * g_.D), stream_);
  }

  // The GEMM operand copy of fp32 weights (or of a gradient of them, per
  // pair a block): themselves for f32, bf16 in `copy` (allocated on first
  // use) else.
  const T* operand_copy(const float* W, PoolArray<T>& copy) {
    if constexpr (std::is_same<T, float>::value) {
      (void)copy;
      return W;
    } else {
      T* out = lazy(copy, static_cast<std::size_t>(g_.state()), stream_);
      convert_kernel<T>
          <<<grid_for(g_.state(), kThreads), kThreads, 0, stream_>>>(W, g_.state(), out);
      SS_LAUNCH_CHECK("convert_kernel");
      return out;
    }
  }
  const T* operand_weights(const float* W) { return operand_copy(W, w_op_); }

  // W_out <- renorm(W_in - step) (W_out may be W_in); returns the GEMM
  // operand copy of the new W (written by the same kernel for bf16:
  // operand_weights without its pass).
  const T* step_renorm(const float* W_in, float* W_out, const float* step) {
    T* op = nullptr;
    if constexpr (!std::is_same<T, float>::value) op = w_op_.get();
    step_renorm_kernel<T><<<grid_for(g_.pairs * g_.norms() * 32, kThreads), kThreads, 0, stream_>>>(
        W_in, W_out, step, norm0_.get(), g_.pairs, g_.H, g_.M, g_.D, p_.config.renorm, op);
    SS_LAUNCH_CHECK("step_renorm_kernel");
    if constexpr (std::is_same<T, float>::value)
      return W_out;
    else
      return op;
  }

  // h = [h0 | h2] = X [W0; W2]^T (rows of 2M) for the tokens X (q or k).
  void hidden(const void* x, const T* w, int64_t n, int64_t t0) {
    const int64_t M2 = 2 * g_.M;
    for (int64_t b = 0; b < g_.B; ++b)
      gemm_t(false, true, n, M2, g_.D, 1.0, tokens(x, b, t0), weights(w, b, 0), 0.0,
             rows_out(h_buf(), b, n, M2));
  }

  // The fused hidden-layer kernel's launch for the slice (lact_hidden.cuh);
  // d_o: apply_backward's second token operand.
  LactHiddenParams hidden_params(LactHiddenMode mode, const T* w, int64_t n, int64_t t0,
                                 const void* d_o = nullptr) const {
    if constexpr (std::is_same<T, bf16>::value) {
      LactHiddenParams h;
      h.mode = mode;
      h.x = tok(mode == LactHiddenMode::key_side ? p_.k : p_.q);
      h.v = tok(mode == LactHiddenMode::apply_backward ? d_o : p_.v);
      h.dh = dh_.get();
      h.o = static_cast<bf16*>(p_.o);
      // On the caller's stream the kernel before is always a kernel that
      // writes none of the tokens and reads none of the outputs (step_renorm,
      // the weights' copy, a dW GEMM); on the side stream an event wait
      // precedes every launch.
      h.dependent = pdl_ && stream_ != side_.stream;
      h.w = w;
      h.lr0 = tok(p_.lr0), h.lr1 = tok(p_.lr1), h.lr2 = tok(p_.lr2);
      h.z = z_.get(), h.gate = gate_.get(), h.z_lo = z_lo_.get(), h.gate_lo = gate_lo_.get();
      h.B = g_.B, h.H = g_.H, h.D = g_.D, h.M = g_.M;
      h.local_len = g_.local_len, h.t0 = t0, h.n = n;
      return h;
    } else {
      SS_CHECK_ARG(false, "dtype", "the fused hidden layer takes bf16 layers only");
      return {};
    }
  }

  // o = f_W(q) for the slice (the fused kernel forms o itself; an o it
  // cannot store to, as a d_o it cannot load, takes the cuBLAS path).
  void apply_forward(const T* w, int64_t n, int64_t t0) {
    const int64_t rows = g_.pairs * n, M = g_.M, hd = g_.H * g_.D;
    if (fused_apply()) {
      lact_hidden_launch(hidden_params(LactHiddenMode::apply, w, n, t0), stream_);
      return;
    }
    hidden(p_.q, w, n, t0);
    apply_gate_kernel<T>
        <<<row_grid(rows), kRowThreads, 0, stream_>>>(h_buf(), rows, M, gate_.get());
    SS_LAUNCH_CHECK("apply_gate_kernel");
    for (int64_t b = 0; b < g_.B; ++b)
      gemm_t(false, true, n, g_.D, M, 1.0, rows_in<T>(gate_.get(), b, n, M), weights(w, b, 2), 0.0,
             Output{static_cast<T*>(p_.o) + (b * g_.local_len + t0) * hd, kT, hd, g_.D});
  }

  // h = [h0 | h2] and e = -W1^T v (as rows) at the slice's keys and values.
  void key_side(const T* w, int64_t n, int64_t t0) {
    hidden(p_.k, w, n, t0);
    for (int64_t b = 0; b < g_.B; ++b)
      gemm_t(false, false, n, g_.M, g_.D, -1.0, tokens(p_.v, b, t0), weights(w, b, 2), 0.0,
             rows_out(e_buf(), b, n, g_.M));
  }

  // G = [G0 | G2 | G1] of the slice at W (this rank's partial sum).
  void partial_gradients(const T* w, int64_t n, int64_t t0, float* G) {
    const int64_t M = g_.M, M2 = 2 * g_.M;
    if (fused_hidden_) {
      lact_hidden_launch(hidden_params(LactHiddenMode::key_side, w, n, t0), stream_);
    } else {
      key_side(w, n, t0);
      key_side_kernel<T><<<row_grid(g_.pairs * n), kRowThreads, 0, stream_>>>(
          h_buf(), e_buf(), tok(p_.lr0), tok(p_.lr1), tok(p_.lr2), g_.pairs, n, M, g_.H,
          g_.local_len, t0, z_.get(), gate_.get(), z_lo_.get(), gate_lo_.get());
      SS_LAUNCH_CHECK("key_side_kernel");
    }
    for (int64_t b = 0; b < g_.B; ++b) {
      // [G0; G2] = [z0 | z2]^T k,  G1 = -v^T gate (+ the low bf16 terms).
      gemm_t(true, false, M2, g_.D, n, 1.0, rows_in<T>(z_.get(), b, n, M2), tokens(p_.k, b, t0),
             0.0, weight_grad(G, b, 0));
      gemm_t(true, false, g_.D, M, n, -1.0, tokens(p_.v, b, t0), rows_in<T>(gate_.get(), b, n, M),
             0.0, weight_grad(G, b, 2));
      if (split_update_) {
        gemm_t(true, false, M2, g_.D, n, 1.0, rows_in<T>(z_lo_.get(), b, n, M2),
               tokens(p_.k, b, t0), 1.0, weight_grad(G, b, 0));
        gemm_t(true, false, g_.D, M, n, -1.0, tokens(p_.v, b, t0),
               rows_in<T>(gate_lo_.get(), b, n, M), 1.0, weight_grad(G, b, 2));
      }
    }
  }

  void store_tokens(const float* acc, int64_t n, int64_t t0, void* dst) {
    const int64_t hd = g_.H * g_.D, total = g_.B * n * hd;
    store_tokens_kernel<T><<<grid_for(total, kThreads), kThreads, 0, stream_>>>(
        acc, g_.B, n, hd, g_.local_len, t0, static_cast<T*>(dst));
    SS_LAUNCH_CHECK("store_tokens_kernel");
  }

  // Whether apply_forward / apply_backward take the fused kernel: o and d_o
  // are the caller's, and the kernel's tensor maps and stores need them
  // aligned too.
  bool fused_apply() const { return fused_hidden_ && lact_hidden_aligned(p_.o, p_.o, p_.o); }
  bool fused_apply_backward(const LactCudaGrads& gr) const {
    return fused_hidden_ && lact_hidden_aligned(gr.d_o, gr.d_o, gr.d_o);
  }

  // Backward of apply_forward at w: writes dq of the slice, adds to dW.
  void apply_backward(const LactCudaGrads& gr, const T* w, int64_t n, int64_t t0, float* dW) {
    apply_backward_tokens(gr, w, n, t0);
    apply_backward_weights(gr, n, t0, dW);
  }
  // Its token side: gate and dh (gate_, dh_) of the slice, and dq.
  void apply_backward_tokens(const LactCudaGrads& gr, const T* w, int64_t n, int64_t t0) {
    const int64_t rows = g_.pairs * n, M = g_.M, M2 = 2 * g_.M;
    if (fused_apply_backward(gr)) {
      lact_hidden_launch(hidden_params(LactHiddenMode::apply_backward, w, n, t0, gr.d_o), stream_);
    } else {
      hidden(p_.q, w, n, t0);
      for (int64_t b = 0; b < g_.B; ++b)  // dgate = W1^T do (as rows), in u1's buffer
        gemm_t(false, false, n, M, g_.D, 1.0, tokens(gr.d_o, b, t0), weights(w, b, 2), 0.0,
               rows_out(u1_buf(), b, n, M));
      apply_backward_kernel<T><<<row_grid(rows), kRowThreads, 0, stream_>>>(
          h_buf(), u1_buf(), rows, M, gate_.get(), dh_.get());
      SS_LAUNCH_CHECK("apply_backward_kernel");
    }
    // [h0; h2] = [W0; W2] q: dq = dh [W0; W2].
    for (int64_t b = 0; b < g_.B; ++b)
      gemm_t(false, false, n, g_.D, M2, 1.0, rows_in<T>(dh_.get(), b, n, M2), weights(w, b, 0), 0.0,
             tokens_out(gr.dq, b, t0));
  }
  // Its weight side from gate_ and dh_: o = W1 gate: dW1 += do gate^T;
  // d[W0; W2] += dh^T q.
  void apply_backward_weights(const LactCudaGrads& gr, int64_t n, int64_t t0, float* dW) {
    const int64_t M = g_.M, M2 = 2 * g_.M;
    for (int64_t b = 0; b < g_.B; ++b) {
      gemm_t(true, false, g_.D, M, n, 1.0, tokens(gr.d_o, b, t0), rows_in<T>(gate_.get(), b, n, M),
             1.0, weight_grad(dW, b, 2));
      gemm_t(true, false, M2, g_.D, n, 1.0, rows_in<T>(dh_.get(), b, n, M2), tokens(p_.q, b, t0),
             1.0, weight_grad(dW, b, 0));
    }
  }

  // gradients_backward's rows (z, gate, de, dh, dlr) by lact_hidden_grad_kernel
  // where the fused hidden layer runs, into the packed rows zdh_ = [z | dh]
  // (4M) and gde_ = [gate | de] (2M), with kw_ = [dG0; dG2; W0; W2] and
  // t1_ = [dG1^T; W1^T] per pair beside them: dk and dv are then one GEMM
  // each, straight into the token gradients. False: the caller runs the
  // cuBLAS path.
  bool fused_gradient_rows(const LactCudaGrads& gr, const T* w, const float* dg, int64_t n,
                           int64_t t0) {
    if constexpr (std::is_same<T, bf16>::value) {
      if (!fused_hidden_) return false;
      const int64_t md = g_.md(), pairs = g_.pairs;
      const std::size_t rows = rows_alloc();
      T* zdh = lazy(zdh_, 4 * rows, stream_);
      T* gde = lazy(gde_, 2 * rows, stream_);
      T* kw = lazy(kw_, static_cast<std::size_t>(pairs * 4 * md), stream_);
      T* t1 = lazy(t1_, static_cast<std::size_t>(pairs * 2 * md), stream_);
      // dG's bf16 rows go straight into kw and t1: the block copy of dG
      // that the cuBLAS path converts is not needed here.
      lact_hidden_pack_operands(dg, w, pairs, g_.M, g_.D, kw, t1, stream_);
      LactHiddenGradParams h;
      h.k = tok(p_.k), h.v = tok(p_.v), h.w = kw + 2 * md, h.dg = kw, h.w1t = t1 + md, h.dg1t = t1;
      h.w_pitch = 4 * g_.M, h.t_pitch = 2 * g_.M;
      h.lr0 = tok(p_.lr0), h.lr1 = tok(p_.lr1), h.lr2 = tok(p_.lr2);
      h.dlr0 = static_cast<T*>(gr.dlr0), h.dlr1 = static_cast<T*>(gr.dlr1),
      h.dlr2 = static_cast<T*>(gr.dlr2);
      h.z = zdh, h.dh = zdh + 2 * g_.M, h.z_ld = h.dh_ld = 4 * g_.M;
      h.gate = gde, h.de = gde + g_.M, h.gate_ld = h.de_ld = 2 * g_.M;
      h.B = g_.B, h.H = g_.H, h.D = g_.D, h.M = g_.M, h.local_len = g_.local_len, h.t0 = t0,
      h.n = n;
      h.dependent = pdl_;  // after lact_hidden_pack_operands, which writes only kw and t1
      lact_hidden_grad_launch(h, stream_);
      return true;
    } else {
      (void)gr, (void)w, (void)dg, (void)n, (void)t0;
      return false;
    }
  }

  // Backward of partial_gradients given the all-reduced dG (fp32; w: W's
  // operand copy): writes dk, dv, dlr0..2 of the slice, adds the
  // second-order part to dW.
  //   dk = [lr0 z0 | lr2 z2] [dG0; dG2] + [dh0 | dh2] [W0; W2],
  //   dv = -lr1 gate dG1^T - de W1^T,
  //   e = -W1^T v: dW1 -= v de^T;  [h0; h2] = [W0; W2] k: d[W0; W2] += dh^T k.
  void gradients_backward(const LactCudaGrads& gr, const T* w, const float* dG, int64_t n,
                          int64_t t0, float* dW) {
    const int64_t M = g_.M, M2 = 2 * g_.M, md = g_.md(), D = g_.D;
    if (fused_gradient_rows(gr, w, dG, n, t0)) {
      const T* zdh = zdh_.get();
      const T* gde = gde_.get();
      for (int64_t b = 0; b < g_.B; ++b) {
        const int64_t pb = b * g_.H;  // the row's first pair
        gemm_t(false, false, n, D, 2 * M2, 1.0, rows_in<T>(zdh, b, n, 2 * M2),
               {kw_.get() + pb * 4 * md, kT, D, 4 * md}, 0.0, tokens_out(gr.dk, b, t0));
        gemm_t(false, false, n, D, M2, -1.0, rows_in<T>(gde, b, n, M2),
               {t1_.get() + pb * 2 * md, kT, D, 2 * md}, 0.0, tokens_out(gr.dv, b, t0));
        gemm_t(true, false, D, M, n, -1.0, tokens(p_.v, b, t0), rows_in<T>(gde + M, b, n, M2), 1.0,
               weight_grad(dW, b, 2));
        gemm_t(true, false, M2, D, n, 1.0, rows_in<T>(zdh + M2, b, n, 2 * M2), tokens(p_.k, b, t0),
               1.0, weight_grad(dW, b, 0));
      }
      return;
    }
    const T* dg = operand_copy(dG, dg_op_);
    key_side(w, n, t0);
    for (int64_t b = 0; b < g_.B; ++b) {
      // [u0 | u2] = k [dG0; dG2]^T, u1 = v dG1 (as rows).
      gemm_t(false, true, n, M2, D, 1.0, tokens(p_.k, b, t0), weights(dg, b, 0), 0.0,
             rows_out(u_buf(), b, n, M2));
      gemm_t(false, false, n, M, D, 1.0, tokens(p_.v, b, t0), weights(dg, b, 2), 0.0,
             rows_out(u1_buf(), b, n, M));
    }
    gradients_backward_rows_kernel<T><<<row_grid(g_.pairs * n), kRowThreads, 0, stream_>>>(
        h_buf(), e_buf(), u_buf(), u1_buf(), tok(p_.lr0), tok(p_.lr1), tok(p_.lr2), g_.pairs * n, n,
        M, g_.H, g_.local_len, t0, static_cast<T*>(gr.dlr0), static_cast<T*>(gr.dlr1),
        static_cast<T*>(gr.dlr2), z_.get(), gate_.get(), de_buf(), dh_.get());
    SS_LAUNCH_CHECK("gradients_backward_rows_kernel");
    // The rows in separate arrays: dk and dv as two GEMMs each into fp32 sums.
    float* dk_acc = token_acc(dk_acc_);
    float* dv_acc = token_acc(dv_acc_);
    for (int64_t b = 0; b < g_.B; ++b) {
      gemm_t(false, false, n, D, M2, 1.0, rows_in<T>(z_.get(), b, n, M2), weights(dg, b, 0), 0.0,
             acc_out(dk_acc, b, n));
      gemm_t(false, false, n, D, M2, 1.0, rows_in<T>(dh_.get(), b, n, M2), weights(w, b, 0), 1.0,
             acc_out(dk_acc, b, n));
      gemm_t(false, true, n, D, M, -1.0, rows_in<T>(gate_.get(), b, n, M), weights(dg, b, 2), 0.0,
             acc_out(dv_acc, b, n));
      gemm_t(false, true, n, D, M, -1.0, rows_in<T>(de_.get(), b, n, M), weights(w, b, 2), 1.0,
             acc_out(dv_acc, b, n));
      gemm_t(true, false, D, M, n, -1.0, tokens(p_.v, b, t0), rows_in<T>(de_.get(), b, n, M), 1.0,
             weight_grad(dW, b, 2));
      gemm_t(true, false, M2, D, n, 1.0, rows_in<T>(dh_.get(), b, n, M2), tokens(p_.k, b, t0), 1.0,
             weight_grad(dW, b, 0));
    }
    store_tokens(dk_acc, n, t0, gr.dk);
    store_tokens(dv_acc, n, t0, gr.dv);
  }

  LactCudaParams p_;
  Geo g_;
  cudaStream_t stream_;
  cublasHandle_t blas_;
  bool causal_, momentum_;
  // bf16 with Muon: the update gradient G (Newton-Schulz's input) takes its
  // token operands z, gate as bf16 hi + lo pairs (two GEMMs each). Newton-
  // Schulz amplifies the small singular directions of its input by up to
  // a^5 ~ 490, and plain bf16 z, gate put ~1e-3 relative noise there: in a
  // host emulation of this path (bidir, Muon, D 32, M 64, C 128) they lifted
  // dk from 5.4e-3 to 7.3e-3 and dlr from 6.3e-3 to 8.6e-3 (DESIGN's bounds
  // 8e-3 and 2e-2). Costs 6 M D more forward GEMM FLOPs per token (18 -> 24),
  // with Muon only.
  bool split_update_;
  // The hidden layer in lact_hidden_kernel and lact_hidden_grad_kernel
  // (lact_cuda_hidden_path): gate, z (and their low terms), dh, de straight
  // from the MMAs, no fp32 h, e or u.
  bool fused_hidden_;
  bool token_gemm_ = std::is_same<T, bf16>::value && token_gemm_requested();
  bool pdl_ = lact_pdl_requested();  // the fused kernels as dependent launches
  // A stream beside stream_ (side_stream), its cuBLAS handle and the events
  // that order it against stream_; empty (false) where the layer runs on one
  // stream (side_stream_requested), and the callers then run that work on
  // stream_ themselves.
  struct Lane {
    cudaStream_t stream = nullptr;
    cublasHandle_t blas = nullptr;
    cudaEvent_t fork = nullptr, joined = nullptr;
    bool pending = false;  // `joined` recorded and not yet waited on by stream_
    // The thread's side stream with its own cuBLAS handle (BlasSlot::lact_side).
    static Lane open() {
      Lane lane;
      lane.stream = side_stream();
      lane.blas = detail::blas_handle(lane.stream, detail::BlasSlot::lact_side);
      SS_CUDA_CHECK(cudaEventCreateWithFlags(&lane.fork, cudaEventDisableTiming));
      SS_CUDA_CHECK(cudaEventCreateWithFlags(&lane.joined, cudaEventDisableTiming));
      return lane;
    }
    explicit operator bool() const { return stream != nullptr; }
    // The layer's destructor: `main` waits for what is still queued here.
    void release(cudaStream_t main) noexcept {
      if (pending) cudaStreamWaitEvent(main, joined, 0);
      if (fork != nullptr) cudaEventDestroy(fork);
      if (joined != nullptr) cudaEventDestroy(joined);
    }
  };
  // Each chunk's output side (the fused apply; the backward's apply and dq),
  // beside the update chain.
  Lane side_;

  // f() with stream_ and blas_ standing for the lane's: what f enqueues
  // (launches, GEMMs) runs after everything enqueued on stream_ so far and
  // beside what is enqueued there next, until join(lane). f must not
  // allocate (the pool's arrays belong to stream_) nor write what stream_'s
  // work before the join reads or writes. `lane` is not empty (the callers
  // test it).
  template <typename F>
  void on_lane(Lane& lane, F&& f) {
    SS_CUDA_CHECK(cudaEventRecord(lane.fork, stream_));
    SS_CUDA_CHECK(cudaStreamWaitEvent(lane.stream, lane.fork, 0));
    struct Swap {
      LactGpu& g;
      Lane& lane;
      cudaStream_t stream;
      cublasHandle_t blas;
      ~Swap() {
        g.stream_ = stream, g.blas_ = blas;
        // Recorded even when f threw: the destructor's wait covers what it enqueued.
        lane.pending = cudaEventRecord(lane.joined, lane.stream) == cudaSuccess;
      }
    } swap{*this, lane, stream_, blas_};
    stream_ = lane.stream, blas_ = lane.blas;
    f();
  }
  // stream_ waits for the lane's work so far.
  void join(Lane& lane) {
    if (!lane.pending) return;
    SS_CUDA_CHECK(cudaStreamWaitEvent(stream_, lane.joined, 0));
    lane.pending = false;
  }
  PoolArray<float> w_init_, norm0_;
  // Rows of 2M: h_, u_ (fp32), z_, dh_ (operands); rows of M: e_, u1_ (fp32),
  // gate_, de_ (operands).
  PoolArray<float> h_, e_, u_, u1_, dk_acc_, dv_acc_;
  PoolArray<T> z_, gate_, de_, dh_, w_op_, z_lo_, gate_lo_;
  // The fused backward's packed rows and weights (fused_gradient_rows), on
  // first use.
  PoolArray<T> zdh_, gde_, kw_, t1_;
  PoolArray<T> dg_op_;     // the cuBLAS path's bf16 dG (operand_copy)
  SplitKScratch split_k_;  // gemm_t's split-K partials and pointer arrays
};

template <typename T, typename U>
void forward_impl(const LactCudaParams& p, const LactDeviceAllReduce& all_reduce,
                  LactCudaSaved* saved, cudaStream_t stream) {
  LactGpu<T, U> layer(p, stream);
  layer.forward(all_reduce, saved);
}

template <typename T, typename U>
void backward_impl(const LactCudaParams& p, const LactCudaGrads& g, const LactCudaSaved& saved,
                   const LactDeviceAllReduce& all_reduce, cudaStream_t stream) {
  LactGpu<T, U> layer(p, stream);
  layer.backward(g, saved, all_reduce);
}

}  // namespace lact_detail
}  // namespace statescan::cuda
