// Helpers shared by the GPU kernels in tf_ops/gpu/: launch geometry, block lookup, error codes.
// Every launcher in launchers.h enqueues its kernels on the stream it is given and returns a
// cudaError_t (cudaSuccess, or the first launch error); it never synchronises.
#ifndef HVD_COMPRESS_TF_OPS_GPU_COMMON_CUH_
#define HVD_COMPRESS_TF_OPS_GPU_COMMON_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../cores.h"

namespace hvd_compress {
namespace gpu {

constexpr int kThreads = 256;

// Blocks for `work` items at one item per thread, capped (the kernels loop with a grid stride).
inline unsigned int Blocks(int64_t work) {
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 65535)));
}

// for (i in [0, n)) with a grid stride.
#define HC_GRID_LOOP(i, n)                                                                 \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// The block b with bounds[b] <= i < bounds[b + 1] (bounds: num_blocks + 1 increasing offsets).
__device__ inline int64_t BlockOf(const int64_t* bounds, int64_t num_blocks, int64_t i) {
  int64_t lo = 0, hi = num_blocks;  // bounds[lo] <= i < bounds[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (bounds[mid] <= i) lo = mid; else hi = mid;
  }
  return lo;
}

// BlockOf for element i of a grid-stride loop whose lanes take consecutive elements: the warp's first
// active lane searches, the others step on from its block (a few steps at most, for blocks of a few
// elements; none for large ones). Keeps the warp's loads and stores of consecutive elements together.
__device__ inline int64_t WarpBlockOf(const int64_t* bounds, int64_t num_blocks, int64_t i) {
  const unsigned int active = __activemask();
  const int leader = __ffs(active) - 1;
  const int64_t first = __shfl_sync(active, i, leader);
  int64_t b = (threadIdx.x & 31) == static_cast<unsigned int>(leader) ? BlockOf(bounds, num_blocks, first) : 0;
  b = __shfl_sync(active, b, leader);
  while (bounds[b + 1] <= i) ++b;
  return b;
}

inline cudaError_t Launched() { return cudaGetLastError(); }

}  // namespace gpu
}  // namespace hvd_compress

#endif  // HVD_COMPRESS_TF_OPS_GPU_COMMON_CUH_
