"""The tree's layering, read from the source (no import runs): the core imports no framework at module level,
the two front ends never import each other, and no project module imports, directly or through others, a
module that imports it back (function-level imports included)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("xkern", "torch_api", "jax_api", "benchmarks", "tools")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(path: Path, mods: dict, top_level_only: bool = False) -> set[str]:
    """The project modules `path` imports (`from pkg import sub` names the submodule where there is one)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                      for a in node.names}
    found = set()
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def _third_party(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    tops = set()
    for node in tree.body:  # module level only: a function may import a framework it is handed
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            tops.add(node.module.split(".")[0])
    return tops


def test_no_import_cycle():
    mods = _modules()
    # Import-time cycles: module-level imports (an import inside a function runs once both modules are loaded,
    # as RMSNorm.forward's of the fused add, whose module imports rms_norm).
    deps = {m: _imports(p, mods, top_level_only=True) - {m} for m, p in mods.items()}
    assert deps["jax_api.rms_norm"] >= {"jax_api.sharding"}, deps["jax_api.rms_norm"]  # the walk sees imports

    def reach(start):
        seen, todo = set(), list(deps[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(deps.get(m, ()))
        return seen

    assert not {m: sorted(deps[m]) for m in deps if m in reach(m)}


def test_core_imports_no_framework_and_front_ends_stay_apart():
    mods = _modules()
    core = {m: _third_party(p) & {"torch", "jax", "jaxlib", "jax_triton", "flax"} for m, p in mods.items()
            if m.startswith("xkern")}
    assert not {m: t for m, t in core.items() if t}, core
    for a, b in (("torch_api", "jax_api"), ("jax_api", "torch_api")):
        crossing = {m: sorted(d for d in _imports(p, mods) if d.split(".")[0] == b)
                    for m, p in mods.items() if m.split(".")[0] == a}
        assert not {m: d for m, d in crossing.items() if d}, crossing
    assert not {m for m, p in mods.items() if m.startswith("xkern")
                and any(d.split(".")[0] in ("torch_api", "jax_api", "benchmarks", "tools") for d in _imports(p, mods))}


def test_no_module_over_900_lines():
    """The product's modules stay readable at a sitting: none in xkern/, torch_api/ or jax_api/ over 900 lines."""
    long = {str(p.relative_to(ROOT)): n for pkg in ("xkern", "torch_api", "jax_api") for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 900}
    assert not long, long


def test_every_op_package_has_the_same_modules():
    """Each op's core is a package of the same modules, so that adding an op touches the same places: the
    recipes (argument rules and launch recipes) and the variants (for compile_check), with plans beside any
    kernels of its own; and compile_check compiles it."""
    from xkern.compile_check import OPS

    packages = [p.parent for p in (ROOT / "xkern").glob("*/__init__.py")]
    assert {"rms_norm", "permute", "grouped_mm"} <= {p.name for p in packages}
    for pkg in packages:
        names = {p.stem for p in pkg.glob("*.py")}
        assert {"recipes", "variants"} <= names and ("kernels" not in names or "plans" in names), (pkg.name, names)
        assert f"xkern.{pkg.name}" in OPS, pkg.name
