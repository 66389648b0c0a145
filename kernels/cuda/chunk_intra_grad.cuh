// chunk_intra_grad_kernel (backward b11, b17): the per-chunk gradients for
// 16-bit inputs with a scalar gate or none (retention, deltanet,
// gated_deltanet, linear with the L2 norm; vector gates:
// chunk_intra_grad_vector.cuh after chunk_state_products_kernel, with the
// helpers below). Since b17 it forms the products with the states itself
// (V', dV', gq, gk, dW: chunk_state_products_kernel's, which handed them
// over through ~112 KB of global memory per item), first, while the slots
// of q, k and the C x C tiles are still free for S, dS, A, K_ and W; and it
// takes T = (I + diag(beta) KK)^{-1} from the backward's prepare re-run
// (ForwardArgs::ws_t) instead of solving it again where that is given. It replaces
// chunk_grad_kernel_tc's per-block global scratch (which fp32 inputs keep) by
// the b8 form (kernels/cuda/PERF_NOTES.md, backward b11): every
// operand in shared memory in the input's 16-bit type, the [C, Dk]
// accumulators gq, gk (and gx, below) in registers, each warp owning one
// 16-row x Dk/4-column slab of all of them for the whole item, so the
// products add into them without a memory round trip. The math is
// chunk_grad_kernel_tc's phase for phase (tests/chunk_bwd_model.h); its
// precision with these bf16 operands is bounded on the CPU by
// test_chunk_bwd_model's ChunkBwdModelBf16 ("b11").
//
// Scalar gate: G_t = inclusive cumsum of the chunk's log gates; the pairwise
// decay e^{G_t - G_s} (s <= t) multiplies C x C matrices elementwise, so every
// product is a plain tensor-core product.
//
// db (the gradient w.r.t. the gate cumsum) is not kept per element: with
// gk = gk_A + gkh + kh + kt (the A path, the T^T dW term and the two dMm
// paths), chunk_grad_kernel_tc's db = gq q - gk_A k + gkh k + (kh - kt) k equals
// gq q - gk k + 2 (gkh + kh) k, so a third accumulator gx = gkh + kh suffices
// and db's row sums are taken at the end.
//   grid (chunk-head items), 512 threads, IntraTraits::kBytes of dynamic
//   shared memory (201 KB at D = 128), one block per multiprocessor.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/chunk_tile_ops.cuh"
#include "kernels/cuda/quad_store.cuh"
#include "kernels/cuda/warp_mma.cuh"

namespace statescan::cuda::detail {

template <typename T, int Dk, int Dv>
struct IntraTraits {
  // 16 warps: four row slabs x four column quarters of the [C, D] arrays
  // (more warps to hide the latency of each phase's short dependent chains
  // than 8, at 128 registers a thread).
  static constexpr int kMaxChunk = 64, kThreads = 512, kWarps = 16, kParts = kWarps / 4;
  static constexpr int kLdK = Dk + 8, kLdV = Dv + 8, kLdC = kMaxChunk + 8;  // 16-bit pitches
  static constexpr int kLdF = kMaxChunk + 4;                                 // fp32 C x C pitch
  static constexpr size_t kKTile = sizeof(T) * kMaxChunk * kLdK;
  static constexpr size_t kVTile = sizeof(T) * kMaxChunk * kLdV;
  static constexpr size_t kCTile = sizeof(T) * kMaxChunk * kLdC;
  static constexpr size_t kFTile = sizeof(float) * kMaxChunk * kLdF;
  // q, k, dW ([C, Dk]); v, dO, V', dV' ([C, Dv]); T, dA, dT, tmp, M' (16-bit
  // C x C); KK, dMm (fp32 C x C); per-row vectors.
  static constexpr size_t kOffQ = 0, kOffK = kOffQ + kKTile, kOffDW = kOffK + kKTile;
  static constexpr size_t kOffV = kOffDW + kKTile, kOffDO = kOffV + kVTile;
  static constexpr size_t kOffVp = kOffDO + kVTile, kOffDVp = kOffVp + kVTile;
  static constexpr size_t kOffHT = kOffDVp + kVTile, kOffHDA = kOffHT + kCTile;
  static constexpr size_t kOffHDT = kOffHDA + kCTile, kOffHTmp = kOffHDT + kCTile;
  static constexpr size_t kOffHM = kOffHTmp + kCTile;
  static constexpr size_t kOffFKK = kOffHM + kCTile, kOffFDM = kOffFKK + kFTile;
  static constexpr size_t kOffRows = kOffFDM + kFTile;
  // The state-product phase runs first, before q, k and the C x C tiles are
  // live: K_ and W take q's and k's slots, S_c, dS_{c+1} (16-bit, Dk x Dv)
  // and A the C x C region from hT on, U the V' slot.
  static constexpr size_t kStateTile = sizeof(T) * Dk * kLdV;
  static constexpr size_t kOffS = kOffHT, kOffDS = kOffS + kStateTile, kOffA = kOffDS + kStateTile;
  static_assert(kOffA + kCTile <= kOffRows, "S, dS and A fit the C x C tiles' region");
  // Row vectors (floats): G, beta, rq, rk, dbeta from dMm; [kParts][C]
  // column-quarter parts of the row sums dbeta, q.gq, k.gk, db; warp partials
  // of the K_ path's column sums and of S . dS (dgamma).
  static constexpr int kRowFloats = 5 * kMaxChunk + 4 * kParts * kMaxChunk + 2 * kWarps;
  static constexpr size_t kBytes = kOffRows + sizeof(float) * kRowFloats;
  static_assert(kBytes <= 227 * 1024, "chunk_intra_grad_kernel exceeds Hopper shared memory");
  static_assert(Dk % (16 * kParts) == 0 && Dv % (16 * kParts) == 0,
                "each warp takes a column quarter in n8 pairs");
};

// V', dV' and dW (delta rules: chunk_state_products_kernel stores them in T
// already) into the 16-bit operand tiles by cp.async (committed, not
// waited: the kernels wait for every group before their second barrier).
template <int kThreads, int kChunk, int Dk, int Dv, typename T>
__device__ __forceinline__ void intra_load_state_products(T* sVp, T* sDVp, T* sDW, int ldk, int ldv,
                                                          const float* sp) {
  using SpTr = StateProductTraits<T, Dk, Dv>;
  auto part = [&](int64_t off) { return reinterpret_cast<const T*>(sp + off); };
  copy_rows_async<kThreads, kChunk, Dv>(sVp, ldv, part(SpTr::kOffVp), Dv, threadIdx.x);
  copy_rows_async<kThreads, kChunk, Dv>(sDVp, ldv, part(SpTr::kOffDVp), Dv, threadIdx.x);
  copy_rows_async<kThreads, kChunk, Dk>(sDW, ldk, part(SpTr::kOffDW), Dk, threadIdx.x);
  cp_async_commit();
}

// A warp's slab accumulator (rows m0 .. m0+16, columns n0 .. n0+8 kNT, the
// warp_mm_16xn layout) dotted with rows given by pair(r, col) (elements col,
// col + 1 of row r) over the slab's columns: out[hr] for row m0 + g + 8 hr,
// complete in every lane of the quad (rows past L give 0).
template <int kNT, typename Pair>
__device__ __forceinline__ void slab_row_dots_by(float (&out)[2], const float (&acc)[kNT][4],
                                                 int m0, int n0, int L, Pair&& pair) {
  const int lane = threadIdx.x & 31, g = lane >> 2, i2 = 2 * (lane & 3);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = m0 + g + 8 * hr;
    float sum = 0.f;
    if (r < L) {
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const float2 x = pair(r, n0 + 8 * j + i2);
        sum += x.x * acc[j][2 * hr] + x.y * acc[j][2 * hr + 1];
      }
    }
    out[hr] = quad_sum(sum);
  }
}

// Row r of a warp's slab (kNT 8-column blocks from column n0, this lane's
// pairs in w) to out + row(r) D when `valid`: in 8-byte pieces after a quad
// exchange where kNT is even (detail::store_quad_row: whole 32-byte sectors),
// else 4 bytes a lane from the fragment layout. Every lane of the warp calls
// it (the exchange).
template <int D, int kNT, typename T, typename Row>
__device__ __forceinline__ void store_slab_row(T* out, const uint32_t (&w)[kNT], Row& row, int r,
                                               int n0, bool valid) {
  const int q = threadIdx.x & 3;
  if constexpr (kNT % 2 == 0) {
    store_quad_row(valid ? out + row(r) * D + n0 : out, w, q, valid);
  } else if (valid) {
#pragma unroll
    for (int j = 0; j < kNT; ++j)
      *reinterpret_cast<uint32_t*>(out + row(r) * D + n0 + 8 * j + 2 * q) = w[j];
  }
}

// dq, dk from the slab accumulators gq, gk (gradients w.r.t. the normalised
// q, k) through the L2 norm, dx = r (dn - n (n . dn)), with the full row dots
// n . dn = sum over the kParts column parts p of sQG[p kMC + r] and the exact
// normalised rows n given by q_exact(r, col), k_exact(r, col) (pairs).
template <int Dk, int kNT, int kMC, int kParts, bool kL2Norm, typename T, typename QExact,
          typename KExact, typename Row>
__device__ __forceinline__ void slab_store_dq_dk(const float (&gq)[kNT][4],
                                                 const float (&gk)[kNT][4], T* dq_out, T* dk_out,
                                                 QExact&& q_exact, KExact&& k_exact,
                                                 const float* sRq, const float* sRk,
                                                 const float* sQG, const float* sKG, Row row,
                                                 int m0, int n0, int L) {
  const int lane = threadIdx.x & 31, g = lane >> 2, i2 = 2 * (lane & 3);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = m0 + g + 8 * hr;
    const bool valid = r < L;
    float rq = 0.f, rk = 0.f, qgr = 0.f, kgr = 0.f;
    if constexpr (kL2Norm) {
      if (valid) {
        rq = sRq[r], rk = sRk[r];
#pragma unroll
        for (int p = 0; p < kParts; ++p) {
          qgr += sQG[p * kMC + r];
          kgr += sKG[p * kMC + r];
        }
      }
    }
    uint32_t wq[kNT], wk[kNT];
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const int col = n0 + 8 * j + i2;
      float x0 = gq[j][2 * hr], x1 = gq[j][2 * hr + 1];
      float y0 = gk[j][2 * hr], y1 = gk[j][2 * hr + 1];
      if constexpr (kL2Norm) {
        if (valid) {
          const float2 q2 = q_exact(r, col);
          const float2 k2 = k_exact(r, col);
          x0 = rq * (x0 - q2.x * qgr);
          x1 = rq * (x1 - q2.y * qgr);
          y0 = rk * (y0 - k2.x * kgr);
          y1 = rk * (y1 - k2.y * kgr);
        }
      }
      wq[j] = pack2<T>(x0, x1);
      wk[j] = pack2<T>(y0, y1);
    }
    store_slab_row<Dk>(dq_out, wq, row, r, n0, valid);
    store_slab_row<Dk>(dk_out, wk, row, r, n0, valid);
  }
}

// The delta rules' dv = beta T^T dU of a warp's 16 rows from m0 and kNT
// 8-column tiles from n0 (rows r < L stored at dv_out + row(r) Dv), adding
// dbeta's partial T^T dU . v of rows m0 + g and m0 + g + 8 to dbp: the step
// chunk_intra_grad_kernel and chunk_intra_grad_vector_kernel share. g and i2
// are the caller's lane / 4 and 2 (lane % 4), passed in so that the code is
// the kernels' own (the same PTX as when it stood inline).
template <int Dv, int kNT, typename T, typename Row>
__device__ __forceinline__ void intra_store_dv(float (&dbp)[2], const T* hT, int ldc, const T* sDVp,
                                               const T* sV, int ldv, const float* sBeta, T* dv_out,
                                               Row&& row, int m0, int n0, int C, int L, int g,
                                               int i2) {
  float tu[kNT][4] = {};
  warp_mm_16xn<T, true, true, kNT>(tu, hT, ldc, sDVp, ldv, m0, n0, C);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = m0 + g + 8 * hr;
    const bool valid = r < L;
    const float beta = valid ? sBeta[r] : 0.f;
    uint32_t w[kNT];
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const int col = n0 + 8 * j + i2;
      const float x = tu[j][2 * hr], y = tu[j][2 * hr + 1];
      const float2 v2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(sV + r * ldv + col));
      dbp[hr] += x * v2.x + y * v2.y;
      w[j] = pack2<T>(beta * x, beta * y);
    }
    store_slab_row<Dv>(dv_out, w, row, r, n0, valid);
  }
}

// The quad's sums of a warp's row partials (rows m0 + g and m0 + g + 8, as
// intra_store_dv's dbp) into dst[m0 + g], dst[m0 + g + 8]; lane and g the
// caller's, as above.
__device__ __forceinline__ void intra_store_row_sums(float (&part)[2], float* dst, int m0, int lane,
                                                     int g) {
  part[0] = quad_sum(part[0]);
  part[1] = quad_sum(part[1]);
  if ((lane & 3) == 0) {
    dst[m0 + g] = part[0];
    dst[m0 + g + 8] = part[1];
  }
}

template <Decay kDecay, Rule kRule, typename T, int Dk, int Dv, bool kL2Norm, int kChunk>
__global__ void __launch_bounds__(512, 1)
    chunk_intra_grad_kernel(const __grid_constant__ BackwardArgs a) {
  static_assert(kChunk == 16 || kChunk == 32 || kChunk == 64, "chunk in {16, 32, 64}");
  static_assert(kDecay != Decay::vector, "vector gates keep chunk_grad_kernel_tc");
  static_assert(!std::is_same_v<T, float>, "16-bit inputs only");
  using Tr = IntraTraits<T, Dk, Dv>;
  constexpr bool kDelta = kRule == Rule::delta;
  constexpr bool kScalar = kDecay == Decay::scalar;
  constexpr int kLdK = Tr::kLdK, kLdV = Tr::kLdV, kLdC = Tr::kLdC, kLdF = Tr::kLdF;
  constexpr int kMC = Tr::kMaxChunk, kWarps = Tr::kWarps, kThreads = Tr::kThreads;
  constexpr int kParts = Tr::kParts;
  constexpr int kNTk = Dk / (8 * kParts), kNTv = Dv / (8 * kParts);  // n8 tiles of a warp's slab
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  auto at = [&](size_t off) { return smem_bytes + off; };
  T* sQ = reinterpret_cast<T*>(at(Tr::kOffQ));  // normalised q, operand copy
  T* sK = reinterpret_cast<T*>(at(Tr::kOffK));  // normalised k, operand copy
  T* sDW = reinterpret_cast<T*>(at(Tr::kOffDW));
  T* sV = reinterpret_cast<T*>(at(Tr::kOffV));
  T* sDO = reinterpret_cast<T*>(at(Tr::kOffDO));
  T* sVp = reinterpret_cast<T*>(at(Tr::kOffVp));
  T* sDVp = reinterpret_cast<T*>(at(Tr::kOffDVp));
  T* hT = reinterpret_cast<T*>(at(Tr::kOffHT));
  T* hDA = reinterpret_cast<T*>(at(Tr::kOffHDA));
  T* hDT = reinterpret_cast<T*>(at(Tr::kOffHDT));
  T* hTmp = reinterpret_cast<T*>(at(Tr::kOffHTmp));
  T* hM = reinterpret_cast<T*>(at(Tr::kOffHM));  // diag(beta) dMm with the decay
  float* fKK = reinterpret_cast<float*>(at(Tr::kOffFKK));
  float* fDM = reinterpret_cast<float*>(at(Tr::kOffFDM));
  float* sG = reinterpret_cast<float*>(at(Tr::kOffRows));
  float* sBeta = sG + kMC;
  float* sRq = sBeta + kMC;
  float* sRk = sRq + kMC;
  float* sDbM = sRk + kMC;            // dbeta from dMm . KK
  float* sDbA = sDbM + kMC;             // [kParts][C] dbeta from T^T dU . v and T^T dW . K^
  float* sQG = sDbA + kParts * kMC;     // [kParts][C] q . gq
  float* sKG = sQG + kParts * kMC;      // [kParts][C] k . gk
  float* sDb = sKG + kParts * kMC;      // [kParts][C] row sums of db
  float* sWarpPart = sDb + kParts * kMC;  // [kWarps] column-sum partials
  float* sDg = sWarpPart + kWarps;        // [kWarps] partials of S . dS

  const ForwardArgs& f = a.f;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, i2 = 2 * (lane & 3);
  const int64_t H = f.heads, item = a.item_begin + blockIdx.x, c = item / H, h = item % H;
  int64_t token0;
  int L;
  chunk_geometry(f, c, token0, L);
  // Compile-time chunk (as chunk_prepare16_kernel): constant trip counts and
  // strides, no division per element in T's 16-bit copy.
  constexpr int C = kChunk, nb = kChunk / 16;
  const float scale = f.scale;
  auto row = [&](int t) { return (token0 + t) * H + h; };
  const T* q_in = static_cast<const T*>(f.q);
  const T* k_in = static_cast<const T*>(f.k);
  const T* v_in = static_cast<const T*>(f.v);
  const T* do_in = static_cast<const T*>(a.d_o);
  const T* beta_in = static_cast<const T*>(f.beta);
  // e^{G_t - G_s} (1 without a gate).
  auto decay = [&](int t, int s) -> float {
    if constexpr (kScalar) return __expf(sG[t] - sG[s]);
    return 1.f;
  };
  auto up = [&](int t) -> float {  // e^{G_t}
    if constexpr (kScalar) return __expf(sG[t]);
    return 1.f;
  };

  // ---- load -------------------------------------------------------------------
  // The state-product phase's operands: the prepare stage's tiles (rows past
  // L are zeros), dO and v (rows past L zero-filled), S_c and dS_{c+1}
  // rounded to T as the forward and the reverse scan round them for their
  // own products (dS saved in T, ws_ds_t, is copied as it is).
  T* sS = reinterpret_cast<T*>(at(Tr::kOffS));
  T* sDS = reinterpret_cast<T*>(at(Tr::kOffDS));
  T* sA = reinterpret_cast<T*>(at(Tr::kOffA));
  T* sKb = sK;  // K_ until q and k take the slots
  T* sW = sQ;
  const int64_t tile = item;  // = c H + h, the workspace's tile index
  const bool ds_in_t = a.ws_ds_t != nullptr;
  const float* S = a.chunk_states + tile * Dk * Dv;
  const float* dS = a.ws_ds + tile * Dk * Dv;
  constexpr int kRowVecs = Dv / 4, kIters = Dk * kRowVecs / kThreads;
  static_assert(kIters * kThreads == Dk * kRowVecs, "whole load rounds");
  auto store_state = [&](T* dst, int idx, const float4& x) {  // fp32 -> T
    const int d = idx / kRowVecs, j = (idx % kRowVecs) * 4;
    *reinterpret_cast<uint2*>(dst + d * kLdV + j) =
        make_uint2(pack2<T>(x.x, x.y), pack2<T>(x.z, x.w));
  };
  // With dS in T, S_c's fp32 rows (64 KB an item at D = 128, the load phase's
  // longest wait) are all requested before the cp.async copies are issued,
  // not after them in two rounds (the first conversion's wait was the
  // kernel's costliest instruction: ncu source view, sixteenth session).
  float4 xs_all[kIters];
  if (ds_in_t) {
#pragma unroll
    for (int it = 0; it < kIters; ++it) xs_all[it] = load4(S + 4 * (tid + it * kThreads));
  }
  // cp.async groups, delta rules: W and U first (V' = U - W S, the first
  // product); then K_, A, dS, v and dO in one group (copy_row_pair_async
  // commits it), which lands while V' is formed: wait<1> below leaves only
  // that group in flight. (Until the eighteenth session v and dO were a
  // group of their own before K_, so wait<1> waited for them too.)
  if constexpr (kDelta) {
    copy_tile_async<kThreads>(sW, kLdK, static_cast<const T*>(f.ws_w) + tile * C * Dk, Dk, C, Dk);
    copy_tile_async<kThreads>(sVp, kLdV, static_cast<const T*>(f.ws_u) + tile * C * Dv, Dv, C, Dv);
    cp_async_commit();
  }
  copy_tile_async<kThreads>(sKb, kLdK, static_cast<const T*>(f.ws_k) + tile * C * Dk, Dk, C, Dk);
  copy_tile_async<kThreads>(sA, kLdC, static_cast<const T*>(f.ws_a) + tile * C * C, C, C, C);
  if (ds_in_t)
    copy_tile_async<kThreads>(sDS, kLdV, static_cast<const T*>(a.ws_ds_t) + tile * Dk * Dv, Dv, Dk,
                              Dv);
  copy_row_pair_async<kThreads, Dv>(sV, sDO, kLdV, v_in, do_in, row, C, L);  // commits the group
  if (tid < kMC) {  // every row of the scan below; zeros past the chunk
    const bool valid = tid < L;
    sBeta[tid] = kDelta && valid ? to_float(beta_in[row(tid)]) : 0.f;
    sG[tid] = kScalar && valid ? f.g[row(tid)] : 0.f;
  }
  if (ds_in_t) {
#pragma unroll
    for (int it = 0; it < kIters; ++it) store_state(sS, tid + it * kThreads, xs_all[it]);
  } else {
    // S and dS in fp32, half of each matrix's loads in flight at once; S . dS
    // from the exact values (dgamma: only scalar gates read it, and their dS
    // is never in T).
    constexpr int kHalf = kIters > 1 ? kIters / 2 : 1;
    static_assert(kIters % kHalf == 0, "whole load rounds");
    float sds = 0.f;
#pragma unroll
    for (int round = 0; round < kIters; round += kHalf) {
      float4 xs[kHalf], xd[kHalf];
#pragma unroll
      for (int it = 0; it < kHalf; ++it) {
        const int idx = tid + (round + it) * kThreads;
        xs[it] = load4(S + 4 * idx);
        xd[it] = load4(dS + 4 * idx);
      }
#pragma unroll
      for (int it = 0; it < kHalf; ++it) {
        const int idx = tid + (round + it) * kThreads;
        store_state(sS, idx, xs[it]);
        store_state(sDS, idx, xd[it]);
        sds += xs[it].x * xd[it].x + xs[it].y * xd[it].y + xs[it].z * xd[it].z +
               xs[it].w * xd[it].w;
      }
    }
    if constexpr (kScalar) {
      sds = warp_sum(sds);
      if (lane == 0) sDg[warp] = sds;
    }
  }
  if constexpr (kDelta)
    cp_async_wait<1>();  // W and U
  else
    cp_async_wait<0>();
  __syncthreads();
  // G_t, the gate's cumsum, by warp 0 as chunk_prepare16_kernel forms it
  // (bitwise the forward's; a serial walk by one thread was 64 dependent
  // shared-memory steps); read only after the barriers below.
  if constexpr (kScalar)
    if (warp == 0) warp_cumsum64(sG);

  // Each warp's slab of the [C, D] arrays: rows m0 .. m0+16, a column quarter.
  const int rt = warp & 3, part = warp >> 2;
  const bool active = rt < nb;
  const int m0 = 16 * rt, n0k = part * (Dk / kParts), n0v = part * (Dv / kParts);
  // Element (j, e) of a slab: row m0 + g + 8 (e >> 1), column n0 + 8 j + i2 + (e & 1).
  auto erow = [&](int e) { return m0 + g + 8 * (e >> 1); };

  // ---- state products (backward b17: formerly chunk_state_products_kernel,
  // whose fp32 outputs made a round trip through global memory) -------------
  //   V'  = U - W S_c            (delta rules, in place of U; additive: V' = V)
  //   dV' = A^T dO + K_ dS_{c+1} (delta rules into sDVp; additive: it is dv)
  //   gq  = dO S_c^T, gk = V' dS_{c+1}^T into the warp's own slab accumulators
  //   dW  = -dV' S_c^T           (delta rules, into sDW)
  // The products that fill a shared tile go in 16 x 32 slabs over the warps.
  auto state_slabs = [&](int cols, auto&& body) {
    for (int sl = warp; sl < nb * (cols / 32); sl += kWarps) body(16 * (sl % nb), 32 * (sl / nb));
  };
  // Slab element (j, e >> 1) pairs: rows r0 + g (+ 8), columns c0 + 8 j + i2 (+ 1).
  auto for_slab_pairs = [&](int r0, int c0, auto&& body) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) body(j, hr, r0 + g + 8 * hr, c0 + 8 * j + i2);
  };
  float gq[kNTk][4] = {}, gk[kNTk][4] = {}, gx[kNTk][4] = {};
  if constexpr (kDelta) {
    state_slabs(Dv, [&](int r0, int c0) {
      float acc[4][4] = {};
      warp_mm_16x32<T, false, true>(acc, sW, kLdK, sS, kLdV, r0, c0, Dk);
      for_slab_pairs(r0, c0, [&](int j, int hr, int r, int col) {
        uint32_t* p = reinterpret_cast<uint32_t*>(sVp + r * kLdV + col);
        const float2 u = unpack2<T>(*p);
        *p = pack2<T>(u.x - acc[j][2 * hr], u.y - acc[j][2 * hr + 1]);
      });
    });
    cp_async_wait<0>();  // the rest
    __syncthreads();
  }
  state_slabs(Dv, [&](int r0, int c0) {
    float acc[4][4] = {};
    warp_mm_16x32<T, true, true>(acc, sA, kLdC, sDO, kLdV, r0, c0, C);
    warp_mm_16x32<T, false, true>(acc, sKb, kLdK, sDS, kLdV, r0, c0, Dk);
    if constexpr (kDelta) {
      for_slab_pairs(r0, c0, [&](int j, int hr, int r, int col) {
        *reinterpret_cast<uint32_t*>(sDVp + r * kLdV + col) =
            pack2<T>(acc[j][2 * hr], acc[j][2 * hr + 1]);
      });
    } else {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = r0 + g + 8 * hr;
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = pack2<T>(acc[j][2 * hr], acc[j][2 * hr + 1]);
        store_slab_row<Dv>(static_cast<T*>(a.dv), w, row, r, c0, r < L);
      }
    }
  });
  if (active) warp_mm_16xn<T, false, false, kNTk>(gq, sDO, kLdV, sS, kLdV, m0, n0k, Dv);
  __syncthreads();  // V' and dV' complete
  // q and k rows in flight during the products below; their slots (K_, W)
  // are free after the next barrier.
  QKRows<kWarps, Dk, T> qk_rows;
  qk_rows.load(q_in, k_in, row, C, L);
  if (active)
    warp_mm_16xn<T, false, false, kNTk>(gk, kDelta ? sVp : sV, kLdV, sDS, kLdV, m0, n0k, Dv);
  if constexpr (kDelta) {
    state_slabs(Dk, [&](int r0, int c0) {
      float acc[4][4] = {};
      warp_mm_16x32<T, false, false>(acc, sDVp, kLdV, sS, kLdV, r0, c0, Dv);
      for_slab_pairs(r0, c0, [&](int j, int hr, int r, int col) {
        *reinterpret_cast<uint32_t*>(sDW + r * kLdK + col) =
            pack2<T>(-acc[j][2 * hr], -acc[j][2 * hr + 1]);
      });
    });
  }
  __syncthreads();  // S, dS, A, K_ and W are dead
  // T from the backward's prepare re-run (ForwardArgs::ws_t) into hT, waited
  // for before the barrier after dA; without it (a backward on the forward's
  // own tiles) the kernel solves T below.
  const bool t_given = kDelta && f.ws_t != nullptr;
  if (t_given) {
    copy_tile_async<kThreads>(hT, kLdC, static_cast<const T*>(f.ws_t) + tile * C * C, C, C, C);
    cp_async_commit();
  }
  intra_store_qk<kWarps, Dk, kL2Norm>(qk_rows, sQ, sK, kLdK, sRq, sRk, C);
  __syncthreads();

  // ---- the state path's factors: gq by scale e^{G}, gk by e^{G_{C-1} - G} --
  {
    float part = 0.f;  // sum of the K_ path's gk . k (it lands on the last row's db)
#pragma unroll
    for (int j = 0; j < kNTk; ++j)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {  // elements 2 hr, 2 hr + 1: one row, adjacent columns
        const int e = 2 * hr, r = m0 + g + 8 * hr, col = n0k + 8 * j + i2;
        if (active) {
          const float down = kScalar ? __expf(sG[C - 1] - sG[r]) : 1.f, u = scale * up(r);
          gq[j][e] *= u;
          gq[j][e + 1] *= u;
          gk[j][e] *= down;
          gk[j][e + 1] *= down;
          // k as db's row sums below take it (the operand copy): the two
          // cancel in the reverse cumsum.
          if (r < L) {
            const float2 kx = operand_pair(sK, kLdK, r, col);
            part += gk[j][e] * kx.x + gk[j][e + 1] * kx.y;
          }
        }
      }
    part = warp_sum(part);
    if (lane == 0) sWarpPart[warp] = part;
  }

  auto lower_slabs = [&](auto&& body) { for_lower_slabs<kWarps>(nb, body); };
  auto all_slabs = [&](auto&& body) { for_all_slabs<kWarps>(nb, body); };
  // Element (j, e) of a 16 x 16 slab at (16 I, 16 J): row 16 I + g + 8 (e >> 1),
  // column 16 J + 8 j + i2 + (e & 1).

  if constexpr (kDelta) {
    // ---- KK = strict_lower(K K^T) with the decay (fp32) --------------------
    lower_slabs([&](int I, int J) {
      float acc[2][4] = {};
      warp_mm_16xn<T, false, false, 2>(acc, sK, kLdK, sK, kLdK, 16 * I, 16 * J, Dk);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = 16 * I + g + 8 * (e >> 1), s = 16 * J + 8 * j + i2 + (e & 1);
          fKK[t * kLdF + s] = s < t ? acc[j][e] * decay(t, s) : 0.f;
        }
    });
    __syncthreads();
    // ---- T = (I + diag(beta) KK)^{-1}: its diagonal blocks beside dA -------
    if (!t_given) intra_solve_t_diagonal<kMC>(fKK, kLdF, sBeta, C);
  }

  // ---- dA = dO V'^T (lower, scaled, decayed; zeros above) -------------------
  {
    const T* vp = kDelta ? sVp : sV;
    all_slabs([&](int I, int J) {
      float acc[2][4] = {};
      if (J <= I) warp_mm_16xn<T, false, false, 2>(acc, sDO, kLdV, vp, kLdV, 16 * I, 16 * J, Dv);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int t = 16 * I + g + 8 * (e >> 1), s = 16 * J + 8 * j + i2;
          const float x = s <= t ? acc[j][e] * scale * decay(t, s) : 0.f;
          const float y = s + 1 <= t ? acc[j][e + 1] * scale * decay(t, s + 1) : 0.f;
          *reinterpret_cast<uint32_t*>(hDA + t * kLdC + s) = pack2<T>(x, y);
        }
    });
  }
  if (t_given) cp_async_wait<0>();
  __syncthreads();
  // The L2 norm's backward takes the exact normalised rows (16-bit input times
  // the fp32 factor) in its row dots and dq, dk: the raw q and k rows go by
  // cp.async into the slots of dO and V' (dead from here), waited for before
  // the row sums. Read from global memory there instead, each thread's loads
  // stood in series behind its own dq, dk stores (they may alias): a sixth of
  // the kernel's stall samples (ncu source view, sixteenth session). This is
  // a second, L2-hot read of the rows QKRows loaded: they could not be stored
  // raw at intra_store_qk, where these two slots are still live (dA reads them).
  static_assert(Tr::kKTile <= Tr::kVTile, "raw q, k rows fit the dO and V' slots");
  T* sQx = sDO;
  T* sKx = sVp;
  if constexpr (kL2Norm) {
    copy_row_pair_async<kThreads, Dk>(sQx, sKx, kLdK, q_in, k_in, row, C, L);  // committed
  }
  if constexpr (kDelta)
    if (!t_given) intra_solve_t_blocks<kThreads>(hT, kLdC, fKK, kLdF, sBeta, nb);

  // ---- A path: gq += dA K, gk += dA^T Q ------------------------------------
  if (active) {
    warp_mm_16xn<T, false, true, kNTk>(gq, hDA, kLdC, sK, kLdK, m0, n0k, C);
    warp_mm_16xn<T, true, true, kNTk>(gk, hDA, kLdC, sQ, kLdK, m0, n0k, C);
  }

  if constexpr (kDelta) {
    // ---- T^T dU: dv = beta T^T dU; dbeta's T^T dU . v ----------------------
    if (active) {
      float dbp[2] = {0.f, 0.f};
      intra_store_dv<Dv, kNTv>(dbp, hT, kLdC, sDVp, sV, kLdV, sBeta, static_cast<T*>(a.dv), row, m0,
                               n0v, C, L, g, i2);
      // ---- T^T dW: gk += beta e^{G} T^T dW (into gx too); dbeta's . K^ ------
      float tw[kNTk][4] = {};
      warp_mm_16xn<T, true, true, kNTk>(tw, hT, kLdC, sDW, kLdK, m0, n0k, C);
#pragma unroll
      for (int j = 0; j < kNTk; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = erow(e), col = n0k + 8 * j + i2 + (e & 1);
          const float eb = up(r);
          const float gkh = sBeta[r] * eb * tw[j][e];
          gk[j][e] += gkh;
          gx[j][e] += gkh;
          dbp[e >> 1] += tw[j][e] * to_float(sK[r * kLdK + col]) * eb;
        }
      intra_store_row_sums(dbp, sDbA + part * kMC, m0, lane, g);
    }
    // ---- dT = beta_s (dV' V^T + dW K^T e^{G_s}), strictly lower ------------
    all_slabs([&](int I, int J) {
      float p1[2][4] = {}, p2[2][4] = {};
      if (J <= I) {
        warp_mm_16xn<T, false, false, 2>(p1, sDVp, kLdV, sV, kLdV, 16 * I, 16 * J, Dv);
        warp_mm_16xn<T, false, false, 2>(p2, sDW, kLdK, sK, kLdK, 16 * I, 16 * J, Dk);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int t = 16 * I + g + 8 * (e >> 1), s = 16 * J + 8 * j + i2;
          const float x = s < t ? sBeta[s] * (p1[j][e] + p2[j][e] * up(s)) : 0.f;
          const float y =
              s + 1 < t ? sBeta[s + 1] * (p1[j][e + 1] + p2[j][e + 1] * up(s + 1)) : 0.f;
          *reinterpret_cast<uint32_t*>(hDT + t * kLdC + s) = pack2<T>(x, y);
        }
    });
    __syncthreads();
    // ---- tmp = dT T^T ------------------------------------------------------
    all_slabs([&](int I, int J) {
      float acc[2][4] = {};
      warp_mm_16xn<T, false, false, 2>(acc, hDT, kLdC, hT, kLdC, 16 * I, 16 * J, C);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int t = 16 * I + g + 8 * (e >> 1), s = 16 * J + 8 * j + i2;
          *reinterpret_cast<uint32_t*>(hTmp + t * kLdC + s) = pack2<T>(acc[j][e], acc[j][e + 1]);
        }
    });
    __syncthreads();
    // ---- dMm = -strict_lower(T^T tmp); M' = diag(beta) dMm with the decay
    // (masked by selection: above the diagonal e^{G_t - G_s} may overflow) ---
    all_slabs([&](int I, int J) {
      float acc[2][4] = {};
      if (J <= I) warp_mm_16xn<T, true, true, 2>(acc, hT, kLdC, hTmp, kLdC, 16 * I, 16 * J, C);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int t = 16 * I + g + 8 * (e >> 1), s = 16 * J + 8 * j + i2;
          const float m0v = s < t ? -acc[j][e] : 0.f, m1v = s + 1 < t ? -acc[j][e + 1] : 0.f;
          fDM[t * kLdF + s] = m0v;
          fDM[t * kLdF + s + 1] = m1v;
          *reinterpret_cast<uint32_t*>(hM + t * kLdC + s) =
              pack2<T>(s < t ? sBeta[t] * m0v * decay(t, s) : 0.f,
                       s + 1 < t ? sBeta[t] * m1v * decay(t, s + 1) : 0.f);
        }
    });
    if constexpr (kL2Norm) cp_async_wait<0>();  // the raw q, k rows
    __syncthreads();
    // dbeta's dMm . KK (a warp per row).
    for (int t = warp; t < C; t += kWarps) {
      float acc = 0.f;
      for (int s = lane; s < t; s += 32) acc += fDM[t * kLdF + s] * fKK[t * kLdF + s];
      acc = warp_sum(acc);
      if (lane == 0) sDbM[t] = acc;
    }
    // ---- kh = M' K (gk and gx), kt = M'^T K (gk) ----------------------------
    if (active) {
      float kh[kNTk][4] = {};
      warp_mm_16xn<T, false, true, kNTk>(kh, hM, kLdC, sK, kLdK, m0, n0k, C);
#pragma unroll
      for (int j = 0; j < kNTk; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          gk[j][e] += kh[j][e];
          gx[j][e] += kh[j][e];
        }
      warp_mm_16xn<T, true, true, kNTk>(gk, hM, kLdC, sK, kLdK, m0, n0k, C);
    }
  }

  // ---- row sums: q . gq, k . gk (exact q, k: the L2 norm's backward) and
  // db = q . gq - k . gk + 2 k . gx from the operand copies of q and k, the
  // values the products used: each in-chunk pair's two entries then cancel in
  // the reverse cumsum as in exact arithmetic (test_chunk_bwd_model,
  // db_from_operands; exact q, k left their rounding in dg) ----------------
  auto q_exact = [&](int r, int col) { return exact_pair_shared(sQx, kLdK, sRq, r, col); };
  auto k_exact = [&](int r, int col) { return exact_pair_shared(sKx, kLdK, sRk, r, col); };
  if constexpr (kL2Norm && !kDelta) {
    cp_async_wait<0>();  // the raw q, k rows
    __syncthreads();
  }
  // One pass over the slab, each pair read once: with the norm the operand
  // copies are the exact rows rounded (intra_store_qk rounds the same
  // products), without it the copies are the exact rows. The five sums keep
  // slab_row_dots_by's order of terms (formerly five passes, three of them
  // over the operand copies: the epilogue's shared-memory reads were its
  // stall).
  if (active) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = m0 + g + 8 * hr;
      float qg = 0.f, kg = 0.f, qo = 0.f, ko = 0.f, kx = 0.f;
      if (r < L) {
#pragma unroll
        for (int j = 0; j < kNTk; ++j) {
          const int col = n0k + 8 * j + i2, e = 2 * hr;
          float2 qc, kc;
          if constexpr (kL2Norm) {
            const float2 qe = q_exact(r, col), ke = k_exact(r, col);
            qg += qe.x * gq[j][e] + qe.y * gq[j][e + 1];
            kg += ke.x * gk[j][e] + ke.y * gk[j][e + 1];
            qc = unpack2<T>(pack2<T>(qe.x, qe.y));
            kc = unpack2<T>(pack2<T>(ke.x, ke.y));
          } else {
            qc = operand_pair(sQ, kLdK, r, col);
            kc = operand_pair(sK, kLdK, r, col);
          }
          qo += qc.x * gq[j][e] + qc.y * gq[j][e + 1];
          ko += kc.x * gk[j][e] + kc.y * gk[j][e + 1];
          kx += kc.x * gx[j][e] + kc.y * gx[j][e + 1];
        }
      }
      qg = quad_sum(qg);
      kg = quad_sum(kg);
      qo = quad_sum(qo);
      ko = quad_sum(ko);
      kx = quad_sum(kx);
      if ((lane & 3) == 0) {
        sQG[part * kMC + r] = qg;  // n . dn (without the norm unused: dq, dk are gq, gk)
        sKG[part * kMC + r] = kg;
        sDb[part * kMC + r] = qo - ko + 2.f * kx;
      }
    }
  }
  __syncthreads();

  // ---- dq, dk through the L2 norm --------------------------------------------
  if (active)
    slab_store_dq_dk<Dk, kNTk, kMC, kParts, kL2Norm>(gq, gk, static_cast<T*>(a.dq),
                                                     static_cast<T*>(a.dk), q_exact, k_exact, sRq,
                                                     sRk, sQG, sKG, row, m0, n0k, L);
  if constexpr (kDelta) {
    if (tid < L) {
      float dbeta = sDbM[tid];
      for (int p = 0; p < kParts; ++p) dbeta += sDbA[p * kMC + tid];
      static_cast<T*>(a.dbeta)[row(tid)] = from_float<T>(dbeta);
    }
  }
  // ---- dg: the rows' db, the last row also the K_ path's column sums and
  // dgamma . gamma, reverse-cumulated -------------------------------------
  if constexpr (kScalar) {
    if (tid == 0) {
      // The decay's gradient dgamma . gamma: S_c . dS_{c+1} times e^{G_{C-1}}.
      float dgs = 0.f;
      for (int w = 0; w < kWarps; ++w) dgs += sDg[w];
      float last = dgs * __expf(sG[C - 1]);
      for (int w = 0; w < kWarps; ++w) last += sWarpPart[w];
      float run = 0.f;
      for (int t = L - 1; t >= 0; --t) {
        for (int p = 0; p < kParts; ++p) run += sDb[p * kMC + t];
        if (t == L - 1) run += last;
        a.dg[row(t)] = run;
      }
    }
  }
}

}  // namespace statescan::cuda::detail
