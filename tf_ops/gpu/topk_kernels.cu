// GPU kernels of the top-k and scatter ops: TopKAbs, ScatterDense, ScatterMean, GatherAt, ZeroAt
// (topk_ops.cc has the contracts; topk_kernels.cc the CPU kernels). Every result is the CPU's, bit for bit:
//
// TopKAbs: the k largest keys of |x| (cores.h: AbsKey for float32; HalfAbsKey / Bf16AbsKey, which order
// exactly as AbsKey of the float32 value, for float16 / bfloat16), ties at the k-th key to the lower index, in
// index order. The inputs are a list of parts (device pointers and sizes on the host), read where they lie, in
// the CPU's order (part 0's elements, then part 1's, ...): every kernel works on tiles of kTile elements that
// never cross a part's end, found on the device from a table of the parts' starts and pointers (staged with
// the select's state in one small copy). No host synchronisation:
// - a radix select of the k-th largest key, most significant digit first (float32: 11 + 10 + 10 bits of the
//   31-bit key; 16-bit types: 8 + 7 bits of the 15-bit key). Each digit is one read of x into per-block
//   shared-memory histograms of the keys that match the digits found so far, added into a global histogram
//   (integer atomics: order-free); one block then finds the digit holding the remaining rank (SelectState on
//   the device);
// - one read counts, per tile, the keys above the threshold and equal to it; one block scans the tiles in
//   order: a tile takes TiesTaken(ties to take, ties in earlier tiles, its ties) (cores.h, as the CPU's
//   WriteSelection) and its output offset is the sum of what earlier tiles take;
// - one read writes each tile's selection in index order: rounds of kThreads elements, ranks by warp ballots.
// Five reads of x for float32, four for 16-bit types; the output is written once.
//
// ScatterDense / ScatterMean: the CPU adds the values of an index in input order, from 0.0f, in float32 (then
// rounds once to the output type, or divides once by count). Here the (index, value) pairs are sorted by index
// with CUB's stable radix sort, so each index's values stay in input order, and one thread per run of equal
// indices adds them in that order from 0.0f: the same float32 sums. (A run is added by one thread: an index
// repeated m times costs m sequential adds; k repeats of one index would be slow but still exact.)
// GatherAt, ZeroAt: one thread per index (ZeroAt's duplicates write the same zero).
//
// Out-of-range indices: the CPU kernels reject them (InvalidArgument). Here they are skipped (GatherAt writes
// 0.0f for them) and never touch memory out of bounds; hc_first_out_of_range_* finds the first one, for a GPU op
// kernel to report as the CPU does.
#include <cub/cub.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstring>
#include <vector>

#include "common.cuh"
#include "launchers.h"

namespace hvd_compress {
namespace gpu {
namespace {

constexpr int kWarps = kThreads / 32;
constexpr int64_t kTile = 4096;          // elements per tile; per-tile counts are packed in 16 bits
constexpr int kMaxBins = 2048;           // the widest digit: 11 bits
constexpr int kHistWords = 2048 + 1024 + 1024;  // the digits' histograms, one after another
constexpr int kOneBlock = 1024;          // threads of the one-block kernels
constexpr int kScanItems = 4;            // tiles per thread per round of the tile scan
static_assert(kThreads % 32 == 0 && kTile < (1 << 16), "packed counts");

struct Digit {
  int shift, bits;
};

// Keys of each element type: Bits is the stored type (values are copied as bits), Key its order key.
struct F32Keys {
  using Bits = uint32_t;
  static constexpr int kDigits = 3;
  static constexpr Digit kDigit[3] = {{20, 11}, {10, 10}, {0, 10}};
  __device__ static uint32_t Key(uint32_t bits) { return AbsKey(BitsFloat(bits)); }
};
struct F16Keys {
  using Bits = uint16_t;
  static constexpr int kDigits = 2;
  static constexpr Digit kDigit[2] = {{7, 8}, {0, 7}};
  __device__ static uint32_t Key(uint16_t bits) { return HalfAbsKey(bits); }
};
struct Bf16Keys {
  using Bits = uint16_t;
  static constexpr int kDigits = 2;
  static constexpr Digit kDigit[2] = {{7, 8}, {0, 7}};
  __device__ static uint32_t Key(uint16_t bits) { return Bf16AbsKey(bits); }
};

// A run of at most kTile elements of one part; begin is its first element's index in the concatenation.
struct Tile {
  const void* data;
  int64_t begin;
  int length;
};

// The tiles of the parts, found on the device from a small table (staged from the host): part p's tiles are
// tile_starts[p] .. tile_starts[p + 1] - 1, its elements elem_starts[p] .. elem_starts[p + 1] - 1 of the
// concatenation, at bytes[p] (whose element size is `size`).
struct TilePlan {
  const int64_t* tile_starts;  // num_parts + 1
  const int64_t* elem_starts;  // num_parts + 1
  const uint64_t* pointers;    // num_parts
  int64_t num_parts;
  int64_t num_tiles;

  template <typename Bits>
  __device__ Tile At(int64_t t) const {
    const int64_t p = BlockOf(tile_starts, num_parts, t);  // skips empty parts
    const int64_t offset = (t - tile_starts[p]) * kTile;
    const int64_t length = elem_starts[p + 1] - elem_starts[p] - offset;
    return Tile{reinterpret_cast<const Bits*>(static_cast<uintptr_t>(pointers[p])) + offset,
                elem_starts[p] + offset, static_cast<int>(length < kTile ? length : kTile)};
  }
};

// The select's progress: the key's digits found so far (lower digits zero) and the rank (1-based) of the k-th
// largest key among the keys that match them. After the last digit: the threshold, and how many keys equal to
// it are taken.
struct SelectState {
  uint32_t prefix;
  uint32_t rank;
};

// Workspace of the top-k: [state | tile plan's table] (staged from the host), histograms (zeroed), per-tile
// arrays.
struct TopKLayout {
  size_t table, hist, above, equal, offset, taken, total;
};

TopKLayout LayoutTopK(int64_t num_parts, int64_t num_tiles) {
  TopKLayout l;
  l.table = 16;  // after the state
  l.hist = AlignUp(l.table + sizeof(int64_t) * (3 * num_parts + 2));
  l.above = AlignUp(l.hist + sizeof(uint32_t) * kHistWords);
  l.equal = AlignUp(l.above + sizeof(int32_t) * num_tiles);
  l.offset = AlignUp(l.equal + sizeof(int32_t) * num_tiles);
  l.taken = AlignUp(l.offset + sizeof(int64_t) * num_tiles);
  l.total = AlignUp(l.taken + sizeof(int32_t) * num_tiles);
  return l;
}

int64_t NumTiles(const int64_t* sizes_host, int64_t num_parts) {
  int64_t tiles = 0;
  for (int64_t p = 0; p < num_parts; ++p) tiles += (sizes_host[p] + kTile - 1) / kTile;
  return tiles;
}

// Blocks of a tile kernel: as many as the device holds at once (one wave), each looping over tiles.
template <typename Kernel>
unsigned int TileGrid(Kernel kernel, int64_t num_tiles) {
  int device = 0, sms = 132, per_sm = 4;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    sms = 132;
  }
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess || per_sm < 1) {
    per_sm = 4;
  }
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(num_tiles, int64_t{per_sm} * sms)));
}

// A tile's keys, kItems per thread (element u * kThreads + threadIdx.x), all loaded before any is used so
// that the loads are in flight together; past the tile's end: kNoKey, which matches no prefix (bit 31).
constexpr int kItems = kTile / kThreads;
constexpr uint32_t kNoKey = 0xffffffffu;
static_assert(kTile % kThreads == 0, "whole rounds");

template <typename K>
__device__ inline void LoadKeys(const Tile& tile, uint32_t (&keys)[kItems]) {
  const typename K::Bits* x = static_cast<const typename K::Bits*>(tile.data);
#pragma unroll
  for (int u = 0; u < kItems; ++u) {
    const int at = u * kThreads + static_cast<int>(threadIdx.x);
    keys[u] = at < tile.length ? K::Key(x[at]) : kNoKey;
  }
}

// Histogram of digit (shift, bits) of the keys whose higher digits equal state->prefix's.
template <typename K>
__global__ void __launch_bounds__(kThreads)
    DigitHistogramKernel(TilePlan plan, const SelectState* state, int shift, int bits, uint32_t* hist) {
  __shared__ uint32_t local[kMaxBins];
  const int bins = 1 << bits;
  for (int b = threadIdx.x; b < bins; b += kThreads) local[b] = 0;
  __syncthreads();
  const uint32_t prefix = state->prefix;
  const uint32_t high_mask = ~((1u << (shift + bits)) - 1u);  // shift + bits <= 31
  const uint32_t digit_mask = static_cast<uint32_t>(bins - 1);
  for (int64_t t = blockIdx.x; t < plan.num_tiles; t += gridDim.x) {
    uint32_t keys[kItems];
    LoadKeys<K>(plan.At<typename K::Bits>(t), keys);
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      if ((keys[u] & high_mask) == prefix) atomicAdd(&local[(keys[u] >> shift) & digit_mask], 1u);
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += kThreads) {
    if (local[b] != 0) atomicAdd(&hist[b], local[b]);
  }
}

// One block: the digit whose bin holds the state's rank, counting from the largest bin down.
__global__ void __launch_bounds__(kOneBlock) SelectDigitKernel(const uint32_t* hist, int shift, int bits,
                                                               SelectState* state) {
  using Scan = cub::BlockScan<uint32_t, kOneBlock>;
  __shared__ typename Scan::TempStorage temp;
  const int bins = 1 << bits;  // <= 2 * kOneBlock
  const uint32_t rank = state->rank, prefix = state->prefix;
  uint32_t count[2], above[2];
  for (int j = 0; j < 2; ++j) {
    const int r = 2 * static_cast<int>(threadIdx.x) + j;  // bins in decreasing order
    count[j] = r < bins ? hist[bins - 1 - r] : 0u;
  }
  Scan(temp).ExclusiveSum(count, above);  // above[j]: keys in higher bins
  __syncthreads();                        // every thread has read the state before it is written
  for (int j = 0; j < 2; ++j) {
    const int r = 2 * static_cast<int>(threadIdx.x) + j;
    if (r < bins && above[j] < rank && rank - above[j] <= count[j]) {
      state->prefix = prefix | (static_cast<uint32_t>(bins - 1 - r) << shift);
      state->rank = rank - above[j];
    }
  }
}

// Per tile: keys above the threshold and equal to it.
template <typename K>
__global__ void __launch_bounds__(kThreads)
    TileCountKernel(TilePlan plan, const SelectState* state, int32_t* tile_above, int32_t* tile_equal) {
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const uint32_t threshold = state->prefix;
  for (int64_t t = blockIdx.x; t < plan.num_tiles; t += gridDim.x) {
    uint32_t keys[kItems];
    LoadKeys<K>(plan.At<typename K::Bits>(t), keys);
    uint32_t packed = 0;  // (above << 16) | equal: each at most kTile < 2^16
#pragma unroll
    for (int u = 0; u < kItems; ++u) {  // kNoKey is above no threshold (< 2^31) and equal to none
      packed += (keys[u] != kNoKey && keys[u] > threshold ? 0x10000u : 0u) + (keys[u] == threshold ? 1u : 0u);
    }
    const uint32_t total = Reduce(temp).Sum(packed);
    if (threadIdx.x == 0) {
      tile_above[t] = static_cast<int32_t>(total >> 16);
      tile_equal[t] = static_cast<int32_t>(total & 0xffffu);
    }
    __syncthreads();  // temp is reused by the next tile
  }
}

// One block: in tile order, the ties each tile takes and where its selection starts in the output.
__global__ void __launch_bounds__(kOneBlock)
    TileOffsetsKernel(const int32_t* tile_above, const int32_t* tile_equal, int64_t num_tiles,
                      const SelectState* state, int64_t* tile_offset, int32_t* tile_taken) {
  using Scan = cub::BlockScan<int64_t, kOneBlock>;
  __shared__ typename Scan::TempStorage temp;
  const int64_t ties_to_take = state->rank;
  int64_t ties_carry = 0, offset_carry = 0;
  for (int64_t base = 0; base < num_tiles; base += int64_t{kOneBlock} * kScanItems) {
    int64_t equal[kScanItems], above[kScanItems], ties_before[kScanItems], selected[kScanItems],
        before[kScanItems], taken[kScanItems];
    for (int j = 0; j < kScanItems; ++j) {
      const int64_t t = base + int64_t{threadIdx.x} * kScanItems + j;
      equal[j] = t < num_tiles ? tile_equal[t] : 0;
      above[j] = t < num_tiles ? tile_above[t] : 0;
    }
    int64_t ties_total = 0, selected_total = 0;
    Scan(temp).ExclusiveSum(equal, ties_before, ties_total);
    __syncthreads();
    for (int j = 0; j < kScanItems; ++j) {
      taken[j] = TiesTaken(ties_to_take, ties_carry + ties_before[j], equal[j]);
      selected[j] = above[j] + taken[j];
    }
    Scan(temp).ExclusiveSum(selected, before, selected_total);
    __syncthreads();
    for (int j = 0; j < kScanItems; ++j) {
      const int64_t t = base + int64_t{threadIdx.x} * kScanItems + j;
      if (t < num_tiles) {
        tile_offset[t] = offset_carry + before[j];
        tile_taken[t] = static_cast<int32_t>(taken[j]);
      }
    }
    ties_carry += ties_total;
    offset_carry += selected_total;
  }
}

// Writes each tile's keys above the threshold and its first tile_taken ties, in index order: rounds of kThreads
// elements (round u: elements u * kThreads .. u * kThreads + kThreads - 1), ranked by warp ballots.
template <typename K>
__global__ void __launch_bounds__(kThreads)
    WriteSelectionKernel(TilePlan plan, const SelectState* state, const int32_t* tile_above,
                         const int64_t* tile_offset, const int32_t* tile_taken, typename K::Bits* values,
                         int32_t* indices) {
  using Bits = typename K::Bits;
  __shared__ int32_t warp_counts[2][2][kWarps];  // [round parity][above, ties][warp]
  const uint32_t threshold = state->prefix;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t lower = (1u << lane) - 1u;  // the lanes before this one
  int parity = 0;
  for (int64_t t = blockIdx.x; t < plan.num_tiles; t += gridDim.x) {
    const int32_t taken = tile_taken[t];
    const int32_t selected = tile_above[t] + taken;
    if (selected == 0) continue;  // uniform over the block
    const Tile tile = plan.At<Bits>(t);
    const Bits* x = static_cast<const Bits*>(tile.data);
    Bits bits[kItems];
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const int j = u * kThreads + static_cast<int>(threadIdx.x);
      bits[u] = j < tile.length ? x[j] : Bits(0);
    }
    const int64_t out = tile_offset[t];
    int32_t above_carry = 0, ties_carry = 0;  // in earlier rounds of this tile
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      if (u * kThreads >= tile.length) break;  // uniform
      const int j = u * kThreads + static_cast<int>(threadIdx.x);
      const bool valid = j < tile.length;
      const uint32_t key = K::Key(bits[u]);
      const bool above = valid && key > threshold;
      const bool tie = valid && key == threshold;
      const uint32_t above_mask = __ballot_sync(0xffffffffu, above);
      const uint32_t tie_mask = __ballot_sync(0xffffffffu, tie);
      if (lane == 0) {
        warp_counts[parity][0][warp] = __popc(above_mask);
        warp_counts[parity][1][warp] = __popc(tie_mask);
      }
      // One barrier a round: a warp writes this parity again two rounds on, after every warp has passed the
      // next round's barrier, so after every read below.
      __syncthreads();
      int32_t above_before = above_carry + __popc(above_mask & lower);
      int32_t ties_before = ties_carry + __popc(tie_mask & lower);
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const int32_t a = warp_counts[parity][0][w], e = warp_counts[parity][1][w];
        if (w < warp) {
          above_before += a;
          ties_before += e;
        }
        above_carry += a;
        ties_carry += e;
      }
      parity ^= 1;
      if (above || (tie && ties_before < taken)) {
        const int64_t at = out + above_before + min(ties_before, taken);
        values[at] = bits[u];
        indices[at] = static_cast<int32_t>(tile.begin + j);
      }
      if (above_carry + min(ties_carry, taken) >= selected) break;  // uniform: the tile is written
    }
  }
}

template <typename K>
int TopKAbs(const void* const* parts_host, const int64_t* sizes_host, int64_t num_parts, int64_t k,
            typename K::Bits* values, int32_t* indices, void* workspace, cudaStream_t stream) {
  int64_t n = 0;
  for (int64_t p = 0; p < num_parts; ++p) {
    if (sizes_host[p] < 0) return cudaErrorInvalidValue;
    n += sizes_host[p];
  }
  if (k < 0 || k > n || n > INT32_MAX) return cudaErrorInvalidValue;
  if (k == 0) return cudaSuccess;
  // Staged in one copy: the state, then the tile plan's table (tile starts, element starts, pointers).
  const int64_t num_tiles = NumTiles(sizes_host, num_parts);
  const TopKLayout l = LayoutTopK(num_parts, num_tiles);
  std::vector<int64_t> table(3 * num_parts + 2);
  int64_t* tile_starts = table.data();
  int64_t* elem_starts = tile_starts + num_parts + 1;
  tile_starts[0] = elem_starts[0] = 0;
  for (int64_t p = 0; p < num_parts; ++p) {
    tile_starts[p + 1] = tile_starts[p] + (sizes_host[p] + kTile - 1) / kTile;
    elem_starts[p + 1] = elem_starts[p] + sizes_host[p];
    table[2 * (num_parts + 1) + p] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(parts_host[p]));
  }
  std::vector<unsigned char> staged(l.table + sizeof(int64_t) * table.size(), 0);
  const SelectState start{0u, static_cast<uint32_t>(k)};
  static_assert(sizeof(SelectState) <= 16, "the state's room");
  std::memcpy(staged.data(), &start, sizeof(start));
  std::memcpy(staged.data() + l.table, table.data(), sizeof(int64_t) * table.size());
  unsigned char* ws = static_cast<unsigned char*>(workspace);
  cudaError_t status = cudaMemcpyAsync(ws, staged.data(), staged.size(), cudaMemcpyHostToDevice, stream);
  if (status != cudaSuccess) return status;  // staged before it returns
  status = cudaMemsetAsync(ws + l.hist, 0, sizeof(uint32_t) * kHistWords, stream);
  if (status != cudaSuccess) return status;
  SelectState* state = reinterpret_cast<SelectState*>(ws);
  const int64_t* device_table = reinterpret_cast<const int64_t*>(ws + l.table);
  const TilePlan plan{device_table, device_table + num_parts + 1,
                      reinterpret_cast<const uint64_t*>(device_table + 2 * (num_parts + 1)), num_parts, num_tiles};
  uint32_t* hist = reinterpret_cast<uint32_t*>(ws + l.hist);
  int32_t* tile_above = reinterpret_cast<int32_t*>(ws + l.above);
  int32_t* tile_equal = reinterpret_cast<int32_t*>(ws + l.equal);
  int64_t* tile_offset = reinterpret_cast<int64_t*>(ws + l.offset);
  int32_t* tile_taken = reinterpret_cast<int32_t*>(ws + l.taken);
  for (int d = 0; d < K::kDigits; ++d) {
    const Digit digit = K::kDigit[d];
    DigitHistogramKernel<K><<<TileGrid(DigitHistogramKernel<K>, num_tiles), kThreads, 0, stream>>>(
        plan, state, digit.shift, digit.bits, hist);
    SelectDigitKernel<<<1, kOneBlock, 0, stream>>>(hist, digit.shift, digit.bits, state);
    hist += 1 << digit.bits;
  }
  TileCountKernel<K><<<TileGrid(TileCountKernel<K>, num_tiles), kThreads, 0, stream>>>(plan, state, tile_above,
                                                                                        tile_equal);
  TileOffsetsKernel<<<1, kOneBlock, 0, stream>>>(tile_above, tile_equal, num_tiles, state, tile_offset, tile_taken);
  WriteSelectionKernel<K><<<TileGrid(WriteSelectionKernel<K>, num_tiles), kThreads, 0, stream>>>(
      plan, state, tile_above, tile_offset, tile_taken, values, indices);
  return Launched();
}

// ---- scatter / gather ----

// A concatenation of parts on the device: starts[num_parts + 1] (int64), then the parts' pointers.
size_t PartTableBytes(int64_t num_parts) { return AlignUp(sizeof(int64_t) * (2 * num_parts + 1)); }

// Stages the table into `table` (device); sets *total to the concatenation's size.
cudaError_t StagePartTable(const void* const* parts_host, const int64_t* sizes_host, int64_t num_parts, void* table,
                           int64_t* total, cudaStream_t stream) {
  std::vector<int64_t> staged(2 * num_parts + 1);
  staged[0] = 0;
  for (int64_t p = 0; p < num_parts; ++p) {
    if (sizes_host[p] < 0) return cudaErrorInvalidValue;
    staged[p + 1] = staged[p] + sizes_host[p];
  }
  for (int64_t p = 0; p < num_parts; ++p) {
    staged[num_parts + 1 + p] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(parts_host[p]));
  }
  *total = staged[num_parts];
  return cudaMemcpyAsync(table, staged.data(), sizeof(int64_t) * staged.size(), cudaMemcpyHostToDevice, stream);
}

struct PartTable {
  const int64_t* starts;
  int64_t num_parts;
  __device__ float* Part(int64_t p) const {
    return reinterpret_cast<float*>(static_cast<uintptr_t>(starts[num_parts + 1 + p]));
  }
  // Where element `at` (in [0, total)) of the concatenation lies.
  __device__ float* At(int64_t at) const {
    const int64_t p = BlockOf(starts, num_parts, at);
    return Part(p) + (at - starts[p]);
  }
};

// Sort keys: the index, or the sentinel n for one out of [0, n). 32 bits when n fits, else 64.
template <typename Key>
struct ScatterLayout {
  size_t keys_in, keys_out, values_in, values_out, temp, temp_bytes, total;
};

int BitWidth(uint64_t v) {
  int bits = 0;
  while (v != 0) {
    ++bits;
    v >>= 1;
  }
  return bits;
}

template <typename Key>
ScatterLayout<Key> LayoutScatter(size_t head, int64_t k) {
  ScatterLayout<Key> l;
  l.keys_in = AlignUp(head);
  l.keys_out = AlignUp(l.keys_in + sizeof(Key) * k);
  l.values_in = AlignUp(l.keys_out + sizeof(Key) * k);
  l.values_out = AlignUp(l.values_in + sizeof(float) * k);
  l.temp = AlignUp(l.values_out + sizeof(float) * k);
  l.temp_bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, l.temp_bytes, static_cast<const Key*>(nullptr), static_cast<Key*>(nullptr),
                                  static_cast<const float*>(nullptr), static_cast<float*>(nullptr), k, 0,
                                  static_cast<int>(sizeof(Key) * 8), nullptr);
  l.total = AlignUp(l.temp + l.temp_bytes);
  return l;
}

template <typename Index, typename T, typename Key>
__global__ void ScatterKeysKernel(const Index* indices, const T* values, int64_t k, int64_t n, Key* keys,
                                  float* keyed_values) {
  HC_GRID_LOOP(i, k) {
    const int64_t at = static_cast<int64_t>(indices[i]);
    keys[i] = static_cast<Key>(at >= 0 && at < n ? at : n);
    keyed_values[i] = static_cast<float>(values[i]);
  }
}

// One thread per run of equal sorted keys (but the sentinel's): its values added in order from 0.0f.
template <typename Key, typename Store>
__global__ void ScatterRunsKernel(const Key* keys, const float* values, int64_t k, Key sentinel, Store store) {
  HC_GRID_LOOP(i, k) {
    const Key key = keys[i];
    if (key == sentinel || (i > 0 && keys[i - 1] == key)) continue;
    float sum = 0.0f;
    for (int64_t j = i; j < k && keys[j] == key; ++j) sum += values[j];
    store(static_cast<int64_t>(key), sum);
  }
}

template <typename T>
struct DenseStore {
  T* y;
  __device__ void operator()(int64_t at, float sum) const { y[at] = static_cast<T>(sum); }
};

struct MeanStore {
  PartTable parts;
  float divisor;
  __device__ void operator()(int64_t at, float sum) const { *parts.At(at) = sum / divisor; }
};

// Sorts the k (index, value) pairs by index (stable) and stores each index's in-order sum.
template <typename Key, typename Index, typename T, typename Store>
cudaError_t ScatterSorted(const Index* indices, const T* values, int64_t k, int64_t n, size_t head,
                          unsigned char* ws, Store store, cudaStream_t stream) {
  const ScatterLayout<Key> l = LayoutScatter<Key>(head, k);
  Key* keys_in = reinterpret_cast<Key*>(ws + l.keys_in);
  Key* keys_out = reinterpret_cast<Key*>(ws + l.keys_out);
  float* values_in = reinterpret_cast<float*>(ws + l.values_in);
  float* values_out = reinterpret_cast<float*>(ws + l.values_out);
  ScatterKeysKernel<<<Blocks(k), kThreads, 0, stream>>>(indices, values, k, n, keys_in, values_in);
  // Only the bits that hold n (the sentinel) are sorted, when the storage for them fits (it does: fewer bits
  // need no more storage than all of them, whose size the workspace holds).
  int end_bit = BitWidth(static_cast<uint64_t>(n));
  size_t needed = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, needed, keys_in, keys_out, values_in, values_out, k, 0, end_bit, stream);
  if (needed > l.temp_bytes) end_bit = static_cast<int>(sizeof(Key) * 8);
  size_t temp_bytes = l.temp_bytes;
  cudaError_t status = cub::DeviceRadixSort::SortPairs(ws + l.temp, temp_bytes, keys_in, keys_out, values_in,
                                                       values_out, k, 0, end_bit, stream);
  if (status != cudaSuccess) return status;
  ScatterRunsKernel<<<Blocks(k), kThreads, 0, stream>>>(keys_out, values_out, k, static_cast<Key>(n), store);
  return Launched();
}

bool FitsKey32(int64_t n) { return static_cast<uint64_t>(n) <= 0xffffffffull; }

size_t ScatterBytes(size_t head, int64_t k, int64_t n) {
  return FitsKey32(n) ? LayoutScatter<uint32_t>(head, k).total : LayoutScatter<uint64_t>(head, k).total;
}

template <typename Index, typename T>
int ScatterDense(const Index* indices, const T* values, int64_t k, int64_t n, T* y, void* workspace,
                 cudaStream_t stream) {
  if (n < 0 || k < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  cudaError_t status = cudaMemsetAsync(y, 0, sizeof(T) * n, stream);  // +0.0 in every type
  if (status != cudaSuccess || k == 0) return status;
  unsigned char* ws = static_cast<unsigned char*>(workspace);
  return FitsKey32(n) ? ScatterSorted<uint32_t>(indices, values, k, n, 0, ws, DenseStore<T>{y}, stream)
                      : ScatterSorted<uint64_t>(indices, values, k, n, 0, ws, DenseStore<T>{y}, stream);
}

int ScatterMean(const int32_t* indices, const float* values, int64_t k, float* const* parts_host,
                const int64_t* sizes_host, int64_t num_parts, int64_t count, void* workspace, cudaStream_t stream) {
  if (k < 0 || count < 1 || num_parts < 0) return cudaErrorInvalidValue;
  unsigned char* ws = static_cast<unsigned char*>(workspace);
  int64_t total = 0;
  cudaError_t status = StagePartTable(reinterpret_cast<const void* const*>(parts_host), sizes_host, num_parts, ws,
                                      &total, stream);
  if (status != cudaSuccess) return status;
  for (int64_t p = 0; p < num_parts; ++p) {
    if (sizes_host[p] == 0) continue;
    status = cudaMemsetAsync(parts_host[p], 0, sizeof(float) * sizes_host[p], stream);
    if (status != cudaSuccess) return status;
  }
  if (k == 0 || total == 0) return cudaSuccess;
  const MeanStore store{PartTable{reinterpret_cast<const int64_t*>(ws), num_parts}, static_cast<float>(count)};
  const size_t head = PartTableBytes(num_parts);
  return FitsKey32(total) ? ScatterSorted<uint32_t>(indices, values, k, total, head, ws, store, stream)
                          : ScatterSorted<uint64_t>(indices, values, k, total, head, ws, store, stream);
}

__global__ void GatherAtKernel(PartTable parts, const int32_t* indices, int64_t k, float* values) {
  const int64_t total = parts.starts[parts.num_parts];
  HC_GRID_LOOP(i, k) {
    const int64_t at = indices[i];
    values[i] = at >= 0 && at < total ? *parts.At(at) : 0.0f;
  }
}

__global__ void ZeroAtKernel(PartTable parts, const int32_t* indices, int64_t k) {
  const int64_t total = parts.starts[parts.num_parts];
  HC_GRID_LOOP(i, k) {
    const int64_t at = indices[i];
    if (at >= 0 && at < total) *parts.At(at) = 0.0f;
  }
}

__global__ void SubtractSparseMeanKernel(float* x, int64_t size, const int32_t* indices, const float* values,
                                         int64_t m, int64_t offset, float divisor) {
  HC_GRID_LOOP(t, m) {
    const int64_t at = static_cast<int64_t>(indices[t]) - offset;
    if (at >= 0 && at < size) x[at] -= values[t] / divisor;
  }
}

__global__ void SetKernel(int64_t* where, int64_t value) { *where = value; }

template <typename Index>
__global__ void FirstOutOfRangeKernel(const Index* indices, int64_t k, int64_t n, int64_t* first) {
  HC_GRID_LOOP(i, k) {
    const int64_t at = static_cast<int64_t>(indices[i]);
    if (at < 0 || at >= n) {
      atomicMin(reinterpret_cast<unsigned long long*>(first), static_cast<unsigned long long>(i));
    }
  }
}

template <typename Index>
int FirstOutOfRange(const Index* indices, int64_t k, int64_t n, int64_t* first, cudaStream_t stream) {
  SetKernel<<<1, 1, 0, stream>>>(first, k);
  if (k > 0) FirstOutOfRangeKernel<<<Blocks(k), kThreads, 0, stream>>>(indices, k, n, first);
  return Launched();
}

}  // namespace
}  // namespace gpu
}  // namespace hvd_compress

using namespace hvd_compress::gpu;  // NOLINT: the C launchers below are thin

extern "C" {

size_t hc_top_k_abs_workspace_bytes(const int64_t* sizes_host, int64_t num_parts) {
  return LayoutTopK(num_parts, NumTiles(sizes_host, num_parts)).total;
}

int hc_top_k_abs_f32(const void* const* parts_host, const int64_t* sizes_host, int64_t num_parts, int64_t k,
                     float* values, int32_t* indices, void* workspace, hc_stream stream) {
  return TopKAbs<F32Keys>(parts_host, sizes_host, num_parts, k, reinterpret_cast<uint32_t*>(values), indices,
                          workspace, stream);
}

int hc_top_k_abs_f16(const void* const* parts_host, const int64_t* sizes_host, int64_t num_parts, int64_t k,
                     void* values, int32_t* indices, void* workspace, hc_stream stream) {
  return TopKAbs<F16Keys>(parts_host, sizes_host, num_parts, k, static_cast<uint16_t*>(values), indices, workspace,
                          stream);
}

int hc_top_k_abs_bf16(const void* const* parts_host, const int64_t* sizes_host, int64_t num_parts, int64_t k,
                      void* values, int32_t* indices, void* workspace, hc_stream stream) {
  return TopKAbs<Bf16Keys>(parts_host, sizes_host, num_parts, k, static_cast<uint16_t*>(values), indices,
                           workspace, stream);
}

size_t hc_scatter_dense_workspace_bytes(int64_t k, int64_t n) { return ScatterBytes(0, k, n); }

int hc_scatter_dense_f32_i32(const int32_t* indices, const float* values, int64_t k, int64_t n, float* y,
                             void* workspace, hc_stream stream) {
  return ScatterDense(indices, values, k, n, y, workspace, stream);
}

int hc_scatter_dense_f32_i64(const int64_t* indices, const float* values, int64_t k, int64_t n, float* y,
                             void* workspace, hc_stream stream) {
  return ScatterDense(indices, values, k, n, y, workspace, stream);
}

int hc_scatter_dense_f16_i32(const int32_t* indices, const void* values, int64_t k, int64_t n, void* y,
                             void* workspace, hc_stream stream) {
  return ScatterDense(indices, static_cast<const __half*>(values), k, n, static_cast<__half*>(y), workspace, stream);
}

int hc_scatter_dense_f16_i64(const int64_t* indices, const void* values, int64_t k, int64_t n, void* y,
                             void* workspace, hc_stream stream) {
  return ScatterDense(indices, static_cast<const __half*>(values), k, n, static_cast<__half*>(y), workspace, stream);
}

int hc_scatter_dense_bf16_i32(const int32_t* indices, const void* values, int64_t k, int64_t n, void* y,
                              void* workspace, hc_stream stream) {
  return ScatterDense(indices, static_cast<const __nv_bfloat16*>(values), k, n, static_cast<__nv_bfloat16*>(y),
                      workspace, stream);
}

int hc_scatter_dense_bf16_i64(const int64_t* indices, const void* values, int64_t k, int64_t n, void* y,
                              void* workspace, hc_stream stream) {
  return ScatterDense(indices, static_cast<const __nv_bfloat16*>(values), k, n, static_cast<__nv_bfloat16*>(y),
                      workspace, stream);
}

size_t hc_scatter_mean_workspace_bytes(int64_t k, const int64_t* sizes_host, int64_t num_parts) {
  int64_t total = 0;
  for (int64_t p = 0; p < num_parts; ++p) total += sizes_host[p];
  return ScatterBytes(PartTableBytes(num_parts), k, total);
}

int hc_scatter_mean(const int32_t* indices, const float* values, int64_t k, float* const* parts_host,
                    const int64_t* sizes_host, int64_t num_parts, int64_t count, void* workspace, hc_stream stream) {
  return ScatterMean(indices, values, k, parts_host, sizes_host, num_parts, count, workspace, stream);
}

size_t hc_parts_workspace_bytes(int64_t num_parts) { return PartTableBytes(num_parts); }

int hc_gather_at(const float* const* parts_host, const int64_t* sizes_host, int64_t num_parts,
                 const int32_t* indices, int64_t k, float* values, void* workspace, hc_stream stream) {
  int64_t total = 0;
  cudaError_t status = StagePartTable(reinterpret_cast<const void* const*>(parts_host), sizes_host, num_parts,
                                      workspace, &total, stream);
  if (status != cudaSuccess || k == 0) return status;
  GatherAtKernel<<<Blocks(k), kThreads, 0, stream>>>(PartTable{static_cast<const int64_t*>(workspace), num_parts},
                                                    indices, k, values);
  return Launched();
}

int hc_subtract_sparse_mean(float* x, int64_t size, const int32_t* indices, const float* values, int64_t m,
                            int64_t offset, int64_t count, hc_stream stream) {
  if (m == 0) return cudaSuccess;
  SubtractSparseMeanKernel<<<Blocks(m), kThreads, 0, stream>>>(x, size, indices, values, m, offset,
                                                              static_cast<float>(count));
  return Launched();
}

int hc_zero_at(float* const* parts_host, const int64_t* sizes_host, int64_t num_parts, const int32_t* indices,
               int64_t k, void* workspace, hc_stream stream) {
  int64_t total = 0;
  cudaError_t status = StagePartTable(reinterpret_cast<const void* const*>(parts_host), sizes_host, num_parts,
                                      workspace, &total, stream);
  if (status != cudaSuccess || k == 0) return status;
  ZeroAtKernel<<<Blocks(k), kThreads, 0, stream>>>(PartTable{static_cast<const int64_t*>(workspace), num_parts},
                                                  indices, k);
  return Launched();
}

int hc_first_out_of_range_i32(const int32_t* indices, int64_t k, int64_t n, int64_t* first, hc_stream stream) {
  return FirstOutOfRange(indices, k, n, first, stream);
}

int hc_first_out_of_range_i64(const int64_t* indices, int64_t k, int64_t n, int64_t* first, hc_stream stream) {
  return FirstOutOfRange(indices, k, n, first, stream);
}

}  // extern "C"
