"""Shared fixtures for the torch/transformers tests: tiny random Llama models and SmolLM2.

SmolLM2-135M-Instruct comes from the GGUF `make model` fetches
(~/.cache/kvgc/SmolLM2-135M-Instruct.Q4_1.gguf, dequantised by transformers' GGUF
loader). The first load converts it once into ~/.cache/kvgc/smollm2-hf (save_pretrained),
so later loads take a fraction of a second. Without the GGUF the SmolLM2 tests skip,
saying so, unless KVGC_REQUIRE_MODEL=1 (CI), where they fail.
"""

import os
import shutil
import uuid

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Two cores are shared with builds: keep torch (and kvgc) to one thread.
torch.set_num_threads(1)
os.environ.setdefault("KVGC_THREADS", "1")
# kvgc's environment overrides heap keywords (as in C): a KVGC_POLICY=h2o left in the
# shell would turn the policy="full" equality tests into eviction tests. Tests say what
# they configure, so the heap-option variables are cleared for this process.
for _var in ("BUDGET", "BYTE_BUDGET", "TOKEN_BUDGET", "COMPACT_THRESHOLD", "DEMOTE", "DEVICE",
             "HARVEST", "LAYER_BUDGET", "PAGE_TOKENS", "POLICY", "RECENT_DECAY",
             "SCORE_NOISE", "SEED", "SINKS", "WINDOW", "VERBOSE"):
    os.environ.pop("KVGC_" + _var, None)

CACHE_DIR = os.path.expanduser(os.environ.get("KVGC_CACHE_DIR", "~/.cache/kvgc"))
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_DIR = os.path.join(CACHE_DIR, "smollm2-hf")


def tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=0, **extra):
    """A random-init float32 LlamaForCausalLM with GQA (heads/kv_heads queries per KV head),
    in eval mode, on attn_implementation="sdpa". No EOS so generation runs to length."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=2048, bos_token_id=1, eos_token_id=None,
                      pad_token_id=0, attn_implementation="sdpa", **extra)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="session")
def make_tiny():
    """The tiny_llama factory, for tests that need their own model: make_tiny(layers=4)."""
    return tiny_llama


@pytest.fixture(scope="session")
def tiny():
    """Session-wide tiny GQA model (2 layers, 4 query heads over 2 KV heads, head_dim 16)."""
    return tiny_llama()


def _require_model():
    return os.environ.get("KVGC_REQUIRE_MODEL") == "1"


def load_smollm2():
    """(model, tokenizer) for SmolLM2-135M-Instruct in float32 on SDPA, or pytest.skip."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = os.path.join(HF_DIR, "model.safetensors")
    if not os.path.exists(done):
        gguf = os.path.join(CACHE_DIR, GGUF_NAME)
        if not os.path.exists(gguf):
            msg = f"SmolLM2 GGUF not found at {gguf} (run `make model`)"
            if _require_model():
                pytest.fail(msg + " and KVGC_REQUIRE_MODEL=1")
            pytest.skip(msg)
        model = AutoModelForCausalLM.from_pretrained(CACHE_DIR, gguf_file=GGUF_NAME,
                                                     dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(CACHE_DIR, gguf_file=GGUF_NAME)
        # Written aside, then renamed: a concurrent run never sees half a directory.
        tmp = f"{HF_DIR}.tmp-{uuid.uuid4().hex[:8]}"
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, HF_DIR)
        except OSError:  # another process won the race: its copy is the same
            shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(HF_DIR, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(HF_DIR)
    return model, tok


@pytest.fixture(scope="session")
def smollm2():
    """Session-wide (model, tokenizer) of SmolLM2-135M-Instruct, float32, SDPA."""
    return load_smollm2()


@pytest.fixture
def attn():
    """Switches a model between "sdpa" and "kvgc" attention: attn(model, "kvgc")."""
    import kvgc.transformers as kt

    touched = []

    def switch(model, name):
        touched.append(model)
        if name == "kvgc":
            kt.use_kvgc(model)
        else:
            model.set_attn_implementation(name)
        return model

    yield switch
    for m in touched:  # leave session models as they were
        m.set_attn_implementation("sdpa")
