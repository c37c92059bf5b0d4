"""The package's structure: no import circle between its modules, both backends implement the
whole backend interface, and a group's parameters are GroupConfig's fields."""

import ast
import inspect
import pathlib

import pytest
import torch

import megatron_nccl_ep as ep
from megatron_nccl_ep import backend, config, cuda_backend, reference

PACKAGE = pathlib.Path(ep.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, name: str, modules: set) -> set:
    """The package modules ``name`` imports anywhere in its file (function-level imports too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _import_graph() -> dict:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, name, set(files)) for name, path in files.items()}


def test_no_import_circle():
    graph = _import_graph()
    assert "megatron_nccl_ep.config" in graph and "megatron_nccl_ep.api" in graph
    # __init__ imports its names lazily (by string): it sits above everything, so it is left out.
    graph = {m: {t for t in ts if t != "megatron_nccl_ep"} for m, ts in graph.items()
             if m != "megatron_nccl_ep"}
    state, circles = {}, []

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, f"import circles: {circles}"


# The front end (what users call) and the modules allowed above it: the Megatron dispatchers
# and their registration. Every other module sits below the front end and never imports it.
FRONT_END = {"megatron_nccl_ep.api", "megatron_nccl_ep.ll", "megatron_nccl_ep.autograd"}
ABOVE_FRONT_END = {"megatron_nccl_ep", "megatron_nccl_ep.dispatcher",
                   "megatron_nccl_ep.inference", "megatron_nccl_ep.megatron"}


def test_shared_types_sit_below_the_front_end():
    graph = _import_graph()
    assert "megatron_nccl_ep.reference" in graph and "megatron_nccl_ep.cuda_backend" in graph
    for module, targets in graph.items():
        if module in FRONT_END | ABOVE_FRONT_END:
            continue
        assert not targets & FRONT_END, f"{module} imports the front end: {targets & FRONT_END}"
    # The floor: limits (the library's header) imports nothing, fp8 (a payload's cast) only it,
    # and config only those two.
    assert graph["megatron_nccl_ep.limits"] == set()
    assert graph["megatron_nccl_ep.fp8"] == {"megatron_nccl_ep.limits"}
    assert graph["megatron_nccl_ep.config"] == {"megatron_nccl_ep.limits",
                                                "megatron_nccl_ep.fp8"}


def _protocol_members(protocol) -> dict:
    return {name: member for name, member in vars(protocol).items()
            if not name.startswith("_") or name == "__init__"}


@pytest.mark.parametrize("implementation", [reference.ReferenceBackend, cuda_backend.CudaBackend],
                         ids=["torch", "cuda"])
def test_backends_implement_every_method_of_the_interface(implementation):
    members = _protocol_members(backend.Backend)
    assert {"check", "local_team", "info", "agree_on_arguments", "create_handle", "dispatch",
            "combine", "combine_probs", "destroy"} <= set(members)
    for name, member in members.items():
        assert hasattr(implementation, name), f"{implementation.__name__} lacks {name}"
        if not callable(member) and not isinstance(member, (staticmethod, classmethod)):
            continue
        want = inspect.signature(getattr(backend.Backend, name))
        have = inspect.signature(getattr(implementation, name))
        assert list(have.parameters)[:len(want.parameters)] == list(want.parameters), \
            f"{implementation.__name__}.{name}{have} against the interface's {want}"
    assert isinstance(implementation.name, str)


def test_group_takes_a_config_or_its_fields():
    fields = dict(num_experts=8, hidden=16, max_tokens_per_rank=32, max_topk=2,
                  dtype=torch.float32, recv_mode="capacity")
    by_fields = ep.Group(backend="torch", device="cpu", capacity_factor=1.5, **fields)
    built = config.GroupConfig.build(1, capacity_factor=1.5, **fields)
    assert by_fields.config == built
    assert built.max_recv_tokens_per_rank == config.capacity_from_factor(1.5, 32, 2, 8, 1)
    by_config = ep.Group(config=built, backend="torch", device="cpu")
    assert by_config.config is built
    with pytest.raises(TypeError, match="not both"):
        ep.Group(config=built, backend="torch", device="cpu", hidden=16)
    with pytest.raises(TypeError, match=r"unexpected group parameter\(s\) \['hiden'\]"):
        ep.Group(backend="torch", device="cpu", hiden=16, num_experts=8,
                 max_tokens_per_rank=32, max_topk=2)
    with pytest.raises(TypeError, match=r"missing group parameter\(s\) \['hidden'\]"):
        ep.Group(backend="torch", device="cpu", num_experts=8, max_tokens_per_rank=32,
                 max_topk=2)
    with pytest.raises(ValueError, match="max_topk must be in"):
        ep.Group(config=config.GroupConfig(8, 16, 32, 9), backend="torch", device="cpu")


def test_local_team_refuses_without_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        ep.Group.local_team(2, num_experts=8, hidden=16, max_tokens_per_rank=32, max_topk=2,
                            device="cpu")
