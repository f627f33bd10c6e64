// One observe prefill per prompt, shared by every configuration (issue 12, item 5).
//
// Configurations are different heaps, so kvgc_seq_fork cannot share a prefill across them.
// Instead the prompt is prefilled once (Engine::prefill, observe mode) in a full-cache heap:
// that prefill only caches and scores (no kvgc_step until the prompt's end, and the full
// policy's step evicts nothing). Its cache is then replayed into each configuration's
// fresh heap through the public API: kvgc_read each layer's K/V, kvgc_append them,
// kvgc_observe the scores kvgc_read_scores gave, pool them at the configuration's radius
// (the snapshot's full-cache engine pools nothing: full_config), then the one kvgc_step
// that ends an observe prefill. --check-replay compares every replay with a fresh prefill of the same
// configuration (compare_replay).
//
// Positions: the configuration's Engine has run no token, so it would rotate the next
// token's query and key (RoPE) as position 0. RoPE attention depends only on the distance
// between query and key, so the replayed keys are rotated by -n (n = the prompt's length):
// key p then sits at p - n, the engine's position 0 is the prompt's position n, and every
// distance is the fresh engine's. V, positions (kvgc's own, 0..n-1), scores and so every
// GC decision are exactly the fresh prefill's; K differs by the rounding of one extra
// rotation (and, for tokens the step stores as int4/int8, by quantizing the rotated key).
// An Engine that can resume at a position (bool resume(uint64_t position, std::string*))
// makes the replay exact: it is used automatically when the engine has it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "quality_common.hpp"

namespace quality {

struct Snapshot {
  uint64_t tokens = 0;               // the prompt's length
  std::vector<float> logits;         // its last position's logits, before any eviction
  std::vector<std::vector<uint8_t>> k, v;  // per layer, [tokens][n_kv_heads][head_dim]
  std::vector<std::vector<float>> scores;  // per layer, unpooled observe-prefill scores
};

// Prefills `prompt` in observe mode in a full-cache heap and keeps its cache. `full` is
// left at the prompt's end (its decode gives the full row).
bool take_snapshot(const Bench& bench, engine::Engine* full, const std::vector<int32_t>& prompt,
                   Snapshot* out, std::string* err);

// Fills `engine` (fresh: init()ed with the configuration's options, no token run) with the
// snapshot and runs the observe prefill's final kvgc_step. *position_offset receives what
// to add to engine->position() for the sequence's real length (n with the RoPE shift, 0
// with an engine that resumes).
bool replay(const Bench& bench, const Snapshot& snap, engine::Engine* engine,
            uint64_t* position_offset, std::string* err);

// --check-replay: the replayed cache against a fresh observe prefill of the same
// configuration, layer by layer: the same live positions, generations, scores and V
// (bit for bit), the same bytes per storage class, and K within rounding of the shift
// (quantization steps where the configuration demotes). *same false with *what saying
// the first difference.
// Whether a configuration's prefill can be replayed: kvgc_read_scores gives the accumulated
// score only, so a configuration that also ranks by a recent-attention score (0.4's
// recent_decay < 1) is prefilled afresh instead, and so is one with the reconstruction
// signal (its repeat runs on forks of the prefilled sequence: no cheaper from a snapshot).
bool replayable(const Config& config);

// Brings `engine` (fresh) to the end of the prompt's observe prefill in the configuration's
// heap: replay() when replayable, else a fresh prefill of `prompt`. *offset as replay's.
bool prefill_or_replay(const Bench& bench, const Config& config, const Snapshot& snap,
                       const std::vector<int32_t>& prompt, engine::Engine* engine,
                       uint64_t* offset, std::string* err);

bool compare_replay(const Bench& bench, const engine::Engine& replayed, uint64_t offset,
                    const engine::Engine& fresh, bool demotes, bool* same, std::string* what,
                    std::string* err);

}  // namespace quality
