// GPU kernels of the blockwise low-bit quantizer (quantize_ops.cc has the contracts and the format;
// quantize_kernels.cc the CPU kernels). Every output is bit-equal to the CPU kernel's (and to the NumPy
// reference's), with cores.h's Quantize* arithmetic; no tolerance anywhere:
// - block statistics (BlockQuantizeCompress): a block's min and max are exact and order-free (the CPU's
//   own pieces on the kChunk grid are merged in no particular order either), so no piece plan is needed.
//   Each warp walks a span of kSpan elements of x, 4 consecutive elements per lane per tile, and keeps
//   per-lane partial keys of the current block in registers; when the block ends inside a tile, the
//   partials are reduced across the warp and merged into the block's order-preserving uint32 keys with
//   atomicMin / atomicMax (integer atomics: the same result in any order). NaN and +-Inf sort beyond
//   every finite key, which is how a non-finite block is recognised. One thread per block then turns
//   the keys into offset, scale and 1/scale with QuantizeFinish, as the CPU does (kept in the
//   workspace as one float4 per block, so a lane loads a block's parameters at once).
// - codes, residual and packing: one lane per 8 consecutive elements (one word of 8 codes, `bits`
//   bytes), QuantizeUniform of each element's global index (stochastic) or 0.5, QuantizeLevel,
//   QuantizeDecode for the residual; the padding bits after the last code are 0.
// - decoded mean (BlockQuantizeDecodeMean): one lane per 8 elements, the words of kPayloads payloads
//   loaded at once, then added in payload order from 0 in float32, divided by m, then + plus.
// Lanes find their elements' blocks by walking the bounds forward from the block of the span's start
// (a binary search once per span; then the next block is tried before any search), so small blocks
// cost no per-element search.
// Subnormals: nvcc keeps them (no -ftz), as NumPy does; TensorFlow runs its CPU kernels with denormals
// flushed to zero, so for subnormal inputs or intermediates the GPU matches the NumPy reference, and the
// CPU kernel may not (the caveat quantize_ops.cc states for the CPU).
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"
#include "launchers.h"

namespace hvd_compress {
namespace gpu {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kStatsPerLane = 4;                     // consecutive elements per lane per tile (statistics)
constexpr int64_t kStatsTile = 32 * kStatsPerLane;   // elements per warp per tile (statistics)
constexpr int kGroup = 8;                            // consecutive elements per lane per tile (codes, decoding)
constexpr int64_t kGroupTile = 32 * kGroup;          // elements per warp per tile (codes, decoding)
constexpr int64_t kSpan = 2048;                      // elements per warp span: a multiple of both tiles
constexpr int kPayloads = 4;                         // payloads whose words a lane loads at once (decoding)
static_assert(kSpan % kStatsTile == 0 && kSpan % kGroupTile == 0, "a span holds whole tiles");

// Order-preserving uint32 key of a float: a < b gives Key(a) < Key(b) (-0 below +0); NaN with the sign
// bit clear sorts above +Inf, with it set below -Inf.
__device__ inline uint32_t OrderedKey(float v) {
  const uint32_t u = FloatBits(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ inline float KeyFloat(uint32_t k) { return BitsFloat((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

constexpr uint32_t kNegInfKey = 0x007fffffu;  // OrderedKey(-Inf): finite keys lie strictly between the two
constexpr uint32_t kPosInfKey = 0xff800000u;  // OrderedKey(+Inf)

__device__ inline int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }


// The block of element i < n, given that block b holds an element in [i - step, i] (step >= 2): blocks are
// not empty, so i's block is one of b .. b + step. The next two are tried first, in cache.
__device__ inline int64_t Advance(const int64_t* bounds, int64_t num_blocks, int64_t b, int64_t step, int64_t i) {
  if (bounds[b + 1] > i) return b;
  if (bounds[b + 2] > i) return b + 1;  // bounds[b + 1] <= i < n: b + 2 <= num_blocks
  return BlockIn(bounds, b + 2, Min64(num_blocks, b + 1 + step), i);
}

// Bit k (0 < k < count <= N) set where element i0 + k starts a block, walking on from b, the block of i0.
// Element i0 + k - 1 lies in the current block, so bounds[current + 1] >= i0 + k, and a block that ends
// at i0 + k is followed by one that holds it (blocks are not empty).
template <int N>
__device__ inline uint32_t BlockStarts(const int64_t* bounds, int64_t b, int64_t i0, int count) {
  int64_t next = bounds[b + 1];
  uint32_t starts = 0;
#pragma unroll
  for (int k = 1; k < N; ++k) {
    if (k < count && next == i0 + k) {
      starts |= 1u << k;
      next = bounds[++b + 1];
    }
  }
  return starts;
}

// blk[k]: the block of element i0 + k for k < count (count <= N), walking on from b, the block of i0;
// blk[k] for k >= count repeats the last one.
template <int N>
__device__ inline void WalkBlocks(const int64_t* bounds, int64_t b, int64_t i0, int count, int64_t* blk) {
  int64_t next = bounds[b + 1];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (k < count) {
      while (next <= i0 + k) next = bounds[++b + 1];
    }
    blk[k] = b;
  }
}

__device__ inline void WarpMinMax(uint32_t* lo, uint32_t* hi) {
  for (int d = 16; d > 0; d >>= 1) {
    *lo = min(*lo, __shfl_xor_sync(kFull, *lo, d));
    *hi = max(*hi, __shfl_xor_sync(kFull, *hi, d));
  }
}

__device__ inline void MergeKeys(uint32_t* lo_key, uint32_t* hi_key, int64_t b, uint32_t lo, uint32_t hi) {
  atomicMin(lo_key + b, lo);
  atomicMax(hi_key + b, hi);
}

// The warp's span s covers [s * kSpan, min(n, (s + 1) * kSpan)); spans go to warps with a grid stride.
#define HC_WARP_SPANS(s, n)                                                                 \
  for (int64_t s = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32,     \
               spans_ = ((n) + kSpan - 1) / kSpan;                                          \
       s < spans_; s += static_cast<int64_t>(gridDim.x) * blockDim.x / 32)

// lo_key[b] = min and hi_key[b] = max of OrderedKey(x[i]) over block b (keys set to 0xffffffff and 0 before).
__global__ void StatsKernel(const float* x, const int64_t* bounds, int64_t num_blocks, int64_t n, uint32_t* lo_key,
                            uint32_t* hi_key) {
  const int lane = threadIdx.x & 31;
  const bool aligned = (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  HC_WARP_SPANS(s, n) {
    const int64_t span_begin = s * kSpan, span_end = min(n, span_begin + kSpan);
    // b: the block of the lane's first element of the current tile (kept current while the lane has one).
    int64_t b = BlockOf(bounds, num_blocks, Min64(span_begin + kStatsPerLane * lane, span_end - 1));
    int64_t carry = __shfl_sync(kFull, b, 0);  // the block whose per-lane partial keys acc_lo, acc_hi hold
    uint32_t acc_lo = 0xffffffffu, acc_hi = 0u;
    for (int64_t tile = span_begin; tile < span_end; tile += kStatsTile) {  // uniform over the warp
      const int64_t i0 = tile + kStatsPerLane * lane;
      float v[kStatsPerLane];
      bool ok[kStatsPerLane];
      int64_t blk[kStatsPerLane];
      if (aligned && i0 + kStatsPerLane <= span_end) {
        const float4 q = *reinterpret_cast<const float4*>(x + i0);
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
      } else {
#pragma unroll
        for (int k = 0; k < kStatsPerLane; ++k) v[k] = i0 + k < span_end ? x[i0 + k] : 0.0f;
      }
      const int count = static_cast<int>(Min64(kStatsPerLane, span_end > i0 ? span_end - i0 : 0));
      if (count > 0) {
        b = Advance(bounds, num_blocks, b, kStatsTile, i0);
        WalkBlocks<kStatsPerLane>(bounds, b, i0, count, blk);
      } else {
#pragma unroll
        for (int k = 0; k < kStatsPerLane; ++k) blk[k] = b;
      }
      const int64_t last_b = blk[kStatsPerLane - 1];  // the block of the lane's last element
      bool mine = true;                                 // every element of the lane is in block `carry`
      uint32_t key[kStatsPerLane];
#pragma unroll
      for (int k = 0; k < kStatsPerLane; ++k) {
        ok[k] = k < count;
        if (ok[k]) mine = mine && blk[k] == carry;
        key[k] = OrderedKey(v[k]);
      }
      if (__all_sync(kFull, mine)) {  // the tile stays in block `carry`
#pragma unroll
        for (int k = 0; k < kStatsPerLane; ++k) {
          if (ok[k]) acc_lo = min(acc_lo, key[k]), acc_hi = max(acc_hi, key[k]);
        }
        continue;
      }
      // Block `carry` ends in this tile: its elements here join the partials, which go to its keys.
#pragma unroll
      for (int k = 0; k < kStatsPerLane; ++k) {
        if (ok[k] && blk[k] == carry) acc_lo = min(acc_lo, key[k]), acc_hi = max(acc_hi, key[k]);
      }
      WarpMinMax(&acc_lo, &acc_hi);
      if (lane == 0) MergeKeys(lo_key, hi_key, carry, acc_lo, acc_hi);
      // The tile's last block is the new carry; the blocks strictly between go to their keys at once.
      const int last_lane = static_cast<int>(Min64(31, (span_end - 1 - tile) / kStatsPerLane));
      const int64_t old = carry;
      carry = __shfl_sync(kFull, last_b, last_lane);
      acc_lo = 0xffffffffu, acc_hi = 0u;
      bool middle = false;
#pragma unroll
      for (int k = 0; k < kStatsPerLane; ++k) {
        if (ok[k] && blk[k] == carry) acc_lo = min(acc_lo, key[k]), acc_hi = max(acc_hi, key[k]);
        middle = middle || (ok[k] && blk[k] != old && blk[k] != carry);
      }
      if (__any_sync(kFull, middle)) {
        // Per k, elements tile + 4 * lane + k rise with the lane, so a block's are consecutive lanes:
        // a segmented reduction (segments: equal blocks), whose first lane merges the segment's keys.
#pragma unroll
        for (int k = 0; k < kStatsPerLane; ++k) {
          const bool in = ok[k] && blk[k] != old && blk[k] != carry;
          const int rel = in ? static_cast<int>(blk[k] - old) : -1;  // 0 < rel <= kStatsTile
          uint32_t lo = key[k], hi = key[k];
          for (int d = 1; d < 32; d <<= 1) {
            const uint32_t other_lo = __shfl_down_sync(kFull, lo, d), other_hi = __shfl_down_sync(kFull, hi, d);
            const int other = __shfl_down_sync(kFull, rel, d);
            if (lane + d < 32 && other == rel) lo = min(lo, other_lo), hi = max(hi, other_hi);
          }
          const int before = __shfl_up_sync(kFull, rel, 1);
          if (in && (lane == 0 || before != rel)) MergeKeys(lo_key, hi_key, old + rel, lo, hi);
        }
      }
    }
    WarpMinMax(&acc_lo, &acc_hi);
    if (lane == 0) MergeKeys(lo_key, hi_key, carry, acc_lo, acc_hi);
  }
}

// offsets, scales and params (offset, scale, 1/scale, 0) of every block from its keys, as the CPU's QuantizeFinish.
__global__ void ParamsKernel(const uint32_t* lo_key, const uint32_t* hi_key, int64_t num_blocks, int bits,
                             float* offsets, float* scales, float4* params) {
  HC_GRID_LOOP(b, num_blocks) {
    const uint32_t lo = lo_key[b], hi = hi_key[b];
    const QuantizeStats stats{KeyFloat(lo), KeyFloat(hi), lo <= kNegInfKey || hi >= kPosInfKey};
    const QuantizeParams p = QuantizeFinish(stats, bits);
    offsets[b] = p.offset;
    scales[b] = p.scale;
    params[b] = make_float4(p.offset, p.scale, p.inv, 0.0f);
  }
}

// The `bytes` bytes at p as a little-endian word (one load where p is aligned to a whole group's word).
template <int kBits>
__device__ inline uint64_t LoadWord(const uint8_t* p, int bytes) {
  if (bytes == kBits && (reinterpret_cast<uintptr_t>(p) & (kBits - 1)) == 0) {
    if (kBits == 2) return *reinterpret_cast<const uint16_t*>(p);
    if (kBits == 4) return *reinterpret_cast<const uint32_t*>(p);
    return *reinterpret_cast<const uint64_t*>(p);
  }
  uint64_t word = 0;
  for (int q = 0; q < bytes; ++q) word |= static_cast<uint64_t>(p[q]) << (8 * q);
  return word;
}

template <int kBits>
__device__ inline void StoreWord(uint8_t* p, int bytes, uint64_t word) {
  if (bytes == kBits && (reinterpret_cast<uintptr_t>(p) & (kBits - 1)) == 0) {
    if (kBits == 2) *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(word);
    else if (kBits == 4) *reinterpret_cast<uint32_t*>(p) = static_cast<uint32_t>(word);
    else *reinterpret_cast<uint64_t*>(p) = word;
    return;
  }
  for (int q = 0; q < bytes; ++q) p[q] = static_cast<uint8_t>(word >> (8 * q));
}

// v[0, count) = p[0, count), zeros after (count <= 8; p 16-byte aligned for the vector path).
__device__ inline void LoadGroup(const float* p, int count, float* v) {
  if (count == kGroup && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], c = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = c.x, v[5] = c.y, v[6] = c.z, v[7] = c.w;
    return;
  }
#pragma unroll
  for (int k = 0; k < kGroup; ++k) v[k] = k < count ? p[k] : 0.0f;
}

__device__ inline void StoreGroup(float* p, int count, const float* v) {
  if (count == kGroup && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    return;
  }
#pragma unroll
  for (int k = 0; k < kGroup; ++k) {
    if (k < count) p[k] = v[k];
  }
}

// Codes, packed words and residual (may be x, or NULL) of every element, from the blocks' parameters.
template <int kBits, bool kStochastic>
__global__ void CodeKernel(const float* x, const int64_t* bounds, int64_t num_blocks, int64_t n, const float4* params,
                           uint64_t seed_base, uint8_t* packed, float* residual) {
  const int lane = threadIdx.x & 31;
  const float levels = QuantizeLevels(kBits);
  HC_WARP_SPANS(s, n) {
    const int64_t span_begin = s * kSpan, span_end = min(n, span_begin + kSpan);
    int64_t b = BlockOf(bounds, num_blocks, Min64(span_begin + kGroup * lane, span_end - 1));
    for (int64_t tile = span_begin; tile < span_end; tile += kGroupTile) {
      const int64_t i0 = tile + kGroup * lane;  // a multiple of 8: its codes start a byte
      if (i0 >= span_end) break;                // this lane is done with the span (no warp-wide calls here)
      const int count = static_cast<int>(Min64(kGroup, span_end - i0));
      b = Advance(bounds, num_blocks, b, kGroupTile, i0);
      float v[kGroup], r[kGroup];
      LoadGroup(x + i0, count, v);
      const uint32_t starts = BlockStarts<kGroup>(bounds, b, i0, count);
      int64_t current = b;
      float4 q = params[current];
      uint64_t word = 0;
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        r[k] = 0.0f;
        if (k < count) {
          if ((starts >> k) & 1u) q = params[++current];
          const QuantizeParams p{q.x, q.y, q.z};
          const float add = kStochastic ? QuantizeUniform(seed_base, i0 + k) : 0.5f;
          const float f = QuantizeLevel(v[k], p, add, levels);
          word |= static_cast<uint64_t>(static_cast<uint32_t>(f)) << (k * kBits);
          r[k] = v[k] - QuantizeDecode(p.offset, f, p.scale);
        }
      }
      if (residual != nullptr) StoreGroup(residual + i0, count, r);
      StoreWord<kBits>(packed + i0 / 8 * kBits, (count * kBits + 7) / 8, word);
    }
  }
}

// y[i] = (sum over payloads r in order of QuantizeDecode(offsets[r, b], q_ri, scales[r, b])) / m (+ plus[i]).
template <int kBits>
__global__ void DecodeMeanKernel(const uint8_t* packed, const float* scales, const float* offsets,
                                 const int64_t* bounds, int64_t num_blocks, int64_t n, int64_t m, const float* plus,
                                 float* y) {
  const int lane = threadIdx.x & 31;
  const int64_t num_bytes = QuantizePackedBytes(n, kBits);
  const float count_f = static_cast<float>(m);
  const uint64_t mask = (1u << kBits) - 1u;
  HC_WARP_SPANS(s, n) {
    const int64_t span_begin = s * kSpan, span_end = min(n, span_begin + kSpan);
    int64_t b = BlockOf(bounds, num_blocks, Min64(span_begin + kGroup * lane, span_end - 1));
    for (int64_t tile = span_begin; tile < span_end; tile += kGroupTile) {
      const int64_t i0 = tile + kGroup * lane;
      if (i0 >= span_end) break;
      const int count = static_cast<int>(Min64(kGroup, span_end - i0));
      b = Advance(bounds, num_blocks, b, kGroupTile, i0);
      const uint32_t starts = BlockStarts<kGroup>(bounds, b, i0, count);
      float acc[kGroup];
#pragma unroll
      for (int k = 0; k < kGroup; ++k) acc[k] = 0.0f;
      const int bytes = (count * kBits + 7) / 8;
      const uint8_t* words = packed + i0 / 8 * kBits;
      for (int64_t r0 = 0; r0 < m; r0 += kPayloads) {
        // kPayloads payloads' words and parameters loaded at once (a repeated last payload past m, unused).
        uint64_t word[kPayloads];
        float offset0[kPayloads], scale0[kPayloads];
#pragma unroll
        for (int j = 0; j < kPayloads; ++j) {
          const int64_t r = Min64(r0 + j, m - 1);
          word[j] = LoadWord<kBits>(words + r * num_bytes, bytes);
          offset0[j] = offsets[r * num_blocks + b];
          scale0[j] = scales[r * num_blocks + b];
        }
#pragma unroll
        for (int j = 0; j < kPayloads; ++j) {
          if (r0 + j < m) {  // payloads in order
            const float* row_offsets = offsets + (r0 + j) * num_blocks;
            const float* row_scales = scales + (r0 + j) * num_blocks;
            int64_t current = b;
            float offset = offset0[j], scale = scale0[j];
#pragma unroll
            for (int k = 0; k < kGroup; ++k) {
              if (k < count) {
                if ((starts >> k) & 1u) ++current, offset = row_offsets[current], scale = row_scales[current];
                const float code = static_cast<float>(static_cast<uint32_t>((word[j] >> (k * kBits)) & mask));
                acc[k] = acc[k] + QuantizeDecode(offset, code, scale);
              }
            }
          }
        }
      }
      float out[kGroup];
      if (plus != nullptr) {
        float add[kGroup];
        LoadGroup(plus + i0, count, add);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) out[k] = acc[k] / count_f + add[k];
      } else {
#pragma unroll
        for (int k = 0; k < kGroup; ++k) out[k] = acc[k] / count_f;
      }
      StoreGroup(y + i0, count, out);
    }
  }
}

unsigned int SpanBlocks(int64_t n) { return Blocks((n + kSpan - 1) / kSpan * 32); }

template <int kBits>
void LaunchCode(bool stochastic, const float* x, const int64_t* bounds, int64_t num_blocks, int64_t n,
                const float4* params, uint64_t seed_base, uint8_t* packed, float* residual, cudaStream_t stream) {
  if (stochastic) {
    CodeKernel<kBits, true><<<SpanBlocks(n), kThreads, 0, stream>>>(x, bounds, num_blocks, n, params, seed_base,
                                                                    packed, residual);
  } else {
    CodeKernel<kBits, false><<<SpanBlocks(n), kThreads, 0, stream>>>(x, bounds, num_blocks, n, params, seed_base,
                                                                     packed, residual);
  }
}

// Workspace: the blocks' min keys and max keys (uint32), then (16-byte aligned) their params (float4).
int64_t ParamsOffset(int64_t num_blocks) { return (num_blocks * 2 * sizeof(uint32_t) + 15) / 16 * 16; }

}  // namespace
}  // namespace gpu
}  // namespace hvd_compress

using namespace hvd_compress;       // NOLINT: the C launchers below are thin
using namespace hvd_compress::gpu;  // NOLINT

extern "C" {

size_t hc_quantize_compress_workspace_bytes(int64_t num_blocks) {
  return static_cast<size_t>(ParamsOffset(num_blocks) + num_blocks * sizeof(float4));
}

int hc_quantize_compress(const float* x, const int64_t* bounds, int64_t num_blocks, int64_t n, int bits,
                         int stochastic, int64_t seed_key, int64_t seed_counter, uint8_t* packed, float* scales,
                         float* offsets, float* residual, void* workspace, hc_stream stream) {
  if (bits != 2 && bits != 4 && bits != 8) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (num_blocks < 1) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(workspace) & 15) != 0) return cudaErrorMisalignedAddress;
  uint32_t* lo_key = static_cast<uint32_t*>(workspace);
  uint32_t* hi_key = lo_key + num_blocks;
  float4* params = reinterpret_cast<float4*>(static_cast<char*>(workspace) + ParamsOffset(num_blocks));
  cudaError_t status = cudaMemsetAsync(lo_key, 0xff, num_blocks * sizeof(uint32_t), stream);
  if (status == cudaSuccess) status = cudaMemsetAsync(hi_key, 0, num_blocks * sizeof(uint32_t), stream);
  if (status != cudaSuccess) return status;
  StatsKernel<<<SpanBlocks(n), kThreads, 0, stream>>>(x, bounds, num_blocks, n, lo_key, hi_key);
  ParamsKernel<<<Blocks(num_blocks), kThreads, 0, stream>>>(lo_key, hi_key, num_blocks, bits, offsets, scales,
                                                            params);
  const uint64_t seed_base = QuantizeSeedBase(seed_key, seed_counter);
  const bool random = stochastic != 0;
  if (bits == 2) {
    LaunchCode<2>(random, x, bounds, num_blocks, n, params, seed_base, packed, residual, stream);
  } else if (bits == 4) {
    LaunchCode<4>(random, x, bounds, num_blocks, n, params, seed_base, packed, residual, stream);
  } else {
    LaunchCode<8>(random, x, bounds, num_blocks, n, params, seed_base, packed, residual, stream);
  }
  return Launched();
}

int hc_quantize_decode_mean(const uint8_t* packed, const float* scales, const float* offsets, const int64_t* bounds,
                            int64_t num_blocks, int64_t n, int64_t m, int bits, const float* plus, float* y,
                            hc_stream stream) {
  if (bits != 2 && bits != 4 && bits != 8) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (m < 1 || num_blocks < 1) return cudaErrorInvalidValue;
  if (bits == 2) {
    DecodeMeanKernel<2><<<SpanBlocks(n), kThreads, 0, stream>>>(packed, scales, offsets, bounds, num_blocks, n, m,
                                                                plus, y);
  } else if (bits == 4) {
    DecodeMeanKernel<4><<<SpanBlocks(n), kThreads, 0, stream>>>(packed, scales, offsets, bounds, num_blocks, n, m,
                                                                plus, y);
  } else {
    DecodeMeanKernel<8><<<SpanBlocks(n), kThreads, 0, stream>>>(packed, scales, offsets, bounds, num_blocks, n, m,
                                                                plus, y);
  }
  return Launched();
}

}  // extern "C"
