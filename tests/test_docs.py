"""The documentation site: built from the notebooks without Quarto, opened in headless Chromium.
Every page loads; each library page shows its API documentation; experiment pages show their plots as images and their results as
tables; no page shows a machine's absolute path or a progress-bar warning; no internal link is broken."""
import re, shutil, subprocess, sys, warnings
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlparse, unquote
import pytest
from conftest import ROOT, run

# The library pages that may show no API documentation, and why. Every other page of a notebook with a `default_exp`
# documents what its module exports (a package's `__init__` that imports a name by name, as 95_package imports
# `declare_home`, documents that name).
NO_API = {
    # the top of a package split into modules: its `__init__` is star imports of the modules, each documented on its own page
    '10_bpt.html': "BPT's overview; exports memlab.bpt's __init__, the names of bpt/*",
    '20_neurocache.html': "Neurocache's overview; exports memlab.neurocache's __init__, the names of neurocache/*",
    '30_relora.html': "ReLoRA's overview; exports memlab.relora's __init__, the names of relora/*",
    'distill/41_package.html': "memlab.distill's __init__, the names of distill/*",
    '50_mixer.html': "the masked mixers' overview; exports memlab.mixer's __init__, the names of mixer/*",
    # notebooks that export no module
    **{p.stem + '.html': 'exports nothing' for p in (ROOT/'nbs').glob('[0-9][0-9]_*.ipynb')
       if '#| default_exp' not in p.read_text()},   # 92_compose (tests and prose on the methods' APIs), 41_distill (overview)
}
CHROMIUM = shutil.which('chromium') or shutil.which('chromium-browser')
ARGS = ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
        '--disable-component-update', '--disable-sync']

def git_status() -> str:
    return subprocess.run(['git', 'status', '--porcelain', '--ignored'], cwd=ROOT, capture_output=True, text=True).stdout

@pytest.fixture(scope='module')
def site(tmp_path_factory):
    out, before = tmp_path_factory.mktemp('site')/'site', git_status()
    run([Path(sys.executable).parent/'memlab_docs', '--site', '--out', out, '--root', ROOT], timeout=900)
    assert git_status() == before, 'the build wrote into the repository'     # only --out is written (README.md is regenerated as it was)
    return out

def test_every_notebook_has_a_page():
    "Every notebook of nbs/ (a package's module notebooks in nbs/<method>/ too) is a page of the site, under the same path."
    from memlab.docs import site_pages
    pages = {nb.resolve(): page for _, nb, page in site_pages(ROOT)}
    notebooks = {p.resolve() for p in (ROOT/'nbs').rglob('*.ipynb') if '.ipynb_checkpoints' not in p.parts}
    assert notebooks - set(pages) == set(), sorted(str(p.relative_to(ROOT)) for p in notebooks - set(pages))
    assert pages[(ROOT/'nbs'/'neurocache'/'20_3_model.ipynb').resolve()] == 'neurocache/20_3_model.md'  # relative links hold
    assert pages[(ROOT/'nbs'/'distill'/'41_package.ipynb').resolve()] == 'distill/41_package.md'

def test_readme_links_exist():
    "README.md (generated from nbs/index.ipynb, whose links are relative to nbs/ or to the root) links files that exist."
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT/'README.md').read_text())
    local = [l.split('#')[0] for l in links if not re.match(r'^[a-z]+:|^#', l)]
    assert local and not [l for l in local if not (ROOT/unquote(l)).exists()], [l for l in local if not (ROOT/unquote(l)).exists()]

def test_code_is_highlighted_and_docstrings_rendered(site):
    page = (site/'neurocache'/'20_3_model.html').read_text()       # the module's page, not the overview's
    assert page.count('<span class="k">') > 50                               # Python keywords in notebook code, coloured by Pygments
    api = page[page.index('id="api-add_neurocache"'):][:4000]
    assert 'class="highlight"' in api and 'class="memlab-source"' in api     # highlighted signature, a link to its source
    assert '`' not in api.split('</pre>', 1)[1].split('</div>', 1)[0]         # docstrings as Markdown, not raw backticks

# An absolute path of the machine that ran a notebook: the root or a user's home folder, a worktree, a temporary folder. Only where a
# path starts (not inside a URL like https://host/work/, a relative ../tmp/ or ~/...); file:// URLs are paths too.
MACHINE_PATH = re.compile(r"(?<![\w.~/-])(?:/root/|/home/[\w.-]+/|/work/|/tmp/)")
DATA_URI = re.compile(r"data:[\w/+.-]+;base64,[\w+/=]+")                   # inline images: base64 can spell anything
CODE_STRING = re.compile(r'<span class="s[a-z0-9]?">[^<]*</span>')             # a string literal in highlighted code (Pygments)
NOISE = ('TqdmWarning', 'IProgress not found')                               # tqdm.auto without ipywidgets

def machine_paths(html:str) -> list:
    """Absolute machine paths in a page's HTML, with some context. A temporary folder written as a string literal in code (a
    notebook's `run_demo('/tmp/...')`) is what a person writes, not what a machine printed: allowed; /root, /home and /work never are."""
    html = DATA_URI.sub('', html).replace('file://', ' ')
    strings = [m.span() for m in CODE_STRING.finditer(html)]
    return [html[max(0, m.start() - 60):m.end() + 40] for m in MACHINE_PATH.finditer(html)
            if not (m.group() == '/tmp/' and any(a <= m.start() < b for a, b in strings))]

def test_machine_paths_found():
    assert machine_paths('run folder /root/.cache/memlab/x') and machine_paths('weights of /home/ann/runs/x')
    assert machine_paths('<code>/work/wt/relora/memlab/relora.py:583: UserWarning</code>') and machine_paths('data /tmp/pytest-of-x/y')
    assert machine_paths('<a href="file:///work/main/site/index.html">') and machine_paths('&quot;/tmp/x&quot;')
    assert not machine_paths('<a href="https://github.com/o/r/tree/main/work/x">') and not machine_paths('~/.cache/memlab/x, ../tmp/y')
    assert not machine_paths('<span class="s1">\'/tmp/memlab-demo-test\'</span>')
    assert machine_paths('<span class="s1">\'/root/.cache/x\'</span>')

def test_pages_carry_no_machine_paths_nor_warnings(site):
    pages = sorted(site.rglob('*.html'))
    assert len(pages) > 10
    paths = {str(p.relative_to(site)): hits[:3] for p in pages if (hits := machine_paths(p.read_text()))}
    assert not paths, f"absolute paths of a machine in {len(paths)} page(s): {paths}"
    noisy = [f"{p.relative_to(site)}: {w}" for p in pages for w in NOISE if w in p.read_text()]
    assert not noisy, noisy

def test_experiment_pages_show_tables(site):
    exp_pages = sorted((site/'experiments').glob('*.html'))
    assert exp_pages, 'no experiment pages were built'
    no_table = [p.name for p in exp_pages if '<table' not in p.read_text()]
    assert not no_table, f"experiment pages without a results table: {no_table}"

class Links(HTMLParser):
    def __init__(self): super().__init__(); self.links = []
    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if v and ((tag == 'a' and k == 'href') or (tag in ('img', 'script') and k == 'src') or (tag == 'link' and k == 'href')):
                self.links.append(v)

def test_no_broken_internal_link(site):
    pages = [p for p in site.rglob('*.html') if p.name != '404.html']  # the 404 page uses server-absolute links by design
    assert len(pages) > 10
    broken = []
    for page in pages:
        p = Links(); p.feed(page.read_text())
        for link in p.links:
            u = urlparse(link)
            if u.scheme or link.startswith('#') or not u.path: continue
            target = (site/unquote(u.path).lstrip('/')) if u.path.startswith('/') else (page.parent/unquote(u.path)).resolve()
            if not target.exists(): broken.append(f"{page.relative_to(site)} -> {link}")
    assert not broken, broken[:20]

@pytest.mark.skipif(CHROMIUM is None, reason='needs Chromium (Debian package chromium); .ci/run installs it')
def test_pages_in_headless_chromium(site):
    from playwright.sync_api import sync_playwright
    lib_pages = sorted(p for g in ('[0-9][0-9]_*.html', '*/[0-9][0-9]_*.html') for p in site.glob(g)
                       if p.parent.name not in ('benchmarks', 'experiments'))      # with nbs/neurocache/, nbs/distill/
    assert {'neurocache/20_3_model.html', 'distill/41_package.html'} <= {str(p.relative_to(site)) for p in lib_pages}
    assert set(NO_API) <= {str(p.relative_to(site)) for p in lib_pages}, 'an exemption names no page'
    exp_pages = sorted((site/'experiments').glob('*.html')) if (site/'experiments').exists() else []
    method_pages = [p for p in lib_pages if p.name[0] in '12345']
    assert method_pages, 'no method pages were built'
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page()
        errors = []
        page.on('pageerror', lambda e: errors.append(str(e)))
        page.goto((site/'index.html').as_uri())
        assert 'memlab' in page.title()
        assert page.locator('h1').first.inner_text().strip() == 'memlab'
        for p in lib_pages:
            page.goto(p.as_uri())
            name = str(p.relative_to(site))
            assert page.locator('h1').count() >= 1, name
            if name not in NO_API:
                assert page.locator('.memlab-api').count() > 0, f"{name} shows no API documentation"
        page.goto((site/'95_package.html').as_uri())                         # the package's `__init__` documents its import
        assert page.locator('#api-declare_home').count() == 1
        page.goto((site/'index.html').as_uri())                                # search from file:// (the offline plugin)
        page.locator('input.md-search__input').fill('Neurocache')           # the header's search box, shown when search can work
        # the index (3 MB) is read and built in the page when search starts: ~1.5 s here alone; once, while the other pytest
        # worker's launches held both cores, no result came within 15 s: typed again after 30 s (a warning says so)
        try: page.wait_for_selector('.md-search-result__item', timeout=30000)
        except Exception:
            warnings.warn('docs search: no result 30 s after typing; typed again')
            page.locator('input.md-search__input').fill(''); page.locator('input.md-search__input').fill('Neurocache')
            page.wait_for_selector('.md-search-result__item', timeout=60000)
        assert page.locator('.md-search-result__item').count() > 0, 'search for Neurocache found nothing'
        page.set_viewport_size({'width': 1280, 'height': 900})
        for p in exp_pages:
            page.goto(p.as_uri())
            widths = page.evaluate("() => { const a = document.querySelector('article').getBoundingClientRect().width;"
                                   " return [...document.querySelectorAll('article img')].map(i => i.getBoundingClientRect().width - a); }")
            assert all(w <= 1 for w in widths), f"{p.name}: an image is wider than the text column"
            imgs = page.locator('article img')
            n = imgs.count()
            assert n > 0, f"{p.name} shows no plot"
            assert page.locator('article table').count() > 0, f"{p.name} shows no results table"
            loaded = page.evaluate("() => [...document.querySelectorAll('article img')].map(i => i.complete && i.naturalWidth > 0)")
            assert all(loaded), f"{p.name}: {loaded.count(False)} image(s) did not load"
        browser.close()
    assert not errors, errors[:5]
