"""``python -m megatron_core.megatron script.py [args]``: run a script with the switch installed.

For launchers that start a script, not a function: ``torchrun --nproc-per-node 2 -m
megatron_core.megatron train.py --tp 2`` runs ``train.py`` on each rank after
:func:`megatron_core.megatron.install`, as if it had made the call itself, with the script's
folder on ``sys.path`` as ``python train.py`` puts it there (Megatron-LM's ``pretrain_gpt.py``
imports ``gpt_builders`` and ``model_provider`` from beside it).

A script in a Megatron-LM checkout (its folder holds ``megatron/core/``) gets that folder at the
*end* of ``sys.path`` instead, and the working directory is dropped from the front when it is
that folder: the installed megatron-core, the release :func:`install` checked, is then the
``megatron.core`` that runs, and the checkout serves only what the installed release lacks
(``megatron.training`` and ``megatron.legacy`` beside megatron-core 0.16.1's wheel; 0.19's wheel
ships ``megatron.training`` itself).
"""

import os
import runpy
import sys

from megatron_core import megatron


def _script_path(script: str) -> None:
    """Put ``script``'s folder on ``sys.path`` (see the module docstring)."""
    folder = os.path.dirname(os.path.abspath(script))
    checkout = os.path.isfile(os.path.join(folder, "megatron", "core", "__init__.py"))
    if not checkout:
        sys.path.insert(0, folder)
        return
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != folder]
    sys.path.append(folder)


def main() -> None:
    """Install the switch, then run ``sys.argv[1]`` as ``__main__`` with the remaining args."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m megatron_core.megatron script.py [args ...]")
    _script_path(sys.argv[1])
    megatron.install()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
