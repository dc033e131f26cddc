// The GPU kernels' launchers, in C so that both TensorFlow's GPU op kernels and the standalone
// harness (tests/gpu/harness.py, through ctypes) call the same code. Pointers are device memory
// unless named *_host. Each launcher enqueues on `stream` and returns a cudaError_t as int (0: success;
// cudaErrorInvalidValue for a count the op refuses, e.g. a mean of no payloads).
// The launchers trust what an op kernel validates on the host first, as the CPU kernels do: block
// bounds strictly increasing from 0 to n (ValidateBounds), indices in range (or found with
// hc_first_out_of_range_*), sizes that match.
// Element types: "f32" float, "f16" IEEE half, "bf16" bfloat16.
#ifndef HVD_COMPRESS_TF_OPS_GPU_LAUNCHERS_H_
#define HVD_COMPRESS_TF_OPS_GPU_LAUNCHERS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st* hc_stream;

// ---- 1-bit sign (sign_kernels.cu): BlockSignPack, BlockSignCompress, BlockSignUnpack(Mean),
// ResourceSubtractBlockSignMean. bounds: the num_blocks + 1 block bounds (bounds[num_blocks] = n); the
// pack needs a device workspace of hc_sign_pack_workspace_bytes(n, num_blocks) bytes.
size_t hc_sign_pack_workspace_bytes(int64_t n, int64_t num_blocks);
// bits[(n + 7) / 8], scales[num_blocks]; residual (f32 only, may be NULL, may be x): x - C(x).
int hc_sign_pack_f32(const float* x, int64_t n, const int64_t* bounds, int64_t num_blocks, uint8_t* bits,
                     float* scales, float* residual, void* workspace, hc_stream stream);
int hc_sign_pack_f16(const void* x, int64_t n, const int64_t* bounds, int64_t num_blocks, uint8_t* bits,
                     float* scales, void* workspace, hc_stream stream);
int hc_sign_pack_bf16(const void* x, int64_t n, const int64_t* bounds, int64_t num_blocks, uint8_t* bits,
                      float* scales, void* workspace, hc_stream stream);
// y[i] = mean over m payloads (bits [m, (n + 7) / 8], scales [m, num_blocks]) (+ plus[i] when plus is not NULL).
int hc_sign_unpack_mean_f32(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks,
                            int64_t n, int64_t m, const float* plus, float* y, hc_stream stream);
int hc_sign_unpack_mean_f16(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks,
                            int64_t n, int64_t m, const float* plus, void* y, hc_stream stream);
int hc_sign_unpack_mean_bf16(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks,
                             int64_t n, int64_t m, const float* plus, void* y, hc_stream stream);
// variable[i - offset] -= the mean, for i in [offset, offset + size).
int hc_sign_subtract_mean(const uint8_t* bits, const float* scales, const int64_t* bounds, int64_t num_blocks,
                          int64_t n, int64_t m, int64_t offset, int64_t size, float* variable, hc_stream stream);

// ---- Error feedback (feedback_kernels.cu): a[n] = g + e (a_i = g_i + e_i, one rounding; a may be g or e), and
// MomentumErrorFeed (a may be g).
int hc_error_feed(const float* g, const float* e, int64_t n, float* a, hc_stream stream);
int hc_momentum_error_feed(const float* g, const float* m, const float* e, int64_t n, float lr, float momentum,
                           float residual_scale, int nesterov, float* m_new, float* a, hc_stream stream);

// ---- Adam with a frozen variance (adam_kernels.cu): AdamMomentumFeed, AdamFrozenStep, ResourceDecayAndSubtract.
// a may be g or e; m_new may be m; delta may be mean.
int hc_adam_momentum_feed(const float* g, const float* m, const float* v, const float* e, int64_t n,
                          float one_minus_beta_1, float epsilon, float bound, float* a, hc_stream stream);
int hc_adam_frozen_step(const float* mean, const float* m, const float* v, int64_t n, float alpha,
                        float one_minus_beta_1, float epsilon, float max_step, int momentum_exchanged, float* m_new,
                        float* delta, hc_stream stream);
// x[i] = (x[i] - x[i] * decay) - delta[i], in place.
int hc_decay_and_subtract(float* x, const float* delta, int64_t n, float decay, hc_stream stream);

// ---- fp16 (half_kernels.cu): HalfPack / HalfUnpack of one part, HalfMean.
int hc_half_from_f32(const float* x, int64_t n, void* y, hc_stream stream);
int hc_half_from_bf16(const void* x, int64_t n, void* y, hc_stream stream);
int hc_half_to_f32(const void* x, int64_t n, float* y, hc_stream stream);
int hc_half_to_bf16(const void* x, int64_t n, void* y, hc_stream stream);
// mean[m] of rows x[count, m] (float16).
int hc_half_mean(const void* x, int64_t count, int64_t m, void* mean, hc_stream stream);

// ---- top-k and scatter (topk_kernels.cu): TopKAbs, ScatterDense, ScatterMean, GatherAt, ZeroAt.
// Parts (the ops' lists of tensors, read where they lie, as one concatenation): parts_host[num_parts] holds their
// device pointers and sizes_host[num_parts] their sizes, both on the host. Out-of-range indices are skipped (GatherAt
// gives 0 for them); hc_first_out_of_range_* finds the first for the op to reject them as the CPU kernels do.
// values[k], indices[k]: the k largest |x| of the concatenation, ties to the lower index, in index order; a device
// workspace of hc_top_k_abs_workspace_bytes(...) bytes. k in [0, n], n < 2^31.
size_t hc_top_k_abs_workspace_bytes(const int64_t* sizes_host, int64_t num_parts);
int hc_top_k_abs_f32(const void* const* parts_host, const int64_t* sizes_host, int64_t num_parts, int64_t k,
                     float* values, int32_t* indices, void* workspace, hc_stream stream);
int hc_top_k_abs_f16(const void* const* parts_host, const int64_t* sizes_host, int64_t num_parts, int64_t k,
                     void* values, int32_t* indices, void* workspace, hc_stream stream);
int hc_top_k_abs_bf16(const void* const* parts_host, const int64_t* sizes_host, int64_t num_parts, int64_t k,
                      void* values, int32_t* indices, void* workspace, hc_stream stream);
// y[n]: zero but y[indices[i]] += values[i], in input order (float32 sums, rounded once); workspace of
// hc_scatter_dense_workspace_bytes(k, n) bytes.
size_t hc_scatter_dense_workspace_bytes(int64_t k, int64_t n);
int hc_scatter_dense_f32_i32(const int32_t* indices, const float* values, int64_t k, int64_t n, float* y,
                             void* workspace, hc_stream stream);
int hc_scatter_dense_f32_i64(const int64_t* indices, const float* values, int64_t k, int64_t n, float* y,
                             void* workspace, hc_stream stream);
int hc_scatter_dense_f16_i32(const int32_t* indices, const void* values, int64_t k, int64_t n, void* y,
                             void* workspace, hc_stream stream);
int hc_scatter_dense_f16_i64(const int64_t* indices, const void* values, int64_t k, int64_t n, void* y,
                             void* workspace, hc_stream stream);
int hc_scatter_dense_bf16_i32(const int32_t* indices, const void* values, int64_t k, int64_t n, void* y,
                              void* workspace, hc_stream stream);
int hc_scatter_dense_bf16_i64(const int64_t* indices, const void* values, int64_t k, int64_t n, void* y,
                              void* workspace, hc_stream stream);
// The parts (written whole): zero but, at each index, its values summed in input order, divided by count.
size_t hc_scatter_mean_workspace_bytes(int64_t k, const int64_t* sizes_host, int64_t num_parts);
int hc_scatter_mean(const int32_t* indices, const float* values, int64_t k, float* const* parts_host,
                    const int64_t* sizes_host, int64_t num_parts, int64_t count, void* workspace, hc_stream stream);
// GatherAt: values[i] = element indices[i] of the parts; ZeroAt: those elements set to zero, in place. Workspace:
// hc_parts_workspace_bytes(num_parts) bytes.
size_t hc_parts_workspace_bytes(int64_t num_parts);
int hc_gather_at(const float* const* parts_host, const int64_t* sizes_host, int64_t num_parts,
                 const int32_t* indices, int64_t k, float* values, void* workspace, hc_stream stream);
// x[indices[t] - offset] -= values[t] / count for the indices in [offset, offset + size) (ResourceSubtractSparseMean;
// the indices distinct).
int hc_subtract_sparse_mean(float* x, int64_t size, const int32_t* indices, const float* values, int64_t m,
                            int64_t offset, int64_t count, hc_stream stream);
int hc_zero_at(float* const* parts_host, const int64_t* sizes_host, int64_t num_parts, const int32_t* indices,
               int64_t k, void* workspace, hc_stream stream);
// *first (device): the first i with indices[i] outside [0, n), or k when there is none.
int hc_first_out_of_range_i32(const int32_t* indices, int64_t k, int64_t n, int64_t* first, hc_stream stream);
int hc_first_out_of_range_i64(const int64_t* indices, int64_t k, int64_t n, int64_t* first, hc_stream stream);

// ---- count sketch (sketch_kernels.cu): CountSketch, CountSketchBuckets, CountSketchQuery. seed and step: the
// ops' scalars (SketchSeed in sketch_hash.h combines them); sketch: float32 [rows, cols], row-major. Sizes:
// n < 2^32 and cols < 2^32. CountSketch sums each cell in increasing i (the CPU's bits) and needs a device
// workspace of hc_count_sketch_workspace_bytes(n, cols) bytes (16 n plus the sort's; 0 when n is 0).
size_t hc_count_sketch_workspace_bytes(int64_t n, int64_t cols);
// sketch[rows, cols] of x[n].
int hc_count_sketch_f32(const float* x, int64_t n, int64_t seed, int64_t step, int64_t rows, int64_t cols,
                        float* sketch, void* workspace, hc_stream stream);
int hc_count_sketch_f16(const void* x, int64_t n, int64_t seed, int64_t step, int64_t rows, int64_t cols,
                        float* sketch, void* workspace, hc_stream stream);
int hc_count_sketch_bf16(const void* x, int64_t n, int64_t seed, int64_t step, int64_t rows, int64_t cols,
                         float* sketch, void* workspace, hc_stream stream);
// loads[rows, cols]: how many of the coordinates i < n (n < 2^31) each row hashes to each cell (CountSketch's
// count_loads).
int hc_count_sketch_loads(int64_t n, int64_t seed, int64_t step, int64_t rows, int64_t cols, int32_t* loads,
                          hc_stream stream);
// estimate[n]: the median over the rows of sketch[rows, cols] of every coordinate i < n.
int hc_count_sketch_query(const float* sketch, int64_t rows, int64_t cols, int64_t n, int64_t seed, int64_t step,
                          float* estimate, hc_stream stream);
// buckets[rows, m]: the cell (column) of indices[m] in every row of a sketch of n values; -1 for an index outside
// [0, n) (the CPU op refuses those: a GPU op kernel can check for -1).
int hc_count_sketch_buckets(const int64_t* indices, int64_t m, int64_t n, int64_t seed, int64_t step, int64_t rows,
                            int64_t cols, int64_t* buckets, hc_stream stream);

// ---- low-bit quantization (quantize_kernels.cu): BlockQuantizeCompress, BlockQuantizeDecodeMean. bits: 2, 4
// or 8 (else cudaErrorInvalidValue); bounds: the num_blocks + 1 block bounds [0, ..., n] on the device.
// The compress needs a device workspace of hc_quantize_compress_workspace_bytes(num_blocks) bytes, 16-byte
// aligned (else cudaErrorMisalignedAddress).
size_t hc_quantize_compress_workspace_bytes(int64_t num_blocks);
// packed[(n * bits + 7) / 8], scales[num_blocks], offsets[num_blocks]; residual (may be NULL, may be x):
// x - decode(packed). stochastic: 0 rounds to nearest, else draws u_i from seed (seed_key, seed_counter).
int hc_quantize_compress(const float* x, const int64_t* bounds, int64_t num_blocks, int64_t n, int bits,
                         int stochastic, int64_t seed_key, int64_t seed_counter, uint8_t* packed, float* scales,
                         float* offsets, float* residual, void* workspace, hc_stream stream);
// y[n] = mean over m >= 1 payloads (packed [m, (n * bits + 7) / 8], scales and offsets [m, num_blocks])
// (+ plus[i] when plus is not NULL).
int hc_quantize_decode_mean(const uint8_t* packed, const float* scales, const float* offsets, const int64_t* bounds,
                            int64_t num_blocks, int64_t n, int64_t m, int bits, const float* plus, float* y,
                            hc_stream stream);

// ---- Stochastic Gradient Push (pushsum_kernels.cu): PushSumShare. values_host[num_parts] and before_host (NULL
// without overlap, else one per value) hold device pointers, sizes_host their sizes, on the host; weight: the
// device scalar w. share[sum(sizes) + 1] = [x / parts, w / parts], x = values * w (before NULL) or
// values - (1 - w) * before, each part's slice in order. parts >= 2 (else cudaErrorInvalidValue).
int hc_push_sum_share(const float* const* values_host, const float* const* before_host, const int64_t* sizes_host,
                      int64_t num_parts, const float* weight, int64_t parts, float* share, hc_stream stream);

#ifdef __cplusplus
}
#endif

#endif  // HVD_COMPRESS_TF_OPS_GPU_LAUNCHERS_H_
