"""The documentation site: built from the notebooks without Quarto, opened in headless Chromium.
Every page loads; each library page shows its API documentation; experiment pages show their plots as images; no internal link is broken."""
import re, shutil, subprocess, sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlparse, unquote
import pytest
from conftest import ROOT, run

# Pages whose notebook exports no module (92_compose is tests and prose on the methods' own APIs) have no API section:
NO_API = {'99_docs.html'} | {p.stem + '.html' for p in (ROOT/'nbs').glob('[0-9][0-9]_*.ipynb')
                             if '#| default_exp' not in p.read_text()}
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

def test_code_is_highlighted_and_docstrings_rendered(site):
    page = (site/'20_neurocache.html').read_text()
    assert page.count('<span class="k">') > 50                               # Python keywords in notebook code, coloured by Pygments
    api = page[page.index('id="api-add_neurocache"'):][:4000]
    assert 'class="highlight"' in api and 'class="memlab-source"' in api     # highlighted signature, a link to its source
    assert '`' not in api.split('</pre>', 1)[1].split('</div>', 1)[0]         # docstrings as Markdown, not raw backticks

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
    lib_pages = sorted(p for p in site.glob('[0-9][0-9]_*.html'))
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
            assert page.locator('h1').count() >= 1, p.name
            if p.name not in NO_API:
                assert page.locator('.memlab-api').count() > 0, f"{p.name} shows no API documentation"
        page.goto((site/'index.html').as_uri())                                # search from file:// (the offline plugin)
        page.locator('input.md-search__input').fill('Neurocache')           # the header's search box, shown when search can work
        page.wait_for_selector('.md-search-result__item', timeout=15000)
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
            loaded = page.evaluate("() => [...document.querySelectorAll('article img')].map(i => i.complete && i.naturalWidth > 0)")
            assert all(loaded), f"{p.name}: {loaded.count(False)} image(s) did not load"
        browser.close()
    assert not errors, errors[:5]
