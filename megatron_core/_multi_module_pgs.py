"""MultiModuleProcessGroupCollection (megatron-core 0.19), served as
``process_groups_config.MultiModuleProcessGroupCollection``: one rank's process groups for
several modules of a model (e.g. a vision encoder and a language model placed on the same rank),
each module's groups a ``ProcessGroupCollection``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MultiModuleProcessGroupCollection"]


@dataclass
class MultiModuleProcessGroupCollection:
    """Module name -> ProcessGroupCollection, with dict-like access and the language model's.

    Attributes:
        module_pgs: module name -> its ProcessGroupCollection (at least one).
        language_model_module_name: the key of the language model, or None when this rank
            holds none (its cp size is what loss and data code ask for).

    Example::

        pgs = MultiModuleProcessGroupCollection(
            module_pgs={"vision": vision_pgs, "llm": llm_pgs}, language_model_module_name="llm"
        )
        pgs["vision"].tp, pgs.get_language_model_cp_size(), list(pgs.keys())

    Raises:
        ValueError: ``module_pgs`` is empty or lacks ``language_model_module_name``.
    """

    module_pgs: dict[str, Any]
    language_model_module_name: str | None = None

    def __post_init__(self) -> None:
        if not self.module_pgs:
            raise ValueError("MultiModuleProcessGroupCollection: module_pgs ({}) is empty")
        name = self.language_model_module_name
        if name is not None and name not in self.module_pgs:
            raise ValueError(
                f"MultiModuleProcessGroupCollection: language_model_module_name ({name!r}) is "
                f"not one of the modules {list(self.module_pgs)}"
            )

    def get_language_model_collection(self):
        """The language model's ProcessGroupCollection (ValueError if there is none)."""
        if self.language_model_module_name is None:
            raise ValueError(
                "MultiModuleProcessGroupCollection: no language model on this rank "
                f"(modules: {list(self.module_pgs)})"
            )
        return self.module_pgs[self.language_model_module_name]

    def get_language_model_cp_size(self) -> int:
        """The size of the language model's context-parallel group (its ``cp``)."""
        return self.get_language_model_collection().cp.size()

    def has_language_model(self) -> bool:
        """True if this rank holds the language model."""
        return self.language_model_module_name is not None

    def get_module_collection(self, module_name: str):
        """The ProcessGroupCollection of ``module_name`` (ValueError naming the known ones)."""
        if module_name not in self.module_pgs:
            raise ValueError(
                f"MultiModuleProcessGroupCollection: no module {module_name!r}; modules: "
                f"{list(self.module_pgs)}"
            )
        return self.module_pgs[module_name]

    def __len__(self) -> int:
        return len(self.module_pgs)

    def __getitem__(self, module_name: str):
        return self.module_pgs[module_name]

    def __iter__(self):
        """Iterates over the collections (not the names), as megatron-core does."""
        return iter(self.module_pgs.values())

    def keys(self):
        """The module names."""
        return self.module_pgs.keys()

    def values(self):
        """The ProcessGroupCollections."""
        return self.module_pgs.values()

    def items(self):
        """(module name, ProcessGroupCollection) pairs."""
        return self.module_pgs.items()

    def __repr__(self) -> str:
        lm = self.language_model_module_name
        lm_text = f", language_model_module_name={lm!r}" if lm else ""
        return f"MultiModuleProcessGroupCollection(modules=[{', '.join(self.module_pgs)}]{lm_text})"
