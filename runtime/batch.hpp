// A batch: one engine step over many sequences (kvgc_batch_*). The plan (batch.cpp)
// reserves every layer's pages for the step's new tokens and lays out, per layer, the
// ops' arrays: append runs, the pages in read order with each sequence's range, the
// attention work per sequence, and the exported page table. The run calls then issue one
// op per layer over every sequence, reading those arrays (on a device: one upload at plan).
//
// Index conventions: per-(layer, sequence) arrays are layer-major, entry layer * B + i.
#pragma once

#include <cstdint>
#include <utility>

#include "../allocator/host_memory.hpp"
#include "../allocator/page_pool.hpp"
#include "../kernels/ops.hpp"

namespace kvgc {

struct SequenceState;

// The most sequences one plan takes (the device table region is sized for it).
constexpr uint32_t kMaxBatch = 1024;

struct BatchPlan : host::HostAllocated {
  struct Entry {
    SequenceState* s;
    kvgc_seq id;
    uint32_t n_new, row0;  // its rows are [row0, row0 + n_new) of the batch
    uint32_t slot, tenant; // checked before each call (the sequence may be gone)
    uint32_t scored;       // its last `scored` rows add mass (<= n_new; kvgc_batch_plan_ex)
    bool defer_step;       // KVGC_BATCH_SEQ_DEFER_STEP: kvgc_batch_step skips it
  };
  bool planned = false;   // a plan is live (not spent, not cancelled)
  bool stale = false;     // a planned segment changed since (ManagedHeap::touch): every
                          // call on the plan fails, whichever layer it names
  uint64_t serial = 0;    // the plan's serial (SequenceState::batch_mark)
  uint32_t n_rows = 0;
  host::vector<Entry> seqs;
  host::vector<uint8_t> appended;       // [L]
  host::vector<uint8_t> exported;       // [L] the layer's page arrays are written (CPU: on demand)
  host::vector<uint32_t> cnt_new, cnt_pages, tail_room, run_start;  // [L*B] the plan's counts
  host::vector<uint64_t> length, rows;  // [L*B] each segment's length and attention rows
  host::vector<uint8_t*> tail;          // [L*B] its FP16 tail page when it has room
  host::vector<uint64_t> need;          // [B] new pages per sequence, all layers
  host::vector<float> decay;            // [B] recent_decay^(scored rows)
  host::vector<std::pair<uint32_t, uint64_t>> tenant_need;  // the plan's bytes per limited tenant
  host::vector<uint64_t> epoch;         // [L*B] each segment's epoch at plan
  host::vector<uint32_t> res_off;       // [L*B + 1] into reserved
  host::vector<PageId> reserved;        // pages taken for new tokens, not yet in a table
  host::vector<uint32_t> run_off;       // [L + 1] into runs
  host::vector<uint32_t> page_off;      // [L + 1] into pages / page_offset / page_class
  // The arrays the ops and the export read: host memory from Backend::result_alloc
  // (page-locked on a device, so the one upload at plan never waits), grown as needed.
  struct Arrays {
    AppendRun* runs;
    SegPage* pages;
    AttendSeq* aseqs;       // [L*B]
    uint64_t* page_offset;  // like pages
    uint32_t* page_indptr;  // [L*(B+1)]
    uint32_t* q_indptr;     // [B+1]
    int32_t* q_pos0;        // [L*B]
    uint8_t* page_class;    // like pages
    uint64_t* kv_offset;    // like pages: where each page's K/V is (a shared page's, or its own)
  };
  Arrays host{}, dev{};     // dev: the same arrays in the heap's batch region (devices)
  uint8_t* block = nullptr;  // the host arrays' memory
  size_t block_bytes = 0;
  void* upload_event = nullptr;  // devices: the plan's upload, waited for before reuse
  bool upload_pending = false;
};

// Bytes of a plan's arrays (BatchPlan::Arrays, each 16-byte aligned, in that order) for
// n_runs runs, n_pages pages, n_layers layers and n_seqs sequences; the device region is
// sized by it for the largest plan a heap can make.
size_t batch_arrays_size(uint64_t n_runs, uint64_t n_pages, uint32_t n_layers, uint32_t n_seqs);

}  // namespace kvgc
