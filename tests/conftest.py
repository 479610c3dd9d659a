"Shared helpers for memlab's integration tests: run memlab's scripts as real processes (plain, torchrun, accelerate launch)."
import json, os, re, signal, socket, subprocess, sys, warnings
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SLOW = bool(os.environ.get('MEMLAB_SLOW_TESTS'))   # the slow tier: checks a default-tier test makes another way, at more cost
slow = pytest.mark.skipif(not SLOW, reason='slow tier: set MEMLAB_SLOW_TESTS=1')
BAD_INPUT = {'tried': 0, 'clean': 0}      # counted by tests/test_bad_input.py, reported at the end of the run

def pytest_sessionfinish(session):
    "Under pytest-xdist a worker hands its bad-input counts to the controller, which reports them."
    if hasattr(session.config, 'workeroutput'): session.config.workeroutput['bad_input'] = dict(BAD_INPUT)

@pytest.hookimpl(optionalhook=True)      # xdist's hook: pytest without that plugin loaded (the GPU kit's run) skips it
def pytest_testnodedown(node, error):
    for k, v in getattr(node, 'workeroutput', {}).get('bad_input', {}).items(): BAD_INPUT[k] += v

# Under pytest-xdist (`.ci/test`: `-n 2 --dist loadgroup`): a file whose tests share module fixtures (a trained run, a
# pretokenized corpus, a built site) runs on one worker, so they are built once; these files' tests share none and spread
# over both workers, filling the end of the run. The longest files start first; test_training.py's groups (its reference runs)
# among them, its other tests and the files of in-process checks (seconds each) last, where they fill a worker that ends first.
SPREAD = {'test_training.py', 'test_layers.py', 'test_gpu.py', 'test_loop_flags.py', 'test_resume_tables.py'}
FIRST = ['test_bad_input.py', 'test_relora.py', 'test_training.py groups', 'test_mixer.py', 'test_distill.py', 'test_mesh.py',
         'test_run_folder.py', 'test_neurocache.py', 'test_bpt.py', 'test_docs.py', 'test_training.py']

def _order(item, rank={f: i for i, f in enumerate(FIRST)}) -> int:
    name = item.path.name
    if name == 'test_training.py' and item.get_closest_marker('xdist_group'): name += ' groups'
    return rank.get(name, len(FIRST))

@pytest.hookimpl(tryfirst=True)        # before pytest-xdist's hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    items.sort(key=_order)                                              # stable: a file's tests keep their order
    for it in items:
        if it.path.name not in SPREAD: it.add_marker(pytest.mark.xdist_group(it.path.stem))

def pytest_configure(config):
    """`--dist loadgroup` with pytest 9 and pytest-xdist 3.8 or older groups nothing (xdist writes the groups into test ids
    that pytest 9 no longer reads), so each worker would build every module fixture again: refuse, in one line."""
    config.addinivalue_line('markers', 'xdist_group(name): run on the pytest-xdist worker of that group')  # (known without xdist)
    if hasattr(config, 'workerinput') or config.getoption('dist', default=None) != 'loadgroup': return   # (no xdist: none)
    import xdist
    version = lambda v: tuple(int(x) for x in v.split('.')[:2] if x.isdigit())
    if version(pytest.__version__) >= (9,) and version(xdist.__version__) <= (3, 8):
        raise pytest.UsageError(f"pytest-xdist {xdist.__version__} does not group tests under pytest {pytest.__version__}: "
                                "install the versions of .ci/constraints.txt (pytest 8)")

def pytest_terminal_summary(terminalreporter):
    if BAD_INPUT['tried']:
        terminalreporter.write_line(f"bad input: {BAD_INPUT['clean']} of {BAD_INPUT['tried']} cases answered in one line "
                                    "(exit status != 0, no traceback, nothing created or changed)")

def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def env(**kw) -> dict:
    e = {**os.environ, 'PYTHONFAULTHANDLER': '1', 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false', 'HF_HUB_OFFLINE': '1', 'HF_DATASETS_OFFLINE': '1',
         'PYTHONPATH': str(ROOT)}
    e.update({k: str(v) for k, v in kw.items()})
    return e

def run(cmd, timeout=600, check=True, **envkw) -> subprocess.CompletedProcess:
    "Run `cmd` from the project root; on a timeout its whole process group goes (torchrun's and accelerate's workers too)."
    p = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env(**envkw), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try: out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL); p.communicate()
        raise
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-5000:]}")
    return r

def cli_runner(module:str, prog:str) -> str:
    """A `python -c` script that runs `module`'s CLI (`module:function`, default `main`) once per argv of the JSON list in argv[1], in
    one process (accelerate's state reset between runs), and prints [[exit code, stderr], ...] as JSON: many short CLI runs for the
    price of one interpreter start."""
    module, _, fn = module.partition(':')
    return f'''
import json, sys
from accelerate.state import AcceleratorState
from memlab.cli import run_cli
from {module} import {fn or 'main'} as main
out = []
for argv in json.loads(sys.argv[1]):
    AcceleratorState._reset_state(True)
    code, _, err = run_cli(main, argv, prog={prog!r})
    out.append([code, err])
print(json.dumps(out))
'''

MANY = r'''
import importlib, json, sys
from accelerate.state import AcceleratorState
from memlab.cli import run_cli
out = []
for target, prog, argv in json.loads(sys.argv[1]):
    module, _, fn = target.partition(':')
    AcceleratorState._reset_state(True)
    code, _, err = run_cli(getattr(importlib.import_module(module), fn or 'main'), argv, prog=prog)
    out.append([code, err])
print(json.dumps(out))
'''

def run_commands(runs) -> list:
    "[(exit status, stderr lines)] of each (module[:function], program, argv) of `runs`, all in one process (one interpreter start)."
    r = run([sys.executable, '-c', MANY, json.dumps([[m, p, [str(a) for a in argv]] for m, p, argv in runs])], timeout=900)
    return [(code, [l for l in err.splitlines() if l.strip()]) for code, err in json.loads(r.stdout.strip().splitlines()[-1])]

def torchrun(script, *args, nproc=2, **envkw):
    return run([BIN/'torchrun', '--nproc-per-node', nproc, '--master-port', free_port(), script, *args], **envkw)

CRASH = re.compile(r'Signal (11|7) \((SIGSEGV|SIGBUS)\) received|Fatal Python error: (Segmentation fault|Bus error)')

class NativeCrash(UserWarning): "A launch whose process died in native code (segfault) and was run once more."

def run_again_on_crash(launch, clear):
    """`launch()` once more (after `clear()` empties what it wrote) when a process of it died of a segfault in native code.
    Seen once in the suite's history: a worker of the 2-process mesh launch (tests/test_mesh.py) died in gloo's transport
    thread (`pt_gloo_runloop`, a corrupted heap inside libc's malloc) and did not again in 66 launches of the same command
    (alone, two at once, and beside a busy core under glibc's malloc checks). A second crash fails the test, with its Python stacks (PYTHONFAULTHANDLER); any other failure fails at
    once; the first crash's tail is a warning in the run's summary."""
    try: return launch()
    except AssertionError as e:
        if not CRASH.search(str(e)): raise
        warnings.warn(NativeCrash(f"a launch crashed in native code and ran again:\n{str(e)[-2500:]}"))
    clear()
    return launch()

def results(out) -> list:
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob('result_rank*.json'))]
