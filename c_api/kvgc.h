/**
 * @file
 * kvgc.h -- the public C ABI of kvgc, a managed heap for an LLM's KV cache.
 *
 * Glossary (docs/ARCHITECTURE.md has the long form):
 * ```
 *   heap      one model's KV memory on one device: arena + page pools + sequences.
 *   arena     the single reservation of device (or host) memory, sized by the budget.
 *   slab      a fixed-size chunk of the arena carved into pages of one storage class.
 *   page      `page_tokens` token slots of one segment, for all KV heads of its layer.
 *   class     how a slot's K/V are stored: FP16 (the model dtype), INT8 or INT4; a
 *             ladder by rank (FP16 > INT8 > INT4 > evicted), kept monotone by the GC.
 *   sequence  one request's cache; belongs to a tenant.
 *   segment   the cache of one (sequence, layer): an ordered page table of slots.
 *   slot      one token's place in a page: live bit, score, position, generation.
 * ```
 *
 * Rules every function follows:
 *   - Every function returns a kvgc_status (KVGC_OK == 0) unless it is a pure getter.
 *     On error, kvgc_errmsg() names the argument or variable at fault and the call
 *     changed nothing (one exception: a failed kvgc_heap_create sets *heap_out to
 *     NULL). No C++ exception ever crosses this ABI.
 *   - Out of memory is KVGC_ENOMEM, never a crash; the heap stays valid. That holds for
 *     any allocation of the process failing (kvgc's, the C++ runtime's), transient or
 *     persistent, with any cpu_threads: recording the error itself never allocates.
 *   - Structs that start with `struct_size` only ever grow: set struct_size to
 *     sizeof(the struct you compiled against) (the *_init functions do it); kvgc reads
 *     and writes only that many bytes, so old callers keep working with new libraries.
 *
 * Threads: a heap may be used from any number of threads; calls on one heap are
 * serialised by a lock inside the heap (different heaps never contend). The error
 * message is per thread: kvgc_errmsg() returns the message of the calling thread's
 * most recent failed call, so concurrent callers never see each other's errors.
 *
 * Streams: on the CUDA backend, functions that touch KV data take the engine's
 * cudaStream_t as `void* stream` (NULL = the legacy default stream). Pointers passed
 * with a stream are device pointers, valid on that stream; the work is enqueued on it
 * and may still run when the call returns. On the CPU backend `stream` is ignored and
 * pointers are host pointers; work is complete when the call returns.
 */
#ifndef KVGC_H
#define KVGC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(KVGC_BUILDING_SHARED)
#define KVGC_API __declspec(dllexport)
#elif defined(__GNUC__)
#define KVGC_API __attribute__((visibility("default")))
#else
#define KVGC_API
#endif

/* ---- version ------------------------------------------------------------------ */
/** This header's version: major, minor, patch, the string, and one number, major * 10000 +
 * minor * 100 + patch, to compare with kvgc_version_number(). */
/** @{ */
#define KVGC_VERSION_MAJOR 0
#define KVGC_VERSION_MINOR 14
#define KVGC_VERSION_PATCH 0
#define KVGC_VERSION_STRING "0.14.0"
#define KVGC_VERSION_NUMBER \
  (KVGC_VERSION_MAJOR * 10000 + KVGC_VERSION_MINOR * 100 + KVGC_VERSION_PATCH)
/** @} */

/** The library's version string ("0.6.0"); equals KVGC_VERSION_STRING of its build. */
KVGC_API const char* kvgc_version(void);
/** The library's KVGC_VERSION_NUMBER, to compare against the header's at run time. */
KVGC_API int kvgc_version_number(void);

/* ---- status ------------------------------------------------------------------- */
/** What every function returns, unless it is a pure getter (the rules above). */
typedef enum kvgc_status {
  KVGC_OK = 0,           /**< success */
  KVGC_EINVAL = 1,       /**< an argument or environment variable is malformed */
  KVGC_ENOMEM = 2,       /**< the arena (or host memory) has no room; nothing changed */
  KVGC_EBUDGET = 3,      /**< a budget cannot be met (every token protected, quota) */
  KVGC_ENOTFOUND = 4,    /**< unknown or destroyed sequence */
  KVGC_EDEVICE = 5,      /**< the device (CUDA) reported an error; the message has it */
  KVGC_EUNSUPPORTED = 6, /**< valid request this build or backend cannot do */
  KVGC_EINTERNAL = 7     /**< an invariant is broken (kvgc_heap_check); a kvgc bug */
} kvgc_status;

/** A static name for a status: "KVGC_OK", "KVGC_EINVAL", ...; "KVGC_E?" if unknown. */
KVGC_API const char* kvgc_status_str(int status);

/* ---- enums -------------------------------------------------------------------- */
/** The model's K/V element type (kvgc_model_desc.dtype). */
typedef enum kvgc_dtype {
  KVGC_DTYPE_F16 = 0,  /**< IEEE half */
  KVGC_DTYPE_BF16 = 1, /**< bfloat16 */
  KVGC_DTYPE_F32 = 2   /**< float */
} kvgc_dtype;

/** The backend a heap runs on (kvgc_heap_options.device). */
typedef enum kvgc_device {
  KVGC_DEVICE_AUTO = 0, /**< CUDA when a device answers, else CPU */
  KVGC_DEVICE_CPU = 1,  /**< host memory and threads */
  KVGC_DEVICE_CUDA = 2  /**< a CUDA device (kvgc_heap_options.cuda_device) */
} kvgc_device;

/** Storage classes, a ladder by rank: FP16 > INT8 > INT4 > INT2 > evicted. FP16 stores
 * K/V in the model dtype (f16, bf16, or f32 for f32 models); INT8 one signed byte per
 * element with a symmetric scale per slot and head (added in 0.4); INT4 packed nibbles
 * with a scale and zero per group of 32 elements (or the whole head) per slot and head;
 * INT2 (added in 0.10, only on KVGC_DEMOTE_LADDER_INT2's ladder) INT4's code with two
 * bits an element, four a byte. New tokens are always stored FP16; demotion
 * (kvgc_demote) moves them down the ladder. Read order (kvgc_read, kvgc_observe) is a
 * segment's FP16 pages, then INT4, then INT8, then INT2 (the enum's order), live slots
 * in slot order. KVGC_CLASS_COUNT was 3 before 0.10: kvgc_stats.tokens_demoted_to keeps
 * its 3 entries, and INT2's figures are fields of their own. */
typedef enum kvgc_storage_class {
  KVGC_CLASS_FP16 = 0,  /**< the model dtype */
  KVGC_CLASS_INT4 = 1,  /**< packed nibbles, a scale and zero per group */
  KVGC_CLASS_INT8 = 2,  /**< a signed byte an element, a scale per slot and head */
  KVGC_CLASS_INT2 = 3,  /**< INT4's code in two bits (added in 0.10) */
  KVGC_CLASS_COUNT = 4  /**< the number of classes (3 before 0.10) */
} kvgc_storage_class;

/** Eviction policies: one GC mechanism with different priority keys (docs/ARCHITECTURE.md,
 * "Policies, tiers and budgets"). */
typedef enum kvgc_policy {
  KVGC_POLICY_GENERATIONAL = 0, /**< tiers (kvgc_generation), minor and major GCs */
  KVGC_POLICY_FULL = 1,         /**< never collects: keeps every token */
  KVGC_POLICY_STREAMING = 2,    /**< ranks by position */
  KVGC_POLICY_H2O = 3,          /**< ranks by accumulated attention score */
  KVGC_POLICY_RANDOM = 4        /**< ranks by a seeded hash (kvgc_heap_options.seed) */
} kvgc_policy;

/** The rungs of the storage ladder a GC may demote to before it evicts (KVGC_DEMOTE).
 * A collection ranks its candidates by the policy's key and gives every one the class its
 * rank earns: the top stay FP16, the next are stored INT8, then INT4, the lowest are
 * evicted, so that no token in a cheaper class outranks one in a dearer class after the
 * decision (monotone; docs/ARCHITECTURE.md gives the rule that sets the bands). A class
 * that would save too little for the model's head_dim is dropped (KVGC_VERBOSE says so). */
typedef enum kvgc_demote {
  KVGC_DEMOTE_OFF = 0,    /**< FP16 -> evicted */
  KVGC_DEMOTE_INT4 = 1,   /**< FP16 -> INT4 -> evicted */
  KVGC_DEMOTE_INT8 = 2,   /**< FP16 -> INT8 -> evicted (added in 0.4) */
  KVGC_DEMOTE_LADDER = 3, /**< FP16 -> INT8 -> INT4 -> evicted (added in 0.4) */
  KVGC_DEMOTE_LADDER_INT2 = 4 /**< FP16 -> INT8 -> INT4 -> INT2 -> evicted (added in 0.10) */
} kvgc_demote;

/** When the host applies a GC's page-level results (live counts per page; kvgc_step).
 * DEFERRED: at the sequence's next kvgc_step, or earlier where exact counts are needed
 * (kvgc_read, kvgc_read_scores, kvgc_observe, kvgc_seq_tokens, kvgc_get_stats,
 * kvgc_heap_check, tenant calls, destruction, a page allocation that would fail), so a
 * step only enqueues and never waits for the device. Which tokens die is decided by the
 * device at the step either way; only the host's bookkeeping (freeing emptied pages,
 * compaction, statistics, KVGC_EBUDGET) follows later.
 * IMMEDIATE: within the same kvgc_step (on CUDA it synchronises its stream once per
 * segment that collects). */
typedef enum kvgc_harvest {
  KVGC_HARVEST_DEFERRED = 0,  /**< DEFERRED above (the default) */
  KVGC_HARVEST_IMMEDIATE = 1  /**< IMMEDIATE above */
} kvgc_harvest;

/** Who pays for the tokens a sequence attached from the prefix cache (0.7;
 * KVGC_PREFIX_CHARGE=shrink|cache|view). Which to choose: SHRINK (the default since
 * 0.15) to serve the most requests in a given memory; CACHE when a shared prompt must
 * never be pruned (its attention exact for every holder); VIEW to test that sharing
 * changes nothing (an attached sequence as one that appended the prompt).
 * SHRINK (0.13; the default since 0.15, CACHE before): each holder prunes the attached
 * tokens as its own and pays for those it keeps, at the cache's bytes. Its GC ranks,
 * evicts and demotes them as VIEW's does, so it decides as one that appended the prompt
 * itself (where ranking keys do not tie), but a shared token it demotes keeps its slot
 * and stays readable at its page's precision; it is only charged at the cheaper class
 * (recorded in its gen byte, bits 6-7: see the page layout). So the sequence holds only
 * its own tokens' bytes (plus a header page per shared page) and pays for the prefix
 * tokens it keeps as if it held them. And the shared pages shrink with their holders: a
 * shared page (FP16) whose every holder counts each of its live slots at the ladder's
 * first rung below FP16 (INT8 with the default ladder; INT4 when it is the only rung) or
 * cheaper, or has evicted them, is re-stored once at that rung: its bytes shrink (FP16 to
 * INT8: about half) and its holders read it there. A page no holder holds any more
 * (every holder evicted its slots, so only cached prefixes keep it) shrinks too, once a
 * holder has judged it so. A later attach reads the shrunk page at its class. A holder
 * reads a demoted shared token at its page's precision, or at the rung it is charged at
 * once the page shrank; a new holder reads shrunk pages at their class from the start.
 * Without a rung below FP16 (kvgc_demote OFF) no page shrinks. kvgc_seq_fork pins
 * nothing new: the copy is charged exactly as its source, so it decides as the copy it
 * replaces. Served against pruning alone, on 24 requests over a shared 1K-token prefix:
 * 1.61-1.65x the mean concurrency, every pass key the full cache answers
 * (docs/PERF.md, "serving with the prefix cache"). kvgc_stats.pages_shrunk counts the
 * pages re-stored.
 * CACHE: the cache. The whole pages a sequence attaches stay whole in its view for its
 * life: its GC never ranks, evicts or demotes them, and its budgets are spent only on the
 * tokens it holds itself (a budget fraction is still of its whole length, so a sequence
 * never keeps fewer of its own tokens than it would unshared). The prefix's bytes are
 * held once, whatever the number of sequences.
 * VIEW: the sequence, as if it had appended them: its budgets count every token it keeps
 * and its GC prunes the attached tokens like its own (a demoted shared token becomes a
 * private copy at the cheaper rung), so an attached sequence makes the decisions of one
 * that appended the prompt itself (where ranking keys do not tie) and reads the same
 * tokens at the same precision. Not always in the same order: compaction moves only a
 * sequence's private pages, so the attached sequence reads its live tokens in another
 * order once the other has compacted its prompt pages, and its attention outputs and
 * scores may differ in the last bits (float sums in another order: scores under 1e-5
 * relative, outputs within two roundoffs of the dtype;
 * tests/test_prefix.cpp, "charged to the view").
 * PRUNE (0.8, retired in 0.15): SHRINK without re-storing pages. The value stays valid: a
 * heap given it runs SHRINK, and kvgc_heap_get_options reports SHRINK. */
typedef enum kvgc_prefix_charge {
  KVGC_PREFIX_CHARGE_CACHE = 0,  /**< CACHE above (the default before 0.15) */
  KVGC_PREFIX_CHARGE_VIEW = 1,   /**< VIEW above */
  KVGC_PREFIX_CHARGE_PRUNE = 2,  /**< retired in 0.15: runs as SHRINK */
  KVGC_PREFIX_CHARGE_SHRINK = 3  /**< SHRINK above (added in 0.13; the default since 0.15) */
} kvgc_prefix_charge;

/** Token generations (tiers): sinks and the young window are never evicted. */
typedef enum kvgc_generation {
  KVGC_GEN_SINK = 0,         /**< a sequence's first `sinks` tokens */
  KVGC_GEN_YOUNG = 1,        /**< the young window: its newest tokens */
  KVGC_GEN_INTERMEDIATE = 2, /**< tenured out of the window; ranked by recent score */
  KVGC_GEN_LONG_TERM = 3,    /**< promoted heavy hitters; ranked by accumulated score */
  KVGC_GEN_COUNT = 4         /**< the number of generations */
} kvgc_generation;

/** How a segment budget is split across layers (kvgc_heap_options.layer_budget). */
typedef enum kvgc_layer_budget {
  KVGC_LAYER_BUDGET_UNIFORM = 0, /**< the same for every layer */
  KVGC_LAYER_BUDGET_PYRAMID = 1, /**< PyramidKV: more for lower layers, same total */
  KVGC_LAYER_BUDGET_ENTROPY = 2  /**< in proportion to per-layer weights (measured attention
                                    entropy: kvgc-run --profile), same total */
} kvgc_layer_budget;

/* ---- model -------------------------------------------------------------------- */
/** The shape of the KV cache. K/V tensors handed to kvgc are [tokens][n_kv_heads]
 * [head_dim] in `dtype`, row-major. */
typedef struct kvgc_model_desc {
  size_t struct_size;  /**< sizeof(kvgc_model_desc) (kvgc_model_desc_init sets it) */
  uint32_t n_layers;   /**< layers this heap holds (kvgc_heap_options.total_layers) */
  uint32_t n_q_heads;  /**< a multiple of n_kv_heads (GQA); used by attention */
  uint32_t n_kv_heads; /**< K/V heads per layer */
  uint32_t head_dim;   /**< even, 2..1024 */
  kvgc_dtype dtype;    /**< the K/V element type */
} kvgc_model_desc;

/** Zeroes *desc and sets struct_size. Returns KVGC_EINVAL on NULL. */
KVGC_API kvgc_status kvgc_model_desc_init(kvgc_model_desc* desc);

/** KV bytes `tokens` tokens of one sequence take across all layers, stored in class
 * `cls`. With page_tokens == 0: the raw K/V payload (what any engine stores). With
 * page_tokens > 0: what kvgc holds for them, whole pages with their slot metadata. */
KVGC_API kvgc_status kvgc_kv_bytes(const kvgc_model_desc* model, uint64_t tokens,
                                   kvgc_storage_class cls, uint32_t page_tokens,
                                   uint64_t* bytes_out);

/* ---- heap options ------------------------------------------------------------- */
#define KVGC_OPT_IGNORE_ENV 0x1u /**< flags: the struct is final; KVGC_* is not read */

/** Heap options. kvgc_heap_options_init() fills the defaults listed beside each field.
 * Precedence: KVGC_* environment variables > these fields > defaults, because the
 * environment is the operator's override; set KVGC_OPT_IGNORE_ENV to opt out. */
typedef struct kvgc_heap_options {
  size_t struct_size;      /**< sizeof(kvgc_heap_options) (set by the init) */
  uint32_t flags;          /**< KVGC_OPT_* */
  kvgc_device device;      /**< AUTO: the backend */
  int cuda_device;         /**< 0: CUDA device ordinal */
  uint64_t budget_bytes;   /**< 0: use budget_fraction. Arena size, rounded down to slabs */
  double budget_fraction;  /**< 0.5: fraction of free device (or host) memory */
  kvgc_policy policy;      /**< GENERATIONAL: the eviction policy */
  uint64_t token_budget;   /**< 0: none. Live tokens per segment, absolute */
  double token_budget_fraction; /**< 0: none. Live tokens per segment / sequence length */
  uint32_t sinks;          /**< 4: the first tokens, never evicted (KVGC_GEN_SINK) */
  uint32_t window;         /**< 32 (0.4; 64 before): the young window, never evicted; under
                            * a byte budget at most window, see window_min (0.9) */
  uint32_t page_tokens;    /**< 16: slots per page, 1..256 */
  double compact_threshold;/**< 0.25: segment fragmentation that triggers compaction */
  kvgc_demote demote;      /**< LADDER (0.4; OFF before): int8, then int4, then eviction */
  kvgc_layer_budget layer_budget; /**< UNIFORM: the split across layers */
  double score_noise;      /**< 0: Laplace scale on ranking scores; 0 = off */
  uint64_t seed;           /**< 0x6b766763: of score_noise and the random policy */
  uint32_t slab_bytes;     /**< 0 (0.11; 2 MiB before): chosen by the heap (kvgc_heap_get_options
                              reports it): 8 fp16 pages rounded up to 64 KiB, in whole fp16
                              pages, for a heap that demotes (memory moves between classes a slab at a time, so
                              small slabs let the ladder's cheaper classes find room),
                              else 2 MiB; or 64 KiB..1 GiB. Grown to hold an fp16 page */
  int verbose;             /**< 0: 1 prints the effective configuration to stderr */
  /** @name Layer weights
   * KVGC_LAYER_BUDGET_ENTROPY: one weight per layer (> 0, finite), copied at creation.
   * KVGC_LAYER_BUDGET=entropy:FILE reads them from FILE (one number a line, '#' comments). */
  /** @{ */
  const float* layer_weights; /**< NULL */
  uint32_t n_layer_weights;   /**< 0 */
  /** @} */
  kvgc_harvest harvest;       /**< DEFERRED (added in 0.2, in what was tail padding) */
  /** 1 (added in 0.3): threads the CPU backend's attention uses, the calling thread
   * included, 1..256 (KVGC_THREADS=N|auto). The heap starts cpu_threads - 1 workers at
   * its first attention (fewer if the system refuses threads) and splits the live tokens
   * of segments of at least 512 among them; results differ from one thread's only by
   * summation order. 1, the default, runs everything on the calling thread: engines
   * usually own their cores (and their BLAS threads), and oversubscription hurts.
   * Accepted and ignored by the CUDA backend. */
  uint32_t cpu_threads;
  /** @name Byte budget
   * Added in 0.4. A byte budget per segment, against which every storage class counts
   * what its pages really hold: the whole pages a segment keeps, slot metadata and the
   * partly filled tail page of each class included (KVGC_BYTE_BUDGET=64K|0.1|10%).
   * byte_budget: bytes, absolute. byte_budget_fraction: a fraction of the full cache's
   * raw K/V payload in the model dtype for the sequence's length (tokens x n_kv_heads x
   * head_dim x 2 x dtype bytes), which is what an engine keeping every token holds. Split
   * across layers as the token budget is (layer_budget). With both a token and a byte
   * budget, the tighter one rules. A collection meets it exactly: after the results of a
   * kvgc_step are applied (the next step with KVGC_HARVEST=deferred, the same step with
   * immediate) each segment holds at most its byte budget of pages, plus what was
   * appended since, unless its protected tokens alone need more (KVGC_EBUDGET). */
  /** @{ */
  uint64_t byte_budget;          /**< 0: none */
  double byte_budget_fraction;   /**< 0: none */
  /** @} */
  /** Added in 0.4: the per-query decay of every token's recent-attention score, in (0, 1]
   * (KVGC_RECENT_DECAY). Each scoring query multiplies it by recent_decay before adding
   * the token's mass (a chunk of n queries: recent_decay^n). The generational policy
   * ranks its intermediate tier by it and its long-term tier by the accumulated score;
   * 1 makes the two the same (H2O's). */
  double recent_decay;           /**< 0.95 */
  /** @name Pipeline parallelism
   * Added in 0.5: pipeline parallelism. The heap holds layers [first_layer, first_layer +
   * model->n_layers) of a model of total_layers layers (0: model->n_layers, the whole
   * model), so each pipeline rank runs a heap of its own. Every `layer` argument of the
   * API stays local (0 .. model->n_layers - 1); layer budgets (uniform, pyramid, entropy:
   * layer_weights then holds total_layers weights, a profile file total_layers lines) and
   * the random policy's draws are indexed by the global layer, so the ranks' heaps make
   * exactly the decisions one heap over every layer makes. Nothing crosses ranks. */
  /** @{ */
  uint32_t first_layer;          /**< 0 */
  uint32_t total_layers;         /**< 0: model->n_layers */
  /** @} */
  /** Added in 0.7: kvgc_prefix_charge above. */
  kvgc_prefix_charge prefix_charge; /**< SHRINK (CACHE before 0.15) */
  /** Added in 0.9 (KVGC_WINDOW_MIN): the young window scales with a byte budget. With a
   * byte budget set, a segment's young window is an eighth of its budget counted in fp16
   * tokens (its token budget, if tighter, counts too), never more than `window` and never
   * less than window_min: at 5% of a 1K-token prompt the sinks and a 32-token window took
   * most of the budget. window_min >= window keeps the window fixed (0.8 and before);
   * without a byte budget the window is always `window`. 0..16777216. In what was tail
   * padding, as harvest was in 0.2. */
  uint32_t window_min;              /**< 8 */
  /** Added in 0.14 (KVGC_MIN_LENGTH): a sequence shorter than this many tokens is never
   * pruned: no budget (token or byte, absolute or a fraction) applies to it, so nothing
   * is evicted or demoted and a short chat keeps every token at fp16. From min_length
   * tokens on the budgets apply as set. 25% of a 39-token chat prompt is 10 tokens, which
   * the sinks and the window fill: the question was gone before the answer's first word,
   * for bytes that matter to no one. 0 turns the rule off (budgets from the first token:
   * what kvgc's own benchmarks of short prompts ask for). 0..2^31. */
  uint32_t min_length;              /**< 256 */
} kvgc_heap_options;

/** sizeof(kvgc_heap_options) of 0.2 (no cpu_threads), 0.3 (no byte budget) and 0.4 (no
 * layer range), still accepted by kvgc_heap_create and kvgc_heap_get_options. */
/** @{ */
#define KVGC_HEAP_OPTIONS_0_2_SIZE (offsetof(kvgc_heap_options, cpu_threads))
#define KVGC_HEAP_OPTIONS_0_3_SIZE (offsetof(kvgc_heap_options, byte_budget))
#define KVGC_HEAP_OPTIONS_0_4_SIZE (offsetof(kvgc_heap_options, first_layer))
/** @} */
/** ... and of 0.5 and 0.6 (no prefix_charge). (window_min took what was tail padding in
 * 0.7 and 0.8, so their size is 0.9's: their kvgc_heap_options_init sets it.) */
#define KVGC_HEAP_OPTIONS_0_6_SIZE (offsetof(kvgc_heap_options, prefix_charge))
/** ... and of 0.9 to 0.13 (no min_length: they get 0.14's default, 256). */
#define KVGC_HEAP_OPTIONS_0_13_SIZE (offsetof(kvgc_heap_options, min_length))

/** Fills *opts with the defaults and sets struct_size. Returns KVGC_EINVAL on NULL. */
KVGC_API kvgc_status kvgc_heap_options_init(kvgc_heap_options* opts);

/* ---- heap --------------------------------------------------------------------- */
/** A heap (opaque): one model's KV memory on one device. */
typedef struct kvgc_heap kvgc_heap;

/** Creates a heap for `model`, reserving its whole arena now (one cudaMalloc on CUDA).
 * opts == NULL means defaults, then environment. A malformed KVGC_* variable fails
 * with KVGC_EINVAL naming it and its accepted forms. On any failure *heap_out is set
 * to NULL (heap_out itself NULL: KVGC_EINVAL), so kvgc_heap_destroy on it is a no-op. */
KVGC_API kvgc_status kvgc_heap_create(const kvgc_model_desc* model,
                                      const kvgc_heap_options* opts,
                                      kvgc_heap** heap_out);
/** Frees every sequence and the arena. NULL is a no-op. The caller must have no work
 * using the heap's memory still pending on any stream, and no other call on this heap
 * may run concurrently with it or start after it: destroy takes no lock (the lock dies
 * with the heap), and a handle used after destroy points to freed memory. Destroying
 * twice is undefined for the same reason (the magic check catches it only while the
 * memory has not been reused). */
KVGC_API void kvgc_heap_destroy(kvgc_heap* heap);

/** The calling thread's last error message for `heap` (any heap if NULL), or "" if
 * its last call succeeded. Valid until this thread's next kvgc call. Never NULL. */
KVGC_API const char* kvgc_errmsg(const kvgc_heap* heap);

/** The effective options (after environment) and the backend actually in use. */
KVGC_API kvgc_status kvgc_heap_get_options(const kvgc_heap* heap, kvgc_heap_options* out);

/** Walks every invariant: slab and page free lists, page ownership, per-page and
 * per-segment live counts against the slot metadata, statistics. KVGC_OK or
 * KVGC_EINTERNAL with the first violation. Synchronises the device (a debug tool). */
KVGC_API kvgc_status kvgc_heap_check(kvgc_heap* heap);

/* ---- sequences ---------------------------------------------------------------- */
typedef uint64_t kvgc_seq; /**< A sequence: never 0; never reused within a heap */

/** A new, empty sequence of `tenant` (kvgc_tenant_set_limit); its handle in *seq_out. */
KVGC_API kvgc_status kvgc_seq_create(kvgc_heap* heap, uint32_t tenant, kvgc_seq* seq_out);
/** Frees the sequence's pages at once: pending stream work must not still use them. */
KVGC_API kvgc_status kvgc_seq_destroy(kvgc_heap* heap, kvgc_seq seq);
/** A new sequence of `tenant` holding a copy of seq's cache: every segment's tokens (K/V,
 * positions, scores, generations, storage class) and GC state, so that the two continue
 * independently (parallel sampling, beam search, one prompt shared by several
 * continuations). Since 0.7 the copy shares seq's pages (no K/V byte is copied): each
 * sequence gets a header page per page (its own live bits, positions, scores and
 * generations, a few hundred bytes; copies enqueued on `stream`), and whichever first
 * writes into a partly filled shared tail copies that one page (copy-on-write). The
 * shared pages stay charged to the tenant that created them; the new sequence's tenant is
 * charged its header pages. What a fork costs: the first fork of a sequence takes two
 * header pages per page (seq's and the copy's), each later one one; a header page is a
 * page's bytes before its K/V (kvgc_page_layout's k_offset: 2% of an fp16 page for
 * SmolLM2 at 16 tokens a page). When the last fork goes, seq takes its pages back as its
 * own at its next kvgc_step (or batch plan) and its header pages go back to the pool
 * (0.15; kvgc_stats.pages_unshared; a page seq's ladder charged below its class in place,
 * under KVGC_PREFIX_CHARGE=shrink, stays shared until that token goes). All or nothing: KVGC_ENOMEM when the header pages do not fit
 * (after applying pending GC results, evacuating sparse slabs and evicting cached
 * prefixes: see "Room" below), KVGC_EBUDGET past a
 * tenant's quota; *seq_out is written only on success. Added in 0.2. */
KVGC_API kvgc_status kvgc_seq_fork(kvgc_heap* heap, kvgc_seq seq, uint32_t tenant,
                                   kvgc_seq* seq_out, void* stream);

/** Appends n_tokens tokens to segment (seq, layer). k and v are [n_tokens][n_kv_heads]
 * [head_dim] in the model dtype, on the heap's device. Positions continue from the
 * segment's length. All or nothing: KVGC_ENOMEM if the pages do not fit, after applying
 * every pending GC result (kvgc_harvest) and compacting this segment if fragmented. */
KVGC_API kvgc_status kvgc_append(kvgc_heap* heap, kvgc_seq seq, uint32_t layer,
                                 const void* k, const void* v, uint32_t n_tokens,
                                 void* stream);

/** Live and total appended tokens of a segment (host-side counts; applies a pending GC's
 * results first, waiting for them on CUDA: see kvgc_harvest). */
KVGC_API kvgc_status kvgc_seq_tokens(kvgc_heap* heap, kvgc_seq seq, uint32_t layer,
                                     uint64_t* live_out, uint64_t* length_out);

/** Gathers segment (seq, layer)'s live K/V, dense, in slot order, into k_out/v_out
 * ([n][n_kv_heads][head_dim], model dtype, heap's device) and their positions into
 * pos_out (int32, heap's device). Any output may be NULL. *n_out (host) receives the
 * live count; if capacity is smaller, KVGC_EINVAL and nothing is written but *n_out. */
KVGC_API kvgc_status kvgc_read(kvgc_heap* heap, kvgc_seq seq, uint32_t layer, void* k_out,
                               void* v_out, int32_t* pos_out, uint64_t capacity,
                               uint64_t* n_out, void* stream);

/* ---- the prefix cache (0.7) ------------------------------------------------------- */
/** Prompt caching with pruning. A sequence that has just appended a prompt (every layer
 * holds exactly its n_tokens tokens, before any kvgc_step ranked them) can keep it as a
 * cached prefix: its pages become shared (no K/V byte is copied) and stay in the heap,
 * indexed by a chain of hashes of the token ids, one per page (a prefix matches page by
 * page). A later sequence attaches to the longest cached prefix of its own token ids in
 * O(pages), copying no K/V byte, and appends only the rest. Every holder keeps its own
 * live bits, scores and generations (a header page per shared page), so each one's GC
 * prunes its own view and touches no shared byte; a shared page goes back to the pool
 * when nothing holds it.
 *
 * Visibility: with salt 0 a prefix is found only by sequences of the keeper's tenant;
 * with a salt, by any sequence that passes the same salt, whatever its tenant (vLLM's
 * cache_salt). A lookup that does not match reads no byte of any page.
 *
 * Room: when the arena is short (an append, a plan, a fork, a demotion), cached prefixes
 * that are not pinned are evicted in least-recently-used order before anything returns
 * KVGC_ENOMEM; evicting one frees the pages no sequence holds. Since 0.10.3 only a prefix
 * holding such a page is evicted: one whose pages all have holders stays findable (its
 * eviction would free no byte, and the next request would prefill its tokens again).
 * Since 0.12 evacuation comes first: sparse slabs of the other storage classes are emptied
 * by copying their pages (device to device, enqueued on the call's stream) into their
 * classes' other slabs, and go back to the arena. Pages move, tokens do not: what any
 * sequence or prefix reads is unchanged. It never runs while a batch plan is live, so an
 * engine's exported page offsets stay valid for the plan's life (kvgc_stats:
 * pages_migrated, slabs_evacuated). */
typedef uint64_t kvgc_prefix; /**< A cached prefix: never 0; never reused within a heap */

#define KVGC_PREFIX_PIN 1u /**< kvgc_prefix_keep flags: never evicted for room */

/** Keeps seq's cache of token_ids[0, n_tokens) (host int32, the ids the engine appended)
 * as a cached prefix visible per `salt` (above), and writes its handle to *prefix_out
 * (may be NULL). n_tokens is seq's length, or (0.7.1) a multiple of page_tokens below
 * it: the first whole pages only, e.g. the part of a prompt that other prompts share, so
 * that the rest stays seq's own to prune. seq continues unchanged (its header pages are
 * written on `stream`). Since 0.10.2 no page is kept twice: a page of seq whose ids a
 * cached prefix visible to it (the same tenant, or the same salt) already holds at the
 * same place (prompts prefilled side by side each computed their own copy) is read from
 * that prefix's page from then on, and seq's copy goes back to the pool; seq's view
 * (live bits, scores, positions) is unchanged. If the same ids are already cached with
 * the same visibility, that prefix's handle is returned (flags still apply) and seq reads
 * its pages (when their header pages fit; else seq keeps its copy).
 * KVGC_EINVAL when n_tokens is 0, above a layer's length or below it and not a multiple
 * of page_tokens, or when a kvgc_step already ranked seq's tokens (keep a prompt right
 * after appending it);
 * KVGC_ENOMEM when the header pages do not fit; KVGC_EBUDGET past seq's tenant quota. */
KVGC_API kvgc_status kvgc_prefix_keep(kvgc_heap* heap, kvgc_seq seq, const int32_t* token_ids,
                                      uint64_t n_tokens, uint64_t salt, uint32_t flags,
                                      kvgc_prefix* prefix_out, void* stream);
/** Attaches the longest cached prefix of token_ids[0, n_tokens) visible to seq's tenant
 * and `salt` to seq, which must hold no token yet: whole pages, plus a cached prefix's
 * partly filled last page when all its tokens match. *n_attached_out receives the tokens
 * attached (0 when nothing matched: seq is unchanged); the engine appends
 * token_ids[*n_attached_out, n_tokens) itself. seq then holds what appending those
 * tokens' K/V would have given it (positions, sinks, generations, no score) and goes on
 * as any sequence: its first write into a shared partly filled page copies that page.
 * Header pages are written on `stream`. KVGC_ENOMEM / KVGC_EBUDGET (seq's tenant pays its
 * header pages) change nothing. */
KVGC_API kvgc_status kvgc_prefix_attach(kvgc_heap* heap, kvgc_seq seq, const int32_t* token_ids,
                                        uint64_t n_tokens, uint64_t salt,
                                        uint64_t* n_attached_out, void* stream);
/** Pins (nonzero) or unpins a cached prefix: a pinned one is never evicted for room. */
KVGC_API kvgc_status kvgc_prefix_pin(kvgc_heap* heap, kvgc_prefix prefix, int pinned);
/** Drops a cached prefix now: the pages no sequence holds go back to the pool. */
KVGC_API kvgc_status kvgc_prefix_drop(kvgc_heap* heap, kvgc_prefix prefix);

/* ---- tenants ---------------------------------------------------------------------- */
/** A per-tenant quota on the pages its sequences hold (bytes, every storage class; a
 * shared page counts once, for the tenant whose sequence created it, and each holder's
 * header pages for the holder's tenant);
 * 0 removes it. An append that would take the tenant past it fails with KVGC_EBUDGET and
 * changes nothing; demotion stays within it. A tenant's GC only ever touches its own
 * sequences, so no tenant can evict another's tokens. Lowering a limit below current
 * usage evicts nothing; it only refuses further growth. */
KVGC_API kvgc_status kvgc_tenant_set_limit(kvgc_heap* heap, uint32_t tenant, uint64_t max_bytes);
/** Bytes of pages the tenant's sequences hold now, and its limit (0 = none). */
KVGC_API kvgc_status kvgc_tenant_usage(kvgc_heap* heap, uint32_t tenant, uint64_t* bytes_out,
                                       uint64_t* limit_out);

/* ---- the GC ----------------------------------------------------------------------- */
/** Hands in the attention mass each live slot of segment (seq, layer) received this step:
 * mass[i] (float32, heap's device) belongs to the i-th row kvgc_read would return, and n
 * must equal the segment's live count. The order kvgc_read (or kvgc_read_scores,
 * kvgc_read_classes) returned holds until this sequence's next kvgc_append, kvgc_observe
 * or kvgc_step on that segment: no call on another sequence, from any thread, reorders
 * it (0.14; before, a step of another holder of shared pages under
 * KVGC_PREFIX_CHARGE_SHRINK could). Mass accumulates into each token's score, the
 * signal h2o and generational rank by. For engines that compute attention themselves.
 * Values are clamped, not rejected (on CUDA they are read on the device): a mass that
 * is NaN, +-infinite or not positive adds nothing, and a score saturates at FLT_MAX, so
 * scores stay finite and >= 0. kvgc_attend's fused mass follows the same rule. */
KVGC_API kvgc_status kvgc_observe(kvgc_heap* heap, kvgc_seq seq, uint32_t layer,
                                  const float* mass, uint64_t n, void* stream);

/** The end of one engine step for a sequence: runs, for each of its segments, what the
 * policy says is due: a GC (generational: a minor GC every page_tokens new tokens, a
 * major one when the minor cannot meet the budget; flat policies: whenever over budget),
 * freeing every page left without a live token, then compaction when a segment's
 * fragmentation passes compact_threshold. Evicted tokens disappear from kvgc_read;
 * demoted ones read back dequantized. KVGC_EBUDGET when a segment stays over its budget
 * because the protected tokens alone (sinks, young window) exceed it: advisory, nothing
 * is lost, and the next step proceeds.
 * Results (opts->harvest, KVGC_HARVEST): the GC's decision runs on the device, enqueued
 * on `stream`; its page-level results (live counts per page, a few bytes each) come back
 * asynchronously. DEFERRED (default): they are applied at the sequence's next kvgc_step
 * (or a call that needs exact counts: see kvgc_harvest), so a step never waits, and
 * freeing emptied pages and compaction follow one step later (an append that would not
 * fit applies them first). IMMEDIATE: applied within this call; on CUDA it synchronises
 * `stream` once per segment that collects. Either way kvgc_append, kvgc_attend never
 * wait. kvgc_step and kvgc_attend share the heap's device scratch: issue them on one
 * stream (or order the streams). */
KVGC_API kvgc_status kvgc_step(kvgc_heap* heap, kvgc_seq seq, void* stream);

/* ---- attention ------------------------------------------------------------------ */
#define KVGC_ATTEND_NO_SCORES 0x1u /**< flags: do not add attention mass to the scores */

/** Options of kvgc_attend and kvgc_batch_attend (kvgc_attend_params_init: the defaults). */
typedef struct kvgc_attend_params {
  size_t struct_size; /**< sizeof(kvgc_attend_params) (set by the init) */
  float scale;     /**< softmax scale; 0 (the default) means 1/sqrt(head_dim) */
  uint32_t flags;  /**< KVGC_ATTEND_* */
  /** Added in 0.15, kvgc_batch_attend only (kvgc_attend: KVGC_EINVAL): NULL (the default)
   * adds the scored rows' attention mass to the scores; else the mass is written here
   * instead, float32 [view.n_pages][page_tokens] on the heap's device, slot-indexed in
   * kvgc_batch_export's page order: exactly the array kvgc_batch_observe takes (dead
   * slots and unscored sequences' pages get 0), and no score or recent score changes.
   * For tensor parallelism: each rank's heap holds its own KV heads, so its mass covers
   * only its query heads; sum the ranks' arrays in one fixed order and hand every rank
   * the same sum with kvgc_batch_observe, and every rank's GC makes the same decisions.
   * With one scored row per sequence (decode), attend with mass_out then
   * kvgc_batch_observe of that array leaves the scores bit for bit as the fused attend
   * does (kvgc_batch_observe decays the recent scores once; the fused attend by
   * recent_decay to the power of a sequence's scored rows). KVGC_EINVAL with
   * KVGC_ATTEND_NO_SCORES. */
  float* mass_out;
} kvgc_attend_params;

/** sizeof(kvgc_attend_params) before 0.15 (without mass_out), still accepted. */
#define KVGC_ATTEND_PARAMS_V1_SIZE (offsetof(kvgc_attend_params, mass_out))

/** Zeroes *params (defaults) and sets struct_size. */
KVGC_API kvgc_status kvgc_attend_params_init(kvgc_attend_params* params);

/** Attention of n_q queries over segment (seq, layer)'s cache, fused with the H2O signal:
 * each live slot's probability mass, summed over the query heads that share its KV head
 * and over the n_q queries, is added to its score (what kvgc_observe would do).
 * q is [n_q][n_q_heads][head_dim] and out [n_q][n_q_heads][head_dim], model dtype, on the
 * heap's device. The queries are the segment's last n_q tokens (append their K/V first):
 * query i has position length - n_q + i and attends to live tokens at positions <= its
 * own, so a prefill chunk sees the cache and its own earlier tokens. GQA: query head j
 * uses KV head j / (n_q_heads / n_kv_heads). Dead (evicted) slots are skipped; int4 slots
 * are dequantised; softmax accumulates in fp32. A query that sees no live token gets
 * zeros. params may be NULL (defaults). */
KVGC_API kvgc_status kvgc_attend(kvgc_heap* heap, kvgc_seq seq, uint32_t layer, const void* q,
                                 uint32_t n_q, void* out, const kvgc_attend_params* params,
                                 void* stream);

/** The GC's view of segment (seq, layer): each live token's accumulated score (float32)
 * and generation (uint8, kvgc_generation), in kvgc_read order, on the heap's device.
 * Either output may be NULL; capacity and *n_out as for kvgc_read. */
KVGC_API kvgc_status kvgc_read_scores(kvgc_heap* heap, kvgc_seq seq, uint32_t layer,
                                      float* scores_out, uint8_t* gen_out, uint64_t capacity,
                                      uint64_t* n_out, void* stream);

/** Each live token's storage class (uint8, kvgc_storage_class) of segment (seq, layer), in
 * kvgc_read order, on the heap's device; capacity and *n_out as for kvgc_read. What the
 * storage ladder decided, for engines and researchers that compare policies. On CUDA it
 * synchronises `stream` (a research and test tool, not for the decode path). Added in 0.4. */
KVGC_API kvgc_status kvgc_read_classes(kvgc_heap* heap, kvgc_seq seq, uint32_t layer,
                                       uint8_t* cls_out, uint64_t capacity, uint64_t* n_out,
                                       void* stream);

/* ---- batches (added in 0.5) ---------------------------------------------------- */
/** Serving many sequences at once: plan once per engine step, then one call per layer for
 * the whole batch (on CUDA each is a single launch over every sequence), then one GC call.
 *
 * ```
 *   kvgc_batch_plan(b, seqs, n_new, n, &failed, stream);   once per engine step
 *   for each layer:
 *     kvgc_batch_append(b, layer, k, v, stream);           the step's new K/V rows
 *     kvgc_batch_attend(b, layer, q, out, params, stream); their queries
 *   kvgc_batch_step(b, stream);                            every sequence's GC
 * ```
 *
 * (kvgc_batch_plan_ex, 0.6: per sequence, rows that attend unscored and a GC deferred to
 * a later step, so that an observe-style prefill runs inside the plan too.)
 *
 * Rows are in batch order: sequence i's n_new[i] rows follow sequence i-1's, so k, v, q
 * and out are [sum n_new][heads][head_dim] in the model dtype. A sequence may bring one
 * row (decode) or a chunk of its prompt (chunked prefill) in the same batch; n_new[i] = 0
 * keeps it in the batch without new tokens (it attends nothing, its GC still runs).
 * Every call computes exactly what the per-sequence calls compute (kvgc_append, then
 * kvgc_attend with n_q = n_new[i], then kvgc_step per sequence): bit for bit on the CPU
 * with one thread; with cpu_threads > 1 only a sequence long enough to be split across
 * threads may differ, by summation order.
 *
 * The plan stays valid until the batch's kvgc_batch_step or its next plan. A call on the
 * heap that changes a planned sequence's pages in between (a per-sequence append or
 * step, kvgc_seq_destroy, a fork of it is fine), whichever layer it touches, makes the
 * whole plan stale: every later call on it (append, attend, export and observe at any
 * layer, and kvgc_batch_step) fails with KVGC_EINVAL and changes nothing; plan again.
 * Calls that succeeded before it stand (a layer already appended keeps its rows), so an
 * engine that mixes per-sequence calls into a planned step evens its layers itself.
 * (tests/test_batch.cpp, "a plan goes stale as a whole"; 0.5.0 as first released let only
 * the touched layer go stale.) One plan per heap at a time:
 * planning a batch makes the heap's other batches' plans stale (their device tables share
 * one region of the arena). Pages a plan reserved for layers that were never appended go
 * back at the next plan, the step or kvgc_batch_destroy. */
typedef struct kvgc_batch kvgc_batch;

/** A batch object for `heap`, reused step after step (its host arrays grow to the largest
 * batch planned and are kept). */
KVGC_API kvgc_status kvgc_batch_create(kvgc_heap* heap, kvgc_batch** batch_out);
/** Frees the batch and returns the pages its plan still reserves. NULL is a no-op. The
 * heap must outlive its batches. */
KVGC_API void kvgc_batch_destroy(kvgc_batch* batch);

/** Plans one engine step over n_seqs distinct live sequences of the batch's heap: applies
 * their pending GC results, reserves the pages every layer needs for n_new[i] new tokens
 * of sequence i, and (CUDA) uploads the step's page tables, append runs and attention
 * work list for every layer in one copy on `stream`. All or nothing: when the pages do
 * not fit (after applying every pending GC result and compacting the batch's fragmented
 * segments), KVGC_ENOMEM, or KVGC_EBUDGET past a tenant's quota, and *failed_out (may be
 * NULL) is the index of the first sequence, in batch order, that did not fit: every
 * sequence before it did, so an engine preempts that one (or a later one) and plans
 * again. KVGC_ENOTFOUND for an unknown sequence and KVGC_EINVAL for a repeated one, with
 * *failed_out its index. n_seqs may be 0 (an empty step). */
KVGC_API kvgc_status kvgc_batch_plan(kvgc_batch* batch, const kvgc_seq* seqs,
                                     const uint32_t* n_new, uint32_t n_seqs,
                                     uint32_t* failed_out, void* stream);

/** Per-sequence choices of a plan (added in 0.6), for a prompt that enters the cache
 * SnapKV-style inside the plan: its chunks attend unscored (or score only their last
 * rows, the observation window), and its GC waits for the prompt's end.
 *
 *   scored_rows  [n_seqs] or NULL (every row scores). Of sequence i's n_new[i] rows only
 *                the last scored_rows[i] add attention mass at kvgc_batch_attend; the rows
 *                before them attend as with KVGC_ATTEND_NO_SCORES. Values >= n_new[i]:
 *                every row scores. Exactly the per-sequence calls kvgc_append of the first
 *                n_new - s rows, kvgc_attend of them with KVGC_ATTEND_NO_SCORES, then
 *                kvgc_append and kvgc_attend (scored) of the last s rows: bit for bit on
 *                the CPU with one thread; the recent scores decay by recent_decay^s, so
 *                an unscored chunk (s = 0) changes no score at all. A call whose params
 *                say KVGC_ATTEND_NO_SCORES scores no row of any sequence. kvgc_batch_observe
 *                (the engine's own attention) is not affected.
 *   seq_flags    [n_seqs] or NULL (none): KVGC_BATCH_SEQ_* bits per sequence.
 *
 * KVGC_BATCH_SEQ_DEFER_STEP: kvgc_batch_step does not step this sequence (no GC, its
 * pending results stay pending), as a per-sequence engine calls no kvgc_step between a
 * prompt's chunks; the sequence's next kvgc_step, or a later plan's kvgc_batch_step
 * without the flag, collects, with every appended token counted. */
#define KVGC_BATCH_SEQ_DEFER_STEP 0x1u

/** Per-sequence choices of a plan (above; kvgc_batch_plan_options_init: none). */
typedef struct kvgc_batch_plan_options {
  size_t struct_size;          /**< sizeof(kvgc_batch_plan_options) (set by the init) */
  const uint32_t* scored_rows; /**< [n_seqs] or NULL */
  const uint32_t* seq_flags;   /**< [n_seqs] or NULL */
} kvgc_batch_plan_options;

/** Zeroes *opts (every row scores, no flags) and sets struct_size. */
KVGC_API kvgc_status kvgc_batch_plan_options_init(kvgc_batch_plan_options* opts);

/** kvgc_batch_plan with per-sequence choices; opts NULL is kvgc_batch_plan. KVGC_EINVAL
 * for unknown seq_flags bits (*failed_out the sequence's index; the previous plan stays
 * live) and for an opts->struct_size this library does not know. Added in 0.6. */
KVGC_API kvgc_status kvgc_batch_plan_ex(kvgc_batch* batch, const kvgc_seq* seqs,
                                        const uint32_t* n_new, uint32_t n_seqs,
                                        const kvgc_batch_plan_options* opts,
                                        uint32_t* failed_out, void* stream);

/** Appends every planned sequence's new rows to `layer` (k and v: [sum n_new][n_kv_heads]
 * [head_dim], batch order, on the heap's device). Once per layer per plan; KVGC_EINVAL if
 * this layer was already appended. Never allocates pages: the plan reserved them. */
KVGC_API kvgc_status kvgc_batch_append(kvgc_batch* batch, uint32_t layer, const void* k,
                                       const void* v, void* stream);

/** Attention of every planned sequence's new rows over its cache at `layer`, fused with
 * the H2O signal: q and out are [sum n_new][n_q_heads][head_dim], batch order; row j of
 * sequence i is its query at position length - n_new[i] + j, as kvgc_attend. Rows that
 * kvgc_batch_plan_ex's scored_rows leave out add no mass (params->flags may also turn
 * scores off for every row). The layer
 * must have been appended in this plan (KVGC_EINVAL otherwise); it may be attended more
 * than once. Long sequences are split across SMs (CPU: threads), short ones share them. */
KVGC_API kvgc_status kvgc_batch_attend(kvgc_batch* batch, uint32_t layer, const void* q,
                                       void* out, const kvgc_attend_params* params,
                                       void* stream);

/** Every planned sequence's kvgc_step, but those planned with KVGC_BATCH_SEQ_DEFER_STEP
 * (kvgc_batch_plan_ex). The plan is spent (pages reserved for layers that were not
 * appended go back first). KVGC_EBUDGET as kvgc_step, for any sequence, after
 * every sequence's GC has run; the first failure of another kind stops the walk. */
KVGC_API kvgc_status kvgc_batch_step(kvgc_batch* batch, void* stream);

/* ---- bring your own attention: the page layout and a batch's page tables (0.5) ---- */
/** Engines with their own paged attention kernels read kvgc's pages directly, through this
 * layout, and hand the attention mass back with kvgc_batch_observe. The layout is part of
 * the ABI: KVGC_PAGE_LAYOUT_VERSION changes whenever any offset rule below does.
 *
 * A page of class `cls` is page_bytes bytes at arena_base + offset (kvgc_batch_view) and
 * holds page_tokens slots of one segment for all its KV heads. Version 2 (0.7): a page
 * may be shared (kvgc_seq_fork, the prefix cache); the fields from live to gen (the
 * sequence's own view) are then at arena_base + page_offset, and K, V and their scales at
 * arena_base + kv_offset (read only: other sequences read them too). A private page has
 * kv_offset == page_offset, so reading every field at page_offset's offsets for the
 * header and at kv_offset's for the payload serves both:
 * ```
 *   live    uint32[ceil(page_tokens/32)] at live_offset: bit s%32 of word s/32 set = slot s
 *           holds a live token (a dead slot's other fields are garbage: skip it)
 *   pos     int32[page_tokens]  at pos_offset: the token's position in its sequence
 *   score   float[page_tokens]  at score_offset: accumulated attention mass (read only)
 *   recent  float[page_tokens]  at recent_offset: decayed recent mass (read only)
 *   gen     uint8[page_tokens]  at gen_offset: bits 0-1 the kvgc_generation, 2-5 an age,
 *           6-7 (0.8) the kvgc_storage_class a shared page's slot is charged at under
 *           KVGC_PREFIX_CHARGE_PRUNE (0: the page's own; the slot reads as its page)
 *   K, V    at k_offset, v_offset: element d of head h of slot s starts at byte
 *           h * head_stride + s * slot_stride + (FP16: d * dtype bytes; INT8: d; INT4: d/2,
 *           the low nibble for even d, the high for odd; INT2: d/4, bits 2*(d%4) and up)
 *   FP16    elements in the model dtype (f16, bf16; f32 for f32 models)
 *   INT8    x = q * scale, q int8, scale the 16-bit word at kq_offset (K) or vq_offset (V)
 *           + 2 * ((h * page_tokens + s) * qwords); f16 for f16 models, else bf16
 *   INT4    x = n * scale + zero, n the nibble; for group g = d / group, scale and zero are
 *           16-bit words 2g and 2g+1 from kq_offset/vq_offset + 2 * ((h * page_tokens + s)
 *           * qwords), typed as INT8's scale
 *   INT2    as INT4, n the 2-bit code (0..3)
 * ```
 * A slot's order in attention does not matter, its position does (causal masks). */
#define KVGC_PAGE_LAYOUT_VERSION 2

/** One storage class's page layout (above): kvgc_page_layout_get. */
typedef struct kvgc_page_layout {
  size_t struct_size;    /**< sizeof(kvgc_page_layout) as compiled */
  uint32_t version;      /**< KVGC_PAGE_LAYOUT_VERSION of the library */
  kvgc_storage_class cls; /**< the class it describes */
  kvgc_dtype dtype;      /**< the model's */
  /** The heap's page_tokens and the model's n_kv_heads and head_dim. */
  /** @{ */
  uint32_t page_tokens, n_kv_heads, head_dim;
  /** @} */
  uint32_t group;        /**< INT4, INT2: elements per scale/zero pair; else head_dim */
  uint32_t qwords;       /**< 16-bit quantisation words per (head, slot): FP16 0, INT8 1,
                            INT4 and INT2 2 * head_dim / group */
  uint64_t page_bytes;   /**< bytes of one page of this class */
  /** Where each field of a page starts (bytes from the page) and the K/V strides (above). */
  /** @{ */
  uint64_t live_offset, pos_offset, score_offset, recent_offset, gen_offset;
  uint64_t k_offset, v_offset, kq_offset, vq_offset;  /* kq/vq: 0 for FP16 */
  uint64_t head_stride, slot_stride;
  /** @} */
} kvgc_page_layout;

/** Fills *out (set out->struct_size first, or zero it and set struct_size) for class cls. */
KVGC_API kvgc_status kvgc_page_layout_get(const kvgc_heap* heap, kvgc_storage_class cls,
                                          kvgc_page_layout* out);

/** One appended layer of a planned batch, as device arrays (host arrays on the CPU
 * backend) valid until the plan is spent or stale. Sequence i's pages, the step's new
 * tokens included, are page_offset[page_indptr[i] .. page_indptr[i+1]) with their classes
 * in page_class, in kvgc's attention order (INT2, INT4, INT8, then FP16 pages; any order serves
 * attention). Its queries are rows [q_indptr[i], q_indptr[i+1]) at positions q_pos0[i] + j.
 * KVGC_EINVAL before kvgc_batch_append(layer): reserved pages hold nothing readable yet. */
typedef struct kvgc_batch_view {
  size_t struct_size;           /**< sizeof(kvgc_batch_view) as compiled */
  uint32_t n_seqs;              /**< the sequences planned */
  uint32_t n_pages;             /**< this layer's pages over the whole batch */
  uint32_t n_rows;              /**< sum of n_new */
  uint32_t page_tokens;         /**< slots per page */
  void* arena_base;             /**< device address every offset counts from */
  const uint32_t* page_indptr;  /**< [n_seqs + 1] */
  const uint64_t* page_offset;  /**< [n_pages] bytes from arena_base */
  const uint8_t* page_class;    /**< [n_pages] kvgc_storage_class */
  const uint32_t* q_indptr;     /**< [n_seqs + 1] */
  const int32_t* q_pos0;        /**< [n_seqs] */
  /** 0.7: [n_pages] bytes from arena_base of the page holding each page's K/V (and scales):
   * page_offset[p] for a private page, the shared page's otherwise (page layout version 2).
   * A caller built against 0.6 (struct_size without this field) gets KVGC_EUNSUPPORTED
   * for a layer whose pages include a shared one. */
  const uint64_t* kv_offset;
} kvgc_batch_view;

/** sizeof(kvgc_batch_view) in 0.5 and 0.6, still accepted by kvgc_batch_export. */
#define KVGC_BATCH_VIEW_V1_SIZE (offsetof(kvgc_batch_view, kv_offset))

/** The planned batch's page tables for `layer`. */
KVGC_API kvgc_status kvgc_batch_export(kvgc_batch* batch, uint32_t layer, kvgc_batch_view* out);

/** Hands in the attention mass an engine's own kernel gave every slot of `layer`'s pages:
 * mass is float32 [view.n_pages][page_tokens] (slot-indexed, on the heap's device), entry
 * p * page_tokens + s for slot s of the view's page p; dead slots' entries are ignored.
 * As kvgc_observe per segment: each slot's recent score is multiplied by recent_decay once,
 * then the mass is added; values are clamped as for kvgc_observe. */
KVGC_API kvgc_status kvgc_batch_observe(kvgc_batch* batch, uint32_t layer, const float* mass,
                                        void* stream);

/* ---- statistics --------------------------------------------------------------- */
/** The kvgc_stats version this header declares (kvgc_stats.version: the library's). */
#define KVGC_STATS_VERSION 10

/** One storage class's pages (kvgc_stats.cls, cls_int8, cls_int2, cls_header). */
typedef struct kvgc_class_stats {
  uint64_t page_bytes;     /**< bytes of one page of this class, metadata included */
  uint64_t slabs;          /**< slabs currently carved into this class */
  uint64_t reserved_bytes; /**< slabs * slab_bytes */
  uint64_t used_bytes;     /**< pages in use * page_bytes */
  uint64_t free_bytes;     /**< reserved - used: free pages and slab tail waste */
  uint64_t pages_used;     /**< pages in use */
  uint64_t pages_free;     /**< free pages in this class's slabs */
} kvgc_class_stats;

/** A heap's state and counters (kvgc_get_stats), by the version that added each field. */
typedef struct kvgc_stats {
  size_t struct_size;      /**< sizeof(kvgc_stats) (kvgc_stats_init sets it) */
  uint32_t version;        /**< KVGC_STATS_VERSION of the library that filled it */
  kvgc_device device;      /**< the backend in use: CPU or CUDA */
  uint64_t arena_bytes;    /**< the reservation */
  uint64_t slab_bytes;     /**< bytes of one slab */
  uint64_t slabs_total;    /**< slabs in the arena */
  uint64_t slabs_free;     /**< in the arena, owned by no class */
  uint64_t free_bytes;     /**< free slabs + every class's free_bytes (its free pages and
                              the tail waste of its slabs), so arena_bytes - scratch_bytes
                              - free_bytes is the bytes of pages in use */
  kvgc_class_stats cls[2]; /**< KVGC_CLASS_FP16, KVGC_CLASS_INT4 (INT8: cls_int8 below) */
  uint64_t sequences;      /**< live sequences */
  uint64_t segments;       /**< segments holding at least one page */
  uint64_t live_tokens;    /**< all segments */
  uint64_t slots_held;     /**< pages in use * page_tokens */
  uint64_t dead_slots;     /**< appended, then evicted, still holding a slot */
  double fragmentation;    /**< dead_slots / slots_held (0 when nothing is held) */
  /* counters since creation */
  uint64_t appends;        /**< appends to a segment (batch appends: one per sequence) */
  uint64_t tokens_appended;/**< tokens those appends added */
  uint64_t pages_allocated;/**< pages taken from the class pools */
  uint64_t pages_freed;    /**< pages given back to them */
  uint64_t slabs_acquired; /**< slabs a class took from the arena */
  uint64_t slabs_released; /**< slabs a class gave back to the arena */
  uint64_t enomem;         /**< calls that failed with KVGC_ENOMEM */
  /* version 2: the GC */
  uint64_t tier_tokens[KVGC_GEN_COUNT]; /**< live tokens per generation, all segments */
  uint64_t steps;          /**< kvgc_step calls */
  uint64_t observes;       /**< kvgc_observe calls */
  uint64_t gcs;            /**< segment collections (all policies) */
  uint64_t minor_gcs;      /**< generational */
  uint64_t major_gcs;      /**< generational */
  uint64_t tokens_ranked;  /**< candidates ranked, summed over collections */
  uint64_t tokens_evicted; /**< by the GC */
  uint64_t tokens_demoted; /**< moved down the storage ladder (any rung) */
  uint64_t tokens_promoted;/**< intermediate -> long-term */
  uint64_t tokens_tenured; /**< young -> intermediate */
  uint64_t compactions;    /**< segment compactions */
  uint64_t slots_moved;    /**< by compaction */
  uint64_t bytes_moved;    /**< by compaction and demotion */
  uint64_t ebudget;        /**< segments left over budget (KVGC_EBUDGET) */
  uint64_t attends;        /**< kvgc_attend calls */
  uint64_t scratch_bytes;  /**< of arena_bytes, kept for device attention and GC (CPU: 0) */
  /* version 3 (0.4): the INT8 class, and demotions per destination class */
  kvgc_class_stats cls_int8;     /**< the INT8 class */
  uint64_t tokens_demoted_to[3]; /**< [KVGC_CLASS_FP16] is always 0; INT2: below */
  /* version 4 (0.7): shared pages and the prefix cache */
  kvgc_class_stats cls_header; /**< header pages: each holder's metadata of a shared page */
  uint64_t shared_pages;       /**< pages held through header pages or cached prefixes */
  uint64_t shared_bytes;       /**< their bytes, each counted once (in cls/cls_int8 too) */
  uint64_t shared_refs;        /**< header pages + cached prefixes' references to them */
  uint64_t prefixes;           /**< cached prefixes (kvgc_prefix_keep) */
  uint64_t prefixes_pinned;    /**< of prefixes, those pinned (kvgc_prefix_pin) */
  uint64_t prefix_lookups;     /**< kvgc_prefix_attach calls */
  uint64_t prefix_hits;        /**< ... that attached at least one token */
  uint64_t prefix_tokens_attached; /**< tokens those hits attached */
  uint64_t prefix_evictions;   /**< cached prefixes evicted for room (LRU) */
  uint64_t pages_shared;       /**< pages made shared (keep, fork), counted once each time */
  uint64_t cow_copies;         /**< shared partly filled pages copied on first write */
  /* version 5 (0.7.1) */
  uint64_t cached_only_bytes;  /**< of shared_bytes, pages only cached prefixes hold (no
                                  sequence): what evicting unpinned prefixes can give back,
                                  so an engine's admission may count them as free */
  /* version 6 (0.10): the INT2 class */
  kvgc_class_stats cls_int2;    /**< the INT2 class */
  uint64_t tokens_demoted_to_int2; /**< tokens demoted to INT2 */
  /* version 7 (0.12): evacuation. Memory moves between classes by whole slabs; when the
     arena is short of one class's pages, sparse slabs of the others are emptied by moving
     their pages into their class's other slabs (device copies; nothing else changes) */
  uint64_t pages_migrated;     /**< pages moved so */
  uint64_t slabs_evacuated;    /**< slabs emptied so and given back to the arena */
  /* version 8 (0.13): KVGC_PREFIX_CHARGE_SHRINK */
  uint64_t pages_shrunk;       /**< shared pages re-stored at a cheaper class */
  uint64_t bytes_shrunk;       /**< arena bytes that gave back */
  /* version 9 (0.14): a step that degrades says so. When the arena (after settling other
     GCs, evacuating sparse slabs and evicting cached prefixes) or the tenant's quota has
     no page for the ladder's demoted tokens, kvgc_step still returns KVGC_OK and meets
     its budget, but by evicting tokens it would have demoted: */
  uint64_t gcs_short_of_pages; /**< collections that got fewer demotion slots than wanted */
  uint64_t demote_slots_short; /**< the slots they lacked: at most this many tokens were
                                  evicted instead of demoted */
  /* version 10 (0.15): a shared page whose other holders are all gone (the forks of a
     sequence destroyed, the prefix that held it evicted or dropped) becomes its last
     holder's own page again at that holder's next kvgc_step or batch plan, and the header
     page the sharing cost goes back to the pool (k_offset bytes of kvgc_page_layout): */
  uint64_t pages_unshared;     /**< shared pages taken back so by their last holder */
} kvgc_stats;

/** sizeof(kvgc_stats) of versions 1 to 9, still accepted by kvgc_get_stats. */
/** @{ */
#define KVGC_STATS_V1_SIZE (offsetof(kvgc_stats, tier_tokens))
#define KVGC_STATS_V2_SIZE (offsetof(kvgc_stats, cls_int8))
#define KVGC_STATS_V3_SIZE (offsetof(kvgc_stats, cls_header))
#define KVGC_STATS_V4_SIZE (offsetof(kvgc_stats, cached_only_bytes))
#define KVGC_STATS_V5_SIZE (offsetof(kvgc_stats, cls_int2))
#define KVGC_STATS_V6_SIZE (offsetof(kvgc_stats, pages_migrated))
#define KVGC_STATS_V7_SIZE (offsetof(kvgc_stats, pages_shrunk))
#define KVGC_STATS_V8_SIZE (offsetof(kvgc_stats, gcs_short_of_pages))
#define KVGC_STATS_V9_SIZE (offsetof(kvgc_stats, pages_unshared))
/** @} */

/** Zeroes *out and sets struct_size. Returns KVGC_EINVAL on NULL. */
KVGC_API kvgc_status kvgc_stats_init(kvgc_stats* out);
/** Fills *out up to out->struct_size bytes (set it first; kvgc_stats_init does). */
KVGC_API kvgc_status kvgc_get_stats(kvgc_heap* heap, kvgc_stats* out);

#ifdef __cplusplus
} /* extern "C" */
#endif
#endif /* KVGC_H */
