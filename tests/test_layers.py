"The package's layering (README / nbs/index.ipynb, 'Where a new piece goes'): a module imports only from lower layers."
import ast, json, re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def declared_layers() -> dict:
    "{module: layer} from the table in nbs/index.ipynb."
    text = ''.join(''.join(c['source']) for c in json.loads((ROOT/'nbs'/'index.ipynb').read_text())['cells'])
    section = text[text.index('### Where a new piece goes'):]
    out = {}
    for line in section.splitlines():
        m = re.match(r'\|\s*(\d+)\s*\|([^|]*)\|', line)
        if m:
            for mod in re.findall(r'`(\w+)`', m.group(2)): out[mod] = int(m.group(1))
    return out

def memlab_imports(path:Path, in_package:bool=False) -> set:
    """The memlab modules `path` imports anywhere (module level and inside functions). A file of a package
    (`in_package`: memlab/<package>/x.py) reaches memlab's modules with `..`; its `.` imports are its own package's."""
    top = 2 if in_package else 1
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == top and node.module: found.add(node.module.split('.')[0])
            elif node.level == top: found.update(a.name for a in node.names)
            elif node.module and node.module.startswith('memlab.'): found.add(node.module.split('.')[1])
            elif node.module == 'memlab': found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split('.')[1] for a in node.names if a.name.startswith('memlab.'))
    return found

def module_files() -> dict:
    "{module: [(file, in_package)]}: memlab/x.py is module x; a package memlab/x/ (with __init__.py) is module x."
    out = {p.stem: [(p, False)] for p in sorted((ROOT/'memlab').glob('*.py')) if not p.stem.startswith('_')}
    for init in sorted((ROOT/'memlab').glob('*/__init__.py')):
        out[init.parent.name] = [(p, True) for p in sorted(init.parent.glob('*.py'))]
    return out

def test_every_module_has_a_layer():
    layers = declared_layers()
    modules = set(module_files())
    assert modules - set(layers) == set(), f"modules missing from the layer table: {sorted(modules - set(layers))}"
    assert set(layers) - modules == set(), f"the layer table names modules that do not exist: {sorted(set(layers) - modules)}"

def test_imports_go_down():
    layers = declared_layers()
    bad = [f"{mod} (layer {layers[mod]}) imports {m} (layer {layers[m]})"
           for mod, files in module_files().items() if mod in layers for p, pkg in files
           for m in sorted(memlab_imports(p, pkg)) if m in layers and m != mod and layers[m] >= layers[mod]]
    assert not bad, 'imports against the layering:\n' + '\n'.join(bad)

def test_the_check_sees_function_level_imports(tmp_path):
    f = tmp_path/'x.py'
    f.write_text("from .core import check\ndef g():\n    from memlab.relora import add_relora\n    import memlab.bitnet\n")
    assert memlab_imports(f) == {'core', 'relora', 'bitnet'}
    f.write_text("from ..core import check\nfrom .cache import KNNCache\nfrom . import config\n")
    assert memlab_imports(f, in_package=True) == {'core'}     # a package's own modules are not other modules

def test_no_private_name_crosses_modules():
    "A name a module keeps private (leading underscore) is not imported by another memlab module: what is shared is public."
    bad = []
    for p in sorted((ROOT/'memlab').rglob('*.py')):     # a package's modules too, each of them a module of its own here
        if p.stem.startswith('_') and p.name != '__init__.py': continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level >= 1 or (node.module or '').startswith('memlab')):
                name = p.relative_to(ROOT/'memlab').with_suffix('').as_posix()
                bad += [f"{name} imports {a.name} from {node.module}" for a in node.names if a.name.startswith('_')]
    assert not bad, '\n'.join(bad)
