// Op registrations and shape functions for top-k sparsification
// (Top-k with residuals; see hvd_compress/compression.py).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvd_compress {

using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("TopKAbs")
    .Input("x: T")
    .Input("k: int32")
    .Output("values: T")
    .Output("indices: int32")
    .Attr("T: {float, half, bfloat16}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      DimensionHandle k;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(1, &k));
      c->set_output(0, c->Vector(k));
      c->set_output(1, c->Vector(k));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The k entries of x (flattened) with the largest |x|, in increasing index
order. Among equal magnitudes the lower index wins; NaN counts as larger than
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

}  // namespace hvd_compress
