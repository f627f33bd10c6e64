/* A plain C11 program that includes only kvgc.h and drives the API on the CPU backend:
 * the proof that the header is C and that an engine written in C can embed kvgc. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvgc.h"

static int failures = 0;
#define EXPECT(cond)                                                  \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "%s:%d: EXPECT(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

enum { LAYERS = 3, KV_HEADS = 2, HEAD_DIM = 64, TOKENS = 37 };

int main(void) {
  kvgc_model_desc model;
  kvgc_heap_options opts;
  kvgc_heap* heap = NULL;
  kvgc_seq seq = 0;
  const size_t per_token = (size_t)KV_HEADS * HEAD_DIM;
  uint16_t* k = malloc(TOKENS * per_token * sizeof *k);
  uint16_t* v = malloc(TOKENS * per_token * sizeof *v);
  uint16_t* k_out = malloc(TOKENS * per_token * sizeof *k_out);
  uint16_t* v_out = malloc(TOKENS * per_token * sizeof *v_out);
  int32_t pos[TOKENS];
  uint64_t n = 0, live = 0, length = 0;
  size_t i;
  uint32_t layer;
  kvgc_stats stats;

  EXPECT(strcmp(kvgc_version(), KVGC_VERSION_STRING) == 0);
  EXPECT(kvgc_model_desc_init(&model) == KVGC_OK);
  model.n_layers = LAYERS;
  model.n_q_heads = KV_HEADS * 4;
  model.n_kv_heads = KV_HEADS;
  model.head_dim = HEAD_DIM;
  model.dtype = KVGC_DTYPE_F16;
  EXPECT(kvgc_heap_options_init(&opts) == KVGC_OK);
  opts.flags = KVGC_OPT_IGNORE_ENV;
  opts.device = KVGC_DEVICE_CPU;
  opts.budget_bytes = 4u << 20;

  EXPECT(kvgc_heap_create(&model, &opts, &heap) == KVGC_OK);
  if (!heap) {
    fprintf(stderr, "heap_create: %s\n", kvgc_errmsg(NULL));
    return 1;
  }
  EXPECT(kvgc_seq_create(heap, 0, &seq) == KVGC_OK);
  for (layer = 0; layer < LAYERS; ++layer) {
    for (i = 0; i < TOKENS * per_token; ++i) {
      k[i] = (uint16_t)(i * 7 + layer);
      v[i] = (uint16_t)(i * 13 + layer);
    }
    EXPECT(kvgc_append(heap, seq, layer, k, v, TOKENS, NULL) == KVGC_OK);
    memset(k_out, 0xff, TOKENS * per_token * sizeof *k_out);
    EXPECT(kvgc_read(heap, seq, layer, k_out, v_out, pos, TOKENS, &n, NULL) == KVGC_OK);
    EXPECT(n == TOKENS);
    EXPECT(memcmp(k, k_out, TOKENS * per_token * sizeof *k) == 0);
    EXPECT(memcmp(v, v_out, TOKENS * per_token * sizeof *v) == 0);
    EXPECT(pos[0] == 0 && pos[TOKENS - 1] == TOKENS - 1);
  }
  EXPECT(kvgc_seq_tokens(heap, seq, 1, &live, &length) == KVGC_OK);
  EXPECT(live == TOKENS && length == TOKENS);

  /* Errors are statuses with a message naming the argument. */
  EXPECT(kvgc_append(heap, seq, LAYERS, k, v, 1, NULL) == KVGC_EINVAL);
  EXPECT(strstr(kvgc_errmsg(heap), "layer") != NULL);
  EXPECT(kvgc_read(heap, seq, 0, k_out, NULL, NULL, 1, &n, NULL) == KVGC_EINVAL);
  EXPECT(n == TOKENS);
  EXPECT(kvgc_seq_destroy(heap, seq + 100) == KVGC_ENOTFOUND);

  EXPECT(kvgc_stats_init(&stats) == KVGC_OK);
  EXPECT(kvgc_get_stats(heap, &stats) == KVGC_OK);
  EXPECT(stats.live_tokens == (uint64_t)TOKENS * LAYERS);
  EXPECT(stats.sequences == 1);
  EXPECT(kvgc_heap_check(heap) == KVGC_OK);

  /* A batch step from C: one new row, appended to every layer, its page table exported
     and read through the documented layout. */
  {
    kvgc_batch* batch = NULL;
    kvgc_batch_view view;
    kvgc_page_layout layout;
    uint32_t one = 1, failed = 99;
    const uint8_t* page;
    uint32_t live_word;
    int32_t last_pos;
    EXPECT(kvgc_batch_create(heap, &batch) == KVGC_OK);
    EXPECT(kvgc_batch_plan(batch, &seq, &one, 1, &failed, NULL) == KVGC_OK);
    for (layer = 0; layer < LAYERS; ++layer)
      EXPECT(kvgc_batch_append(batch, layer, k, v, NULL) == KVGC_OK);
    memset(&view, 0, sizeof view);
    view.struct_size = sizeof view;
    EXPECT(kvgc_batch_export(batch, 0, &view) == KVGC_OK);
    memset(&layout, 0, sizeof layout);
    layout.struct_size = sizeof layout;
    EXPECT(kvgc_page_layout_get(heap, KVGC_CLASS_FP16, &layout) == KVGC_OK);
    EXPECT(layout.version == KVGC_PAGE_LAYOUT_VERSION);
    EXPECT(view.n_seqs == 1 && view.n_rows == 1 && view.q_pos0[0] == TOKENS);
    /* TOKENS + 1 tokens: the last page holds the new one, at its position. */
    EXPECT(view.page_indptr[1] == (TOKENS + layout.page_tokens) / layout.page_tokens);
    page = (const uint8_t*)view.arena_base + view.page_offset[view.page_indptr[1] - 1];
    memcpy(&live_word, page + layout.live_offset, sizeof live_word);
    memcpy(&last_pos, page + layout.pos_offset + 4 * (TOKENS % layout.page_tokens), sizeof last_pos);
    EXPECT((live_word >> (TOKENS % layout.page_tokens) & 1u) == 1u);
    EXPECT(last_pos == TOKENS);
    EXPECT(kvgc_batch_step(batch, NULL) == KVGC_OK);
    EXPECT(kvgc_batch_append(batch, 0, k, v, NULL) == KVGC_EINVAL); /* the plan is spent */
    { /* 0.6: one more row through kvgc_batch_plan_ex, unscored, its GC deferred */
      kvgc_batch_plan_options popts;
      uint32_t none = 0, defer = KVGC_BATCH_SEQ_DEFER_STEP;
      EXPECT(kvgc_batch_plan_options_init(&popts) == KVGC_OK);
      popts.scored_rows = &none;
      popts.seq_flags = &defer;
      EXPECT(kvgc_batch_plan_ex(batch, &seq, &one, 1, &popts, &failed, NULL) == KVGC_OK);
      for (layer = 0; layer < LAYERS; ++layer)
        EXPECT(kvgc_batch_append(batch, layer, k, v, NULL) == KVGC_OK);
      EXPECT(kvgc_batch_step(batch, NULL) == KVGC_OK);
    }
    kvgc_batch_destroy(batch);
  }
  EXPECT(kvgc_seq_tokens(heap, seq, LAYERS - 1, &live, &length) == KVGC_OK);
  EXPECT(live == TOKENS + 2 && length == TOKENS + 2);
  EXPECT(kvgc_seq_destroy(heap, seq) == KVGC_OK);
  EXPECT(kvgc_get_stats(heap, &stats) == KVGC_OK);
  EXPECT(stats.live_tokens == 0 && stats.slabs_free == stats.slabs_total);
  kvgc_heap_destroy(heap);
  free(k);
  free(v);
  free(k_out);
  free(v_out);
  printf("c_api_test: %d failure(s)\n", failures);
  return failures ? 1 : 0;
}
