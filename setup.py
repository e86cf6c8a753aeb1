"""Packaging for megatron_core (distribution name: megatron-tp-core)."""

from setuptools import find_packages, setup

setup(
    name="megatron-tp-core",
    version="0.1.0",
    description=(
        "A Megatron-style tensor-parallel core for PyTorch: parallel_state and tensor_parallel, "
        "device-agnostic and tested on CPU with gloo."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_core", "megatron_core.*"]),
    python_requires=">=3.10",
    # megatron-core's own floor, no upper bound (README "Support matrix")
    install_requires=["torch>=2.6"],
    extras_require={
        # numpy: all_gather_object; pytest-xdist: the suite runs on two workers (pyproject.toml)
        "test": ["pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3", "numpy"],
        "dev": ["ruff>=0.4"],
        "plot": ["matplotlib>=3.5", "numpy"],
        # make docs: the manual (docs/). Lower bounds are the oldest releases the site was built
        # with, without a warning (sphinx 8.1 is the last line on Python 3.10; 9.x is tested too).
        "docs": ["sphinx>=8.1", "myst-parser>=4", "furo>=2024.8.6"],
        # megatron-core's own model code on this core (megatron_core.megatron, the switch):
        # 0.16.1 and 0.19.x are tested (0.17+ needs Python 3.12; each CI lane pins its release). Its
        # base needs are torch, numpy and packaging; psutil is what its dist_checkpointing save
        # needs at run time without declaring it.
        "megatron": ["megatron-core>=0.16.1,<0.20", "numpy", "packaging", "psutil"],
    },
    entry_points={
        # Loaded by pytest everywhere; it does nothing unless --megatron-core-switch or
        # MEGATRON_CORE_SWITCH=1 asks for the switch (megatron_core/megatron/pytest_plugin.py).
        "pytest11": ["megatron_core_switch = megatron_core.megatron.pytest_plugin"],
    },
)
