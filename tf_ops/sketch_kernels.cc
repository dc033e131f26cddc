// CPU kernels for CountSketch, CountSketchQuery and CountSketchBuckets.
//
// Rows wider than kRegionCols are cut into regions, each fed by one contiguous
// segment of the coordinates (sketch_hash.h). CountSketch runs one task per
// (row, region): it hashes the segment's coordinates chunk by chunk (the hash
// vectorized with AVX2 where the CPU has it; integer arithmetic, so the same
// buckets and signs either way) and adds them into the region, which stays in
// the core's L2 cache. Every cell is thus summed in increasing coordinate order
// by one thread, whatever the thread count: the result equals np.add.at in the
// NumPy reference. CountSketchQuery hashes the same way and is parallel over
// chunks of i; CountSketchBuckets returns the cells of a few given coordinates. The hash (sketch_hash.h) and
// the medians (cores.h) are shared with the GPU kernels (gpu/sketch_kernels.cu).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "blocks.h"
#include "sketch_hash.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace hvd_compress {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::TensorShape;

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;  // as in SketchHash

// For coordinates [first, first + count) in the row of `row_key`: their
// buckets, and sign * v[t] (v: count floats), exactly as SketchHash computes them.
inline void HashRangeScalar(uint64_t row_key, int64_t first, int64_t count, int64_t cols,
                            const float* v, uint32_t* bucket, float* signed_v) {
  for (int64_t t = 0; t < count; ++t) {
    const BucketSign h = SketchHash(row_key, first + t, cols);
    bucket[t] = static_cast<uint32_t>(h.bucket);
    signed_v[t] = h.sign * v[t];
  }
}

#if defined(__x86_64__)
// Low 64 bits of a * b per lane, for b with precomputed high halves.
__attribute__((target("avx2"))) inline __m256i Mul64(__m256i a, __m256i b, __m256i b_hi) {
  const __m256i lo = _mm256_mul_epu32(a, b);
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b),
                                         _mm256_mul_epu32(a, b_hi));
  return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

// HashRangeScalar, four coordinates at a time (Mix64 and the multiply-shift
// range reduction on 64-bit lanes; the sign as a multiplication by -1 or 1).
__attribute__((target("avx2"))) void HashRangeAvx2(uint64_t row_key, int64_t first, int64_t count,
                                                   int64_t cols, const float* v, uint32_t* bucket,
                                                   float* signed_v) {
  const __m256i c1 = _mm256_set1_epi64x(0xBF58476D1CE4E5B9ull);
  const __m256i c1_hi = _mm256_srli_epi64(c1, 32);
  const __m256i c2 = _mm256_set1_epi64x(0x94D049BB133111EBull);
  const __m256i c2_hi = _mm256_srli_epi64(c2, 32);
  const __m256i vcols = _mm256_set1_epi64x(cols);
  const __m256i one = _mm256_set1_epi64x(1);
  const __m256i step = _mm256_set1_epi64x(static_cast<int64_t>(4 * kGolden));
  const __m256i low_dwords = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m128 plus_one = _mm_set1_ps(1.0f), minus_two = _mm_set1_ps(-2.0f);
  const uint64_t base = row_key + static_cast<uint64_t>(first) * kGolden;
  __m256i z0 = _mm256_setr_epi64x(base, base + kGolden, base + 2 * kGolden, base + 3 * kGolden);
  int64_t t = 0;
  for (; t + 4 <= count; t += 4) {
    __m256i z = _mm256_xor_si256(z0, _mm256_srli_epi64(z0, 30));
    z = Mul64(z, c1, c1_hi);
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 27));
    z = Mul64(z, c2, c2_hi);
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
    const __m256i b = _mm256_srli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(z, 32), vcols), 32);
    const __m128i negative =
        _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_and_si256(z, one), low_dwords));
    // 1 - 2 * negative is exactly 1.0f or -1.0f.
    const __m128 sign = _mm_add_ps(plus_one, _mm_mul_ps(minus_two, _mm_cvtepi32_ps(negative)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bucket + t),
                     _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(b, low_dwords)));
    _mm_storeu_ps(signed_v + t, _mm_mul_ps(sign, _mm_loadu_ps(v + t)));
    z0 = _mm256_add_epi64(z0, step);
  }
  HashRangeScalar(row_key, first + t, count - t, cols, v + t, bucket + t, signed_v + t);
}
#endif

// Buckets and signed values of coordinates [first, first + count): see HashRangeScalar.
inline void HashRange(uint64_t row_key, int64_t first, int64_t count, int64_t cols, const float* v,
                      uint32_t* bucket, float* signed_v) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && cols <= 0xFFFFFFFFll) {
    HashRangeAvx2(row_key, first, count, cols, v, bucket, signed_v);
    return;
  }
#endif
  HashRangeScalar(row_key, first, count, cols, v, bucket, signed_v);
}

// HashRange for coordinates [first, first + count) under the regions r: each
// segment's part hashed into its region's width, then offset to its first column.
inline void HashRegioned(const Regions& r, uint64_t row_key, int64_t first, int64_t count, const float* v,
                         uint32_t* bucket, float* signed_v) {
  for (int64_t t = 0; t < count;) {
    const int64_t s = (first + t) / r.per_segment;
    const int64_t len = std::min(count - t, (s + 1) * r.per_segment - (first + t));
    HashRange(row_key, first + t, len, r.Width(s), v + t, bucket + t, signed_v + t);
    const uint32_t offset = static_cast<uint32_t>(r.First(s));
    for (int64_t u = t; u < t + len; ++u) bucket[u] += offset;
    t += len;
  }
}

template <typename T>
class CountSketchOp : public OpKernel {
 public:
  explicit CountSketchOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rows", &rows_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cols", &cols_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x_tensor = ctx->input(0);
    const int64_t n = x_tensor.NumElements();
    OP_REQUIRES(ctx, ctx->input(1).dims() == 0 && ctx->input(2).dims() == 0,
                InvalidArgument("seed and step must be scalars"));
    const int64_t seed = SketchSeed(ctx->input(1).scalar<int64_t>()(), ctx->input(2).scalar<int64_t>()());
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows_, cols_}), &out));
    const T* x = x_tensor.flat<T>().data();
    float* sketch = out->flat<float>().data();
    const Regions regions = RegionsOf(n, cols_);
    // One task per (row, region): its segment's coordinates, in increasing i, into its region.
    ParallelFor(ctx, rows_ * regions.count, regions.per_segment * 12 + 1, [&](int64_t first, int64_t last) {
      std::vector<float> v(kChunk), signed_v(kChunk);
      std::vector<uint32_t> bucket(kChunk);
      for (int64_t task = first; task < last; ++task) {
        const int64_t j = task / regions.count, s = task % regions.count;
        const uint64_t key = RowKey(seed, j);
        const int64_t width = regions.Width(s);
        float* region = sketch + j * cols_ + regions.First(s);
        std::fill(region, region + width, 0.0f);
        const int64_t lo = s * regions.per_segment, hi = std::min(n, lo + regions.per_segment);
        for (int64_t a = lo; a < hi; a += kChunk) {
          const int64_t len = std::min(kChunk, hi - a);
          for (int64_t t = 0; t < len; ++t) v[t] = static_cast<float>(x[a + t]);
          HashRange(key, a, len, width, v.data(), bucket.data(), signed_v.data());
          for (int64_t t = 0; t < len; ++t) region[bucket[t]] += signed_v[t];
        }
      }
    });
  }

 private:
  int64_t rows_, cols_;
};

// The medians are cores.h's (SketchMedian): MedianKey's 3- and 5-row networks run vectorized over a tile of
// coordinates (with float compares and NaN checks the branches mispredicted on random data: 0.24 GB/s for 5
// rows), MedianBySort for other row counts.

constexpr int64_t kTile = 1024;  // coordinates a query takes the medians of at a time

class CountSketchQueryOp : public OpKernel {
 public:
  explicit CountSketchQueryOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& sketch_tensor = ctx->input(0);
    const Tensor& n_tensor = ctx->input(1);
    OP_REQUIRES(ctx, sketch_tensor.dims() == 2 && sketch_tensor.dim_size(0) >= 1 &&
                         sketch_tensor.dim_size(1) >= 1,
                InvalidArgument("sketch must be a non-empty matrix [rows, cols], got ",
                                sketch_tensor.shape().DebugString()));
    OP_REQUIRES(ctx, n_tensor.dims() == 0 && ctx->input(2).dims() == 0 && ctx->input(3).dims() == 0,
                InvalidArgument("n, seed and step must be scalars"));
    const int64_t seed = SketchSeed(ctx->input(2).scalar<int64_t>()(), ctx->input(3).scalar<int64_t>()());
    const int64_t rows = sketch_tensor.dim_size(0), cols = sketch_tensor.dim_size(1);
    const int64_t n = n_tensor.scalar<int64_t>()();
    OP_REQUIRES(ctx, n >= 0, InvalidArgument("n must be >= 0, got ", n));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &out));
    const float* sketch = sketch_tensor.flat<float>().data();
    float* estimate = out->flat<float>().data();
    std::vector<uint64_t> keys(rows);
    for (int64_t j = 0; j < rows; ++j) keys[j] = RowKey(seed, j);
    const Regions regions = RegionsOf(n, cols);
    ParallelFor(ctx, NumChunks(n), kChunk * rows * 12, [&](int64_t first, int64_t last) {
      // A tile's hashes and every row's values stay in L1 while its medians are taken.
      std::vector<uint32_t> bucket(kTile);
      std::vector<float> ones(kTile, 1.0f), sign(kTile), values(rows * kTile), column(rows);
      std::vector<int32_t> keyed(rows * kTile);
      for (int64_t c = first; c < last; ++c) {
        const int64_t end = std::min(n, (c + 1) * kChunk);
        for (int64_t lo = c * kChunk; lo < end; lo += kTile) {
          const int64_t len = std::min(kTile, end - lo);
          for (int64_t j = 0; j < rows; ++j) {  // values[j * kTile + t]: row j's estimate of lo + t
            HashRegioned(regions, keys[j], lo, len, ones.data(), bucket.data(), sign.data());
            const float* row = sketch + j * cols;
            float* out = rows == 1 ? estimate + lo : &values[j * kTile];
            for (int64_t t = 0; t < len; ++t) out[t] = sign[t] * row[bucket[t]];
          }
          if (rows == 1) continue;
          const float* v = values.data();
          if (rows == 3 || rows == 5) {  // a min/max network over keys, vectorized over t
            for (int64_t j = 0; j < rows; ++j) {
              for (int64_t t = 0; t < len; ++t) keyed[j * len + t] = MedianKey(v[j * kTile + t]);
            }
            const int32_t* k = keyed.data();
            for (int64_t t = 0; t < len; ++t) {
              estimate[lo + t] = MedianKeyFloat(
                  rows == 3 ? Median3Keys(k[t], k[len + t], k[2 * len + t])
                            : Median5Keys(k[t], k[len + t], k[2 * len + t], k[3 * len + t], k[4 * len + t]));
            }
            continue;
          }
          for (int64_t t = 0; t < len; ++t) {
            for (int64_t j = 0; j < rows; ++j) column[j] = v[j * kTile + t];
            estimate[lo + t] = MedianBySort(column.data(), rows);
          }
        }
      }
    });
  }
};

#define REGISTER_SKETCH_KERNEL(T) \
  REGISTER_KERNEL_BUILDER(Name("CountSketch")                                  \
                              .Device(DEVICE_CPU)                                  \
                              .HostMemory("seed")                                  \
                              .HostMemory("step")                                  \
                              .TypeConstraint<T>("T"),                             \
                          CountSketchOp<T>);
REGISTER_SKETCH_KERNEL(float);
REGISTER_SKETCH_KERNEL(Eigen::half);
REGISTER_SKETCH_KERNEL(Eigen::bfloat16);
#undef REGISTER_SKETCH_KERNEL

class CountSketchBucketsOp : public OpKernel {
 public:
  explicit CountSketchBucketsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rows", &rows_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cols", &cols_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& indices_tensor = ctx->input(0);
    OP_REQUIRES(ctx, indices_tensor.dims() == 1, InvalidArgument("indices must be a vector"));
    OP_REQUIRES(ctx, ctx->input(1).dims() == 0 && ctx->input(2).dims() == 0 && ctx->input(3).dims() == 0,
                InvalidArgument("n, seed and step must be scalars"));
    const int64_t n = ctx->input(1).scalar<int64_t>()();
    const int64_t seed = SketchSeed(ctx->input(2).scalar<int64_t>()(), ctx->input(3).scalar<int64_t>()());
    const int64_t m = indices_tensor.NumElements();
    const int64_t* indices = indices_tensor.flat<int64_t>().data();
    for (int64_t t = 0; t < m; ++t) {
      OP_REQUIRES(ctx, indices[t] >= 0 && indices[t] < n,
                  InvalidArgument("indices must be in [0, n = ", n, "), got ", indices[t]));
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows_, m}), &out));
    int64_t* buckets = out->flat<int64_t>().data();
    const Regions regions = RegionsOf(n, cols_);
    for (int64_t j = 0; j < rows_; ++j) {
      const uint64_t key = RowKey(seed, j);
      for (int64_t t = 0; t < m; ++t) buckets[j * m + t] = SketchCell(regions, key, indices[t]).bucket;
    }
  }

 private:
  int64_t rows_, cols_;
};

REGISTER_KERNEL_BUILDER(Name("CountSketchBuckets").Device(DEVICE_CPU).HostMemory("n").HostMemory("seed").HostMemory("step"),
                        CountSketchBucketsOp);

REGISTER_KERNEL_BUILDER(
    Name("CountSketchQuery").Device(DEVICE_CPU).HostMemory("n").HostMemory("seed").HostMemory("step"),
    CountSketchQueryOp);

}  // namespace hvd_compress
