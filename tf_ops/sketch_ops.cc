// Op registrations for count sketches (sketched SGD, Ivkin et al., NeurIPS 2019).
//
// Row j hashes coordinate i to bucket h_j(i) in [0, cols) with sign s_j(i) in
// {-1, +1}, both derived from (seed, j, i) by SketchHash in sketch_hash.h:
// nothing d-sized is stored or sent, and every rank and platform agrees.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvd_compress {

using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("CountSketch")
    .Input("xs: N * T")
    .Input("seed: int64")
    .Input("step: int64")
    .Output("sketch: float")
    .Output("loads: int32")
    .Attr("N: int >= 1")
    .Attr("T: {float, half, bfloat16}")
    .Attr("rows: int >= 1")
    .Attr("cols: int >= 1")
    .Attr("count_loads: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      for (int i = c->num_inputs() - 2; i < c->num_inputs(); ++i) {
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
      }
      int64_t rows, cols;
      TF_RETURN_IF_ERROR(c->GetAttr("rows", &rows));
      TF_RETURN_IF_ERROR(c->GetAttr("cols", &cols));
      bool count_loads = false;
      TF_RETURN_IF_ERROR(c->GetAttr("count_loads", &count_loads));
      c->set_output(0, c->Matrix(rows, cols));
      c->set_output(1, count_loads ? c->Matrix(rows, cols) : c->Matrix(0, 0));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Count sketch of x, the concatenation of xs (each flattened; a bucket's parts where
they lie, never copied into one vector): sketch[j, h_j(i)] += s_j(i) * x[i],
summed in float32 in increasing i. Linear in x. Hashes and signs from the scalars seed and
step (SketchSeed in sketch_hash.h). With count_loads, loads[j, c] is the number of
coordinates row j hashes to cell c (they depend on n, seed and step alone), counted in the
same pass; else loads is empty [0, 0].
)doc");

REGISTER_OP("CountSketchQuery")
    .Input("sketch: float")
    .Input("n: int64")
    .Input("seed: int64")
    .Input("step: int64")
    .Output("estimate: float")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle sketch, unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &sketch));
      for (int i = 1; i <= 3; ++i) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
      DimensionHandle n;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(1, &n));
      c->set_output(0, c->Vector(n));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Estimate of every coordinate i < n: the median over rows j of
s_j(i) * sketch[j, h_j(i)] (for an even number of rows, the mean of the two
middle values).
)doc");

REGISTER_OP("CountSketchTopK")
    .Input("sketch: float")
    .Input("loads: int32")
    .Input("xs: N * float")
    .Input("k: int32")
    .Input("seed: int64")
    .Input("step: int64")
    .Output("values: float")
    .Output("indices: int32")
    .Attr("N: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle sketch, unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &sketch));
      const int k_input = c->num_inputs() - 3;
      for (int i = k_input; i < c->num_inputs(); ++i) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
      DimensionHandle k;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(k_input, &k));
      c->set_output(0, c->Vector(k));
      c->set_output(1, c->Vector(k));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The k coordinates i < n = size(x) of largest |estimate| of a one-row sketch
(TopKAbs of CountSketchQuery(sketch, n): increasing index order, ties to the
lower index) and x at them, without the n estimates; x is the concatenation of
xs (each flattened). loads: the cells' coordinate counts as CountSketch counts them
for the same n, seed and step ([1, cols], summing to n), which saves hashing every
coordinate once more; or empty, and they are counted here.
)doc");

REGISTER_OP("CountSketchBuckets")
    .Input("indices: int64")
    .Input("n: int64")
    .Input("seed: int64")
    .Input("step: int64")
    .Output("buckets: int64")
    .Attr("rows: int >= 1")
    .Attr("cols: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle indices, unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &indices));
      for (int i = 1; i <= 3; ++i) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
      int64_t rows;
      TF_RETURN_IF_ERROR(c->GetAttr("rows", &rows));
      c->set_output(0, c->Matrix(rows, c->Dim(indices, 0)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The bucket h_j(i) of every given coordinate i < n in every row j: buckets[j, t] =
h_j(indices[t]), the cells a count sketch of n values adds indices[t] to
(FetchSGD zeroes them once the coordinate's value is applied).
)doc");

}  // namespace hvd_compress
