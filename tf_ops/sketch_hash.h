// The count-sketch hash: bucket and sign of coordinate i in row j, from the
// seed alone (splitmix64 for the row's key, then a keyed 32-bit hash per coordinate and a multiply-shift range
// reduction).
// Must match sketch_hash in tests/np_reference.py. Integer arithmetic only, shared by the CPU kernels
// (sketch_kernels.cc) and the GPU kernels (gpu/sketch_kernels.cu): __host__ __device__ under nvcc.
#ifndef HVD_COMPRESS_TF_OPS_SKETCH_HASH_H_
#define HVD_COMPRESS_TF_OPS_SKETCH_HASH_H_

#include <cstdint>

#include "cores.h"

namespace hvd_compress {

HC_HOST_DEVICE inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The seed of a step's hashes: step 0 hashes with `seed` itself.
HC_HOST_DEVICE inline int64_t SketchSeed(int64_t seed, int64_t step) {
  return static_cast<int64_t>(static_cast<uint64_t>(seed) +
                              static_cast<uint64_t>(step) * 0x632BE59BD9B4E019ull);
}

// Per-row key: computed once per row, then combined with each coordinate.
HC_HOST_DEVICE inline uint64_t RowKey(int64_t seed, int64_t row) {
  return Mix64(static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull +
               static_cast<uint64_t>(row + 1) * 0xD1B54A32D192ED03ull);
}

struct BucketSign {
  int64_t bucket;
  float sign;
};

// A row wider than kRegionCols columns (16 KB of floats: a core's L1 cache) is cut into S = ceil(cols / kRegionCols)
// regions of (nearly) equal width, and the n coordinates into S equal segments
// of L = ceil(n / S): coordinate i hashes into the region of its segment,
// i / L, only. A sketch is thus built and queried one cache-sized region at a
// time; every region has the load of the whole row (L coordinates into cols / S
// columns). A row of at most kRegionCols columns is one region: the plain hash.
constexpr int64_t kRegionCols = int64_t{1} << 12;

// Coordinate i's column in a region of `width` <= kRegionCols columns (a width from Regions, below) and its sign,
// in the row of `row_key`: h = KeyedHash32(row_key, i) (cores.h, two rounds of lowbias32: 32-bit multiplies only, so
// that 8 coordinates cost 5 vector multiplies on AVX2, 4 for h and 1 for the column, where splitmix64's 64-bit
// multiplies cost three times as much), the column from h's top 20 bits by a multiply-shift range reduction
// (((h >> 12) width) >> 20: exact in 32 bits for width <= 2^12, each column within width / 2^20 of its share), the
// sign from its lowest bit.
HC_HOST_DEVICE inline BucketSign SketchHash(uint64_t row_key, int64_t i, int64_t width) {
  static_assert(kRegionCols <= (int64_t{1} << 12), "SketchHash reduces 20 bits of the hash into a region's width");
  const uint32_t h = KeyedHash32(row_key, i);
  return {static_cast<int64_t>(((h >> 12) * static_cast<uint32_t>(width)) >> 20), (h & 1u) ? -1.0f : 1.0f};
}

struct Regions {
  int64_t count;        // S
  int64_t per_segment;  // L
  int64_t cols;

  HC_HOST_DEVICE int64_t First(int64_t s) const { return s * cols / count; }  // first column of region s
  HC_HOST_DEVICE int64_t Width(int64_t s) const { return First(s + 1) - First(s); }
};

HC_HOST_DEVICE inline Regions RegionsOf(int64_t n, int64_t cols) {
  const int64_t count = (cols + kRegionCols - 1) / kRegionCols;
  const int64_t per_segment = (n + count - 1) / count;
  return {count, per_segment > 1 ? per_segment : 1, cols};
}

// The cell of coordinate i (0 <= i < n) in the row of `row_key` under the regions r: its column in
// [0, cols) (the first column of its segment's region plus its hash into the region's width) and its sign.
HC_HOST_DEVICE inline BucketSign SketchCell(const Regions& r, uint64_t row_key, int64_t i) {
  const int64_t s = i / r.per_segment;
  const int64_t first = r.First(s);
  const BucketSign h = SketchHash(row_key, i, r.First(s + 1) - first);
  return {first + h.bucket, h.sign};
}

}  // namespace hvd_compress

#endif  // HVD_COMPRESS_TF_OPS_SKETCH_HASH_H_
