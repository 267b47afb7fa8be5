"""The packages' layers, read from their import statements (no module is imported).

Top to bottom: the commands (hla_bench's own modules), the two wings (hla_bench.recall,
hla_bench.speed), the results both read and write (hla_bench.results), the modules both
wings share (hla_bench.options, registry, configs, safe_files, processes, gpu_use,
dask_executor), then mixers and tasks. A module imports only its own layer or lower ones,
and a wing never imports the other wing.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ("hla_bench", "hla_bench.__version__", "hla_bench.options", "hla_bench.registry",
          "hla_bench.configs", "hla_bench.safe_files", "hla_bench.processes",
          "hla_bench.gpu_use", "hla_bench.dask_executor")


def layer(module: str) -> tuple[int, str]:
    """(height, name) of the layer `module` belongs to."""
    parts = module.split(".")
    if parts[0] in ("mixers", "tasks"):
        return 0, parts[0]
    if module in SHARED or ".".join(parts[:2]) in SHARED[2:]:
        return 1, "shared"
    if parts[1] == "results":
        return 2, "results"
    if parts[1] in ("recall", "speed"):
        return 3, parts[1]
    return 4, "commands"


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a project module in `path`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.append((node.lineno, target))
            if target == "hla_bench":  # `from hla_bench import registry` names a module
                found += [(node.lineno, f"hla_bench.{alias.name}") for alias in node.names]
    return [(line, target) for line, target in found
            if target.split(".")[0] in ("hla_bench", "mixers", "tasks")]


def test_no_module_imports_a_higher_layer_or_the_other_wing():
    wrong = []
    for package in ("hla_bench", "mixers", "tasks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            height, name = layer(module)
            for line, target in imports(path, module):
                up, other = layer(target)
                if up > height or (up == height == 3 and other != name):
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {module} ({name}) imports "
                                 f"{target} ({other})")
    assert not wrong, "\n".join(wrong)
