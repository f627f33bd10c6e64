// Built instead of cuda_backend.cpp when kvgc is configured with -Dcuda=disabled (or
// no nvcc was found): asking for CUDA is then a clear KVGC_EUNSUPPORTED.
#include "backend.hpp"

namespace kvgc {

Status make_cuda_backend(int, std::unique_ptr<Backend>*) {
  return fail(KVGC_EUNSUPPORTED,
              "this kvgc was built without CUDA (meson -Dcuda=disabled or no nvcc found)");
}

}  // namespace kvgc
