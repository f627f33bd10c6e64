"""Converts the SmolLM2 GGUF that `make model` fetches into a checkpoint vLLM loads.

    python tools/vllm-model.py [OUT_DIR]     (default ~/.cache/kvgc/smollm2-vllm)

Run with the vLLM venv's python (tools/vllm-venv.sh): the tokenizer must be written by
the transformers vLLM loads it with (the torch tests' ~/.cache/kvgc/smollm2-hf, written by
transformers 4.57, loads in 5.x as a tokenizer that drops every space). transformers
dequantises the GGUF; save_pretrained refuses a model loaded from a GGUF in 5.x, so the
weights are written with safetensors (the tied lm_head left out, as in the original
checkpoint) and the config without its quantization_config. Skips when OUT_DIR already
holds a checkpoint. Written aside, then renamed: a concurrent run never sees half a
directory.
"""
import os
import shutil
import sys
import uuid

CACHE = os.path.expanduser(os.environ.get("KVGC_CACHE_DIR", "~/.cache/kvgc"))
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(CACHE, "smollm2-vllm")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        print(out)
        return
    if not os.path.exists(os.path.join(CACHE, GGUF)):
        sys.exit(f"vllm-model: {os.path.join(CACHE, GGUF)} not found (run `make model`)")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(CACHE, gguf_file=GGUF, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(CACHE, gguf_file=GGUF)
    tmp = f"{out}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, out)
    except OSError:  # another process won the race: its copy is the same
        shutil.rmtree(tmp, ignore_errors=True)
    print(out)


if __name__ == "__main__":
    main()
