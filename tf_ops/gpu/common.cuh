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
// Alignment of the parts of a workspace.
constexpr size_t kAlign = 256;

inline size_t AlignUp(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Blocks for `work` items at one item per thread, capped (the kernels loop with a grid stride).
inline unsigned int Blocks(int64_t work) {
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 65535)));
}

// for (i in [0, n)) with a grid stride.
#define HC_GRID_LOOP(i, n)                                                                 \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// The block b with bounds[b] <= i < bounds[b + 1], given bounds[lo] <= i < bounds[hi] (a binary search).
__host__ __device__ inline int64_t BlockIn(const int64_t* bounds, int64_t lo, int64_t hi, int64_t i) {
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (bounds[mid] <= i) lo = mid; else hi = mid;
  }
  return lo;
}

// The block b with bounds[b] <= i < bounds[b + 1] (bounds: num_blocks + 1 strictly increasing offsets from 0
// to n, as ValidateBounds checks on the CPU; the launchers trust them).
__device__ inline int64_t BlockOf(const int64_t* bounds, int64_t num_blocks, int64_t i) {
  return BlockIn(bounds, 0, num_blocks, i);
}

// The block of element i, searching forward from block `from` (bounds[from] <= i): steps that double, then
// a binary search; a few loads when i's block is near.
__device__ inline int64_t BlockFrom(const int64_t* bounds, int64_t num_blocks, int64_t from, int64_t i) {
  int64_t lo = from, hi = from + 1, step = 1;  // bounds[lo] <= i
  while (hi < num_blocks && bounds[hi] <= i) {
    lo = hi;
    step *= 2;
    hi = min(num_blocks, lo + step);
  }
  return BlockIn(bounds, lo, hi, i);  // bounds[lo] <= i < bounds[hi] (bounds[num_blocks] = n > i)
}

// Thread blocks for ForEachElementWithBlock over `work` elements: each takes a contiguous run of tiles.
inline unsigned int TileBlocks(int64_t work) {
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 4096)));
}

// Calls body(i, b) for every element i in [begin, end), b its block (bounds[b] <= i < bounds[b + 1]). Each
// thread block (kThreads threads, TileBlocks(end - begin) of them) takes a contiguous run of tiles of kThreads
// elements; per tile, one thread finds the first and last block from the previous tile's (BlockFrom), the
// tile's bounds go to shared memory, and each thread searches there: no per-element search of the global
// bounds, whose blocks may be many and small.
template <typename Body>
__device__ inline void ForEachElementWithBlock(const int64_t* bounds, int64_t num_blocks, int64_t begin, int64_t end,
                                               Body&& body) {
  __shared__ int64_t local[kThreads + 1];
  __shared__ int64_t first, count;
  const int64_t tiles = (end - begin + kThreads - 1) / kThreads;
  const int64_t per_block = (tiles + gridDim.x - 1) / gridDim.x;
  const int64_t tile_lo = blockIdx.x * per_block, tile_hi = min(tiles, tile_lo + per_block);
  int64_t from = tile_lo < tile_hi ? BlockOf(bounds, num_blocks, begin + tile_lo * kThreads) : 0;
  for (int64_t tile = tile_lo; tile < tile_hi; ++tile) {
    const int64_t lo = begin + tile * kThreads, hi = min(end, lo + kThreads);
    if (threadIdx.x == 0) {
      const int64_t b0 = BlockFrom(bounds, num_blocks, from, lo);
      from = BlockFrom(bounds, num_blocks, b0, hi - 1);
      first = b0;
      count = from - b0 + 1;  // at most kThreads blocks: every block holds an element
    }
    __syncthreads();
    for (int64_t j = threadIdx.x; j <= count; j += blockDim.x) local[j] = bounds[first + j];
    __syncthreads();
    const int64_t i = lo + threadIdx.x;
    if (i < hi) {
      body(i, first + BlockIn(local, 0, count, i));
    }
    __syncthreads();  // before the next tile's bounds replace these
  }
}

inline cudaError_t Launched() { return cudaGetLastError(); }

}  // namespace gpu
}  // namespace hvd_compress

#endif  // HVD_COMPRESS_TF_OPS_GPU_COMMON_CUH_
