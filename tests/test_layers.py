"""The direction of imports (DESIGN.md section 1): a test fails on an arrow that points the wrong way."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# module prefix -> prefixes it must never import
# the four that touch both worlds
RUNNER = ("jaxserve.runner", "jaxserve.sampler_controls", "jaxserve.draft_runner",
          "jaxserve.inflight")
FORBIDDEN = {
    "jaxserve.core": ("jax", "flax", "optax", "jaxserve.model", *RUNNER, "jaxserve.engine",
                      "jaxserve.llm", "jaxserve.server", "jaxserve.backends", "pallas_kernels",
                      "cpu_kernels"),
    # the model names no platform: the backend it is handed does the kernels
    "jaxserve.model": ("jaxserve.core", *RUNNER, "jaxserve.engine", "jaxserve.llm",
                       "jaxserve.async_engine", "jaxserve.server", "jaxserve.tokenizer",
                       "jaxserve.backends", "pallas_kernels", "cpu_kernels"),
    "jaxserve.backends": ("jaxserve.core", *RUNNER, "jaxserve.engine", "jaxserve.llm",
                          "jaxserve.async_engine", "jaxserve.server"),
    "jaxserve.checks": ("jaxserve.",),
    "jaxserve.config": ("jaxserve.",),
    "jaxserve.model_config": ("jaxserve.",),
    "jaxserve.family_config": ("jaxserve.",),
    "jaxserve.quant_config": ("jaxserve.",),
    "jaxserve.decode_rows": ("jaxserve.",),
    "jaxserve.request": ("jaxserve.",),
    "jaxserve.sim": (*RUNNER, "jaxserve.model", "jax"),
    # the engine loop, shared with the simulator and the tests' fake: host only
    "jaxserve.engine_core": ("jax", "flax", "jaxserve.model", *RUNNER, "jaxserve.server",
                             "pallas_kernels"),
    "jaxserve.server": (*RUNNER, "jaxserve.model"),
    # the runner's persistent host arrays: numpy only
    "jaxserve.input_batch": ("jax", "flax", "jaxserve.model", *RUNNER),
    # the host half of the sampler controls (the masks, the grammars): numpy only
    "jaxserve.token_masks": ("jax", "flax", "jaxserve.model", *RUNNER),
    "jaxserve.structured_output": ("jax", "flax", "jaxserve.model", *RUNNER),
    # the proposers the scheduler asks: host only
    "jaxserve.spec": ("jax", "flax", "jaxserve.model", *RUNNER),
    "pallas_kernels": ("jaxserve", "cpu_kernels"),
    "cpu_kernels": ("jaxserve",),
}
# leaves the modules above may import all the same
ALLOWED = ("jaxserve.checks", "jaxserve.model_config", "jaxserve.family_config",
           "jaxserve.quant_config", "jaxserve.decode_rows")


def _modules():
    for base in ("jaxserve", "pallas_kernels", "cpu_kernels"):
        for path in sorted((ROOT / base).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            yield ".".join(p for p in rel.parts if p != "__init__"), path


def _imports(path: Path, module_level: bool = False):
    """The modules a file imports (module_level: only its top-level statements')."""
    tree = ast.parse(path.read_text())
    for node in tree.body if module_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.mark.parametrize(("module", "path"), list(_modules()), ids=lambda x: str(x))
def test_imports_point_the_right_way(module, path):
    for prefix, forbidden in FORBIDDEN.items():
        if module == prefix or module.startswith(prefix + "."):
            bad = [name for name in _imports(path) if name not in ALLOWED
                   and any(name == f.rstrip(".") or name.startswith(f if f.endswith(".") else f + ".")
                          for f in forbidden)]
            assert not bad, f"{module} imports {bad}, against DESIGN.md section 1"


@pytest.mark.parametrize("path", sorted((ROOT / "jaxserve" / "model").glob("*.py")),
                         ids=lambda p: p.name)
def test_the_model_names_no_platform_or_kernel_option(path):
    """The model reads as the model: kernels and platforms are the backend's (issue 29)."""
    text = path.read_text()
    for word in ("matmul_impl", "attention_impl", '"cpu"', '"gpu"', '"tpu"', "jax.default_backend"):
        assert word not in text, f"{path.name} names {word}"


@pytest.mark.parametrize(("module", "path"), list(_modules()), ids=lambda x: str(x))
def test_the_grammar_library_loads_only_where_a_grammar_is_used(module, path):
    """llguidance is structured_output's alone, and structured_output is imported inside the
    functions that compile or fill a grammar: an engine serving no structured output starts
    without the grammar library (an accelerator image may lack it)."""
    if module != "jaxserve.structured_output":
        names = list(_imports(path, module_level=True))
        assert "jaxserve.structured_output" not in names and "llguidance" not in names, module
