// Error statuses whose message is the concatenation of its pieces, as TensorFlow's
// errors::InvalidArgument(...) and errors::Internal(...) build them; those are deprecated
// (absl::StrCat inside absl's own statuses is what they point to), and every use of them
// raised a compiler warning.
#ifndef HVD_COMPRESS_TF_OPS_STATUS_H_
#define HVD_COMPRESS_TF_OPS_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace hvd_compress {

template <typename... Pieces>
absl::Status InvalidArgument(const Pieces&... pieces) {
  return absl::InvalidArgumentError(absl::StrCat(pieces...));
}

template <typename... Pieces>
absl::Status Internal(const Pieces&... pieces) {
  return absl::InternalError(absl::StrCat(pieces...));
}

}  // namespace hvd_compress

#endif  // HVD_COMPRESS_TF_OPS_STATUS_H_
