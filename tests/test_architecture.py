"""The package's shape: imports point one way, format -> kernels -> precision -> model ->
train -> rollout -> rl -> serve/cli, with no cycle; the SGLang plugin stands alone; no
environment variable picks a code path. Read from the source with ``ast`` (nothing imported)."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("quads_jax", "pallas_kernels", "rollout")

# the layer of each module, by longest matching prefix; a module may import its own layer or lower
LAYERS = [
    ("quads_jax.nvfp4", 0), ("quads_jax.fp8", 0), ("quads_jax.config_util", 0), ("quads_jax.sharding", 0),
    ("quads_jax.distributed", 0), ("quads_jax.metrics", 0),
    ("pallas_kernels", 1),
    ("quads_jax.precision", 2),
    ("quads_jax.model", 3), ("quads_jax.hf", 3),
    ("quads_jax.train", 4),
    ("rollout", 5),
    ("quads_jax.rl", 6),
    ("rollout.server", 7), ("quads_jax.cli", 7), ("quads_jax.plot", 7),
    ("quads_jax", 0),  # the package's own __init__ (empty)
]
NAMES = {0: "format", 1: "kernels", 2: "precision", 3: "model", 4: "train", 5: "rollout", 6: "rl", 7: "serve/cli"}


def modules():
    out = {}
    for pkg in PACKAGES:
        for dp, _, fs in os.walk(os.path.join(ROOT, pkg)):
            for f in fs:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dp, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel[:-9] if rel.endswith(".__init__") else rel] = os.path.join(dp, f)
    return out


def imports_of(name, path, mods):
    """Project modules ``name`` imports (anywhere in the file: lazy imports count too)."""
    tree = ast.parse(open(path).read())
    is_pkg = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
            found.update(subs if subs else [base])
    return {m for m in found if m in mods and m != name}


def layer(name):
    return max(((p, l) for p, l in LAYERS if name == p or name.startswith(p + ".")), key=lambda pl: len(pl[0]))[1]


def test_imports_point_down_the_layers():
    mods = modules()
    bad = []
    for name, path in mods.items():
        if name.startswith("rollout.sglang_plugin"):
            continue
        for dep in imports_of(name, path, mods):
            if dep.startswith("rollout.sglang_plugin"):
                bad.append(f"{name} imports the SGLang plugin {dep}")
            elif layer(dep) > layer(name):
                bad.append(f"{name} ({NAMES[layer(name)]}) imports {dep} ({NAMES[layer(dep)]})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycle():
    mods = modules()
    graph = {n: imports_of(n, p, mods) - {n.rsplit(".", 1)[0]} for n, p in mods.items()}  # a submodule's parent package is not a cycle
    state, cycles = {}, []

    def visit(n, stack):
        state[n] = 1
        for d in graph[n]:
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, "\n".join(cycles)


def test_sglang_plugin_stands_alone():
    """The plugin runs where JAX and the rest of the project are not installed: no module of
    it imports them, except ``jax_launch`` (JAX launching the plugin's Triton kernel)."""
    mods = modules()
    for name, path in mods.items():
        if not name.startswith("rollout.sglang_plugin") or name.endswith("jax_launch"):
            continue
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for m in names:
                top = m.split(".")[0]
                assert top not in ("jax", "jaxlib", "flax", "quads_jax", "pallas_kernels"), f"{name} imports {m}"


def test_no_environment_variable_picks_a_code_path():
    """Environment reads are operational only: multi-host start-up, Triton's own interpreter
    switch and cache directory. Everything that picks an implementation is a config value."""
    allowed = {"quads_jax/distributed.py", "rollout/sglang_plugin/triton_gemm.py", "rollout/sglang_plugin/jax_launch.py"}
    offenders = []
    for name, path in modules().items():
        rel = os.path.relpath(path, ROOT)
        src = open(path).read()
        if re.search(r"os\.environ|os\.getenv", src) and rel not in allowed:
            offenders.append(rel)
    assert not offenders, offenders


def test_exported_names_do_not_shadow_modules():
    mods = modules()
    init = ast.parse(open(os.path.join(ROOT, "pallas_kernels", "__init__.py")).read())
    exported = next(ast.literal_eval(n.value) for n in init.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__")
    assert not [n for n in exported if f"pallas_kernels.{n}" in mods]
