// ns_cluster_kernel: Muon's Newton-Schulz steps of a bf16 LaCT layer, one
// cluster per matrix (lact_ns_cluster.cuh says what and why).
#include <algorithm>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/cuda/cluster_copy.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/lact_ns_cluster.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/warp_mma.cuh"

namespace statescan::cuda::lact_detail {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

__device__ __forceinline__ void store_pair(__nv_bfloat16* base, int64_t at, uint32_t v) {
  *reinterpret_cast<uint32_t*>(base + at) = v;
}

// acc (this warp's 16 rows x 8 kT columns of the 32 x m output block) +=
// one stage: the A operand's kKc columns from k0 (hi at a_row + k0, lo a_plane
// further; a_row already at this lane's ldmatrix row) times the stage's
// streamed operand (this lane's plane already added to `stage`):
//   kBt:  a gram tile, B^T stored [col][k], rows kKc + kPad apart;
//   !kBt: a row tile, B stored [k][col], rows m + kPad apart.
// Three products per 16 x 8 x 16 step, small terms first.
template <int kT, bool kBt>
__device__ __forceinline__ void ns_cluster_stage(float (&acc)[kT][4], const __nv_bfloat16* a_row,
                                                 int a_plane, int k0, const __nv_bfloat16* stage,
                                                 int wc, int lane) {
  using Tile = NsClusterTile;
  constexpr int kLd = kBt ? Tile::kKc + Tile::kPad : 32 * kT + Tile::kPad;
  constexpr uint32_t kElem = sizeof(__nv_bfloat16);
  // 32-bit shared addresses, stepped by constants below (no per-load
  // generic-to-shared conversion or 64-bit index arithmetic).
  const uint32_t a_hi_at = detail::shared_address(a_row + k0);
  const uint32_t a_lo_at = a_hi_at + uint32_t(a_plane) * kElem;
  const int b_khalf = ((lane >> 3) & 1) * 8, b_r = lane & 7;
  const uint32_t b_at =
      detail::shared_address(stage) +
      uint32_t(kBt ? (wc * 8 * kT + b_r) * kLd + b_khalf : (b_khalf + b_r) * kLd + wc * 8 * kT) *
          kElem;
#pragma unroll
  for (int kk = 0; kk < Tile::kKc; kk += 16) {
    uint32_t a_hi[4], a_lo[4];
    detail::ldmatrix_x4_at<false>(a_hi, a_hi_at + kk * kElem);
    detail::ldmatrix_x4_at<false>(a_lo, a_lo_at + kk * kElem);
    // One x4 load per 8-column tile: both planes, both k halves (b[0], b[1]
    // hi; b[2], b[3] lo).
    uint32_t b[kT][4];
#pragma unroll
    for (int j = 0; j < kT; ++j) {
      if constexpr (kBt)
        detail::ldmatrix_x4_at<false>(b[j], b_at + (8 * j * kLd + kk) * kElem);
      else
        detail::ldmatrix_x4_at<true>(b[j], b_at + (kk * kLd + 8 * j) * kElem);
    }
#pragma unroll
    for (int j = 0; j < kT; ++j)
      detail::mma_m16n8k16<__nv_bfloat16>(acc[j], a_lo, b[j][0], b[j][1]);
#pragma unroll
    for (int j = 0; j < kT; ++j)
      detail::mma_m16n8k16<__nv_bfloat16>(acc[j], a_hi, b[j][2], b[j][3]);
#pragma unroll
    for (int j = 0; j < kT; ++j)
      detail::mma_m16n8k16<__nv_bfloat16>(acc[j], a_hi, b[j][0], b[j][1]);
  }
}

#endif  // __CUDA_ARCH__ >= 900

// Grid: x = the cluster's m / 32 CTAs (one cluster per matrix), y over the
// matrices (grid-strided past 65535; a cluster's CTAs share blockIdx.y).
// Block: NsClusterTile::kThreads. Dynamic shared memory: smem_bytes(m).
// kT = m / 32: each warp's 8 kT output columns, and the row tiles per column pass.
template <int kT>
__global__ void __launch_bounds__(NsClusterTile::kThreads, 1)
    ns_cluster_kernel(const __grid_constant__ NsClusterParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Tile = NsClusterTile;
  using bf16 = __nv_bfloat16;
  constexpr int kM = 32 * kT, kS = Tile::kStages;
  constexpr int kLdG = Tile::kKc + Tile::kPad, kLdR = kM + Tile::kPad;
  constexpr int kGramPlane = Tile::gram_plane(kM), kRowPlane = Tile::row_plane(kM);
  constexpr int kStage = Tile::stage_elems(kM);
  extern __shared__ __align__(128) unsigned char ns_smem[];
  bf16* stages = reinterpret_cast<bf16*>(ns_smem);
  bf16* sA = stages + kS * kStage;  // A_i, then B_i: one row tile
  const int n = p.n;
  uint64_t* full = reinterpret_cast<uint64_t*>(sA + 2 * kRowPlane);
  uint64_t* empty = full + kS;
  const int gram_tiles = n / Tile::kKc;  // also apply's row tiles, all passes
  const int64_t mn = int64_t(kM) * n;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int wr = warp >> 2, wc = warp & 3, g = lane >> 2, i = lane & 3;
  const int rank = static_cast<int>(detail::cluster_rank());
  const int ctas = static_cast<int>(detail::cluster_size());
  const int row0 = rank * Tile::kRows;

  if (t == 0) {
    for (int st = 0; st < kS; ++st) {
      detail::mbarrier_init(full + st, 1);
      detail::mbarrier_init(empty + st, ctas * Tile::kWarps);
    }
    detail::fence_mbarrier_init();
  }
  // (The prologue's cluster barrier below publishes the initialisation
  // before any copy or remote arrival.)

  // Accumulator element (j, e): row 16 wr + g + 8 (e / 2) of the CTA's 32,
  // column 8 kT wc + 8 j + 2 i + (e % 2) of the block; pairs h = e / 2.
  const auto out_row = [&](int h) { return 16 * wr + g + 8 * h; };
  const auto out_col = [&](int j) { return 8 * kT * wc + 8 * j + 2 * i; };
  // ldmatrix addresses: the A operand's row 16 wr + lane % 16, k half lane / 16.
  const int a_lane_row = 16 * wr + (lane & 15), a_lane_k = (lane >> 4) * 8;

  // The pipeline. Fills are numbered on one counter for the whole launch
  // (stage f % kS, phase f / kS); a step's fills are gram's n / 32, poly's
  // kT, apply's n / 32, in the order they are consumed. Only thread 0 issues:
  // fill f after every warp of every CTA released fill f - kS (empty), and
  // only once its data is complete (`ready`, raised after each barrier).
  const int step_fills = 2 * gram_tiles + kT;
  int64_t fill_base = 0;      // the current step's first fill
  int issued = 0, ready = 0;  // thread 0: fills of this step issued / issuable
  const uint16_t mask = static_cast<uint16_t>((1u << ctas) - 1u);

  for (int64_t mat = blockIdx.y; mat < p.mats; mat += gridDim.y) {
    float* X = p.X + mat * mn;
    bf16* ag = p.ag + mat * kT * 2 * kRowPlane;

    // Where this thread's pair (row r of the CTA, column c) of X lands in
    // buffer `buf`: the apply row tile and the gram tile.
    const auto store_x = [&](int buf, int r, int c, uint32_t hi, uint32_t lo) {
      bf16* ax = p.ax + ((int64_t(buf) * p.mats + mat) * gram_tiles + (c / kM) * kT + rank) * 2 *
                            kRowPlane;
      bf16* gx =
          p.gx + ((int64_t(buf) * p.mats + mat) * gram_tiles + c / Tile::kKc) * 2 * kGramPlane;
      const int ra = r * kLdR + c % kM, rg = (row0 + r) * kLdG + c % Tile::kKc;
      store_pair(ax, ra, hi);
      store_pair(ax, kRowPlane + ra, lo);
      store_pair(gx, rg, hi);
      store_pair(gx, kGramPlane + rg, lo);
    };

    // X_0's parts, eight pairs of loads in flight per thread.
    {
      constexpr int kBatch = 8;
      const int pairs = Tile::kRows * n / 2;
      for (int q0 = t; q0 < pairs; q0 += kBatch * Tile::kThreads) {
        float2 x[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int q = q0 + u * Tile::kThreads;
          if (q < pairs)
            x[u] = *reinterpret_cast<const float2*>(X + int64_t(row0) * n + 2 * int64_t(q));
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int q = q0 + u * Tile::kThreads;
          if (q >= pairs) continue;
          uint32_t hi, lo;
          detail::split_bf16x2(x[u].x, x[u].y, hi, lo);
          store_x(0, (2 * q) / n, (2 * q) % n, hi, lo);
        }
      }
    }
    detail::fence_proxy_async_global();
    detail::cluster_sync_all();  // every CTA's rows of X_0 are out

    for (int s = 0; s < p.steps; ++s) {
      const int cur = s & 1;
      const bf16* gx = p.gx + (int64_t(cur) * p.mats + mat) * gram_tiles * 2 * kGramPlane;
      const bf16* ax = p.ax + (int64_t(cur) * p.mats + mat) * gram_tiles * 2 * kRowPlane;
      issued = 0;
      ready = gram_tiles;  // X is complete: gram's fills may go

      // Thread 0: issues this step's fills below min(upto, ready).
      const auto top_up = [&](int upto) {
        if (t != 0) return;
        for (; issued < min(upto, ready); ++issued) {
          const int64_t f = fill_base + issued;
          const int st = static_cast<int>(f % kS);
          if (f >= kS)
            detail::mbarrier_wait_cta(empty + st, static_cast<uint32_t>((f / kS - 1) & 1));
          const bf16* src;
          uint32_t bytes;
          if (issued < gram_tiles) {
            src = gx + int64_t(issued) * 2 * kGramPlane;
            bytes = 2 * kGramPlane * sizeof(bf16);
          } else if (issued < gram_tiles + kT) {
            src = ag + int64_t(issued - gram_tiles) * 2 * kRowPlane;
            bytes = 2 * kRowPlane * sizeof(bf16);
          } else {
            src = ax + int64_t(issued - gram_tiles - kT) * 2 * kRowPlane;
            bytes = 2 * kRowPlane * sizeof(bf16);
          }
          detail::mbarrier_arrive_expect_tx(full + st, bytes);
          const uint32_t slice = bytes / ctas;  // a multiple of 16 (NsClusterTile)
          bf16* dst = stages + st * kStage;
          if (ctas == 1)
            detail::bulk_copy_to_shared(dst, src, bytes, full + st);
          else
            detail::bulk_copy_multicast(reinterpret_cast<unsigned char*>(dst) + rank * slice,
                                        reinterpret_cast<const unsigned char*>(src) + rank * slice,
                                        slice, full + st, mask);
        }
      };
      // Consumes this step's fills [first, first + count) into acc (zeroed).
      // Gram (kBt): the A operand is X_i, this CTA's rows of the gram tile
      // itself; else it is sA's row tile, k offset 32 (fill - first).
      const auto consume = [&](auto bt, float(&acc)[kT][4], int first, int count) {
        constexpr bool kBt = decltype(bt)::value;
#pragma unroll
        for (int j = 0; j < kT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
        const int b_plane = (lane >> 4) * (kBt ? kGramPlane : kRowPlane);
        for (int q = first; q < first + count; ++q) {
          top_up(q + kS);
          const int64_t f = fill_base + q;
          const int st = static_cast<int>(f % kS);
          detail::mbarrier_wait_cta(full + st, static_cast<uint32_t>((f / kS) & 1));
          const bf16* stage = stages + st * kStage;
          if constexpr (kBt)
            ns_cluster_stage<kT, true>(acc, stage + (row0 + a_lane_row) * kLdG + a_lane_k,
                                       kGramPlane, 0, stage + b_plane, wc, lane);
          else
            ns_cluster_stage<kT, false>(acc, sA + a_lane_row * kLdR + a_lane_k, kRowPlane,
                                        (q - first) * Tile::kKc, stage + b_plane, wc, lane);
          __syncwarp();
          if (lane < ctas) detail::mbarrier_arrive_cluster_cta(empty + st, lane);
        }
      };

      // The parts of out(j, h) = f(accumulator pair) into sA and, when `tile`
      // is given, the same place of that row tile.
      const auto store_row_tile = [&](bf16* tile, auto&& f) {
#pragma unroll
        for (int j = 0; j < kT; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int at = out_row(h) * kLdR + out_col(j);
            const float2 v = f(j, h);
            uint32_t hi, lo;
            detail::split_bf16x2(v.x, v.y, hi, lo);
            for (bf16* dst : {sA, tile}) {
              if (dst == nullptr) continue;
              store_pair(dst, at, hi);
              store_pair(dst, kRowPlane + at, lo);
            }
          }
      };

      // gram: A_i = X_i X^T, kept in registers for poly's b A_i; its parts
      // go to sA and to poly's row tile `rank`.
      float a_acc[kT][4];
      consume(std::true_type{}, a_acc, 0, gram_tiles);
      store_row_tile(ag + rank * 2 * kRowPlane, [&](int j, int h) {
        return make_float2(a_acc[j][2 * h], a_acc[j][2 * h + 1]);
      });
      detail::fence_proxy_async_global();
      // Every CTA's rows of A are out (release / acquire across the cluster;
      // a block barrier too, for sA).
      detail::cluster_sync_all();
      ready = step_fills;  // poly's and apply's fills

      // poly: B_i = b A_i + c A_i A, into sA once every warp is done with A_i.
      {
        float acc[kT][4];
        consume(std::false_type{}, acc, gram_tiles, kT);
        __syncthreads();
        store_row_tile(nullptr, [&](int j, int h) {
          return make_float2(p.b * a_acc[j][2 * h] + p.c * acc[j][2 * h],
                             p.b * a_acc[j][2 * h + 1] + p.c * acc[j][2 * h + 1]);
        });
        __syncthreads();  // B_i complete before apply reads it
      }

      // apply: X'_i = a X_i + B_i X in column passes of kM.
      float* its = p.iterates ? p.iterates + (int64_t(s) * p.mats + mat) * mn : nullptr;
      for (int pass = 0; pass < n / kM; ++pass) {
        const int col0 = pass * kM;
        // This thread's old X values, loaded before the products hide their latency.
        float2 x_old[kT][2];
#pragma unroll
        for (int j = 0; j < kT; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            x_old[j][h] = *reinterpret_cast<const float2*>(X + int64_t(row0 + out_row(h)) * n +
                                                           col0 + out_col(j));
        float acc[kT][4];
        consume(std::false_type{}, acc, gram_tiles + kT + pass * kT, kT);
#pragma unroll
        for (int j = 0; j < kT; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = out_row(h), c = col0 + out_col(j);
            const int64_t at = int64_t(row0 + r) * n + c;
            const float2 x = x_old[j][h];
            if (its) *reinterpret_cast<float2*>(its + at) = x;
            const float2 y = make_float2(acc[j][2 * h] + p.a * x.x, acc[j][2 * h + 1] + p.a * x.y);
            *reinterpret_cast<float2*>(X + at) = y;
            uint32_t hi, lo;
            detail::split_bf16x2(y.x, y.y, hi, lo);
            store_x(cur ^ 1, r, c, hi, lo);
          }
      }
      fill_base += step_fills;
      detail::fence_proxy_async_global();
      // X' complete in the other buffer; nobody reads this step's any more.
      detail::cluster_sync_all();
    }
  }
#else
  (void)p;
  __trap();  // the host launches this only where the code was built for sm_90+
#endif
}

// ---- host side ------------------------------------------------------------------

// Every CTA's slice of a stage image is a whole number of 16-byte units (the
// bulk copies' granule) for each supported Gram side m (cluster of m / 32).
constexpr bool ns_slices_aligned(int m) {
  using Tile = NsClusterTile;
  const int ctas = m / Tile::kRows, elem = int(sizeof(__nv_bfloat16));
  return (2 * Tile::gram_plane(m) * elem) % (16 * ctas) == 0 &&
         (2 * Tile::row_plane(m) * elem) % (16 * ctas) == 0;
}
static_assert(ns_slices_aligned(32) && ns_slices_aligned(64) && ns_slices_aligned(128) &&
                  ns_slices_aligned(256),
              "stage image slices must be 16-byte multiples");
static_assert(NsClusterTile::smem_bytes(NsClusterTile::kMaxM) <= 227 * 1024,
              "the largest cluster kernel fits an sm_90 CTA's shared memory");

namespace {

// Calls f(kernel) with ns_cluster_kernel<m / 32>; m in {32, 64, 128, 256}.
template <typename F>
void with_ns_cluster_kernel(int64_t m, F&& f) {
  switch (m) {
    case 32:
      f(ns_cluster_kernel<1>);
      return;
    case 64:
      f(ns_cluster_kernel<2>);
      return;
    case 128:
      f(ns_cluster_kernel<4>);
      return;
    case 256:
      f(ns_cluster_kernel<8>);
      return;
    default:
      SS_FAIL("w0", "ns_cluster_kernel takes a Gram side m in {32, 64, 128, 256}, got ", m);
  }
}

// The uncached check of ns_cluster_supported on `device`.
bool ns_cluster_fits(int device, int64_t m, int64_t n) {
  using Tile = NsClusterTile;
  if (!(m == 32 || m == 64 || m == 128 || m == Tile::kMaxM) || n % m != 0 || n > Tile::kMaxN)
    return false;
  int major = 0, smem_optin = 0;
  SS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  SS_CUDA_CHECK(
      cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t smem = Tile::smem_bytes(static_cast<int>(m));
  if (major < 9 || smem > static_cast<size_t>(smem_optin)) return false;
  bool ok = false;
  with_ns_cluster_kernel(m, [&](auto kernel) {
    // A build without sm_90 code would JIT the trapping stub from older PTX.
    cudaFuncAttributes attr{};
    SS_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    ok = attr.ptxVersion >= 90 &&
         detail::active_clusters(kernel, Tile::kThreads, smem, static_cast<unsigned>(m / 32)) > 0;
  });
  return ok;
}

}  // namespace

bool ns_cluster_supported(int64_t m, int64_t n) {
  return detail::cached_device_check<NsClusterTile>(m, n, ns_cluster_fits);
}

void ns_cluster_launch(const NsClusterParams& p, cudaStream_t stream) {
  using Tile = NsClusterTile;
  SS_CHECK_ARG(ns_cluster_supported(p.m, p.n), "w0", "ns_cluster_kernel cannot run ", p.m, " x ",
               p.n, " matrices on this device");
  const unsigned cluster = static_cast<unsigned>(p.m / Tile::kRows);
  const dim3 grid(cluster, static_cast<unsigned>(std::min<int64_t>(p.mats, 65535)));
  with_ns_cluster_kernel(p.m, [&](auto kernel) {
    detail::launch_kernel_cluster(kernel, grid, Tile::kThreads, Tile::smem_bytes(p.m), cluster,
                                  stream, "ns_cluster_kernel", p);
  });
}

}  // namespace statescan::cuda::lact_detail
