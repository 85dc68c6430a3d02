"""The layout's rules, read from the source: no import cycle (imports inside functions count),
the engine (runtime/) never reaches launcher, front or Triton code, the contracts (kvforge/)
depend on no stage, every package imports without nvidia-pytriton, the Triton-stub code imports
with a stand-in for triton_python_backend_utils, and pyproject lists every package."""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvforge", "export", "engines", "runtime", "triton_models", "launcher", "frontend", "clients", "bench")
TRITON_ONLY = ("triton_python_backend_utils", "pytriton", "tritonclient")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            modules[module_name(path)] = path
    for path in (ROOT / "model_repository").glob("*/1/model.py"):
        modules[f"model_repository.{path.parts[-3]}"] = path
    return modules


def imported_names(path: Path) -> set[str]:
    """Every module an import statement anywhere in the file names (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(project module -> project modules it imports, project module -> external top-level names)."""
    modules = project_modules()
    graph, external = {}, {}
    for name, path in modules.items():
        names = imported_names(path)
        graph[name] = {n for n in names if n in modules and n != name}
        external[name] = {n.split(".")[0] for n in names if n.split(".")[0] not in PACKAGES}
    return graph, external


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_there_is_no_import_cycle():
    graph, _ = import_graph()
    cycles = sorted(name for name in graph if name in reachable(graph, name))
    assert cycles == [], f"modules on an import cycle: {cycles}"


def test_the_engine_never_imports_launcher_front_or_triton_code():
    graph, external = import_graph()
    for name in graph:
        if not name.startswith("runtime"):
            continue
        reached = reachable(graph, name) | {name}
        stages = sorted(m for m in reached if m.split(".")[0] in ("launcher", "frontend", "triton_models",
                                                                  "model_repository", "clients", "bench"))
        assert stages == [], f"{name} reaches {stages}"
        triton = sorted({n for m in reached for n in external[m]} & set(TRITON_ONLY))
        assert triton == [], f"{name} imports {triton}"


def test_contracts_depend_on_no_stage():
    graph, _ = import_graph()
    for name in graph:
        if name.startswith("kvforge"):
            stages = sorted(m for m in reachable(graph, name) if not m.startswith("kvforge"))
            assert stages == [], f"{name} reaches {stages}"


def test_only_triton_stub_code_imports_the_python_backend():
    graph, external = import_graph()
    users = sorted(name for name in graph if "triton_python_backend_utils" in external[name])
    assert all(name.startswith(("triton_models", "model_repository")) for name in users), users


BLOCK_AND_IMPORT = textwrap.dedent("""
    import importlib, importlib.abc, importlib.util, sys
    blocked = set(sys.argv[1].split(","))

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in blocked:
                raise ModuleNotFoundError(f"{name} is blocked for this check")

    sys.meta_path.insert(0, Blocker())
    if sys.argv[2] == "stand-in":  # what a stub sees: Triton's module, here a stand-in
        class StandIn:
            def __getattr__(self, name):
                return StandIn()

            def __call__(self, *args, **kwargs):
                return StandIn()

        stand_in = type(sys)("triton_python_backend_utils")
        stand_in.__getattr__ = lambda name: StandIn()
        sys.modules["triton_python_backend_utils"] = stand_in
    for target in sys.argv[3:]:
        if target.endswith(".py"):
            spec = importlib.util.spec_from_file_location("model_under_check", target)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        else:
            importlib.import_module(target)
""")


def check_imports(blocked: tuple[str, ...], mode: str, targets: list[str]) -> None:
    run = subprocess.run([sys.executable, "-c", BLOCK_AND_IMPORT, ",".join(blocked), mode, *targets],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_every_package_but_the_stub_code_imports_without_nvidia_pytriton():
    modules = [name for name in project_modules()
               if not name.startswith(("triton_models", "model_repository"))]
    check_imports(("pytriton", "tritonserver", "triton_python_backend_utils"), "none", modules)


def test_stub_code_imports_with_a_stand_in_for_the_python_backend():
    modules = project_modules()
    targets = [name for name in modules if name.startswith("triton_models")]
    targets += [str(path) for name, path in modules.items() if name.startswith("model_repository")]
    check_imports(("pytriton", "tritonserver"), "stand-in", targets)


def test_pyproject_lists_every_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(init) for package in PACKAGES for init in (ROOT / package).rglob("__init__.py")}
    assert found == listed
