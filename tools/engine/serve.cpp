#include "engine/serve.hpp"

#include <algorithm>

namespace engine {

Server::Server(BatchEngine* engine, ServeOptions options)
    : engine_(engine), options_(std::move(options)) {
  kvgc_stats s;
  kvgc_stats_init(&s);
  if (kvgc_get_stats(engine_->heap(), &s) == KVGC_OK) {
    arena_bytes_ = s.arena_bytes - s.scratch_bytes;
    header_bytes_ = s.cls_header.page_bytes;
  }
  options_.chunk_tokens = std::max(1u, options_.chunk_tokens);
  options_.max_step_tokens = std::max(1u, options_.max_step_tokens);
  options_.max_running = std::max(1u, options_.max_running);
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  kvgc_heap_get_options(engine_->heap(), &o);
  page_tokens_ = std::max(1u, o.page_tokens);
  kvgc_kv_bytes(&engine_->kv_model(), page_tokens_, KVGC_CLASS_FP16, page_tokens_, &page_bytes_);
  whole_kept_ = o.policy == KVGC_POLICY_FULL;
  // Under view a holder's demoted shared tokens become copies of its own; under cache and
  // prune its attached pages never cost it a byte but their headers.
  whole_attached_ = whole_kept_ || o.prefix_charge != KVGC_PREFIX_CHARGE_VIEW;
  if (options_.prefix_cache && options_.prefill != Engine::PrefillMode::Observe)
    config_error_ = "Server: ServeOptions::prefix_cache needs the observe prefill "
                    "(prefill = Observe): a stream prefill's GC ranks the prompt before it is "
                    "in, so kvgc_prefix_keep could never keep it";
}

Server::~Server() {
  for (const Running& r : running_) kvgc_seq_destroy(engine_->heap(), r.seq);
}

uint64_t Server::footprint(uint64_t tokens, uint64_t cached, bool prefilling) const {
  if (options_.footprint) return options_.footprint(tokens, cached, prefilling);
  uint64_t bytes = 0;  // the full cache: every page of the tokens it holds itself
  kvgc_kv_bytes(&engine_->kv_model(), tokens - cached, KVGC_CLASS_FP16, page_tokens_, &bytes);
  return bytes;
}

uint64_t Server::own_footprint(const Running& r, bool prefilling, size_t tokens) const {
  if (tokens == SIZE_MAX) tokens = r.context.size() + 1;
  const size_t paid = std::max(whole_attached_ ? r.attached / page_tokens_ * page_tokens_ : 0,
                               whole_kept_ ? r.kept / page_tokens_ * page_tokens_ : 0);
  // Plus a header page per shared page it holds, in every layer (what it attached or kept).
  const uint64_t headers = uint64_t(std::max(r.attached, r.kept) / page_tokens_) *
                           engine_->kv_model().n_layers * header_bytes_;
  return footprint(tokens, std::min(paid, tokens), prefilling) + headers;
}

const kvgc_stats* Server::heap_stats(kvgc_stats* out) const {
  kvgc_stats_init(out);
  return kvgc_get_stats(engine_->heap(), out) == KVGC_OK ? out : nullptr;
}

uint64_t Server::heap_room(const kvgc_stats* s) const {
  if (!s) return UINT64_MAX;  // the projection decides
  uint64_t growth = 0;
  for (const Running& x : running_)
    if (x.done < x.prompt_end) {
      const uint64_t now = own_footprint(x, true, x.done), end = x.footprint;
      growth += end > now ? end - now : 0;
    }
  const uint64_t room = s->free_bytes + s->cached_only_bytes;
  return room > growth ? room - growth : 0;
}

size_t Server::tokens_to_keep(const Running& r) const {
  const size_t n = r.prompt_end;
  if (whole_kept_) return n;  // no GC: the cache's pages are the sequence's anyway
  size_t common = 0;  // the longest run of ids it shares with another prompt
  auto compare = [&](const ServeRequest* from, const std::vector<int32_t>& other) {
    if (from == r.request) return;
    const size_t m = std::min(n, other.size());
    size_t i = 0;
    while (i < m && other[i] == r.context[i]) ++i;
    common = std::max(common, i);
  };
  for (size_t i = 0; i < waiting_.size() && i < kSeenPrompts; ++i) compare(waiting_[i], waiting_[i]->prompt);
  for (const auto& [from, prompt] : seen_) compare(from, prompt);
  const size_t keep = common >= n ? n : common / page_tokens_ * page_tokens_;
  return keep > r.attached ? keep : 0;
}

size_t Server::in_prompt() const {
  return size_t(std::count_if(running_.begin(), running_.end(),
                              [](const Running& x) { return x.done < x.prompt_end; }));
}

uint64_t Server::cache_held(const kvgc_stats* s) const {
  // The shared pages some running sequence holds, each once: kvgc_stats counts them
  // exactly (pages only cached prefixes hold are free: the heap evicts them for room).
  return s ? s->shared_bytes - s->cached_only_bytes : 0;
}

bool Server::submit(ServeRequest* request, std::string* err) {
  if (!config_error_.empty()) {
    if (err) *err = config_error_;
    return false;
  }
  if (request == nullptr || request->prompt.empty() || request->max_new == 0) {
    if (err) *err = "Server::submit: a request needs a non-empty prompt and max_new >= 1";
    return false;
  }
  request->done = false;
  waiting_.push_back(request);
  return true;
}

// FIFO, as vLLM: the queue's head waits until it fits, and nothing overtakes it.
bool Server::admit(double now, std::string* err) {
  while (!waiting_.empty() && waiting_.front()->arrival <= now &&
         running_.size() < options_.max_running) {
    if (options_.max_prefilling && in_prompt() >= options_.max_prefilling) break;
    ServeRequest* r = waiting_.front();
    Running run{r, 0, r->prompt, 0, 0, 0};
    run.context.insert(run.context.end(), r->output.begin(), r->output.end());
    run.prompt_end = run.context.size();
    run.footprint = footprint(run.context.size() + 1, 0, true);
    if (run.footprint > arena_bytes_) {  // could never run, even alone
      waiting_.pop_front();
      r->error = "needs " + std::to_string(run.footprint) + " bytes; the arena holds " +
                 std::to_string(arena_bytes_);
      r->done = true;
      r->finished = now;
      continue;
    }
    // Headroom: each running sequence may take a fresh page in its next step (vLLM keeps
    // a watermark of free blocks for the same reason): without it admission packs the
    // arena to its last page and the next step's growth preempts what it just admitted.
    const uint64_t headroom = uint64_t(running_.size() + 1) * page_bytes_;
    // Counted once per step (admit runs once a step): what the head waits behind.
    auto wait_for_room = [&] {
      ++stats_.waits_for_room;
      stats_.wait_head_bytes += double(run.footprint);
      for (const Running& x : running_)
        (x.done < x.prompt_end ? stats_.wait_prefill_bytes : stats_.wait_decode_bytes) += double(x.footprint);
    };
    kvgc_stats snapshot;
    if (!options_.prefix_cache && !running_.empty() &&
        (projected_ + run.footprint + headroom > arena_bytes_ ||
         run.footprint + headroom > heap_room(heap_stats(&snapshot)))) {
      wait_for_room();
      break;
    }
    const kvgc_status s = kvgc_seq_create(engine_->heap(), 0, &run.seq);
    if (s == KVGC_ENOMEM) break;  // host memory: try again next step
    if (s != KVGC_OK) {
      if (err) *err = std::string("kvgc_seq_create: ") + kvgc_status_str(s) + ": " +
                      kvgc_errmsg(engine_->heap());
      return false;
    }
    if (options_.prefix_cache) {
      // The longest cached prefix, all but the last token (it runs for the logits).
      uint64_t attached = 0;
      const kvgc_status a = kvgc_prefix_attach(engine_->heap(), run.seq, run.context.data(),
                                               run.context.size() - 1, options_.prefix_salt,
                                               &attached, nullptr);
      if (a != KVGC_OK && a != KVGC_ENOMEM && a != KVGC_EBUDGET) {  // those change nothing
        if (err) *err = std::string("kvgc_prefix_attach: ") + kvgc_status_str(a) + ": " +
                        kvgc_errmsg(engine_->heap());
        kvgc_seq_destroy(engine_->heap(), run.seq);
        return false;
      }
      run.attached = run.done = size_t(attached);
      run.footprint = own_footprint(run, true);
      const kvgc_stats* s = running_.empty() ? nullptr : heap_stats(&snapshot);
      if (!running_.empty() && (projected_ + run.footprint + cache_held(s) + headroom > arena_bytes_ ||
                                run.footprint + headroom > heap_room(s))) {
        kvgc_seq_destroy(engine_->heap(), run.seq);  // undoes the attach
        wait_for_room();
        break;
      }
      ++stats_.prefix_lookups;
      stats_.prefix_hits += attached > 0;
      stats_.prefix_tokens_attached += attached;
      r->attached = attached;
    }
    waiting_.pop_front();
    if (options_.prefix_cache && r->admitted < 0) {  // for tokens_to_keep
      if (seen_.size() == kSeenPrompts) seen_.pop_front();
      seen_.emplace_back(r, r->prompt);
    }
    if (r->admitted < 0) r->admitted = now;
    projected_ += run.footprint;
    running_.push_back(std::move(run));
  }
  return true;
}

void Server::preempt(size_t index) {
  Running& r = running_[index];
  kvgc_seq_destroy(engine_->heap(), r.seq);
  projected_ -= r.footprint;
  ++r.request->preemptions;
  ++stats_.preemptions;
  waiting_.push_front(r.request);
  running_.erase(running_.begin() + std::ptrdiff_t(index));
}

void Server::finish(size_t index, double now) {
  Running& r = running_[index];
  kvgc_seq_destroy(engine_->heap(), r.seq);
  projected_ -= r.footprint;
  r.request->done = true;
  r.request->finished = now;
  running_.erase(running_.begin() + std::ptrdiff_t(index));
}

bool Server::step(double now, std::string* err) {
  if (!admit(now, err)) return false;
  const uint32_t n_vocab = engine_->engine().model().config.n_vocab;
  const bool observe = options_.prefill == Engine::PrefillMode::Observe;
  for (;;) {
    if (running_.empty()) return true;
    // Decode rows first (one token each), then prompt chunks while the step has rows.
    items_.clear();
    item_of_.clear();
    wants_logits_.clear();
    decode_row_.clear();
    uint32_t rows = 0;
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t i = 0; i < running_.size(); ++i) {
        Running& r = running_[i];
        const size_t left = r.context.size() - r.done;
        if ((pass == 0) != (left == 1)) continue;
        const uint32_t budget = options_.max_step_tokens - std::min(rows, options_.max_step_tokens);
        if (pass == 1 && budget == 0) break;
        uint32_t n = pass == 0 ? 1u : uint32_t(std::min<size_t>({left, options_.chunk_tokens, budget}));
        BatchItem item;
        item.seq = r.seq;
        if (observe && r.done < r.prompt_end) {
          // The prompt's last kObserveTokens score; a chunk never straddles where they start.
          const size_t scored_from =
              r.prompt_end > Engine::kObserveTokens ? r.prompt_end - Engine::kObserveTokens : 0;
          if (r.done < scored_from) n = uint32_t(std::min<size_t>(n, scored_from - r.done));
          item.observe = true;
          item.scores = r.done >= scored_from;
        }
        item.tokens = r.context.data() + r.done;
        item.n = n;
        item.position = r.done;
        items_.push_back(item);
        item_of_.push_back(i);
        wants_logits_.push_back(r.done + n == r.context.size());
        decode_row_.push_back(pass == 0 && !r.request->output.empty());
        rows += n;
      }
    }
    // Logit buffers for the items that end their context.
    const size_t n_logits = size_t(std::count(wants_logits_.begin(), wants_logits_.end(), true));
    logits_.resize(n_logits * n_vocab);
    for (size_t j = 0, next = 0; j < items_.size(); ++j)
      if (wants_logits_[j]) items_[j].logits = &logits_[next++ * n_vocab];

    uint32_t failed = 0;
    const BatchEngine::Outcome outcome = engine_->step(items_, &failed, err);
    if (outcome == BatchEngine::Outcome::Failed) return false;
    if (outcome == BatchEngine::Outcome::NoRoom) {
      if (running_.size() == 1) {  // alone and still too big: it can never run here
        ServeRequest* r = running_[0].request;
        r->error = "does not fit the arena even alone (" + std::to_string(running_[0].done) +
                   " tokens cached)";
        finish(0, now);
        continue;
      }
      preempt(running_.size() - 1);  // the most recently admitted, as vLLM
      continue;
    }
    ++stats_.steps;
    stats_.running_sum += double(running_.size());
    if (!waiting_.empty() && waiting_.front()->arrival <= now) {
      ++stats_.loaded_steps;
      stats_.loaded_running_sum += double(running_.size());
    }
    stats_.max_running = std::max<uint32_t>(stats_.max_running, uint32_t(running_.size()));
    stats_.max_in_prompt = std::max<uint32_t>(stats_.max_in_prompt, uint32_t(in_prompt()));
    std::vector<size_t> finished;
    for (size_t j = 0; j < items_.size(); ++j) {
      Running& r = running_[item_of_[j]];
      ServeRequest* req = r.request;
      if (decode_row_[j]) ++stats_.decode_rows;
      else stats_.prompt_tokens += items_[j].n;
      r.done += items_[j].n;
      if (items_[j].observe && r.done == r.prompt_end) {  // the prompt is in: evict to budget
        // Keep it first: no kvgc_step has ranked it yet.
        const size_t keep = options_.prefix_cache ? tokens_to_keep(r) : 0;
        if (keep) {
          const kvgc_status k = kvgc_prefix_keep(engine_->heap(), r.seq, r.context.data(), keep,
                                                 options_.prefix_salt, 0, nullptr, nullptr);
          if (k == KVGC_OK) {
            ++stats_.prefix_keeps;
            r.kept = keep;  // under a pruning policy its GC still prunes its own view of them
          } else if (k == KVGC_EINVAL || k == KVGC_ENOMEM || k == KVGC_EBUDGET) {
            ++stats_.prefix_keep_failed;  // served as without the cache
          } else {
            if (err) *err = std::string("kvgc_prefix_keep: ") + kvgc_status_str(k) + ": " +
                            kvgc_errmsg(engine_->heap());
            return false;
          }
        }
        if (!engine_->end_observe(r.seq, err)) return false;
        const uint64_t after = own_footprint(r, false);
        projected_ = projected_ - r.footprint + after;
        r.footprint = after;
      }
      if (items_[j].logits == nullptr) continue;
      const int32_t token = argmax(items_[j].logits, n_vocab);
      if (req->first_token < 0) req->first_token = now;
      ++stats_.generated_tokens;
      const bool stop = req->stop_at_eos && std::find(options_.stop.begin(), options_.stop.end(),
                                                      token) != options_.stop.end();
      if (!stop) {  // a stop token ends the answer and is not part of it
        req->output.push_back(token);
        r.context.push_back(token);
        if (r.done >= r.prompt_end) {  // admission counts what it holds now, output included
          const uint64_t grown = own_footprint(r, false);
          projected_ = projected_ - r.footprint + grown;
          r.footprint = grown;
        }
      }
      if (stop || req->output.size() >= req->max_new) finished.push_back(item_of_[j]);
    }
    // The finished leave, highest index first.
    std::sort(finished.rbegin(), finished.rend());
    for (const size_t i : finished) finish(i, now);
    return true;
  }
}

}  // namespace engine
