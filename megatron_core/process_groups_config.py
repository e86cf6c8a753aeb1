"""ProcessGroupCollection: the process groups a model needs, as one value (megatron-core 0.16).

A layer or a training step can be handed a collection instead of reading parallel_state's
globals. Build one from parallel_state (``ProcessGroupCollection.use_mpu_process_groups()``) or set
the groups yourself (``ProcessGroupCollection(tp=..., dp=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import partial

import torch.distributed as dist

from megatron_core import parallel_state as ps

__all__ = [
    "ProcessGroupHelperMeta",
    "ProcessGroupCollection",
    "MultiModuleProcessGroupCollection",
]


class ProcessGroupHelperMeta(type):
    """Metaclass whose classes refuse ``Cls.virtual_pipeline_model_parallel_size = ...``.

    megatron-core 0.16.1's guard for classes that keep the virtual pipeline size as a class
    attribute: it must change through their ``set_virtual_pipeline_model_parallel_size()``.
    Every other class attribute is set as usual.
    """

    def __setattr__(cls, name, value):
        """Set ``name`` on the class, except virtual_pipeline_model_parallel_size.

        Raises:
            AttributeError: ``name`` is virtual_pipeline_model_parallel_size (names the setter).
        """
        if name == "virtual_pipeline_model_parallel_size":
            raise AttributeError(
                f"Cannot set {cls.__name__}.{name} (to {value!r}) directly; use "
                f"set_virtual_pipeline_model_parallel_size() instead"
            )
        super().__setattr__(name, value)


@dataclass(init=False, repr=False)
class ProcessGroupCollection:
    """Named process groups for model parallelism, gradient communication and the optimizer.

    Every attribute is optional: an instance holds only the groups given to it (reading a missing
    one raises AttributeError, so ``hasattr`` tells what was provided).

    Attributes:
        tp: tensor parallel. pp: pipeline parallel. mp: model parallel (tensor x pipeline).
        embd / pos_embd: word / position embedding groups (None on stages without one).
        cp: context parallel. tp_cp: tensor x context. hcp: hierarchical context-parallel groups
            (a list, one per level).
        ep: expert model parallel. expt_tp: expert tensor parallel. tp_ep: expert tensor x expert
            model. tp_ep_pp: expert tensor x expert model x pipeline.
        tp_dp_cp: tensor x data x context.
        dp: data parallel. dp_cp: data x context. expt_dp: expert data parallel.
        intra_dp_cp / intra_expt_dp: this distributed-optimizer instance's part of dp_cp / expt_dp.
        inter_dist_opt: across distributed-optimizer instances. intra_dist_opt: all ranks of this
            instance.
        megatron-core 0.19's: dp_cp_ag / expt_dp_ag: all-gather groups over dp_cp's / expt_dp's
            ranks on their own communicators (from parallel_state.create_all_gather_groups; None
            from use_mpu_process_groups, as there). gtp_remat / expt_gtp_remat: the weight-remat
            groups (one rank each: generalized TP is not implemented); dp_cp_gtp_remat,
            expt_dp_gtp_remat, tp_ep_pp_with_egtp_remat: dp_cp, expt_dp, tp_ep_pp with the remat
            ranks merged in (the same groups at remat size 1).

    Example::

        pgs = ProcessGroupCollection(tp=tp_group, dp=dp_group)
        pgs.pp = pp_group
        layer = ColumnParallelLinear(..., tp_group=pgs.tp)
    """

    tp: dist.ProcessGroup = field(init=False)
    pp: dist.ProcessGroup = field(init=False)
    mp: dist.ProcessGroup = field(init=False)
    embd: dist.ProcessGroup = field(init=False)
    pos_embd: dist.ProcessGroup = field(init=False)
    cp: dist.ProcessGroup = field(init=False)
    tp_cp: dist.ProcessGroup = field(init=False)
    hcp: list = field(init=False)
    ep: dist.ProcessGroup = field(init=False)
    expt_tp: dist.ProcessGroup = field(init=False)
    tp_ep: dist.ProcessGroup = field(init=False)
    tp_ep_pp: dist.ProcessGroup = field(init=False)
    tp_dp_cp: dist.ProcessGroup = field(init=False)
    dp: dist.ProcessGroup = field(init=False)
    dp_cp: dist.ProcessGroup = field(init=False)
    expt_dp: dist.ProcessGroup = field(init=False)
    intra_dp_cp: dist.ProcessGroup = field(init=False)
    intra_expt_dp: dist.ProcessGroup = field(init=False)
    inter_dist_opt: dist.ProcessGroup = field(init=False)
    intra_dist_opt: dist.ProcessGroup = field(init=False)
    # megatron-core 0.19
    tp_ep_pp_with_egtp_remat: dist.ProcessGroup = field(init=False)
    dp_cp_gtp_remat: dist.ProcessGroup = field(init=False)
    dp_cp_ag: dist.ProcessGroup = field(init=False)
    gtp_remat: dist.ProcessGroup = field(init=False)
    expt_gtp_remat: dist.ProcessGroup = field(init=False)
    expt_dp_gtp_remat: dist.ProcessGroup = field(init=False)
    expt_dp_ag: dist.ProcessGroup = field(init=False)

    def __init__(self, **kwargs):
        """Set the given groups; an unknown name raises ValueError (as megatron-core does)."""
        names = {f.name for f in fields(self)}
        for key, value in kwargs.items():
            if key not in names:
                raise ValueError(f"Unknown attribute: {key} (known: {sorted(names)})")
            setattr(self, key, value)

    def __repr__(self) -> str:
        """``ProcessGroupCollection(tp(2), dp(4), embd(None), ...)``: the groups set, with sizes."""
        parts = []
        for f in fields(self):
            if hasattr(self, f.name):
                pg = getattr(self, f.name)
                size = "None" if pg is None else (len(pg) if isinstance(pg, list) else pg.size())
                parts.append(f"{f.name}({size})")
        return f"ProcessGroupCollection({', '.join(parts) if parts else 'empty'})"

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: list[str] | None = None):
        """A collection of parallel_state's groups (all of them, or the names in ``required_pgs``).

        Groups parallel_state did not create on this rank (an embedding group on a middle stage,
        hcp without hierarchical context parallelism, inter_dist_opt with one optimizer instance)
        are None; dp, dp_cp and intra_dp_cp must exist.

        Raises:
            ValueError: ``required_pgs`` names an unknown group.
            MegatronCoreError: parallel_state is not initialized (from the dp getters).
        """
        all_pgs = [f.name for f in fields(cls)]
        required_pgs = all_pgs if required_pgs is None else list(required_pgs)
        invalid = [name for name in required_pgs if name not in all_pgs]
        if invalid:
            raise ValueError(f"Invalid process groups requested: {invalid}")
        unchecked = {
            "tp": ps.get_tensor_model_parallel_group,
            "pp": ps.get_pipeline_model_parallel_group,
            "mp": ps.get_model_parallel_group,
            "cp": ps.get_context_parallel_group,
            "tp_cp": ps.get_tensor_and_context_parallel_group,
            "hcp": ps.get_hierarchical_context_parallel_groups,
            "ep": ps.get_expert_model_parallel_group,
            "expt_tp": ps.get_expert_tensor_parallel_group,
            "tp_ep": ps.get_expert_tensor_and_model_parallel_group,
            "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group,
            "embd": ps.get_embedding_group,
            "pos_embd": ps.get_position_embedding_group,
            "intra_expt_dp": partial(
                ps.get_expert_data_parallel_group, partial_expert_data_parallel=True
            ),
            "inter_dist_opt": ps.get_inter_distributed_optimizer_instance_group,
            "intra_dist_opt": ps.get_intra_distributed_optimizer_instance_group,
            "expt_dp": ps.get_expert_data_parallel_group,
            "tp_dp_cp": partial(ps.get_tensor_and_data_parallel_group, with_context_parallel=True),
        }
        unchecked.update(
            tp_ep_pp_with_egtp_remat=partial(
                ps.get_expert_tensor_model_pipeline_parallel_group, with_egtp_remat=True
            ),
            expt_dp_gtp_remat=ps.get_expert_data_parallel_group,
            gtp_remat=ps.get_gtp_weight_remat_group,
            expt_gtp_remat=ps.get_expert_gtp_weight_remat_group,
        )
        getters = {name: partial(get, check_initialized=False) for name, get in unchecked.items()}
        getters["dp_cp_gtp_remat"] = partial(ps.get_data_parallel_group, with_context_parallel=True)
        getters["dp_cp_ag"] = getters["expt_dp_ag"] = lambda: None  # create_all_gather_groups
        getters["dp"] = ps.get_data_parallel_group
        getters["dp_cp"] = partial(ps.get_data_parallel_group, with_context_parallel=True)
        getters["intra_dp_cp"] = partial(
            ps.get_data_parallel_group, with_context_parallel=True, partial_data_parallel=True
        )
        return cls(**{name: getters[name]() for name in required_pgs})

    @staticmethod
    def is_gtp_remat_active(process_group_dict: dict) -> bool:
        """True if the ``gtp_remat_group`` or ``expt_gtp_remat_group`` of a dict from the
        ``setup_process_groups_for_*`` builders spans more than one rank (never here, where
        generalized TP is not implemented; megatron-core 0.19)."""
        return any(
            group is not None and group.size() > 1
            for group in (
                process_group_dict.get("gtp_remat_group"),
                process_group_dict.get("expt_gtp_remat_group"),
            )
        )

    @staticmethod
    def setup_process_groups_for_optimizer(
        pg_collection: ProcessGroupCollection | None,
        model_chunks: list,
        use_gloo_process_groups: bool = True,
    ) -> dict:
        """The groups an optimizer needs, from ``pg_collection`` or (if None) parallel_state.

        Reads ``model_chunks[0].ddp_config`` (num_distributed_optimizer_instances,
        use_distributed_optimizer) and ``model_chunks[0].config.context_parallel_size`` when
        present.

        Returns:
            dict with dp_group, dp_cp_group, intra_dp_cp_group, expt_dp_group,
            intra_expt_dp_group, mp_group, expt_tp_pp_group, inter_dist_opt_group,
            intra_dist_opt_group, intra_dp_cp_group_gloo, intra_expt_dp_group_gloo (None where
            not used); megatron-core 0.19's gtp_remat_group, expt_gtp_remat_group and
            expt_tp_pp_with_egtp_remat_group (expt_tp_pp_group at remat size 1).

        Raises:
            ValueError: a group the configuration needs is missing from ``pg_collection``, or
                gloo groups are asked for together with an explicit ``pg_collection``.
        """
        ddp_config = getattr(model_chunks[0], "ddp_config", None)
        instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)
        if pg_collection is None:
            groups = _ddp_groups_from_parallel_state(ddp_config)
            gloo = use_gloo_process_groups
            groups.update(
                mp_group=ps.get_model_parallel_group(),
                expt_tp_pp_group=ps.get_expert_tensor_model_pipeline_parallel_group(),
                intra_dist_opt_group=ps.get_intra_distributed_optimizer_instance_group(),
                intra_dp_cp_group_gloo=(
                    ps.get_data_parallel_group_gloo(True, partial_data_parallel=True)
                    if gloo
                    else None
                ),
                intra_expt_dp_group_gloo=(
                    ps.get_expert_data_parallel_group_gloo(partial_expert_data_parallel=True)
                    if gloo
                    else None
                ),
            )
            for key in ("tp_group", "pp_group", "ep_group"):
                groups.pop(key)
            groups["expt_tp_pp_with_egtp_remat_group"] = groups["expt_tp_pp_group"]
            return groups
        cp_size = getattr(getattr(model_chunks[0], "config", None), "context_parallel_size", 1)
        groups = {"dp_group": _required(pg_collection, "dp")}
        groups["dp_cp_group"] = _dp_cp(pg_collection, groups["dp_group"], cp_size)
        groups["expt_dp_group"] = _required(pg_collection, "expt_dp")
        groups.update(_partial_groups(pg_collection, groups, ddp_config, instances))
        use_dist_opt = getattr(ddp_config, "use_distributed_optimizer", False)
        groups["intra_dist_opt_group"] = (
            _required(pg_collection, "intra_dist_opt") if use_dist_opt else None
        )
        groups["mp_group"] = _required(pg_collection, "mp")
        groups["expt_tp_pp_group"] = _required(pg_collection, "tp_ep_pp")
        if use_gloo_process_groups:
            raise ValueError(
                "Gloo process groups are not supported when pg_collection is provided. "
                "Please set use_gloo_process_groups to False."
            )
        groups.update(intra_dp_cp_group_gloo=None, intra_expt_dp_group_gloo=None)
        groups["expt_tp_pp_with_egtp_remat_group"] = getattr(
            pg_collection, "tp_ep_pp_with_egtp_remat", groups["expt_tp_pp_group"]
        )
        groups.update(_gtp_groups(pg_collection))
        return groups

    @staticmethod
    def setup_process_groups_for_ddp(
        pg_collection: ProcessGroupCollection | None, config, ddp_config
    ) -> dict:
        """The groups DistributedDataParallel needs, from ``pg_collection`` or parallel_state.

        Returns:
            dict with dp_group, dp_cp_group, intra_dp_cp_group, expt_dp_group,
            intra_expt_dp_group, tp_group, pp_group, ep_group, inter_dist_opt_group and (from
            parallel_state) intra_dist_opt_group, and 0.19's gtp_remat_group /
            expt_gtp_remat_group. Without an expt_dp group in ``pg_collection``, expt_dp_group is
            a new one-rank group of this rank.
        """
        if pg_collection is None:
            return _ddp_groups_from_parallel_state(ddp_config)
        instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)
        groups = {"dp_group": _required(pg_collection, "dp")}
        cp_size = getattr(config, "context_parallel_size", 1)
        groups["dp_cp_group"] = _dp_cp(pg_collection, groups["dp_group"], cp_size)
        expt_dp = getattr(pg_collection, "expt_dp", None)
        if expt_dp is None:
            expt_dp = dist.new_group(ranks=[dist.get_rank()], use_local_synchronization=True)
        groups["expt_dp_group"] = expt_dp
        groups.update(_partial_groups(pg_collection, groups, ddp_config, instances))
        for name in ("tp", "pp", "ep"):
            groups[f"{name}_group"] = _required(pg_collection, name, "tp, pp and ep are required")
        groups.update(_gtp_groups(pg_collection))
        return groups


def _required(pgs: ProcessGroupCollection, name: str, why: str = "") -> dist.ProcessGroup:
    if not hasattr(pgs, name):
        raise ValueError(
            f"{name} process group is required but not provided in pg_collection"
            + (f" ({why})" if why else "; set it to None explicitly if you don't need it")
        )
    return getattr(pgs, name)


def _dp_cp(pgs: ProcessGroupCollection, dp_group, cp_size: int):
    if hasattr(pgs, "dp_cp"):
        return pgs.dp_cp
    if cp_size == 1:
        return dp_group  # without context parallelism dp_cp is dp
    raise ValueError(
        f"dp_cp process group is required when context_parallel_size ({cp_size}) > 1 "
        f"but not provided in pg_collection"
    )


def _partial_groups(pgs: ProcessGroupCollection, groups: dict, ddp_config, instances: int):
    if ddp_config is None or instances == 1:
        return {
            "intra_dp_cp_group": groups["dp_cp_group"],
            "intra_expt_dp_group": groups["expt_dp_group"],
            "inter_dist_opt_group": None,
        }
    why = f"num_distributed_optimizer_instances is {instances}"
    return {
        "intra_dp_cp_group": _required(pgs, "intra_dp_cp", why),
        "intra_expt_dp_group": _required(pgs, "intra_expt_dp", why),
        "inter_dist_opt_group": _required(pgs, "inter_dist_opt", why),
    }


def _gtp_groups(pgs: ProcessGroupCollection | None) -> dict:
    """megatron-core 0.19's weight-remat groups of a builder's dict (None where not given)."""
    if pgs is None:
        return {
            "gtp_remat_group": ps.get_gtp_weight_remat_group(check_initialized=False),
            "expt_gtp_remat_group": ps.get_expert_gtp_weight_remat_group(check_initialized=False),
        }
    return {
        "gtp_remat_group": getattr(pgs, "gtp_remat", None),
        "expt_gtp_remat_group": getattr(pgs, "expt_gtp_remat", None),
    }


def _ddp_groups_from_parallel_state(ddp_config) -> dict:
    instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)
    use_dist_opt = getattr(ddp_config, "use_distributed_optimizer", False)
    return {
        "dp_group": ps.get_data_parallel_group(),
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
        "intra_dp_cp_group": ps.get_data_parallel_group(True, partial_data_parallel=True),
        "expt_dp_group": ps.get_expert_data_parallel_group(),
        "intra_expt_dp_group": ps.get_expert_data_parallel_group(partial_expert_data_parallel=True),
        "tp_group": ps.get_tensor_model_parallel_group(),
        "pp_group": ps.get_pipeline_model_parallel_group(),
        "ep_group": ps.get_expert_model_parallel_group(),
        "inter_dist_opt_group": (
            ps.get_inter_distributed_optimizer_instance_group() if instances > 1 else None
        ),
        "intra_dist_opt_group": (
            ps.get_intra_distributed_optimizer_instance_group() if use_dist_opt else None
        ),
        **_gtp_groups(None),
    }


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

    module_pgs: dict[str, ProcessGroupCollection]
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
