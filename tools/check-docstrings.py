#!/usr/bin/env python3
"""Checks that the Python package's public API is documented, then renders its reference.

    python tools/check-docstrings.py [--html DIR] MODULE ...

(make docs: kvgc, kvgc.transformers, kvgc.kvpress and kvgc.vllm into build/docs/python,
with the interpreter of make test-python's venv, where torch, transformers, kvpress and
pdoc are.) The public API is what pdoc renders: each MODULE, every name in its `__all__`
(functions, classes, constants: a constant's docstring is the string literal after its
assignment), and every public class's own public methods and properties. Each of these
without a docstring is printed as `module.name: no docstring` and fails the run (pdoc has
no such switch). An inherited method is checked where it is defined, and a method that
overrides a documented one inherits its docstring, as pdoc shows it.

With --html, pdoc 16 then writes the reference into DIR, and a warning of pdoc's own (a
name in `__all__` that is not there, an annotation or a docstring it cannot read, a module
it cannot import) or of kvgc's code fails the run too: warnings that torch or transformers
raise while being imported are theirs, and do not.
"""
import argparse
import importlib
import os
import pathlib
import sys
import warnings

import pdoc
import pdoc.doc


def public(name, module_all=None):
    if module_all is not None:
        return name in module_all
    return not name.startswith("_")


def undocumented(modname):
    """Yields the dotted name of every public symbol of modname without a docstring."""
    module = pdoc.doc.Module(importlib.import_module(modname))
    if not module.docstring.strip():
        yield modname
    module_all = getattr(module.obj, "__all__", None)
    for name, member in module.members.items():
        if not public(name, module_all):
            continue
        if not member.docstring.strip():
            yield f"{modname}.{name}"
        if isinstance(member, pdoc.doc.Class):
            for m in member.own_members:
                mname = m.name
                if mname.startswith("_"):
                    continue
                # methods and properties; class attributes (enum members, dataclass fields)
                # are the class docstring's to describe
                is_property = isinstance(m, pdoc.doc.Variable) and isinstance(
                    member.obj.__dict__.get(mname), property)
                if (isinstance(m, pdoc.doc.Function) or is_property) and not m.docstring.strip():
                    yield f"{modname}.{name}.{mname}"


def complain(lines, what):
    """Prints each line and a count of `what` to stderr; 1 if there were any, else 0."""
    for line in lines:
        print(line, file=sys.stderr)
    if lines:
        print(f"check-docstrings: {len(lines)} {what}", file=sys.stderr)
    return int(bool(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--html", metavar="DIR", help="render the reference into DIR with pdoc")
    ap.add_argument("modules", nargs="+")
    args = ap.parse_args()

    # Import first, under the default filters: the modules' own imports' warnings (torch's,
    # transformers') are not pdoc's. From here on every warning is recorded.
    for m in args.modules:
        importlib.import_module(m)
    ours_dirs = tuple({os.path.dirname(pdoc.__file__) + os.sep} |
                      {os.path.dirname(importlib.import_module(m.split(".")[0]).__file__) + os.sep
                       for m in args.modules})
    status = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        missing = [n for m in args.modules for n in undocumented(m)]
        status |= complain([f"{n}: no docstring" for n in missing],
                           "public symbols without a docstring")
        if not missing:
            print(f"check-docstrings: every public symbol of {', '.join(args.modules)} "
                  "is documented")
        if args.html and not missing:
            pdoc.pdoc(*args.modules, output_directory=pathlib.Path(args.html))
    ours = [w for w in caught if w.filename.startswith(ours_dirs)]
    status |= complain([f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}"
                        for w in ours], "warnings from pdoc or the package (errors here)")
    if args.html and status == 0:
        print(f"check-docstrings: the reference is in {args.html}/index.html")
    return status


if __name__ == "__main__":
    sys.exit(main())
