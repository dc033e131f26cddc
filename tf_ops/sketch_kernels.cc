// CPU kernels for CountSketch, CountSketchQuery, CountSketchTopK and CountSketchBuckets.
//
// Rows wider than kRegionCols are cut into regions, each fed by one contiguous
// segment of the coordinates (sketch_hash.h). CountSketch and CountSketchTopK
// run one task per (row, region) (HashSegments): it hashes the segment's
// coordinates 1024 at a time (vectorized with AVX-512 or AVX2 where the CPU has
// it; integer arithmetic, so the same buckets and signs any way) and adds them
// into the region, which stays in the core's L1 cache with them. Every cell is
// thus summed in increasing coordinate order by one thread, whatever the thread
// count: the result equals np.add.at in the NumPy reference. CountSketchQuery
// hashes the same way and is parallel over chunks of i; CountSketchBuckets
// returns the cells of a few given coordinates. The hash (sketch_hash.h) and the
// medians (cores.h) are shared with the GPU kernels (gpu/sketch_kernels.cu).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "blocks.h"
#include "op_checks.h"
#include "sketch_hash.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace hvd_compress {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::TensorShape;

// For coordinates [first, first + count) in the row of `row_key`, in a region of `width` columns: their
// buckets, and sign * v[t] (v: count floats) unless signed_v is null, exactly as SketchHash computes them.
inline void HashRangeScalar(uint64_t row_key, int64_t first, int64_t count, int64_t width, const float* v,
                            uint32_t* bucket, float* signed_v) {
  for (int64_t t = 0; t < count; ++t) {
    const BucketSign h = SketchHash(row_key, first + t, width);
    bucket[t] = static_cast<uint32_t>(h.bucket);
    if (signed_v != nullptr) signed_v[t] = h.sign * v[t];
  }
}

#if defined(__x86_64__)
// HashRangeScalar, 8 coordinates at a time (KeyedHash32 in 8 lanes with Mix32Avx2, blocks.h; the range reduction
// in 32-bit lanes, the sign as a multiplication by -1 or 1), while hi32 of the coordinate stays the same; false
// (nothing done) where it does not.
__attribute__((target("avx2"))) bool HashRangeAvx2(uint64_t row_key, int64_t first, int64_t count, int64_t width,
                                                   const float* v, uint32_t* bucket, float* signed_v) {
  if ((static_cast<uint64_t>(first) >> 32) != (static_cast<uint64_t>(first + count - 1) >> 32)) return false;
  const __m256i key_lo = _mm256_set1_epi32(static_cast<int32_t>(row_key));
  const __m256i key_hi =
      _mm256_set1_epi32(static_cast<int32_t>((row_key >> 32) ^ (static_cast<uint64_t>(first) >> 32)));
  const __m256i columns = _mm256_set1_epi32(static_cast<int32_t>(width));
  const __m256 plus_one = _mm256_set1_ps(1.0f), minus_one = _mm256_set1_ps(-1.0f);
  __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(first)),
                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) {
    const __m256i h = Mix32Avx2(_mm256_xor_si256(Mix32Avx2(_mm256_xor_si256(index, key_lo)), key_hi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bucket + t),
                        _mm256_srli_epi32(_mm256_mullo_epi32(_mm256_srli_epi32(h, 12), columns), 20));
    if (signed_v != nullptr) {  // h's lowest bit moved to the top selects -1
      const __m256 sign = _mm256_blendv_ps(plus_one, minus_one, _mm256_castsi256_ps(_mm256_slli_epi32(h, 31)));
      _mm256_storeu_ps(signed_v + t, _mm256_mul_ps(sign, _mm256_loadu_ps(v + t)));
    }
    index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
  }
  HashRangeScalar(row_key, first + t, count - t, width, v + t, bucket + t, signed_v ? signed_v + t : nullptr);
  return true;
}

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wmaybe-uninitialized mistakes for a read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// HashRangeAvx2, 16 coordinates at a time.
__attribute__((target("avx512f,avx512bw"))) bool HashRangeAvx512(uint64_t row_key, int64_t first, int64_t count,
                                                                 int64_t width, const float* v, uint32_t* bucket,
                                                                 float* signed_v) {
  if ((static_cast<uint64_t>(first) >> 32) != (static_cast<uint64_t>(first + count - 1) >> 32)) return false;
  const __m512i key_lo = _mm512_set1_epi32(static_cast<int32_t>(row_key));
  const __m512i key_hi =
      _mm512_set1_epi32(static_cast<int32_t>((row_key >> 32) ^ (static_cast<uint64_t>(first) >> 32)));
  const __m512i columns = _mm512_set1_epi32(static_cast<int32_t>(width)), one = _mm512_set1_epi32(1);
  const __m512 plus_one = _mm512_set1_ps(1.0f), minus_one = _mm512_set1_ps(-1.0f);
  __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first)),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  int64_t t = 0;
  for (; t + 16 <= count; t += 16) {
    const __m512i h = Mix32Avx512(_mm512_xor_si512(Mix32Avx512(_mm512_xor_si512(index, key_lo)), key_hi));
    _mm512_storeu_si512(bucket + t, _mm512_srli_epi32(_mm512_mullo_epi32(_mm512_srli_epi32(h, 12), columns), 20));
    if (signed_v != nullptr) {
      const __m512 sign = _mm512_mask_blend_ps(_mm512_test_epi32_mask(h, one), plus_one, minus_one);
      _mm512_storeu_ps(signed_v + t, _mm512_mul_ps(sign, _mm512_loadu_ps(v + t)));
    }
    index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
  }
  HashRangeScalar(row_key, first + t, count - t, width, v + t, bucket + t, signed_v ? signed_v + t : nullptr);
  return true;
}
#pragma GCC diagnostic pop
#endif

// Buckets and signed values of coordinates [first, first + count) in a region of `width` columns: see
// HashRangeScalar.
inline void HashRange(uint64_t row_key, int64_t first, int64_t count, int64_t width, const float* v,
                      uint32_t* bucket, float* signed_v) {
#if defined(__x86_64__)
  static const bool avx512 = UseAvx512(), avx2 = __builtin_cpu_supports("avx2");
  if (avx512 && HashRangeAvx512(row_key, first, count, width, v, bucket, signed_v)) return;
  if (avx2 && HashRangeAvx2(row_key, first, count, width, v, bucket, signed_v)) return;
#endif
  HashRangeScalar(row_key, first, count, width, v, bucket, signed_v);
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

// Reads a region of the sketch in order before its random reads, so that they find it in the core's cache
// (the hardware prefetcher streams an ordered read; random reads of a cold region miss one line at a time).
inline void WarmUp(const float* region, int64_t width) {
  float sum = 0;
  for (int64_t c = 0; c < width; c += 16) sum += region[c];
  asm volatile("" : : "r"(sum));
}

constexpr int64_t kRun = 1024;  // coordinates HashSegments hashes at a time: their buckets stay in L1 beside the region

// Runs visit(s, a, len, bucket, sign) over the coordinates of each region s's segment, 1024 at a time in
// increasing order, bucket[t] the column of coordinate a + t inside region s and sign[t] its sign (1.0f or
// -1.0f; null where signs is false: buckets only); one task per region (its cells are its own), cost_per_element a
// rough count of cycles. visit returns false to skip the rest of its segment.
template <typename Visit>
void HashSegments(OpKernelContext* ctx, const Regions& r, int64_t n, uint64_t row_key, bool signs,
                  int64_t cost_per_element, Visit&& visit) {
  ParallelFor(ctx, r.count, r.per_segment * cost_per_element + 1, [&](int64_t first, int64_t last) {
    float ones[kRun], sign[kRun];
    uint32_t bucket[kRun];
    std::fill(ones, ones + kRun, 1.0f);
    for (int64_t s = first; s < last; ++s) {
      const int64_t lo = s * r.per_segment, hi = std::min(n, lo + r.per_segment), width = r.Width(s);
      for (int64_t a = lo; a < hi; a += kRun) {
        const int64_t len = std::min(kRun, hi - a);
        HashRange(row_key, a, len, width, ones, bucket, signs ? sign : nullptr);
        if (!visit(s, a, len, bucket, signs ? sign : nullptr)) break;
      }
    }
  });
}

// The tensors of a list input (a bucket's parts, read where they lie) as one vector of T: each one's elements and
// where each starts.
template <typename T>
struct ListParts {
  std::vector<const T*> data;
  PartIndex where;

  explicit ListParts(const tensorflow::OpInputList& list) : where(SizesOf(list)) {
    for (int k = 0; k < list.size(); ++k) data.push_back(list[k].flat<T>().data());
  }
  static std::vector<int64_t> SizesOf(const tensorflow::OpInputList& list) {
    std::vector<int64_t> sizes;
    for (int k = 0; k < list.size(); ++k) sizes.push_back(list[k].NumElements());
    return sizes;
  }
};

template <typename T>
class CountSketchOp : public OpKernel {
 public:
  explicit CountSketchOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rows", &rows_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cols", &cols_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("count_loads", &count_loads_));
  }

  void Compute(OpKernelContext* ctx) override {
    tensorflow::OpInputList xs;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    const ListParts<T> x(xs);
    const PartIndex& where = x.where;
    const int64_t n = where.total();
    const Tensor& seed_tensor = ctx->input(xs.size());
    const Tensor& step_tensor = ctx->input(xs.size() + 1);
    OP_REQUIRES(ctx, seed_tensor.dims() == 0 && step_tensor.dims() == 0,
                InvalidArgument("seed and step must be scalars"));
    const int64_t seed = SketchSeed(seed_tensor.scalar<int64_t>()(), step_tensor.scalar<int64_t>()());
    OP_REQUIRES(ctx, !count_loads_ || n <= std::numeric_limits<int32_t>::max(),
                InvalidArgument("count_loads counts in int32: x may have at most 2^31-1 elements, got ", n));
    Tensor *out = nullptr, *loads_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows_, cols_}), &out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, count_loads_ ? TensorShape({rows_, cols_}) : TensorShape({0, 0}),
                                             &loads_out));
    float* sketch = out->flat<float>().data();
    const Regions regions = RegionsOf(n, cols_);
    for (int64_t j = 0; j < rows_; ++j) {  // each region's segment, in increasing i, into the region
      float* row = sketch + j * cols_;
      int32_t* loads = count_loads_ ? loads_out->flat<int32_t>().data() + j * cols_ : nullptr;
      HashSegments(ctx, regions, n, RowKey(seed, j), /*signs=*/true, 12,
                   [&](int64_t s, int64_t a, int64_t len, const uint32_t* bucket, const float* sign) {
                     float* region = row + regions.First(s);
                     int32_t* counts = loads ? loads + regions.First(s) : nullptr;
                     if (a == s * regions.per_segment) {
                       std::fill(region, region + regions.Width(s), 0.0f);
                       if (counts) std::fill(counts, counts + regions.Width(s), 0);
                     }
                     where.ForEachPartIn(a, a + len, [&](int64_t part, int64_t at, int64_t lo, int64_t length) {
                       const T* values = x.data[part] + at;
                       const uint32_t* cells = bucket + (lo - a);
                       const float* signs = sign + (lo - a);
                       if (counts) {
                         for (int64_t t = 0; t < length; ++t) {
                           region[cells[t]] += signs[t] * static_cast<float>(values[t]);
                           ++counts[cells[t]];
                         }
                         return;
                       }
                       for (int64_t t = 0; t < length; ++t) {
                         region[cells[t]] += signs[t] * static_cast<float>(values[t]);
                       }
                     });
                     return true;
                   });
      for (int64_t s = 0; s < regions.count; ++s) {  // regions whose segment holds no coordinate
        if (s * regions.per_segment >= n) {
          std::fill(row + regions.First(s), row + regions.First(s + 1), 0.0f);
          if (loads) std::fill(loads + regions.First(s), loads + regions.First(s + 1), 0);
        }
      }
    }
  }

 private:
  int64_t rows_, cols_;
  bool count_loads_;
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

// CountSketchTopK's selection over one run of a region's coordinates a .. a + len - 1 (bucket[t]: coordinate
// a + t's column in the region): a coordinate is taken where its cell's key is above the threshold, or at it while
// *ties > 0 (each such one takes a tie, in index order); the taken coordinates are written to stage in index order
// (len entries are room enough), their number returned and *ties left with what remains. Every coordinate is staged
// at `taken`, which only a taken one advances (no branch to mispredict).
inline int64_t SelectRunScalar(const float* region, const uint32_t* bucket, int64_t a, int64_t len,
                               uint32_t threshold, int64_t* ties, int32_t* stage) {
  int64_t left = *ties, taken = 0;
  for (int64_t t = 0; t < len; ++t) {
    const uint32_t key = AbsKey(region[bucket[t]]);
    const bool tie = key == threshold && left > 0;
    left -= tie;
    stage[taken] = static_cast<int32_t>(a + t);
    taken += key > threshold || tie;
  }
  *ties = left;
  return taken;
}

#if defined(__x86_64__)
// For each 8-bit mask, its set lanes first, in order: a compress of 8 lanes by _mm256_permutevar8x32_epi32 (AVX2
// has no compress store).
struct CompressLanes {
  alignas(32) int32_t lanes[256][8];
  constexpr CompressLanes() : lanes() {
    for (int mask = 0; mask < 256; ++mask) {
      int k = 0;
      for (int lane = 0; lane < 8; ++lane) {
        if ((mask >> lane) & 1) lanes[mask][k++] = lane;
      }
    }
  }
};
constexpr CompressLanes kCompressLanes;

// SelectRunScalar 8 coordinates at a time from their cells' keys (keys[t], read beforehand by scalar loads: AVX2's
// gather instead made the whole op 13% slower on an AMD Zen 3): those above the threshold compressed into stage; 8
// that hold a key at the threshold while ties remain go through SelectRunScalar, in order. Keys and the threshold
// are below 2^31, so the signed compare orders them as AbsKey does.
__attribute__((target("avx2,popcnt"))) int64_t SelectKeysAvx2(const uint32_t* keys, const float* region,
                                                              const uint32_t* bucket, int64_t a, int64_t len,
                                                              uint32_t threshold, int64_t* ties, int32_t* stage) {
  const __m256i at = _mm256_set1_epi32(static_cast<int32_t>(threshold));
  __m256i index =
      _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(a)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  int64_t taken = 0, t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256i key = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + t));
    if (*ties > 0 && _mm256_movemask_epi8(_mm256_cmpeq_epi32(key, at)) != 0) {
      taken += SelectRunScalar(region, bucket + t, a + t, 8, threshold, ties, stage + taken);
    } else {
      const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(key, at)));
      const __m256i lanes = _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompressLanes.lanes[mask]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(stage + taken), _mm256_permutevar8x32_epi32(index, lanes));
      taken += __builtin_popcount(static_cast<unsigned>(mask));
    }
    index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
  }
  return taken + SelectRunScalar(region, bucket + t, a + t, len - t, threshold, ties, stage + taken);
}
#endif

// SelectRunScalar, with AVX2 where the CPU has it (the same coordinates; len <= kRun).
inline int64_t SelectRun(const float* region, const uint32_t* bucket, int64_t a, int64_t len, uint32_t threshold,
                         int64_t* ties, int32_t* stage) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
  if (avx2) {
    uint32_t keys[kRun];
    for (int64_t t = 0; t < len; ++t) keys[t] = AbsKey(region[bucket[t]]);
    return SelectKeysAvx2(keys, region, bucket, a, len, threshold, ties, stage);
  }
#endif
  return SelectRunScalar(region, bucket, a, len, threshold, ties, stage);
}

// CountSketchTopK: top_k_abs(count_sketch_query(sketch, n)) of a one-row sketch, and x at the selected
// coordinates (sketched SGD's candidates and their values), without writing the n estimates. With one
// row |estimate_i| = |S[h(i)]| (the sign only flips it), so every coordinate hashed to a cell has the
// cell's key: the k-th largest key is found over the cells, each counted once per coordinate hashed to
// it (its load), by TopKAbs's two-level radix select. The loads come from CountSketch (count_loads), which
// hashed every coordinate into the same cells; where they are not given, a first pass hashes the coordinates
// to count them. The selection hashes them (again), each region's segment by one task, written in index order
// with TopKAbs's ties (the lowest indices first) from each region's counts of coordinates above the threshold
// and at it, which its own cells give.
class CountSketchTopKOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& sketch_tensor = ctx->input(0);
    int64_t n = 0, k = 0;
    OP_REQUIRES_OK(ctx, checks::SketchTopKInputs(ctx, &n, &k));
    tensorflow::OpInputList xs;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    const ListParts<float> x(xs);
    const PartIndex& where = x.where;
    const int64_t cols = sketch_tensor.dim_size(1);
    const int64_t seed =
        SketchSeed(ctx->input(xs.size() + 3).scalar<int64_t>()(), ctx->input(xs.size() + 4).scalar<int64_t>()());
    Tensor *values_tensor = nullptr, *indices_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k}), &values_tensor));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k}), &indices_tensor));
    if (k == 0) return;
    const float* row = sketch_tensor.flat<float>().data();
    float* values = values_tensor->flat<float>().data();
    int32_t* indices = indices_tensor->flat<int32_t>().data();
    const Regions regions = RegionsOf(n, cols);
    const uint64_t row_key = RowKey(seed, 0);

    // Coordinates per cell (a segment has fewer than 2^31): CountSketch's, or counted here. Each region is zeroed
    // by its task as it starts, in order, so that its random increments find it in the core's cache (a zeroed
    // vector's would miss).
    const Tensor& given = ctx->input(1);
    std::unique_ptr<int32_t[]> loads_buffer;
    const int32_t* loads = given.flat<int32_t>().data();
    if (given.NumElements() != 0) {  // (non-negative, so that no region's place in the output passes k)
      int64_t total = 0, negative = 0;
      for (int64_t c = 0; c < cols; ++c) {
        total += loads[c];
        negative += loads[c] < 0;
      }
      OP_REQUIRES(ctx, total == n && negative == 0,
                  InvalidArgument("loads sum to ", total, " with ", negative, " negative, not to x's ", n,
                                  " elements: give count_sketch's loads of the same x's size, seed and step"));
    } else {
      loads_buffer.reset(new int32_t[cols]);
      int32_t* counted = loads_buffer.get();
      HashSegments(ctx, regions, n, row_key, /*signs=*/false, 8,
                   [&](int64_t s, int64_t a, int64_t len, const uint32_t* bucket, const float*) {
        int32_t* region = counted + regions.First(s);
        if (a == s * regions.per_segment) std::fill(region, region + regions.Width(s), 0);
        for (int64_t t = 0; t < len; ++t) ++region[bucket[t]];
        return true;
      });
      for (int64_t s = 0; s < regions.count; ++s) {  // regions whose segment holds no coordinate
        if (s * regions.per_segment >= n) std::fill(counted + regions.First(s), counted + regions.First(s + 1), 0);
      }
      loads = counted;
    }

    // The threshold key: the high 15 bits' bin of the k-th largest coordinate key, then the low 16 bits'.
    std::vector<int64_t> high(kHighBins, 0), low(kLowBins, 0);
    for (int64_t c = 0; c < cols; ++c) high[AbsKey(row[c]) >> 16] += loads[c];
    int64_t above_high = 0, above_low = 0;
    const uint32_t high_bin = BinOfRank(high, k, &above_high);
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t key = AbsKey(row[c]);
      if ((key >> 16) == high_bin) low[key & 0xffff] += loads[c];
    }
    const uint32_t threshold = (high_bin << 16) | BinOfRank(low, k - above_high, &above_low);
    const int64_t ties_to_take = k - above_high - above_low;

    // Each region's place in the output: its coordinates above the threshold and the ties it takes.
    std::vector<int64_t> out(regions.count + 1, 0), ties_left(regions.count);
    int64_t ties_before = 0;
    for (int64_t s = 0; s < regions.count; ++s) {
      int64_t greater = 0, ties = 0;
      for (int64_t c = regions.First(s); c < regions.First(s + 1); ++c) {
        const uint32_t key = AbsKey(row[c]);
        greater += key > threshold ? loads[c] : 0;
        ties += key == threshold ? loads[c] : 0;
      }
      ties_left[s] = TiesTaken(ties_to_take, ties_before, ties);
      ties_before += ties;
      out[s + 1] = out[s] + greater + ties_left[s];
    }
    std::vector<int64_t> end(out.begin() + 1, out.end());
    HashSegments(ctx, regions, n, row_key, /*signs=*/false, 10,
                 [&](int64_t s, int64_t a, int64_t len, const uint32_t* bucket, const float*) {
      // The run's selected coordinates are staged, then copied out.
      int32_t stage[kRun];
      const float* region = row + regions.First(s);
      if (a == s * regions.per_segment) WarmUp(region, regions.Width(s));
      int64_t ties = ties_left[s];
      const int64_t taken = std::min(SelectRun(region, bucket, a, len, threshold, &ties, stage), end[s] - out[s]);
      for (int64_t t = 0, part = where.PartOf(a); t < taken; ++t) {  // (staged in increasing order)
        while (stage[t] >= where.start(part + 1)) ++part;
        indices[out[s] + t] = stage[t];
        values[out[s] + t] = x.data[part][stage[t] - where.start(part)];
      }
      out[s] += taken;
      ties_left[s] = ties;
      return out[s] < end[s];
    });
    for (int64_t s = 0; s < regions.count; ++s) {  // given loads of other hashes leave a region short of its place
      const int64_t start = s ? end[s - 1] : 0;
      OP_REQUIRES(ctx, out[s] == end[s],
                  InvalidArgument("the loads do not match x's hashes (region ", s, " selected ", out[s] - start, " of ",
                                  end[s] - start, "): give count_sketch's loads of the same seed and step"));
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("CountSketchTopK").Device(DEVICE_CPU).HostMemory("k").HostMemory("seed").HostMemory("step"),
                        CountSketchTopKOp);

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
