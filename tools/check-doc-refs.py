#!/usr/bin/env python3
"""Checks the docs' cross-references: links that resolve, sections that exist.

    python3 tools/check-doc-refs.py [--root DIR] [--unquoted] [FILE ...]

The checks, over README.md, CHANGELOG.md, docs/*.md, docs/records/*.md and
docs/quality/*.md, and over the comments (and Python docstrings) of the tree's *.cpp,
*.hpp, *.h, *.cu, *.cuh, *.py, *.sh and *.build files (or over the FILEs given):

- every relative markdown link `[text](path)` or `![alt](path)` names a file or folder
  that exists (resolved against the linking file's folder; a `#anchor` is ignored);
- every markdown file named in the text (`docs/PERF.md`, `PERF.md`, `../QUALITY.md`)
  exists: beside the naming file, from the repository root, under docs/, or, for a path
  whose ending names one file of the tree, that file; and every other file named by a
  path from the root under docs/ (`docs/quality/f16-4k-kvgc.jsonl`) exists;
- every reference to a section of a markdown file by a quoted name, in the forms
  `X.md, "Section"`, `X.md "Section"`, `X.md's "Section"`, `X.md: "Section"`,
  `X.md ("Section")` and `[X.md](X.md), "Section"` (a name may wrap over lines; a list
  `X.md, "A" and "B"` checks each), names a heading of X.md (`#` to `######`, outside code
  fences) or the start of one, compared case-insensitively with backticks, `*` and
  repeated spaces ignored and ending at a word boundary; and, in README.md, CHANGELOG.md
  and docs/*.md, a quoted `"Section" above` or `"Section" below` names one of the file's
  own headings (records keep their source's order, so theirs are not checked).

With --unquoted it also lists, as warnings that do not fail the run, references of the
forms `X.md, some words` and `X.md's some words` (the words up to a comma, a bracket, `;`,
`|` or a sentence's end) whose words start no heading of X.md: a reader's check of the
prose references the quoted form does not cover (many are descriptions, not names).

Prints each offender as `path:line: message` and exits 1 when there is any, else prints
a one-line summary and exits 0. Python 3 standard library only.
"""
import argparse
import os
import re
import subprocess
import sys

DOC_GLOBS = [("", ("README.md", "CHANGELOG.md")), ("docs", None), ("docs/records", None),
             ("docs/quality", None)]
CODE_EXT = (".cpp", ".hpp", ".h", ".cu", ".cuh", ".py", ".sh", ".build")
SKIP_DIRS = {".git", "build", "subprojects", "node_modules", "__pycache__", ".cache"}

# A section reference: the file, a separator, then one or more quoted names.
QUOTE = r'["\u201c]([^"\u201d]{1,200}?)["\u201d]'
SECTION_REF = re.compile(
    r"(?<![\w./-])(?P<file>[\w./-]*\w\.md)(?:\]\((?P<target>[^)\s#]*)[^)\s]*\))?"
    r"(?P<sep>\s*,\s*|\s*:\s*|'s\s+|\u2019s\s+|\s+\(?|\s*\(\s*)"
    + r'(?P<names>' + QUOTE + r'(?:\s*(?:,|and|or|,\s*and)\s*' + QUOTE + r')*)')
QUOTED = re.compile(QUOTE)
NEARBY_REF = re.compile(QUOTE + r"\s+(above|below)\b")
DOC_PATH = re.compile(r"(?<![\w./:-])docs/[\w./-]*\w\.[A-Za-z]\w*\b")
BARE_MD = re.compile(r"(?<![\w./:-])([\w./-]*\w\.md)\b")
UNQUOTED_REF = re.compile(
    r"(?<![\w./-])(?P<file>[\w./-]*\w\.md)(?P<link>\]\([^)\s]*\))?(?P<sep>,|'s|\u2019s)\s+"
    r"(?P<name>[A-Za-z~`][^,();|\]\n]*(?:\n[^,();|\]\n]*)?)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^ {0,3}(```|~~~)")


def norm(s):
    s = s.replace("`", "").replace("*", "")
    return re.sub(r"\s+", " ", s).strip().lower()


def is_prefix(ref, heading):
    """ref is heading, or its start ending at a word boundary ("serving" starts "serving:
    how many ..." but "serv" starts nothing)."""
    if not heading.startswith(ref):
        return False
    return len(heading) == len(ref) or not (heading[len(ref)].isalnum() and ref[-1:].isalnum())


class Tree:
    def __init__(self, root):
        self.root = os.path.abspath(root)
        self.headings = {}
        self.md_files = None

    def rel(self, path):
        return os.path.relpath(path, self.root)

    def all_md(self):
        if self.md_files is None:
            self.md_files = []
            for d, dirs, files in os.walk(self.root):
                dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith(("build", "."))]
                self.md_files += [os.path.join(d, f) for f in files if f.endswith(".md")]
        return self.md_files

    def resolve_md(self, name, referrer):
        here = os.path.dirname(referrer)
        for base in (here, self.root, os.path.join(self.root, "docs")):
            p = os.path.normpath(os.path.join(base, name))
            if os.path.isfile(p):
                return p
        tail = "/" + name.lstrip("./")
        hits = [p for p in self.all_md() if p.endswith(tail)]
        return hits[0] if len(hits) == 1 else None

    def headings_of(self, path):
        if path not in self.headings:
            hs, fence = [], None
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    m = FENCE.match(line)
                    if m:
                        fence = None if fence == m.group(1) else (fence or m.group(1))
                        continue
                    if fence:
                        continue
                    h = HEADING.match(line)
                    if h:
                        hs.append(norm(h.group(2)))
            self.headings[path] = hs
        return self.headings[path]


def doc_files(root):
    out = []
    for sub, names in DOC_GLOBS:
        d = os.path.join(root, sub)
        if not os.path.isdir(d):
            continue
        for n in sorted(names or os.listdir(d)):
            p = os.path.join(d, n)
            if n.endswith(".md") and os.path.isfile(p):
                out.append(p)
    return out


def code_files(root):
    try:
        ls = subprocess.run(["git", "-C", root, "ls-files", "-co", "--exclude-standard"],
                            capture_output=True, text=True, check=True).stdout.split("\n")
        paths = [os.path.join(root, p) for p in ls if p]
    except (OSError, subprocess.CalledProcessError):
        paths = []
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith(("build", "."))]
            paths += [os.path.join(d, f) for f in files]
    return sorted(p for p in paths if os.path.isfile(p)
                  and p.endswith(CODE_EXT))


def blank(text, keep):
    """text with every character outside the spans in keep replaced by a space (newlines kept)."""
    out = [c if c == "\n" else " " for c in text]
    for a, b in keep:
        out[a:b] = text[a:b]
    return "".join(out)


C_TOKENS = re.compile(r'R"(?P<d>[^(\s]*)\((?:.|\n)*?\)(?P=d)"|"(?:\\.|[^"\\\n])*"|'
                      r"'(?:\\.|[^'\\\n])*'|//[^\n]*|/\*(?:.|\n)*?\*/")
PY_TOKENS = re.compile(r'[rRbBuUfF]{0,2}("""|\'\'\')(?:.|\n)*?\1|"(?:\\.|[^"\\\n])*"|'
                       r"'(?:\\.|[^'\\\n])*'|#[^\n]*")
SH_TOKENS = re.compile(r'"(?:\\.|[^"\\])*"|\'[^\']*\'|(?:(?<=\s)|^)#[^\n]*', re.M)


def comment_text(path, text):
    """The file's comments (and Python's triple-quoted strings) in place, markers blanked."""
    if path.endswith((".cpp", ".hpp", ".h", ".cu", ".cuh")):
        spans = [(m.start(), m.end()) for m in C_TOKENS.finditer(text)
                 if m.group(0).startswith(("//", "/*"))]
        t = blank(text, spans)
        return re.sub(r"//|/\*+|\*+/|^\s*\*", lambda m: " " * len(m.group(0)), t, flags=re.M)
    if path.endswith(".py"):
        spans = [(m.start(), m.end()) for m in PY_TOKENS.finditer(text)
                 if m.group(0).startswith("#") or m.group(1)]
    else:
        spans = [(m.start(), m.end()) for m in SH_TOKENS.finditer(text)
                 if m.group(0).startswith("#") and not m.group(0).startswith("#!")]
    t = blank(text, spans)
    return re.sub(r"#+", lambda m: " " * len(m.group(0)), t)


def md_text(text):
    """Markdown with inline-code backticks blanked (a name in backticks still counts)."""
    return text.replace("`", " ")


def line_of(text, pos):
    return text.count("\n", 0, pos) + 1


def check_file(tree, path, unquoted, errors, warnings):
    with open(path, encoding="utf-8", errors="replace") as f:
        raw = f.read()
    is_md = path.endswith(".md")
    text = md_text(raw) if is_md else comment_text(path, raw)
    where = tree.rel(path)

    if is_md:
        fence_free = []
        fence = None
        for line in raw.splitlines(keepends=True):
            m = FENCE.match(line)
            if m:
                fence = None if fence == m.group(1) else (fence or m.group(1))
            fence_free.append(line if not fence and not m else "\n")
        body = "".join(fence_free)
        body = re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group(0)), body)
        for m in LINK.finditer(body):
            target = m.group(1)
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue
            p = target.split("#", 1)[0]
            if not p:
                continue
            full = os.path.normpath(os.path.join(os.path.dirname(path), p))
            if not os.path.exists(full):
                errors.append(f"{where}:{line_of(body, m.start())}: link to {target}: no such file")

    targets = [m.span(1) for m in LINK.finditer(text)] if is_md else []
    for m in DOC_PATH.finditer(text):
        if m.group(0).endswith(".md") or any(a <= m.start() < b for a, b in targets):
            continue  # markdown files: below
        if not os.path.exists(os.path.join(tree.root, m.group(0))):
            errors.append(f"{where}:{line_of(text, m.start())}: {m.group(0)}: no such file")
    for m in BARE_MD.finditer(text):
        if any(a <= m.start() < b for a, b in targets):
            continue  # a link's target: checked as a link
        if tree.resolve_md(m.group(1), path) is None:
            errors.append(f"{where}:{line_of(text, m.start())}: {m.group(1)}: no such markdown file")

    for m in SECTION_REF.finditer(text):
        name = m.group("file")
        target = tree.resolve_md(m.group("target") or name, path)
        ln = line_of(text, m.start())
        if target is None:
            continue  # reported above
        heads = tree.headings_of(target)
        for q in QUOTED.finditer(m.group("names")):
            ref = norm(q.group(1)).rstrip(",.;:")
            if not ref or any(is_prefix(ref, h) for h in heads):
                continue
            errors.append(f'{where}:{ln}: {name}, "{" ".join(q.group(1).split())}": no such heading in '
                          f"{tree.rel(target)}")

    # "Section" above / below, in a current doc (a record's "above" is its source's order).
    if is_md and os.path.dirname(os.path.relpath(path, tree.root)) in ("", "docs"):
        heads = tree.headings_of(path)
        for m in NEARBY_REF.finditer(text):
            ref = norm(m.group(1)).rstrip(",.;:")
            if not any(is_prefix(ref, h) for h in heads):
                errors.append(f'{where}:{line_of(text, m.start())}: "{" ".join(m.group(1).split())}" '
                              f"{m.group(2)}: no such heading in this file")

    if unquoted:
        for m in UNQUOTED_REF.finditer(text):
            if m.group("link") and m.group("sep") == ",":
                continue  # a link to a record, then what it holds: not a section name
            target = tree.resolve_md(m.group("file"), path)
            name = re.sub(r"\s+", " ", m.group("name")).strip()
            name = re.split(r"\s+(?:and|or)\s+(?=[\w./-]*\.md\b)|[.:](?:\s|$)", name)[0]
            first = name.split(" ")[0]
            if target is None or "/" in first or first.endswith(".md") or not name:
                continue
            ref = norm(name).rstrip(",.;:")
            if any(is_prefix(ref, h) for h in tree.headings_of(target)):
                continue
            warnings.append(f"{where}:{line_of(text, m.start())}: {m.group('file')}, {name[:70]}: "
                            f"no heading of {tree.rel(target)} starts so (unquoted)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--unquoted", action="store_true",
                    help="also warn about unquoted `X.md, name` references (never fails)")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    tree = Tree(args.root)
    files = ([os.path.abspath(f) for f in args.files] if args.files
             else doc_files(tree.root) + code_files(tree.root))
    errors, warnings = [], []
    me = os.path.abspath(__file__)
    for p in files:
        if os.path.abspath(p) == me:
            continue
        check_file(tree, p, args.unquoted, errors, warnings)
    for w in warnings:
        print("warning: " + w)
    for e in sorted(errors, key=lambda e: (e.split(":")[0], int(e.split(":")[1]))):
        print(e)
    if errors:
        print(f"check-doc-refs: {len(errors)} dangling reference(s) in {len(files)} files",
              file=sys.stderr)
        return 1
    print(f"check-doc-refs: {len(files)} files, links and section references resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
