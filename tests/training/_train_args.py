"""Command lines for the tests that train the GPT through ``parse_args`` / ``train``.

``argv_of`` turns a dict of flags into argv. ``corpus_file`` is a fixed training corpus: the main
job's default corpus is the package's own source and docs, which change while someone edits the
tree, so two runs of one test (a reference and a resumed or resharded run) would see different
batches. Tests that compare runs pass ``--data corpus_file()`` instead.
"""

import os
import tempfile
from pathlib import Path


def corpus_file() -> str:
    """Path of a ~0.5 MB deterministic text file (written once per machine, atomically)."""
    path = Path(tempfile.gettempdir()) / "megatron_core_test_train_checkpoint_corpus_v1.txt"
    if not path.exists():
        text = " ".join(f"alpha{i % 97} beta{(i * 7919) % 389}." for i in range(20_000))
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # ranks may write it at once: same bytes, atomic
    return str(path)


def argv_of(base: dict, **options) -> list[str]:
    """argv for parse_args: ``base`` (flag names with dashes) updated by ``options`` (underscores
    allowed); a True value is a bare flag, None or False leaves the flag out."""
    merged = {**base, **{k.replace("_", "-"): v for k, v in options.items()}}
    argv = []
    for key, value in merged.items():
        if value is True:
            argv.append(f"--{key}")
        elif value is not None and value is not False:
            argv += [f"--{key}", str(value)]
    return argv
