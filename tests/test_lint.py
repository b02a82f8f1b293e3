"""The package reads cleanly: no undefined names or unused imports (pyflakes), and no circle of modules importing
each other (an import graph built from the source with ``ast``): a bad merge fails here, not at a user's."""
import ast
import os
from typing import Dict, List, Set

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO_ROOT, "keras_scale")


def test_package_has_no_undefined_names_or_unused_imports():
    pyflakes_api = pytest.importorskip("pyflakes.api")
    from pyflakes import reporter as pyflakes_reporter

    class Collect(pyflakes_reporter.Reporter):
        def __init__(self):
            self.messages = []

        def unexpectedError(self, filename, message):
            self.messages.append(f"{filename}: {message}")

        def syntaxError(self, filename, message, lineno, offset, text):
            self.messages.append(f"{filename}:{lineno}: {message}")

        def flake(self, message):
            self.messages.append(str(message))

    collect = Collect()
    pyflakes_api.checkRecursive([PACKAGE], collect)
    assert collect.messages == []


# ---- the import graph ------------------------------------------------------------------------------------------

def _modules(root: str = REPO_ROOT) -> Dict[str, str]:
    """``{"keras_scale.doctor.facts": path, "keras_scale.doctor": path of its __init__.py, ...}``."""
    out = {}
    for d, dirs, files in os.walk(os.path.join(root, "keras_scale")):
        dirs[:] = sorted(x for x in dirs if x.isidentifier())
        for f in files:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(d, f), root)[:-3].split(os.sep)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(d, f)
    return out


def import_graph(root: str = REPO_ROOT) -> Dict[str, Set[str]]:
    """Module -> the keras_scale modules it imports: every ``import``/``from ... import`` anywhere in it (inside
    functions and ``if TYPE_CHECKING:`` too), relative or absolute; ``from keras_scale.x import y`` counts as
    importing ``keras_scale.x.y`` when that is a module, else ``keras_scale.x``. (Importing ``a.b`` also runs
    ``a/__init__.py``; that implicit edge is not counted, or every package importing its own parts would be a circle.)
    """
    mods = _modules(root)

    def nearest(name):  # `import keras_scale.x.Name` is not a thing, but `from a.b import c` may name a package
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(nearest(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # from . import x / from ..y import z
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.add(sub if sub in mods else nearest(base))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def circles(graph: Dict[str, Set[str]]) -> List[Set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each a set of names."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    out = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(component: Set[str], graph: Dict[str, Set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in sorted(component) for b in sorted(graph[a] & component)]
    return "{" + ", ".join(sorted(component)) + "}: " + "; ".join(edges)


# No circle is allowed: a new one fails the test (it names the modules and edges).
ALLOWED_CIRCLES: Dict[str, frozenset] = {}


def test_import_graph_sees_imports_inside_functions_relative_and_from_package(tmp_path):
    pkg = tmp_path / "keras_scale"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from keras_scale import b  # late\n")
    (pkg / "b.py").write_text("from .sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("from keras_scale.sub.c import X\n")
    (pkg / "sub" / "c.py").write_text("import keras_scale.a\nfrom ..b import nothing\nX = 1\n")
    (pkg / "sub" / "d.py").write_text("from . import c\nimport os\n")
    graph = import_graph(str(tmp_path))
    assert graph == {"keras_scale": set(), "keras_scale.a": {"keras_scale.b"}, "keras_scale.b": {"keras_scale.sub.c"},
                     "keras_scale.sub": {"keras_scale.sub.c"}, "keras_scale.sub.c": {"keras_scale.a", "keras_scale.b"},
                     "keras_scale.sub.d": {"keras_scale.sub.c"}}
    assert circles(graph) == [{"keras_scale.a", "keras_scale.b", "keras_scale.sub.c"}]


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_no_new_circle_of_imports(graph):
    found = circles(graph)
    new = [c for c in found if not any(c <= allowed for allowed in ALLOWED_CIRCLES.values())]
    assert not new, "modules that import each other (move the shared part to a module both import):\n" + "\n".join(
        _describe(c, graph) for c in new)
    gone = [name for name, allowed in ALLOWED_CIRCLES.items() if not any(c & allowed for c in found)]
    assert not gone, f"circles broken, well done: remove {gone} from ALLOWED_CIRCLES in tests/test_lint.py"


# the composed step is a package: each of its parts (keras_scale/step/*.py) is checked on its own too
STEP_PARTS = tuple(sorted(f"step.{name[:-3]}" for name in os.listdir(os.path.join(PACKAGE, "step"))
                          if name.endswith(".py") and name != "__init__.py"))
STEP_AND_WRAP = ("step", "accumulation", "auto_accum", "deferred_update", "state", "lifecycle", "epoch_logs") \
    + STEP_PARTS


@pytest.mark.parametrize("module", STEP_AND_WRAP)
def test_the_step_and_wrap_import_no_callback(graph, module):
    """The composed step and ``wrap`` are used without any callback (a callback may use them, not the reverse):
    neither they nor anything they import, directly or through other modules, imports ``keras_scale.callbacks``."""
    seen, todo, path = set(), [f"keras_scale.{module}"], {f"keras_scale.{module}": [f"keras_scale.{module}"]}
    while todo:
        m = todo.pop()
        for t in sorted(graph[m] - seen):
            seen.add(t)
            path[t] = path[m] + [t]
            todo.append(t)
    callbacks = sorted(m for m in seen if m.startswith("keras_scale.callbacks"))
    assert not callbacks, "\n".join(" -> ".join(path[m]) for m in callbacks)


STEP_SHARED = {"keras_scale.step.numerics", "keras_scale.step.model_checks", "keras_scale.step.optimizer_switches"}


def test_the_step_parts_meet_on_the_step_not_through_imports(graph):
    """Each part of the composed step (``keras_scale/step/*.py``) reads alone: it imports no other part nor
    ``composed`` (the parts meet on ``self``), only what they share; ``composed`` alone assembles them."""
    modules = {f"keras_scale.{m}" for m in STEP_PARTS}
    assert STEP_SHARED <= modules and "keras_scale.step.train_step" in modules
    problems = [f"{m} -> {t}" for m in sorted(modules - {"keras_scale.step.composed"})
                for t in sorted(graph[m] & (modules - STEP_SHARED))]
    assert not problems, "a part imports another part (call it through self instead):\n" + "\n".join(problems)
