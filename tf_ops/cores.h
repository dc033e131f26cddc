// The per-element and per-block arithmetic of the hvd_compress kernels, shared by the CPU kernels
// (tf_ops/*_kernels.cc) and the GPU kernels (tf_ops/gpu/*.cu), so both round alike and the CPU tests
// exercise the arithmetic the GPU runs. Plain C++ with no TensorFlow: under nvcc every function is
// __host__ __device__. Values arrive as float (the caller converts half and bfloat16).
//
// Both builds keep every product and sum rounded on its own, as TensorFlow's separate ops round
// them: g++ with -ffp-contract=off, nvcc with -fmad=false.
#ifndef HVD_COMPRESS_TF_OPS_CORES_H_
#define HVD_COMPRESS_TF_OPS_CORES_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HC_HOST_DEVICE __host__ __device__
#else
#define HC_HOST_DEVICE
#endif
#if defined(__CUDA_ARCH__)
#define HC_UNROLL_8 _Pragma("unroll 8")
#else
#define HC_UNROLL_8
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

// Blocks are cut by the global kChunk grid into pieces: block [lo, hi) has this many.
HC_HOST_DEVICE inline int64_t PiecesOfBlock(int64_t lo, int64_t hi) { return (hi - 1) / kChunk - lo / kChunk + 1; }

// Lane `lane` of a piece's |x| sum: elements begin + lane, begin + lane + 8, ... (< end), summed in
// float64 from 0 in order. A piece's sum is its 8 lanes added in order from 0 (PieceAbsSum); a
// block's scale is its pieces' sums added in order, over its size (BlockScale). The GPU sums a lane
// per thread; the CPU all 8 in one pass (LaneAbsSums), with the same sums.
template <typename Load>
HC_HOST_DEVICE inline double LaneAbsSum(const Load& x, int64_t begin, int64_t end, int lane) {
  double sum = 0;
  HC_UNROLL_8  // loads issued ahead on the GPU; the additions stay in order
  for (int64_t i = begin + lane; i < end; i += 8) sum += static_cast<double>(BitsFloat(AbsKey(x(i))));
  return sum;
}

// LaneAbsSum of all 8 lanes in one pass over [begin, end), into lanes[0..8).
template <typename Load>
HC_HOST_DEVICE inline void LaneAbsSums(const Load& x, int64_t begin, int64_t end, double* lanes) {
  for (int l = 0; l < 8; ++l) lanes[l] = 0;
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] += static_cast<double>(BitsFloat(AbsKey(x(i + l))));
  }
  for (int l = 0; i + l < end; ++l) lanes[l] += static_cast<double>(BitsFloat(AbsKey(x(i + l))));
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

// ---- Adam with its variance frozen after a warm-up (Tang et al. 2021, 1-bit Adam), one element ----
// x clamped to [-bound, bound]; NaN stays NaN.
HC_HOST_DEVICE inline float ClampAt(float x, float bound) { return x > bound ? bound : (x < -bound ? -bound : x); }

// d = sqrt(v) + eps, v frozen. The worker's side of 1-bit Adam: a = clamp((m + (g - m) * (1 - b1)) / d, bound) + e,
// this rank's momentum over d, no larger than bound, plus its residual.
HC_HOST_DEVICE inline float AdamMomentumFeedAt(float grad, float m, float v, float e, float one_minus_beta_1,
                                               float epsilon, float bound) {
  return ClampAt((m + (grad - m) * one_minus_beta_1) / (sqrtf(v) + epsilon), bound) + e;
}

// The receiving side, from the exchanged mean D: where the momentum over d was exchanged (1-bit Adam),
// m' = D d and delta = D alpha; where gradients were (Adam with a frozen variance), m' = m + (D - m) * (1 - b1) and
// delta = (m' alpha) / d; delta clamped to [-max_step, max_step]. delta is what the variable loses.
HC_HOST_DEVICE inline void AdamFrozenStepAt(float mean, float m, float v, float alpha, float one_minus_beta_1,
                                            float epsilon, float max_step, bool momentum_exchanged, float* m_new,
                                            float* delta) {
  const float d = sqrtf(v) + epsilon;
  if (momentum_exchanged) {
    *m_new = mean * d;
    *delta = ClampAt(mean * alpha, max_step);
  } else {
    const float momentum = m + (mean - m) * one_minus_beta_1;
    *m_new = momentum;
    *delta = ClampAt((momentum * alpha) / d, max_step);
  }
}

// The variable's step: x' = (x - x * decay) - delta (decay: weight decay times the learning rate, Keras's AdamW order).
HC_HOST_DEVICE inline float DecayAndSubtractAt(float x, float delta, float decay) { return (x - x * decay) - delta; }

// ---- Top-k sparsification (Aji & Heafield 2017; Stich et al. 2018): TopKAbs's keys and tie rule ----
// TopKAbs takes the k largest AbsKey(x) of its input, ties at the k-th key to the lower index, in index order.

// 15-bit keys of a float16 / bfloat16 |x| from its bits, ordered exactly as AbsKey of its float32 value
// (conversion to float32 is exact and monotone), so a select on them takes the same elements. A float16
// signalling NaN is first made quiet, as the CPU's conversion to float32 does (x86 F16C, ARM fcvt);
// bfloat16 converts by a shift, which keeps every NaN's bits.
HC_HOST_DEVICE inline uint32_t HalfAbsKey(uint16_t bits) {
  const uint32_t key = bits & 0x7fffu;
  return key > 0x7c00u ? key | 0x0200u : key;
}
HC_HOST_DEVICE inline uint32_t Bf16AbsKey(uint16_t bits) { return bits & 0x7fffu; }

// How many of a piece's `ties` keys equal to the threshold are taken, when the selection takes the first
// `ties_to_take` of them in index order and `ties_before` lie in earlier pieces.
HC_HOST_DEVICE inline int64_t TiesTaken(int64_t ties_to_take, int64_t ties_before, int64_t ties) {
  const int64_t left = ties_to_take - ties_before;
  return left < 0 ? 0 : (left < ties ? left : ties);
}

// ---- Count sketch (Charikar et al. 2002; sketched SGD, Ivkin et al. 2019; FetchSGD): the query's median ----
// The hash, buckets and regions are in sketch_hash.h. Row j's value of coordinate i is s_j(i) * sketch[j, h_j(i)];
// the estimate is the median of the rows' values (SketchMedian): NaN sorts after everything, so a NaN in most
// rows makes the estimate NaN. 3 and 5 rows take a min/max network over integer keys (MedianKey), in which -0
// sorts before +0; other row counts a stable insertion sort (MedianBySort), in which -0 and +0 tie and keep
// their row order. Both pick one of the values (bits and all), or for an even count the mean of the middle two.

// a sorts before b: the float order with every NaN last (NaNs tie).
HC_HOST_DEVICE inline bool MedianSortsBefore(float a, float b) { return a < b || (a == a && b != b); }

// An int32 key per float whose order is the float order with every NaN last (negative floats' magnitude bits
// flipped; NaN as the largest key), and back (a NaN key gives a NaN). Min and max of keys need no branches,
// so the CPU kernel vectorizes the 3- and 5-row networks over a tile of coordinates.
HC_HOST_DEVICE inline int32_t MedianKey(float x) {
  int32_t bits = static_cast<int32_t>(FloatBits(x));
  bits ^= (bits >> 31) & 0x7FFFFFFF;
  return x != x ? INT32_MAX : bits;
}
HC_HOST_DEVICE inline float MedianKeyFloat(int32_t key) {
  key ^= (key >> 31) & 0x7FFFFFFF;
  return BitsFloat(static_cast<uint32_t>(key));
}
HC_HOST_DEVICE inline int32_t MinKey(int32_t a, int32_t b) { return b < a ? b : a; }
HC_HOST_DEVICE inline int32_t MaxKey(int32_t a, int32_t b) { return a < b ? b : a; }
HC_HOST_DEVICE inline int32_t Median3Keys(int32_t a, int32_t b, int32_t c) {
  return MaxKey(MinKey(a, b), MinKey(MaxKey(a, b), c));
}
HC_HOST_DEVICE inline int32_t Median5Keys(int32_t a, int32_t b, int32_t c, int32_t d, int32_t e) {
  return Median3Keys(e, MaxKey(MinKey(a, b), MinKey(c, d)), MinKey(MaxKey(a, b), MaxKey(c, d)));
}

// The median of v[0..rows) by a stable insertion sort under MedianSortsBefore (v is reordered): v[rows / 2], or
// for an even count (v[rows / 2 - 1] + v[rows / 2]) / 2 in float32.
HC_HOST_DEVICE inline float MedianBySort(float* v, int64_t rows) {
  for (int64_t a = 1; a < rows; ++a) {  // a handful of rows
    const float u = v[a];
    int64_t b = a;
    for (; b > 0 && MedianSortsBefore(u, v[b - 1]); --b) v[b] = v[b - 1];
    v[b] = u;
  }
  return rows % 2 ? v[rows / 2] : (v[rows / 2 - 1] + v[rows / 2]) / 2.0f;
}

// The estimate of one coordinate from its rows' values v[0..rows) (rows >= 1; v may be reordered).
HC_HOST_DEVICE inline float SketchMedian(float* v, int64_t rows) {
  if (rows == 1) return v[0];
  if (rows == 3) return MedianKeyFloat(Median3Keys(MedianKey(v[0]), MedianKey(v[1]), MedianKey(v[2])));
  if (rows == 5) {
    return MedianKeyFloat(
        Median5Keys(MedianKey(v[0]), MedianKey(v[1]), MedianKey(v[2]), MedianKey(v[3]), MedianKey(v[4])));
  }
  return MedianBySort(v, rows);
}

// ---- Blockwise low-bit quantization (Compression.quantize; format in quantize_ops.cc) ----

HC_HOST_DEVICE inline float QuantizeLevels(int bits) { return static_cast<float>((1 << bits) - 1); }

HC_HOST_DEVICE inline int64_t QuantizePackedBytes(int64_t n, int bits) { return (n * bits + 7) / 8; }

// The stochastic draws, counter-based: the op's seed (key, counter) gives a 64-bit key K once (splitmix64 of
// a mix of both), and two elements share one 32-bit hash of an index under K (QuantizeHash32: one round of Wellons's
// lowbias32), 16 bits each. Element i takes hash j = 8 floor(i / 16) + i mod 8, its high half where i mod 16 < 8 and
// its low half otherwise: u_i = half * 2^-16, exact in float32 (a rounding's bias at most 2^-16 of a level). So 16
// draws are one 8-lane hash: with a hash per element (splitmix64, then two rounds of lowbias32) they cost as much as
// the rest of a 4-bit coding on an AVX2 CPU, and a second round of the hash took 20% of it.
HC_HOST_DEVICE inline uint64_t QuantizeSeedBase(int64_t key, int64_t counter) {
  uint64_t z = (static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) ^
               (static_cast<uint64_t>(counter) * 0xC2B2AE3D27D4EB4Full);
  z += 0x9E3779B97F4A7C15ull;  // splitmix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// lowbias32 (C. Wellons, "Hash functions for 32-bit integers", 2018): a bijection of uint32 with low bias.
HC_HOST_DEVICE inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

// Element i's 32-bit hash under the 64-bit key K: Mix32(Mix32(lo32(i) ^ lo32(K)) ^ hi32(K) ^ hi32(i)), the count
// sketch's cells (sketch_hash.h), where every bit of the cell's column and sign must be mixed from both halves of K.
HC_HOST_DEVICE inline uint32_t KeyedHash32(uint64_t key, int64_t i) {
  const uint64_t index = static_cast<uint64_t>(i);
  return Mix32(Mix32(static_cast<uint32_t>(index) ^ static_cast<uint32_t>(key)) ^ static_cast<uint32_t>(key >> 32) ^
               static_cast<uint32_t>(index >> 32));
}

// The draws' hash of index j under the 64-bit key K: Mix32(lo32(j) ^ lo32(K)) ^ hi32(K) ^ hi32(j). One round, so two
// keys' hashes are one sequence with the indices XORed by the low halves' difference and the hashes by the high
// halves' (draws of other elements, for rounding as good as independent); and hi32(j) is XORed in after the round, so
// past 2^32 hashes (a bucket of more than 2^33 elements) they repeat but for their lowest bit.
HC_HOST_DEVICE inline uint32_t QuantizeHash32(uint64_t key, int64_t j) {
  const uint64_t index = static_cast<uint64_t>(j);
  return Mix32(static_cast<uint32_t>(index) ^ static_cast<uint32_t>(key)) ^ static_cast<uint32_t>(key >> 32) ^
         static_cast<uint32_t>(index >> 32);
}

// The hash that element i draws from (the draws above): 8 hashes serve 16 consecutive elements.
HC_HOST_DEVICE inline int64_t QuantizeDrawHash(int64_t i) { return ((i >> 4) << 3) | (i & 7); }

HC_HOST_DEVICE inline float QuantizeUniform(uint64_t base, int64_t i) {
  const uint32_t h = QuantizeHash32(base, QuantizeDrawHash(i));
  return static_cast<float>(static_cast<int32_t>((i & 8) ? (h & 0xffffu) : (h >> 16))) * 0x1p-16f;  // exact
}

// A block's (or a piece's) min, max and whether any element is NaN or +-Inf.
struct QuantizeStats {
  float lo, hi;
  bool non_finite;
};

// One element's statistics: x - x is +0 for a finite x and NaN otherwise.
HC_HOST_DEVICE inline QuantizeStats QuantizeStatsOf(float v) { return QuantizeStats{v, v, !(v - v == 0.0f)}; }

// Order-free merge (min and max are exact; the zero signs are fixed by the + 0.0f in QuantizeFinish).
HC_HOST_DEVICE inline QuantizeStats QuantizeMerge(QuantizeStats a, const QuantizeStats& b) {
  a.lo = b.lo < a.lo ? b.lo : a.lo;
  a.hi = b.hi > a.hi ? b.hi : a.hi;
  a.non_finite = a.non_finite || b.non_finite;
  return a;
}

// A block's decode and code parameters.
struct QuantizeParams {
  float offset, scale, inv;
};

HC_HOST_DEVICE inline QuantizeParams QuantizeFinish(const QuantizeStats& s, int bits) {
  const float levels = QuantizeLevels(bits);
  const float lo = s.lo + 0.0f, hi = s.hi + 0.0f;  // -0 -> +0
  const float range = hi - lo;
  if (s.non_finite || !(range <= BitsFloat(0x7f7fffffu))) {  // FLT_MAX
    const float nan = BitsFloat(0x7fc00000u);
    return QuantizeParams{nan, nan, 0.0f};  // v = (x - NaN) * 0 is NaN, whose code is 0
  }
  return QuantizeParams{lo, range / levels, range > 0.0f ? levels / range : 0.0f};
}

HC_HOST_DEVICE inline float QuantizeFloor(float v) {
#if defined(__CUDA_ARCH__)
  return floorf(v);
#else
  return __builtin_floorf(v);
#endif
}

// The code of v as a float in [0, levels]: floor((v - offset) * inv + add), NaN -> 0 (as max(NaN, 0) = 0),
// clamped to levels. add: u_i (stochastic) or 0.5f (deterministic).
HC_HOST_DEVICE inline float QuantizeLevel(float v, const QuantizeParams& p, float add, float levels) {
  float f = QuantizeFloor((v - p.offset) * p.inv + add);
  f = f > 0.0f ? f : 0.0f;
  return f < levels ? f : levels;
}

// The decoded value of a code (as a float): two float32 roundings, no FMA.
HC_HOST_DEVICE inline float QuantizeDecode(float offset, float code, float scale) { return offset + code * scale; }

// Element j's code in a packed vector: bits [j * bits, (j + 1) * bits), LSB first.
HC_HOST_DEVICE inline uint32_t QuantizeCodeAt(const uint8_t* packed, int bits, int64_t j) {
  const int64_t bit = j * bits;
  return (static_cast<uint32_t>(packed[bit >> 3]) >> (bit & 7)) & ((1u << bits) - 1u);
}

}  // namespace hvd_compress

#endif  // HVD_COMPRESS_TF_OPS_CORES_H_
