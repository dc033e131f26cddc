// Op registrations and shape functions for the blockwise sign compressor
// (dist-EF-SGD, Zheng et al. 2019): C(x)_b = (||x_b||_1 / |G_b|) * sign(x_b).
//
// Wire format: the signs bit-packed LSB-first (bit j of byte i is element
// 8*i + j; a set bit means negative, so sign(0) = sign(-0) = +1) and one
// float32 scale per block. Blocks are given by `bounds`, an int64 vector
// [0 = b_0 < b_1 < ... < b_B = n]; the Python wrappers in
// hvd_compress/ops.py build it from a block size or from a fused layout.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvd_compress {

using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

namespace {

// Number of blocks B from bounds [B + 1]; unknown when bounds' length is.
absl::Status NumBlocks(InferenceContext* c, int bounds_input,
                       DimensionHandle* blocks) {
  ShapeHandle bounds;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(bounds_input), 1, &bounds));
  return c->Subtract(c->Dim(bounds, 0), 1, blocks);
}

// n = bounds[-1] when bounds is a constant known at graph-building time.
DimensionHandle NumElementsFromBounds(InferenceContext* c, int bounds_input) {
  const tensorflow::Tensor* bounds = c->input_tensor(bounds_input);
  if (bounds == nullptr || bounds->NumElements() == 0) {
    return c->UnknownDim();
  }
  return c->MakeDim(bounds->flat<int64_t>()(bounds->NumElements() - 1));
}

// Payloads (bits, scales, bounds at inputs first, first + 1, first + 2) of
// payload_rank 1 (one) or 2 (stacked) that agree with each other.
absl::Status CheckPayloads(InferenceContext* c, int payload_rank, int first) {
  DimensionHandle blocks;
  TF_RETURN_IF_ERROR(NumBlocks(c, first + 2, &blocks));
  ShapeHandle bits, scales;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(first), payload_rank, &bits));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(first + 1), payload_rank, &scales));
  DimensionHandle unused;
  TF_RETURN_IF_ERROR(
      c->Merge(c->Dim(scales, payload_rank - 1), blocks, &unused));
  if (payload_rank == 2) {
    TF_RETURN_IF_ERROR(c->Merge(c->Dim(bits, 0), c->Dim(scales, 0), &unused));
  }
  return absl::OkStatus();
}

absl::Status UnpackShape(InferenceContext* c, int payload_rank) {
  TF_RETURN_IF_ERROR(CheckPayloads(c, payload_rank, 0));
  c->set_output(0, c->Vector(NumElementsFromBounds(c, 2)));
  return absl::OkStatus();
}

// bits [ceil(n / 8)] and scales [B] of x [n] and bounds [B + 1].
absl::Status PackShape(InferenceContext* c) {
  DimensionHandle blocks, n_plus_7, num_bytes;
  TF_RETURN_IF_ERROR(NumBlocks(c, 1, &blocks));
  TF_RETURN_IF_ERROR(c->Add(c->NumElements(c->input(0)), 7, &n_plus_7));
  TF_RETURN_IF_ERROR(c->Divide(n_plus_7, 8, /*evenly_divisible=*/false, &num_bytes));
  c->set_output(0, c->Vector(num_bytes));
  c->set_output(1, c->Vector(blocks));
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("BlockSignPack")
    .Input("x: T")
    .Input("bounds: int64")
    .Output("bits: uint8")
    .Output("scales: float")
    .Attr("T: {float, half, bfloat16}")
    .SetShapeFn(PackShape)
    .Doc(R"doc(
Packs the signs of x (flattened) into bits and computes one scale per block.

bits: uint8[ceil(n / 8)], bit j of byte i set when x[8i + j] < 0.
scales: float32[B], scales[b] = mean(|x[bounds[b]:bounds[b+1]]|); a NaN or Inf
  in a block makes that block's scale non-finite.
)doc");

REGISTER_OP("BlockSignCompress")
    .Input("x: float")
    .Input("bounds: int64")
    .Output("bits: uint8")
    .Output("scales: float")
    .Output("residual: float")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(PackShape(c));
      c->set_output(2, c->input(0));
      return absl::OkStatus();
    })
    .Doc(R"doc(
BlockSignPack's bits and scales of float32 x, and the error-feedback residual
x - C(x) with C(x) as BlockSignUnpack decodes it, in x's buffer when nothing
else holds it.
)doc");

REGISTER_OP("BlockSignUnpack")
    .Input("bits: uint8")
    .Input("scales: float")
    .Input("bounds: int64")
    .Output("y: T")
    .Attr("T: {float, half, bfloat16} = DT_FLOAT")
    .SetShapeFn([](InferenceContext* c) { return UnpackShape(c, 1); })
    .Doc(R"doc(
Decodes one packed payload: y[i] = -scales[b] if bit i is set else scales[b],
for i in block b. n = bounds[-1].
)doc");

REGISTER_OP("BlockSignUnpackMean")
    .Input("bits: uint8")
    .Input("scales: float")
    .Input("bounds: int64")
    .Input("plus: N * float")
    .Output("y: T")
    .Attr("T: {float, half, bfloat16} = DT_FLOAT")
    .Attr("N: int >= 0 = 0")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(UnpackShape(c, 2));
      for (int i = 3; i < c->num_inputs(); ++i) {
        ShapeHandle plus;
        TF_RETURN_IF_ERROR(c->Merge(c->input(i), c->output(0), &plus));
      }
      return absl::OkStatus();
    })
    .Doc(R"doc(
Mean of m stacked payloads (what an allgather returns), decoded in one pass
without materializing m dense tensors: bits uint8[m, ceil(n/8)],
scales float32[m, B]. Summed in float32 in payload order, then divided by m;
with plus (at most one float32[n]) the sum's mean + plus, added in float32
before the cast to T (for float32, what a separate add would give).
)doc");

REGISTER_OP("ResourceSubtractBlockSignMean")
    .Input("variable: resource")
    .Input("bits: uint8")
    .Input("scales: float")
    .Input("bounds: int64")
    .Input("offset: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 0, &unused));
      return CheckPayloads(c, 2, 1);
    })
    .Doc(R"doc(
variable -= y[offset : offset + size], in place, where y is what
BlockSignUnpackMean decodes from the same stacked payloads and bounds and
size is the float32 variable's number of elements (read as a flat vector):
the float32 subtraction of AssignSubVariableOp, in one pass over the variable
instead of a decode and a read-modify-write of a decoded tensor. Copies the
variable's buffer first only where a read still holds it.
)doc");

}  // namespace hvd_compress
