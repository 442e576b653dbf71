"""No import circle in the package, counting the imports inside functions and under
``TYPE_CHECKING`` too: a circle is removed by moving the shared piece down a layer, not defused by
importing inside a function (the house rules). Imports of optional packages inside functions
(triton, verl, ray, cudnn, quack, ...) are no edges here: only the package's own modules are."""

import ast

from vexact_models.switches import package_modules


def _imported(module: str, is_package: bool, node: ast.AST, modules: set[str]) -> set[str]:
    """The package modules `node` (an import in `module`) imports, parent packages of `module`
    aside (they are imported before it anyway)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module.split(".")[: None if is_package else -1]
        base = base[: len(base) - node.level + 1] if node.level else []
        target = ".".join(base + ([node.module] if node.module else []))
        names = [target] + [f"{target}.{alias.name}" for alias in node.names]
    return {n for n in names if n in modules and n != module and not module.startswith(n + ".")}


def _graph() -> dict[str, set[str]]:
    found = package_modules()
    modules = {name for name, _ in found}
    return {name: {t for node in ast.walk(ast.parse(path.read_text(), str(path)))
                   if isinstance(node, (ast.Import, ast.ImportFrom))
                   for t in _imported(name, path.name == "__init__.py", node, modules)}
            for name, path in found}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle_through_a_function_body_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [{"a", "b", "c"}]
    src = "def f():\n    from .moe import fused_moe\n"
    node = ast.parse(src).body[0].body[0]
    assert _imported("vexact_models.kernels.moe_backward", False, node,
                     {"vexact_models.kernels.moe", "vexact_models.kernels"}) == {"vexact_models.kernels.moe"}


def test_the_package_has_no_import_circle():
    graph = _graph()
    assert {"vexact_models.kernels.moe", "vexact_models.integrations.verl"} <= set(graph)
    assert "vexact_models.kernels.moe_grouped_gemm" in graph["vexact_models.kernels.moe_backward"]
    cycles = [sorted(c) for c in _cycles(graph)]
    assert not cycles, f"import circles (move the shared piece down a layer): {cycles}"
