"""Every code block of README.md and docs/python.md that is complete enough to run, run, so that the
docs cannot drift from the code.

A fenced block's info string says what it is:
  ```python   run with python3 in a fresh process (cwd: a temporary directory; the package found as
              the suite finds it)
  ```sh       run with bash -e in a temporary directory in which `build` and `examples` link to the
              repository's (build/: the optfuse program from scripts/build.sh); skipped, with the
              reason, where build/optfuse is missing
  ```text     not code (a diagram, program output): never run
A block that must not run (it needs the reader's model or buffers, a process group, minutes of
work) is marked on the line before its fence:
  <!-- fragment: why it does not run -->
A block that needs a GPU is marked
  <!-- needs: cuda -->
and skips with its reason where torch sees no CUDA device. Any other language (cpp, ...) must be
marked a fragment: nothing here compiles C++ (examples/custom_rule.cpp and examples/find_package are
built and run by tests/install/run_install_test.sh).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HAS_CUDA, NO_CUDA_REASON

ROOT = Path(__file__).resolve().parents[2]
# The build the sh blocks' `build/` stands for: build/ (scripts/build.sh, which scripts/test.sh runs
# first), or another build directory of this tree named by OPTFUSE_DOCS_BUILD_DIR.
BUILD = Path(os.environ.get("OPTFUSE_DOCS_BUILD_DIR", ROOT / "build")).resolve()
DOCS = ["README.md", "docs/python.md"]
RUN_LANGS = {"python", "sh"}
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARK = re.compile(r"^\s*<!--\s*(fragment|needs)\s*:\s*(.*?)\s*-->\s*$")
TIMEOUT_S = 600


def parse_blocks(text):
    """(first line number, language, marks, code) for every fenced block of a markdown text; marks:
    {"fragment": reason, "needs": what} from the comment lines right before the fence."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        marks, j = {}, i - 1
        while j >= 0 and MARK.match(lines[j]):
            k = MARK.match(lines[j])
            marks[k.group(1)] = k.group(2)
            j -= 1
        body, i = [], i + 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i >= len(lines):
            raise ValueError(f"the code block at line {i - len(body)} is never closed")
        blocks.append((i - len(body), lang, marks, "\n".join(body) + "\n"))
        i += 1
    return blocks


def all_blocks():
    out = []
    for doc in DOCS:
        for line, lang, marks, code in parse_blocks((ROOT / doc).read_text(encoding="utf-8")):
            out.append((doc, line, lang, marks, code))
    return out


BLOCKS = all_blocks()
RUNNABLE = [b for b in BLOCKS if b[2] in RUN_LANGS and "fragment" not in b[3]]


def test_parser_reads_marks_and_indented_blocks():
    text = ("intro\n<!-- fragment: needs your model -->\n```python\nopt.step()\n```\n"
            "- item:\n\n  <!-- needs: cuda -->\n  ```sh\n  echo hi\n  ```\n```text\na -> b\n```\n")
    blocks = parse_blocks(text)
    assert [(b[1], b[2], b[3]) for b in blocks] == [
        ("python", {"fragment": "needs your model"}, "opt.step()\n"),
        ("sh", {"needs": "cuda"}, "echo hi\n"),
        ("text", {}, "a -> b\n")]


def test_every_block_is_run_or_marked():
    """A block in a language this test does not run is marked a fragment (or is `text`), so that
    nothing is left out silently; a fragment says why; `needs` names something this test knows."""
    problems = []
    for doc, line, lang, marks, code in BLOCKS:
        where = f"{doc}:{line} ({lang or 'no language'})"
        if lang not in RUN_LANGS | {"text"} and "fragment" not in marks:
            problems.append(f"{where}: mark it <!-- fragment: why --> or give it a language this test runs")
        if "fragment" in marks and not marks["fragment"]:
            problems.append(f"{where}: a fragment mark must say why")
        if marks.get("needs", "cuda") != "cuda":
            problems.append(f"{where}: unknown needs '{marks['needs']}'")
    assert not problems, "\n".join(problems)
    assert len(RUNNABLE) >= 8, f"only {len(RUNNABLE)} runnable blocks: the docs lost their examples?"


def _env(tmp_path):
    env = dict(os.environ)
    # a kernel cache of the block's own (the blocks fill it, `optfuse cache --verify` checks it), not
    # the reader's
    env["OPTFUSE_CACHE_DIR"] = str(tmp_path / "kernel-cache")
    # the package as this suite imports it (an installed one, or python/ on PYTHONPATH)
    import optfuse
    pkg_parent = str(Path(optfuse.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


@pytest.mark.parametrize("doc,line,lang,marks,code", RUNNABLE,
                         ids=[f"{b[0]}:{b[1]}" for b in RUNNABLE])
def test_block_runs(doc, line, lang, marks, code, tmp_path):
    if marks.get("needs") == "cuda" and not HAS_CUDA:
        pytest.skip(f"{doc}:{line} is marked <!-- needs: cuda -->; {NO_CUDA_REASON}")
    if lang == "python":
        cmd = [sys.executable, "-c", code]
    else:
        if not (BUILD / "optfuse").exists() and "build/" in code:
            pytest.skip(f"{doc}:{line} runs build/optfuse, which is not built here (scripts/build.sh builds it)")
        (tmp_path / "build").symlink_to(BUILD)  # what the blocks name, as seen from the repository root
        (tmp_path / "examples").symlink_to(ROOT / "examples")
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    r = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, (f"{doc}:{line} ({lang}) exited with {r.returncode}\n--- block\n{code}"
                               f"--- stdout (end)\n{r.stdout[-3000:]}\n--- stderr (end)\n{r.stderr[-3000:]}")
