// Op registrations and shape functions for top-k sparsification
// (Top-k with residuals; see hvd_compress/compression.py).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "shape_fns.h"

namespace hvd_compress {

using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("TopKAbs")
    .Input("xs: N * T")
    .Input("k: int32")
    .Output("values: T")
    .Output("indices: int32")
    .Attr("N: int >= 1")
    .Attr("T: {float, half, bfloat16}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      const int k_input = c->num_inputs() - 1;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(k_input), 0, &unused));
      DimensionHandle k;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(k_input, &k));
      c->set_output(0, c->Vector(k));
      c->set_output(1, c->Vector(k));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The k entries of the concatenation of xs (each flattened) with the largest
|x|, in increasing index order; the inputs are read in place, never
concatenated. Among equal magnitudes the lower index wins; NaN counts as larger than
+Inf, so non-finite entries are always selected.
)doc");

REGISTER_OP("ScatterDense")
    .Input("indices: Tidx")
    .Input("values: T")
    .Input("n: int64")
    .Output("y: T")
    .Attr("T: {float, half, bfloat16}")
    .Attr("Tidx: {int32, int64} = DT_INT32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      DimensionHandle n;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(2, &n));
      c->set_output(0, c->Vector(n));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Dense vector of length n, zero except y[indices[i]] += values[i]; duplicate
indices are summed in input order.
)doc");

REGISTER_OP("ZeroAt")
    .Input("xs: N * float")
    .Input("indices: int32")
    .Output("ys: N * float")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
      return absl::OkStatus();
    })
    .Doc(R"doc(
xs with the elements at `indices` (of their concatenation) set to zero. An
input nothing else holds is zeroed in place (no copy).
)doc");

REGISTER_OP("GatherAt")
    .Input("xs: N * float")
    .Input("indices: int32")
    .Output("values: float")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle indices;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(c->num_inputs() - 1), 1, &indices));
      c->set_output(0, indices);
      return absl::OkStatus();
    })
    .Doc(R"doc(
The elements at `indices` of the concatenation of xs (each flattened), read in
place (no concatenation is made).
)doc");

REGISTER_OP("ScatterMean")
    .Input("indices: int32")
    .Input("values: float")
    .Output("ys: N * float")
    .Attr("N: int >= 1")
    .Attr("sizes: list(int)")
    .Attr("count: int")
    .SetShapeFn(VectorsOfSizes)
    .Doc(R"doc(
Vectors of `sizes` (parts of one concatenation), zero except at `indices`:
there the values given for the index summed in input order, then divided by
count. The allgathered (values, indices) of `count` ranks give their mean
without a dense tensor per rank.
)doc");

REGISTER_OP("ResourceSubtractSparseMean")
    .Input("variable: resource")
    .Input("indices: int32")
    .Input("values: float")
    .Input("offset: int64")
    .Attr("count: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 0, &unused));
      return absl::OkStatus();
    })
    .Doc(R"doc(
A float32 variable, elements [offset, offset + size) of a bucket, less its part of the
sparse mean update (values at increasing, distinct `indices` of the bucket, divided by
count), in place: variable[i - offset] -= values[t] / count for every indices[t] = i in
that range, as ScatterMean's mean subtracted from the whole variable would give, in one
write per index instead of passes over the variable.
)doc");

}  // namespace hvd_compress
