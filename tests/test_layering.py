"""Package structure: each dsv4 module imports only its own layer or earlier ones, and holds no mutable globals.

Layers, in order: formats < config < kernels < parallel < model < checkpoint < runtime < surface, where surface is
dsv4/__init__.py, dsv4/__main__.py, dsv4/cli.py, dsv4/api.py, dsv4/server/ and dsv4/vllm_plugin/. Every
import counts: absolute or relative, at module level or inside a function or `if TYPE_CHECKING:`, and
`importlib.import_module("dsv4....")`.

`parallel` (the layout of several ranks and their collectives) sits between kernels and model: the model imports it to
build one rank's part and to sum partial outputs, and it knows nothing of the model, checkpoints or the runtime.
"""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "dsv4"
LAYERS = ("formats", "config", "kernels", "parallel", "model", "checkpoint", "runtime", "surface")
SURFACE = ("__init__", "__main__", "cli", "api", "server", "vllm_plugin")
MODULES = sorted(PKG.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """'dsv4.kernels.ref' -> 'kernels'; the package root and surface modules -> 'surface'."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in SURFACE:
        return "surface"
    return parts[1] if parts[1] in LAYERS else f"<no layer: dsv4.{parts[1]}>"


def _exists(module: str, root: Path) -> bool:
    path = root.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def imported_modules(tree: ast.AST, module: str, is_package: bool, root: Path = PKG) -> list[tuple[int, str]]:
    """(line, absolute dsv4 module) for every import of dsv4 code in `tree`."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for alias in node.names:  # `from dsv4 import formats` imports the subpackage, not dsv4/__init__
                sub = f"{mod}.{alias.name}"
                found.append((node.lineno, sub if _exists(sub, root) else mod))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")):
            found.append((node.lineno, node.args[0].value))
    return [(line, m) for line, m in found if m == "dsv4" or m.startswith("dsv4.")]


def layer_violations(source: str, module: str, is_package: bool = False, root: Path = PKG) -> list[str]:
    own = layer_of(module)
    if own not in LAYERS:
        return [f"{module} belongs to no layer ({own})"]
    bad = []
    for line, target in imported_modules(ast.parse(source), module, is_package, root):
        theirs = layer_of(target)
        if theirs not in LAYERS or LAYERS.index(theirs) > LAYERS.index(own):
            bad.append(f"line {line}: {module} ({own}) imports {target} ({theirs})")
    return bad


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG.parent)))
def test_imports_respect_layers(path):
    assert layer_violations(path.read_text(), module_name(path), path.name == "__init__.py") == []


@pytest.mark.parametrize("source,module,is_package,bad", [
    ("from ..kernels import ref", "dsv4.formats.nvfp4", False, True),
    ("from ..formats import QWeight", "dsv4.kernels.ref", False, False),
    ("from . import ref", "dsv4.kernels", True, False),
    ("def f():\n    from . import kernels", "dsv4.config", False, True),
    ("from .formats import QWeight", "dsv4.config", False, False),
    ("import dsv4.runtime.engine", "dsv4.model.block", False, True),
    ("from dsv4 import api", "dsv4.checkpoint.loader", False, True),
    ("from dsv4 import formats", "dsv4.checkpoint.loader", False, False),
    ("from dsv4 import QWeight", "dsv4.kernels.ref", False, True),   # a name re-exported by dsv4/__init__
    ("import importlib\nimportlib.import_module('dsv4.cli')", "dsv4.runtime.engine", False, True),
    ("if TYPE_CHECKING:\n    from ..model import Model", "dsv4.kernels.ref", False, True),
    ("from ..checkpoint import load", "dsv4.server.app", False, False),
    ("from ..parallel import Layout", "dsv4.model.moe", False, False),
    ("from ..model import QLinear", "dsv4.parallel.comm", False, True),
    ("from ..kernels import Ops", "dsv4.parallel.layout", False, False),
    ("import torch", "dsv4.utils", False, True),                      # a module outside every layer
])
def test_layer_checker_catches_what_it_should(source, module, is_package, bad):
    assert bool(layer_violations(source, module, is_package)) == bad


# ---- no mutable module globals -------------------------------------------------------------------------

MUTABLE_BUILTINS = frozenset({"list", "dict", "set", "bytearray"})
MUTABLE_CLASSES = frozenset({"defaultdict", "OrderedDict", "deque", "Counter", "ChainMap", "WeakValueDictionary",
                             "WeakKeyDictionary", "WeakSet"})
TENSOR_FACTORIES = frozenset({"tensor", "as_tensor", "from_numpy", "zeros", "ones", "empty", "full", "arange",
                              "linspace", "logspace", "eye", "rand", "randn", "randint", "zeros_like", "ones_like",
                              "empty_like", "full_like", "array", "asarray"})
FREEZERS = frozenset({"frozenset", "tuple", "MappingProxyType", "types.MappingProxyType"})
MUTATORS = frozenset({"append", "extend", "insert", "update", "setdefault", "add", "pop", "popitem", "clear",
                      "remove", "discard", "__setitem__"})


def is_mutable(node: ast.expr, frozen: bool = False) -> bool:
    """Does this expression build a mutable object? `frozen`: it is the direct argument of a freezer,
    so only its elements matter (MappingProxyType({...}) is fine, MappingProxyType({"a": []}) is not)."""
    if isinstance(node, (ast.List, ast.Set, ast.Dict, ast.ListComp, ast.SetComp, ast.DictComp)):
        if not frozen:
            return True
        if isinstance(node, ast.Dict):
            return any(is_mutable(v) for v in [*node.keys, *node.values] if v is not None)
        if isinstance(node, (ast.ListComp, ast.SetComp)):
            return is_mutable(node.elt)
        if isinstance(node, ast.DictComp):
            return is_mutable(node.key) or is_mutable(node.value)
        return any(is_mutable(e) for e in node.elts)
    if isinstance(node, ast.Tuple):
        return any(is_mutable(e) for e in node.elts)
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        last = name.rpartition(".")[2]
        if name in FREEZERS:
            return any(is_mutable(a, frozen=True) for a in node.args)
        if name in MUTABLE_BUILTINS or last in MUTABLE_CLASSES:
            return True
        return name.partition(".")[0] in ("torch", "np", "numpy") and last in TENSOR_FACTORIES
    return False


def _targets(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    return [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []


def _is_exempt(node: ast.stmt) -> bool:
    if isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation).rpartition(".")[2] == "TypeAlias":
        return True
    names = [t.id for t in _targets(node) if isinstance(t, ast.Name)]
    return names == ["__all__"]


def _global_statements(body: list[ast.stmt], where: str):
    """Statements executed at import time of a module or class body (not function bodies)."""
    for node in body:
        yield where, node
        if isinstance(node, ast.ClassDef):
            yield from _global_statements(node.body, f"class {node.name}")
        elif isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.TryStar)):
            nested = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            nested += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
            yield from _global_statements(nested, where)


def mutable_globals(source: str) -> list[str]:
    tree = ast.parse(source)
    found = []
    for where, node in _global_statements(tree.body, "module"):
        value = getattr(node, "value", None)
        if _targets(node) and not _is_exempt(node):
            if value is not None and is_mutable(value):
                names = ", ".join(ast.unparse(t) for t in _targets(node))
                found.append(f"line {node.lineno}: {where} binds {names} to a mutable {type(value).__name__}")
            if isinstance(node, ast.AugAssign) or any(isinstance(t, (ast.Subscript, ast.Attribute))
                                                      for t in _targets(node)):
                found.append(f"line {node.lineno}: {where} mutates {ast.unparse(_targets(node)[0])} at import time")
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute) and node.value.func.attr in MUTATORS):
            found.append(f"line {node.lineno}: {where} mutates {ast.unparse(node.value.func.value)} at import time")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            found.append(f"line {node.lineno}: `{type(node).__name__.lower()} {', '.join(node.names)}` rebinds "
                         "outer state")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG.parent)))
def test_no_mutable_module_globals(path):
    found = mutable_globals(path.read_text())
    assert found == [], ("constant tables must be immutable: wrap dicts in types.MappingProxyType, sets in "
                         "frozenset, lists in tuple; keep state in objects that are handed around")


@pytest.mark.parametrize("source,bad", [
    ("_CACHE = {}", True),
    ("X: dict[str, int] = {}", True),
    ("SEEN = set()", True),
    ("import collections\nD = collections.defaultdict(list)", True),
    ("import torch\nLUT = torch.tensor([0.0, 0.5])", True),
    ("A, B = [], []", True),
    ("PAIRS = ([1], [2])", True),
    ("from types import MappingProxyType\nM = MappingProxyType({'a': []})", True),
    ("class C:\n    registry = {}", True),
    ("X = (1, 2)\nX += (3,)", True),
    ("T = {}\nT['a'] = 1", True),
    ("L = ()\nsome.append(1)", True),
    ("def f():\n    global X\n    X = 1", True),
    ("try:\n    import x\nexcept ImportError:\n    FALLBACK = []", True),
    ("__all__ = ['a', 'b']", False),
    ("from typing import TypeAlias\nShape: TypeAlias = tuple[int, ...]", False),
    ("FORMATS = ('dense', 'fp8')", False),
    ("NAMES = frozenset({'a', 'b'})", False),
    ("from types import MappingProxyType\nM = MappingProxyType({'a': (1, 2), 'b': frozenset()})", False),
    ("def f():\n    cache = {}\n    return cache", False),
    ("@dataclass\nclass C:\n    xs: list = field(default_factory=list)", False),
    ("import re\nPATTERN = re.compile('a+')", False),
])
def test_mutable_global_checker_catches_what_it_should(source, bad):
    assert bool(mutable_globals(source)) == bad


# ---- sizes ------------------------------------------------------------------------------------------------

MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS = 700, 100, 24
# What is over a limit today, by "path" or "path:function": the list may only shrink (each entry must still be over).
OVER_LIMITS = frozenset()


def oversized(source: str, where: str) -> list[str]:
    """`where` (a module), and `where:function` for each function, that exceed a size limit."""
    found = [where] if len(source.splitlines()) > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + \
                (a.kwarg is not None)
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES or params > MAX_PARAMETERS:
                found.append(f"{where}:{node.name}")
    return found


def test_modules_functions_and_signatures_stay_small():
    found = {o for path in MODULES for o in oversized(path.read_text(), str(path.relative_to(PKG.parent)))}
    assert found <= OVER_LIMITS, (f"over {MAX_MODULE_LINES} lines per module, {MAX_FUNCTION_LINES} per function or "
                                  f"{MAX_PARAMETERS} parameters: {sorted(found - OVER_LIMITS)}")
    assert OVER_LIMITS <= found, f"no longer over a limit, so off the list: {sorted(OVER_LIMITS - found)}"


@pytest.mark.parametrize("source,bad", [
    ("def f(" + ", ".join(f"a{i}" for i in range(24)) + "):\n    pass", False),
    ("def f(" + ", ".join(f"a{i}" for i in range(24)) + ", *, b=1):\n    pass", True),
    ("def f():\n" + "    x = 1\n" * 99, False),
    ("def f():\n" + "    x = 1\n" * 100, True),
    ("x = 1\n" * 701, True),
])
def test_size_checker_catches_what_it_should(source, bad):
    assert bool(oversized(source, "m")) == bad
