"""One run per output folder: a second launch into the folder of a live run is refused in one line and changes nothing there;
the lock dies with its process, so a run killed with SIGKILL resumes from its folder at once."""
import signal, subprocess, sys, time
from pathlib import Path
from conftest import BIN, ROOT, env, free_port, run, run_commands
import pytest

@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    "A tiny Llama with SmolLM2's tokenizer, saved as a folder."
    p = tmp_path_factory.mktemp('tiny')/'model'
    run([sys.executable, '-c', "import sys; from memlab.models import save_tiny_model, load_tokenizer; "
         "save_tiny_model('llama', sys.argv[1], vocab_size=49152); load_tokenizer('smollm2-135m').save_pretrained(sys.argv[1])", p])
    return p

def train_argv(model, out, *extra):
    # a constant schedule: the killed run below is resumed for one update more than it reached (its length may change)
    return ['--model', model, '--dataset', 'pydocs', '--sequence_length', 32, '--max_eval_steps', 1, '--eval_every', 0,
            '--log_every', 1, '--output_dir', out, '--report_to', 'none', '--progress', 'false', '--mixed_precision', 'no',
            '--scheduler', 'constant', *extra]

def wait_for(cond, proc, timeout=120):
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - t0 < timeout, 'timed out'
        time.sleep(0.2)

def test_second_run_into_a_live_folder_is_refused_and_a_killed_run_resumes(tiny, tmp_path):
    out = tmp_path/'run'
    first = subprocess.Popen([str(BIN/'memlab_train'), *map(str, train_argv(tiny, out, '--max_steps', 100000, '--save_every', 2))],
                             cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log = out/'log.jsonl'
        wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 3 and (out/'checkpoints'/'latest').exists(), first)
        first.send_signal(signal.SIGSTOP)      # stopped where it is: it still holds the folder, and leaves the CPU to the others
        before, config = log.read_text(), (out/'run_config.json').read_text()
        names = sorted(p.name for p in out.iterdir())
        busy = f'is in use by a running memlab command (memlab_train, process {first.pid} on'
        tries = [(('memlab.train', 'memlab_train', train_argv(tiny, out, '--max_steps', 3)), 'output_dir'),   # a fresh start
                 (('memlab.train', 'memlab_train', train_argv(tiny, out, '--max_steps', 3, '--resume_from', 'latest')), 'output_dir'),
                 # every other command that writes into a folder takes the same lock (issue 40: pretokenize wrote here)
                 (('memlab.tokenizers:pretokenize_main', 'memlab_pretokenize', ['--tokenizer', tiny, '--dataset', 'pydocs', '--take',
                   2, '--sequence_length', 32, '--save_dir', out]), 'save_dir'),
                 (('memlab.evaluation', 'memlab_eval', [tiny, '--tasks', 'x', '--out', out/'scores.json']), 'out'),
                 (('memlab.docs:docs_main', 'memlab_docs', ['--root', ROOT, '--site', '--out', out]), 'out')]
        for (_, flag), (code, lines) in zip(tries, run_commands([c for c, _ in tries])):   # one process runs the five
            assert code != 0 and len(lines) == 1 and 'Traceback' not in lines[0], lines[-20:]
            assert f'--{flag} {out} {busy}' in lines[0], lines[0]
        assert log.read_text().startswith(before) and (out/'run_config.json').read_text() == config  # the first run's files untouched
        assert sorted(p.name for p in out.iterdir()) == names
        assert first.poll() is None                                                                   # and it still runs
    finally:
        first.send_signal(signal.SIGKILL); first.communicate()
    assert first.returncode == -signal.SIGKILL and (out/'.memlab.lock').exists()   # a lock file nobody holds is left
    step = int((out/'checkpoints'/'latest').read_text().split('-')[1])
    r = run([BIN/'memlab_train', *train_argv(tiny, out, '--max_steps', step + 1, '--resume_from', 'latest')])
    assert 'after training' in r.stdout and (out/'results.json').exists()
    assert not (out/'.memlab.lock').exists()                                       # released when the command ended

def test_a_live_run_under_torchrun_holds_its_folder(tiny, tmp_path):
    "Two processes run one job: the first launch's main process holds the folder, and a second launch (also of two) is refused."
    out = tmp_path/'run'
    def launch(*extra):
        return [BIN/'torchrun', '--nproc-per-node', 2, '--master-port', free_port(), '-m', 'memlab.train',
                *train_argv(tiny, out, '--per_device_batch_size', 1, *extra)]
    first = subprocess.Popen([str(a) for a in launch('--max_steps', 100000)], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        log = out/'log.jsonl'
        wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 2, first)
        subprocess.run(['pkill', '-STOP', '-P', str(first.pid)]); first.send_signal(signal.SIGSTOP)   # held, not training on
        before = log.read_text()
        r = run(launch('--max_steps', 3), check=False)
        assert r.returncode != 0 and f'--output_dir {out} is in use by a running memlab command' in r.stderr, r.stderr[-3000:]
        assert log.read_text().startswith(before) and first.poll() is None   # (torchrun adds its own report of a failed worker)
    finally:
        subprocess.run(['pkill', '-KILL', '-P', str(first.pid)]); first.kill(); first.communicate()   # the workers, then torchrun

def test_a_lock_that_is_not_memlabs_is_refused_and_left_alone(tiny, tmp_path):
    """A `.memlab.lock` planted as a link to a file elsewhere, as another name (hard link) of a file, or holding a user's data: the
    command refuses in one line, the file it points at is not truncated or written, and nothing else is created."""
    import os
    victim = tmp_path/'victim.txt'; victim.write_text('precious\n')
    plants = {'link': lambda lock: lock.symlink_to(victim), 'hard link': lambda lock: os.link(victim, lock),
              'notes': lambda lock: lock.write_text('my notes\n')}
    outs = {name: tmp_path/name.replace(' ', '_') for name in plants}
    for name, plant in plants.items(): outs[name].mkdir(); plant(outs[name]/'.memlab.lock')
    made = run_commands([('memlab.train', 'memlab_train', train_argv(tiny, out, '--max_steps', 1)) for out in outs.values()])
    for (name, out), (code, lines) in zip(outs.items(), made):                  # the three commands, in one process
        assert code == 2 and len(lines) == 1 and "not memlab's lock file" in lines[0], (name, code, lines[-20:])
        assert victim.read_text() == 'precious\n' and sorted(p.name for p in out.iterdir()) == ['.memlab.lock'], name
