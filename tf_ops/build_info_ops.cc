// HvdCompressBuildInfo: the TensorFlow version this library was compiled
// against, so hvd_compress/ops.py can refuse a library built for another one.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/public/version.h"

// setup.py passes the installed TensorFlow's version: from TF 2.19 on, the pip headers no longer
// define TF_VERSION_STRING (release_version.h expects the version from TensorFlow's own build).
#ifndef HVD_COMPRESS_TF_VERSION
#define HVD_COMPRESS_TF_VERSION TF_VERSION_STRING
#endif

namespace hvd_compress {

REGISTER_OP("HvdCompressBuildInfo")
    .Output("tensorflow_version: string")
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);

class BuildInfoOp : public tensorflow::OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(tensorflow::OpKernelContext* ctx) override {
    tensorflow::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {}, &out));
    out->scalar<tensorflow::tstring>()() = HVD_COMPRESS_TF_VERSION;
  }
};

REGISTER_KERNEL_BUILDER(
    Name("HvdCompressBuildInfo").Device(tensorflow::DEVICE_CPU), BuildInfoOp);

}  // namespace hvd_compress
