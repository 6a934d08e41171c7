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
