"""The direction of imports (DESIGN.md section 1): the folders stand in layers, each importing
only the layers below it, and no module imports itself back through others. A test fails, by
name, on an arrow that points the wrong way or on a loop."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxserve", "pallas_kernels", "cpu_kernels")

# The layers, bottom first: a part may import the parts of the layers below its own, never a
# part beside it or above it. A part is a folder of jaxserve/ (or a module at its top, or one of
# the kernel packages beside it).
LAYERS = (
    ("pallas_kernels",),  # kernels and their pure-jnp twins: jax only
    ("cpu_kernels",),  # the CPU's C++ kernels through XLA's FFI
    ("config",),  # frozen, validated settings: the engine's, the model's
    ("request",),  # the shared nouns: SamplingParams, Request, RequestOutput, Samples
    ("text", "spec"),  # tokenizers and text; speculative decoding's proposers
    ("core", "structured"),  # the scheduler and KV pages; token masks and grammars
    ("model",),  # the device side: modules, sampler, jitted steps, loading
    ("backends",),  # the platform seam: kernels chosen once
    ("parallel",),  # meshes, shardings, several processes
    ("runner",),  # the only part that moves data between host and device
    ("demo",),  # the built-in model (and its training script)
    ("engine",),  # the engine loop, outputs, LLMEngine, AsyncEngine
    ("llm", "server", "sim"),  # the offline API, the HTTP server, the simulator
    ("benchmarks",),  # `jaxserve bench`: the public API and the simulator's metrics
    ("tools",),  # plan, calibrate, simulate, train_predictor: commands over everything
    ("cli", "__init__", "__main__"),  # entry points: the CLI, `jaxserve`'s own surface
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}

# Host-only modules and folders: Python and numpy, never jax (the simulator, the scheduler
# and the engine loop load and run without it).
NO_JAX = ("jax", "jaxlib", "flax", "optax")
HOST_ONLY = ("jaxserve.config", "jaxserve.request", "jaxserve.text", "jaxserve.spec",
             "jaxserve.core", "jaxserve.structured", "jaxserve.sim", "jaxserve.engine.loop",
             "jaxserve.engine.outputs", "jaxserve.runner.input_batch",
             "jaxserve.model.decode_rows")


def _modules():
    for base in PACKAGES:
        for path in sorted((ROOT / base).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            yield ".".join(p for p in rel.parts if p != "__init__"), path


MODULES = dict(_modules())


def _resolve(name: str) -> str | None:
    """The module of ours that an imported name loads (a package's submodule where it is
    one), or None for another library."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path, module_level: bool = False):
    """The names a file imports (module_level: only its top-level statements'), each the
    module it loads: `from pkg import sub` names pkg.sub where sub is a module."""
    tree = ast.parse(path.read_text())
    for node in tree.body if module_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names
                    if f"{node.module}.{a.name}" in MODULES]
            yield from subs if len(subs) == len(node.names) else [node.module, *subs]


def _part(module: str, path: Path) -> str:
    """The layer part of a module: its folder under jaxserve/, its own name at the top."""
    parts = module.split(".")
    if path.name == "__main__.py":
        return "__main__"
    if parts[0] != "jaxserve":
        return parts[0]
    return "__init__" if len(parts) == 1 else parts[1]


def _edges():
    for module, path in MODULES.items():
        for name in _imports(path):
            target = _resolve(name)
            if target is not None and target != module:
                yield module, target


def test_every_part_has_a_layer():
    parts = {_part(m, p) for m, p in MODULES.items()}
    assert parts <= set(RANK), f"parts with no layer in LAYERS: {sorted(parts - set(RANK))}"


@pytest.mark.parametrize(("module", "path"), list(MODULES.items()), ids=lambda x: str(x))
def test_imports_point_down_the_layers(module, path):
    here = _part(module, path)
    bad = []
    for name in _imports(path):
        target = _resolve(name)
        if target is None:
            continue
        there = _part(target, MODULES[target])
        if there != here and RANK[there] >= RANK[here]:
            bad.append(f"{target} ({there}, layer {RANK[there]})")
    assert not bad, (f"{module} ({here}, layer {RANK[here]}) imports {bad}: a part imports "
                     "only the layers below it (DESIGN.md section 1)")


@pytest.mark.parametrize(("module", "path"), [(m, p) for m, p in MODULES.items()
                                              if m.startswith(HOST_ONLY)], ids=lambda x: str(x))
def test_host_only_parts_never_import_jax(module, path):
    bad = [n for n in _imports(path) if n.split(".")[0] in NO_JAX]
    assert not bad, f"{module} is host only and imports {bad}"


@pytest.mark.parametrize(("module", "path"), [(m, p) for m, p in MODULES.items()
                                              if not m.startswith("jaxserve")],
                         ids=lambda x: str(x))
def test_the_kernel_packages_know_nothing_of_jaxserve(module, path):
    bad = [n for n in _imports(path) if n.split(".")[0] == "jaxserve"]
    assert not bad, f"{module} imports {bad}"


def _loops(edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        loops.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return loops


def test_no_import_loops():
    """Every import counts, those inside functions and under TYPE_CHECKING too: a loop hidden
    in a function is a loop in the design."""
    assert _loops(_edges()) == []


def test_a_loop_is_found():
    assert _loops([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]


@pytest.mark.parametrize("path", sorted((ROOT / "jaxserve" / "model").glob("*.py")),
                         ids=lambda p: p.name)
def test_the_model_names_no_platform_or_kernel_option(path):
    """The model reads as the model: kernels and platforms are the backend's (issue 29)."""
    text = path.read_text()
    for word in ("matmul_impl", "attention_impl", '"cpu"', '"gpu"', '"tpu"', "jax.default_backend"):
        assert word not in text, f"{path.name} names {word}"


@pytest.mark.parametrize(("module", "path"), list(MODULES.items()), ids=lambda x: str(x))
def test_the_grammar_library_loads_only_where_a_grammar_is_used(module, path):
    """llguidance is structured/grammar.py's alone, and that module is imported inside the
    functions that compile or fill a grammar: an engine serving no structured output starts
    without the grammar library (an accelerator image may lack it)."""
    if module != "jaxserve.structured.grammar":
        names = list(_imports(path, module_level=True))
        assert "jaxserve.structured.grammar" not in names and "llguidance" not in names, module


def test_every_folder_says_what_it_is_and_where_it_stands():
    """Each folder's __init__ docstring names what it is and what it may import."""
    for init in sorted((ROOT / "jaxserve").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Imports" in doc and "never" in doc.lower(), (
            f"{init.relative_to(ROOT)}: its docstring says what it may import ('Imports ...') "
            "and what must never import it")
