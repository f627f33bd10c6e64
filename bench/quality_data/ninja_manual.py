#!/usr/bin/env python3
"""Plain text of Debian's ninja-build manual (/usr/share/doc/ninja-build/manual.html), for
kvgc-bench-quality: one paragraph a line with a blank line between, list items as "- "
paragraphs, code blocks kept verbatim as paragraphs of their own, the table of contents
dropped. Usage: ninja_manual.py manual.html > ninja-manual.txt"""
import html.parser
import re
import sys

# Elements whose text is a paragraph; a block inside another ends the outer one's text.
BLOCKS = {"p", "pre", "dt", "dd", "li", "h1", "h2", "h3", "td"}


class Text(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.paras, self.buf, self.open, self.toc, self.pre = [], [], 0, 0, False

    def flush(self):
        text = "".join(self.buf)
        text = text.strip("\n") if self.pre else re.sub(r"\s+", " ", text).strip()
        if text not in ("", "-"):
            self.paras.append(text)
        self.buf = []

    def handle_starttag(self, tag, attrs):
        if self.toc:
            self.toc += tag == "div"
        elif tag == "div" and ("class", "toc") in attrs:
            self.toc = 1
        elif tag in BLOCKS:
            self.flush()
            self.open += 1
            self.pre = tag == "pre"
            if tag == "li":
                self.buf.append("- ")

    def handle_endtag(self, tag):
        if self.toc:
            self.toc -= tag == "div"
        elif tag in BLOCKS and self.open:
            self.flush()
            self.open -= 1
            self.pre = False

    def handle_data(self, data):
        if not self.toc and self.open:
            self.buf.append(data)


parser = Text()
parser.feed(open(sys.argv[1], encoding="utf-8").read())
parser.close()
sys.stdout.write("\n\n".join(parser.paras) + "\n")
