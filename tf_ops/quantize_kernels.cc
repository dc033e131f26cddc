// CPU kernels for BlockQuantizeCompress and BlockQuantizeDecodeMean; the
// format is documented in quantize_ops.cc and re-implemented in NumPy by
// block_quantize_* in tests/np_reference.py.
//
// Every element's code depends only on its block's min, max and finiteness
// (exact, order-free reductions) and on its own index, so the results are the
// same for any split of the work. Work is split on the global kChunk grid of
// blocks.h (a multiple of 8 elements, hence of whole packed bytes), chunks on
// TensorFlow's intra-op threads, as the sign kernels do.
//
// Compress reads x once where blocks lie inside a chunk (statistics, then
// coding while the block is still in cache), and twice for the pieces of
// blocks that cross the chunk grid (statistics of every piece first, coding
// once the whole block is known).
//
// The per-element and per-block arithmetic (draws, statistics, parameters, codes, decoding) is
// cores.h's Quantize*, which the GPU kernels (gpu/quantize_kernels.cu) run too; the SIMD paths
// below do the same float32 operations in the same order.
#include <cmath>
#include <cstdlib>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <cstring>
#include <limits>
#include <vector>

#include "blocks.h"
#include "op_checks.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace hvd_compress {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::TensorShape;

namespace {

// Elements coded or decoded at a time through stack buffers (L1-sized).
constexpr int64_t kTile = 1024;

// Outputs of at least this many bytes are written with streaming (non-temporal) stores where a vector loop writes
// whole aligned vectors: as large as the last-level caches measured (32 MB on the AMD EPYCs), they would not stay in
// cache for their reader, and a streaming store skips the read of every line that a cached store makes first (a
// decoded mean of 16M floats: 11% less time). A CPU whose cache holds much more (over 100 MB) could keep such an
// output for its reader, and lose by streaming it.
constexpr int64_t kStreamingBytes = 32 << 20;

// Orders this thread's streaming stores before what it does next (its part of the op's end).
inline void StreamsDone() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

absl::Status CheckBits(int64_t bits) {
  if (bits != 2 && bits != 4 && bits != 8) return InvalidArgument("bits must be 2, 4 or 8, got ", bits);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Stochastic draws: u_i = QuantizeUniform(QuantizeSeedBase(key, counter), i) (cores.h).

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HVD_COMPRESS_QUANTIZE_AVX2 1
const bool kHasAvx2 = __builtin_cpu_supports("avx2");
// AVX-512 codes 16 elements at a time, with the same float32 operations per element (UseAvx512, blocks.h).
const bool kHasAvx512 = UseAvx512();
#endif

// out[l] = u_(first + l) for l in [0, len), where the CPU has no AVX2 (CodeTileDrawnAvx2 draws in registers).
void Uniforms(uint64_t base, int64_t first, int64_t len, float* out) {
  for (int64_t l = 0; l < len; ++l) out[l] = QuantizeUniform(base, first + l);
}

// ---------------------------------------------------------------------------
// Block statistics (QuantizeStats): min, max and whether any element is NaN or +-Inf.

#if defined(__AVX__)
// Running statistics of 8 lanes, for the loops that make or read the values: min, max, and whether any is NaN or
// +-Inf (x - x is +0 for a finite x and NaN otherwise: its bits ORed together).
struct StatsOfEights {
  __m256 lo = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 hi = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 bad = _mm256_setzero_ps();

  void Add(__m256 v) {
    lo = _mm256_min_ps(lo, v);
    hi = _mm256_max_ps(hi, v);
    bad = _mm256_or_ps(bad, _mm256_sub_ps(v, v));
  }
  // The lanes' statistics merged into s.
  QuantizeStats MergeInto(QuantizeStats s) const {
    alignas(32) float lo8[8], hi8[8];
    alignas(32) uint32_t bad8[8];
    _mm256_store_ps(lo8, lo);
    _mm256_store_ps(hi8, hi);
    _mm256_store_ps(reinterpret_cast<float*>(bad8), bad);
    for (int l = 0; l < 8; ++l) s = QuantizeMerge(s, QuantizeStats{lo8[l], hi8[l], bad8[l] != 0});
    return s;
  }
};
#endif

constexpr QuantizeStats kNoStats{std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                                 false};

QuantizeStats PieceStats(const float* x, int64_t len) {
  QuantizeStats s = kNoStats;
  int64_t i = 0;
#if defined(__AVX__)
  StatsOfEights eights;
  for (; i + 8 <= len; i += 8) eights.Add(_mm256_loadu_ps(x + i));
  s = eights.MergeInto(s);
#endif
  for (; i < len; ++i) s = QuantizeMerge(s, QuantizeStatsOf(x[i]));
  return s;
}

// sum = x + plus over [0, len) (sum may be x or plus), and the statistics of sum, in one pass.
QuantizeStats SumWithStats(const float* x, const float* plus, int64_t len, float* sum) {
  QuantizeStats s = kNoStats;
  int64_t i = 0;
#if defined(__AVX__)
  StatsOfEights eights;
  for (; i + 8 <= len; i += 8) {
    const __m256 v = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(plus + i));
    _mm256_storeu_ps(sum + i, v);
    eights.Add(v);
  }
  s = eights.MergeInto(s);
#endif
  for (; i < len; ++i) {
    sum[i] = x[i] + plus[i];
    s = QuantizeMerge(s, QuantizeStatsOf(sum[i]));
  }
  return s;
}

// ---------------------------------------------------------------------------
// Packing of codes (one per uint8 of q) into `bits`-bit fields, and back.

// Element j of the packed vector, with the other bits of its byte kept.
inline void PutCode(uint8_t* packed, int bits, int64_t j, uint8_t code) {
  const int64_t bit = j * bits;
  const int shift = static_cast<int>(bit & 7);
  const uint8_t mask = static_cast<uint8_t>(((1u << bits) - 1u) << shift);
  uint8_t& byte = packed[bit >> 3];
  byte = static_cast<uint8_t>((byte & ~mask) | (code << shift));
}

// Writes codes q[0, len) as elements [begin, begin + len) of packed; the bytes
// it shares with neighbouring elements are read, modified and written.
void PackCodes(const uint8_t* q, int64_t begin, int64_t len, int bits, uint8_t* packed) {
  const int per_byte = 8 / bits;
  int64_t i = 0;
  for (; i < len && (begin + i) % per_byte != 0; ++i) PutCode(packed, bits, begin + i, q[i]);
  const int64_t whole = (len - i) / per_byte;
  uint8_t* out = packed + (begin + i) * bits / 8;
  const uint8_t* in = q + i;
  if (bits == 8) {
    std::memcpy(out, in, whole);
  } else if (bits == 4) {
    for (int64_t j = 0; j < whole; ++j) out[j] = static_cast<uint8_t>(in[2 * j] | (in[2 * j + 1] << 4));
  } else {
    for (int64_t j = 0; j < whole; ++j) {
      out[j] = static_cast<uint8_t>(in[4 * j] | (in[4 * j + 1] << 2) | (in[4 * j + 2] << 4) | (in[4 * j + 3] << 6));
    }
  }
  for (i += whole * per_byte; i < len; ++i) PutCode(packed, bits, begin + i, q[i]);
}

// ---------------------------------------------------------------------------
// Coding: x[0, len) of one block -> codes (packed, or one per byte in q) and residual[0, len). residual may be x.
// add: u_i (stochastic) or 0.5 (deterministic).

inline void CodeOne(float v, float add, const QuantizeParams& p, float levels, uint8_t* q, float* residual) {
  const float f = QuantizeLevel(v, p, add, levels);
  *q = static_cast<uint8_t>(f);
  *residual = v - QuantizeDecode(p.offset, f, p.scale);
}

#if defined(__AVX__)
// A block's parameters (QuantizeParams and its top level) in registers, for the vector coders.
struct CoderOfEights {
  __m256 offset, inv, scale, levels;
  CoderOfEights(const QuantizeParams& p, float top)
      : offset(_mm256_set1_ps(p.offset)), inv(_mm256_set1_ps(p.inv)), scale(_mm256_set1_ps(p.scale)),
        levels(_mm256_set1_ps(top)) {}
};

// CodeOne of 8 elements: writes their residuals, returns their codes (int32).
inline __m256i CodeEight(const float* x, __m256 add, const CoderOfEights& c, float* residual) {
  const __m256 v = _mm256_loadu_ps(x);
  __m256 f = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(v, c.offset), c.inv), add));
  f = _mm256_min_ps(_mm256_max_ps(f, _mm256_setzero_ps()), c.levels);  // max_ps(NaN, 0) = 0
  _mm256_storeu_ps(residual, _mm256_sub_ps(v, _mm256_add_ps(c.offset, _mm256_mul_ps(f, c.scale))));
  return _mm256_cvttps_epi32(f);
}
#endif

// add[l] for element l.
void CodeTile(const float* x, const float* add, int64_t len, const QuantizeParams& p, float levels, uint8_t* q,
              float* residual) {
  int64_t i = 0;
#if defined(__AVX__)
  const CoderOfEights coder(p, levels);
  for (; i + 8 <= len; i += 8) {
    const __m256i codes = CodeEight(x + i, _mm256_loadu_ps(add + i), coder, residual + i);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(codes), _mm256_extractf128_si256(codes, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packus_epi16(words, words));
  }
#endif
  for (; i < len; ++i) CodeOne(x[i], add[i], p, levels, q + i, residual + i);
}

#if defined(HVD_COMPRESS_QUANTIZE_AVX2)
// The draws of 16 elements from the 8 hashes whose first index is `index` (QuantizeUniform's halves): high halves
// for the first 8 elements, low halves for the next 8.
struct DrawsOfSixteen {
  __m256i high, low;
};

__attribute__((target("avx2"))) inline DrawsOfSixteen DrawSixteen(__m256i index, __m256i key_lo, __m256i key_hi) {
  const __m256i h = _mm256_xor_si256(Mix32Avx2(_mm256_xor_si256(index, key_lo)), key_hi);
  return {_mm256_srli_epi32(h, 16), _mm256_and_si256(h, _mm256_set1_epi32(0xffff))};
}

// Elements [first, first + head) are coded one at a time, so that the vector loops start at a multiple of 16, where
// a hash's two halves serve elements 8 apart; the loops run while hi32 of the hashes' index stays the same (head =
// len where it does not).
inline int64_t DrawHead(int64_t first, int64_t len) {
  const int64_t head = std::min(len, (16 - first % 16) % 16);
  const uint64_t from = static_cast<uint64_t>(QuantizeDrawHash(first + head)) >> 32;
  return from == static_cast<uint64_t>(QuantizeDrawHash(first + len - 1)) >> 32 ? head : len;
}

// The codes of 16 consecutive elements, one per byte in order, packed LSB first into the 2 * kBits bytes at out (the
// vector coders start at a multiple of 16 elements, a byte boundary): 8-bit codes as they are; 4-bit ones by a
// multiply-add of neighbouring bytes (e[2j] + 16 e[2j + 1]); 2-bit ones by one more, of neighbouring pairs.
template <int kBits>
__attribute__((target("avx2"))) inline void StoreSixteenCodes(__m128i codes, uint8_t* out) {
  if constexpr (kBits == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), codes);
  } else if constexpr (kBits == 4) {
    const __m128i pairs = _mm_maddubs_epi16(codes, _mm_set1_epi16(0x1001));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(pairs, pairs));
  } else {
    const __m128i pairs = _mm_maddubs_epi16(codes, _mm_set1_epi16(0x0401));
    const __m128i quads = _mm_madd_epi16(pairs, _mm_set1_epi32(0x00100001));
    const int32_t word = _mm_cvtsi128_si32(_mm_packus_epi16(_mm_packus_epi32(quads, quads), _mm_setzero_si128()));
    std::memcpy(out, &word, sizeof(word));
  }
}

// Element first + l, coded alone, into its bits of packed (the other bits of its byte kept) and its residual.
inline void CodeOneInto(const float* x, uint64_t base, int64_t first, int64_t l, const QuantizeParams& p, int bits,
                        uint8_t* packed, float* residual) {
  uint8_t q;
  CodeOne(x[l], QuantizeUniform(base, first + l), p, QuantizeLevels(bits), &q, residual + l);
  PutCode(packed, bits, first + l, q);
}

// Elements [first, first + len) coded with their draws made in registers, 16 at a time, and their codes packed
// there; x and residual point at element first.
template <int kBits>
__attribute__((target("avx2"))) void CodeTileDrawnAvx2(const float* x, uint64_t base, int64_t first, int64_t len,
                                                       const QuantizeParams& p, uint8_t* packed, float* residual) {
  int64_t i = DrawHead(first, len);
  for (int64_t l = 0; l < i; ++l) CodeOneInto(x, base, first, l, p, kBits, packed, residual);
  const uint64_t start = static_cast<uint64_t>(QuantizeDrawHash(first + i));
  const __m256i key_lo = _mm256_set1_epi32(static_cast<int32_t>(base));
  const __m256i key_hi = _mm256_set1_epi32(static_cast<int32_t>((base >> 32) ^ (start >> 32)));
  __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(start)),
                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256 unit = _mm256_set1_ps(0x1p-16f);
  const CoderOfEights coder(p, QuantizeLevels(kBits));
  // Two vectors of int32 codes narrowed to words and then to bytes hold elements 0-3 8-11 4-7 12-15: put in order.
  const __m128i order = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
  for (; i + 16 <= len; i += 16) {
    const DrawsOfSixteen u = DrawSixteen(index, key_lo, key_hi);
    const __m256i first8 = CodeEight(x + i, _mm256_mul_ps(_mm256_cvtepi32_ps(u.high), unit), coder, residual + i);
    const __m256i next8 =
        CodeEight(x + i + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(u.low), unit), coder, residual + i + 8);
    const __m256i words = _mm256_packus_epi32(first8, next8);
    const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    StoreSixteenCodes<kBits>(_mm_shuffle_epi8(bytes, order), packed + (first + i) / 8 * kBits);
    index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
  }
  for (; i < len; ++i) CodeOneInto(x, base, first, i, p, kBits, packed, residual);
}

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wmaybe-uninitialized mistakes for a read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// CodeTileDrawnAvx2 with the 16 elements in one vector: the same draws, codes and residuals (CodeEight's operations
// in its order; max(NaN, 0) is 0 here too, and codes in [0, 255] narrow to bytes exactly, in order).
template <int kBits>
__attribute__((target("avx512f,avx512bw"))) void CodeTileDrawnAvx512(const float* x, uint64_t base, int64_t first,
                                                                    int64_t len, const QuantizeParams& p,
                                                                    uint8_t* packed, float* residual) {
  int64_t i = DrawHead(first, len);
  for (int64_t l = 0; l < i; ++l) CodeOneInto(x, base, first, l, p, kBits, packed, residual);
  const uint64_t start = static_cast<uint64_t>(QuantizeDrawHash(first + i));
  const __m256i key_lo = _mm256_set1_epi32(static_cast<int32_t>(base));
  const __m256i key_hi = _mm256_set1_epi32(static_cast<int32_t>((base >> 32) ^ (start >> 32)));
  __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(start)),
                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m512 offset = _mm512_set1_ps(p.offset), inv = _mm512_set1_ps(p.inv), scale = _mm512_set1_ps(p.scale);
  const __m512 top = _mm512_set1_ps(QuantizeLevels(kBits)), unit = _mm512_set1_ps(0x1p-16f);
  for (; i + 16 <= len; i += 16) {
    const DrawsOfSixteen u = DrawSixteen(index, key_lo, key_hi);
    const __m512 add = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(u.high), u.low, 1)),
                                     unit);
    const __m512 v = _mm512_loadu_ps(x + i);
    __m512 f = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(v, offset), inv), add),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    f = _mm512_min_ps(_mm512_max_ps(f, _mm512_setzero_ps()), top);
    StoreSixteenCodes<kBits>(_mm512_cvtepi32_epi8(_mm512_cvttps_epi32(f)), packed + (first + i) / 8 * kBits);
    _mm512_storeu_ps(residual + i, _mm512_sub_ps(v, _mm512_add_ps(offset, _mm512_mul_ps(f, scale))));
    index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
  }
  for (; i < len; ++i) CodeOneInto(x, base, first, i, p, kBits, packed, residual);
}
#pragma GCC diagnostic pop
#endif

// Codes elements [begin, end) of one block into packed and residual; x and residual point at element begin
// (residual may be x). Stochastic rounding on an AVX2 CPU packs the codes in registers; otherwise they go through
// a tile of bytes (PackCodes).
template <bool kStochastic, int kBits>
void CodePiece(const float* x, float* residual, int64_t begin, int64_t end, const QuantizeParams& p,
               uint64_t seed_base, uint8_t* packed) {
  const float levels = QuantizeLevels(kBits);
  alignas(32) uint8_t q[kTile];
  alignas(32) float add[kTile];
  if (!kStochastic) std::fill(add, add + std::min(kTile, end - begin), 0.5f);
  for (int64_t lo = begin; lo < end; lo += kTile) {
    const int64_t len = std::min(kTile, end - lo);
    const float* tile_x = x + (lo - begin);
    float* tile_residual = residual + (lo - begin);
#if defined(HVD_COMPRESS_QUANTIZE_AVX2)
    if (kStochastic && kHasAvx512) {
      CodeTileDrawnAvx512<kBits>(tile_x, seed_base, lo, len, p, packed, tile_residual);
      continue;
    }
    if (kStochastic && kHasAvx2) {
      CodeTileDrawnAvx2<kBits>(tile_x, seed_base, lo, len, p, packed, tile_residual);
      continue;
    }
#endif
    if (kStochastic) Uniforms(seed_base, lo, len, add);
    CodeTile(tile_x, add, len, p, levels, q, tile_residual);
    PackCodes(q, lo, len, kBits, packed);
  }
}

// CodePiece for the op's rounding and bits.
using PieceCoder = void (*)(const float*, float*, int64_t, int64_t, const QuantizeParams&, uint64_t, uint8_t*);
template <bool kStochastic>
PieceCoder CoderFor(int bits) {
  return bits == 2 ? CodePiece<kStochastic, 2> : bits == 4 ? CodePiece<kStochastic, 4> : CodePiece<kStochastic, 8>;
}

// ---------------------------------------------------------------------------
// Decoding: the mean of m payloads of the elements [begin, end) of one block, straight from the packed
// bytes, summed in registers: acc = 0; acc += offset_r + float(q_r) * scale_r for r = 0..m-1 in order;
// out = acc / m (+ plus).

// The codes of a packed byte as floats: kCodeTables.two[byte][k] for 2-bit codes, .four for 4-bit.
struct CodeTables {
  alignas(16) float two[256][4];
  alignas(16) float four[256][2];
  constexpr CodeTables() : two(), four() {
    for (int byte = 0; byte < 256; ++byte) {
      for (int k = 0; k < 4; ++k) two[byte][k] = static_cast<float>((byte >> (2 * k)) & 3);
      for (int k = 0; k < 2; ++k) four[byte][k] = static_cast<float>((byte >> (4 * k)) & 15);
    }
  }
};
constexpr CodeTables kCodeTables;

#if defined(__AVX__)
// The 8 codes (as floats) of the kBits bytes at p: elements 8j .. 8j + 7.
template <int kBits>
inline __m256 CodesOfEight(const uint8_t* p) {
  if constexpr (kBits == 2) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_load_ps(kCodeTables.two[p[0]])),
                                _mm_load_ps(kCodeTables.two[p[1]]), 1);
  } else if constexpr (kBits == 4) {
    auto pair = [&](int k) {
      const double* a = reinterpret_cast<const double*>(kCodeTables.four[p[k]]);
      const double* b = reinterpret_cast<const double*>(kCodeTables.four[p[k + 1]]);
      return _mm_castpd_ps(_mm_loadh_pd(_mm_load_sd(a), b));
    };
    return _mm256_insertf128_ps(_mm256_castps128_ps256(pair(0)), pair(2), 1);
  } else {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_insertf128_si256(_mm256_castsi128_si256(_mm_cvtepu8_epi32(bytes)),
                                                      _mm_cvtepu8_epi32(_mm_srli_si128(bytes, 4)), 1));
  }
}
#endif

#if defined(HVD_COMPRESS_QUANTIZE_AVX2)
// The 8 codes (as floats) of elements 8j .. 8j + 7 at p: 8-bit codes widened; 2- and 4-bit ones with AVX2's
// per-lane shifts, the kBits bytes as one word in every lane, lane l shifted right by l * kBits and masked (no
// table lookups).
template <int kBits>
__attribute__((target("avx2"))) inline __m256 CodesOfEightAvx2(const uint8_t* p) {
  if constexpr (kBits == 8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  uint32_t word = 0;
  std::memcpy(&word, p, kBits);
  const __m256i shifts = _mm256_setr_epi32(0, kBits, 2 * kBits, 3 * kBits, 4 * kBits, 5 * kBits, 6 * kBits, 7 * kBits);
  const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(word)), shifts),
                                         _mm256_set1_epi32((1 << kBits) - 1));
  return _mm256_cvtepi32_ps(codes);
}

// DecodeMeanPiece's vector loop over elements [i, end) (i a multiple of 8) with CodesOfEightAvx2 (4-bit codes 16 at
// a time first, a byte to a lane), the same float32 results in the same order, for up to kMostHoisted payloads (and
// their statistics into stats, where not null); returns where it stopped (the last whole 8, or i where m is larger).
// Where stream, the means go out with streaming stores (out + i then 32-byte aligned: every store is).
template <int kBits>
__attribute__((target("avx2"))) int64_t DecodeMeanEightsAvx2(const uint8_t* packed, int64_t num_bytes, int64_t m,
                                                              const float* offsets, const float* scales,
                                                              int64_t stride, int64_t i, int64_t end,
                                                              const float* plus, float* out, StatsOfEights* stats,
                                                              bool stream) {
  constexpr int64_t kMostHoisted = 16;  // payloads whose offset and scale stay in registers
  if (m > kMostHoisted) return i;
  __m256 offset[kMostHoisted], scale[kMostHoisted];
  for (int64_t r = 0; r < m; ++r) {
    offset[r] = _mm256_set1_ps(offsets[r * stride]);
    scale[r] = _mm256_set1_ps(scales[r * stride]);
  }
  const CountDivisor divide(static_cast<float>(m));
  StatsOfEights taken = stats ? *stats : StatsOfEights();  // in registers: out's stores could alias *stats
  const bool streaming = stream && reinterpret_cast<uintptr_t>(out + i) % 32 == 0;  // every 8 aligned then
  // The mean (+ plus) of 8 elements from their sums: written, and their statistics taken.
  auto finish = [&](__m256 acc, int64_t at) {
    acc = divide(acc);
    if (plus) acc = _mm256_add_ps(acc, _mm256_loadu_ps(plus + at));
    if (streaming) {
      _mm256_stream_ps(out + at, acc);
    } else {
      _mm256_storeu_ps(out + at, acc);
    }
    if (stats) taken.Add(acc);
  };
  if constexpr (kBits == 4) {
    // 16 elements from 8 bytes a payload, widened to one per lane: the low nibbles are the even elements, the high
    // ones the odd, each summed apart (the same operations per element) and interleaved once after the payloads.
    const __m256i nibble = _mm256_set1_epi32(15);
    for (; i + 16 <= end; i += 16) {
      __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
      for (int64_t r = 0; r < m; ++r) {
        const __m256i bytes =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + r * num_bytes + i / 2)));
        const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, nibble));
        const __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
        even = _mm256_add_ps(even, _mm256_add_ps(offset[r], _mm256_mul_ps(low, scale[r])));
        odd = _mm256_add_ps(odd, _mm256_add_ps(offset[r], _mm256_mul_ps(high, scale[r])));
      }
      // Elements 0-3 and 8-11, then 4-7 and 12-15; their halves put together in order.
      const __m256 first = _mm256_unpacklo_ps(even, odd), second = _mm256_unpackhi_ps(even, odd);
      finish(_mm256_permute2f128_ps(first, second, 0x20), i);
      finish(_mm256_permute2f128_ps(first, second, 0x31), i + 8);
    }
  }
  for (; i + 8 <= end; i += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t r = 0; r < m; ++r) {
      const __m256 codes = CodesOfEightAvx2<kBits>(packed + r * num_bytes + i / 8 * kBits);
      acc = _mm256_add_ps(acc, _mm256_add_ps(offset[r], _mm256_mul_ps(codes, scale[r])));
    }
    finish(acc, i);
  }
  if (stats) *stats = taken;
  return i;
}
#endif

// One block's decoded mean: payload r's bytes at packed + r * num_bytes, its offset and scale at
// offsets[r * stride] and scales[r * stride]; the statistics of what it wrote into *stats, where not null.
template <int kBits>
void DecodeMeanPiece(const uint8_t* packed, int64_t num_bytes, int64_t m, const float* offsets, const float* scales,
                     int64_t stride, int64_t begin, int64_t end, const float* plus, float* out,
                     QuantizeStats* stats, bool stream) {
  const float count = static_cast<float>(m);
  QuantizeStats s = kNoStats;
  auto one = [&](int64_t i) {
    float acc = 0.0f;
    for (int64_t r = 0; r < m; ++r) {
      const float code = static_cast<float>(QuantizeCodeAt(packed + r * num_bytes, kBits, i));
      acc = acc + QuantizeDecode(offsets[r * stride], code, scales[r * stride]);
    }
    out[i] = plus ? acc / count + plus[i] : acc / count;
    if (stats) s = QuantizeMerge(s, QuantizeStatsOf(out[i]));
  };
  int64_t i = begin;
  for (; i < end && (i & 7) != 0; ++i) one(i);
#if defined(__AVX__)
  StatsOfEights eights;
  StatsOfEights* eights_or_none = stats ? &eights : nullptr;
#endif
#if defined(HVD_COMPRESS_QUANTIZE_AVX2)
  if (kHasAvx2) {
    i = DecodeMeanEightsAvx2<kBits>(packed, num_bytes, m, offsets, scales, stride, i, end, plus, out,
                                    eights_or_none, stream);
  }
#endif
#if defined(__AVX__)
  const CountDivisor divide(count);
  for (; i + 8 <= end; i += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t r = 0; r < m; ++r) {
      const __m256 codes = CodesOfEight<kBits>(packed + r * num_bytes + i / 8 * kBits);
      acc = _mm256_add_ps(acc, _mm256_add_ps(_mm256_set1_ps(offsets[r * stride]),
                                             _mm256_mul_ps(codes, _mm256_set1_ps(scales[r * stride]))));
    }
    acc = divide(acc);
    if (plus) acc = _mm256_add_ps(acc, _mm256_loadu_ps(plus + i));
    _mm256_storeu_ps(out + i, acc);
    if (stats) eights.Add(acc);
  }
  if (stats) s = eights.MergeInto(s);
#endif
  for (; i < end; ++i) one(i);
  if (stats) *stats = s;
}

// Codes n values blockwise into packed, scales and offsets and their residual (values - decode), the work of
// BlockQuantizeCompress and BlockQuantizeRecodeMean. The values come from a source: source.prepare(b, begin, end)
// makes those of the piece [begin, end) of block b ready before anything reads them (nothing for a plain x;
// x + plus, or the decoded mean, written into the residual's buffer) and returns their statistics (taken in the pass
// that writes them, where it writes any); source.values(begin) and source.residual(begin) point at element begin of
// the values and of the residual (which may be the same), so a local block is read from memory once.
template <typename Source>
void CodeBlocks(OpKernelContext* ctx, int64_t n, const int64_t* bounds, int64_t num_blocks, int bits, bool stochastic,
                uint64_t seed_base, const Source& source, uint8_t* packed, float* scales, float* offsets) {
  const PieceCoder code = stochastic ? CoderFor<true>(bits) : CoderFor<false>(bits);
  // The bits after the last element in its byte are 0.
  auto zero_padding = [&] {
    const int used = static_cast<int>((n * bits) & 7);
    if (used) packed[(n * bits) >> 3] &= static_cast<uint8_t>((1u << used) - 1u);
  };

  // Block b meets chunks bounds[b] / kChunk ... (bounds[b + 1] - 1) / kChunk; piece p of a
  // block is its intersection with its p-th chunk. A block inside one chunk is "local".
  std::vector<int64_t> piece_offset(num_blocks + 1, 0);
  for (int64_t b = 0; b < num_blocks; ++b) {
    piece_offset[b + 1] = piece_offset[b] + PiecesOfBlock(bounds[b], bounds[b + 1]);
  }
  const bool all_local = piece_offset[num_blocks] == num_blocks;
  std::vector<QuantizeStats> piece_stats(all_local ? 0 : piece_offset[num_blocks]);
  std::vector<QuantizeParams> params(num_blocks);
  auto local = [&](int64_t b) { return bounds[b] / kChunk == (bounds[b + 1] - 1) / kChunk; };
  auto finish = [&](int64_t b, const QuantizeStats& s) {
    params[b] = QuantizeFinish(s, bits);
    scales[b] = params[b].scale;
    offsets[b] = params[b].offset;
  };

  // Pass 1, chunk by chunk: a local block's statistics, then its coding while it is in cache;
  // the statistics of the other blocks' pieces.
  ParallelFor(ctx, NumChunks(n), kChunk * 12, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
      ForEachPieceInChunk(bounds, num_blocks, lo, hi, [&](int64_t b, int64_t begin, int64_t end) {
        const QuantizeStats s = source.prepare(b, begin, end);
        if (local(b)) {
          finish(b, s);
          code(source.values(begin), source.residual(begin), begin, end, params[b], seed_base, packed);
        } else {
          piece_stats[piece_offset[b] + c - bounds[b] / kChunk] = s;
        }
      });
    }
  });
  if (all_local) return zero_padding();
  // Pass 2 (tiny): the other blocks' parameters from their pieces.
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (local(b)) continue;
    QuantizeStats s = piece_stats[piece_offset[b]];
    for (int64_t p = piece_offset[b] + 1; p < piece_offset[b + 1]; ++p) s = QuantizeMerge(s, piece_stats[p]);
    finish(b, s);
  }
  // Pass 3: code the pieces of the blocks that cross the chunk grid.
  ParallelFor(ctx, NumChunks(n), kChunk * 8, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
      ForEachPieceInChunk(bounds, num_blocks, lo, hi, [&](int64_t b, int64_t begin, int64_t end) {
        if (!local(b)) {
          code(source.values(begin), source.residual(begin), begin, end, params[b], seed_base, packed);
        }
      });
    }
  });
  zero_padding();
}

absl::Status QuantizeSeed(const Tensor& seed_tensor, uint64_t* seed_base) {
  if (seed_tensor.dims() != 1 || seed_tensor.NumElements() != 2) {
    return InvalidArgument("seed must be an int64 vector [key, counter], got shape ",
                           seed_tensor.shape().DebugString());
  }
  const auto seed = seed_tensor.flat<int64_t>();
  *seed_base = QuantizeSeedBase(seed(0), seed(1));
  return absl::OkStatus();
}

// The payload outputs 0-2 (packed, scales, offsets) of n elements in num_blocks blocks.
absl::Status AllocatePayload(OpKernelContext* ctx, int64_t n, int64_t num_blocks, int bits, Tensor** packed,
                             Tensor** scales, Tensor** offsets) {
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({QuantizePackedBytes(n, bits)}), packed));
  TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({num_blocks}), scales));
  return ctx->allocate_output(2, TensorShape({num_blocks}), offsets);
}

// The decoded mean of piece [begin, end) of block b into out (+ plus), for m payloads of bits-bit codes; the
// statistics of what it wrote into *stats, where not null.
void DecodeMeanOfPiece(int bits, const uint8_t* packed, int64_t num_bytes, int64_t m, const float* offsets,
                       const float* scales, int64_t num_blocks, int64_t b, int64_t begin, int64_t end,
                       const float* plus, float* out, QuantizeStats* stats, bool stream) {
  const auto decode = bits == 2 ? DecodeMeanPiece<2> : bits == 4 ? DecodeMeanPiece<4> : DecodeMeanPiece<8>;
  decode(packed, num_bytes, m, offsets + b, scales + b, num_blocks, begin, end, plus, out, stats, stream);
}

}  // namespace

// The parts of BlockQuantizeCompress as one vector: part k's values are x_k, or x_k + plus_k written into its
// residual's buffer by prepare (where plus_k has elements).
struct PartsSource {
  PartIndex where;
  std::vector<const float*> xs, pluses;  // pluses[k]: nullptr where plus_k is empty
  std::vector<float*> residuals;

  QuantizeStats prepare(int64_t, int64_t begin, int64_t end) const {
    const int64_t part = where.PartOf(begin), at = begin - where.start(part);
    const float* plus = pluses[part];
    if (plus == nullptr) return PieceStats(xs[part] + at, end - begin);
    return SumWithStats(xs[part] + at, plus + at, end - begin, residuals[part] + at);  // may be in place
  }
  const float* values(int64_t begin) const {
    const int64_t part = where.PartOf(begin), at = begin - where.start(part);
    return (pluses[part] == nullptr ? xs[part] : residuals[part]) + at;
  }
  float* residual(int64_t begin) const {
    const int64_t part = where.PartOf(begin);
    return residuals[part] + (begin - where.start(part));
  }
};

// BlockQuantizeCompress (see quantize_ops.cc).
class BlockQuantizeCompressOp : public OpKernel {
 public:
  explicit BlockQuantizeCompressOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int64_t bits;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bits", &bits));
    OP_REQUIRES_OK(ctx, CheckBits(bits));
    bits_ = static_cast<int>(bits);
    OP_REQUIRES_OK(ctx, ctx->GetAttr("stochastic", &stochastic_));
  }

  void Compute(OpKernelContext* ctx) override {
    tensorflow::OpInputList xs, pluses;
    OP_REQUIRES_OK(ctx, ctx->input_list("xs", &xs));
    OP_REQUIRES_OK(ctx, ctx->input_list("pluses", &pluses));
    const Tensor& bounds_tensor = ctx->input(2 * xs.size());
    std::vector<int64_t> sizes;
    for (int k = 0; k < xs.size(); ++k) sizes.push_back(xs[k].NumElements());
    PartsSource source{PartIndex(sizes), {}, {}, {}};
    const int64_t n = source.where.total();
    OP_REQUIRES_OK(ctx, ValidateBounds(bounds_tensor, n));
    const int64_t* bounds = bounds_tensor.flat<int64_t>().data();
    const int64_t num_blocks = bounds_tensor.NumElements() - 1;
    uint64_t seed_base;
    OP_REQUIRES_OK(ctx, QuantizeSeed(ctx->input(2 * xs.size() + 1), &seed_base));
    for (int k = 0; k < xs.size(); ++k) {
      OP_REQUIRES(ctx, pluses[k].NumElements() == sizes[k] || pluses[k].NumElements() == 0,
                  InvalidArgument("pluses[", k, "] must have the ", sizes[k], " elements of xs[", k,
                                  "], or none, got shape ", pluses[k].shape().DebugString()));
      OP_REQUIRES(ctx, std::binary_search(bounds, bounds + num_blocks + 1, source.where.start(k)),
                  InvalidArgument("xs[", k, "] starts at element ", source.where.start(k),
                                  ", inside a block: every part must start at one of the bounds"));
    }
    Tensor *packed = nullptr, *scales = nullptr, *offsets = nullptr;
    OP_REQUIRES_OK(ctx, AllocatePayload(ctx, n, num_blocks, bits_, &packed, &scales, &offsets));
    for (int k = 0; k < xs.size(); ++k) {
      const bool has_plus = pluses[k].NumElements() > 0;
      Tensor* residual = nullptr;
      OP_REQUIRES_OK(ctx, has_plus ? ctx->forward_input_or_allocate_output({k, xs.size() + k}, 3 + k,
                                                                            xs[k].shape(), &residual)
                                   : ctx->forward_input_or_allocate_output({k}, 3 + k, xs[k].shape(), &residual));
      source.xs.push_back(xs[k].flat<float>().data());
      source.pluses.push_back(has_plus ? pluses[k].flat<float>().data() : nullptr);
      source.residuals.push_back(residual->flat<float>().data());  // may be x_k's or plus_k's buffer
    }
    if (n == 0) return;
    CodeBlocks(ctx, n, bounds, num_blocks, bits_, stochastic_, seed_base, source, packed->flat<uint8_t>().data(),
               scales->flat<float>().data(), offsets->flat<float>().data());
  }

 private:
  int bits_;
  bool stochastic_;
};

// BlockQuantizeRecodeMean (see quantize_ops.cc).
class BlockQuantizeRecodeMeanOp : public OpKernel {
 public:
  explicit BlockQuantizeRecodeMeanOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int64_t bits;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bits", &bits));
    OP_REQUIRES_OK(ctx, CheckBits(bits));
    bits_ = static_cast<int>(bits);
    OP_REQUIRES_OK(ctx, ctx->GetAttr("stochastic", &stochastic_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed_tensor = ctx->input(0);
    const Tensor& scales_tensor = ctx->input(1);
    const Tensor& offsets_tensor = ctx->input(2);
    const Tensor& bounds_tensor = ctx->input(3);
    const Tensor& plus_tensor = ctx->input(4);
    int64_t n, m, num_blocks;
    OP_REQUIRES_OK(ctx, checks::QuantizePayloads(packed_tensor, scales_tensor, offsets_tensor, bounds_tensor,
                                                 plus_tensor, bits_, &n, &m, &num_blocks));
    uint64_t seed_base;
    OP_REQUIRES_OK(ctx, QuantizeSeed(ctx->input(5), &seed_base));
    Tensor *packed = nullptr, *scales = nullptr, *offsets = nullptr, *residual = nullptr;
    OP_REQUIRES_OK(ctx, AllocatePayload(ctx, n, num_blocks, bits_, &packed, &scales, &offsets));
    const bool has_plus = plus_tensor.NumElements() > 0;
    if (has_plus) {
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({4}, 3, TensorShape({n}), &residual));
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({n}), &residual));
    }
    if (n == 0) return;
    const uint8_t* in_packed = packed_tensor.flat<uint8_t>().data();
    const float* in_scales = scales_tensor.flat<float>().data();
    const float* in_offsets = offsets_tensor.flat<float>().data();
    const float* plus = has_plus ? plus_tensor.flat<float>().data() : nullptr;  // may be residual's buffer
    // The decoded mean (+ plus) of each piece into the residual's buffer, coded there.
    struct MeanSource {
      int bits;
      const uint8_t* packed;
      int64_t n, num_bytes, m;
      const float *offsets, *scales;
      int64_t num_blocks;
      const float* plus;
      float* mean;
      QuantizeStats prepare(int64_t b, int64_t begin, int64_t end) const {
        PrefetchNext(begin, end);
        QuantizeStats stats = kNoStats;
        DecodeMeanOfPiece(bits, packed, num_bytes, m, offsets, scales, num_blocks, b, begin, end, plus, mean, &stats,
                          false);  // the mean is coded next, from the cache
        return stats;
      }
      // Asks for the next piece's payload bytes and plus (as long as this one, up to element n) while this one is
      // decoded and coded: the coding loads nothing new, so the hardware prefetchers fall behind the streams
      // between two decodes (4-bit codes: 5-8% less time at 16M floats on a 2-core AMD EPYC Zen 4).
      void PrefetchNext(int64_t begin, int64_t end) const {
        const int64_t last = std::min(end + (end - begin), n);
        for (int64_t i = end; plus && i < last; i += 64 / sizeof(float)) __builtin_prefetch(plus + i);
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t i = end * bits / 8; i < (last * bits + 7) / 8; i += 64) {
            __builtin_prefetch(packed + r * num_bytes + i);
          }
        }
      }
      const float* values(int64_t begin) const { return mean + begin; }
      float* residual(int64_t begin) const { return mean + begin; }
    };
    const MeanSource source{bits_, in_packed, n, QuantizePackedBytes(n, bits_), m, in_offsets, in_scales, num_blocks,
                            plus, residual->flat<float>().data()};
    CodeBlocks(ctx, n, bounds_tensor.flat<int64_t>().data(), num_blocks, bits_, stochastic_, seed_base, source,
               packed->flat<uint8_t>().data(), scales->flat<float>().data(), offsets->flat<float>().data());
  }

 private:
  int bits_;
  bool stochastic_;
};

// BlockQuantizeDecodeMean (see quantize_ops.cc).
class BlockQuantizeDecodeMeanOp : public OpKernel {
 public:
  explicit BlockQuantizeDecodeMeanOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int64_t bits;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bits", &bits));
    OP_REQUIRES_OK(ctx, CheckBits(bits));
    bits_ = static_cast<int>(bits);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed_tensor = ctx->input(0);
    const Tensor& scales_tensor = ctx->input(1);
    const Tensor& offsets_tensor = ctx->input(2);
    const Tensor& bounds_tensor = ctx->input(3);
    const Tensor& plus_tensor = ctx->input(4);
    int64_t n, m, num_blocks;
    OP_REQUIRES_OK(ctx, checks::QuantizePayloads(packed_tensor, scales_tensor, offsets_tensor, bounds_tensor,
                                                 plus_tensor, bits_, &n, &m, &num_blocks));
    const int64_t* bounds = bounds_tensor.flat<int64_t>().data();
    const int bits = bits_;
    const int64_t num_bytes = QuantizePackedBytes(n, bits);
    const float* plus = plus_tensor.NumElements() > 0 ? plus_tensor.flat<float>().data() : nullptr;

    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &y_tensor));
    if (n == 0) return;
    const uint8_t* packed = packed_tensor.flat<uint8_t>().data();
    const float* scales = scales_tensor.flat<float>().data();
    const float* offsets = offsets_tensor.flat<float>().data();
    float* y = y_tensor->flat<float>().data();

    const bool stream = n * static_cast<int64_t>(sizeof(float)) >= kStreamingBytes;
    ParallelFor(ctx, NumChunks(n), kChunk * (2 + 2 * m), [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        const int64_t chunk_lo = c * kChunk, chunk_hi = std::min(n, chunk_lo + kChunk);
        ForEachPieceInChunk(bounds, num_blocks, chunk_lo, chunk_hi, [&](int64_t b, int64_t begin, int64_t end) {
          DecodeMeanOfPiece(bits, packed, num_bytes, m, offsets, scales, num_blocks, b, begin, end, plus, y, nullptr,
                            stream);
        });
      }
      if (stream) StreamsDone();
    });
  }

 private:
  int bits_;
};

REGISTER_KERNEL_BUILDER(Name("BlockQuantizeCompress").Device(DEVICE_CPU), BlockQuantizeCompressOp);
REGISTER_KERNEL_BUILDER(Name("BlockQuantizeDecodeMean").Device(DEVICE_CPU), BlockQuantizeDecodeMeanOp);
REGISTER_KERNEL_BUILDER(Name("BlockQuantizeRecodeMean").Device(DEVICE_CPU), BlockQuantizeRecodeMeanOp);

}  // namespace hvd_compress
