"""compat.py is the one place that checks what a torch release has: no other module of the
package probes torch with getattr/hasattr for a name some release lacks."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_core"
PROBE = re.compile(r"\b(getattr|hasattr)\((torch|dist|torch\.[\w.]+)\s*,")
# A dtype read by its saved name (not a version difference).
ALLOWED = {("training/checkpoint_io.py", "getattr(torch, name")}


def test_only_compat_probes_torch_for_release_differences():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = PROBE.search(line)
            if match and not any(relative == f and s in line for f, s in ALLOWED):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "move these feature checks into megatron_core/compat.py:\n" + "\n".join(found)
