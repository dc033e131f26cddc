// The per-element and per-block arithmetic of the hvd_compress kernels, shared by the CPU kernels
// (tf_ops/*_kernels.cc) and the GPU kernels (tf_ops/gpu/*.cu), so both round alike and the CPU tests
// exercise the arithmetic the GPU runs. Plain C++ with no TensorFlow: under nvcc every function is
// __host__ __device__. Values arrive as float (the caller converts half and bfloat16).
//
// Both builds keep every product and sum rounded on its own, as TensorFlow's separate ops round
// them: g++ with -ffp-contract=off, nvcc with -fmad=false.
#ifndef HVD_COMPRESS_TF_OPS_CORES_H_
#define HVD_COMPRESS_TF_OPS_CORES_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HC_HOST_DEVICE __host__ __device__
#else
#define HC_HOST_DEVICE
#endif

namespace hvd_compress {

// Elements per work item; a multiple of 8 so a chunk owns whole bytes of a packed bit vector.
// Reductions run over fixed global chunks (never by thread count), so their order, and so their
// bits, are the same on any machine. Must match KCHUNK in tests/np_reference.py.
constexpr int64_t kChunk = 1 << 14;

HC_HOST_DEVICE inline int64_t NumChunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

HC_HOST_DEVICE inline uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

HC_HOST_DEVICE inline float BitsFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// Element i of x as float: the loads the cores take (T: float, or a half or bfloat16 type that converts).
template <typename T>
struct FloatLoad {
  const T* x;
  HC_HOST_DEVICE float operator()(int64_t i) const { return static_cast<float>(x[i]); }
};

// |v| as an order-preserving unsigned key: larger |v| gives a larger key and NaN sorts above +Inf,
// so a NaN is always among the largest magnitudes.
HC_HOST_DEVICE inline uint32_t AbsKey(float v) { return FloatBits(v) & 0x7fffffffu; }

// ---- 1-bit sign compression (Seide et al. 2014; Bernstein et al. 2018): x ~ scale * sign(x) ----

// The payload's bit of one element: set when v < 0 (clear for -0 and NaN, as sign(.) wants).
HC_HOST_DEVICE inline uint32_t SignBit(float v) { return v < 0.0f ? 1u : 0u; }

// The packed byte of elements [i, min(i + 8, end)) of x (i a multiple of 8): bit l is element i + l's.
template <typename Load>
HC_HOST_DEVICE inline uint8_t SignByte(const Load& x, int64_t i, int64_t end) {
  uint32_t byte = 0;
  for (int l = 0; l < 8 && i + l < end; ++l) byte |= SignBit(x(i + l)) << l;
  return static_cast<uint8_t>(byte);
}

// +scale when `bit` is clear, -scale when set: the scale's bits with the sign flipped by the bit.
HC_HOST_DEVICE inline float SignedScale(uint32_t scale_bits, uint32_t bit) {
  return BitsFloat(scale_bits ^ (bit << 31));
}

// Bit i of a packed bit vector.
HC_HOST_DEVICE inline uint32_t BitAt(const uint8_t* bits, int64_t i) { return (bits[i >> 3] >> (i & 7)) & 1u; }

// Lane `lane` of a piece's |x| sum: elements begin + lane, begin + lane + 8, ... (< end), summed in
// float64 from 0 in order. A piece's sum is its 8 lanes added in order from 0 (PieceAbsSum); a
// block's scale is its pieces' sums added in order, over its size (BlockScale).
template <typename Load>
HC_HOST_DEVICE inline double LaneAbsSum(const Load& x, int64_t begin, int64_t end, int lane) {
  double sum = 0;
  for (int64_t i = begin + lane; i < end; i += 8) sum += static_cast<double>(BitsFloat(AbsKey(x(i))));
  return sum;
}

HC_HOST_DEVICE inline double PieceAbsSum(const double* lanes) {
  double sum = 0;
  for (int l = 0; l < 8; ++l) sum += lanes[l];
  return sum;
}

HC_HOST_DEVICE inline float BlockScale(double abs_sum, int64_t size) {
  return static_cast<float>(abs_sum / static_cast<double>(size));
}

// x - C(x) for one element of a block of scale `scale`: the residual of error feedback.
HC_HOST_DEVICE inline float SignResidual(float v, float scale) { return v - (v < 0.0f ? -scale : scale); }

// The mean over m payloads of element i's +-scale: summed in float32 from 0 in payload order, then
// divided by count. Payload r's bits start at bits + r * num_bytes; scale_bits[r * stride] is the
// bits of payload r's scale of i's block.
HC_HOST_DEVICE inline float SignMeanAt(const uint8_t* bits, int64_t num_bytes, const uint32_t* scale_bits,
                                       int64_t stride, int64_t m, float count, int64_t i) {
  float sum = 0.0f;
  for (int64_t r = 0; r < m; ++r) sum += SignedScale(scale_bits[r * stride], BitAt(bits + r * num_bytes, i));
  return sum / count;
}

// ---- fp16 exchange (Compression.fp16) ----

// The mean of one element over `count` rows (row(r): its float32 value in row r): summed in float32 in
// row order from row 0, divided by count in float32; the caller rounds it to float16 once.
template <typename Load>
HC_HOST_DEVICE inline float RowMean(const Load& row, int64_t count) {
  float sum = row(0);
  for (int64_t r = 1; r < count; ++r) sum += row(r);
  return sum / static_cast<float>(count);
}

// ---- Momentum with error feedback (Zheng et al. 2019, DistEF-SGD), one element ----
// m' = mu * m + g;  a = lr * (nesterov ? mu * m' + g : m') + residual_scale * e.
HC_HOST_DEVICE inline void MomentumErrorFeedAt(float grad, float m, float e, float lr, float mu, float residual_scale,
                                               bool nesterov, float* m_new, float* a) {
  const float velocity = mu * m + grad;
  *m_new = velocity;
  *a = lr * (nesterov ? mu * velocity + grad : velocity) + residual_scale * e;
}

}  // namespace hvd_compress

#endif  // HVD_COMPRESS_TF_OPS_CORES_H_
