// GPU kernels of the count-sketch ops (sketch_ops.cc has the contracts; sketch_kernels.cc the CPU kernels).
// Cells and signs come from sketch_hash.h (SketchCell), medians from cores.h (SketchMedian): the CPU kernels'
// integer and float arithmetic, so every result is the CPU's bits:
// - CountSketch: the CPU adds each cell's values (sign * x[i], in float32) in increasing i, from +0, one
//   thread per (row, region) (a region's cells take coordinates of one segment only). The GPU does it row by
//   row: one thread per coordinate writes its cell (column) and signed value; a stable radix sort by cell
//   (CUB's DeviceRadixSort: LSD passes keep equal keys in input order) brings every cell's values together in
//   increasing i; the thread at the first position of each cell's run adds the run in that order from +0 and
//   writes the cell (cells no coordinate hashes to stay +0 from a memset). No float atomics: bit for bit the
//   CPU's sums at any load. A cell of c values is one chain of c dependent additions, so a sketch whose cells
//   each take very many coordinates (cols far below n) is slow, as it is on the CPU. Workspace:
//   hc_count_sketch_workspace_bytes(n, cols) (16 n bytes plus CUB's), reused by every row.
// - CountSketchQuery: one thread per coordinate: its rows' values into registers (up to kMaxLocalRows rows)
//   and SketchMedian; for more rows, the value at each needed position of the same stable order, found by
//   ranks (no per-thread array; rows^2 hashes per coordinate).
// - CountSketchBuckets: one thread per (row, index).
// - CountSketch's loads (count_loads): one thread per (row, coordinate), an integer atomicAdd to its cell's count
//   (integer sums do not depend on their order).
// Limits: n < 2^32 and cols < 2^32 (32-bit cells and positions; cudaErrorInvalidValue otherwise).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/device/device_radix_sort.cuh>

#include "../sketch_hash.h"
#include "common.cuh"
#include "launchers.h"

namespace hvd_compress {
namespace gpu {
namespace {

constexpr int64_t kMaxItems = int64_t{0xFFFFFFFF};  // n and cols: 32-bit positions and cells
constexpr int kMaxLocalRows = 32;                   // rows a query thread keeps in registers / local memory

// The bits of a cell (column) in [0, cols): the radix sort's end_bit (at least 1).
int CellBits(int64_t cols) {
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) < cols) ++bits;
  return bits;
}

bool SketchSizesOk(int64_t n, int64_t rows, int64_t cols) {
  return n >= 0 && n <= kMaxItems && rows >= 1 && cols >= 1 && cols <= kMaxItems;
}

// The workspace of CountSketch: cells and values, twice (the sort's double buffers), then CUB's temporary storage.
struct SketchSpace {
  uint32_t* cells[2];
  float* values[2];
  void* temp;
  size_t temp_bytes;
};

size_t SortTempBytes(int64_t n, int64_t cols) {
  size_t bytes = 0;
  cub::DoubleBuffer<uint32_t> cells(nullptr, nullptr);
  cub::DoubleBuffer<float> values(nullptr, nullptr);
  if (cub::DeviceRadixSort::SortPairs(nullptr, bytes, cells, values, static_cast<uint32_t>(n), 0, CellBits(cols)) !=
      cudaSuccess) {
    return 0;
  }
  return bytes;
}

SketchSpace CarveSketchSpace(void* workspace, int64_t n, int64_t cols) {
  char* at = static_cast<char*>(workspace);
  SketchSpace space;
  const size_t array = AlignUp(sizeof(uint32_t) * static_cast<size_t>(n));  // 4-byte cells and values alike
  for (int b = 0; b < 2; ++b) {
    space.cells[b] = reinterpret_cast<uint32_t*>(at);
    at += array;
    space.values[b] = reinterpret_cast<float*>(at);
    at += array;
  }
  space.temp = at;
  space.temp_bytes = SortTempBytes(n, cols);
  return space;
}

size_t SketchWorkspaceBytes(int64_t n, int64_t cols) {
  if (n <= 0 || !SketchSizesOk(n, 1, cols)) return 0;
  return 4 * AlignUp(sizeof(uint32_t) * static_cast<size_t>(n)) + AlignUp(SortTempBytes(n, cols));
}

// Row `row_key`'s cell and signed value of every coordinate: cells[i], values[i] = s(i) * x[i].
template <typename T>
__global__ void CellsKernel(const T* x, int64_t n, Regions regions, uint64_t row_key, uint32_t* cells,
                            float* values) {
  const FloatLoad<T> load{x};
  HC_GRID_LOOP(i, n) {
    const BucketSign h = SketchCell(regions, row_key, i);
    cells[i] = static_cast<uint32_t>(h.bucket);
    values[i] = h.sign * load(i);
  }
}

// cells sorted (stably) with their values: the first position of each cell's run adds the run's values in
// order, from +0, into row[cell].
__global__ void CellSumsKernel(const uint32_t* cells, const float* values, int64_t n, float* row) {
  HC_GRID_LOOP(p, n) {
    const uint32_t cell = cells[p];
    if (p > 0 && cells[p - 1] == cell) continue;
    float sum = 0.0f;
    int64_t q = p;
    do {
      sum += values[q];
      ++q;
    } while (q < n && cells[q] == cell);
    row[cell] = sum;
  }
}

template <typename T>
int CountSketch(const T* x, int64_t n, int64_t seed, int64_t step, int64_t rows, int64_t cols, float* sketch,
                void* workspace, cudaStream_t stream) {
  if (!SketchSizesOk(n, rows, cols)) return cudaErrorInvalidValue;
  cudaError_t status = cudaMemsetAsync(sketch, 0, sizeof(float) * static_cast<size_t>(rows * cols), stream);
  if (status != cudaSuccess || n == 0) return status;
  const SketchSpace space = CarveSketchSpace(workspace, n, cols);
  if (space.temp_bytes == 0) return cudaErrorInvalidValue;
  const Regions regions = RegionsOf(n, cols);
  const int64_t hash_seed = SketchSeed(seed, step);
  const int bits = CellBits(cols);
  for (int64_t j = 0; j < rows; ++j) {
    CellsKernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, regions, RowKey(hash_seed, j), space.cells[0],
                                                    space.values[0]);
    if ((status = Launched()) != cudaSuccess) return status;
    cub::DoubleBuffer<uint32_t> cells(space.cells[0], space.cells[1]);
    cub::DoubleBuffer<float> values(space.values[0], space.values[1]);
    size_t temp_bytes = space.temp_bytes;
    status = cub::DeviceRadixSort::SortPairs(space.temp, temp_bytes, cells, values, static_cast<uint32_t>(n), 0,
                                             bits, stream);
    if (status != cudaSuccess) return status;
    CellSumsKernel<<<Blocks(n), kThreads, 0, stream>>>(cells.Current(), values.Current(), n, sketch + j * cols);
    if ((status = Launched()) != cudaSuccess) return status;
  }
  return cudaSuccess;
}

// Row j's value of coordinate i: its sign times its cell.
__device__ inline float RowValue(const float* sketch, int64_t cols, const Regions& regions, uint64_t row_key,
                                 int64_t j, int64_t i) {
  const BucketSign h = SketchCell(regions, row_key, i);
  return h.sign * sketch[j * cols + h.bucket];
}

// kRows > 0: a sketch of kRows rows (unrolled); kRows == 0: of `rows` <= kMaxLocalRows rows.
template <int kRows>
__global__ void QueryKernel(const float* sketch, int64_t rows, int64_t cols, int64_t n, int64_t hash_seed,
                            float* estimate) {
  __shared__ uint64_t keys[kRows > 0 ? kRows : kMaxLocalRows];
  const int64_t r = kRows > 0 ? kRows : rows;
  for (int64_t j = threadIdx.x; j < r; j += blockDim.x) keys[j] = RowKey(hash_seed, j);
  __syncthreads();
  const Regions regions = RegionsOf(n, cols);
  HC_GRID_LOOP(i, n) {
    float v[kRows > 0 ? kRows : kMaxLocalRows];
#pragma unroll
    for (int64_t j = 0; j < (kRows > 0 ? kRows : kMaxLocalRows); ++j) {
      if (kRows > 0 || j < r) v[j] = RowValue(sketch, cols, regions, keys[j], j, i);
    }
    estimate[i] = SketchMedian(v, r);
  }
}

// The value MedianBySort's stable insertion sort puts at position k of value(0), ..., value(rows - 1), with no
// array: value a lands at the number of values that sort before it plus the number of earlier rows that tie
// with it (MedianSortsBefore is a strict weak order, so these positions are a permutation of [0, rows)).
template <typename Value>
HC_HOST_DEVICE inline float StableRankValue(const Value& value, int64_t rows, int64_t k) {
  for (int64_t a = 0; a < rows; ++a) {
    const float va = value(a);
    int64_t position = 0;
    for (int64_t b = 0; b < rows; ++b) {
      if (b == a) continue;
      const float vb = value(b);
      position += (MedianSortsBefore(vb, va) || (b < a && !MedianSortsBefore(va, vb))) ? 1 : 0;
    }
    if (position == k) return va;
  }
  return BitsFloat(0x7fc00000u);  // not reached
}

// MedianBySort of the rows' values by StableRankValue: for rows > kMaxLocalRows.
template <typename Value>
HC_HOST_DEVICE inline float RankMedian(const Value& value, int64_t rows) {
  if (rows % 2) return StableRankValue(value, rows, rows / 2);
  return (StableRankValue(value, rows, rows / 2 - 1) + StableRankValue(value, rows, rows / 2)) / 2.0f;
}

__global__ void QueryManyRowsKernel(const float* sketch, int64_t rows, int64_t cols, int64_t n, int64_t hash_seed,
                                    float* estimate) {
  const Regions regions = RegionsOf(n, cols);
  HC_GRID_LOOP(i, n) {
    const auto value = [&](int64_t j) { return RowValue(sketch, cols, regions, RowKey(hash_seed, j), j, i); };
    estimate[i] = RankMedian(value, rows);
  }
}

int CountSketchQuery(const float* sketch, int64_t rows, int64_t cols, int64_t n, int64_t seed, int64_t step,
                     float* estimate, cudaStream_t stream) {
  if (n < 0 || rows < 1 || cols < 1) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int64_t hash_seed = SketchSeed(seed, step);
  const unsigned int blocks = Blocks(n);
  switch (rows) {
    case 1: QueryKernel<1><<<blocks, kThreads, 0, stream>>>(sketch, rows, cols, n, hash_seed, estimate); break;
    case 2: QueryKernel<2><<<blocks, kThreads, 0, stream>>>(sketch, rows, cols, n, hash_seed, estimate); break;
    case 3: QueryKernel<3><<<blocks, kThreads, 0, stream>>>(sketch, rows, cols, n, hash_seed, estimate); break;
    case 4: QueryKernel<4><<<blocks, kThreads, 0, stream>>>(sketch, rows, cols, n, hash_seed, estimate); break;
    case 5: QueryKernel<5><<<blocks, kThreads, 0, stream>>>(sketch, rows, cols, n, hash_seed, estimate); break;
    case 6: QueryKernel<6><<<blocks, kThreads, 0, stream>>>(sketch, rows, cols, n, hash_seed, estimate); break;
    case 7: QueryKernel<7><<<blocks, kThreads, 0, stream>>>(sketch, rows, cols, n, hash_seed, estimate); break;
    default:
      if (rows <= kMaxLocalRows) {
        QueryKernel<0><<<blocks, kThreads, 0, stream>>>(sketch, rows, cols, n, hash_seed, estimate);
      } else {
        QueryManyRowsKernel<<<blocks, kThreads, 0, stream>>>(sketch, rows, cols, n, hash_seed, estimate);
      }
  }
  return Launched();
}

__global__ void BucketsKernel(const int64_t* indices, int64_t m, int64_t n, int64_t hash_seed, int64_t rows,
                              int64_t cols, int64_t* buckets) {
  const Regions regions = RegionsOf(n, cols);
  HC_GRID_LOOP(t, rows * m) {
    const int64_t j = t / m, index = indices[t % m];
    buckets[t] = index >= 0 && index < n ? SketchCell(regions, RowKey(hash_seed, j), index).bucket : -1;
  }
}

__global__ void LoadsKernel(int64_t n, int64_t hash_seed, int64_t rows, int64_t cols, int32_t* loads) {
  const Regions regions = RegionsOf(n, cols);
  HC_GRID_LOOP(t, rows * n) {
    const int64_t j = t / n, i = t % n;
    atomicAdd(loads + j * cols + SketchCell(regions, RowKey(hash_seed, j), i).bucket, 1);
  }
}

int CountSketchLoads(int64_t n, int64_t seed, int64_t step, int64_t rows, int64_t cols, int32_t* loads,
                     cudaStream_t stream) {
  if (!SketchSizesOk(n, rows, cols) || n > int64_t{0x7FFFFFFF}) return cudaErrorInvalidValue;
  const cudaError_t status = cudaMemsetAsync(loads, 0, sizeof(int32_t) * static_cast<size_t>(rows * cols), stream);
  if (status != cudaSuccess || n == 0) return status;
  LoadsKernel<<<Blocks(rows * n), kThreads, 0, stream>>>(n, SketchSeed(seed, step), rows, cols, loads);
  return Launched();
}

int CountSketchBuckets(const int64_t* indices, int64_t m, int64_t n, int64_t seed, int64_t step, int64_t rows,
                       int64_t cols, int64_t* buckets, cudaStream_t stream) {
  if (m < 0 || n < 0 || rows < 1 || cols < 1) return cudaErrorInvalidValue;
  if (m == 0) return cudaSuccess;
  BucketsKernel<<<Blocks(rows * m), kThreads, 0, stream>>>(indices, m, n, SketchSeed(seed, step), rows, cols,
                                                           buckets);
  return Launched();
}

}  // namespace
}  // namespace gpu
}  // namespace hvd_compress

using namespace hvd_compress::gpu;  // NOLINT: the C launchers below are thin

extern "C" {

size_t hc_count_sketch_workspace_bytes(int64_t n, int64_t cols) { return SketchWorkspaceBytes(n, cols); }

int hc_count_sketch_f32(const float* x, int64_t n, int64_t seed, int64_t step, int64_t rows, int64_t cols,
                        float* sketch, void* workspace, hc_stream stream) {
  return CountSketch(x, n, seed, step, rows, cols, sketch, workspace, stream);
}

int hc_count_sketch_f16(const void* x, int64_t n, int64_t seed, int64_t step, int64_t rows, int64_t cols,
                        float* sketch, void* workspace, hc_stream stream) {
  return CountSketch(static_cast<const __half*>(x), n, seed, step, rows, cols, sketch, workspace, stream);
}

int hc_count_sketch_bf16(const void* x, int64_t n, int64_t seed, int64_t step, int64_t rows, int64_t cols,
                         float* sketch, void* workspace, hc_stream stream) {
  return CountSketch(static_cast<const __nv_bfloat16*>(x), n, seed, step, rows, cols, sketch, workspace, stream);
}

int hc_count_sketch_loads(int64_t n, int64_t seed, int64_t step, int64_t rows, int64_t cols, int32_t* loads,
                          hc_stream stream) {
  return CountSketchLoads(n, seed, step, rows, cols, loads, stream);
}

int hc_count_sketch_query(const float* sketch, int64_t rows, int64_t cols, int64_t n, int64_t seed, int64_t step,
                          float* estimate, hc_stream stream) {
  return CountSketchQuery(sketch, rows, cols, n, seed, step, estimate, stream);
}

int hc_count_sketch_buckets(const int64_t* indices, int64_t m, int64_t n, int64_t seed, int64_t step, int64_t rows,
                            int64_t cols, int64_t* buckets, hc_stream stream) {
  return CountSketchBuckets(indices, m, n, seed, step, rows, cols, buckets, stream);
}

}  // extern "C"
