"""docs/architecture.md, "Dependencies point one way": its table of import edges between the
top-level packages is the set the code has, no more and no less, and the repository's own source
lines it cites exist.

An edge A -> B is any import in a .py file under A/ of a module of B/: `import`, `from ... import`
(at module level or inside a function), and `importlib.import_module` of a name written in the
file (a string, a module-level string constant, or the constant start of an f-string). The
registry of accel/__init__.py (BACKENDS, TEXT_MODELS: "module:callable" strings) counts as edges
from reference/, whose factory imports what it names. A module run as a process (`python -m X`,
pytest's `-p X`) is not imported and is not an edge. tests/ is a package here: its modules import
each other as top-level names (conftest, test_gguf).
"""
import ast
import os
import re

import pytest

from conftest import ROOT

PACKAGES = ("reference", "accel", "tools", "tests")
DOC = os.path.join(ROOT, "docs", "architecture.md")
SECTION = "## Dependencies point one way"
EDGE_ROW = re.compile(r"^\| `(\w+)` \| `(\w+)` \|")
REGISTRY = (os.path.join("accel", "__init__.py"), ("BACKENDS", "TEXT_MODELS"), "reference")
OWN_CITATION = re.compile(r"\b((?:reference|accel|tests)/[\w./]+\.py):(\d+)(?:-(\d+))?")


def python_files(package):  # -> [path relative to ROOT] of every .py under package/
    return sorted(os.path.relpath(os.path.join(folder, name), ROOT)
                  for folder, _, names in os.walk(os.path.join(ROOT, package)) for name in names if name.endswith(".py"))


TESTS_MODULES = {os.path.splitext(os.path.basename(p))[0] for p in python_files("tests")
                 if os.path.dirname(p) == "tests"}


def package_of(module):  # dotted module name -> the top-level package of this repository it lies in, or None
    top = module.split(".")[0]
    return "tests" if top in TESTS_MODULES else top if top in PACKAGES else None


def string_constants(tree):  # module -> {name: str} of its module-level NAME = "..." assignments
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def imported_name(arg, constants):  # the argument of import_module -> the module name it spells, or None
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.Name):
        return constants.get(arg.id)
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return arg.values[0].value  # f"reference.ggml_cpu.{name}": its package is in the constant start
    return None


def imported_modules(source):  # -> [dotted names] the source imports, by statement or by import_module
    tree = ast.parse(source)
    constants = string_constants(tree)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"):
            names.append(imported_name(node.args[0], constants))
    return [n for n in names if n]


def registry_modules(source, tables):  # accel/__init__.py -> [modules its "module:callable" tables name]
    modules = []
    for node in ast.parse(source).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id in tables for t in node.targets)):
            modules += [v.value.partition(":")[0] for v in node.value.values]
    return modules


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def code_edges():  # -> {(from, to): [files]} between distinct packages
    edges = {}
    for package in PACKAGES:
        for path in python_files(package):
            for module in imported_modules(read(path)):
                target = package_of(module)
                if target not in (None, package):
                    edges.setdefault((package, target), []).append(path)
    registry, tables, reader = REGISTRY
    for module in registry_modules(read(registry), tables):
        target = package_of(module)
        if target not in (None, reader):
            edges.setdefault((reader, target), []).append(f"{registry} ({module})")
    return edges


def documented_edges():  # -> {(from, to)} of the table under SECTION in docs/architecture.md
    text = read(DOC)
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))]
    return {m.groups() for m in map(EDGE_ROW.match, section.splitlines()) if m and m.group(1) != "from"}


def test_the_documented_import_edges_are_the_code_s():
    edges, documented = code_edges(), documented_edges()
    assert documented, f"no edge table under {SECTION!r} in docs/architecture.md"
    undocumented = {e: sorted(edges[e])[:3] for e in set(edges) - documented}
    assert not undocumented, f"imports docs/architecture.md does not list (an example file each): {undocumented}"
    assert documented <= set(edges), f"listed in docs/architecture.md, imported nowhere: {documented - set(edges)}"


def test_the_edge_collector_sees_every_spelling():
    source = ("import tools.golden\n"
              "from accel.numba import NumbaBackend\n"
              "from . import ops\n"
              "PACKAGE = 'reference'\n"
              "def f(name):\n"
              "    import conftest\n"
              "    importlib.import_module(PACKAGE)\n"
              "    import_module(f'accel.cupy.{name}')\n"
              "    importlib.import_module(name)\n")
    assert [package_of(m) for m in imported_modules(source)] == ["tools", "accel", "tests", "reference", "accel"]
    registry = "BACKENDS = {('x', 'exact'): 'tools.fast:Backend'}\nOTHER = {'a': 'reference.ops:b'}\n"
    assert registry_modules(registry, ("BACKENDS",)) == ["tools.fast"]


def test_the_repository_lines_the_document_cites_exist():
    for path, first, last in OWN_CITATION.findall(read(DOC)):
        assert os.path.isfile(os.path.join(ROOT, path)), f"docs/architecture.md cites {path}, which is not there"
        n_lines = len(read(path).splitlines())
        assert 1 <= int(first) <= int(last or first) <= n_lines, f"{path}:{first}-{last} past its {n_lines} lines"


def module_of(path):  # "accel/cupy/text.py" -> "accel.cupy.text"; tests/x.py -> "x" (tests' modules are top-level)
    parts = os.path.splitext(path)[0].split(os.sep)
    if parts[0] == "tests" and len(parts) == 2:
        return parts[1]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path, source, modules):  # -> {modules of `modules` the file imports}, relative imports resolved
    me = module_of(path)
    package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = ".".join(filter(None, (base if node.level else "", node.module or "")))
            # `from P import m` imports the module P.m when there is one, else a name of P
            found |= {f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names}
    return (found & modules) - {me}


def import_cycles(graph):  # {module: {modules}} -> [sorted modules of each cycle] (Tarjan's components > 1)
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    """Among the repository's modules, by every import a file holds (a function's own imports too:
    they are the same dependency, only deferred)."""
    paths = [p for package in PACKAGES for p in python_files(package)]
    modules = {module_of(p) for p in paths}
    cycles = import_cycles({module_of(p): module_imports(p, read(p), modules) for p in paths})
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_finder_finds_a_cycle_through_a_function_s_import():
    modules = {"reference", "reference.a", "reference.b", "reference.c"}
    files = {"reference/a.py": "from . import b\n", "reference/b.py": "def f():\n    from reference.a import g\n",
             "reference/c.py": "from .a import g\nimport reference.b\n"}
    graph = {module_of(path): module_imports(path, source, modules) for path, source in files.items()}
    assert graph == {"reference.a": {"reference.b"}, "reference.b": {"reference.a"},
                     "reference.c": {"reference.a", "reference.b"}}
    assert import_cycles(graph) == [["reference.a", "reference.b"]]


def positional_reads(source):  # -> [line] where a codegen reads its arguments by position: args[i], tys[i], signature.args[i]
    """numba gives a codegen (context, builder, signature, args): accel/numba/operands.py names them as
    the typing function's parameters, so a kernel's IR reads `a.raw.at([o])`, not args[0]."""
    lines = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef) and [a.arg for a in fn.args.args][-2:] == ["signature", "args"]:
            for node in ast.walk(fn):
                value = node.value if isinstance(node, ast.Subscript) else None
                if (isinstance(value, ast.Name) and value.id in ("args", "tys")) or (
                        isinstance(value, ast.Attribute) and value.attr == "args"):
                    lines.append(node.lineno)
    return lines


def test_no_codegen_reads_its_arguments_by_position():
    found = {path: lines for path in python_files("accel") + python_files("reference") + python_files("tools")
             if (lines := positional_reads(open(os.path.join(ROOT, path)).read()))}
    assert not found, f"args[N] / tys[N] in codegens (use accel.numba.operands): {found}"


def test_the_positional_read_finder_finds_one():
    source = ("def k(typingctx, x):\n    def codegen(context, builder, signature, args):\n"
              "        tys = signature.args\n        return builder.bitcast(args[0], tys[0])\n")
    assert positional_reads(source) == [4, 4]
    assert positional_reads(source.replace("args[0], tys[0]", "x_, x_ty")) == []


# ---------------------------------------------------------------------------------------------
# Tensors are resolved at load (reference/gguf/tensors.py): a forward reads its record's handles
# (`layer.ffn_up`), and spells no tensor name, whole or in parts

FORWARDS = ("reference/text.py", "reference/dflash.py", "reference/vision.py", "reference/video.py",
            "accel/cupy/text.py")
TENSOR_NAME_PART = re.compile(r"\.(weight|bias)\b|(^|\.)blk\.|^v\.|^mm\.\d|^(token_embd|output|output_norm|fc)$")


def tensor_name_strings(source):  # -> the string constants (f-strings' constant parts too) that spell tensor names
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docstrings and TENSOR_NAME_PART.search(n.value)]


def test_tensor_name_strings_are_seen():
    source = 'def f(il, b):\n    "blk.0 in a docstring"\n    return f"blk.{il}.attn_{p}.weight", b + "v.pre_ln", "mm.2.weight", "ln1"\n'
    assert sorted(tensor_name_strings(source)) == [".weight", "blk.", "mm.2.weight", "v.pre_ln"]


@pytest.mark.parametrize("path", FORWARDS)
def test_forwards_build_no_tensor_name(path):
    assert tensor_name_strings(read(path)) == []
