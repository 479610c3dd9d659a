"""Bad input, tried the way users meet it, against the command lines it applies to: each is one line on stderr, a non-zero exit,
no traceback, and nothing written or overwritten."""
import json, os, sys
from pathlib import Path
from conftest import BIN, ROOT, run
import pytest

def one_line(r, *fragments):
    "The run failed with exactly one line on stderr (no traceback) holding every fragment."
    assert r.returncode != 0, r.stdout[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and 'Traceback' not in r.stderr, r.stderr[-3000:]
    for f in fragments: assert f in lines[0], lines[0]
    return lines[0]

def test_tokenizers_module_runs_one_command(tmp_path):
    "`python -m memlab.tokenizers` holds two commands: it runs the one named first, and says so when none is."
    one_line(run([sys.executable, '-m', 'memlab.tokenizers'], check=False), 'give a command first: train_tokenizer or pretokenize')
    r = run([sys.executable, '-m', 'memlab.tokenizers', 'pretokenize', '--help'])
    assert r.stdout.startswith('usage: memlab_pretokenize') and 'memlab_train_tokenizer' not in r.stdout

def test_accelerate_launch_without_multi_gpu_is_refused(tmp_path):
    "Seed 000's launcher form on a CPU machine: `accelerate launch --num_processes 2` without --multi_gpu starts ONE process."
    r = run([BIN/'accelerate', 'launch', '--num_processes', '2', '--num_machines', '1', '--mixed_precision', 'no', '--dynamo_backend',
             'no', '-m', 'memlab.train', '--model', 'tiny-llama', '--output_dir', tmp_path/'run'], check=False)
    assert r.returncode != 0
    assert 'accelerate launch was asked for 2 processes but started 1' in r.stderr and '--multi_gpu' in r.stderr, r.stderr[-3000:]
    assert not (tmp_path/'run').exists()
    r = run([BIN/'accelerate', 'launch', '--num_processes', '1', '--num_machines', '1', '--mixed_precision', 'no', '--dynamo_backend',
             'no', '-m', 'memlab.train', '--help'])                     # one process asked, one started: fine
    assert 'usage: ' in r.stdout
