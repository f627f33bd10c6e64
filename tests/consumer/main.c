/* A consumer of an installed kvgc: built through pkg-config and through CMake. */
#include <kvgc.h>
#include <stdio.h>

int main(void) {
  kvgc_model_desc m;
  uint64_t bytes = 0;
  kvgc_model_desc_init(&m);
  m.n_layers = 32;
  m.n_q_heads = 32;
  m.n_kv_heads = 8;
  m.head_dim = 128;
  m.dtype = KVGC_DTYPE_F16;
  if (kvgc_kv_bytes(&m, 1, KVGC_CLASS_FP16, 0, &bytes) != KVGC_OK) return 1;
  printf("kvgc %s: %llu KV bytes per token\n", kvgc_version(), (unsigned long long)bytes);
  return bytes == 131072 ? 0 : 1;
}
