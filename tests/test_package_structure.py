"""The package's structure: no import circle between its modules, both backends implement the
whole backend interface, a group's parameters are GroupConfig's fields, the public names show in
dir() and help() without making the package import heavy, and the import keeps torch's "No CUDA
runtime" notice off CPU machines' output."""

import ast
import inspect
import os
import pathlib
import pydoc
import subprocess
import sys

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


# The front end (what users call) and the modules allowed above it: the Megatron dispatchers,
# what they share (their Groups) and their registration. Every other module sits below the
# front end and never imports it.
FRONT_END = {"megatron_nccl_ep.api", "megatron_nccl_ep.ll", "megatron_nccl_ep.autograd"}
ABOVE_FRONT_END = {"megatron_nccl_ep", "megatron_nccl_ep.dispatcher_common",
                   "megatron_nccl_ep.dispatcher", "megatron_nccl_ep.inference",
                   "megatron_nccl_ep.megatron"}


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


def _run_python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that imports this checkout's package."""
    path = os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=path, **env), timeout=300)


def test_public_names_show_in_dir_without_importing_torch_or_megatron():
    code = ("import sys, megatron_nccl_ep as ep\n"
            "print(sorted(set(ep.__all__) - set(dir(ep))))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))")
    result = _run_python(code)
    assert result.returncode == 0, result.stdout + result.stderr
    missing, heavy = result.stdout.splitlines()
    assert missing == "[]", f"names of __all__ missing from dir(): {missing}"
    assert heavy == "[]", f"import megatron_nccl_ep and dir() imported {heavy}"


def test_public_names_resolve_and_help_documents_them():
    assert len(ep.__all__) == len(set(ep.__all__)) >= 12
    for name in ep.__all__:
        value = getattr(ep, name)
        assert value.__name__ == name and name in dir(ep), name
        # The module docstring (help()'s description) names the whole API.
        assert f"``{name}``" in ep.__doc__, f"the package docstring does not name {name}"
    with pytest.raises(AttributeError, match="has no attribute 'Grup'"):
        ep.Grup  # noqa: B018
    text = pydoc.render_doc(ep, renderer=pydoc.plaintext)
    classes, functions = text.split("\nCLASSES\n")[1].split("\nFUNCTIONS\n")
    for name in ep.__all__:
        if inspect.isclass(getattr(ep, name)):
            assert f"class {name}(" in classes, name
        else:
            assert f"\n    {name}(" in functions.split("\nDATA\n")[0], name


NO_CUDA_RUNTIME_NOTICE = "No CUDA runtime is found"


@pytest.mark.skipif(torch.version.cuda is None, reason="a torch built without CUDA never logs "
                    f"{NO_CUDA_RUNTIME_NOTICE!r}")
def test_import_drops_torchs_no_cuda_runtime_notice_only(tmp_path):
    """torch.utils.cpp_extension (which megatron.core imports) logs the notice where torch sees no
    CUDA GPU but finds a CUDA toolkit (CUDA_HOME): after ``import megatron_nccl_ep`` it is gone,
    and the logger's other records still show."""
    code = ("import sys\n"
            "if sys.argv[1] == 'package':\n"
            "    import megatron_nccl_ep\n"
            "import torch.utils.cpp_extension as cpp_extension\n"
            "cpp_extension.logger.warning('another cpp_extension record')")
    runs = {which: _run_python(code, which, CUDA_HOME=str(tmp_path), CUDA_VISIBLE_DEVICES="")
            for which in ("torch", "package")}
    for which, result in runs.items():
        assert result.returncode == 0, result.stdout + result.stderr
        assert "another cpp_extension record" in result.stderr, (which, result.stderr)
    assert NO_CUDA_RUNTIME_NOTICE in runs["torch"].stderr, runs["torch"].stderr
    assert NO_CUDA_RUNTIME_NOTICE not in runs["package"].stderr, runs["package"].stderr
