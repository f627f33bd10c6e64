// C entry points of the prefix cache: kvgc_prefix_keep, _attach, _pin and _drop.
#include <string>

#include "../runtime/heap.hpp"
#include "checks.hpp"
#include "kvgc.h"

using kvgc::fail;
using kvgc::Status;
using namespace kvgc::capi;

extern "C" {

kvgc_status kvgc_prefix_keep(kvgc_heap* heap, kvgc_seq seq, const int32_t* token_ids,
                             uint64_t n_tokens, uint64_t salt, uint32_t flags,
                             kvgc_prefix* prefix_out, void* stream) {
  return with_heap(heap, "kvgc_prefix_keep", [&](kvgc::ManagedHeap& h) -> Status {
    if (flags & ~KVGC_PREFIX_PIN)
      return fail(KVGC_EINVAL, "kvgc_prefix_keep: flags " + std::to_string(flags) + " has unknown bits");
    if (n_tokens && !token_ids) return fail(KVGC_EINVAL, "kvgc_prefix_keep: token_ids is NULL");
    return h.prefix_keep(seq, token_ids, n_tokens, salt, flags & KVGC_PREFIX_PIN, prefix_out, stream);
  }, Mutates::Yes);
}

kvgc_status kvgc_prefix_attach(kvgc_heap* heap, kvgc_seq seq, const int32_t* token_ids,
                               uint64_t n_tokens, uint64_t salt, uint64_t* n_attached_out,
                               void* stream) {
  return with_heap(heap, "kvgc_prefix_attach", [&](kvgc::ManagedHeap& h) -> Status {
    if (!n_attached_out) return fail(KVGC_EINVAL, "kvgc_prefix_attach: n_attached_out is NULL");
    if (n_tokens && !token_ids) return fail(KVGC_EINVAL, "kvgc_prefix_attach: token_ids is NULL");
    const Status st = h.prefix_attach(seq, token_ids, n_tokens, salt, n_attached_out, stream);
    // The walker only after a hit: a miss changes no page and must read none (tenants).
    if (st.ok() && *n_attached_out) debug_check(h, "kvgc_prefix_attach");
    return st;
  });
}

kvgc_status kvgc_prefix_pin(kvgc_heap* heap, kvgc_prefix prefix, int pinned) {
  return with_heap(heap, "kvgc_prefix_pin", [&](kvgc::ManagedHeap& h) {
    return h.prefix_pin(prefix, pinned != 0);
  }, Mutates::Yes);
}

kvgc_status kvgc_prefix_drop(kvgc_heap* heap, kvgc_prefix prefix) {
  return with_heap(heap, "kvgc_prefix_drop", [&](kvgc::ManagedHeap& h) {
    return h.prefix_drop(prefix);
  }, Mutates::Yes);
}

}  // extern "C"
