"""``python -m megatron_core.megatron script.py [args]``: run a script with the switch installed.

For launchers that start a script, not a function: ``torchrun --nproc-per-node 2 -m
megatron_core.megatron train.py --tp 2`` runs ``train.py`` on each rank after
:func:`megatron_core.megatron.install`, as if it had made the call itself.
"""

import runpy
import sys

from megatron_core import megatron


def main() -> None:
    """Install the switch, then run ``sys.argv[1]`` as ``__main__`` with the remaining args."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m megatron_core.megatron script.py [args ...]")
    megatron.install()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
