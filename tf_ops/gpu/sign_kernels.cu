// GPU kernels of the 1-bit sign ops (sign_ops.cc has the contracts; sign_kernels.cc the CPU kernels).
// The arithmetic is cores.h's, in the CPU kernels' order, so the results are the CPU's bits:
// - signs: one thread per packed byte (SignByte);
// - scales: a block's |x| sum is cut, as on the CPU, into pieces by the global kChunk grid and each
//   piece into 8 lanes; one thread sums one lane of one piece in order (LaneAbsSum), then one thread
//   per block adds its pieces' lanes in order (PieceAbsSum, BlockScale). Sequential lanes keep the
//   float64 sums bit-exact; the parallelism is pieces x 8. The pieces are planned on the device: each
//   block's count, then their offsets by a prefix sum (CUB), so no host work grows with the blocks.
// - the residual, decoding, means and the in-place subtraction: one thread per element (SignMeanAt),
//   its block looked up among its tile's bounds in shared memory (ForEachElementWithBlock).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/cub.cuh>

#include "common.cuh"
#include "launchers.h"

namespace hvd_compress {
namespace gpu {
namespace {

// At most this many pieces: every block, plus one for each chunk boundary a block crosses.
int64_t MaxPieces(int64_t n, int64_t num_blocks) { return num_blocks + NumChunks(n); }

// The workspace: piece counts and offsets (num_blocks + 1 each, int64), 8 lanes per piece (float64),
// then CUB's scan storage.
struct Workspace {
  int64_t* counts;
  int64_t* offset;
  double* lanes;
  void* scan;
  size_t scan_bytes;
};

size_t ScanBytes(int64_t num_blocks) {
  size_t bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
                                num_blocks + 1);
  return bytes;
}

Workspace Carve(void* memory, int64_t n, int64_t num_blocks) {
  Workspace w;
  w.counts = static_cast<int64_t*>(memory);
  w.offset = w.counts + num_blocks + 1;
  w.lanes = reinterpret_cast<double*>(w.offset + num_blocks + 1);
  w.scan = w.lanes + 8 * MaxPieces(n, num_blocks);
  w.scan_bytes = ScanBytes(num_blocks);
  return w;
}

__global__ void PieceCountsKernel(const int64_t* bounds, int64_t num_blocks, int64_t* counts) {
  HC_GRID_LOOP(b, num_blocks + 1) {
    counts[b] = b < num_blocks ? PiecesOfBlock(bounds[b], bounds[b + 1]) : 0;
  }
}

template <typename T>
__global__ void SignBytesKernel(const T* x, int64_t n, uint8_t* bits) {
  HC_GRID_LOOP(j, (n + 7) / 8) bits[j] = SignByte(FloatLoad<T>{x}, j * 8, n);
}

// Lane t % 8 of piece t / 8; piece p is piece p - offset[b] of its block b, the block's part of chunk
// bounds[b] / kChunk + (p - offset[b]).
template <typename T>
__global__ void LaneSumsKernel(const T* x, const int64_t* bounds, int64_t num_blocks, const int64_t* offset,
                               int64_t max_pieces, double* lanes) {
  const int64_t pieces = offset[num_blocks];
  HC_GRID_LOOP(t, max_pieces * 8) {
    const int64_t p = t / 8;
    if (p >= pieces) continue;
    const int64_t b = BlockOf(offset, num_blocks, p);
    const int64_t chunk = bounds[b] / kChunk + (p - offset[b]);
    const int64_t begin = max(bounds[b], chunk * kChunk), end = min(bounds[b + 1], (chunk + 1) * kChunk);
    lanes[t] = LaneAbsSum(FloatLoad<T>{x}, begin, end, static_cast<int>(t % 8));
  }
}

__global__ void ScalesKernel(const int64_t* bounds, const int64_t* offset, const double* lanes, int64_t num_blocks,
                             float* scales) {
  HC_GRID_LOOP(b, num_blocks) {
    double sum = 0;
    for (int64_t p = offset[b]; p < offset[b + 1]; ++p) sum += PieceAbsSum(lanes + 8 * p);
    scales[b] = BlockScale(sum, bounds[b + 1] - bounds[b]);
  }
}

__global__ void ResidualKernel(const float* x, const int64_t* bounds, int64_t num_blocks, int64_t n,
                               const float* scales, float* residual) {
  ForEachElementWithBlock(bounds, num_blocks, 0, n,
                          [&](int64_t i, int64_t b) { residual[i] = SignResidual(x[i], scales[b]); });
}

template <typename T>
int SignPack(const T* x, int64_t n, const int64_t* bounds, int64_t num_blocks, uint8_t* bits, float* scales,
             float* residual, void* workspace, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  Workspace w = Carve(workspace, n, num_blocks);
  const int64_t max_pieces = MaxPieces(n, num_blocks);
  PieceCountsKernel<<<Blocks(num_blocks + 1), kThreads, 0, stream>>>(bounds, num_blocks, w.counts);
  cudaError_t status = cub::DeviceScan::ExclusiveSum(w.scan, w.scan_bytes, w.counts, w.offset, num_blocks + 1, stream);
  if (status != cudaSuccess) return status;
  SignBytesKernel<<<Blocks((n + 7) / 8), kThreads, 0, stream>>>(x, n, bits);
  LaneSumsKernel<<<Blocks(max_pieces * 8), kThreads, 0, stream>>>(x, bounds, num_blocks, w.offset, max_pieces,
                                                                 w.lanes);
  ScalesKernel<<<Blocks(num_blocks), kThreads, 0, stream>>>(bounds, w.offset, w.lanes, num_blocks, scales);
  if (residual != nullptr) {
    ResidualKernel<<<TileBlocks(n), kThreads, 0, stream>>>(reinterpret_cast<const float*>(x), bounds, num_blocks, n,
                                                      scales, residual);
  }
  return Launched();
}

template <typename T>
__global__ void UnpackMeanKernel(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks,
                                 int64_t n, int64_t m, const float* plus, T* y) {
  const uint32_t* scale_bits = reinterpret_cast<const uint32_t*>(scales);
  const int64_t num_bytes = (n + 7) / 8;
  const float count = static_cast<float>(m);
  ForEachElementWithBlock(bounds, num_blocks, 0, n, [&](int64_t i, int64_t b) {
    const float mean = SignMeanAt(bits, num_bytes, scale_bits + b, num_blocks, m, count, i);
    y[i] = static_cast<T>(plus != nullptr ? mean + plus[i] : mean);
  });
}

template <typename T>
int SignUnpackMean(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks, int64_t n,
                   int64_t m, const float* plus, T* y, cudaStream_t stream) {
  if (m < 1) return cudaErrorInvalidValue;  // a mean of no payloads
  if (n == 0) return cudaSuccess;
  UnpackMeanKernel<T><<<TileBlocks(n), kThreads, 0, stream>>>(bits, scales, bounds, num_blocks, n, m, plus, y);
  return Launched();
}

__global__ void SubtractMeanKernel(const uint8_t* bits, const float* scales, const int64_t* bounds,
                                   int64_t num_blocks, int64_t n, int64_t m, int64_t offset, int64_t size,
                                   float* variable) {
  const uint32_t* scale_bits = reinterpret_cast<const uint32_t*>(scales);
  const int64_t num_bytes = (n + 7) / 8;
  const float count = static_cast<float>(m);
  ForEachElementWithBlock(bounds, num_blocks, offset, offset + size, [&](int64_t i, int64_t b) {
    variable[i - offset] -= SignMeanAt(bits, num_bytes, scale_bits + b, num_blocks, m, count, i);
  });
}

}  // namespace
}  // namespace gpu
}  // namespace hvd_compress

using namespace hvd_compress::gpu;  // NOLINT: the C launchers below are thin

extern "C" {

size_t hc_sign_pack_workspace_bytes(int64_t n, int64_t num_blocks) {
  return sizeof(int64_t) * 2 * (num_blocks + 1) + sizeof(double) * 8 * MaxPieces(n, num_blocks) +
         ScanBytes(num_blocks);
}

int hc_sign_pack_f32(const float* x, int64_t n, const int64_t* bounds, int64_t num_blocks, uint8_t* bits,
                     float* scales, float* residual, void* workspace, hc_stream stream) {
  return SignPack(x, n, bounds, num_blocks, bits, scales, residual, workspace, stream);
}

int hc_sign_pack_f16(const void* x, int64_t n, const int64_t* bounds, int64_t num_blocks, uint8_t* bits,
                     float* scales, void* workspace, hc_stream stream) {
  return SignPack(static_cast<const __half*>(x), n, bounds, num_blocks, bits, scales, nullptr, workspace, stream);
}

int hc_sign_pack_bf16(const void* x, int64_t n, const int64_t* bounds, int64_t num_blocks, uint8_t* bits,
                      float* scales, void* workspace, hc_stream stream) {
  return SignPack(static_cast<const __nv_bfloat16*>(x), n, bounds, num_blocks, bits, scales, nullptr, workspace,
                  stream);
}

int hc_sign_unpack_mean_f32(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks,
                            int64_t n, int64_t m, const float* plus, float* y, hc_stream stream) {
  return SignUnpackMean(bits, scales, bounds, num_blocks, n, m, plus, y, stream);
}

int hc_sign_unpack_mean_f16(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks,
                            int64_t n, int64_t m, const float* plus, void* y, hc_stream stream) {
  return SignUnpackMean(bits, scales, bounds, num_blocks, n, m, plus, static_cast<__half*>(y), stream);
}

int hc_sign_unpack_mean_bf16(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks,
                             int64_t n, int64_t m, const float* plus, void* y, hc_stream stream) {
  return SignUnpackMean(bits, scales, bounds, num_blocks, n, m, plus, static_cast<__nv_bfloat16*>(y), stream);
}

int hc_sign_subtract_mean(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks,
                          int64_t n, int64_t m, int64_t offset, int64_t size, float* variable, hc_stream stream) {
  if (m < 1) return cudaErrorInvalidValue;
  if (size == 0) return cudaSuccess;
  SubtractMeanKernel<<<TileBlocks(size), kThreads, 0, stream>>>(bits, scales, bounds, num_blocks, n, m, offset, size,
                                                            variable);
  return Launched();
}

}  // extern "C"
