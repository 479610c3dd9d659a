#!/usr/bin/env python3
"""Rebuild data/pydocs/pydocs.jsonl.gz, memlab's embedded long-document corpus, from Debian's python3.11-doc package.

Usage: python3 data/pydocs/build.py [--deb python3.11-doc_*.deb]   (downloads the .deb with apt-get when not given)
Each document is one reStructuredText source of the Python 3.11 documentation; the split is fixed by a hash of its id.
"""
import argparse, glob, gzip, hashlib, json, subprocess, sys, tempfile
from pathlib import Path

SOURCES = 'usr/share/doc/python3.11/html/_sources'

def split_of(doc_id: str) -> str:
    "Fixed document-level split: 90% train, 5% validation, 5% test, by the first bytes of sha1(id)."
    h = int(hashlib.sha1(doc_id.encode()).hexdigest()[:8], 16) % 100
    return 'train' if h < 90 else ('validation' if h < 95 else 'test')

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--deb', help='path to python3.11-doc_*.deb (default: apt-get download it)')
    p.add_argument('--out', default=str(Path(__file__).with_name('pydocs.jsonl.gz')), help='output file')
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        deb = args.deb
        if deb is None:
            subprocess.run(['apt-get', 'download', 'python3.11-doc'], cwd=d, check=True)
            deb = glob.glob(f'{d}/python3.11-doc_*.deb')[0]
        subprocess.run(['dpkg', '-x', deb, f'{d}/x'], check=True)
        root = Path(d, 'x', SOURCES)
        files = sorted(root.rglob('*.txt'))
        with gzip.GzipFile(args.out, 'wb', mtime=0) as gz:
            for f in files:
                doc_id = str(f.relative_to(root)).removesuffix('.rst.txt').removesuffix('.txt')
                rec = {'id': doc_id, 'split': split_of(doc_id), 'text': f.read_text(encoding='utf-8')}
                gz.write((json.dumps(rec, ensure_ascii=False) + '\n').encode())
    print(f"wrote {len(files)} documents to {args.out}", file=sys.stderr)

if __name__ == '__main__': main()
