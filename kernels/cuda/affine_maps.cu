// Small fp32 kernels on batches of affine maps S_out = M S_in + E (DESIGN §5):
// what the device exchange composes and applies, the two-level summary's
// fold and the pre-pass's Horner steps compose, the finiteness count the
// CP mixer's input checks use, and the NCCL link probe's stream hold. The
// maps are tiny (Dk <= 256 per head), so these are plain CUDA-core kernels
// in fp32 (no TF32: a handful of products whose errors nothing repeats).
// Full maps go through 32 x 32 output tiles with the operands staged in
// shared memory (map_product_kernel): one thread per output element took
// 21 us for 16 maps of 128 x 128 (a merge), the tiles 14; cuBLAS's fp32
// batched GEMM about the same (PERF_NOTES, twenty-fifth session). The
// summary's fold and the pre-pass's Horner steps, chains of such products,
// run as one launch each (maps_chain_kernel).

#include <algorithm>
#include <cstdint>

#include "core/cuda_check.h"
#include "kernels/cuda/cp_kernels.h"
#include "kernels/cuda/cuda_mixer.h"

namespace statescan::cuda {
namespace {

constexpr int kThreads = 256;
// grid.y's and grid.z's limit: launches with more maps than this run in slices.
constexpr int64_t kMaxGridYZ = 65535;

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>((n + kThreads - 1) / kThreads);
}

// affine_apply_kernel: out[m][i][c] = bias[m][i][c] + A[m][i] B[m][i][c] for
// diagonal maps A ([maps, Dk]); one thread per (m, i, c). B, bias and out are
// Dk x width per map with row strides ld_b, ld_bias, width; bias and B may be
// null (zero; with B null A is not read, which also serves full maps applied
// to a zero state). Full maps with a state go through map_product_kernel.
__global__ void affine_apply_kernel(int64_t maps, int64_t dk, int64_t width, const float* A,
                                    const float* B, int64_t ld_b, int64_t stride_b,
                                    const float* bias, int64_t ld_bias, int64_t stride_bias,
                                    float* out) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= maps * dk * width) return;
  const int64_t m = idx / (dk * width), i = (idx / width) % dk, c = idx % width;
  float acc = bias != nullptr ? bias[m * stride_bias + i * ld_bias + c] : 0.f;
  if (B != nullptr) acc += A[m * dk + i] * B[m * stride_b + i * ld_b + c];
  out[idx] = acc;
}

// map_product_kernel: out[m][i][c] = bias[m][i][c] + sum_j op(A)[m][i][j] B[m][j][c]
// with op(A) = A or A^T (kTransA), A Dk x Dk per map. Grid (width / 32,
// Dk / 32, maps), rounded up; 16 x 16 threads, each owning rows ty, ty + 16
// and columns tx, tx + 16 of the CTA's tile. The contraction runs through
// 32 x 32 slices of op(A) and B in shared memory (padded rows: the
// transposed loads write columns without bank conflicts). A 4 x 4 block per
// thread (64 threads a CTA, float4 shared reads) took twice as long: the
// slices' global loads, not the shared reads, bound it (ncu, twenty-fifth
// session).
template <bool kTransA>
__global__ void __launch_bounds__(256) map_product_kernel(MapsProduct p) {
  constexpr int kTile = 32;
  __shared__ float sa[kTile][kTile + 1], sb[kTile][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 16 + tx;
  const int64_t m = blockIdx.z, i0 = int64_t{blockIdx.y} * kTile, c0 = int64_t{blockIdx.x} * kTile;
  const float* A = p.A + m * p.dk * p.dk;
  const float* B = p.B + m * p.stride_b;
  float acc[2][2] = {};
  for (int64_t j0 = 0; j0 < p.dk; j0 += kTile) {
    for (int e = tid; e < kTile * kTile; e += 256) {
      const int r = e / kTile, q = e % kTile;
      // op(A)[i0 + a][j0 + b] into sa[a][b]; reads run along A's rows.
      if constexpr (kTransA)
        sa[q][r] = j0 + r < p.dk && i0 + q < p.dk ? A[(j0 + r) * p.dk + i0 + q] : 0.f;
      else
        sa[r][q] = i0 + r < p.dk && j0 + q < p.dk ? A[(i0 + r) * p.dk + j0 + q] : 0.f;
      sb[r][q] = j0 + r < p.dk && c0 + q < p.width ? B[(j0 + r) * p.ld_b + c0 + q] : 0.f;
    }
    __syncthreads();
#pragma unroll 8
    for (int j = 0; j < kTile; ++j) {
      const float a0 = sa[ty][j], a1 = sa[ty + 16][j], b0 = sb[j][tx], b1 = sb[j][tx + 16];
      acc[0][0] = fmaf(a0, b0, acc[0][0]);
      acc[0][1] = fmaf(a0, b1, acc[0][1]);
      acc[1][0] = fmaf(a1, b0, acc[1][0]);
      acc[1][1] = fmaf(a1, b1, acc[1][1]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int64_t i = i0 + ty + 16 * a, c = c0 + tx + 16 * b;
      if (i >= p.dk || c >= p.width) continue;
      // bias may be out itself: this thread alone reads and writes (i, c).
      const float add = p.bias != nullptr ? p.bias[m * p.stride_bias + i * p.ld_bias + c] : 0.f;
      p.out[m * p.stride_out + i * p.ld_out + c] = acc[a][b] + add;
    }
}

// maps_chain_kernel: chain_maps (cp_kernels.h). Grid (width / 32 rounded up,
// maps, chains), 256 threads: a CTA carries columns [32 x, 32 x + 32) of one
// map's X (all Dk <= 128 rows, zero-padded, in shared memory) through every
// step; thread (ty, tx) = (t / 8, t % 8) owns rows 4 ty .. and columns
// 4 tx .. of the product. op(A_s) streams through shared memory in slices of
// 32 contraction indices, the next slice (across step boundaries too: A does
// not depend on X) loaded into registers while the current one is used;
// step s's bias is loaded when the step starts and added when it ends.
struct MapsChainLaunch {
  MapsChain chain[2];
};

constexpr int kChainCols = 32, kChainRows = 128, kChainK = 32;

__global__ void __launch_bounds__(256)
    maps_chain_kernel(const __grid_constant__ MapsChainLaunch l) {
  const MapsChain& c = l.chain[blockIdx.z];
  const int64_t m = blockIdx.y, c0 = int64_t{blockIdx.x} * kChainCols;
  if (m >= c.maps || c0 >= c.width) return;  // the other chain is wider or has more maps
  __shared__ __align__(16) float xs[kChainRows][kChainCols + 4];
  __shared__ __align__(16) float as[kChainK][kChainRows + 4];  // op(A)^T slice: [k][row]
  const int t = threadIdx.x, ty = t / 8, tx = t % 8;
  const int dk = static_cast<int>(c.dk);
  const int cols = c.width - c0 < kChainCols ? static_cast<int>(c.width - c0) : kChainCols;
  const int64_t state = m * c.dk * c.width + c0;  // (row 0, column c0) of this map's X
  for (int e = t; e < kChainRows * kChainCols; e += 256) {
    const int r = e / kChainCols, q = e % kChainCols;
    xs[r][q] = r < dk && q < cols ? c.x0[state + r * c.width + q] : 0.f;
  }
  const int ktiles = (dk + kChainK - 1) / kChainK, total = c.steps * ktiles;
  // Slice `it` (step it / ktiles, contraction indices k0 ..) into registers:
  // four float4 a thread, read along A's rows (coalesced either way).
  float4 pre[4];
  auto load_slice = [&](int it) {
    const float* A = c.A[it / ktiles] + m * c.dk * c.dk;
    const int k0 = (it % ktiles) * kChainK;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int e = t + 256 * r;
      int row, col;  // of A
      if (c.transpose_a) {
        row = k0 + e / 32;  // op(A)[i][k] = A[k][i]: as[k][i] is A's row k
        col = 4 * (e % 32);
      } else {
        row = e / 8;  // as[k][i] = A[i][k]: A's row i, 4 contraction indices
        col = k0 + 4 * (e % 8);
      }
      pre[r] = row < dk && col < dk ? *reinterpret_cast<const float4*>(A + row * dk + col)
                                    : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  auto store_slice = [&] {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int e = t + 256 * r;
      if (c.transpose_a) {
        *reinterpret_cast<float4*>(&as[e / 32][4 * (e % 32)]) = pre[r];
      } else {
        const int i = e / 8, k = 4 * (e % 8);
        as[k][i] = pre[r].x;
        as[k + 1][i] = pre[r].y;
        as[k + 2][i] = pre[r].z;
        as[k + 3][i] = pre[r].w;
      }
    }
  };
  float acc[4][4] = {}, add[4][4] = {};
  if (total > 0) load_slice(0);
  for (int it = 0; it < total; ++it) {
    const int s = it / ktiles, kt = it % ktiles;
    if (kt == 0 && c.bias[s] != nullptr) {
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const int row = 4 * ty + a, col = 4 * tx + b;
          add[a][b] = row < dk && col < cols ? c.bias[s][state + row * c.width + col] : 0.f;
        }
    }
    __syncthreads();  // the previous slice's reads done (and the previous step's X written)
    store_slice();
    __syncthreads();
    if (it + 1 < total) load_slice(it + 1);
    const int k0 = kt * kChainK;
#pragma unroll 8
    for (int k = 0; k < kChainK; ++k) {
      const float4 a4 = *reinterpret_cast<const float4*>(&as[k][4 * ty]);
      const float4 x4 = *reinterpret_cast<const float4*>(&xs[k0 + k][4 * tx]);
      const float av[4] = {a4.x, a4.y, a4.z, a4.w}, xv[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) acc[a][b] = fmaf(av[a], xv[b], acc[a][b]);
    }
    if (kt == ktiles - 1) {
      __syncthreads();  // every read of step s's X done
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          // Rows past Dk stay zero: op(A)'s rows there were loaded as zeros.
          xs[4 * ty + a][4 * tx + b] = acc[a][b] + add[a][b];
          acc[a][b] = add[a][b] = 0.f;
        }
    }
  }
  __syncthreads();
  for (int e = t; e < kChainRows * kChainCols; e += 256) {
    const int r = e / kChainCols, q = e % kChainCols;
    if (r < dk && q < cols) c.out[state + r * c.width + q] = xs[r][q];
  }
}

// elementwise_product_kernel: out[i] = a[i] * b[i] (diagonal maps compose).
__global__ void elementwise_product_kernel(int64_t n, const float* a, const float* b, float* out) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx < n) out[idx] = a[idx] * b[idx];
}

// transpose_kernel: Mt[m][j][i] = M[m][i][j], one thread per element.
__global__ void transpose_kernel(const float* M, float* Mt, int64_t maps, int64_t dk) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= maps * dk * dk) return;
  const int64_t m = idx / (dk * dk), i = (idx / dk) % dk, j = idx % dk;
  Mt[(m * dk + j) * dk + i] = M[idx];
}

// identity_kernel: out[m][i][j] = (i == j), Dk x Dv per map.
__global__ void identity_kernel(float* out, int64_t maps, int64_t dk, int64_t dv) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= maps * dk * dv) return;
  const int64_t i = (idx / dv) % dk, j = idx % dv;
  out[idx] = i == j ? 1.f : 0.f;
}

// nonfinite_kernel: adds the number of NaN/Inf elements among n elements of
// kBytes each (2 or 4) at `data` to *count. The test is on the raw bits (all
// exponent bits set: kMask per element), so nothing is converted. The inputs
// of a CP call are checked on every call (GBs at long sequences), so this
// streams at HBM bandwidth: 16-byte loads, four in flight per thread, bypassing
// L1 and marked evict-first; the `head` elements before the first 16-byte
// boundary and the tail after the last whole vector go one per thread.
// kLogGate (fp32 only): count the elements that are not log gates instead,
// NaN, +-Inf or > 0 (DESIGN §2): a positive float is a positive int32 (sign
// bit clear, some other bit set), +0 is 0 and -0 negative, so one integer
// compare beside the exponent test.
template <int kBytes, uint32_t kMask, bool kLogGate = false>
__device__ __forceinline__ int nonfinite_in_word(uint32_t w) {
  static_assert(!kLogGate || kBytes == 4, "log gates are fp32");
  if constexpr (kLogGate) {
    return (w & kMask) == kMask || static_cast<int32_t>(w) > 0 ? 1 : 0;
  } else if constexpr (kBytes == 4) {
    return (w & kMask) == kMask ? 1 : 0;
  } else {
    return ((w & kMask) == kMask ? 1 : 0) + (((w >> 16) & kMask) == kMask ? 1 : 0);
  }
}

template <int kBytes, uint32_t kMask, bool kLogGate>
__device__ __forceinline__ int nonfinite_in_vector(uint4 v) {
  return nonfinite_in_word<kBytes, kMask, kLogGate>(v.x) +
         nonfinite_in_word<kBytes, kMask, kLogGate>(v.y) +
         nonfinite_in_word<kBytes, kMask, kLogGate>(v.z) +
         nonfinite_in_word<kBytes, kMask, kLogGate>(v.w);
}

template <int kBytes, uint32_t kMask, bool kLogGate>
__device__ __forceinline__ int nonfinite_element(const unsigned char* data, int64_t i) {
  if constexpr (kBytes == 4) {
    return nonfinite_in_word<4, kMask, kLogGate>(*reinterpret_cast<const uint32_t*>(data + 4 * i));
  } else {
    return (*reinterpret_cast<const uint16_t*>(data + 2 * i) & kMask) == kMask ? 1 : 0;
  }
}

template <int kBytes, uint32_t kMask, bool kLogGate = false>
__global__ void nonfinite_kernel(const unsigned char* data, int64_t n, int64_t head,
                                 int64_t vectors, unsigned long long* count) {
  constexpr int64_t kPerVector = 16 / kBytes;
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tail = head + vectors * kPerVector;
  int mine = 0;
  if (tid < head) mine += nonfinite_element<kBytes, kMask, kLogGate>(data, tid);
  if (tid < n - tail) mine += nonfinite_element<kBytes, kMask, kLogGate>(data, tail + tid);
  const uint4* v = reinterpret_cast<const uint4*>(data + head * kBytes);
  int64_t i = tid;
  for (; i + 3 * stride < vectors; i += 4 * stride) {
    const uint4 a = __ldcs(v + i), b = __ldcs(v + i + stride), c = __ldcs(v + i + 2 * stride),
                d = __ldcs(v + i + 3 * stride);
    mine += nonfinite_in_vector<kBytes, kMask, kLogGate>(a) +
            nonfinite_in_vector<kBytes, kMask, kLogGate>(b) +
            nonfinite_in_vector<kBytes, kMask, kLogGate>(c) +
            nonfinite_in_vector<kBytes, kMask, kLogGate>(d);
  }
  for (; i < vectors; i += stride)
    mine += nonfinite_in_vector<kBytes, kMask, kLogGate>(__ldcs(v + i));
  // At most 4 * 8 per thread per pass: the warp's int sum cannot overflow
  // before it goes to the 64-bit total.
  for (int offset = 16; offset > 0; offset /= 2)
    mine += __shfl_down_sync(0xffffffffu, mine, offset);
  if ((threadIdx.x & 31) == 0 && mine != 0) atomicAdd(count, static_cast<unsigned long long>(mine));
}

}  // namespace

void multiply_maps(const MapsProduct& p, cudaStream_t stream) {
  SS_CHECK_ARG(p.maps >= 0 && p.dk >= 1 && p.width >= 1, "maps", "maps ", p.maps, ", Dk ", p.dk,
               ", width ", p.width);
  SS_CHECK_ARG(p.A != nullptr, "A", "must not be null");
  SS_CHECK_ARG(p.B != nullptr, "B", "must not be null");
  SS_CHECK_ARG(p.out != nullptr, "out", "must not be null");
  SS_CHECK_ARG(p.B != p.out, "out", "must not alias B (other tiles still read it)");
  // The maps run along grid.z (at most 65535): more go in several launches,
  // each on its slice of every operand (B * H of them reach that on a
  // delta rule's exchange, on some ranks only, so this cannot be an error).
  for (int64_t first = 0; first < p.maps; first += kMaxGridYZ) {
    MapsProduct slice = p;
    slice.maps = std::min(p.maps - first, kMaxGridYZ);
    slice.A = p.A + first * p.dk * p.dk;
    slice.B = p.B + first * p.stride_b;
    if (p.bias != nullptr) slice.bias = p.bias + first * p.stride_bias;
    slice.out = p.out + first * p.stride_out;
    const dim3 grid(static_cast<unsigned>((p.width + 31) / 32),
                    static_cast<unsigned>((p.dk + 31) / 32), static_cast<unsigned>(slice.maps));
    if (p.transpose_a)
      map_product_kernel<true><<<grid, dim3(16, 16), 0, stream>>>(slice);
    else
      map_product_kernel<false><<<grid, dim3(16, 16), 0, stream>>>(slice);
    SS_LAUNCH_CHECK("map_product_kernel");
  }
}

void chain_maps(const MapsChain* chains, int count, cudaStream_t stream) {
  SS_CHECK_ARG(chains != nullptr && (count == 1 || count == 2), "count", count,
               " chains in one launch (1 or 2)");
  MapsChainLaunch l;
  int64_t max_maps = 0, max_width = 0;
  for (int i = 0; i < count; ++i) {
    const MapsChain& c = chains[i];
    SS_CHECK_ARG(c.maps >= 0, "maps", c.maps, " maps");
    SS_CHECK_ARG(c.dk >= 1 && c.dk <= kChainRows && c.dk % 4 == 0, "dk",
                 "chained map products take Dk <= 128, a multiple of 4, got ", c.dk);
    SS_CHECK_ARG(c.width >= 1, "width", "must be positive, got ", c.width);
    SS_CHECK_ARG(c.steps >= 0 && c.steps <= kMaxChainSteps, "steps", c.steps, " steps (at most ",
                 kMaxChainSteps, ")");
    SS_CHECK_ARG(c.x0 != nullptr, "x0", "must not be null");
    SS_CHECK_ARG(c.out != nullptr, "out", "must not be null");
    for (int s = 0; s < c.steps; ++s)
      SS_CHECK_ARG(c.A[s] != nullptr, "A", "step ", s, "'s maps must not be null");
    l.chain[i] = c;
    max_maps = std::max(max_maps, c.maps);
    max_width = std::max(max_width, c.width);
  }
  // The maps run along grid.y: more than its limit go in slices, each chain
  // on its own maps of the slice (none once it has fewer).
  for (int64_t first = 0; first < max_maps; first += kMaxGridYZ) {
    MapsChainLaunch slice = l;
    for (int i = 0; i < count; ++i) {
      const MapsChain& c = l.chain[i];
      MapsChain& s = slice.chain[i];
      s.maps = std::clamp<int64_t>(c.maps - first, 0, kMaxGridYZ);
      if (s.maps == 0) continue;
      const int64_t state = first * c.dk * c.width, map = first * c.dk * c.dk;
      s.x0 = c.x0 + state;
      s.out = c.out + state;
      for (int st = 0; st < c.steps; ++st) {
        s.A[st] = c.A[st] + map;
        if (c.bias[st] != nullptr) s.bias[st] = c.bias[st] + state;
      }
    }
    const int64_t maps = std::min(max_maps - first, kMaxGridYZ);
    const dim3 grid(static_cast<unsigned>((max_width + kChainCols - 1) / kChainCols),
                    static_cast<unsigned>(maps), static_cast<unsigned>(count));
    maps_chain_kernel<<<grid, 256, 0, stream>>>(slice);
    SS_LAUNCH_CHECK("maps_chain_kernel");
  }
}

void apply_affine_maps(const DeviceMaps& maps, const float* in, float* out, int64_t col0,
                       int64_t width, cudaStream_t stream) {
  SS_CHECK_ARG(col0 >= 0 && width >= 1 && col0 + width <= maps.dv, "width", "columns [", col0, ", ",
               col0 + width, ") outside Dv = ", maps.dv);
  const int64_t n = maps.maps * maps.dk * width;
  if (n == 0) return;
  if (!maps.diagonal && in != nullptr) {
    MapsProduct mp = packed_maps_product(maps.maps, maps.dk, width);
    mp.A = maps.M;
    mp.B = in;
    mp.bias = maps.E + col0;  // columns [col0, col0 + width) of E's Dv
    mp.ld_bias = maps.dv;
    mp.stride_bias = maps.dk * maps.dv;
    mp.out = out;
    multiply_maps(mp, stream);
    return;
  }
  // Diagonal maps, or no incoming state (out = E's columns).
  affine_apply_kernel<<<blocks_for(n), kThreads, 0, stream>>>(maps.maps, maps.dk, width, maps.M, in,
                                                              width, maps.dk * width, maps.E + col0,
                                                              maps.dv, maps.dk * maps.dv, out);
  SS_LAUNCH_CHECK("affine_apply_kernel");
}

void compose_affine_maps(int64_t maps, int64_t dk, int64_t dv, bool diagonal, float* later_M,
                         float* later_E, const float* earlier_M, const float* earlier_E,
                         float* scratch, cudaStream_t stream) {
  const int64_t m_size = diagonal ? dk : dk * dk;
  float* new_E = scratch;
  float* new_M = scratch + maps * dk * dv;
  const int64_t ne = maps * dk * dv;
  if (ne == 0) return;
  const int64_t nm = maps * m_size;
  if (diagonal) {
    // E first: it reads M_l before M_l is replaced.
    affine_apply_kernel<<<blocks_for(ne), kThreads, 0, stream>>>(
        maps, dk, dv, later_M, earlier_E, dv, dk * dv, later_E, dv, dk * dv, new_E);
    SS_LAUNCH_CHECK("affine_apply_kernel");
    elementwise_product_kernel<<<blocks_for(nm), kThreads, 0, stream>>>(nm, later_M, earlier_M,
                                                                        new_M);
    SS_LAUNCH_CHECK("elementwise_product_kernel");
  } else {
    MapsProduct e = packed_maps_product(maps, dk, dv);  // E' = M_l E_e + E_l
    e.A = later_M;
    e.B = earlier_E;
    e.bias = later_E;
    e.out = new_E;
    multiply_maps(e, stream);
    MapsProduct m = packed_maps_product(maps, dk, dk);  // M' = M_l M_e
    m.A = later_M;
    m.B = earlier_M;
    m.out = new_M;
    multiply_maps(m, stream);
  }
  SS_CUDA_CHECK(
      cudaMemcpyAsync(later_E, new_E, ne * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  SS_CUDA_CHECK(
      cudaMemcpyAsync(later_M, new_M, nm * sizeof(float), cudaMemcpyDeviceToDevice, stream));
}

void transpose_maps(const float* M, float* Mt, int64_t maps, int64_t dk, cudaStream_t stream) {
  const int64_t n = maps * dk * dk;
  if (n == 0) return;
  transpose_kernel<<<blocks_for(n), kThreads, 0, stream>>>(M, Mt, maps, dk);
  SS_LAUNCH_CHECK("transpose_kernel");
}

void fill_identity(float* out, int64_t maps, int64_t dk, int64_t dv, cudaStream_t stream) {
  const int64_t n = maps * dk * dv;
  if (n == 0) return;
  identity_kernel<<<blocks_for(n), kThreads, 0, stream>>>(out, maps, dk, dv);
  SS_LAUNCH_CHECK("identity_kernel");
}

namespace {

// Spins (sleeping a microsecond between reads) until the global timer has
// moved `ns` nanoseconds past its first read.
__global__ void hold_kernel(uint64_t ns) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

}  // namespace

void hold_stream(cudaStream_t stream, double seconds) {
  SS_CHECK_ARG(seconds > 0 && seconds <= 1, "seconds", "is ", seconds, ", must be in (0, 1]");
  hold_kernel<<<1, 1, 0, stream>>>(static_cast<uint64_t>(seconds * 1e9));
  SS_LAUNCH_CHECK("hold_kernel");
}

namespace {

void count_bad(const void* data, int64_t n, DType dtype, bool log_gates, int64_t* count,
               cudaStream_t stream) {
  if (n == 0) return;
  const int bytes = dtype == DType::f32 ? 4 : 2;
  SS_CHECK_ARG(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16, "dtype",
               "finiteness check needs f32, bf16 or f16, got ", to_string(dtype));
  SS_CHECK_ARG(!log_gates || dtype == DType::f32, "dtype", "log gates are f32, got ",
               to_string(dtype));
  const auto address = reinterpret_cast<uintptr_t>(data);
  SS_CHECK_ARG(address % bytes == 0, "data", "is not aligned to its ", bytes, "-byte elements");
  // Elements before the first 16-byte boundary, then whole 16-byte vectors.
  const int64_t head = std::min<int64_t>(n, static_cast<int64_t>((16 - address % 16) % 16) / bytes);
  const int64_t vectors = (n - head) * bytes / 16;
  // Enough 256-thread blocks to keep HBM busy (8 per SM on an H200), fewer
  // for small arrays; the head and the tail (< 8 elements each) go to the
  // first threads, one element each.
  const int64_t want = std::max<int64_t>((vectors + kThreads - 1) / kThreads, 1);
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>(want, 8LL * multiprocessor_count()));
  auto* out = reinterpret_cast<unsigned long long*>(count);
  const auto* base = static_cast<const unsigned char*>(data);
  switch (dtype) {
    case DType::f32:
      if (log_gates)
        nonfinite_kernel<4, 0x7F800000u, true>
            <<<blocks, kThreads, 0, stream>>>(base, n, head, vectors, out);
      else
        nonfinite_kernel<4, 0x7F800000u>
            <<<blocks, kThreads, 0, stream>>>(base, n, head, vectors, out);
      break;
    case DType::bf16:
      nonfinite_kernel<2, 0x7F80u><<<blocks, kThreads, 0, stream>>>(base, n, head, vectors, out);
      break;
    default:  // f16
      nonfinite_kernel<2, 0x7C00u><<<blocks, kThreads, 0, stream>>>(base, n, head, vectors, out);
      break;
  }
  SS_LAUNCH_CHECK("nonfinite_kernel");
}

}  // namespace

void count_nonfinite(const void* data, int64_t n, DType dtype, int64_t* count,
                     cudaStream_t stream) {
  count_bad(data, n, dtype, /*log_gates=*/false, count, stream);
}

void count_bad_log_gates(const float* g, int64_t n, int64_t* count, cudaStream_t stream) {
  count_bad(g, n, DType::f32, /*log_gates=*/true, count, stream);
}

}  // namespace statescan::cuda
