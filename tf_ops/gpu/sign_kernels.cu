// GPU kernels of the 1-bit sign ops (sign_ops.cc has the contracts; sign_kernels.cc the CPU kernels).
// The arithmetic is cores.h's, in the CPU kernels' order, so the results are the CPU's bits:
// - signs: one thread per packed byte (SignByte);
// - scales: a block's |x| sum is cut, as on the CPU, into pieces by the global kChunk grid and each
//   piece into 8 lanes; one thread sums one lane of one piece in order (LaneAbsSum), then one thread
//   per block adds its pieces' lanes in order (PieceAbsSum, BlockScale). Sequential lanes keep the
//   float64 sums bit-exact; the parallelism is pieces x 8.
// - decoding, means and the in-place subtraction: one thread per element (SignMeanAt).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <vector>

#include "common.cuh"
#include "launchers.h"

namespace hvd_compress {
namespace gpu {
namespace {

// The pieces of every block: piece p covers [begin[p], end[p]); block b's are offset[b] .. offset[b + 1].
struct PiecePlan {
  std::vector<int64_t> begin, end, offset;
};

PiecePlan PlanPieces(const int64_t* bounds, int64_t num_blocks) {
  PiecePlan plan;
  plan.offset.push_back(0);
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int64_t c = bounds[b] / kChunk; c <= (bounds[b + 1] - 1) / kChunk; ++c) {
      plan.begin.push_back(std::max(bounds[b], c * kChunk));
      plan.end.push_back(std::min(bounds[b + 1], (c + 1) * kChunk));
    }
    plan.offset.push_back(static_cast<int64_t>(plan.begin.size()));
  }
  return plan;
}

int64_t NumPieces(const int64_t* bounds, int64_t num_blocks) {
  int64_t pieces = 0;
  for (int64_t b = 0; b < num_blocks; ++b) pieces += (bounds[b + 1] - 1) / kChunk - bounds[b] / kChunk + 1;
  return pieces;
}

template <typename T>
__global__ void SignBytesKernel(const T* x, int64_t n, uint8_t* bits) {
  HC_GRID_LOOP(j, (n + 7) / 8) bits[j] = SignByte(FloatLoad<T>{x}, j * 8, n);
}

template <typename T>
__global__ void LaneSumsKernel(const T* x, const int64_t* begin, const int64_t* end, int64_t pieces, double* lanes) {
  HC_GRID_LOOP(t, pieces * 8) lanes[t] = LaneAbsSum(FloatLoad<T>{x}, begin[t / 8], end[t / 8], static_cast<int>(t % 8));
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
  HC_GRID_LOOP(i, n) residual[i] = SignResidual(x[i], scales[BlockOf(bounds, num_blocks, i)]);
}

template <typename T>
int SignPack(const T* x, const int64_t* bounds_host, int64_t num_blocks, uint8_t* bits, float* scales,
             float* residual, void* workspace, cudaStream_t stream) {
  const int64_t n = bounds_host[num_blocks];
  if (n == 0) return cudaSuccess;
  const PiecePlan plan = PlanPieces(bounds_host, num_blocks);
  const int64_t pieces = static_cast<int64_t>(plan.begin.size());
  // Workspace: bounds, piece begins, piece ends, piece offsets (int64), then 8 lanes per piece (float64).
  std::vector<int64_t> table(bounds_host, bounds_host + num_blocks + 1);
  table.insert(table.end(), plan.begin.begin(), plan.begin.end());
  table.insert(table.end(), plan.end.begin(), plan.end.end());
  table.insert(table.end(), plan.offset.begin(), plan.offset.end());
  int64_t* device_table = static_cast<int64_t*>(workspace);
  cudaError_t status = cudaMemcpyAsync(device_table, table.data(), table.size() * sizeof(int64_t),
                                       cudaMemcpyHostToDevice, stream);  // staged before it returns
  if (status != cudaSuccess) return status;
  const int64_t* bounds = device_table;
  const int64_t* begin = bounds + num_blocks + 1;
  const int64_t* end = begin + pieces;
  const int64_t* offset = end + pieces;
  double* lanes = reinterpret_cast<double*>(device_table + table.size());
  SignBytesKernel<<<Blocks((n + 7) / 8), kThreads, 0, stream>>>(x, n, bits);
  LaneSumsKernel<<<Blocks(pieces * 8), kThreads, 0, stream>>>(x, begin, end, pieces, lanes);
  ScalesKernel<<<Blocks(num_blocks), kThreads, 0, stream>>>(bounds, offset, lanes, num_blocks, scales);
  if (residual != nullptr) {
    ResidualKernel<<<Blocks(n), kThreads, 0, stream>>>(reinterpret_cast<const float*>(x), bounds, num_blocks, n,
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
  HC_GRID_LOOP(i, n) {
    const int64_t b = BlockOf(bounds, num_blocks, i);
    const float mean = SignMeanAt(bits, num_bytes, scale_bits + b, num_blocks, m, count, i);
    y[i] = static_cast<T>(plus != nullptr ? mean + plus[i] : mean);
  }
}

template <typename T>
int SignUnpackMean(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks, int64_t n,
                   int64_t m, const float* plus, T* y, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  UnpackMeanKernel<T><<<Blocks(n), kThreads, 0, stream>>>(bits, scales, bounds, num_blocks, n, m, plus, y);
  return Launched();
}

__global__ void SubtractMeanKernel(const uint8_t* bits, const float* scales, const int64_t* bounds,
                                   int64_t num_blocks, int64_t n, int64_t m, int64_t offset, int64_t size,
                                   float* variable) {
  const uint32_t* scale_bits = reinterpret_cast<const uint32_t*>(scales);
  const int64_t num_bytes = (n + 7) / 8;
  const float count = static_cast<float>(m);
  HC_GRID_LOOP(j, size) {
    const int64_t i = offset + j;
    variable[j] -= SignMeanAt(bits, num_bytes, scale_bits + BlockOf(bounds, num_blocks, i), num_blocks, m, count, i);
  }
}

}  // namespace
}  // namespace gpu
}  // namespace hvd_compress

using namespace hvd_compress::gpu;  // NOLINT: the C launchers below are thin

extern "C" {

size_t hc_sign_pack_workspace_bytes(const int64_t* bounds_host, int64_t num_blocks) {
  const int64_t pieces = NumPieces(bounds_host, num_blocks);
  return sizeof(int64_t) * (2 * (num_blocks + 1) + 2 * pieces) + sizeof(double) * 8 * pieces;
}

int hc_sign_pack_f32(const float* x, const int64_t* bounds_host, int64_t num_blocks, uint8_t* bits, float* scales,
                     float* residual, void* workspace, hc_stream stream) {
  return SignPack(x, bounds_host, num_blocks, bits, scales, residual, workspace, stream);
}

int hc_sign_pack_f16(const void* x, const int64_t* bounds_host, int64_t num_blocks, uint8_t* bits, float* scales,
                     void* workspace, hc_stream stream) {
  return SignPack(static_cast<const __half*>(x), bounds_host, num_blocks, bits, scales, nullptr, workspace, stream);
}

int hc_sign_pack_bf16(const void* x, const int64_t* bounds_host, int64_t num_blocks, uint8_t* bits, float* scales,
                      void* workspace, hc_stream stream) {
  return SignPack(static_cast<const __nv_bfloat16*>(x), bounds_host, num_blocks, bits, scales, nullptr, workspace,
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
  if (size == 0) return cudaSuccess;
  SubtractMeanKernel<<<Blocks(size), kThreads, 0, stream>>>(bits, scales, bounds, num_blocks, n, m, offset, size,
                                                            variable);
  return Launched();
}

}  // extern "C"
