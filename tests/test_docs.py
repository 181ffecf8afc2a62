"""The hex examples in docs/ are the bytes the code produces."""

import re
from pathlib import Path

import pytest
from doc_examples import EXAMPLES

DOCS = Path(__file__).resolve().parent.parent / "docs"
PATTERN = re.compile(r"<!-- example: (\w+) -->\n```text\n(.*?)\n```", re.S)


def doc_examples():
    found = {}
    for path in sorted(DOCS.glob("*.md")):
        for name, body in PATTERN.findall(path.read_text()):
            found[name] = (path.name, bytes.fromhex(body.replace("\n", " ")))
    return found


def test_every_example_is_documented():
    assert set(doc_examples()) == set(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_documented_bytes_equal_the_code(name):
    where, documented = doc_examples()[name]
    assert documented == EXAMPLES[name], f"{where}: example {name} differs from the code"
