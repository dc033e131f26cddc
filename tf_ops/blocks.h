// Shared helpers for the hvd_compress CPU kernels: block bounds, the fixed
// chunk decomposition used for deterministic multi-threading, and sharding
// onto TensorFlow's CPU thread pool. The arithmetic itself, shared with the
// GPU kernels, is in cores.h.
//
// Determinism: work is split into chunks of kChunk elements at fixed global
// offsets (multiples of kChunk), never by thread count, so every reduction is
// done in the same order on any machine and the NumPy reference in
// tests/np_reference.py reproduces it bit for bit.
#ifndef HVD_COMPRESS_TF_OPS_BLOCKS_H_
#define HVD_COMPRESS_TF_OPS_BLOCKS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <cstdlib>
#include <vector>
#if defined(__x86_64__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "cores.h"
#include "status.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/util/work_sharder.h"

namespace hvd_compress {

using tensorflow::OpKernelContext;
using tensorflow::Tensor;

// Runs work(begin, end) over [0, total) on TF's intra-op CPU thread pool.
// cost_per_unit is a rough count of cycles for one unit of work.
inline void ParallelFor(OpKernelContext* ctx, int64_t total,
                        int64_t cost_per_unit,
                        const std::function<void(int64_t, int64_t)>& work) {
  const auto& workers = *ctx->device()->tensorflow_cpu_worker_threads();
  tensorflow::Shard(workers.num_threads, workers.workers, total, cost_per_unit,
                    [&work](int64_t begin, int64_t end) { work(begin, end); });
}

#if defined(__x86_64__)
// Whether the kernels' AVX-512 paths run: the CPU has AVX-512 F, BW, DQ and VL, and HVD_COMPRESS_AVX512=0 in the
// environment does not keep the AVX2 ones (the tests compare the two; both give the same bits).
inline bool UseAvx512() {
  static const bool use = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && [] {
                            const char* setting = std::getenv("HVD_COMPRESS_AVX512");
                            return setting == nullptr || std::strcmp(setting, "0") != 0;
                          }();
  return use;
}
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// Mix32 (cores.h) of 8 lanes.
__attribute__((target("avx2"))) inline __m256i Mix32Avx2(__m256i x) {
  x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 16)), _mm256_set1_epi32(0x7feb352d));
  x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 15)),
                         _mm256_set1_epi32(static_cast<int32_t>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wmaybe-uninitialized mistakes for a read (a
// warning group Clang does not know).
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// Mix32 of 16 lanes (its callers take the same target, so that it inlines).
__attribute__((target("avx512f,avx512bw"))) inline __m512i Mix32Avx512(__m512i x) {
  x = _mm512_mullo_epi32(_mm512_xor_si512(x, _mm512_srli_epi32(x, 16)), _mm512_set1_epi32(0x7feb352d));
  x = _mm512_mullo_epi32(_mm512_xor_si512(x, _mm512_srli_epi32(x, 15)),
                         _mm512_set1_epi32(static_cast<int32_t>(0x846ca68bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

#if defined(__AVX__)
// The mean's division of eight float32 sums by a count of payloads (the unpack and decode means): a multiply by
// 1 / count where count is a power of two, the same floats (x / 2^k and x * 2^-k round the same real number), and a
// division otherwise. A division of eight floats costs several multiplies' time, and decoding the mean of a few
// payloads is little else.
class CountDivisor {
 public:
  explicit CountDivisor(float count)
      : count_(_mm256_set1_ps(count)), reciprocal_(_mm256_set1_ps(1.0f / count)), power_of_two_(IsPowerOfTwo(count)) {}
  __m256 operator()(__m256 sums) const {
    return power_of_two_ ? _mm256_mul_ps(sums, reciprocal_) : _mm256_div_ps(sums, count_);
  }

 private:
  static bool IsPowerOfTwo(float count) {
    int exponent = 0;
    return count > 0.0f && std::frexp(count, &exponent) == 0.5f;
  }
  __m256 count_, reciprocal_;
  bool power_of_two_;
};
#endif

// The radix selects' two levels of bins (TopKAbs, CountSketchTopK): a key's high 15 bits (its top bit is clear), then
// its low 16 bits inside the high bin that holds the k-th largest.
constexpr int kHighBins = 1 << 15;  // key >> 16
constexpr int kLowBins = 1 << 16;   // key & 0xffff

// The radix selects' step (TopKAbs, CountSketchTopK): the bin holding the `rank`-th largest element
// (1-based) given the counts per bin; returns it and sets *above to the count in higher bins.
inline int64_t BinOfRank(const std::vector<int64_t>& counts, int64_t rank, int64_t* above) {
  *above = 0;
  for (int64_t bin = static_cast<int64_t>(counts.size()) - 1; bin >= 0; --bin) {
    if (*above + counts[bin] >= rank) return bin;
    *above += counts[bin];
  }
  return 0;  // unreachable when rank <= total count
}

// Before an in-place update of a float32 variable whose lock the caller holds: gives it a buffer of its own where a
// read still holds the current one (the read keeps the value it read).
inline absl::Status OwnBuffer(OpKernelContext* ctx, tensorflow::Var* var) {
  Tensor* v = var->tensor();
  if (!var->copy_on_read_mode.load() && v->RefCountIsOne()) return absl::OkStatus();
  Tensor copy;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tensorflow::DT_FLOAT, v->shape(), &copy));
  std::memcpy(copy.flat<float>().data(), v->flat<float>().data(), v->NumElements() * sizeof(float));
  *v = copy;
  return absl::OkStatus();
}

// Checks that `bounds` is an int64 vector [0 = b_0 < b_1 < ... < b_B = n]
// describing B non-empty blocks that cover n elements.
inline absl::Status ValidateBounds(const Tensor& bounds, int64_t n) {
  if (bounds.dims() != 1 || bounds.NumElements() < 1) {
    return InvalidArgument(
        "bounds must be a vector [0, ..., n] of block boundaries, got shape ",
        bounds.shape().DebugString(),
        "; build it with hvd_compress.ops.block_bounds(n, block_size)");
  }
  const auto b = bounds.flat<int64_t>();
  const int64_t last = b(b.size() - 1);
  if (b(0) != 0 || last != n) {
    return InvalidArgument(
        "bounds must start at 0 and end at the number of elements n=", n,
        ", got bounds[0]=", b(0), " and bounds[-1]=", last);
  }
  for (int64_t i = 1; i < b.size(); ++i) {
    if (b(i) <= b(i - 1)) {
      return InvalidArgument(
          "bounds must be strictly increasing (no empty blocks), but bounds[",
          i, "]=", b(i), " <= bounds[", i - 1, "]=", b(i - 1));
    }
  }
  return absl::OkStatus();
}

// Calls piece(block, begin, end) for every block that intersects the chunk
// [chunk_begin, chunk_end), clipped to the chunk, in increasing order.
template <typename Fn>
inline void ForEachPieceInChunk(const int64_t* bounds, int64_t num_blocks,
                                int64_t chunk_begin, int64_t chunk_end,
                                Fn&& piece) {
  int64_t block = std::upper_bound(bounds, bounds + num_blocks + 1,
                                   chunk_begin) - bounds - 1;
  for (; block < num_blocks && bounds[block] < chunk_end; ++block) {
    piece(block, std::max(chunk_begin, bounds[block]),
          std::min(chunk_end, bounds[block + 1]));
  }
}

// A concatenation of parts of given sizes (the tensors of one bucket, read
// where they lie): where a global index falls, and which parts a range meets.
class PartIndex {
 public:
  explicit PartIndex(const std::vector<int64_t>& sizes) : starts_(1, 0) {
    for (int64_t s : sizes) starts_.push_back(starts_.back() + s);
  }
  int64_t total() const { return starts_.back(); }
  int64_t start(int64_t part) const { return starts_[part]; }
  int64_t PartOf(int64_t index) const {
    return std::upper_bound(starts_.begin(), starts_.end(), index) - starts_.begin() - 1;
  }
  // Calls piece(part, offset_in_part, global_begin, length) for every part that
  // meets the global range [begin, end), in order.
  template <typename Fn>
  void ForEachPartIn(int64_t begin, int64_t end, Fn&& piece) const {
    for (int64_t part = PartOf(begin); part + 1 < static_cast<int64_t>(starts_.size()) && starts_[part] < end;
         ++part) {
      const int64_t lo = std::max(begin, starts_[part]), hi = std::min(end, starts_[part + 1]);
      if (hi > lo) piece(part, lo - starts_[part], lo, hi - lo);
    }
  }

 private:
  std::vector<int64_t> starts_;
};

// OK unless some index is outside [0, n).
template <typename Index>
inline absl::Status CheckIndices(const Index* idx, int64_t k, int64_t n) {
  for (int64_t i = 0; i < k; ++i) {
    if (idx[i] < 0 || idx[i] >= n) {
      return InvalidArgument("indices[", i, "] = ", idx[i], " is out of range [0, n=", n, ")");
    }
  }
  return absl::OkStatus();
}

// Checks that every int32 index is in [0, where.total()), then calls
// at(i, part, offset) for each, in order: index i is element `offset` of `part`.
template <typename Fn>
inline absl::Status ForEachIndexInParts(const Tensor& indices, const PartIndex& where, Fn&& at) {
  const int32_t* idx = indices.flat<int32_t>().data();
  const int64_t k = indices.NumElements();
  TF_RETURN_IF_ERROR(CheckIndices(idx, k, where.total()));
  for (int64_t i = 0; i < k; ++i) {
    const int64_t part = where.PartOf(idx[i]);
    at(i, part, idx[i] - where.start(part));
  }
  return absl::OkStatus();
}

// AbsKey (cores.h) of a half or bfloat16 element, through float.
template <typename T>
inline uint32_t AbsKey(T v) {
  return AbsKey(static_cast<float>(v));
}

}  // namespace hvd_compress

#endif  // HVD_COMPRESS_TF_OPS_BLOCKS_H_
