#include "model.hpp"

#include "../kernels/page_layout.hpp"

namespace kvgc {

Status model_validate(const kvgc_model_desc& m, const char* arg) {
  const std::string a(arg);
  if (m.struct_size < sizeof(kvgc_model_desc))
    return fail(KVGC_EINVAL, a + "->struct_size is " + std::to_string(m.struct_size) +
                                 "; call kvgc_model_desc_init() first");
  if (m.n_layers == 0 || m.n_layers > 4096)
    return fail(KVGC_EINVAL, a + "->n_layers must be in 1..4096");
  if (m.n_kv_heads == 0 || m.n_kv_heads > 1024)
    return fail(KVGC_EINVAL, a + "->n_kv_heads must be in 1..1024");
  if (m.n_q_heads == 0 || m.n_q_heads % m.n_kv_heads)
    return fail(KVGC_EINVAL, a + "->n_q_heads must be a positive multiple of n_kv_heads (GQA)");
  if (m.head_dim < 2 || m.head_dim > kMaxHeadDim || m.head_dim % 2)
    return fail(KVGC_EINVAL, a + "->head_dim must be even and in 2..1024");
  const int dtype = raw_enum(m.dtype);
  if (dtype != KVGC_DTYPE_F16 && dtype != KVGC_DTYPE_BF16 && dtype != KVGC_DTYPE_F32)
    return fail(KVGC_EINVAL, a + "->dtype must be KVGC_DTYPE_F16, _BF16 or _F32");
  return Status::Ok();
}

uint64_t kv_bytes(const kvgc_model_desc& m, uint64_t tokens, kvgc_storage_class cls,
                  uint32_t page_tokens) {
  if (page_tokens == 0) {
    // K and V, every layer and kv head, and their quantisation words (int8: one 16-bit
    // scale a row; int4: a 16-bit scale/zero pair per group).
    const PageLayout L = PageLayout::make(1, 1, m.head_dim, m.dtype, cls);
    const uint64_t per_head = L.slot_stride + 2ull * L.qwords;
    return 2ull * m.n_layers * m.n_kv_heads * per_head * tokens;
  }
  const PageLayout L = PageLayout::make(page_tokens, m.n_kv_heads, m.head_dim, m.dtype, cls);
  const uint64_t pages = (tokens + page_tokens - 1) / page_tokens;
  return uint64_t(m.n_layers) * pages * L.bytes;
}

}  // namespace kvgc
