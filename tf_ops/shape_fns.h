// Shape functions shared by hvd_compress's op registrations.
#ifndef HVD_COMPRESS_TF_OPS_SHAPE_FNS_H_
#define HVD_COMPRESS_TF_OPS_SHAPE_FNS_H_

#include <vector>

#include "tensorflow/core/framework/shape_inference.h"

namespace hvd_compress {

// Output i is a vector of the op's attr sizes[i] elements (ops that cut one
// concatenation back into its parts).
inline absl::Status VectorsOfSizes(tensorflow::shape_inference::InferenceContext* c) {
  std::vector<int64_t> sizes;
  TF_RETURN_IF_ERROR(c->GetAttr("sizes", &sizes));
  for (size_t i = 0; i < sizes.size(); ++i) c->set_output(i, c->Vector(sizes[i]));
  return absl::OkStatus();
}

// The number of elements of inputs [begin, end) together (the length of their flattened concatenation), or
// kUnknownDim when one of them has an unknown number.
inline int64_t TotalNumElements(tensorflow::shape_inference::InferenceContext* c, int begin, int end) {
  int64_t total = 0;
  for (int i = begin; i < end; ++i) {
    const int64_t n = c->Value(c->NumElements(c->input(i)));
    if (n == tensorflow::shape_inference::InferenceContext::kUnknownDim) return n;
    total += n;
  }
  return total;
}

}  // namespace hvd_compress

#endif  // HVD_COMPRESS_TF_OPS_SHAPE_FNS_H_
