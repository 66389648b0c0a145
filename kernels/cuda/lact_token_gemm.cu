// lact_token_gemm (lact_token_gemm.cuh): C = alpha A^T B + beta C per pair,
// A and B token-major bf16, C fp32, the tokens split over a cluster.
//
// A CTA: 128 x BN of C (two consumer warpgroups of m64 x BN, one MMA of
// m64nBNk16 per 16 tokens with both operands MN-major: the tiles are copied
// token-major as they lie, 64 tokens x 64 columns a box in the 128-byte
// swizzle) over its share of the 64-token steps, fed by a producer
// warpgroup through a ring of stages. Then every CTA of the cluster writes
// its partial tile into its shared memory (over the stages), the cluster
// syncs, and CTA s sums rows [s 128 / S, (s + 1) 128 / S) of the S partials
// in rank order through distributed shared memory, scales, adds beta C and
// writes them with 16-byte stores.

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/env_knob.h"
#include "core/error.h"
#include "kernels/cuda/cluster_copy.cuh"
#include "kernels/cuda/cuda_mixer.h"
#include "kernels/cuda/lact_token_gemm.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/tensor_map.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace statescan::cuda::lact_detail {
namespace {

constexpr int kMaxSplits = 8;  // CTAs of a cluster: the portable limit

template <int kBN>
struct TokenTile {
  // 4 stages (6 at BN 128 changed nothing: 25.1 -> 26.3 us a launch).
  static constexpr int kBM = 128, kK = 64, kStages = 4;
  static constexpr int kConsumers = 256, kThreads = kConsumers + 128;  // + a producer warpgroup
  static constexpr int kConsumerWarps = kConsumers / 32;
  // The producer keeps what its copies need; the consumers' BN / 2
  // accumulators take the rest (2 x 128 x 232 + 128 x 40 <= 65536).
  static constexpr int kConsumerRegs = 232, kProducerRegs = 40;
  static constexpr size_t kBox = size_t{kK} * 64 * 2;  // 64 tokens x 64 columns: 8 KB
  static constexpr size_t kABytes = 2 * kBox, kBBytes = (kBN / 64) * kBox;
  static constexpr size_t kStageBytes = kABytes + kBBytes;
  // The partial tile in fp32 rows of BN + 8 (the float2 stores from the
  // accumulator layout then take the minimum two wavefronts per warp).
  static constexpr int kPitch = kBN + 8;
  static constexpr size_t kPartialBytes = size_t{kBM} * kPitch * 4;
  static constexpr size_t kDataBytes = std::max(kStages * kStageBytes, kPartialBytes);
  static constexpr size_t kSmemBytes = 1024 + kDataBytes + 2 * kStages * sizeof(uint64_t);
};
static_assert(TokenTile<256>::kSmemBytes <= 227 * 1024, "lact_token_gemm: shared memory");
static_assert(detail::fits_register_pool(TokenTile<256>::kThreads, 2, TokenTile<256>::kConsumerRegs,
                                         TokenTile<256>::kProducerRegs),
              "lact_token_gemm: the warpgroups' register budgets exceed the launch's pool");

struct TokenGemmArgs {
  float* c;
  int64_t ldc, c_stride;
  int m_tiles, k_tiles;
  int a_rows_dim, b_rows_dim;  // the tensor maps' token dimension: 1 or 2 (the other the pair)
  float alpha, beta;
};
struct TokenGemmMaps {
  CUtensorMap a, b;
};

// One 64 x 64 box of a map at column `col`, token `t`, pair `pair`.
__device__ __forceinline__ void copy_box(void* dst, const CUtensorMap* map, int rows_dim, int col,
                                         int t, int pair, uint64_t* bar) {
  if (rows_dim == 1)
    detail::tensor_copy_to_shared_3d(dst, map, col, t, pair, bar);
  else
    detail::tensor_copy_to_shared_3d(dst, map, col, pair, t, bar);
}

// CTA `split`'s rows of the tile, [split 128 / kSplits, ...), summed over
// the cluster's kSplits partial tiles, into C (consumer thread tid).
template <int kBN, int kSplits>
__device__ __forceinline__ void sum_partials(const TokenGemmArgs& p, const float* partial, float* c,
                                             int split, int tid) {
  using Tile = TokenTile<kBN>;
  constexpr int kRows = Tile::kBM / kSplits, kQuadsPerRow = kBN / 4;
  uint32_t rank_base[kSplits];
#pragma unroll
  for (int r = 0; r < kSplits; ++r) rank_base[r] = detail::cluster_shared_address(partial, r);
  for (int q = tid; q < kRows * kQuadsPerRow; q += Tile::kConsumers) {
    const int row = split * kRows + q / kQuadsPerRow, col = 4 * (q % kQuadsPerRow);
    const uint32_t offset = static_cast<uint32_t>((row * Tile::kPitch + col) * sizeof(float));
    // Every rank's quad in flight at once (a remote read is a round trip of
    // hundreds of cycles), then summed in rank order, whichever CTA sums:
    // the same bits on every run.
    float4 x[kSplits];
#pragma unroll
    for (int r = 0; r < kSplits; ++r) x[r] = detail::load_shared_cluster_f4(rank_base[r] + offset);
    float4 sum = x[0];
#pragma unroll
    for (int r = 1; r < kSplits; ++r)
      sum.x += x[r].x, sum.y += x[r].y, sum.z += x[r].z, sum.w += x[r].w;
    float4* out = reinterpret_cast<float4*>(c + int64_t{row} * p.ldc + col);
    float4 v = make_float4(p.alpha * sum.x, p.alpha * sum.y, p.alpha * sum.z, p.alpha * sum.w);
    if (p.beta != 0.f) {
      const float4 old = *out;
      v.x += p.beta * old.x, v.y += p.beta * old.y, v.z += p.beta * old.z, v.w += p.beta * old.w;
    }
    *out = v;
  }
}

template <int kBN>
__global__ void __launch_bounds__(TokenTile<kBN>::kThreads, 1)
    token_gemm_kernel(const __grid_constant__ TokenGemmArgs p,
                      const __grid_constant__ TokenGemmMaps maps) {
  using Tile = TokenTile<kBN>;
  constexpr int kStages = Tile::kStages;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* base = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(base + Tile::kDataBytes);
  uint64_t* empty = full + kStages;
  float* partial = reinterpret_cast<float*>(base);

  const int tid = threadIdx.x;
  // The cluster spans x: the CTA's rank is its split of the tokens.
  const int splits = static_cast<int>(gridDim.x), split = static_cast<int>(blockIdx.x);
  const int pair = static_cast<int>(blockIdx.z);
  const int m0 = Tile::kBM * (static_cast<int>(blockIdx.y) % p.m_tiles);
  const int n0 = kBN * (static_cast<int>(blockIdx.y) / p.m_tiles);
  const int kt0 = static_cast<int>(int64_t{split} * p.k_tiles / splits);
  const int steps = static_cast<int>(int64_t{split + 1} * p.k_tiles / splits) - kt0;
  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      detail::mbarrier_init(full + st, 1);
      detail::mbarrier_init(empty + st, Tile::kConsumerWarps);
    }
    detail::fence_mbarrier_init();
  }
  __syncthreads();

  if (tid >= Tile::kConsumers) {
    detail::setmaxnreg_dec<Tile::kProducerRegs>();
    if (tid == Tile::kConsumers) {
      detail::prefetch_tensor_map(&maps.a);
      detail::prefetch_tensor_map(&maps.b);
      for (int i = 0; i < steps; ++i) {
        const int st = i % kStages;
        if (i >= kStages) detail::mbarrier_wait_cta(empty + st, (i / kStages - 1) & 1);
        detail::mbarrier_arrive_expect_tx(full + st, static_cast<uint32_t>(Tile::kStageBytes));
        unsigned char* s = base + st * Tile::kStageBytes;
        const int t = Tile::kK * (kt0 + i);
        copy_box(s, &maps.a, p.a_rows_dim, m0, t, pair, full + st);
        copy_box(s + Tile::kBox, &maps.a, p.a_rows_dim, m0 + 64, t, pair, full + st);
#pragma unroll
        for (int j = 0; j < kBN / 64; ++j)
          copy_box(s + Tile::kABytes + j * Tile::kBox, &maps.b, p.b_rows_dim, n0 + 64 * j, t, pair,
                   full + st);
      }
    }
    __syncwarp();
  } else {
    detail::setmaxnreg_inc<Tile::kConsumerRegs>();
    // wg by shuffle: warp-uniform to ptxas (uniform descriptors, as lact_hidden.cu).
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0), warp = (tid % 128) / 32,
              lane = tid % 32;
    float acc[kBN / 2];
#pragma unroll
    for (int e = 0; e < kBN / 2; ++e) acc[e] = 0.f;
    for (int i = 0; i < steps; ++i) {
      const int st = i % kStages;
      detail::mbarrier_wait_cta(full + st, (i / kStages) & 1);
      const unsigned char* s = base + st * Tile::kStageBytes;
      // A: this warpgroup's 64 columns, one atom across (LBO unused); B: BN
      // columns in boxes of 64, 8 KB apart. 8-token atoms 1 KB apart; a k16
      // step is two of them.
      const uint64_t da = detail::wgmma_desc_sw128_mn(s + wg * Tile::kBox, 16, 1024);
      const uint64_t db =
          detail::wgmma_desc_sw128_mn(s + Tile::kABytes, static_cast<uint32_t>(Tile::kBox), 1024);
      detail::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Tile::kK / 16; ++kk)
        detail::wgmma_m64k16_ss_bf16_mn<kBN>(acc, detail::wgmma_desc_advance(da, 2048 * kk),
                                             detail::wgmma_desc_advance(db, 2048 * kk));
      detail::wgmma_commit();
      // The previous step's MMAs are done once at most this group is
      // pending: hand its stage back while these run.
      detail::wgmma_wait<1>();
      if (i > 0) {
        __syncwarp();
        if (lane == 0) detail::mbarrier_arrive(empty + (i - 1) % kStages);
      }
    }
    detail::wgmma_wait<0>();
    // Both warpgroups' MMAs have read their last stages before the partial
    // tile goes over them.
    detail::named_barrier_sync(1, Tile::kConsumers);
    const int r0 = 64 * wg + 16 * warp + lane / 4, c0 = 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j) {
      *reinterpret_cast<float2*>(partial + r0 * Tile::kPitch + 8 * j + c0) =
          make_float2(acc[4 * j], acc[4 * j + 1]);
      *reinterpret_cast<float2*>(partial + (r0 + 8) * Tile::kPitch + 8 * j + c0) =
          make_float2(acc[4 * j + 2], acc[4 * j + 3]);
    }
  }
  // Every CTA's partial tile is written (release / acquire at cluster scope).
  detail::cluster_sync_all();
  if (tid < Tile::kConsumers) {
    float* c = p.c + pair * p.c_stride + int64_t{m0} * p.ldc + n0;
    if (splits == 1)
      sum_partials<kBN, 1>(p, partial, c, split, tid);
    else if (splits == 2)
      sum_partials<kBN, 2>(p, partial, c, split, tid);
    else if (splits == 4)
      sum_partials<kBN, 4>(p, partial, c, split, tid);
    else
      sum_partials<kBN, kMaxSplits>(p, partial, c, split, tid);
  }
  // No CTA leaves while another may still read its shared memory.
  detail::cluster_sync_all();
}

// Whether the device runs the kernel at all: sm_90a build, 9.0 device,
// enough shared memory for the BN 256 tile.
bool device_fits() {
  return detail::cached_device_check<TokenTile<256>>(0, 0, [](int device, int64_t, int64_t) {
    if (!detail::wgmma_device(device)) return false;
    int optin = 0;
    SS_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return TokenTile<256>::kSmemBytes <= static_cast<size_t>(optin);
  });
}

// Whether an operand's pairs lie apart by whole slices of tokens (rows of
// an array per pair) rather than inside each token's row.
bool pair_major(const LactTokenOperand& x, const LactTokenGemmParams& p) {
  return p.pairs == 1 || x.stride >= x.ld * p.k;
}

// The first argument lact_token_gemm cannot take, with why; nullptr if it
// takes them all. Host checks first, the device last (host-only tests).
const char* misfit(const LactTokenGemmParams& p, const char** why) {
  auto operand_fits = [&](const LactTokenOperand& x, int64_t width) {
    if (!detail::aligned16(x.data) || x.ld % 8 != 0 || x.stride % 8 != 0 || x.ld < width)
      return false;
    // Pairs apart by whole slices, or interleaved inside a row (tokens).
    return pair_major(x, p) || (x.stride >= width && x.stride * p.pairs <= x.ld);
  };
  if (p.pairs < 1 || p.pairs > 65535) return *why = "1 to 65535 pairs", "heads";
  if (p.m < 128 || p.m % 128 != 0 || p.n < 128 || p.n % 128 != 0 || p.m >= (int64_t{1} << 31) ||
      p.n >= (int64_t{1} << 31))
    return *why = "m and n must be positive multiples of 128", "dim";
  if ((p.m / 128) * (p.n / 128) > 65535) return *why = "more than 65535 tiles a pair", "dim";
  if (p.k < 1 || p.k >= (int64_t{1} << 31)) return *why = "1 to 2^31 - 1 tokens", "seq_len";
  if (!operand_fits(p.a, p.m))
    return *why = "A needs 16-byte aligned rows and pairs that do not overlap", "a";
  if (!operand_fits(p.b, p.n))
    return *why = "B needs 16-byte aligned rows and pairs that do not overlap", "b";
  if (!detail::aligned16(p.c) || p.ldc % 4 != 0 || p.c_stride % 4 != 0 || p.ldc < p.n)
    return *why = "C needs 16-byte aligned rows and pairs", "c";
  if (!device_fits())
    return *why = "needs an sm_90a build on a compute capability 9.0 device", "device";
  return nullptr;
}

// A's or B's tensor map: dims {width, tokens, pairs} or {width, pairs,
// tokens}, whichever puts the strides in ascending order; rows_dim says
// where the tokens went.
CUtensorMap operand_map(const LactTokenOperand& x, int64_t width, const LactTokenGemmParams& p,
                        int* rows_dim, const char* arg) {
  const int64_t row = x.ld * 2;
  *rows_dim = pair_major(x, p) ? 1 : 2;
  const int64_t pair = p.pairs == 1 ? row * p.k : x.stride * 2;
  if (*rows_dim == 1) {
    const int64_t dims[3] = {width, p.k, p.pairs}, strides[2] = {row, pair};
    const int box[3] = {64, 64, 1};
    return detail::tile_map_3d(x.data, dims, strides, box, arg);
  }
  const int64_t dims[3] = {width, p.pairs, p.k}, strides[2] = {pair, row};
  const int box[3] = {64, 1, 64};
  return detail::tile_map_3d(x.data, dims, strides, box, arg);
}

// Clusters of `splits` CTAs that fit at once (cached per device and split).
template <int kBN>
int clusters_at_once(int splits) {
  return detail::cached_device_check<TokenTile<kBN>>(splits, 0, [](int, int64_t s, int64_t) {
    return detail::active_clusters(token_gemm_kernel<kBN>, TokenTile<kBN>::kThreads,
                                   TokenTile<kBN>::kSmemBytes, static_cast<unsigned>(s));
  });
}

template <int kBN>
void launch(const LactTokenGemmParams& p, int splits, cudaStream_t stream) {
  using Tile = TokenTile<kBN>;
  TokenGemmArgs args{};
  args.c = p.c, args.ldc = p.ldc, args.c_stride = p.c_stride;
  args.m_tiles = static_cast<int>(p.m / Tile::kBM);
  args.k_tiles = static_cast<int>((p.k + Tile::kK - 1) / Tile::kK);
  args.alpha = p.alpha, args.beta = p.beta;
  TokenGemmMaps maps{};
  maps.a = operand_map(p.a, p.m, p, &args.a_rows_dim, "a");
  maps.b = operand_map(p.b, p.n, p, &args.b_rows_dim, "b");
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(args.m_tiles * (p.n / kBN)),
                  static_cast<unsigned>(p.pairs));
  detail::launch_kernel_cluster(token_gemm_kernel<kBN>, grid, Tile::kThreads, Tile::kSmemBytes,
                                static_cast<unsigned>(splits), stream, "token_gemm_kernel", args,
                                maps);
}

// The tile width and token split: the fewest 128-column 64-token steps on
// the longest-running SM, counting waves of the clusters that fit at once
// (the occupancy API: a GPC holds whole clusters only, so 4- and 8-CTA
// clusters fill fewer SMs than the count suggests). Ties go to the wider
// tile (fewer L2 reads), then to fewer splits (less to sum).
struct TokenPlan {
  int bn, splits;
};
TokenPlan plan(const LactTokenGemmParams& p) {
  const int64_t k_tiles = (p.k + 63) / 64;
  TokenPlan best{128, 1};
  int64_t best_cost = -1;
  for (const int bn : {256, 128}) {
    if (p.n % bn != 0) continue;
    const int64_t tiles = p.pairs * (p.m / 128) * (p.n / bn);
    for (int splits = 1; splits <= kMaxSplits && splits <= k_tiles; splits *= 2) {
      const int64_t fit = bn == 256 ? clusters_at_once<256>(splits) : clusters_at_once<128>(splits);
      if (fit <= 0) continue;
      // A wave's fixed part (fill, the partial tile, the sum over the
      // cluster) counted as 4 + splits / 2 steps.
      const int64_t cost = (tiles + fit - 1) / fit *
                           (((k_tiles + splits - 1) / splits) * (bn / 128) + 4 + splits / 2);
      if (best_cost < 0 || cost < best_cost) best_cost = cost, best = {bn, splits};
    }
  }
  return best;
}

}  // namespace

bool token_gemm_requested() {
  static const bool fused = env_choice("STATESCAN_LACT_TOKEN_GEMM", {"cublas", "fused"}) == 1;
  return fused;
}

bool lact_token_gemm_fits(const LactTokenGemmParams& p) {
  const char* why = nullptr;
  return misfit(p, &why) == nullptr;
}

namespace {
std::atomic<int64_t> g_token_gemm_calls{0};
}  // namespace

int64_t lact_token_gemm_calls() {
  return g_token_gemm_calls.load();
}

void lact_token_gemm(const LactTokenGemmParams& p, cudaStream_t stream) {
  g_token_gemm_calls.fetch_add(1);
  const char* why = nullptr;
  const char* arg = misfit(p, &why);
  SS_CHECK_ARG(arg == nullptr, arg, "lact_token_gemm: ", why, " (pairs ", p.pairs, ", m ", p.m,
               ", n ", p.n, ", k ", p.k, ")");
  const TokenPlan t = plan(p);
  if (t.bn == 256)
    launch<256>(p, t.splits, stream);
  else
    launch<128>(p, t.splits, stream);
}

}  // namespace statescan::cuda::lact_detail
