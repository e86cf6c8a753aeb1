"""The commands the README, BENCHMARKS.md, the manual (docs/**/*.md) and the Makefile quote still
work: every file under scripts/ that a quoted command runs exists; every quoted Python script
with a command line answers ``--help``, and its help lists each flag the quoted commands pass it;
every quoted shell script parses (``bash -n``; gpu_check.sh's ``--dry-run`` runs in
test_gpu_check.py, check_megatron_lm.sh's refusal of a missing checkout in
tests/megatron/test_megatron_switch.py).

A quoted command is a fenced code block's line (``\\`` continuations joined) or an inline code
span; its flags are the ``--name`` words after the script's path, up to a comment, a pipe or the
next command. The ``--help`` runs share one interpreter that imports torch once and forks a child
per script, which runs it as ``python <script> --help`` would (``__main__``, the script's folder
first on ``sys.path``): a second each instead of an interpreter start each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1", re.S | re.M)
_INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
_PATH = re.compile(r"(?<![\w./-])(scripts/[\w./-]+?\.(?:py|sh))(?![\w/])")
_FLAG = re.compile(r"(?<!\S)(--[A-Za-z][\w-]*)")
_END_OF_COMMAND = re.compile(r"\s#|\||&&|;")


def _pages() -> list[Path]:
    """README.md, BENCHMARKS.md, the Makefile and every page of the manual (not its build)."""
    docs = ROOT / "docs"
    manual = [p for p in docs.rglob("*.md") if not any(part.startswith("_") for part in p.parts)]
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "Makefile", *sorted(manual)]


def _commands(text: str) -> list[str]:
    """The quoted commands of one page: fenced blocks' lines, then inline code spans."""
    commands = []
    for block in _FENCE.finditer(text):
        commands += block.group(2).replace("\\\n", " ").splitlines()
    commands += [
        span.group(1).replace("\n", " ") for span in _INLINE.finditer(_FENCE.sub("", text))
    ]
    return commands


def quoted_scripts() -> dict[str, dict]:
    """``{path under the root: {"pages": pages that quote it, "flags": {flag: pages}}}`` for
    every scripts/ file a quoted command names (the Makefile's recipes read whole)."""
    found: dict[str, dict] = defaultdict(lambda: {"pages": set(), "flags": defaultdict(set)})
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        commands = text.splitlines() if page.name == "Makefile" else _commands(text)
        for command in commands:
            for match in _PATH.finditer(command):
                entry, name = found[match.group(1)], os.path.relpath(page, ROOT)
                entry["pages"].add(name)
                tail = _END_OF_COMMAND.split(command[match.end() :])[0]
                for flag in _FLAG.findall(tail):
                    entry["flags"][flag].add(name)
    return dict(found)


def _has_command_line(script: Path) -> bool:
    source = script.read_text(encoding="utf-8")
    return "argparse" in source or "parse_args(" in source


def test_every_quoted_script_exists():
    found = quoted_scripts()
    # The README's two commands and a script of each room are quoted: the parser found them.
    for script in (
        "scripts/train_gpt.py",
        "scripts/megatron_gpt_example.py",
        "scripts/benchmarks/benchmark_checkpoint.py",
        "scripts/checks/gpu_check.sh",
    ):
        assert script in found, sorted(found)
    missing = {s: sorted(e["pages"]) for s, e in found.items() if not (ROOT / s).is_file()}
    assert not missing, f"quoted scripts that do not exist (script: pages): {missing}"


def test_quoted_python_scripts_answer_help_with_every_quoted_flag():
    found = quoted_scripts()
    scripts = sorted(
        s
        for s in found
        if s.endswith(".py") and (ROOT / s).is_file() and _has_command_line(ROOT / s)
    )
    assert "scripts/train_gpt.py" in scripts and len(scripts) >= 10, scripts
    done = subprocess.run(
        [sys.executable, __file__, *scripts], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failures = []
    for script in scripts:
        status, text = results[script]
        if status != 0 or "usage:" not in text:
            failures.append(f"{script} --help: exit {status}\n{text[-2000:]}")
            continue
        listed = set(_FLAG.findall(text))
        for flag, pages in sorted(found[script]["flags"].items()):
            if flag not in listed:
                where = ", ".join(sorted(pages))
                failures.append(f"{script}: {flag} quoted ({where}) but not in its --help")
    assert not failures, "\n\n".join(failures)


def test_quoted_shell_scripts_parse():
    scripts = sorted(s for s in quoted_scripts() if s.endswith(".sh"))
    assert "scripts/checks/gpu_check.sh" in scripts, scripts
    for script in scripts:
        done = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script}: {done.stderr}"


def _help_in_child(script: str) -> tuple[int, str]:
    """Fork; the child runs ``script --help`` as ``__main__`` with its output in a pipe."""
    import runpy
    import traceback

    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.dup2(write, 1)
        os.dup2(write, 2)
        code = 1
        try:
            path = ROOT / script
            sys.argv = [str(path), "--help"]
            sys.path.insert(0, str(path.parent))
            runpy.run_path(str(path), run_name="__main__")
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    with os.fdopen(read, encoding="utf-8", errors="replace") as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), text


def _help_in_subprocess(script: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stdout + done.stderr


if __name__ == "__main__":
    # The runner of test_quoted_python_scripts_answer_help_with_every_quoted_flag: the scripts'
    # paths in argv; one JSON line {script: [exit status, output]} on stdout.
    # Imported once, before the forks: torch and the main job's engine (train_gpt.py and a few
    # checks import it) take seconds to import, a script's own imports a fraction of one.
    import torch  # noqa: F401

    import megatron_core.training  # noqa: F401

    run = _help_in_child if hasattr(os, "fork") else _help_in_subprocess
    print(json.dumps({script: run(script) for script in sys.argv[1:]}))
