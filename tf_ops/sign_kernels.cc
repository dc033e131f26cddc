// CPU kernels for BlockSignPack (and BlockSignCompress), BlockSignUnpack,
// BlockSignUnpackMean and ResourceSubtractBlockSignMean.
// See sign_ops.cc for the op contracts and blocks.h for the deterministic
// chunking: both passes run over fixed global chunks of kChunk elements, so
// the scales are bit-identical for any number of threads.
#include <cmath>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <cstring>
#include <vector>

#include "blocks.h"
#include "op_checks.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"

namespace hvd_compress {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::TensorShape;

namespace {

// Sum of |x[0:len]| in float64 in cores.h's lane order (LaneAbsSums, PieceAbsSum).
template <typename T>
double AbsSum(const T* x, int64_t len) {
  double lanes[8];
  LaneAbsSums(FloatLoad<T>{x}, 0, len, lanes);
  return PieceAbsSum(lanes);
}

#if defined(__AVX__)
// float32 fast path, same lane order: lanes 0-3 in low, 4-7 in high.
template <>
double AbsSum<float>(const float* x, int64_t len) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 v = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
    low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  }
  double lane[8];
  _mm256_storeu_pd(lane, low);
  _mm256_storeu_pd(lane + 4, high);
  for (int l = 0; i + l < len; ++l) lane[l] += std::fabs(static_cast<double>(x[i + l]));
  double sum = 0;
  for (int l = 0; l < 8; ++l) sum += lane[l];
  return sum;
}
#endif

// Packs x[begin:end) (begin a multiple of 8) into bits[begin/8 : ...].
template <typename T>
void PackSigns(const T* x, int64_t begin, int64_t end, uint8_t* bits) {
  for (int64_t i = begin; i < end; i += 8) bits[i >> 3] = SignByte(FloatLoad<T>{x}, i, end);
}

#if defined(__AVX__)
template <>
void PackSigns<float>(const float* x, int64_t begin, int64_t end, uint8_t* bits) {
  const __m256 zero = _mm256_setzero_ps();
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {  // x < 0 is false for -0 and NaN, as sign(.) wants
    bits[i >> 3] = static_cast<uint8_t>(
        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), zero, _CMP_LT_OQ)));
  }
  if (i < end) bits[i >> 3] = SignByte(FloatLoad<float>{x}, i, end);
}
#endif

// kSignMasks.m[byte][l] has the float sign bit set when bit l of byte is set: XOR it onto the
// bits of a scale to get that element's +-scale (cores.h's SignedScale, eight at a time).
struct SignMasks {
  uint32_t m[256][8];
  constexpr SignMasks() : m() {
    for (int byte = 0; byte < 256; ++byte) {
      for (int l = 0; l < 8; ++l) m[byte][l] = ((byte >> l) & 1u) << 31;
    }
  }
};
constexpr SignMasks kSignMasks;

// out[i] = +-scale for i in [begin, end), sign from bit i of bits.
// Branch-free, eight elements per packed byte in the aligned middle.
template <typename T>
void DecodeSigns(const uint8_t* bits, float scale, int64_t begin, int64_t end, T* out) {
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &scale, sizeof(scale_bits));
  auto one = [&](int64_t i) { out[i] = static_cast<T>(SignedScale(scale_bits, BitAt(bits, i))); };
  int64_t i = begin;
  for (; i < end && (i & 7) != 0; ++i) one(i);
  for (; i + 8 <= end; i += 8) {
    const uint32_t* mask = kSignMasks.m[bits[i >> 3]];
    for (int l = 0; l < 8; ++l) out[i + l] = static_cast<T>(BitsFloat(scale_bits ^ mask[l]));
  }
  for (; i < end; ++i) one(i);
}

// SignMeanAt (cores.h) for the 8 kBytes elements of packed bytes byte .. byte + kBytes - 1, into
// mean[0 .. 8 kBytes), with the same float32 operations in the same order (AVX: eight at a time, kBytes sums in
// registers, each payload's scale broadcast once for them, the sums divided by CountDivisor).
#if defined(__AVX__)
using MeanDivisor = CountDivisor;
#else
using MeanDivisor = float;
#endif
template <int kBytes>
inline void MeanOfBytes(const uint8_t* bits, int64_t num_bytes, const uint32_t* scale_bits, int64_t m,
                        const MeanDivisor& count, int64_t byte, float* __restrict mean) {
#if defined(__AVX__)
  __m256 sum[kBytes];
  for (int k = 0; k < kBytes; ++k) sum[k] = _mm256_setzero_ps();
  for (int64_t r = 0; r < m; ++r) {
    const __m256 scale = _mm256_castsi256_ps(_mm256_set1_epi32(scale_bits[r]));
    const uint8_t* row = bits + r * num_bytes + byte;
    for (int k = 0; k < kBytes; ++k) {
      const __m256 mask = _mm256_loadu_ps(reinterpret_cast<const float*>(kSignMasks.m[row[k]]));
      sum[k] = _mm256_add_ps(sum[k], _mm256_xor_ps(scale, mask));
    }
  }
  for (int k = 0; k < kBytes; ++k) _mm256_storeu_ps(mean + 8 * k, count(sum[k]));
#else
  float sum[8 * kBytes] = {};
  for (int64_t r = 0; r < m; ++r) {
    for (int k = 0; k < kBytes; ++k) {
      const uint32_t* mask = kSignMasks.m[bits[r * num_bytes + byte + k]];
      for (int l = 0; l < 8; ++l) sum[8 * k + l] += BitsFloat(scale_bits[r] ^ mask[l]);
    }
  }
  for (int l = 0; l < 8 * kBytes; ++l) mean[l] = sum[l] / count;
#endif
}

// Calls store(i, mean) for each i in [begin, end) and store8(i, mean[0..8)) for each aligned run
// of eight, with SignMeanAt's values: each element is stored once.
template <typename Store, typename Store8>
inline void ForEachMean(const uint8_t* bits, int64_t num_bytes, const uint32_t* scale_bits, int64_t m, float count,
                        int64_t begin, int64_t end, Store&& store, Store8&& store8) {
  int64_t i = begin;
  for (; i < end && (i & 7) != 0; ++i) store(i, SignMeanAt(bits, num_bytes, scale_bits, 1, m, count, i));
  constexpr int kRun = 4;  // bytes decoded at a time
  alignas(32) float mean[8 * kRun];
  const MeanDivisor divisor(count);
  for (; i + 8 * kRun <= end; i += 8 * kRun) {
    MeanOfBytes<kRun>(bits, num_bytes, scale_bits, m, divisor, i >> 3, mean);
    for (int k = 0; k < kRun; ++k) store8(i + 8 * k, mean + 8 * k);
  }
  for (; i + 8 <= end; i += 8) {
    MeanOfBytes<1>(bits, num_bytes, scale_bits, m, divisor, i >> 3, mean);
    store8(i, mean);
  }
  for (; i < end; ++i) store(i, SignMeanAt(bits, num_bytes, scale_bits, 1, m, count, i));
}

// out[i] = the mean (+ plus[i] with kPlus, added in float32) for i in [begin, end).
template <typename T, bool kPlus>
void DecodeMean(const uint8_t* bits, int64_t num_bytes, const uint32_t* scale_bits, int64_t m, float count,
                const float* __restrict plus, int64_t begin, int64_t end, T* __restrict out) {
  ForEachMean(
      bits, num_bytes, scale_bits, m, count, begin, end,
      [&](int64_t i, float mean) { out[i] = static_cast<T>(kPlus ? mean + plus[i] : mean); },
      [&](int64_t i, const float* __restrict mean) {
        for (int l = 0; l < 8; ++l) out[i + l] = static_cast<T>(kPlus ? mean[l] + plus[i + l] : mean[l]);
      });
}

// y[i - offset] -= the mean for i in [begin, end): AssignSubVariableOp's float32 subtraction.
void SubtractMean(const uint8_t* bits, int64_t num_bytes, const uint32_t* scale_bits, int64_t m, float count,
                  int64_t offset, int64_t begin, int64_t end, float* __restrict y) {
  ForEachMean(
      bits, num_bytes, scale_bits, m, count, begin, end, [&](int64_t i, float mean) { y[i - offset] -= mean; },
      [&](int64_t i, const float* __restrict mean) {
        float* run = y + (i - offset);
#if defined(__AVX__)  // GCC left the eight subtractions scalar: 6x slower than the decode
        _mm256_storeu_ps(run, _mm256_sub_ps(_mm256_loadu_ps(run), _mm256_load_ps(mean)));
#else
        for (int l = 0; l < 8; ++l) run[l] -= mean[l];
#endif
      });
}

// Calls piece(b, begin, end, scale_bits) for every piece [begin, end) of block b within the
// elements [lo, hi) (blocks cut at the global chunk grid), with the bits of the m payloads'
// scales of block b; chunks run on TensorFlow's intra-op threads.
template <typename Piece>
void ForEachBlockPiece(OpKernelContext* ctx, const int64_t* bounds, int64_t num_blocks, const float* scales,
                       int64_t m, int64_t lo, int64_t hi, Piece&& piece) {
  if (hi <= lo) return;
  const int64_t first_chunk = lo / kChunk;
  ParallelFor(ctx, NumChunks(hi) - first_chunk, kChunk * (1 + m), [&](int64_t first, int64_t last) {
    std::vector<uint32_t> scale_bits(m);
    for (int64_t c = first_chunk + first; c < first_chunk + last; ++c) {
      const int64_t chunk_lo = std::max(lo, c * kChunk), chunk_hi = std::min(hi, (c + 1) * kChunk);
      ForEachPieceInChunk(bounds, num_blocks, chunk_lo, chunk_hi, [&](int64_t b, int64_t begin, int64_t end) {
        for (int64_t r = 0; r < m; ++r) std::memcpy(&scale_bits[r], &scales[r * num_blocks + b], 4);
        piece(b, begin, end, scale_bits.data());
      });
    }
  });
}

}  // namespace

// kResidual: BlockSignCompress, which also returns x - C(x), computed as
// BlockSignUnpack's decoding and a float32 subtraction would, in x's buffer
// when nothing else holds it.
template <typename T, bool kResidual>
class BlockSignPackOp : public OpKernel {
 public:
  explicit BlockSignPackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_tensor = ctx->input(0);
    const Tensor& bounds_tensor = ctx->input(1);
    const int64_t n = x_tensor.NumElements();
    OP_REQUIRES_OK(ctx, ValidateBounds(bounds_tensor, n));
    const int64_t num_blocks = bounds_tensor.NumElements() - 1;
    const int64_t* bounds = bounds_tensor.flat<int64_t>().data();

    Tensor* bits_tensor = nullptr;
    Tensor* scales_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({(n + 7) / 8}),
                                             &bits_tensor));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({num_blocks}),
                                             &scales_tensor));
    Tensor* residual_tensor = nullptr;
    if (kResidual) {
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 2, x_tensor.shape(),
                                                                &residual_tensor));
    }
    if (n == 0) return;
    const T* x = x_tensor.flat<T>().data();
    uint8_t* bits = bits_tensor->flat<uint8_t>().data();
    float* scales = scales_tensor->flat<float>().data();

    // Each block is cut by the global chunk grid into pieces; piece p of
    // block b is its intersection with chunk first_chunk(b) + p.
    std::vector<int64_t> piece_offset(num_blocks + 1, 0);
    for (int64_t b = 0; b < num_blocks; ++b) {
      piece_offset[b + 1] = piece_offset[b] + PiecesOfBlock(bounds[b], bounds[b + 1]);
    }
    std::vector<double> piece_sum(piece_offset[num_blocks]);

    // Pass 1 (one read of x): signs and per-piece |x| sums, chunk by chunk.
    ParallelFor(ctx, NumChunks(n), kChunk * 4, [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
        PackSigns(x, lo, hi, bits);
        ForEachPieceInChunk(
            bounds, num_blocks, lo, hi,
            [&](int64_t b, int64_t begin, int64_t end) {
              piece_sum[piece_offset[b] + c - bounds[b] / kChunk] =
                  AbsSum(x + begin, end - begin);
            });
      }
    });
    // Pass 2 (tiny): a block's scale is the in-order sum of its pieces.
    ParallelFor(ctx, num_blocks, 16, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        double sum = 0;
        for (int64_t p = piece_offset[b]; p < piece_offset[b + 1]; ++p) {
          sum += piece_sum[p];
        }
        scales[b] = BlockScale(sum, bounds[b + 1] - bounds[b]);
      }
    });
    if constexpr (kResidual) {
      // Pass 3: residual = x - (+-scale), the sign as pass 1 packed it (x < 0: false for -0
      // and NaN); the residual may be x's own buffer.
      float* residual = residual_tensor->flat<float>().data();
      ParallelFor(ctx, NumChunks(n), kChunk * 2, [&](int64_t first, int64_t last) {
        for (int64_t c = first; c < last; ++c) {
          const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
          ForEachPieceInChunk(bounds, num_blocks, lo, hi, [&](int64_t b, int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) residual[i] = SignResidual(x[i], scales[b]);
          });
        }
      });
    }
  }
};

// Decodes m payloads and averages them. kMean = false is the single-payload
// op (rank-1 bits and scales); its result equals the mean of one payload.
template <typename T, bool kMean>
class BlockSignUnpackOp : public OpKernel {
 public:
  explicit BlockSignUnpackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& bits_tensor = ctx->input(0);
    const Tensor& scales_tensor = ctx->input(1);
    const Tensor& bounds_tensor = ctx->input(2);
    int64_t m = 0;
    OP_REQUIRES_OK(ctx, checks::SignPayloads(bits_tensor, scales_tensor, bounds_tensor, kMean ? 2 : 1, &m));
    const int64_t* bounds = bounds_tensor.flat<int64_t>().data();
    const int64_t num_blocks = bounds_tensor.NumElements() - 1;
    const int64_t n = bounds[num_blocks];
    const int64_t num_bytes = (n + 7) / 8;
    const int num_plus = ctx->num_inputs() - 3;
    OP_REQUIRES(ctx, num_plus <= 1 && (num_plus == 0 || ctx->input(3).NumElements() == n),
                InvalidArgument("plus must be at most one float32 tensor of ", n, " elements, got ", num_plus,
                                num_plus ? " of shape " + ctx->input(3).shape().DebugString() : ""));
    const float* plus = num_plus ? ctx->input(3).flat<float>().data() : nullptr;

    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &y_tensor));
    if (n == 0) return;
    const uint8_t* bits = bits_tensor.flat<uint8_t>().data();
    const float* scales = scales_tensor.flat<float>().data();
    T* y = y_tensor->flat<T>().data();
    const float count = static_cast<float>(m);

    const auto decode_mean = plus ? DecodeMean<T, true> : DecodeMean<T, false>;
    ForEachBlockPiece(ctx, bounds, num_blocks, scales, m, 0, n,
                      [&](int64_t b, int64_t begin, int64_t end, const uint32_t* scale_bits) {
                        if constexpr (!kMean) {
                          DecodeSigns(bits, scales[b], begin, end, y);
                        } else {
                          decode_mean(bits, num_bytes, scale_bits, m, count, plus, begin, end, y);
                        }
                      });
  }
};

// ResourceSubtractBlockSignMean: variable -= the decoded mean's elements [offset, offset + size),
// in place (see sign_ops.cc).
class ResourceSubtractBlockSignMeanOp : public OpKernel {
 public:
  explicit ResourceSubtractBlockSignMeanOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& bits_tensor = ctx->input(1);
    const Tensor& scales_tensor = ctx->input(2);
    const Tensor& bounds_tensor = ctx->input(3);
    const Tensor& offset_tensor = ctx->input(4);
    int64_t m = 0;
    OP_REQUIRES_OK(ctx, checks::SignPayloads(bits_tensor, scales_tensor, bounds_tensor, 2, &m));
    OP_REQUIRES(ctx, offset_tensor.dims() == 0,
                InvalidArgument("offset must be a scalar, got shape ", offset_tensor.shape().DebugString()));
    const int64_t* bounds = bounds_tensor.flat<int64_t>().data();
    const int64_t num_blocks = bounds_tensor.NumElements() - 1;
    const int64_t n = bounds[num_blocks];
    const int64_t offset = offset_tensor.scalar<int64_t>()();

    tensorflow::core::RefCountPtr<tensorflow::Var> var;
    OP_REQUIRES_OK(ctx, tensorflow::LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &var));
    tensorflow::mutex_lock lock(*var->mu());
    Tensor* v = var->tensor();
    OP_REQUIRES_OK(ctx, checks::SubtractTarget(*v, offset, n));
    const int64_t size = v->NumElements();
    OP_REQUIRES_OK(ctx, OwnBuffer(ctx, var.get()));
    if (size == 0) return;
    const uint8_t* bits = bits_tensor.flat<uint8_t>().data();
    const int64_t num_bytes = (n + 7) / 8;
    float* variable = v->flat<float>().data();  // element i of the payloads is variable[i - offset]
    const float count = static_cast<float>(m);
    ForEachBlockPiece(ctx, bounds, num_blocks, scales_tensor.flat<float>().data(), m, offset, offset + size,
                      [&](int64_t b, int64_t begin, int64_t end, const uint32_t* scale_bits) {
                        SubtractMean(bits, num_bytes, scale_bits, m, count, offset, begin, end, variable);
                      });
  }
};

#define REGISTER_SIGN_KERNELS(T)                                            \
  REGISTER_KERNEL_BUILDER(                                                  \
      Name("BlockSignPack").Device(DEVICE_CPU).TypeConstraint<T>("T"),      \
      BlockSignPackOp<T, false>);                                           \
  REGISTER_KERNEL_BUILDER(                                                  \
      Name("BlockSignUnpack").Device(DEVICE_CPU).TypeConstraint<T>("T"),    \
      BlockSignUnpackOp<T, false>);                                         \
  REGISTER_KERNEL_BUILDER(                                                  \
      Name("BlockSignUnpackMean").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      BlockSignUnpackOp<T, true>);

REGISTER_SIGN_KERNELS(float);
REGISTER_SIGN_KERNELS(Eigen::half);
REGISTER_SIGN_KERNELS(Eigen::bfloat16);
#undef REGISTER_SIGN_KERNELS
REGISTER_KERNEL_BUILDER(Name("BlockSignCompress").Device(DEVICE_CPU), BlockSignPackOp<float, true>);
REGISTER_KERNEL_BUILDER(Name("ResourceSubtractBlockSignMean").Device(DEVICE_CPU), ResourceSubtractBlockSignMeanOp);

}  // namespace hvd_compress
