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

# A string that is a module's dotted name (with a function after a colon): an import in disguise, which `importlib`, a
# registry or `run_isolated` makes when it runs. Prose that mentions a module (an error message) has more in the string.
MODULE_STRING = re.compile(r'memlab\.(\w+)(?:\.\w+)*(?::\w+)?\Z')

def memlab_imports(path:Path, in_package:bool=False) -> set:
    """The memlab modules `path` imports anywhere (module level and inside functions), and those a string literal names
    as a module (`'memlab.x'`, `'memlab.x:fn'`: `importlib.import_module`, a table of modules, a subprocess's target).
    A file of a package (`in_package`: memlab/<package>/x.py) reaches memlab's modules with `..`; its `.` imports are
    its own package's."""
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
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := MODULE_STRING.match(node.value)):
            found.add(m.group(1))       # 'memlab.x', 'memlab.x.y:fn': a registry entry, importlib or run_isolated target
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

def test_the_check_sees_module_names_in_strings(tmp_path):
    "A module named by a string is imported when the string is used: `importlib`, a registry's table, `run_isolated`."
    f = tmp_path/'x.py'
    f.write_text("import importlib\nTABLE = {'relora': 'memlab.relora'}\n"
                 "def g(): return importlib.import_module('memlab.bitnet'), run_isolated('memlab.benchmarks.bpt:step', 1)\n")
    assert memlab_imports(f) == {'relora', 'bitnet', 'benchmarks'}
    f.write_text("def g(): raise ValueError('call memlab.relora.remove_relora(model) first')\nCSS = 'memlab'\n")
    assert memlab_imports(f) == set()                           # prose naming a function, not a module: no import

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

# Known failures (issue #33, "Headers that tell the truth"): modules whose header names a notebook that holds only their
# imports. None left: every method package keeps one notebook per module.
HEADER_NOT_HOLDING_CODE = set()

def notebook_cells(path:Path, root:Path=ROOT) -> tuple:
    """(the notebook a generated module's header names, {notebook: number of its exported cells here that hold code, not
    only imports}), notebooks as paths relative to the repository; (None, {}) for a file nbdev did not write."""
    text = path.read_text()
    m = re.search(r'File to edit: (\S+\.ipynb)\.', text)
    if m is None: return None, {}
    rel = lambda nb: (path.parent/nb).resolve().relative_to(root.resolve()).as_posix()
    held = {}
    for nb, chunk in re.findall(r'^# %% (\S+\.ipynb)(?: \d+)?\n(.*?)(?=^# %% |\Z)', text, re.M | re.S):
        code = [n for n in ast.parse(chunk).body if not isinstance(n, (ast.Import, ast.ImportFrom))]
        held[rel(nb)] = held.get(rel(nb), 0) + bool(code)
    return rel(m.group(1)), held

def test_headers_name_the_notebook_that_holds_the_code():
    "The notebook a generated module's header tells you to edit holds (some of) its code, not only its imports."
    wrong, fixed = [], []
    for p in sorted((ROOT/'memlab').rglob('*.py')):
        header, held = notebook_cells(p)
        if header is None: continue
        name = p.relative_to(ROOT/'memlab').with_suffix('').as_posix()
        ok = held.get(header, 0) > 0 or not any(held.values())   # a module of imports only (a package's __init__)
        if not ok and name not in HEADER_NOT_HOLDING_CODE:
            wrong.append(f"memlab/{name}.py names {header}, but its code is in {', '.join(n for n, k in held.items() if k)}")
        if ok and name in HEADER_NOT_HOLDING_CODE: fixed.append(name)
    assert not wrong, '\n'.join(wrong)
    assert not fixed, f"now true, remove from HEADER_NOT_HOLDING_CODE: {fixed}"

def test_the_header_check_reads_cells(tmp_path):
    (tmp_path/'memlab').mkdir()
    (tmp_path/'memlab'/'m.py').write_text('"doc"\n\n# AUTOGENERATED! DO NOT EDIT! File to edit: ../nbs/x/1_m.ipynb.\n\n'
        '# %% ../nbs/x/1_m.ipynb 2\nimport os\n\n# %% auto 0\n__all__ = []\n\n# %% ../nbs/2_big.ipynb\ndef f(): pass\n')
    assert notebook_cells(tmp_path/'memlab'/'m.py', tmp_path) == ('nbs/x/1_m.ipynb', {'nbs/x/1_m.ipynb': 0, 'nbs/2_big.ipynb': 1})
    (tmp_path/'memlab'/'n.py').write_text('import os\n')                   # not written by nbdev
    assert notebook_cells(tmp_path/'memlab'/'n.py', tmp_path) == (None, {})

def test_no_module_over_700_lines():
    "Issue #33: a module that grows past 700 lines is split at its seams (PEFT's tuners/lora/{config,layer,model}.py)."
    long = {p.relative_to(ROOT/'memlab').with_suffix('').as_posix() for p in (ROOT/'memlab').rglob('*.py')
            if not p.stem.startswith('_') and len(p.read_text().splitlines()) > 700}
    assert not long, f"over 700 lines: {sorted(long)}"

def test_the_contributors_map_names_every_library_notebook():
    "'Where to make a change' (nbs/index.ipynb) links notebooks that exist, and every top-level library notebook is in it."
    text = ''.join(''.join(c['source']) for c in json.loads((ROOT/'nbs'/'index.ipynb').read_text())['cells'])
    section = text[text.index('### Where to make a change'):]
    section = section[:section.index('\n#', 1)] if '\n#' in section[1:] else section
    linked = set(re.findall(r'\]\(nbs/([\w.]+\.ipynb)\)', section))
    assert linked and all((ROOT/'nbs'/n).exists() for n in linked), sorted(n for n in linked if not (ROOT/'nbs'/n).exists())
    library = {p.name for p in (ROOT/'nbs').glob('[0-9]*.ipynb')}
    assert library <= linked, sorted(library - linked)

def long_exported_cells(limit:int=100) -> dict:
    "{notebook: number of its exported code cells over `limit` lines}, notebooks relative to nbs/."
    out = {}
    for nb in sorted((ROOT/'nbs').rglob('*.ipynb')):
        for c in json.loads(nb.read_text())['cells']:
            src = ''.join(c['source'])
            if c['cell_type'] == 'code' and src.lstrip().startswith('#| export') and len(src.splitlines()) > limit:
                name = nb.relative_to(ROOT/'nbs').as_posix()
                out[name] = out.get(name, 0) + 1
    return out

def test_no_exported_cell_over_100_lines():
    "An exported cell is short enough to read with its example after it (fastai's notebooks: median 5 lines)."
    found = long_exported_cells()
    assert not found, f"exported cells over 100 lines: {found}"

def _code(src:str) -> str: return '\n'.join(l for l in src.splitlines() if not l.lstrip().startswith('#|'))

def teaches(src:str) -> bool:
    "Whether an exported cell defines something a reader calls (a public function, class or patched method): that wants an example."
    try: tree = ast.parse(_code(src))
    except SyntaxError: return True
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not n.name.startswith('_')
               for n in tree.body)

def runs_something(src:str) -> bool:
    "Whether a cell does more than import or call `nbdev_export()`: only such a cell can be an example."
    try: tree = ast.parse(_code(src))
    except SyntaxError: return True
    export = lambda n: (isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                        and getattr(n.value.func, 'id', getattr(n.value.func, 'attr', None)) == 'nbdev_export')
    return any(not isinstance(n, (ast.Import, ast.ImportFrom)) and not export(n) for n in tree.body)

def cells_without_example(cells:list) -> list:
    """Indices of exported cells defining public names with no example: no code cell runs before the next such cell.
    Exported cells of constants, imports or private helpers between them belong to the group and need none of their own."""
    out = []
    for i, c in enumerate(cells):
        src = ''.join(c['source'])
        if c['cell_type'] != 'code' or not src.lstrip().startswith('#| export') or not teaches(src): continue
        for d in cells[i+1:]:
            s = ''.join(d['source'])
            if d['cell_type'] != 'code' or not s.strip(): continue
            if not s.lstrip().startswith('#| export'):
                if runs_something(s): break                                       # an example, a test, a demonstration
                continue                                                          # imports or nbdev_export(): not one
            if teaches(s): out.append(i); break
        else: out.append(i)
    return out

def unfollowed_cells() -> dict:
    "{notebook: exported cells with no example after them}, the library's notebooks (not the experiments)."
    out = {}
    for nb in sorted((ROOT/'nbs').rglob('*.ipynb')):
        if 'experiments' in nb.parts: continue
        n = len(cells_without_example(json.loads(nb.read_text())['cells']))
        if n: out[nb.relative_to(ROOT/'nbs').as_posix()] = n
    return out

def test_the_example_check_reads_groups():
    cell = lambda src, kind='code': {'cell_type': kind, 'source': [src]}
    cells = [cell('#| export\nX = 1'), cell('#| export\ndef _h(): pass'), cell('#| export\ndef f(): pass'),
             cell('prose', 'markdown'), cell('assert f() is None'), cell('#| export\nclass A: pass'),
             cell('#| export\n@patch_to(A)\ndef g(self): pass'), cell('A().g()'), cell('#| export\ndef k(): pass')]
    assert cells_without_example(cells) == [5, 8]      # A's cell is followed by its patch, not an example; k by nothing
    # imports and the closing nbdev_export() cell are not examples: q and r have none
    cells = [cell('#| export\ndef q(): pass'), cell('#| hide\nfrom fastcore.test import *'),
             cell('#| export\ndef r(): pass'), cell('#| hide\nimport nbdev; nbdev.nbdev_export()'),
             cell('#| export\ndef s(): pass'), cell('test_eq(s(), None)')]
    assert cells_without_example(cells) == [0, 2]

def test_every_exported_cell_is_followed_by_its_example():
    "As in fastai's notebooks: what a cell defines is shown working right after it, not in a test block at the end."
    found = unfollowed_cells()
    assert not found, f"exported cells with no example after them: {found}"

def test_most_exported_cells_are_short():
    "Most exported cells under 40 lines (issue #33); none over 100 (the test above)."
    lengths = [len(''.join(c['source']).splitlines()) for nb in (ROOT/'nbs').rglob('*.ipynb') if 'experiments' not in nb.parts
               for c in json.loads(nb.read_text())['cells']
               if c['cell_type'] == 'code' and ''.join(c['source']).lstrip().startswith('#| export')]
    short = sum(n <= 40 for n in lengths) / len(lengths)
    assert short > 0.5, f"only {short:.0%} of exported cells are 40 lines or fewer"

def reexports(module:str) -> set:
    "Names memlab/<module>.py imports from other memlab modules (and so hands on to whoever imports them from it)."
    tree = ast.parse((ROOT/'memlab'/f'{module}.py').read_text())
    return {a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 1 for a in n.names}

def test_names_are_imported_from_where_they_live():
    "A module imports a wrapper or registry name from `wrappers` / `registry`, not through `models`' re-exports."
    passed_on = reexports('models')
    bad = []
    for p in sorted((ROOT/'memlab').rglob('*.py')):
        if p.stem.startswith('_') or p.stem == 'models': continue
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom) and (n.module or '').split('.')[-1] == 'models' and n.module != 'transformers.models':
                bad += [f"{p.relative_to(ROOT)}: {a.name}" for a in n.names if a.name in passed_on]
    assert not bad, 'imported through memlab.models:\n' + '\n'.join(bad)

def test_no_function_over_80_lines():
    "Issue #33: a recipe is named stages, not one long function; no function or method of the package over 80 lines."
    long = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p in sorted((ROOT/'memlab').rglob('*.py')) if not p.stem.startswith('_')
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80]
    assert not long, '\n'.join(long)

def test_experiments_run_commands_and_import_components():
    """Issue #33: an experiment runs a command as its user types it (`run_cli(main, argv)`) and checks its flags with the
    command's own parser and config classes; every other piece it needs comes from the library, not from a command line."""
    import importlib, inspect
    from memlab.core import Config
    bad = []
    for nb in sorted((ROOT/'nbs'/'experiments').glob('*.ipynb')):
        for c in json.loads(nb.read_text())['cells']:
            src = ''.join(c['source'])
            if c['cell_type'] != 'code': continue
            try: tree = ast.parse('\n'.join(l for l in src.splitlines() if not l.lstrip().startswith(('%', '!'))))
            except SyntaxError: continue
            for n in ast.walk(tree):
                if isinstance(n, ast.ImportFrom) and (n.module or '').startswith('memlab.train_'):
                    mod = importlib.import_module(n.module)
                    for a in n.names:
                        obj = getattr(mod, a.name)
                        if not (a.name == 'main' or a.name.startswith('parse') or
                                (inspect.isclass(obj) and issubclass(obj, Config))):
                            bad.append(f"{nb.name}: {a.name} from {n.module}")
    assert not bad, 'experiments importing command-line components:\n' + '\n'.join(bad)
