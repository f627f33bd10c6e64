#!/usr/bin/env python3
"""Runs the shell commands README.md and docs/*.md show: as written, or in a smoke mode.

    python3 tools/check-doc-commands.py [--list] [--only TEXT] [--build DIR] [--keep] [FILE ...]

What counts as a command (README.md and docs/*.md, or the FILEs given):
- every line of a ```sh / ```bash / ```shell block (comments dropped, `\\` continuations
  joined, a `for ... done` loop as one command);
- in a ```console block, or any block with `$ ` lines, each `$ ` line; the lines after it
  are its expected output: each must appear in what it prints, in order (a line in
  parentheses is a note, and "exit status N" in one is the exit status expected, else 0);
- in a plain ``` block, each line whose first word is a program (a record's command
  above its output);
- in the text and tables, an inline `code span` that starts (after `VAR=value` words)
  with `make TARGET`, an interpreter or tool with arguments (python, bash, ninja, meson,
  pip, env), a path under build/, an executable file of the tree, or `kvgc-NAME` with
  arguments. A path alone (`tools/gguf.cpp`, `bench/gpu-check.sh`) or a bare program name
  is a name (a built program's path, `build/bench/kvgc-bench-batch`, is a command).

Each command lands in exactly one class, by the tables below (PROGRAMS, by the program
each part of the command runs, and OVERRIDES, by the whole command, first):
- run: run as written (from a scratch copy of docs/ beside links to the rest of the
  tree, so nothing it writes lands in the tree; build/tools, build/bench and build/tests
  on PATH, so `kvgc-plan ...` means the built one);
- smoke: rewritten by its program's rule to a few prompts, steps or tokens through flags
  the program has (a benchmark's --quick, kvgc-run's --max-tokens 4, kvgc-bench-quality's
  smallest grid after a --export pass over every flag and configuration name as written),
  then run;
- syntax: needs another environment (a venv of torch, vLLM or the anchors, a GPU, root,
  the network, an hour): only checked: the program exists (a file of the tree, a built
  binary, a Makefile target, a ninja target) and takes each --flag given (named in the
  binary, or in the script or a script beside it);
- skip: not run or checked, for the reason given.
A command no table classifies fails the check: a new doc command needs a decision here.
A smoke rewrite's steps (the --export pass, the run) run once per check: the same step of
another command counts as run.
A `&&` chain's class is its weakest part's (syntax if any part is, then smoke, then run).
Commands that need the model (tools/fetch-model.sh) or the torch venv (make test-python)
are skipped without them, and fail for a missing model when KVGC_REQUIRE_MODEL=1 (CI).

Prints a table (doc:line, class, result, seconds, command), then each failure with its
doc file and line, the command run and the end of its output; exits 1 on any failure or
unclassified command. Python 3 standard library only.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

FENCE = re.compile(r"^ {0,3}(```+|~~~+)\s*([\w+-]*)")
SHELL_LANGS = {"sh", "bash", "shell", "console"}
ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
TOOL_WORDS = {"make", "ninja", "meson", "python", "python3", "bash", "sh", "pip", "pip3", "env"}
INTERPRETERS = {"python", "python3", "bash", "sh"}
PLACEHOLDER = re.compile(r"(?<![\w$/.-])(FILE|DIR|NAME|TASK|N|S|W)(?![\w/.-])")
TIMEOUT = 180

# ---------------------------------------------------------------------------------------
# The tables. Class per program (the key: a built program's name, a script's path in the
# tree, `make TARGET`, or a tool), with its smoke rule or its syntax check and the reason.
# A program's entry: (class, reason, options); options: "smoke" names the rewrite,
# "needs" model / torch, "python" the interpreter `python` means (build: the build venv,
# numpy; torch: make test-python's venv), "ci" a make target .ci/run must run, "in_tree"
# run in the tree itself, not the scratch copy (for what writes nothing).

PROGRAMS = {
    # Fast: run as written.
    "kvgc-plan": ("run", "reads a config, prints a plan", {}),
    "tools/fetch-model.sh": ("run", "idempotent: checks the model CI fetched", {}),
    "assign": ("run", "a shell variable later commands of the doc use", {}),
    # Smoke: a few prompts, steps or tokens.
    "kvgc-run": ("smoke", "--max-tokens 4; FILE a scratch file", {"smoke": "engine", "needs": "model"}),
    "kvgc-serve": ("smoke", "--max-tokens 4; FILE two short prompts", {"smoke": "engine", "needs": "model"}),
    "kvgc-stress": ("smoke", "ITER at most 300 (CI's own runs: 4 8 300)", {"smoke": "stress"}),
    "kvgc-bench-serve": ("smoke", "2 requests, prompts of 64-96 tokens, outputs of 2-4",
                         {"smoke": "serve", "needs": "model"}),
    "kvgc-bench-quality": ("smoke", "an --export pass over every flag, part and configuration "
                           "as written, then its first part (not perplexity: 1K scored tokens "
                           "a configuration) and configuration at 10%, 64-token contexts, one depth",
                           {"smoke": "quality", "needs": "model"}),
    "kvgc-bench-alloc": ("smoke", "--quick", {"smoke": "quick"}),
    "kvgc-bench-attend": ("smoke", "--quick", {"smoke": "quick"}),
    "kvgc-bench-batch": ("smoke", "--quick", {"smoke": "quick"}),
    "kvgc-bench-gc": ("smoke", "--quick", {"smoke": "quick"}),
    "kvgc-bench-prefix": ("smoke", "--quick", {"smoke": "quick"}),
    "ninja": ("smoke", "the build is CI's earlier step: the target is looked up in "
              "build.ninja, not rebuilt", {"smoke": "ninja"}),
    "make demo": ("smoke", "DEMO_DOC 2 KB of the GPL (not 35 KB); build, deps and model "
                  "not remade (-o)", {"smoke": "make_demo", "needs": "model"}),
    "make demo-alloc": ("smoke", "build and deps not remade (-o)", {"smoke": "make_o"}),
    "make check-docs": ("run", "a second: the docs' links and sections; in the tree itself "
                        "(it writes nothing; it lists the tree's files with git)", {"in_tree": True}),
    "make check-doc-commands": ("syntax", "this check; CI runs it (.ci/run)", {"ci": True}),
    "bench/anchors/report.py": ("smoke", "results the other-environment steps before it "
                                "write: the record's, in docs/quality", {"smoke": "report"}),
    "bench/python_binding.py": ("smoke", "--reps 200 --rounds 1, the build venv's python "
                                "(numpy)", {"smoke": "binding", "python": "build"}),
    "bench/python_decode.py": ("smoke", "--decode: --context 64 --new 2; else --contexts 64 "
                               "--reps 1; `python` is the torch venv's",
                               {"smoke": "decode", "python": "torch", "needs": "torch"}),
    # Another environment: checked for syntax only.
    "make test": ("syntax", "CI runs it (.ci/run)", {"ci": True}),
    "make sanitize": ("syntax", "CI runs it (.ci/run)", {"ci": True}),
    "make fuzz": ("syntax", "CI runs it (.ci/run), 20-45 s a harness", {"ci": True}),
    "make cuda-emu": ("syntax", "CI runs it (.ci/run)", {"ci": True}),
    "make test-python": ("syntax", "CI runs it (.ci/run): a torch venv, ~6 GB", {"ci": True}),
    "make test-vllm": ("syntax", "CI runs it (.ci/run): the vLLM venv, ~6 GB", {"ci": True}),
    "make docs": ("syntax", "CI runs it (.ci/run): Doxygen, and pdoc in the torch venv",
                  {"ci": True}),
    "make model": ("syntax", "CI runs tools/fetch-model.sh (network)", {}),
    "make bench": ("syntax", "the full benchmarks, minutes; each runs with --quick here", {}),
    "meson test": ("syntax", "make test runs every suite", {}),
    "pip": ("syntax", "installs from PyPI into the current Python (network)", {}),
    "tools/setup-deps.sh": ("syntax", "apt-get as root; CI's first stage", {}),
    "tools/vllm-venv.sh": ("syntax", "the vLLM venv (~6 GB, network)", {}),
    "tools/vllm-model.py": ("syntax", "the vLLM venv", {}),
    "vllm": ("syntax", "vLLM's server, in the vLLM venv", {}),
    "bench/vllm_bench.py": ("syntax", "the vLLM venv, two servers, an hour", {}),
    "bench/anchors/venv.sh": ("syntax", "builds the anchors' venv (network, minutes)", {}),
    "bench/anchors/kvpress_quality.py": ("syntax", "the anchors' kvpress venv", {}),
    "bench/anchors/llama_quality.py": ("syntax", "the anchors' llama.cpp venv", {}),
    "bench/anchors/llama_cpp.sh": ("syntax", "the anchors' llama.cpp venv", {}),
    "bench/anchors/quality.sh": ("syntax", "the anchors' venvs", {}),
    "bench/anchors/kvpress_harness.sh": ("syntax", "the torch venv with kvpress's eval extras "
                                         "(network), minutes a cell", {}),
    "bench/per_head_mass.py": ("syntax", "the torch venv, the HF checkpoint and an exported "
                               "tasks.jsonl; minutes", {}),
    "bench/gpu-check.sh": ("syntax", "a GPU (--prepare: nvcc, minutes)", {}),
    "tests/mutation/run.sh": ("syntax", "not in CI: rebuilds a scratch tree per mutant", {}),
    "tests/valgrind.sh": ("syntax", "make test runs it (valgrind-ladder)", {}),
    "tests/install_test.sh": ("syntax", "make test runs it (install)", {}),
}

# By the whole command (normalised: one line), before PROGRAMS: (regex, class, reason, options).
OVERRIDES = [
    (r"^\.ci/run$", "skip", "CI itself", {}),
    (r"^meson test$", "skip", "the test runner named in prose", {}),
    (r"^build-fuzz/tests/kvgc-fuzz-NAME ", "skip",
     "a template (NAME: each harness) with make fuzz's flags; CI runs make fuzz", {}),
    (r"^kvgc-stress THREADS ", "syntax", "the synopsis", {}),
    (r"^kvgc-bench-serve --shared-prefix N$", "syntax", "a flag named in prose", {}),
    (r"^kvgc-run --prompt-file$", "syntax", "a flag named in prose", {}),
    (r"^kvgc-serve /dev/zero$", "run", "refuses the endless file: exit status 2",
     {"rc": 2, "needs": "model"}),
]

RANK = {"run": 0, "smoke": 1, "syntax": 2, "skip": 3}

# ---------------------------------------------------------------------------------------
# Extraction.


class Cmd:
    def __init__(self, doc, line, form, text):
        self.doc, self.line, self.form, self.text = doc, line, form, text
        self.expect = []      # console blocks: output lines expected, in order
        self.rc = 0
        self.cls = self.reason = None
        self.opts = {}
        self.parts = []
        self.result, self.secs, self.detail, self.ran = "", 0.0, "", ""

    @property
    def one_line(self):
        return " ".join(self.text.split())


def split_words(text):
    """Shell-like words: whitespace outside quotes and $( ) splits; quotes kept."""
    out, cur, q, depth = [], "", None, 0
    i = 0
    while i < len(text):
        c = text[i]
        if q:
            cur += c
            if c == q:
                q = None
        elif c in "'\"":
            q = c
            cur += c
        elif c == "$" and text[i + 1:i + 2] == "(":
            depth += 1
            cur += "$("
            i += 1
        elif c == ")" and depth:
            depth -= 1
            cur += c
        elif c.isspace() and not depth:
            if cur:
                out.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    if cur:
        out.append(cur)
    return out


def strip_comment(line):
    q, depth = None, 0
    for i, c in enumerate(line):
        if q:
            if c == q:
                q = None
        elif c in "'\"":
            q = c
        elif c == "(" and line[i - 1:i] == "$":
            depth += 1
        elif c == ")" and depth:
            depth -= 1
        elif c == "#" and depth == 0 and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


class Tree:
    def __init__(self, root, build):
        self.root, self.build = root, build

    def executable(self, path):
        p = os.path.join(self.root, path)
        return os.path.isfile(p) and os.access(p, os.X_OK)

    def built(self, name):
        for d in ("tools", "bench", "tests"):
            p = os.path.join(self.build, d, name)
            if os.path.isfile(p):
                return p
        return None


def looks_like_command(tree, text, inline=False):
    words = split_words(text)
    i = 0
    while i < len(words) and ASSIGN.match(words[i]):
        i += 1
    if i >= len(words):
        return False
    w, rest = words[i], words[i + 1:]
    if w in TOOL_WORDS:
        return bool(rest)
    if w == "for":
        return bool(re.match(r"^for \w+ in .*;\s*do\b", text, re.S))
    if w.startswith("$"):
        return bool(rest)
    if "*" in w or w.endswith("/"):
        return False
    if w.startswith(("build/", "./build/", "build-")):
        return True
    if w.startswith("~/"):
        return bool(rest)
    if "/" in w and tree.executable(w):
        return bool(rest) or not inline  # in prose a script's path alone names it
    return bool(re.match(r"^kvgc-[a-z-]+$", w) and rest)


def extract(tree, path, shown):
    lines = open(path, encoding="utf-8").read().split("\n")
    cmds, i, para = [], 0, []

    def flush_para():
        text = "\n".join(l for _, l in para)
        starts = [n for n, _ in para]
        offsets, pos = [], 0
        for _, l in para:
            offsets.append(pos)
            pos += len(l) + 1
        for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
            span = " ".join(m.group(1).split())
            if looks_like_command(tree, span, inline=True):
                k = max(j for j, o in enumerate(offsets) if o <= m.start())
                cmds.append(Cmd(shown, starts[k], "inline", span))
        para.clear()

    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            flush_para()
            lang = m.group(2).lower()
            j, body = i + 1, []
            while j < len(lines) and not lines[j].lstrip().startswith(m.group(1)):
                body.append((j + 1, lines[j]))
                j += 1
            if lang in SHELL_LANGS or lang == "":
                cmds += block_commands(tree, shown, lang, body)
            i = j + 1
            continue
        if not lines[i].strip():
            flush_para()
        else:
            para.append((i + 1, lines[i]))
        i += 1
    flush_para()
    return cmds


def block_commands(tree, shown, lang, body):
    cmds = []
    console = lang == "console" or any(l.startswith("$ ") for _, l in body)
    k = 0
    while k < len(body):
        ln, l = body[k]
        if console and not l.startswith("$ "):
            if cmds and l.strip():
                note = l.strip()
                if note.startswith("(") and note.endswith(")"):
                    m = re.search(r"exit status (\d+)", note)
                    if m:
                        cmds[-1].rc = int(m.group(1))
                else:
                    cmds[-1].expect.append(l.rstrip())
            k += 1
            continue
        s = strip_comment(l[2:] if console else l)
        if not s.strip() or (lang == "" and not console and not looks_like_command(tree, s.strip())):
            k += 1
            continue
        text = s.strip()
        while text.endswith("\\") and k + 1 < len(body):
            k += 1
            text = text[:-1].rstrip() + " " + strip_comment(body[k][1]).strip()
        if re.match(r"^(for|while|if)\b", text):
            while not re.search(r"\b(done|fi)\s*$", text) and k + 1 < len(body):
                k += 1
                text += "\n" + strip_comment(body[k][1])
        cmds.append(Cmd(shown, ln, "console" if console else "block", text))
        k += 1
    return cmds

# ---------------------------------------------------------------------------------------
# Classification: the program each part of a command runs.


def split_and(text):
    """Top-level `&&` parts (outside quotes and $( ))."""
    parts, cur, q, depth, i = [], "", None, 0, 0
    while i < len(text):
        c = text[i]
        if q:
            q = None if c == q else q
        elif c in "'\"":
            q = c
        elif text.startswith("$(", i):
            depth += 1
        elif c == ")" and depth:
            depth -= 1
        elif text.startswith("&&", i) and not depth:
            parts.append(cur.strip())
            cur, i = "", i + 2
            continue
        cur += c
        i += 1
    parts.append(cur.strip())
    return parts


def program_of(tree, part):
    """(key, words from the program on, interpreter or None) of one simple command."""
    if part.startswith("for "):
        m = re.search(r"\bdo\b(.*)\bdone\b", part, re.S)
        body = m.group(1).strip().strip(";") if m else ""
        key, words, interp = program_of(tree, body)
        return key, words, interp
    words = split_words(part)
    i = 0
    while i < len(words) and ASSIGN.match(words[i]):
        i += 1
    if i == len(words):
        inner = re.findall(r"\$\(([^)]*)\)", part)
        for c in inner:
            k, w, interp = program_of(tree, c)
            if k in PROGRAMS and k != "assign":
                return k, w, interp
        return "assign", words, None
    words = words[i:]
    if words[0] == "env":
        words = words[1:]
        while words and (ASSIGN.match(words[0]) or re.match(r"^\$\w+$", words[0])):
            words = words[1:]
    if not words:
        return None, [], None
    w = words[0]
    interp = None
    venv = re.match(r"^~/\.cache/kvgc/([\w.-]+)/bin/(\w+)$", w)
    if w in INTERPRETERS or w.startswith("$") or (venv and venv.group(2).startswith("python")):
        interp, words = w, words[1:]
        if not words:
            return None, [], interp
        w = words[0]
    elif venv:
        return venv.group(2), words, w
    if w in ("make", "meson"):
        return (f"{w} {words[1]}" if len(words) > 1 else w), words, None
    if w in ("ninja", "pip", "pip3"):
        return w.rstrip("3"), words, None
    name = w[2:] if w.startswith("./") else w
    if name.startswith("build/") or "/" not in name:
        return os.path.basename(name), words, interp
    return name, words, interp


def classify(tree, cmd):
    one = cmd.one_line
    for rx, cls, reason, opts in OVERRIDES:
        if re.search(rx, one):
            cmd.cls, cmd.reason, cmd.opts = cls, reason, dict(opts)
            if "rc" in opts:
                cmd.rc = opts["rc"]
            cmd.parts = [(p,) + program_of(tree, p) for p in split_and(cmd.text)]
            return True
    cmd.parts, classes, reasons = [], [], []
    for p in split_and(cmd.text):
        key, words, interp = program_of(tree, p)
        if key not in PROGRAMS:
            cmd.cls, cmd.reason = None, f"no rule for program {key!r}"
            return False
        cls, reason, opts = PROGRAMS[key]
        cmd.parts.append((p, key, words, interp))
        classes.append(cls)
        reasons.append(reason)
        for k, v in opts.items():
            if k == "needs":
                cmd.opts.setdefault("needs", set()).add(v)
            else:
                cmd.opts[k] = v
    worst = max(classes, key=RANK.get)
    cmd.cls = worst
    cmd.reason = "; ".join(r for c, r in zip(classes, reasons) if c == worst)
    return True

# ---------------------------------------------------------------------------------------
# Syntax checks.


def flags_of(words):
    out = []
    for w in words:
        w = w.strip("[]")
        if re.match(r"^--[a-z][\w-]*", w):
            out.append(w.split("=", 1)[0] + ("=" if "=" in w else ""))
    return out


def flag_sources(tree, script):
    """The script and the scripts beside it (a wrapper's runner, a shared argparse module)."""
    d = os.path.dirname(os.path.join(tree.root, script))
    texts = []
    for f in sorted(os.listdir(d)):
        if f.endswith((".py", ".sh")):
            texts.append(open(os.path.join(d, f), encoding="utf-8", errors="replace").read())
    return "\n".join(texts)


def check_syntax(tree, cmd):
    """Problems with a command's programs and flags, as strings (none: passes)."""
    problems = []
    for part, key, words, interp in cmd.parts:
        if key is None:
            problems.append(f"no program in {part!r}")
            continue
        args = words[1:]
        if key.startswith("make "):
            target = key.split(" ", 1)[1]
            mk = open(os.path.join(tree.root, "Makefile"), encoding="utf-8").read()
            if not re.search(rf"^{re.escape(target)}\s*:", mk, re.M):
                problems.append(f"make: no target {target!r} in the Makefile")
            for a in args[1:]:
                if ASSIGN.match(a) and not re.search(rf"\b{a.split('=')[0]}\b", mk):
                    problems.append(f"make: the Makefile has no variable {a.split('=')[0]}")
            if PROGRAMS.get(key, ("", "", {}))[2].get("ci"):
                ci = open(os.path.join(tree.root, ".ci/run"), encoding="utf-8").read()
                if not re.search(rf"\bmake {re.escape(target)}\b", ci):
                    problems.append(f"said to run in CI, but .ci/run has no 'make {target}'")
        elif key == "meson test":
            if "-C" not in args:
                problems.append("meson test outside a build directory needs -C build")
            for s in re.findall(r"--suite[= ](\S+)", " ".join(args)):
                found = subprocess.run(["grep", "-rqs", "--include=meson.build",
                                        f"suite: '{s}'", tree.root]).returncode == 0
                if not found:
                    problems.append(f"meson test: no suite {s!r} in any meson.build")
        elif key == "pip":
            py = open(os.path.join(tree.root, "pyproject.toml"), encoding="utf-8").read()
            for a in args[1:]:
                m = re.match(r"^[\"']?\.(?:\[([\w,-]+)\])?[\"']?$", a)
                if m and m.group(1):
                    for extra in m.group(1).split(","):
                        if not re.search(rf"^{re.escape(extra)}\s*=", py, re.M):
                            problems.append(f"pyproject.toml has no extra {extra!r}")
        elif key == "ninja":
            problems += ninja_problems(tree, args)
        elif key == "vllm":
            if not os.path.isfile(os.path.join(tree.root, "tools/vllm-venv.sh")):
                problems.append("tools/vllm-venv.sh (which installs vllm) is missing")
        elif re.match(r"^kvgc-[\w-]+$", key):
            exe = tree.built(key)
            if not exe:
                problems.append(f"{key}: not built (in {tree.build}/tools, bench or tests)")
                continue
            blob = open(exe, "rb").read()
            for f in flags_of(args):
                if f.encode() not in blob:
                    problems.append(f"{key} does not know {f.rstrip('=')}")
        elif key == "assign":
            pass
        else:
            if not os.path.isfile(os.path.join(tree.root, key)):
                problems.append(f"{key}: no such file")
                continue
            if interp is None and not tree.executable(key):
                problems.append(f"{key}: not executable (run it with an interpreter?)")
            src = flag_sources(tree, key)
            for f in flags_of(args):
                if not re.search(rf"(?<![\w-]){re.escape(f.rstrip('='))}(?![\w-])", src):
                    problems.append(f"{key} does not take {f.rstrip('=')}")
            if key == "bench/anchors/venv.sh":
                for g in args:
                    if not os.path.isfile(os.path.join(tree.root, f"bench/anchors/requirements-{g}.txt")):
                        problems.append(f"venv.sh: no group {g!r}")
            if key == "bench/anchors/llama_cpp.sh" and args:
                if not re.search(rf"\b{re.escape(args[0])}\b", src):
                    problems.append(f"llama_cpp.sh: no mode {args[0]!r}")
        if interp:
            problems += interpreter_problems(tree, cmd, interp)
    return problems


def interpreter_problems(tree, cmd, interp):
    venvs = {"vllm-venv": "tools/vllm-venv.sh", "pyvenv": "tools/test-python.sh",
             "anchors-venv": "bench/anchors/venv.sh"}
    m = re.match(r"^~/\.cache/kvgc/([\w.-]+)/bin/", interp)
    if m:
        maker = venvs.get(m.group(1))
        if not maker:
            return [f"{interp}: no script of the tree makes the venv {m.group(1)}"]
        if m.group(1) not in open(os.path.join(tree.root, maker), encoding="utf-8").read():
            return [f"{maker} does not make {m.group(1)}"]
    m = re.match(r"^\$\((bench/anchors/venv\.sh) (\w+)\)$", interp)
    if m and not os.path.isfile(os.path.join(tree.root, f"bench/anchors/requirements-{m.group(2)}.txt")):
        return [f"venv.sh: no group {m.group(2)!r}"]
    m = re.match(r"^\$(\w+)$", interp)
    if m and m.group(1) not in cmd.assigned:
        return [f"${m.group(1)} is not set by an earlier command of {cmd.doc}"]
    return []


def ninja_problems(tree, args):
    ninja = os.path.join(tree.build, "build.ninja")
    if not os.path.isfile(ninja):
        return [f"{ninja}: missing (not configured)"]
    targets = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] != "-C")]
    if not targets:
        return []
    text = open(ninja, encoding="utf-8", errors="replace").read()
    return [f"ninja: no target {t!r} in {ninja}" for t in targets
            if not re.search(rf"^build {re.escape(t)}( \|)?:", text, re.M)]

# ---------------------------------------------------------------------------------------
# Smoke rewrites: one function per program, on the text of one part.


def set_flag(text, prog, flag, value):
    """flag's value replaced where given, else the flag added after the program word."""
    rx = re.compile(rf"(?<![\w-]){re.escape(flag)}(\s+|=)(\"[^\"]*\"|'[^']*'|\S+)")
    if rx.search(text):
        return rx.sub(lambda m: f"{flag}{m.group(1)}{value}" if value is not None else flag, text)
    return re.sub(rf"((?:^|\s|/){re.escape(prog)})(?=\s|$)",
                  lambda m: f"{m.group(1)} {flag}" + (f" {value}" if value is not None else ""),
                  text, count=1)


def drop_options(text):
    """Optional groups taken: `[--x 1]` -> `--x 1`; `[...]` (more of the same) dropped."""
    text = re.sub(r"\s*\[\.\.\.\]", "", text)
    return re.sub(r"\[(--[^\[\]]*)\]", r"\1", text)


def first_of(text, flag):
    m = re.search(rf"(?<![\w-]){re.escape(flag)}\s+(\S+)", text)
    return m.group(1).split(",")[0] if m else None


def smoke_quick(ctx, text, prog):
    return set_flag(text, prog, "--quick", None)


def smoke_stress(ctx, text, prog):
    def cap(m):
        nums = m.group(2).split()
        if len(nums) >= 3:
            nums[2] = str(min(int(nums[2]), 300))
        return m.group(1) + " ".join(nums)
    return re.sub(r"(kvgc-stress\s+)((?:\d+\s*)+)", cap, text)


def smoke_engine(ctx, text, prog):
    text = re.sub(r"(--profile)\s+FILE", rf"\1 {ctx.tmp}/profile.txt", text)
    text = re.sub(r"(kvgc-serve)\s+FILE", rf"\1 {ctx.prompts}", text)
    text = re.sub(r"(--prompt-file)\s+FILE\b", rf"\1 {ctx.prompts}", text)
    return set_flag(text, prog, "--max-tokens", "4")


def smoke_serve(ctx, text, prog):
    text = drop_options(text)
    text = re.sub(r"(--seed)\s+S\b", r"\1 1", text)
    text = re.sub(r"(--answers)\s+FILE\b", rf"\1 {ctx.tmp}/answers.tsv", text)
    for flag, v in (("--requests", "2"), ("--output-min", "2"), ("--output-max", "4"),
                    ("--rate", "100")):
        text = set_flag(text, prog, flag, v)
    if "--shared-prefix" in text:
        for flag, v in (("--shared-prefix", "64"), ("--private-min", "32"), ("--private-max", "48")):
            text = set_flag(text, prog, flag, v)
    else:
        text = set_flag(text, prog, "--prompt-min", "64")
        text = set_flag(text, prog, "--prompt-max", "96")
    return text


QUALITY_INVOCATION = re.compile(
    r"((?:env\s+(?:\$\w+|\w+=\S+)\s+)*)((?:\./)?(?:build/tools/)?kvgc-bench-quality)([^\n;&|]*)")


def smoke_quality(ctx, text, prog):
    def one(m):
        env, exe, args = m.group(1), m.group(2), m.group(3).rstrip()
        if re.search(r"(?<![\w-])--export\s", args):
            return m.group(0)  # writes the prompts as token ids and exits: fast as written
        validate = f"{env}{exe}{drop_options(args)} --export {ctx.tmp}/validate-tasks.jsonl"
        run = shrink_quality(ctx, args)
        return validate if run is None else f"{validate} && {env}{exe}{run}"
    return QUALITY_INVOCATION.sub(one, text)


def shrink_quality(ctx, args):
    """The smallest run of the command's first part and first configuration, flags in one
    order (so that commands that differ only in grid, budgets or outputs run once)."""
    words = split_words(drop_options(args))
    value = {}
    parts, keep = [], []
    i = 0
    while i < len(words):
        w = words[i]
        if w in ("--observe-only", "--check-replay"):
            keep.append(w)
        elif w == "--only" and i + 1 < len(words):
            parts.append(words[i + 1])
            i += 1
        elif w.startswith("--") and w not in ("--quick", "--full", "--no-plots") and i + 1 < len(words):
            value[w] = words[i + 1]
            i += 1
        i += 1
    parts = ["passkey" if p == "retrieval" else p for p in parts] or ["passkey"]
    parts = [p for p in parts if p != "perplexity"]
    if not parts:
        return None  # the perplexity part has no length flag (1K scored tokens a config)
    config = value.get("--configs", "default@bytes").split(",")[0]
    out = [f"--only {parts[0]}", f"--configs {config}", "--fractions 0.1", "--contexts 64",
           "--depths 0.5", "--offsets 0", "--prompts 1"] + sorted(keep)
    out += [f"{f} {value[f]}" for f in ("--text", "--text2", "--model") if f in value]
    out += ["--jobs 1", f"--out {ctx.tmp}/quality", "--no-plots"]
    return " " + " ".join(out)


def smoke_ninja(ctx, text, prog):
    problems = ninja_problems(ctx.tree, split_words(text)[1:])
    if problems:
        raise SmokeError("; ".join(problems))
    return "true"


def smoke_make_demo(ctx, text, prog):
    return re.sub(r"^make\s+demo\b", f"make -o build -o deps -o model demo DEMO_DOC={ctx.demo_doc}", text)


def smoke_make_o(ctx, text, prog):
    return re.sub(r"^make\s+", "make -o build -o deps -o model ", text)


def smoke_report(ctx, text, prog):
    words = split_words(text)
    prefix = first_of(text, "--prefix") or "anchors"
    stem = prefix[:-len("-anchors")] if prefix.endswith("-anchors") else prefix
    out, skip = [], False
    for i, w in enumerate(words):
        if skip:
            out.append(w)
            skip = False
            continue
        if w.startswith("--"):
            out.append(w)
            skip = w in ("--out", "--prefix")
            continue
        if w == "...":
            out.append(f"docs/quality/{stem}-*.jsonl")
        elif w.endswith(".jsonl") and not os.path.exists(os.path.join(ctx.shadow, w)) \
                and i > 0 and not words[i - 1].startswith("--paired"):
            out.append(f"docs/quality/{stem}-{w}")
        else:
            out.append(w)
    return " ".join(out)


def smoke_binding(ctx, text, prog):
    return text + " --reps 200 --rounds 1"


def smoke_decode(ctx, text, prog):
    text = drop_options(text)
    if re.search(r"--decode\b", text):
        text = set_flag(text, prog, "--context", "64")
        return set_flag(text, prog, "--new", "2")
    text = set_flag(text, prog, "--contexts", "64")
    return set_flag(text, prog, "--reps", "1")


SMOKE = {"quick": smoke_quick, "stress": smoke_stress, "engine": smoke_engine,
         "serve": smoke_serve, "quality": smoke_quality, "ninja": smoke_ninja,
         "make_demo": smoke_make_demo, "make_o": smoke_make_o, "report": smoke_report,
         "binding": smoke_binding, "decode": smoke_decode}


class SmokeError(Exception):
    pass

# ---------------------------------------------------------------------------------------
# Running.


class Context:
    def __init__(self, tree, keep):
        self.tree = tree
        self.tmp = tempfile.mkdtemp(prefix="kvgc-doc-commands-")
        self.keep = keep
        self.shadow = os.path.join(self.tmp, "tree")
        os.makedirs(self.shadow)
        for e in os.listdir(tree.root):
            if e in (".git", "docs", "build"):
                continue
            os.symlink(os.path.join(tree.root, e), os.path.join(self.shadow, e))
        os.symlink(tree.build, os.path.join(self.shadow, "build"))
        shared = os.path.join(os.path.dirname(tree.root), "shared")  # ../shared/DESIGN.md, the brief
        if os.path.isdir(shared):
            os.symlink(shared, os.path.join(self.tmp, "shared"))
        shutil.copytree(os.path.join(tree.root, "docs"), os.path.join(self.shadow, "docs"),
                        symlinks=True)
        self.prompts = os.path.join(self.tmp, "prompts.txt")
        with open(self.prompts, "w") as f:
            f.write("What is the capital of France?\nName a colour.\n")
        self.demo_doc = os.path.join(self.tmp, "demo-doc.txt")
        with open(os.path.join(tree.root, "bench/quality_data/gpl-3.txt"), "rb") as f:
            open(self.demo_doc, "wb").write(f.read(2000))
        home = os.path.expanduser("~/.cache/kvgc")
        self.pythons = {
            "build": os.path.join(os.environ.get("KVGC_BUILD_VENV", f"{home}/build-venv"), "bin/python"),
            "torch": os.path.join(os.environ.get("KVGC_PY_VENV", f"{home}/pyvenv"), "bin/python"),
        }
        self.model = os.environ.get("KVGC_MODEL", f"{home}/SmolLM2-135M-Instruct.Q4_1.gguf")
        self.done = {}  # rewritten text -> (result, detail): one run for the same command

    def env(self, python):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("KVGC_") or k in ("KVGC_BUILD_VENV", "KVGC_PY_VENV", "KVGC_MODEL",
                                                     "KVGC_MODEL_DIR", "KVGC_REQUIRE_MODEL")}
        path = [os.path.join(self.tree.build, d) for d in ("tools", "bench", "tests")]
        if python:
            shim = os.path.join(self.tmp, "bin-" + python)
            if not os.path.isdir(shim):
                os.makedirs(shim)
                for n in ("python", "python3"):  # a wrapper: a venv's python finds its venv by its path
                    with open(os.path.join(shim, n), "w") as f:
                        f.write(f'#!/bin/sh\nexec "{self.pythons[python]}" "$@"\n')
                    os.chmod(os.path.join(shim, n), 0o755)
            path.insert(0, shim)
        env["PATH"] = ":".join(path + [env.get("PATH", "")])
        return env

    def close(self):
        if not self.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)


def run_shell(ctx, cmd, text):
    script = "set -eo pipefail\n" + cmd.prelude + text + "\n"
    t0 = time.time()
    try:
        cwd = ctx.tree.root if cmd.opts.get("in_tree") else ctx.shadow
        p = subprocess.run(["bash", "-c", script], cwd=cwd, env=ctx.env(cmd.opts.get("python")),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           timeout=TIMEOUT)
        out, rc = p.stdout.decode("utf-8", "replace"), p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode("utf-8", "replace") + f"\n(timed out after {TIMEOUT} s)", 124
    return rc, out, time.time() - t0


def execute(ctx, cmd):
    needs = cmd.opts.get("needs", set())
    needs = {needs} if isinstance(needs, str) else needs
    if "model" in needs and not os.path.isfile(ctx.model):
        why = f"no model at {ctx.model} (tools/fetch-model.sh)"
        if os.environ.get("KVGC_REQUIRE_MODEL") == "1":
            return "FAIL", why
        return "SKIP", why
    if "torch" in needs and not os.path.isfile(ctx.pythons["torch"]):
        return "SKIP", f"no torch venv at {ctx.pythons['torch']} (make test-python makes it)"
    text = cmd.text
    if cmd.cls == "smoke":
        try:
            new = []
            for part, key, words, interp in cmd.parts:
                rule = PROGRAMS.get(key, ("", "", {}))[2].get("smoke")
                prog = os.path.basename(words[0]) if words else key
                new.append(SMOKE[rule](ctx, part, prog) if rule else part)
            text = " && ".join(new)
            # a loop over settings: its first setting
            text = re.sub(r"^(for \w+ in )(.*?)(;\s*do\b)",
                          lambda m: m.group(1) + split_words(m.group(2))[0] + m.group(3), text)
        except SmokeError as e:
            return "FAIL", str(e)
    left = PLACEHOLDER.findall(re.sub(r"'[^']*'|\"[^\"]*\"", "", text))
    if left:
        return "FAIL", f"placeholder {left[0]} left in the command: give the program a smoke rule " \
                       f"that fills it, or classify the command as syntax"
    cmd.ran = text
    # A smoke rewrite's steps (an --export pass, then the run) each run once per check: the
    # same step of another command is not run again.
    steps = split_and(text) if cmd.cls == "smoke" and not text.startswith("for ") else [text]
    res, detail, same = "ok", "", []
    for step in steps:
        key = (cmd.prelude if "$" in step else "", step, cmd.rc, tuple(cmd.expect))
        if key in ctx.done:
            res, detail, where = ctx.done[key]
            same.append(where)
        else:
            rc, out, secs = run_shell(ctx, cmd, step)
            cmd.secs += secs
            res, detail = "ok", ""
            if rc != cmd.rc:
                res, detail = "FAIL", f"exit status {rc}, expected {cmd.rc}\n" + tail(out)
            else:
                missing = expect_missing(cmd.expect, out)
                if missing is not None:
                    res, detail = "FAIL", (f"the doc's output line {missing!r} is not in what it "
                                           f"printed\n" + tail(out))
            ctx.done[key] = (res, detail, f"{cmd.doc}:{cmd.line}")
        if res == "FAIL":
            break
    if same and res != "FAIL":
        detail = "(" + ", ".join(f"a step as run for {w}" for w in same) + ")"
    return res, detail


def expect_missing(expect, out):
    got = [l.rstrip() for l in out.split("\n")]
    j = 0
    for e in expect:
        while j < len(got) and got[j] != e.rstrip():
            j += 1
        if j == len(got):
            return e
        j += 1
    return None


def tail(out, head=6, n=18):
    """The start of the output (where a refusal names its argument) and its end."""
    lines = out.rstrip("\n").split("\n")
    if len(lines) > head + n:
        lines = lines[:head] + [f"... ({len(lines) - head - n} lines)"] + lines[-n:]
    return "\n".join("    | " + l[:300] for l in lines)


def doc_files(root):
    docs = os.path.join(root, "docs")
    return [os.path.join(root, "README.md")] + sorted(
        os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--root", default=os.path.normpath(os.path.join(here, "..")))
    ap.add_argument("--build", default=None, help="the meson build directory (default ROOT/build)")
    ap.add_argument("--list", action="store_true", help="extract and classify only; run nothing")
    ap.add_argument("--only", default=None, help="run only commands whose doc:line or text contains this")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("files", nargs="*", help="markdown files (default README.md and docs/*.md)")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    tree = Tree(root, os.path.abspath(args.build or os.path.join(root, "build")))
    files = [os.path.abspath(f) for f in args.files] or doc_files(root)

    cmds = []
    for f in files:
        shown = os.path.relpath(f, root) if f.startswith(root + os.sep) else f
        prelude, assigned = "", set()
        for c in extract(tree, f, shown):
            c.prelude, c.assigned = prelude, set(assigned)
            assigned |= set(re.findall(r"(?:^|;\s*)([A-Za-z_]\w*)=", c.text))
            classify(tree, c)
            if c.cls == "run" and c.parts and c.parts[0][1] == "assign":
                prelude += c.text + "\n"
            cmds.append(c)

    ctx = None if args.list else Context(tree, args.keep)
    failures = 0
    t_start = time.time()
    try:
        for c in cmds:
            selected = not args.only or args.only in f"{c.doc}:{c.line}" or args.only in c.one_line
            if c.cls is None:
                c.result, c.detail = "FAIL", f"unclassified: {c.reason}; add it to PROGRAMS or OVERRIDES " \
                                             f"in tools/check-doc-commands.py"
            elif args.list or not selected:
                c.result = "-"
            elif c.cls == "skip":
                c.result, c.detail = "skip", c.reason
            elif c.cls == "syntax":
                t0 = time.time()
                problems = check_syntax(tree, c)
                c.secs = time.time() - t0
                c.result, c.detail = ("FAIL", "; ".join(problems)) if problems else ("ok", "")
            else:
                c.result, c.detail = execute(ctx, c)
            failures += c.result == "FAIL"
            if not args.list and selected:
                print(f"{c.doc + ':' + str(c.line):<24} {c.cls or '?':<6} {c.result:<4} {c.secs:6.1f}  "
                      f"{c.one_line[:110]}", flush=True)
    finally:
        if ctx:
            ctx.close()
    if args.list:
        for c in cmds:
            print(f"{c.doc + ':' + str(c.line):<24} {c.cls or '?':<6} {c.one_line[:100]}")
            print(f"{'':<31} {c.reason}")
    counts = {}
    for c in cmds:
        counts[c.cls or "unclassified"] = counts.get(c.cls or "unclassified", 0) + 1
    for c in cmds:
        if c.result == "FAIL":
            print(f"\n{c.doc}:{c.line}: FAIL ({c.cls}): {c.one_line}")
            if c.ran and c.ran != c.text:
                print(f"  ran: {' '.join(c.ran.split())}")
            print("  " + c.detail)
    summary = ", ".join(f"{counts[k]} {k}" for k in ("run", "smoke", "syntax", "skip", "unclassified")
                        if k in counts)
    print(f"\ncheck-doc-commands: {len(cmds)} commands in {len(files)} files ({summary}); "
          f"{failures} failed; {time.time() - t_start:.0f} s", file=sys.stderr if failures else sys.stdout)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
