"""README's Python quick start, run exactly as written (the block after "## Python")."""
import os
import re

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md")
MODEL = os.path.expanduser("~/.cache/kvgc/SmolLM2-135M-Instruct.Q4_1.gguf")


def quick_start():
    text = open(README, encoding="utf-8").read()
    section = text.split("## Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_quick_start(capsys):
    if not os.path.exists(MODEL):
        if os.environ.get("KVGC_REQUIRE_MODEL") == "1":
            pytest.fail(f"{MODEL} is missing (tools/fetch-model.sh)")
        pytest.skip(f"{MODEL} is missing (tools/fetch-model.sh)")
    exec(compile(quick_start(), "README.md", "exec"), {})
    out = capsys.readouterr().out
    held = re.findall(r"(\d+) tokens; KV bytes held: (\d+) of an f16 full cache's (\d+)", out)
    assert len(held) == 2, out
    (n_doc, doc, doc_full), (n_chat, chat, chat_full) = [tuple(map(int, h)) for h in held]
    answer, story = out.split("KV bytes held")[0], out.split("KV bytes held")[1]
    # The long document: compressed to about 10% (the young window and tail pages add a
    # little), its pass key still answered.
    assert n_doc > 3000 and 0 < doc < 0.12 * doc_full, (doc, doc_full)
    assert "71432" in answer, out
    # The short chat: under min_length, held whole (its pages' metadata and tail slots on
    # top of the raw K/V), and the model wrote a story.
    assert n_chat < 256 and chat_full <= chat < 1.2 * chat_full, (chat, chat_full)
    assert len(story.split("\n", 1)[1].split()) > 15, out
