"""Every Python block of the docs runs, or says why it cannot (see tests/docs/codeblocks.py).

Runnable blocks run as scripts of their own, in fresh processes: alone, or under ``ringserve run
-np N`` (a real coordinator and N real workers on loopback, and ``--ps S`` shards where it asks)
when the block asks for a world. They
take minutes on two cores, so they carry the ``docs`` marker: scripts/docs.sh runs them (in CI,
from .ci/run), and ``scripts/test.sh -m docs tests/docs`` alone. The checks of the directives run
in the default run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import codeblocks
import pytest
from preludes import PRELUDES

BLOCKS = codeblocks.all_blocks()
RUNNABLE = [b for b in BLOCKS if b.runnable]


def run_block(block: codeblocks.Block, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    prelude = PRELUDES[block.options["prelude"]] if "prelude" in block.options else ""
    script = tmp_path / "block.py"
    script.write_text(f"# {block.id}\n{prelude}\n{block.code}")
    # The block sees a clean environment: no RINGSERVE_* setting of the test run leaks into it.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGSERVE_", "HOROVOD_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    world = int(block.options.get("world", "0"))
    cmd = [sys.executable, str(script)]
    shards = int(block.options.get("ps", "0"))
    if world:
        cmd = [sys.executable, "-m", "ringserve.cli", "run", *(["--ps", str(shards)] if shards else []),
               "-np", str(world), *cmd]
    timeout = float(block.options.get("timeout", "90"))
    try:
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{block.id} ran past {timeout} s:\n{out[-3000:]}")


@pytest.mark.docs
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_the_docs_python_block_runs(block: codeblocks.Block, tmp_path: Path) -> None:
    done = run_block(block, tmp_path)
    assert done.returncode == 0, f"{block.id} exited with {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"


def test_every_block_not_run_says_why_and_names_no_unknown_prelude() -> None:
    for block in BLOCKS:
        if not block.runnable:
            assert len(block.reason.split()) >= 3, f"{block.id}: give a reason a reader understands, not {block.reason!r}"
        assert block.options.get("prelude", "arrays") in PRELUDES, f"{block.id}: no prelude {block.options['prelude']!r}"


def test_the_docs_have_python_blocks_and_most_of_them_run() -> None:
    assert len(RUNNABLE) >= 8, f"only {len(RUNNABLE)} docs blocks run"
    assert len(RUNNABLE) > len(BLOCKS) - len(RUNNABLE)


def test_a_directive_without_a_reason_or_with_an_unknown_option_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- not runnable: -->\n```python\nx = 1\n```\n")
    with pytest.raises(codeblocks.DirectiveError, match="needs a reason"):
        codeblocks.blocks(page)
    page.write_text("<!-- run: wrld=2 -->\n```python\nx = 1\n```\n")
    with pytest.raises(codeblocks.DirectiveError, match="wrld"):
        codeblocks.blocks(page)
    page.write_text("<!-- a comment -->\n```python\nx = 1\n```\n")
    with pytest.raises(codeblocks.DirectiveError, match="not a directive"):
        codeblocks.blocks(page)
    page.write_text("text\n\n<!-- run: world=2 prelude=arrays -->\n\n```python\nx = 1\n```\n```bash\nls\n```\n")
    [block] = codeblocks.blocks(page)
    assert block.runnable and block.options == {"world": "2", "prelude": "arrays"} and block.code == "x = 1\n"
