// chunk_intra_grad_vector_kernel (backward b11v): the per-chunk gradients
// after chunk_state_products_kernel for 16-bit inputs with a vector
// (per-dimension) gate: GLA and KDA. The form of chunk_intra_grad_kernel
// (16-bit operands in shared memory, the [C, Dk] accumulators gq, gk, gx in
// registers, one 16-row x Dk/4-column slab per warp for the whole item);
// what the vector gate adds is the pairwise decay Gamma_tsd = e^{b_td - b_sd},
// which does not factor out of a sum over d.
//
// Reference rows. b (the cumsum of the log gates, fp32) does not increase
// along the chunk. With rho(J) the last row of 16-row block J (and
// b_rho(-1) = 0, the chunk's start), two 16-bit copies are scaled once:
//   X~_s = x_s e^{b_rho(J) - b_s}     (s in block J: factor <= 1)
//   Y~_t = y_t e^{b_t - b_rho(I-1)}   (t in block I: factor <= 1)
// and every block pair of a decayed product becomes a tensor-core product
// with an fp32 factor on its output (in registers):
//   out_f[t] (t in I)  += e^{b_t - b_rho(J)}     (M[I, J] X~_J)[t]
//   out_b[s] (s in J)  += e^{b_rho(I-1) - b_s}   (M[I, J]^T Y~_I)[s]
// For J < I both output factors are <= 1. On the diagonal (I = J) they are
// >= 1, up to e^{drop} with drop = b_rho(I-1) - b_rho(I), the gate's decay
// over the block; the tensor-core form is used there while drop <= 4 for
// every block and dimension of the item (kMaxDrop: the f16 range, and the
// gate gradient's precision, which the CPU model in test_chunk_bwd_model
// bounds). An item with a larger drop takes the diagonal blocks exactly on
// the CUDA cores instead (one exponential per term), decided once per item.
// The key gram KK (delta rule) contracts over d, so there the
// factor e^{b_rho(I-1) - b_rho(J)} (<= 1, J < I) scales the A operand per
// dimension (warp_mm_16xn_xscaled), on the diagonal too within the same
// bound (the factor is then e^{drop} >= 1: A operand k_t e^{b_t - b_rho(I)}).
//
// Shared memory is the scalar kernel's less two fp32 C x C arrays plus b:
// the dead operands take the scaled copies (dO, V' after dA; q after the A
// path) and the fp32 db (q, dW). 202 KB at D = 128, one block per SM.
//   grid (items in the batch), 512 threads.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/chunk_intra_grad.cuh"
#include "kernels/cuda/warp_mma.cuh"

namespace statescan::cuda::detail {

template <typename T, int Dk, int Dv>
struct IntraVecTraits {
  static_assert(Dk == Dv, "slots are reused across the [C, Dk] and [C, Dv] roles");
  static constexpr int kMaxChunk = 64, kThreads = 512, kWarps = 16, kParts = kWarps / 4;
  static constexpr int kLd = Dk + 8, kLdC = kMaxChunk + 8;  // 16-bit pitches
  static constexpr int kLdB = Dk + 4, kLdF = kMaxChunk + 4;  // fp32 pitches
  static constexpr size_t kTile = sizeof(T) * kMaxChunk * kLd;
  static constexpr size_t kCTile = sizeof(T) * kMaxChunk * kLdC;
  static constexpr size_t kBTile = sizeof(float) * kMaxChunk * kLdB;
  static constexpr size_t kFTile = sizeof(float) * kMaxChunk * kLdF;
  // q and dW first: together they later hold the fp32 db.
  static constexpr size_t kOffQ = 0, kOffDW = kOffQ + kTile, kOffV = kOffDW + kTile;
  static constexpr size_t kOffDVp = kOffV + kTile, kOffK = kOffDVp + kTile;
  static constexpr size_t kOffDO = kOffK + kTile, kOffVp = kOffDO + kTile;
  static constexpr size_t kOffB = kOffVp + kTile, kOffHT = kOffB + kBTile;
  static constexpr size_t kOffHA = kOffHT + kCTile, kOffHD = kOffHA + kCTile;
  static constexpr size_t kOffFKK = kOffHD + kCTile, kOffRows = kOffFKK + kFTile;
  // beta, rq, rk; [kParts][C] dbeta (T^T dU . v + T^T dW . K^); [4][C] dbeta
  // (dMm . KK per column block); [kParts][C] q . gq, k . gk; [4][Dk] K_
  // column sums.
  static constexpr int kRowFloats = 3 * kMaxChunk + kParts * kMaxChunk + 4 * kMaxChunk +
                                    2 * kParts * kMaxChunk + 4 * Dk;
  static constexpr size_t kBytes = kOffRows + sizeof(float) * kRowFloats;
  static_assert(2 * kTile >= kBTile, "q and dW hold the fp32 db");
  static_assert(kBytes <= 227 * 1024,
                "chunk_intra_grad_vector_kernel exceeds Hopper shared memory");
  static_assert(Dk % (16 * kParts) == 0, "each warp takes a column quarter in n8 pairs");
};

template <Rule kRule, typename T, int Dk, int Dv, bool kL2Norm, int kChunk>
__global__ void __launch_bounds__(512, 1)
    chunk_intra_grad_vector_kernel(const __grid_constant__ BackwardArgs a) {
  static_assert(kChunk == 16 || kChunk == 32 || kChunk == 64, "chunk in {16, 32, 64}");
  static_assert(!std::is_same_v<T, float>, "16-bit inputs only");
  using Tr = IntraVecTraits<T, Dk, Dv>;
  using SpTr = StateProductTraits<T, Dk, Dv>;
  constexpr bool kDelta = kRule == Rule::delta;
  constexpr int kLd = Tr::kLd, kLdC = Tr::kLdC, kLdB = Tr::kLdB, kLdF = Tr::kLdF;
  constexpr int kMC = Tr::kMaxChunk, kWarps = Tr::kWarps, kThreads = Tr::kThreads;
  constexpr int kParts = Tr::kParts, kNT = Dk / (8 * kParts);  // n8 tiles of a warp's slab
  // The largest per-block decay (in e-folds) the diagonal products take: f16's
  // range needs x e^{-drop} to stay normal; bf16's would allow ~60, but the
  // gate gradient would not (tests/test_chunk_bwd_model.cpp: db takes each
  // pair twice through differently rounded operands, and the scaled diagonal
  // operands' rounding grows GLA's dg error from ~3e-3 to 1.9e-2 at a drop of
  // 10 e-folds and 1.7e-1 at 45, where the exact diagonal keeps ~2e-3).
  constexpr float kMaxDrop = 4.f;
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  auto at = [&](size_t off) { return smem_bytes + off; };
  T* sQ = reinterpret_cast<T*>(at(Tr::kOffQ));  // q; Y~(q) after P4; K^ after P6
  T* sDW = reinterpret_cast<T*>(at(Tr::kOffDW));
  T* sV = reinterpret_cast<T*>(at(Tr::kOffV));
  T* sDVp = reinterpret_cast<T*>(at(Tr::kOffDVp));
  T* sK = reinterpret_cast<T*>(at(Tr::kOffK));
  T* sDO = reinterpret_cast<T*>(at(Tr::kOffDO));  // dO; X~(k) after P1
  T* sVp = reinterpret_cast<T*>(at(Tr::kOffVp));  // V'; Y~(k) after P1
  float* sB = reinterpret_cast<float*>(at(Tr::kOffB));
  T* hT = reinterpret_cast<T*>(at(Tr::kOffHT));
  T* hA = reinterpret_cast<T*>(at(Tr::kOffHA));  // dA; tmp = dT T^T after P8
  T* hD = reinterpret_cast<T*>(at(Tr::kOffHD));  // dT; M' = diag(beta) dMm after P9
  float* fKK = reinterpret_cast<float*>(at(Tr::kOffFKK));
  float* sDbuf = reinterpret_cast<float*>(at(Tr::kOffQ));  // db, [C][kLdB], after P10
  float* sBeta = reinterpret_cast<float*>(at(Tr::kOffRows));
  float* sRq = sBeta + kMC;
  float* sRk = sRq + kMC;
  float* sDbA = sRk + kMC;            // [kParts][C]
  float* sDbM = sDbA + kParts * kMC;  // [4][C]
  float* sQG = sDbM + 4 * kMC;        // [kParts][C]
  float* sKG = sQG + kParts * kMC;    // [kParts][C]
  float* sColK = sKG + kParts * kMC;  // [4][Dk]
  T* sXk = sDO;
  T* sYk = sVp;
  T* sYq = sQ;
  T* sKh = sQ;

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
  const float* sp = a.ws_sp + static_cast<int64_t>(blockIdx.x) * SpTr::kOutFloats;
  auto row = [&](int t) { return (token0 + t) * H + h; };
  const T* q_in = static_cast<const T*>(f.q);
  const T* k_in = static_cast<const T*>(f.k);
  const T* beta_in = static_cast<const T*>(f.beta);
  auto bv = [&](int t, int d) { return sB[t * kLdB + d]; };
  // b at block I's last row; 0 before the chunk (I = -1).
  auto bref = [&](int I, int d) { return I >= 0 ? sB[(16 * I + 15) * kLdB + d] : 0.f; };

  // ---- P0: load; b = per-column cumsum of the log gates ---------------------
  copy_row_pair_async<kThreads, Dv>(sV, sDO, kLd, static_cast<const T*>(f.v),
                                    static_cast<const T*>(a.d_o), row, C, L);
  intra_load_qk<kWarps, Dk, kL2Norm>(sQ, sK, kLd, sRq, sRk, q_in, k_in, row, C, L);
  for (int idx = tid; idx < C * Dk / 4; idx += kThreads) {
    const int t = idx / (Dk / 4), d = (idx % (Dk / 4)) * 4;
    const float4 x = t < L ? load4(f.g + row(t) * Dk + d) : make_float4(0.f, 0.f, 0.f, 0.f);
    *reinterpret_cast<float4*>(sB + t * kLdB + d) = x;
  }
  if (tid < C) sBeta[tid] = kDelta && tid < L ? to_float(beta_in[row(tid)]) : 0.f;
  if constexpr (kDelta)
    intra_load_state_products<kThreads, C, Dk, Dv>(sVp, sDVp, sDW, kLd, kLd, sp);
  __syncthreads();
  if (tid < Dk) {
    float run = 0.f;
    for (int t = 0; t < C; ++t) {
      run += sB[t * kLdB + tid];
      sB[t * kLdB + tid] = run;
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  bool within = true;
  for (int task = tid; task < nb * Dk; task += kThreads) {
    const int I = task / Dk, d = task % Dk;
    within = within && bref(I - 1, d) - bref(I, d) <= kMaxDrop;
  }
  const bool fast = __syncthreads_and(within);  // every block's diagonal on the tensor cores

  const int rt = warp & 3, part = warp >> 2;
  const bool active = rt < nb;
  const int m0 = 16 * rt, n0 = part * (Dk / kParts);
  // Element (j, e) of a slab: row m0 + g + 8 (e >> 1), column n0 + 8 j + i2 + (e & 1).
  auto erow = [&](int e) { return m0 + g + 8 * (e >> 1); };
  auto ecol = [&](int j, int e) { return n0 + 8 * j + i2 + (e & 1); };

  // ---- P1: accumulators from the state products; dA; the gram's diagonal ---
  float gq[kNT][4], gk[kNT][4], gx[kNT][4];
#pragma unroll
  for (int j = 0; j < kNT; ++j)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {  // elements 2 hr, 2 hr + 1: one row, adjacent columns
      const int e = 2 * hr, r = m0 + g + 8 * hr, col = n0 + 8 * j + i2;
      gq[j][e] = gq[j][e + 1] = gk[j][e] = gk[j][e + 1] = 0.f;
      gx[j][e] = gx[j][e + 1] = 0.f;
      if (active) {
        const float2 q2 = load_pair(sp + SpTr::kOffGq + r * Dk + col);
        const float2 k2 = load_pair(sp + SpTr::kOffGk + r * Dk + col);
        const float b0 = bv(r, col), b1 = bv(r, col + 1);
        gq[j][e] = q2.x * scale * __expf(b0);
        gq[j][e + 1] = q2.y * scale * __expf(b1);
        gk[j][e] = k2.x * __expf(bv(C - 1, col) - b0);
        gk[j][e + 1] = k2.y * __expf(bv(C - 1, col + 1) - b1);
      }
    }
  if (active) {
    // Column sums of the K_ path's gk . k over the slab's rows (k's operand
    // copy, as db takes it: the two cancel in the reverse cumsum); they land
    // on row L-1.
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = m0 + g + 8 * hr;
        if (r < L) {
          const float2 k2 = operand_pair(sK, kLd, r, n0 + 8 * j + i2);
          s0 += gk[j][2 * hr] * k2.x;
          s1 += gk[j][2 * hr + 1] * k2.y;
        }
      }
#pragma unroll
      for (int m = 4; m < 32; m *= 2) {
        s0 += __shfl_xor_sync(0xffffffffu, s0, m);
        s1 += __shfl_xor_sync(0xffffffffu, s1, m);
      }
      if (g == 0) {
        sColK[rt * Dk + n0 + 8 * j + i2] = s0;
        sColK[rt * Dk + n0 + 8 * j + i2 + 1] = s1;
      }
    }
  }
  // dA = dO V'^T (V without the delta rule), scaled, zero above the diagonal;
  // its decay is applied in the path products.
  {
    const T* vp = kDelta ? sVp : sV;
    for_all_slabs<kWarps>(nb, [&](int I, int J) {
      float acc[2][4] = {};
      if (J <= I) warp_mm_16xn<T, false, false, 2>(acc, sDO, kLd, vp, kLd, 16 * I, 16 * J, Dv);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int t = 16 * I + g + 8 * hr, s = 16 * J + 8 * j + i2;
          const float x = s <= t ? acc[j][2 * hr] * scale : 0.f;
          const float y = s + 1 <= t ? acc[j][2 * hr + 1] * scale : 0.f;
          *reinterpret_cast<uint32_t*>(hA + t * kLdC + s) = pack2<T>(x, y);
        }
    });
  }
  if (kDelta && !fast) {
    // KK's diagonal blocks exactly (gates too strong for the tensor-core
    // form): a warp per pair (t, s), s < t in one block, lanes over d.
    constexpr int kPer = Dk / 32;
    for (int pidx = warp; pidx < nb * 120; pidx += kWarps) {
      int u = 1, v = pidx % 120;
      while (v >= u) v -= u++;
      const int t = 16 * (pidx / 120) + u, s = t - u + v;
      float acc = 0.f;
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        const int d = lane + 32 * e;
        acc += to_float(sK[t * kLd + d]) * to_float(sK[s * kLd + d]) * __expf(bv(t, d) - bv(s, d));
      }
      acc = warp_sum(acc);
      if (lane == 0) fKK[t * kLdF + s] = acc;
    }
  }
  __syncthreads();

  // ---- P2: X~(k) over dO, Y~(k) over V' (both dead after dA) ----------------
  for (int idx = tid; idx < C * Dk / 2; idx += kThreads) {
    const int t = idx / (Dk / 2), d = 2 * (idx % (Dk / 2)), J = t / 16;
    const float2 k2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(sK + t * kLd + d));
    const float b0 = bv(t, d), b1 = bv(t, d + 1);
    *reinterpret_cast<uint32_t*>(sXk + t * kLd + d) =
        pack2<T>(k2.x * __expf(bref(J, d) - b0), k2.y * __expf(bref(J, d + 1) - b1));
    if constexpr (kDelta)
      *reinterpret_cast<uint32_t*>(sYk + t * kLd + d) =
          pack2<T>(k2.x * __expf(b0 - bref(J - 1, d)), k2.y * __expf(b1 - bref(J - 1, d + 1)));
  }
  __syncthreads();

  // Exact diagonal block of a decayed path (items whose gates drop too fast
  // for the tensor-core form): for the warp's slab elements (t, d) of block rt,
  //   out_f[t,d] += sum_{s <= t} M[t,s] e^{b_td - b_sd} xf[s,d]
  //   out_b[t,d] += sum_{u >= t} M[u,t] e^{b_ud - b_td} xb[u,d]
  // (s, u in the same block), one exponential per term.
  auto exact_diagonal = [&](const T* M, const T* xf, const T* xb, auto&& add_f, auto&& add_b) {
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = erow(e), col = ecol(j, e), rr = r - m0;
        const float br = bv(r, col);
        float sf = 0.f, sb = 0.f;
#pragma unroll 1
        for (int u = 0; u < 16; ++u) {
          const int o = m0 + u;
          const float bo = bv(o, col);
          if (u <= rr)
            sf += to_float(M[r * kLdC + o]) * __expf(br - bo) * to_float(xf[o * kLd + col]);
          if (u >= rr)
            sb += to_float(M[o * kLdC + r]) * __expf(bo - br) * to_float(xb[o * kLd + col]);
        }
        add_f(j, e, sf);
        add_b(j, e, sb);
      }
  };
  // The block pairs of a decayed path on the tensor cores (module comment):
  // rows of the warp's block rt as targets (out_f, J <= rt) and as sources
  // (out_b, I >= rt); the diagonal pair only when `fast`.
  auto pair_products = [&](const T* M, const T* xf_scaled, const T* xb_scaled, auto&& add_f,
                           auto&& add_b) {
    for (int J = 0; J < (fast ? rt + 1 : rt); ++J) {
      float p[kNT][4] = {};
      warp_mm_16xn<T, false, true, kNT>(p, M + 16 * J, kLdC, xf_scaled + 16 * J * kLd, kLd, m0,
                                        n0, 16);
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = ecol(j, e);
          add_f(j, e, __expf(bv(erow(e), col) - bref(J, col)) * p[j][e]);
        }
    }
    for (int I = fast ? rt : rt + 1; I < nb; ++I) {
      float p[kNT][4] = {};
      warp_mm_16xn<T, true, true, kNT>(p, M + 16 * I * kLdC, kLdC, xb_scaled + 16 * I * kLd, kLd,
                                       m0, n0, 16);
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = ecol(j, e);
          add_b(j, e, __expf(bref(I - 1, col) - bv(erow(e), col)) * p[j][e]);
        }
    }
  };
  auto add_gq = [&](int j, int e, float x) { gq[j][e] += x; };
  auto add_gk = [&](int j, int e, float x) { gk[j][e] += x; };
  auto add_gk_gx = [&](int j, int e, float x) {
    gk[j][e] += x;
    gx[j][e] += x;
  };

  // ---- P3: KK's blocks on the tensor cores (the diagonal ones when `fast`:
  // there the factor e^{b_rho(I-1) - b_rho(I)} >= 1 makes the A operand
  // k_t e^{b_t - b_rho(I)}, within the drop bound); the A path's exact diagonal
  if constexpr (kDelta) {
    const int slabs = fast ? nb * (nb + 1) / 2 : nb * (nb - 1) / 2;
    for (int sl = warp; sl < slabs; sl += kWarps) {
      int I, J;
      if (fast) {  // J <= I
        I = 0;
        J = sl;
        while (J > I) J -= ++I;
      } else {  // J < I
        I = 1;
        J = sl;
        while (J >= I) J -= I++;
      }
      float acc[2][4] = {};
      warp_mm_16xn_xscaled<T, false, 2>(acc, sYk, kLd, sXk, kLd, 16 * I, 16 * J, Dk, [&](int d) {
        return __expf(bref(I - 1, d) - bref(J, d));
      });
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = 16 * I + g + 8 * (e >> 1), s = 16 * J + 8 * j + i2 + (e & 1);
          if (s < t) fKK[t * kLdF + s] = acc[j][e];
        }
    }
  }
  if (!fast && active) exact_diagonal(hA, sK, sQ, add_gq, add_gk);
  __syncthreads();

  // ---- P4: T's diagonal blocks (threads 0 .. C-1) beside Y~(q) in place of q
  // (the rest); then T's other blocks (all threads) ------------------------
  if constexpr (kDelta) intra_solve_t_diagonal<kMC>(fKK, kLdF, sBeta, C);
  {
    const int first = kDelta ? kMC : 0;
    if (tid >= first)
      for (int idx = tid - first; idx < C * Dk / 2; idx += kThreads - first) {
        const int t = idx / (Dk / 2), d = 2 * (idx % (Dk / 2)), I = t / 16;
        const float2 q2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(sQ + t * kLd + d));
        *reinterpret_cast<uint32_t*>(sYq + t * kLd + d) =
            pack2<T>(q2.x * __expf(bv(t, d) - bref(I - 1, d)),
                     q2.y * __expf(bv(t, d + 1) - bref(I - 1, d + 1)));
      }
  }
  __syncthreads();
  if constexpr (kDelta) intra_solve_t_blocks<kThreads>(hT, kLdC, fKK, kLdF, sBeta, nb);

  // ---- P5: the A path; T^T dU and T^T dW (delta) -----------------------------
  if (active) pair_products(hA, sXk, sYq, add_gq, add_gk);
  if constexpr (kDelta) {
    if (active) {
      float dbp[2] = {0.f, 0.f};
      intra_store_dv<Dv, kNT>(dbp, hT, kLdC, sDVp, sV, kLd, sBeta, static_cast<T*>(a.dv), row, m0,
                              n0, C, L, g, i2);
      // gk += beta e^{b} T^T dW (gx too); dbeta's T^T dW . K^ (K^ = k e^{b}).
      float tw[kNT][4] = {};
      warp_mm_16xn<T, true, true, kNT>(tw, hT, kLdC, sDW, kLd, m0, n0, C);
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = erow(e), col = ecol(j, e);
          const float eb = __expf(bv(r, col));
          add_gk_gx(j, e, sBeta[r] * eb * tw[j][e]);
          dbp[e >> 1] += tw[j][e] * to_float(sK[r * kLd + col]) * eb;
        }
      intra_store_row_sums(dbp, sDbA + part * kMC, m0, lane, g);
    }
  } else {
    // Additive rule: dv = dV'.
    T* dv_out = static_cast<T*>(a.dv);
    for (int idx = tid; idx < L * Dv / 4; idx += kThreads) {
      const int t = idx / (Dv / 4), j = (idx % (Dv / 4)) * 4;
      store4(dv_out + row(t) * Dv + j, load4(sp + SpTr::kOffDVp + t * Dv + j));
    }
  }
  __syncthreads();

  // The raw q and k rows (the exact rows of P11 and P12: 16-bit inputs, times
  // the row factors there) by cp.async into T's and dA's tiles (q) and KK's
  // (k) once those are dead, waited for before P11: read from global memory
  // there instead, P12's loads stood in series behind its own dq, dk stores
  // (they may alias), as in chunk_intra_grad_kernel, where they were a sixth
  // of the stall samples (PERF_NOTES, sixteenth session).
  static_assert(Tr::kTile <= 2 * Tr::kCTile && Tr::kTile <= Tr::kFTile &&
                    Tr::kOffHA == Tr::kOffHT + Tr::kCTile,
                "raw q fits T's and dA's tiles, raw k KK's");
  T* sQx = hT;
  T* sKx = reinterpret_cast<T*>(fKK);
  auto load_raw_qk = [&] {  // committed by copy_row_pair_async
    copy_row_pair_async<kThreads, Dk>(sQx, sKx, kLd, q_in, k_in, row, C, L);
  };
  if constexpr (kDelta) {
    // ---- P6: K^ = k e^{b} in place of Y~(q) ----------------------------------
    for (int idx = tid; idx < C * Dk / 2; idx += kThreads) {
      const int t = idx / (Dk / 2), d = 2 * (idx % (Dk / 2));
      const float2 k2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(sK + t * kLd + d));
      *reinterpret_cast<uint32_t*>(sKh + t * kLd + d) =
          pack2<T>(k2.x * __expf(bv(t, d)), k2.y * __expf(bv(t, d + 1)));
    }
    __syncthreads();
    // ---- P7: dT = beta_s (dV' V^T + dW K^^T), strictly lower -----------------
    for_all_slabs<kWarps>(nb, [&](int I, int J) {
      float p1[2][4] = {}, p2[2][4] = {};
      if (J <= I) {
        warp_mm_16xn<T, false, false, 2>(p1, sDVp, kLd, sV, kLd, 16 * I, 16 * J, Dv);
        warp_mm_16xn<T, false, false, 2>(p2, sDW, kLd, sKh, kLd, 16 * I, 16 * J, Dk);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int t = 16 * I + g + 8 * hr, s = 16 * J + 8 * j + i2;
          const float x = s < t ? sBeta[s] * (p1[j][2 * hr] + p2[j][2 * hr]) : 0.f;
          const float y = s + 1 < t ? sBeta[s + 1] * (p1[j][2 * hr + 1] + p2[j][2 * hr + 1]) : 0.f;
          *reinterpret_cast<uint32_t*>(hD + t * kLdC + s) = pack2<T>(x, y);
        }
    });
    __syncthreads();
    // ---- P8: tmp = dT T^T (over dA) ------------------------------------------
    for_all_slabs<kWarps>(nb, [&](int I, int J) {
      float acc[2][4] = {};
      warp_mm_16xn<T, false, false, 2>(acc, hD, kLdC, hT, kLdC, 16 * I, 16 * J, C);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int t = 16 * I + g + 8 * hr, s = 16 * J + 8 * j + i2;
          *reinterpret_cast<uint32_t*>(hA + t * kLdC + s) =
              pack2<T>(acc[j][2 * hr], acc[j][2 * hr + 1]);
        }
    });
    __syncthreads();
    // ---- P9: dMm = -strict_lower(T^T tmp); M' = diag(beta) dMm (over dT);
    // dbeta's dMm . KK per (row, column block) ---------------------------------
    for_all_slabs<kWarps>(nb, [&](int I, int J) {
      float acc[2][4] = {};
      if (J <= I) warp_mm_16xn<T, true, true, 2>(acc, hT, kLdC, hA, kLdC, 16 * I, 16 * J, C);
      float part[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int t = 16 * I + g + 8 * hr, s = 16 * J + 8 * j + i2;
          const float m0v = s < t ? -acc[j][2 * hr] : 0.f;
          const float m1v = s + 1 < t ? -acc[j][2 * hr + 1] : 0.f;
          if (s < t) part[hr] += m0v * fKK[t * kLdF + s];
          if (s + 1 < t) part[hr] += m1v * fKK[t * kLdF + s + 1];
          *reinterpret_cast<uint32_t*>(hD + t * kLdC + s) =
              pack2<T>(sBeta[t] * m0v, sBeta[t] * m1v);
        }
      part[0] = quad_sum(part[0]);
      part[1] = quad_sum(part[1]);
      if ((lane & 3) == 0) {
        sDbM[J * kMC + 16 * I + g] = part[0];
        sDbM[J * kMC + 16 * I + g + 8] = part[1];
      }
    });
    __syncthreads();
    load_raw_qk();  // T, dA's tile and KK are dead
    // ---- P10: kh = (M' o Gamma) K (into gk and gx), kt = (M' o Gamma)^T K ----
    if (active) {
      pair_products(hD, sXk, sYk, add_gk_gx, add_gk);
      if (!fast) exact_diagonal(hD, sK, sK, add_gk_gx, add_gk);
    }
  } else {
    load_raw_qk();  // dA's tile is dead (P5's barrier); T and KK are unused
  }
  cp_async_wait<0>();  // the raw q, k rows
  __syncthreads();     // and Y~(q) (P5's operand) is read; db takes its place below

  // The exact normalised q and k: the raw rows in shared memory by the row factors.
  auto q_exact = [&](int r, int col) { return exact_pair_shared(sQx, kLd, sRq, r, col); };
  auto k_exact = [&](int r, int col) { return exact_pair_shared(sKx, kLd, sRk, r, col); };
  // ---- P11: db = gq q - gk k + 2 gx k per element (fp32, over q and dW),
  // with q and k as their 16-bit operand copies (each in-chunk pair's two
  // entries then cancel in the reverse cumsum; q's copy, overwritten since P4,
  // is re-rounded from the exact value as P0 rounded it); the exact rows'
  // dots for the L2 norm ------------------------------------------------------
  if (active) {
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = m0 + g + 8 * hr, col = n0 + 8 * j + i2;
        if (r < L) {
          const float2 qe = q_exact(r, col);
          const float2 q2 = unpack2<T>(pack2<T>(qe.x, qe.y));
          const float2 k2 = operand_pair(sK, kLd, r, col);
          const int e = 2 * hr;
          sDbuf[r * kLdB + col] =
              gq[j][e] * q2.x - gk[j][e] * k2.x + 2.f * gx[j][e] * k2.x;
          sDbuf[r * kLdB + col + 1] =
              gq[j][e + 1] * q2.y - gk[j][e + 1] * k2.y + 2.f * gx[j][e + 1] * k2.y;
        }
      }
    float qg[2], kg[2];
    slab_row_dots_by(qg, gq, m0, n0, L, q_exact);
    slab_row_dots_by(kg, gk, m0, n0, L, k_exact);
    if ((lane & 3) == 0) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        sQG[part * kMC + m0 + g + 8 * hr] = qg[hr];
        sKG[part * kMC + m0 + g + 8 * hr] = kg[hr];
      }
    }
  }
  __syncthreads();

  // ---- P12: dq, dk; dbeta; dg = reverse cumsum of db per column, row L-1
  // also taking the K_ column sums and dgamma e^{b_{C-1}} -------------------
  if (active)
    slab_store_dq_dk<Dk, kNT, kMC, kParts, kL2Norm>(gq, gk, static_cast<T*>(a.dq),
                                                    static_cast<T*>(a.dk), q_exact, k_exact, sRq,
                                                    sRk, sQG, sKG, row, m0, n0, L);
  if constexpr (kDelta) {
    if (tid < L) {
      float dbeta = 0.f;
      for (int p = 0; p < kParts; ++p) dbeta += sDbA[p * kMC + tid];
      for (int J = 0; J < nb; ++J) dbeta += sDbM[J * kMC + tid];
      static_cast<T*>(a.dbeta)[row(tid)] = from_float<T>(dbeta);
    }
  }
  if (tid < Dk) {
    const int d = tid;
    float last = sp[SpTr::kOffDgamma + d] * __expf(bv(C - 1, d));
    for (int r = 0; r < nb; ++r) last += sColK[r * Dk + d];
    float run = last;
    for (int t = L - 1; t >= 0; --t) {
      run += sDbuf[t * kLdB + d];
      a.dg[row(t) * Dk + d] = run;
    }
  }
}

}  // namespace statescan::cuda::detail
