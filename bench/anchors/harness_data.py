#!/usr/bin/env python3
"""Local datasets in kvpress's own evaluation formats, so that its unmodified evaluate.py
can run kvgc and the presses offline (the Hub datasets it names are not reachable here).

Two formats, both exactly what evaluate.py's DATASET_REGISTRY entries load:

* ``ruler``: RULER's raw JSON lines (``{"index", "input", "outputs", "length"}``, one
  file per task under ``<len>/<task>/validation.jsonl``, as RULER's generate.sh writes
  them) are turned into the Hub layout (``<len>/test-00000-of-00001.parquet`` with
  context / question / answer_prefix / answer / task / max_new_tokens) by kvpress's OWN
  converter, ``benchmarks/ruler/create_huggingface_dataset.get_dataframe`` from the sdist.
  So the context/question split, task names and max_new_tokens are the harness's, and
  scoring is its ``string_match_all`` (``string_match_part`` for qa_*).
* ``needle_in_haystack``: one row (context = the haystack, needle, question,
  answer_prefix, max_new_tokens) as in alessiodevoto/paul_graham_essays; evaluate.py
  inserts the needle itself at --needle_depth and scores with ROUGE.

The prompts follow RULER's templates (scripts/data/synthetic/constants.py); what differs
from RULER: the "essay" haystack is the Jargon File introduction in
bench/quality_data (public domain; Paul Graham's essays are not redistributable), the qa
task uses synthetic fact documents instead of SQuAD, and asks 4 questions per context in
4 rows (evaluate.py groups rows by context and pays one prefill for the four; the rows of
one context are not independent, which the report says next to its intervals). The niah
and vt answer prefixes name the query, and evaluate.py requires one prefix per context,
so those tasks have one row per context, as RULER.

Deterministic from --seed: same seed, same tokenizer -> byte-identical parquet files.

  python bench/anchors/harness_data.py --out DIR --tokenizer ~/.cache/kvgc/smollm2-hf \\
      --sdist DIR/kvpress-0.5.5 --lengths 4096 8192 --rows 25
"""
import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ESSAY = os.path.join(HERE, "..", "quality_data", "jargon-intro.txt")

# RULER's noise haystack (scripts/data/synthetic/niah.py, "noise").
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# RULER's templates (scripts/data/synthetic/constants.py), verbatim, incl. its "assgined".
NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to "
                 "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are "
                 "all the special magic {type_needle_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
             "are assgined the value {query}, they are: ")
QA_TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output "
               "any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question "
               "based on the given documents. Only give me the answer and do not output any other words."
               "\n\nQuestion: {query}")
QA_PREFIX = " Answer:"

# Words for keys, variable names and fact entities: plain, single-token-ish English words
# (RULER draws keys from a word list too).
WORDS = """amber anchor apple arrow aspen badge bamboo banner barley basil beacon birch bison
blossom bramble breeze bronze cactus candle canyon cedar cherry cinder clover cobalt comet
copper coral cotton crater crystal daisy dawn delta desert dolphin dune eagle ember falcon
fern fig flint forest fossil garnet ginger glacier granite harbor hazel heron honey island
ivory jade jasmine juniper kettle lagoon lantern lava lemon lily linen lotus maple marble
meadow mint moss nectar oak ocean olive onyx orchid otter pebble pepper pine plum poppy
prairie quartz quill raven reef ripple river saffron sage sapphire shadow silver slate
spruce summit swan thistle thunder tiger timber topaz tulip valley velvet violet walnut
willow winter zephyr""".split()

# Made-up proper nouns for the qa documents: the model cannot know the answers.
SYLLABLES = "ka lo mi ra ven dor sel tha bri gon ul fa zen mor pi qua ri sto lan eth".split()
RELATIONS = [
    ("The capital of {e} is {a}.", "What is the capital of {e}?"),
    ("The river that flows through {e} is called the {a}.", "What is the river that flows through {e} called?"),
    ("The founder of {e} was a merchant named {a}.", "Who founded {e}?"),
    ("The most famous dish of {e} is {a}.", "What is the most famous dish of {e}?"),
]

MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "qa": 32}  # as the harness's converter sets them


def name(rng, parts=3):
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


class Sizer:
    """Token counting with the evaluated model's tokenizer, through the same chat template
    the pipeline applies, so that a '4096' prompt is <= 4096 tokens for this model."""

    def __init__(self, tokenizer_path):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(tokenizer_path)
        self.overhead = 0
        if self.tok.chat_template is not None:
            s = self.tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                             tokenize=False)
            self.overhead = len(self.tok.encode(s, add_special_tokens=False)) - 1

    def count(self, text):
        return len(self.tok.encode(text, add_special_tokens=False)) + self.overhead


def fit(sizer, build, budget, lo=1, hi=4096):
    """The largest n with count(build(n)) <= budget (binary search over haystack units)."""
    while sizer.count(build(hi)) <= budget:
        hi *= 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sizer.count(build(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def essay_sentences():
    with open(ESSAY, encoding="utf-8") as f:
        text = " ".join(f.read().split())
    out, cur = [], []
    for word in text.split(" "):
        cur.append(word)
        if word.endswith((".", "?", "!")):
            out.append(" ".join(cur))
            cur = []
    return out


def insert_at(units, items, depths):
    """units with items[i] inserted at fractional depth depths[i] (RULER inserts needles
    between sentences of the haystack)."""
    units = list(units)
    for item, d in sorted(zip(items, depths), key=lambda p: -p[1]):
        units.insert(int(round(d * len(units))), item)
    return units


def niah_single(rng, sizer, length, idx):
    """RULER niah_single_1: noise haystack, one number needle, one question."""
    key, value = rng.choice(WORDS) + "-" + rng.choice(WORDS), str(rng.randint(1000000, 9999999))
    needle = NIAH_NEEDLE.format(type_needle_v="numbers", key=key, value=value)
    depth = rng.random()

    def build(n):
        ctx = " ".join(insert_at([NOISE] * n, [needle], [depth]))
        return NIAH_TEMPLATE.format(type_needle_v="numbers", context=ctx, query=key) + \
            NIAH_PREFIX.format(type_needle_v="numbers", query=key)
    n = fit(sizer, build, length - MAX_NEW_TOKENS["niah"])
    return [{"index": idx, "input": build(n), "outputs": [value], "length": sizer.count(build(n))}]


def niah_multikey(rng, sizer, length, idx, essay, keys=4):
    """RULER niah_multikey_1: essay haystack, 4 keys with one number each, one of them
    asked. (One row per context: the answer prefix names the key, and evaluate.py requires
    one answer prefix per context group.)"""
    names = rng.sample(WORDS, keys * 2)
    pairs = [(names[2 * i] + "-" + names[2 * i + 1], str(rng.randint(1000000, 9999999))) for i in range(keys)]
    needles = [NIAH_NEEDLE.format(type_needle_v="numbers", key=k, value=v) for k, v in pairs]
    depths = [rng.random() for _ in pairs]
    start = rng.randrange(len(essay))

    def hay(n):
        return [essay[(start + i) % len(essay)] for i in range(n)]

    def build(n, query):
        ctx = " ".join(insert_at(hay(n), needles, depths))
        return NIAH_TEMPLATE.format(type_needle_v="numbers", context=ctx, query=query) + \
            NIAH_PREFIX.format(type_needle_v="numbers", query=query)
    longest = max((k for k, _ in pairs), key=lambda k: sizer.count(k))
    n = fit(sizer, lambda n: build(n, longest), length - MAX_NEW_TOKENS["niah"])
    k, v = pairs[rng.randrange(keys)]
    return [{"index": idx, "input": build(n, k), "outputs": [v], "length": sizer.count(build(n, k))}]


def variable_tracking(rng, sizer, length, idx, hops=4):
    """RULER vt (1 chain, 4 hops): VAR X1 = 12345, VAR X2 = VAR X1, ... in the noise
    haystack; all 5 names are the answer."""
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = set()
    while len(names) < hops + 1:
        names.add("".join(rng.choice(letters) for _ in range(5)))
    names = sorted(names)
    rng.shuffle(names)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i]} = VAR {names[i - 1]}" for i in range(1, hops + 1)]
    depths = sorted(rng.random() for _ in chain)  # the chain keeps its order in the text

    def build(n):
        ctx = " ".join(insert_at([NOISE] * n, [c + "." for c in chain], depths))
        return VT_TEMPLATE.format(context=ctx, query=value) + VT_PREFIX.format(num_v=hops + 1, query=value)
    n = fit(sizer, build, length - MAX_NEW_TOKENS["vt"])
    return [{"index": idx, "input": build(n), "outputs": names, "length": sizer.count(build(n))}]


def qa_docs(rng, sizer, length, idx, essay, questions=4):
    """qa_1-style: documents; `questions` of them hold a made-up fact, the rest are essay
    paragraphs; one row per fact question over the same context (string_match_part)."""
    facts = []
    for rel, q in rng.sample(RELATIONS, questions):
        e, a = name(rng), name(rng, 2)
        facts.append((rel.format(e=e, a=a), q.format(e=e), a))
    start = rng.randrange(len(essay))
    fact_docs = [rng.random() for _ in facts]

    def build(n, query):
        paras = [" ".join(essay[(start + 4 * i + j) % len(essay)] for j in range(4)) for i in range(n)]
        docs = insert_at(paras, [f[0] for f in facts], fact_docs)
        ctx = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        return QA_TEMPLATE.format(context=ctx, query=query) + QA_PREFIX
    longest = max((f[1] for f in facts), key=lambda q: sizer.count(q))
    n = fit(sizer, lambda n: build(n, longest), length - MAX_NEW_TOKENS["qa"])
    return [{"index": idx + i, "input": build(n, q), "outputs": [a], "length": sizer.count(build(n, q))}
            for i, (_, q, a) in enumerate(facts)]


TASKS = {
    "niah_single_1": lambda rng, s, n, i, e: niah_single(rng, s, n, i),
    "niah_multikey_1": niah_multikey,
    "vt_1": lambda rng, s, n, i, e: variable_tracking(rng, s, n, i),
    "qa_1": qa_docs,
}


def needle_haystack(out_dir, essay):
    """needle_in_haystack: the alessiodevoto/paul_graham_essays schema, one row; the
    haystack is the essay text, evaluate.py cuts it to --max_context_length and inserts the
    needle at --needle_depth (its insert_needle_in_haystack), scores with ROUGE."""
    import pandas as pd
    row = {
        "context": " ".join(essay * 2),  # ~30K tokens: enough for an 8K cut
        "needle": "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
        "question": "What is the best thing to do in San Francisco?",
        "answer_prefix": "Answer: The best thing to do in San Francisco is",
        "max_new_tokens": 32,
    }
    os.makedirs(out_dir, exist_ok=True)
    pd.DataFrame([row]).to_parquet(os.path.join(out_dir, "test-00000-of-00001.parquet"), index=False)


def generate(out, tokenizer, sdist, lengths, rows, seed, tasks):
    """Writes OUT/ruler-raw/<len>/<task>/validation.jsonl, OUT/ruler/<len>/test-*.parquet
    (through kvpress's converter) and OUT/needle_in_haystack/test-*.parquet."""
    sys.path.insert(0, os.path.join(sdist, "evaluation"))
    from benchmarks.ruler.create_huggingface_dataset import get_dataframe  # the harness's own converter
    sizer = Sizer(tokenizer)
    essay = essay_sentences()
    for length in lengths:
        raw = os.path.join(out, "ruler-raw", str(length))
        for task in tasks:
            # One RNG per (seed, task, length): adding a task or a length changes no other file.
            rng = random.Random(f"{seed}/{task}/{length}")
            samples, idx = [], 0
            while len(samples) < rows:
                got = TASKS[task](rng, sizer, length, idx, essay)
                samples += got
                idx += len(got)
            os.makedirs(os.path.join(raw, task), exist_ok=True)
            with open(os.path.join(raw, task, "validation.jsonl"), "w") as f:
                for s in samples[:rows] if task != "qa_1" else samples:
                    f.write(json.dumps(s) + "\n")
        df = get_dataframe(raw)
        df = df.sort_values(["task"], kind="stable").reset_index(drop=True)
        dst = os.path.join(out, "ruler", str(length))
        os.makedirs(dst, exist_ok=True)
        df.to_parquet(os.path.join(dst, "test-00000-of-00001.parquet"), index=False)
        print(f"harness_data: {dst}: {len(df)} rows, "
              + ", ".join(f"{t}={n}" for t, n in df["task"].value_counts().sort_index().items()), file=sys.stderr)
    needle_haystack(os.path.join(out, "needle_in_haystack"), essay)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default=os.path.expanduser("~/.cache/kvgc/smollm2-hf"))
    p.add_argument("--sdist", required=True, help="the unpacked kvpress sdist (kvpress-0.5.5/)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--rows", type=int, default=25, help="rows per task (multi-question tasks round up to whole contexts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    a = p.parse_args()
    generate(a.out, a.tokenizer, a.sdist, a.lengths, a.rows, a.seed, a.tasks)


if __name__ == "__main__":
    main()
