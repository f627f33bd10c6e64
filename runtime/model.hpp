// Model shape checks and the KV-memory arithmetic behind kvgc_kv_bytes and kvgc-plan.
#pragma once

#include "status.hpp"

namespace kvgc {

// KVGC_EINVAL naming `arg`'s field ("model->head_dim") when the shape is unusable.
Status model_validate(const kvgc_model_desc& m, const char* arg);

// Bytes for `tokens` tokens of one sequence over all layers in class `cls`:
// raw payload when page_tokens == 0, whole kvgc pages (metadata included) otherwise.
uint64_t kv_bytes(const kvgc_model_desc& m, uint64_t tokens, kvgc_storage_class cls,
                  uint32_t page_tokens);

}  // namespace kvgc
