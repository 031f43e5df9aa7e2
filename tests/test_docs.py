"""The documentation runs: every ```python block of README.md and docs/guide.md is executed,
every relative link of README.md and docs/*.md leads to a file (and heading) that exists,
every ``python -m <module>`` the README and the guide name can be imported, and the README's
configuration table has one row per switch of ``terra.config`` and per ``TERRA_*`` variable
that ``terra/`` reads, with the switch's default.

A document's blocks run in order in one fresh process (a later block uses what an earlier one
defined), with Terra's defaults as a user has them: the test suite's ``TERRA_*`` settings
(``tests/conftest.py``) are not passed on, except ``TERRA_CHECK``. A block is skipped only if
the line before it is ``<!-- fragment -->``: a piece of a program that cannot run alone.
"""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ("README.md", "docs/guide.md")  # documents whose examples run
LINKED = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
FRAGMENT = "<!-- fragment -->"
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


def _text(doc):
    return (ROOT / doc).read_text(encoding="utf-8")


def code_blocks(doc):
    """``(language, code, first line of the code, is a fragment)`` of each fenced block."""
    text = _text(doc)
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        line = text.count("\n", 0, m.start(2)) + 1
        yield m.group(1), m.group(2), line, before == FRAGMENT


def _prose(text):
    """The text without fenced blocks and inline code, where links are links."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)


_RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for doc, line, code in json.load(sys.stdin):
    print(f"--- {doc}:{line}", flush=True)
    exec(compile("\\n" * (line - 1) + code, doc, "exec"), namespace)
"""


def _env():
    """The environment a user runs the examples in: no TERRA_* switch of the test suite's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TERRA_")}
    env["TERRA_CHECK"] = "1"  # the TraceGraph's invariants checked, as in the rest of the suite
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("MPLBACKEND", "Agg")
    return env


@pytest.mark.parametrize("doc", RUN)
def test_python_examples_run(doc, tmp_path):
    blocks = [(doc, line, code) for lang, code, line, fragment in code_blocks(doc)
              if lang == "python" and not fragment]
    assert blocks, f"{doc} has no python example"
    done = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(blocks), text=True,
                          capture_output=True, cwd=tmp_path, env=_env(), timeout=420)
    assert done.returncode == 0, (
        f"an example of {doc} failed (the last '--- file:line' is the block):\n"
        f"{done.stdout[-4000:]}\n{done.stderr[-6000:]}")


def test_fragments_are_few():
    """Skipping is for pieces of programs; everything else runs."""
    for doc in RUN:
        blocks = [b for b in code_blocks(doc) if b[0] == "python"]
        fragments = [line for _, _, line, fragment in blocks if fragment]
        assert len(fragments) <= max(2, len(blocks) // 4), (doc, fragments)


def _slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc):
    found, seen = set(), {}
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t]*#*$", _prose_keep_headings(_text(doc)), re.M):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def _prose_keep_headings(text):
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


@pytest.mark.parametrize("doc", LINKED)
def test_relative_links_lead_somewhere(doc):
    broken = []
    for target in re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)",
                             _prose(_text(doc))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / doc).parent / path if path else ROOT / doc
        if not file.resolve().is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.relative_to(ROOT)):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc}: {broken}"


def _modules():
    found = set()
    for doc in RUN:
        found.update(re.findall(r"python\s+-m\s+([A-Za-z_][\w.]*)", _text(doc)))
    return sorted(found)


def test_named_modules_import():
    """Long commands (benchmarks) are not run; what they run must at least import."""
    modules = _modules()
    assert "benchmarks" in modules
    check = ("import importlib, importlib.util, sys\n"
             "for name in sys.argv[1:]:\n"
             "    spec = importlib.util.find_spec(name)\n"
             "    assert spec is not None, name\n"
             "    importlib.import_module(name + '.__main__' if spec.submodule_search_locations"
             " else name)\n")
    done = subprocess.run([sys.executable, "-c", check, *modules], capture_output=True,
                          text=True, cwd=ROOT, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


# -- the README's configuration table -------------------------------------------------------
def _config_fields():
    """The ``Config`` dataclass's fields and their defaults, read from the source."""
    tree = ast.parse((ROOT / "terra" / "config.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    return {n.target.id: ast.literal_eval(n.value) for n in cls.body
            if isinstance(n, ast.AnnAssign) and n.value is not None}


def _variables():
    """Every ``TERRA_*`` environment variable Terra's Python reads."""
    found = set()
    for path in (ROOT / "terra").rglob("*.py"):
        found.update(re.findall(r"[\"'](TERRA_[A-Z0-9_]+)[\"']", path.read_text("utf-8")))
    return found


def _config_rows():
    text = _text("README.md")
    table = text[text.index("## Configuration"):]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and not set(cells[0]) <= set("-: "):
            rows.append(cells)
    return rows[1:]  # the header


def _same_default(cell, value):
    cell = cell.strip("`").lower()
    if isinstance(value, bool):
        return cell == ("on" if value else "off")
    if isinstance(value, tuple):
        return cell == "empty" and value == ()
    if isinstance(value, int | float):
        try:
            return float(cell) == value
        except ValueError:
            return False
    return cell == str(value).lower()


def test_readme_configuration_table_is_complete():
    fields, variables = _config_fields(), _variables()
    seen_fields, seen_variables, wrong = set(), set(), []
    for name, default, meaning in _config_rows():
        assert meaning, name
        for ident in re.findall(r"`([A-Za-z_0-9]+)`", name):
            if ident.startswith("TERRA_"):
                seen_variables.add(ident)
            elif ident in fields:
                seen_fields.add(ident)
                if not _same_default(default, fields[ident]):
                    wrong.append(f"{ident}: README says {default}, config.py {fields[ident]!r}")
    assert fields.keys() - seen_fields == set(), "configure options missing from the README"
    assert variables - seen_variables == set(), "TERRA_ variables missing from the README"
    assert seen_variables - variables == set(), "README lists variables Terra does not read"
    assert not wrong, wrong
