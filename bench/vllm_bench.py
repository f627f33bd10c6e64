"""vLLM's own KV cache against the kvgc plugin, served by `vllm serve` and driven by vLLM's
own client, `vllm bench serve`, at the same KV memory, in one run.

    tools/vllm-venv.sh                      # the venv (prints its python)
    ~/.cache/kvgc/vllm-venv/bin/python bench/vllm_bench.py [--requests 48] [--kv-mib 384]
        [--budget 10%] [--stream mixed|prefix] [--out DIR]

The stream (a custom JSONL dataset, in order, all requests at once so that memory binds;
sent to /v1/completions already in the model's chat template):
prompts of 512-4K tokens cut from three texts the tree ships (bench/quality_data), outputs of
64-256 tokens, every other request a passkey prompt (a 5-digit key at a random depth in
kvgc-bench-quality's form, asked after the text) scored from the generated text. --stream prefix gives every request
one of two long shared preambles (prefix caching on for vLLM's own side).

Every request generates exactly its output tokens (--ignore-eos), so both sides decode
the same number. Per side: mean and peak running requests, preemptions and the prefix cache's hit rate
(sampled from the server's /metrics every 0.25 s), output tokens/s, mean TTFT and TPOT
(vllm bench serve's JSON), passkey accuracy with its Wilson 95% interval. Ends with one RESULT line, ratios first.
"""
import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "anchors"))
from report import wilson  # noqa: E402  (the anchors' Wilson interval, one definition)
TEXTS = ["gpl-3.txt", "debian-policy.txt", "jargon-intro.txt"]
MODEL = os.path.expanduser("~/.cache/kvgc/smollm2-vllm")


def make_stream(n, seed, stream, tok):
    """The JSONL rows and each row's pass key (None for a plain prompt)."""
    rng = random.Random(seed)
    words = [open(os.path.join(ROOT, "bench", "quality_data", t)).read().split() for t in TEXTS]
    preambles = [" ".join(words[i][:1500]) for i in range(2)]
    rows, keys = [], []
    for i in range(n):
        w = words[i % 3]
        target = rng.randint(512, 4096)
        n_words = int(target / 1.35)             # SmolLM2's tokens per word, about
        start = rng.randrange(0, max(1, len(w) - n_words))
        body = w[start:start + n_words]
        if stream == "prefix":    # a shared preamble, then half the text: the key is in it
            body = body[: len(body) // 2]
        key = None
        if i % 2 == 0:
            key = rng.randint(10000, 99999)
            at = int(len(body) * rng.uniform(0.05, 0.95))
            # kvgc-bench-quality's needle: the key said twice, the answer begun.
            body = body[:at] + [f"\nThe pass key is {key}. Remember it. {key} is the pass "
                                f"key.\n"] + body[at:]
            question = "What is the pass key?"
        else:
            question = "Summarize the text above in two sentences."
        text = " ".join(body)
        if stream == "prefix":
            text = preambles[i // 2 % 2] + "\n\n" + text
        # Sent raw to /v1/completions in SmolLM2's chat template, a pass key's answer begun
        # in the assistant's turn (as kvgc-bench-quality asks it).
        chat = [{"role": "user", "content": text + "\n\n" + question}]
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        rows.append({"prompt": prompt + ("The pass key is" if key else ""),
                     "output_tokens": rng.randint(64, 256) if key is None else 64})
        keys.append(key)
    return rows, keys


class MetricsSampler(threading.Thread):
    """Samples vllm:num_requests_running, vllm:num_preemptions and the prefix cache's
    queried and hit tokens from /metrics."""

    def __init__(self, port):
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.running, self.preemptions, self.stop = [], 0.0, False
        self.prefix_queries = self.prefix_hits = 0.0

    def run(self):
        while not self.stop:
            try:
                text = urllib.request.urlopen(self.url, timeout=2).read().decode()
                for line in text.splitlines():
                    if line.startswith("vllm:num_requests_running"):
                        self.running.append(float(line.rsplit(" ", 1)[1]))
                    elif line.startswith("vllm:num_preemptions_total"):
                        self.preemptions = float(line.rsplit(" ", 1)[1])
                    elif line.startswith("vllm:prefix_cache_queries_total"):
                        self.prefix_queries = float(line.rsplit(" ", 1)[1])
                    elif line.startswith("vllm:prefix_cache_hits_total"):
                        self.prefix_hits = float(line.rsplit(" ", 1)[1])
            except Exception:
                pass
            time.sleep(0.25)


def serve(side, args, port, log):
    env = dict(os.environ, HF_HUB_OFFLINE="1", KVGC_VLLM="1" if side == "kvgc" else "0")
    if side == "kvgc":
        env["KVGC_BYTE_BUDGET"] = args.budget
    cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", args.model,
           "--port", str(port), "--dtype", "bfloat16", "--enforce-eager",
           "--max-model-len", "8192", "--kv-cache-memory-bytes", str(args.kv_mib << 20),
           "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", "smollm2"]
    if args.stream == "prefix" and side == "vllm":
        cmd.append("--enable-prefix-caching")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    t0 = time.time()
    while time.time() - t0 < 300:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve ({side}) exited {proc.returncode}; see {log.name}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, time.time() - t0
        except Exception:
            time.sleep(1)
    os.killpg(proc.pid, signal.SIGTERM)
    raise RuntimeError(f"vllm serve ({side}) did not start in 300 s; see {log.name}")


def run_side(side, args, dataset, keys, out_dir, port):
    log = open(os.path.join(out_dir, f"serve-{side}.log"), "w")
    proc, start_s = serve(side, args, port, log)
    sampler = MetricsSampler(port)
    sampler.start()
    try:
        cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "bench", "serve",
               "--backend", "openai", "--endpoint", "/v1/completions", "--skip-chat-template",
               "--base-url", f"http://127.0.0.1:{port}", "--model", "smollm2",
               "--tokenizer", args.model, "--dataset-name", "custom",
               "--dataset-path", dataset, "--disable-shuffle", "--num-prompts",
               str(args.requests), "--request-rate", "inf", "--temperature", "0", "--ignore-eos",
               "--save-result", "--save-detailed", "--result-dir", out_dir,
               "--result-filename", f"bench-{side}.json"]
        with open(os.path.join(out_dir, f"client-{side}.log"), "w") as clog:
            subprocess.run(cmd, check=True, stdout=clog, stderr=subprocess.STDOUT,
                           env=dict(os.environ, HF_HUB_OFFLINE="1"))
    finally:
        sampler.stop = True
        sampler.join()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    res = json.load(open(os.path.join(out_dir, f"bench-{side}.json")))
    texts = res.get("generated_texts") or []
    asked = [(i, k) for i, k in enumerate(keys) if k is not None]
    right = sum(1 for i, k in asked if i < len(texts) and str(k) in texts[i])
    busy = [r for r in sampler.running if r > 0]
    return {
        "start_s": round(start_s, 1),
        "completed": res.get("completed"),
        "failed": res.get("failed", 0),
        "output_tok_s": res.get("output_throughput"),
        "mean_ttft_ms": res.get("mean_ttft_ms"),
        "mean_tpot_ms": res.get("mean_tpot_ms"),
        "duration_s": res.get("duration"),
        "running_mean": sum(busy) / len(busy) if busy else 0.0,
        "running_peak": max(sampler.running, default=0.0),
        "preemptions": sampler.preemptions,
        "prefix_hit_rate": (sampler.prefix_hits / sampler.prefix_queries
                            if sampler.prefix_queries else 0.0),
        "passkey": right, "passkey_n": len(asked),
        "passkey_ci": wilson(right, len(asked)),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--kv-mib", type=int, default=384, help="KV memory of each side (MiB)")
    p.add_argument("--budget", default="10%", help="the kvgc side's KVGC_BYTE_BUDGET")
    p.add_argument("--stream", choices=("mixed", "prefix"), default="mixed")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--out", default=None)
    p.add_argument("--sides", default="vllm,kvgc")
    args = p.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    out_dir = args.out or tempfile.mkdtemp(prefix="kvgc-vllm-bench-")
    os.makedirs(out_dir, exist_ok=True)
    rows, keys = make_stream(args.requests, args.seed, args.stream, tok)
    dataset = os.path.join(out_dir, "stream.jsonl")
    with open(dataset, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    lens = [len(tok(r["prompt"])["input_ids"]) for r in rows]
    print(f"stream: {len(rows)} requests, prompts {min(lens)}-{max(lens)} tokens "
          f"(mean {sum(lens) / len(lens):.0f}), {sum(k is not None for k in keys)} passkey; "
          f"KV memory {args.kv_mib} MiB a side; kvgc KVGC_BYTE_BUDGET={args.budget}; "
          f"results in {out_dir}", flush=True)
    results = {}
    for i, side in enumerate(args.sides.split(",")):
        results[side] = run_side(side, args, dataset, keys, out_dir, 8700 + i)
        r = results[side]
        print(f"{side:5s} running mean {r['running_mean']:.1f} peak {r['running_peak']:.0f} | "
              f"{r['output_tok_s']:.1f} out tok/s | TTFT {r['mean_ttft_ms']:.0f} ms | "
              f"TPOT {r['mean_tpot_ms']:.0f} ms | passkey {r['passkey']}/{r['passkey_n']} "
              f"[{r['passkey_ci'][0]:.2f}, {r['passkey_ci'][1]:.2f}] | preemptions "
              f"{r['preemptions']:.0f} | prefix hits {100 * r['prefix_hit_rate']:.0f}% | completed {r['completed']} failed {r['failed']} | "
              f"{r['duration_s']:.0f} s", flush=True)
    json.dump(results, open(os.path.join(out_dir, "summary.json"), "w"), indent=1)
    if "vllm" in results and "kvgc" in results:
        v, k = results["vllm"], results["kvgc"]
        ratio = lambda a, b: (a / b) if b else float("nan")
        print(f"RESULT running_mean_ratio={ratio(k['running_mean'], v['running_mean']):.2f} "
              f"output_tok_s_ratio={ratio(k['output_tok_s'], v['output_tok_s']):.2f} "
              f"passkey_ratio={ratio(k['passkey'], v['passkey']):.2f} "
              f"ttft_ratio={ratio(k['mean_ttft_ms'], v['mean_ttft_ms']):.2f} "
              f"tpot_ratio={ratio(k['mean_tpot_ms'], v['mean_tpot_ms']):.2f} "
              f"running_peak_vllm={v['running_peak']:.0f} running_peak_kvgc={k['running_peak']:.0f} "
              f"preemptions_vllm={v['preemptions']:.0f} preemptions_kvgc={k['preemptions']:.0f} "
              f"passkey_vllm={v['passkey']}/{v['passkey_n']} passkey_kvgc={k['passkey']}/{k['passkey_n']} "
              f"prefix_hit_rate_vllm={v['prefix_hit_rate']:.2f} prefix_hit_rate_kvgc={k['prefix_hit_rate']:.2f} "
              f"stream={args.stream} requests={args.requests} kv_mib={args.kv_mib} "
              f"budget={args.budget}")


if __name__ == "__main__":
    main()
