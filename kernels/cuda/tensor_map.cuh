// Host-side TMA descriptors (CUtensorMap) over 16-bit arrays, encoded through
// the driver entry point the runtime hands out (no libcuda link): the chunk
// kernels' tiles (chunk_forward.cuh) and LaCT's fused hidden layer
// (lact_hidden.cu).
#pragma once

#include <cuda.h>          // CUtensorMap
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/error.h"

namespace statescan::cuda::detail {

// cuTensorMapEncodeTiled, resolved once through the runtime.
inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  using Encode = PFN_cuTensorMapEncodeTiled_v12000;
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    SS_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                   cudaEnableDefault, &found));
#else  // deprecated from 12.5 on
    SS_CUDA_CHECK(
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found));
#endif
    SS_CHECK_ARG(found == cudaDriverEntryPointSuccess && fn != nullptr, "driver",
                 "has no cuTensorMapEncodeTiled (needs CUDA 12)");
    return reinterpret_cast<Encode>(fn);
  }();
  return encode;
}

// A 2D tensor map (TMA) over a row-major [rows][cols] array of 16-bit
// elements, boxes of box_rows x box_cols; a box may reach past a row's end
// (box_cols > cols) and those columns arrive as zeros: the tiles' 16 bytes of
// row padding in shared memory come with the tile in one copy. `arg` names
// the array in the error when the driver refuses the map.
inline CUtensorMap tile_map_2d(const void* base, int64_t rows, int64_t cols, int box_cols,
                               int box_rows,
                               CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE,
                               const char* arg = "workspace") {
  const auto encode = encode_tiled();
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<void*>(base), dims,
                            strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  SS_CHECK_ARG(r == CUDA_SUCCESS, arg, "cuTensorMapEncodeTiled failed (", static_cast<int>(r),
               ") for a [", rows, "][", cols, "] tile array, box ", box_rows, " x ", box_cols);
  return map;
}

// A 3D tensor map over 16-bit elements: dims[0] contiguous, dims[1] and
// dims[2] `strides` bytes apart (multiples of 16, ascending), boxes of box[]
// with the 128-byte swizzle; coordinates past a dimension arrive as zeros.
inline CUtensorMap tile_map_3d(const void* base, const int64_t (&dims)[3],
                               const int64_t (&strides)[2], const int (&box)[3], const char* arg) {
  CUtensorMap map;
  const cuuint64_t d[3] = {static_cast<cuuint64_t>(dims[0]), static_cast<cuuint64_t>(dims[1]),
                           static_cast<cuuint64_t>(dims[2])};
  const cuuint64_t st[2] = {static_cast<cuuint64_t>(strides[0]),
                            static_cast<cuuint64_t>(strides[1])};
  const cuuint32_t b[3] = {static_cast<cuuint32_t>(box[0]), static_cast<cuuint32_t>(box[1]),
                           static_cast<cuuint32_t>(box[2])};
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUresult r =
      encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(base), d, st, b,
                     unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  SS_CHECK_ARG(r == CUDA_SUCCESS, arg, "cuTensorMapEncodeTiled failed (", static_cast<int>(r),
               ") for a [", dims[2], "][", dims[1], "][", dims[0], "] array, strides ", strides[0],
               " and ", strides[1], " bytes");
  return map;
}

}  // namespace statescan::cuda::detail
