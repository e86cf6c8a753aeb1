"""The switch's CPU mode (megatron_core/megatron/cpu_mode.py), one stand-in at a time.

The mode changes process-wide state (torch.cuda's names, torch.distributed's group makers, the
torch-function mode stack), and the pytest process is shared, so every test that turns it on
runs its code in a fresh Python process and reads back what it printed (JSON on the last line);
a check that needs no mode turned on runs on the harness's ranks. No test patches
torch or megatron-core to make the mode work; where a test fakes something (a GPU), it says so.
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from megatron_core.megatron import cpu_mode
from megatron_core.testing import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU-only torch")


def run_python(code: str, **env: str):
    """Run ``code`` as a script in a fresh interpreter (this checkout first on the path, the CPU
    mode's variable unset unless given) and return the JSON it printed last."""
    unset = (cpu_mode.ENV, "MEGATRON_CORE_SWITCH")
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    environ["PYTHONPATH"] = os.pathsep.join([ROOT, environ.get("PYTHONPATH", "")])
    environ.update(env)
    with tempfile.TemporaryDirectory() as directory:
        script = os.path.join(directory, "cpu_mode_check.py")
        with open(script, "w") as file:
            file.write(textwrap.dedent(code))
        result = subprocess.run(
            [sys.executable, script],
            capture_output=True,
            text=True,
            timeout=240,
            env=environ,
            cwd=ROOT,
        )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_guide_lists_exactly_the_answered_names():
    guide = open(os.path.join(ROOT, "docs", "guides", "cpu-mode.md")).read()
    section = guide.split("The CPU mode answers:")[1].split("\n\n")[1]
    listed = {line.split("`")[1] for line in section.splitlines() if line.startswith("- `")}
    assert listed == set(cpu_mode.ANSWERED)


def test_answered_names_are_the_replaced_ones_and_disable_restores_them():
    report = run_python(
        """
        import json, torch, torch.distributed
        from megatron_core.megatron import cpu_mode

        def lookup(name):
            owner, _, attr = name.rpartition(".")
            return getattr(eval(owner), attr)

        names = [n for n in cpu_mode.ANSWERED if n.startswith("torch.")]
        stand_ins = sorted(f"{module.__name__}.{attr}" for module, attr in cpu_mode._stand_ins())
        before = {n: lookup(n) for n in names}
        cpu_mode.enable()
        replaced = sorted(n for n in names if lookup(n) is not before[n])
        cpu_mode.disable()
        restored = all(lookup(n) is before[n] for n in names)
        print(json.dumps({"replaced": replaced, "restored": restored, "stand_ins": stand_ins,
                          "stack": len(torch.overrides._get_current_function_mode_stack())}))
        """
    )
    # torch.cuda.* and torch.distributed.* are replaced attributes; the torch.Tensor /
    # torch.nn.Module names are answered by the torch-function mode (checked by behaviour below).
    attributes = sorted(n for n in cpu_mode.ANSWERED if n.startswith(("torch.cuda.", "torch.dist")))
    assert report["replaced"] == attributes == report["stand_ins"]
    assert report["restored"] and report["stack"] == 0
    # The rest: torch.Tensor / torch.nn.Module (the torch-function mode) and the module names of
    # rule 8, each name in COMPLETED exactly once.
    completed = sorted(
        f"{module}.{name}" for module, names in cpu_mode.COMPLETED.items() for name in names
    )
    others = {n for n in cpu_mode.ANSWERED if n not in attributes and n not in completed}
    assert set(completed) <= set(cpu_mode.ANSWERED)
    adapted = sorted(
        f"{module}.{name}" for module, names in cpu_mode.ADAPTED.items() for name in names
    )
    assert adapted == sorted(n for n in others if n.startswith("megatron."))
    mode_names = ("torch.Tensor.", "torch.nn.Module.", "torch.nn.functional.", "torch.rand")
    rest = {n for n in others if not n.startswith("megatron.")} - {"CUDA_DEVICE_MAX_CONNECTIONS"}
    assert all(n.startswith(mode_names) for n in rest), rest


def test_undefined_module_names_are_completed_on_import_and_removed_on_disable(tmp_path):
    # A stand-in package named like megatron-core's module (first on the path): one version
    # leaves te_general_gemm undefined, as megatron-core 0.16.1 does without Transformer
    # Engine, the other defines it.
    package = tmp_path / "megatron" / "core" / "transformer" / "moe"
    package.mkdir(parents=True)
    for level in (package, *list(package.parents)[:3]):
        (level / "__init__.py").write_text("")
    report = run_python(
        f"""
        import importlib, json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from megatron_core.megatron import cpu_mode

        path = {str(package / "moe_utils.py")!r}
        name = "megatron.core.transformer.moe.moe_utils"

        def fresh(text):
            open(path, "w").write(text)
            sys.modules.pop(name, None)
            importlib.invalidate_caches()
            return importlib.import_module(name)

        cpu_mode.enable()
        bare = fresh("def gating():\\n    return te_general_gemm\\n")
        on_import = [bare.gating() is None, "te_general_gemm" in vars(bare)]
        own = fresh("te_general_gemm = 'theirs'\\n")
        kept = own.te_general_gemm
        cpu_mode.disable()
        own_kept = "te_general_gemm" in vars(own)
        bare_after = "te_general_gemm" in vars(bare)
        # Imported before the mode turned on: completed when it does.
        early = fresh("def gating():\\n    return te_general_gemm\\n")
        cpu_mode.enable()
        late = early.gating() is None
        cpu_mode.disable()
        print(json.dumps({{"on_import": on_import, "kept": kept, "own_kept": own_kept,
                          "bare_after": bare_after, "late": late,
                          "finder_gone": not any(type(f).__name__ == "PostImportFinder"
                                                 for f in sys.meta_path)}}))
        """
    )
    assert report["on_import"] == [True, True]
    assert report["kept"] == "theirs" and report["own_kept"]
    assert not report["bare_after"] and report["late"] and report["finder_gone"]


@needs_no_cuda
def test_megatron_lm_walls_each_answered_and_put_back(tmp_path):
    # NOTE rule 9, one wall at a time, on stand-ins for Megatron-LM's files (its training
    # package is on no index): each stand-in fails as the real file does without the mode.
    files = {
        "training/initialize.py": (
            "import torch\n"
            "def initialize_megatron(extra_args_provider=None, args_defaults={},\n"
            "                        ignore_unknown_args=False, allow_no_cuda=False):\n"
            "    if not allow_no_cuda:\n"
            "        assert torch.cuda.is_available(), 'Megatron requires CUDA.'\n"
            "    return allow_no_cuda\n"
        ),
        "core/datasets/utils.py": "CALLS = []\ndef compile_helpers():\n    CALLS.append('make')\n",
        "legacy/fused_kernels/__init__.py": (
            "from torch.utils import cpp_extension\n"
            "def load(args):\n    return cpp_extension.CUDA_HOME + '/bin/nvcc'\n"
        ),
    }
    for name, text in files.items():
        path = tmp_path / "megatron" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in ("training", "core", "core/datasets", "legacy"):
        (tmp_path / "megatron" / folder / "__init__.py").touch()
    report = run_python(
        f"""
        import json, os, sys, torch
        sys.path.insert(0, {str(tmp_path)!r})
        from torch.utils import cpp_extension
        from megatron_core.megatron import cpu_mode

        out = {{}}
        from megatron.training import initialize  # imported before: wrapped when the mode starts
        original_init = initialize.initialize_megatron
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        cpu_mode.enable()
        out["init"] = initialize.initialize_megatron()
        try:
            initialize.initialize_megatron(allow_no_cuda=False)
            out["explicit_false"] = "passed"
        except AssertionError as e:
            out["explicit_false"] = str(e)
        from megatron.core.datasets import utils  # imported after: wrapped on import
        utils.compile_helpers()
        out["make_without_prebuilt"] = list(utils.CALLS)
        open(os.path.join({str(tmp_path)!r}, "megatron/core/datasets/helpers_cpp.py"), "w").close()
        utils.compile_helpers()
        out["make_with_prebuilt"] = list(utils.CALLS)
        from megatron.legacy import fused_kernels
        out["cuda_home"] = cpp_extension.CUDA_HOME
        out["load"] = fused_kernels.load(None)
        cpp_extension.CUDA_HOME = "/opt/cuda"
        out["load_with_toolkit"] = fused_kernels.load(None)
        cpp_extension.CUDA_HOME = None
        props = torch.cuda.get_device_properties(torch.device("cuda:0"))
        out["props"] = [props.major, props.minor, props.name, props.gcnArchName,
                        props.total_memory > 0, props.multi_processor_count > 0]
        out["env_on"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        cpu_mode.disable()
        out["env_off"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        out["restored"] = initialize.initialize_megatron is original_init
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"  # a user's value is kept
        cpu_mode.enable()
        out["env_kept"] = os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]
        cpu_mode.disable()
        out["env_kept_off"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        print(json.dumps(out))
        """
    )
    assert report["init"] is True
    assert report["explicit_false"] == "Megatron requires CUDA."  # an explicit False holds
    assert report["make_without_prebuilt"] == ["make"] == report["make_with_prebuilt"]
    if report["cuda_home"] is None:  # this machine has no CUDA toolkit
        assert report["load"] is None
    assert report["load_with_toolkit"] == "/opt/cuda/bin/nvcc"
    assert report["props"][:2] == [8, 0] and report["props"][3] == ""
    assert isinstance(report["props"][2], str) and all(report["props"][4:])
    assert report["env_on"] == "1" and report["env_off"] is None and report["restored"]
    assert report["env_kept"] == "8" == report["env_kept_off"]


@needs_no_cuda
def test_device_arguments_naming_cuda_mean_the_cpu():
    report = run_python(
        """
        import json, torch
        from megatron_core.megatron import cpu_mode

        cpu_mode.enable()
        index = torch.cuda.current_device()
        made = [
            torch.zeros(2, device="cuda"),
            torch.empty(2, device="cuda:0"),
            torch.ones(2, device=torch.device("cuda")),
            torch.tensor([1.0], device=index),
            torch.arange(3, device="cuda"),
            torch.ones(2).new_zeros(3, device="cuda"),
            torch.ones(2).to("cuda"),
            torch.ones(2).to(index),
            torch.ones(2).to(torch.device("cuda", 0), torch.float64),
            torch.ones(2).to(device="cuda", non_blocking=True),
            torch.zeros_like(torch.ones(2), device="cuda"),
        ]
        tensor = torch.ones(2)
        module = torch.nn.Linear(2, 2)
        weight = module.weight
        module.cuda()
        module.to("cuda")
        print(json.dumps({
            "index": index,
            "devices": sorted({str(t.device) for t in made}),
            "double": str(made[8].dtype),
            "cuda_is_self": tensor.cuda() is tensor,
            "module_kept": module.weight is weight and str(weight.device) == "cpu",
            "types": [
                tensor.type(), tensor.half().type(), tensor.type("torch.cuda.HalfTensor").type()
            ],
            "cpu_device_kept": str(torch.zeros(1, device="cpu").device),
        }))
        """
    )
    assert report["index"] == 0
    assert report["devices"] == ["cpu"] and report["double"] == "torch.float64"
    assert report["cuda_is_self"] and report["module_kept"]
    # type() names CPU tensors as CUDA's; a conversion to a CUDA type name converts on the CPU.
    assert report["types"] == [
        "torch.cuda.FloatTensor",
        "torch.cuda.HalfTensor",
        "torch.cuda.HalfTensor",
    ]
    assert report["cpu_device_kept"] == "cpu"


@needs_no_cuda
@pytest.mark.skipif(
    not hasattr(torch.overrides, "redispatch_function"),
    reason="torch without redispatch_function runs autograd's hooks without the mode (NOTE rule 3)",
)
def test_mode_is_active_inside_backward_hooks_custom_functions_and_checkpoints():
    report = run_python(
        """
        import json, torch
        from torch.utils.checkpoint import checkpoint
        from megatron_core.megatron import cpu_mode

        class Twice(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, grad):
                return grad * torch.full((1,), 2.0, device="cuda")

        cpu_mode.enable()
        x = torch.ones(2, requires_grad=True)
        x.register_hook(lambda g: g + torch.zeros(2, device=torch.cuda.current_device()))
        Twice.apply(x).sum().backward()
        (grad,) = torch.autograd.grad(Twice.apply(x).sum(), x)
        done = []
        for reentrant in (True, False):
            y = checkpoint(lambda t: Twice.apply(t) * torch.ones(2, device="cuda"), x,
                           use_reentrant=reentrant)
            torch.autograd.backward([y.sum()])
            done.append(reentrant)
        print(json.dumps({"grad": x.grad.tolist(), "autograd_grad": grad.tolist(), "done": done,
                          "stack": len(torch.overrides._get_current_function_mode_stack())}))
        """
    )
    # d(2x)/dx = 2 (through the custom backward; the hook adds zeros): 2 from autograd.grad, and
    # 2 + 2 + 2 accumulated by one backward and two checkpointed backwards.
    assert report["autograd_grad"] == [2.0, 2.0] and report["done"] == [True, False]
    assert report["grad"] == [6.0, 6.0]
    assert report["stack"] == 1  # the mode, once


@needs_no_cuda
def test_streams_events_and_rng_stand_ins():
    report = run_python(
        """
        import json, torch
        from megatron_core.megatron import cpu_mode

        cpu_mode.enable()
        stream = torch.cuda.Stream(priority=-1)
        default = torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            inside = torch.cuda.current_stream() is stream
            with torch.cuda.stream(None):
                none_kept = torch.cuda.current_stream() is stream
        context = torch.cuda.stream(stream)  # reusable, as torch's StreamContext
        with context:
            pass
        with context:
            inside = inside and torch.cuda.current_stream() is stream
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        default.wait_stream(stream)
        stream.wait_event(start)
        event = stream.record_event()
        torch.cuda.synchronize()
        end.record(stream)
        torch.cuda.manual_seed(7)
        a = torch.rand(3, device="cuda")
        torch.manual_seed(7)
        seeded = torch.equal(a, torch.rand(3, device="cuda"))
        torch.cuda.manual_seed_all(8)
        state = torch.cuda.get_rng_state()
        b = torch.rand(3, device="cuda")
        torch.rand(5)  # a host draw: the CPU generator, not CUDA's
        torch.cuda.set_rng_state(state)
        print(json.dumps({
            "inside": inside, "none_kept": none_kept,
            "back": torch.cuda.current_stream() is default,
            "default": torch.cuda.default_stream() is default,
            "cpu_stream": isinstance(stream, getattr(torch.cpu, "Stream", object)),
            "done": [stream.query(), event.query(), end.query()],
            "elapsed": start.elapsed_time(end) >= 0,
            "seeded": seeded, "replayed": torch.equal(b, torch.rand(3, device="cuda")),
            "set_device": torch.cuda.set_device(1) is None,
        }))
        """
    )
    assert all(report.values()), report
    assert report["done"] == [True, True, True]


@needs_no_cuda
def test_nccl_groups_are_made_with_gloo(tmp_path):
    report = run_python(
        f"""
        import json, torch, torch.distributed as dist
        from megatron_core.megatron import cpu_mode

        cpu_mode.enable()
        dist.init_process_group("nccl", init_method="file://{tmp_path}/rendezvous", rank=0,
                                world_size=1, device_id=torch.device("cuda", 0))
        world = dist.get_backend()
        plain = dist.get_backend(dist.new_group([0], backend="nccl"))
        with_options = dist.get_backend(dist.new_group([0], None, "nccl", object()))
        mixed = dist.get_backend(dist.new_group([0], backend="cuda:nccl,cpu:gloo"))
        tensor = torch.ones(2, device="cuda")
        dist.all_reduce(tensor)
        dist.destroy_process_group()
        print(json.dumps([world, plain, with_options, mixed, tensor.tolist()]))
        """
    )
    assert report == ["gloo", "gloo", "gloo", "gloo", [1.0, 1.0]]


def test_auto_mode_the_variable_and_the_warning():
    code = """
        import json, warnings, torch
        from megatron_core.megatron import cpu_mode

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            on = cpu_mode.configure(None)
            cpu_mode.disable()
            again = cpu_mode.configure(None)
        warned = [str(w.message) for w in caught if w.category is UserWarning]
        print(json.dumps({"on": on, "again": again, "warnings": warned}))
        """
    auto = run_python(code)
    no_cuda = not torch.cuda.is_available()
    assert auto["on"] is no_cuda and auto["again"] is no_cuda
    if no_cuda:
        assert len(auto["warnings"]) == 1  # once per process
        assert "cuda_on_cpu=False" in auto["warnings"][0] and cpu_mode.ENV in auto["warnings"][0]
    assert run_python(code, **{cpu_mode.ENV: "0"}) == {"on": False, "again": False, "warnings": []}
    forced = run_python(code, **{cpu_mode.ENV: "yes"})
    assert forced["on"] and forced["again"] and len(forced["warnings"]) == 1


def test_a_bad_variable_value_is_named():
    report = run_python(
        """
        import json
        from megatron_core.megatron import cpu_mode
        try:
            cpu_mode.configure(None)
            print(json.dumps("no error"))
        except Exception as error:
            print(json.dumps([type(error).__name__, str(error), cpu_mode.is_active()]))
        """,
        **{cpu_mode.ENV: "maybe"},
    )
    assert report[0] == "FlagError" and "'maybe'" in report[1] and report[2] is False


def test_auto_mode_does_nothing_where_cuda_is_available():
    # Fakes a GPU machine (torch.cuda.is_available answering True) in the child process only.
    report = run_python(
        """
        import json, torch
        torch.cuda.is_available = lambda: True
        from megatron_core.megatron import cpu_mode
        before = torch.cuda.current_device
        print(json.dumps([cpu_mode.configure(None), torch.cuda.current_device is before,
                          len(torch.overrides._get_current_function_mode_stack())]))
        """
    )
    assert report == [False, True, 0]


def test_enable_pushes_once_and_disable_keeps_other_modes():
    report = run_python(
        """
        import json, torch
        from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
        from megatron_core.megatron import cpu_mode

        class Counting(TorchFunctionMode):
            calls = 0
            def __torch_function__(self, func, types, args=(), kwargs=None):
                Counting.calls += 1
                return func(*args, **(kwargs or {}))

        cpu_mode.enable()
        cpu_mode.enable()
        once = len(_get_current_function_mode_stack())
        user = Counting()
        user.__enter__()
        cpu_mode.disable()
        stack = _get_current_function_mode_stack()
        torch.ones(1) + 1
        user.__exit__(None, None, None)
        cpu_mode.disable()
        print(json.dumps([once, len(stack), stack[0] is user, Counting.calls > 0,
                          len(_get_current_function_mode_stack())]))
        """
    )
    assert report == [1, 1, True, True, 0]


@pytest.mark.requires_megatron_core
@needs_no_cuda
def test_install_turns_it_on_by_default_and_keeps_an_explicit_choice():
    report = run_python(
        """
        import json, warnings
        warnings.simplefilter("ignore")
        from megatron_core import megatron
        from megatron_core.megatron import cpu_mode

        seen = []
        megatron.install()
        seen.append(cpu_mode.is_active())
        megatron.install(cuda_on_cpu=False)
        seen.append(cpu_mode.is_active())
        megatron.install()  # None keeps the earlier choice
        seen.append(cpu_mode.is_active())
        megatron.install(cuda_on_cpu=True)
        seen.append(cpu_mode.is_active())
        megatron.uninstall()
        seen.append(cpu_mode.is_active())
        print(json.dumps(seen))
        """
    )
    assert report == [True, False, False, True, False]


@pytest.mark.requires_megatron_core
@needs_no_cuda
@pytest.mark.parametrize("choice", [None, False])
def test_spawn_children_get_the_parents_choice(choice):
    report = run_python(
        f"""
        import json, multiprocessing, warnings
        warnings.simplefilter("ignore")
        from megatron_core import megatron
        from megatron_core.megatron import cpu_mode

        def child(queue):
            queue.put(cpu_mode.is_active())

        if __name__ == "__main__":
            megatron.install(cuda_on_cpu={choice})
            context = multiprocessing.get_context("spawn")
            queue = context.Queue()
            process = context.Process(target=child, args=(queue,))
            process.start()
            in_child = queue.get(timeout=120)
            process.join()
            print(json.dumps([cpu_mode.is_active(), in_child]))
        """
    )
    assert report == [choice is None, choice is None]


@needs_no_cuda
def test_device_count_is_the_local_world_size():
    # NOTE rule 5: one device per process on the node, so megatron-core's
    # set_device(rank % device_count()) does not divide by zero; is_available() stays False.
    code = """
        import json, os, torch
        from megatron_core.megatron import cpu_mode
        from megatron_core.errors import MegatronCoreError

        before = torch.cuda.device_count()
        cpu_mode.enable()
        seen = [torch.cuda.device_count(), torch.cuda.is_available()]
        os.environ["LOCAL_WORLD_SIZE"] = "bad"
        try:
            torch.cuda.device_count()
        except MegatronCoreError as error:
            seen.append(str(error))
        del os.environ["LOCAL_WORLD_SIZE"]
        seen.append(torch.cuda.device_count())
        cpu_mode.disable()
        print(json.dumps([before, *seen, torch.cuda.device_count()]))
        """
    before, count, available, error, unset, after = run_python(code, LOCAL_WORLD_SIZE="3")
    assert (before, count, available, unset, after) == (0, 3, False, 1, 0)
    assert "LOCAL_WORLD_SIZE='bad'" in error


def _new_group_lists(rank_lists_by_rank):
    """Each rank asks torch's new_group for its own list through the CPU mode's serving (NOTE [
    Rank lists per rank ]); returns, per call, the group's ranks and a sum over it, or the
    error."""
    import inspect

    import torch.distributed as dist

    from megatron_core.megatron.group_lists import new_group_per_rank

    ranks = rank_lists_by_rank[dist.get_rank()]
    said = {}
    for name, arguments in (
        ("same", {"ranks": [0, 1]}),
        ("own", {"ranks": ranks}),
        ("after", {"ranks": list(range(dist.get_world_size()))}),  # the groups still agree
    ):
        try:
            bound = inspect.signature(dist.new_group).bind(**arguments)
            group = new_group_per_rank(dist.new_group, bound)
        except Exception as exc:  # the refusal, the same on every rank
            said[name] = str(exc)
            continue
        if group == dist.GroupMember.NON_GROUP_MEMBER:
            said[name] = "not a member"
            continue
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total, group=group)
        said[name] = (dist.get_process_group_ranks(group), total.item())
    return said


@pytest.mark.parametrize(
    "lists",
    [
        [[0, 2], [1, 3], [0, 2], [1, 3]],  # megatron-core's expert-dp lists (0.19)
        [[0, 1], [0, 1], [2, 3], [2, 3]],
        [[0], [1], [2], [3]],  # one-stage embedding groups: one member each
        [[0], [0], [2], [2]],  # a list that leaves its caller out: not a member, as torch says
    ],
)
def test_new_group_with_a_rank_list_per_rank_is_served_on_every_rank(lists):
    # megatron-core 0.19's test_expert_all_gather_group and the pipeline tests' embedding
    # groups pass each rank its own list: NCCL connects lazily, gloo would wait forever; the
    # CPU mode creates every distinct list on every rank and hands each rank its own.
    for rank, said in enumerate(run_distributed(_new_group_lists, 4, lists)):
        assert said["same"] == (([0, 1], 1.0) if rank < 2 else "not a member"), said
        if rank in lists[rank]:
            assert said["own"] == (lists[rank], float(sum(lists[rank]))), said
        else:
            assert said["own"] == "not a member", said
        assert said["after"] == ([0, 1, 2, 3], 6.0), said


@pytest.mark.parametrize("lists", [[[0, 1], [1, 2], [1, 2], [3]], [[0, 1], None, None, None]])
def test_new_group_lists_that_overlap_are_refused_on_every_rank(lists):
    # NOTE [ Rank lists per rank ], rule 3: a rank in two different lists (or "all ranks"
    # beside a list) cannot be one group per call; every rank raises, nothing is created
    for said in run_distributed(_new_group_lists, 4, lists):
        assert "rank lists that differ between ranks and overlap" in said["own"], said
        shown = "all ranks" if lists[1] is None else "[1, 2]"
        assert f"rank 0: [0, 1]; rank 1: {shown}" in said["own"], said
        assert said["after"] == ([0, 1, 2, 3], 6.0), said
