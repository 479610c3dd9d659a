"""Bad input, tried the way users meet it, against the command lines it applies to: each is one line on stderr, a non-zero exit,
no traceback, and nothing written or overwritten."""
import json, sys, warnings
from pathlib import Path
from conftest import BAD_INPUT, BIN, run, run_commands
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

# ---- the machine's and the files' errors, against every command that trains or writes ----------------------------------------
from conftest import cli_runner

@pytest.fixture(scope='module')
def world(tmp_path_factory):
    "A 512-token BPE, a tiny Llama saved with it, rows pretokenized at 64 tokens, a JSON-lines corpus, a file, a folder, cut weights."
    from memlab.models import tiny_model
    from memlab.tokenizers import pretokenize, train_tokenizer
    from memlab.data import load_corpus
    root = tmp_path_factory.mktemp('bad')
    train_tokenizer('pydocs', vocab_size=512, save_dir=root/'tok', take=40, show_progress=False)
    m = root/'model'; tiny_model('llama', vocab_size=512, seed=1).save_pretrained(m)
    for f in ('tokenizer.json', 'tokenizer_config.json'): (m/f).write_bytes((root/'tok'/f).read_bytes())
    pretokenize('pydocs', root/'tok', save_dir=root, sequence_length=64, take=30, output_name='rows', show_progress=False)
    docs = load_corpus('pydocs').split('train')[:10]
    (root/'docs.jsonl').write_text(''.join(json.dumps({'id': d.id, 'text': d.text}) + '\n' for d in docs))
    (root/'a_file').write_text('keep me\n'); (root/'a_folder').mkdir()
    cut = root/'cut_model'; cut.mkdir()
    for f in m.iterdir(): (cut/f.name).write_bytes(f.read_bytes())
    w = (cut/'model.safetensors').read_bytes(); (cut/'model.safetensors').write_bytes(w[:len(w) // 2])   # a download cut short
    return root

# Each command: its module, program name, output flag, config-file flag, model flag, and a small valid run (OUT = its output).
def commands(w):
    tiny_bpt = "{'hidden_size': 64, 'intermediate_size': 128, 'num_key_value_heads': 2}"
    return {
        'memlab_train': ('memlab.train', '--output_dir', None, '--model', [
            '--model', w/'model', '--dataset', 'pydocs', '--max_steps', 1, '--sequence_length', 32, '--max_eval_steps', 1,
            '--report_to', 'none', '--progress', 'false', '--mixed_precision', 'no']),
        'memlab_neurocache': ('memlab.train_neurocache', '--output_dir', '--config', '--model_name_or_path', [
            '--model_name_or_path', w/'model', '--dataset_name', 'pydocs', '--max_train_steps', 1, '--sequence_length', 32,
            '--cache_size', 64, '--topk', 4, '--max_eval_steps', 1, '--per_device_eval_batch_size', 2, '--test_split', 'none',
            '--progress', 'false', '--mixed_precision', 'no', '--num_warmup_steps', 0]),
        'memlab_relora': ('memlab.train_relora', '--save_dir', '--training_config', '--model_name_or_path', [
            '--model_name_or_path', w/'model', '--dataset_path', w/'rows', '--batch_size', 1, '--max_length', 64,
            '--num_training_steps', 1, '--warmup_steps', 0, '--max_eval_tokens', 256, '--report_to', 'none', '--progress', 'false']),
        'memlab_distill': ('memlab.train_distill', '--output_dir', '--config', '--teacher_model_name_or_path', [
            '--teacher_model_name_or_path', w/'model', '--student_model_config', '{"num_hidden_layers": 2}', '--dataset_sample_size', 16,
            '--dataset_max_seq_length', 32, '--dataset_test_size', 0.25, '--max_steps', 1, '--bf16', 'False', '--report_to', 'none',
            '--disable_tqdm', 'True', '--gradient_checkpointing', 'False', '--ppl_evaluators', '[]']),
        'memlab_mixer': ('memlab.train_mixer', '--output_dir', '--config', None, [
            '--dataset_path', w/'rows', '--hidden_size', 32, '--num_layers', 1, '--length', 64, '--max_steps', 1,
            '--per_device_batch_size', 2, '--max_eval_steps', 1, '--report_to', 'none']),
        'memlab_bpt': ('memlab.train_bpt', '--output_dir', '--config', None, [
            '--load_llama_config=debug', f'--update_llama_config={tiny_bpt}', f'--tokenizer.vocab_file={w/"tok"}',
            f'--train_dataset.json_dataset.path={w/"docs.jsonl"}', '--train_dataset.json_dataset.seq_length=64',
            '--train_dataset.json_dataset.batch_size=2', '--llama.max_sequence_length=64', '--total_steps=1', '--dtype=fp32',
            '--report_to=none', '--progress=False']),
        'memlab_pretokenize': ('memlab.tokenizers:pretokenize_main', '--save_dir', None, None, [
            '--tokenizer', w/'tok', '--dataset', 'pydocs', '--take', 3, '--sequence_length', 64, '--output_name', 'rows_again']),
        'memlab_train_tokenizer': ('memlab.tokenizers:train_tokenizer_main', '--save_dir', None, None, [
            '--dataset', 'pydocs', '--take', 5, '--vocab_size', 300]),
    }

PROGS = ['memlab_train', 'memlab_neurocache', 'memlab_relora', 'memlab_distill', 'memlab_mixer', 'memlab_bpt', 'memlab_pretokenize',
         'memlab_train_tokenizer']

def environment_cases(w, out, prog) -> dict:
    "{case: (argv, what its one line names)}: a valid small run of `prog`, then each bad environment, outputs under `out`."
    module, out_flag, config_flag, model_flag, base = commands(w)[prog]
    kv = (lambda k, v: [f'{k}={v}']) if prog == 'memlab_bpt' else (lambda k, v: [k, v])
    def with_(**over):
        argv = list(base)
        for k, v in over.items():
            if prog != 'memlab_bpt' and k in argv: argv[argv.index(k) + 1] = v
            else: argv = [a for a in argv if not str(a).startswith(f'{k}=')] + kv(k, v)
        return [str(a) for a in argv]
    cases = {'valid run': (with_(**{out_flag: out/'ok'}), None),
             'output under a regular file': (with_(**{out_flag: w/'a_file'/'sub'}), 'a_file'),
             'output is a file': (with_(**{out_flag: w/'a_file'}), 'a_file'),
             'output cannot be written': (with_(**{out_flag: '/sys/memlab_out'}), '/sys/memlab_out')}
    if config_flag: cases['config file is a folder'] = (with_(**{out_flag: out/'c', config_flag: w/'a_folder'}), 'a_folder')
    if model_flag: cases['weights cut short'] = (with_(**{out_flag: out/'w', model_flag: w/'cut_model'}), None)
    return cases

@pytest.fixture(scope='module')
def environment_runs(world, tmp_path_factory):
    """Every command's cases, all in one process (an interpreter start each would cost more than the runs): {prog: (its output
    folder, its cases, [(exit status, stderr lines)])}."""
    outs = {prog: tmp_path_factory.mktemp(prog) for prog in PROGS}
    cases = {prog: environment_cases(world, outs[prog], prog) for prog in PROGS}
    res = iter(run_commands([(commands(world)[prog][0], prog, argv) for prog in PROGS for argv, _ in cases[prog].values()]))
    return {prog: (outs[prog], cases[prog], [next(res) for _ in cases[prog]]) for prog in PROGS}

@pytest.mark.parametrize('prog', PROGS)
def test_environment_errors_are_one_line(world, environment_runs, prog):
    "A valid small run succeeds; then each bad environment is one line, exit != 0, no traceback, nothing created or changed."
    out, cases, res = environment_runs[prog]
    for (name, (argv, where)), (code, lines) in zip(cases.items(), res):
        if name == 'valid run': assert code == 0, (prog, lines[-30:]); continue
        BAD_INPUT['tried'] += 1
        assert code != 0 and len(lines) == 1 and 'Traceback' not in lines[0], (prog, name, code, lines[-30:])
        if where: assert where in lines[0], (prog, name, lines[0])
        BAD_INPUT['clean'] += 1
    assert (world/'a_file').read_text() == 'keep me\n' and not Path('/sys/memlab_out').exists()
    assert not (out/'c').exists() and not (out/'w').exists()

def snapshot(folder) -> dict:
    "Every file under `folder` with its bytes: a refused command must leave it as it was."
    return {p.relative_to(folder): p.read_bytes() for p in sorted(Path(folder).rglob('*')) if p.is_file()}

def run_many(module, prog, argvs, **envkw) -> list:
    "[(exit status, stderr lines)] of `prog` run in one process on each argv."
    r = run([sys.executable, '-c', cli_runner(module, prog), json.dumps([[str(a) for a in argv] for argv in argvs])], timeout=900,
            **envkw)
    return [(code, [l for l in err.splitlines() if l.strip()]) for code, err in json.loads(r.stdout.strip().splitlines()[-1])]

def refused(result, *fragments):
    "One line on stderr, a non-zero exit, no traceback, holding every fragment (counted in the bad-input tally)."
    code, lines = result
    BAD_INPUT['tried'] += 1
    assert code != 0 and len(lines) == 1 and 'Traceback' not in lines[0], (code, lines[-5:])
    for f in fragments: assert f in lines[0], (f, lines[0])
    BAD_INPUT['clean'] += 1

def test_damaged_or_mismatched_checkpoints_are_one_line(world, tmp_path):
    """memlab_train resumed into another model, with LoRA switched on, and from checkpoints that do not agree with themselves: a file
    edited, cut short, removed, added or swapped, the manifest gone, the step forged with a manifest written again to match. One line
    each, naming the flag or the file, and the run folder left as it was."""
    import shutil
    from memlab.checkpoints import write_manifest
    module, out_flag, _, _, base = commands(world)['memlab_train']
    argv = lambda out, *extra: [*base, '--output_dir', out, '--lora_r', 0, *extra]
    first = tmp_path/'first'
    assert run_many(module, 'memlab_train', [argv(first, '--max_steps', 2, '--save_every', 1)])[0][0] == 0
    other = tmp_path/'other'
    from memlab.models import tiny_model
    tiny_model('llama', vocab_size=512, num_layers=2, seed=1).save_pretrained(other)
    for f in ('tokenizer.json', 'tokenizer_config.json'): (other/f).write_bytes((world/'tok'/f).read_bytes())
    def cut(p): p.write_bytes(p.read_bytes()[:p.stat().st_size // 3])
    def forge(ck):
        st = ck/'trainer_state.json'; st.write_text(st.read_text().replace('"step": 2', '"step": 9', 1)); write_manifest(ck, 9)
    ck = lambda out: out/'checkpoints'/'step-00000002'
    cases = {   # name: (damage to the copy's latest checkpoint, extra flags, what the line says)
        'another model': (None, ['--model', other], '--model_name_or_path'),
        'LoRA switched on': (None, ['--lora_r', 4], '--lora_r 0 -> 4'),
        'state not JSON': (lambda c: (c/'trainer_state.json').write_text('{bad'), [], 'trainer_state.json has 4 bytes'),
        'weights cut short': (lambda c: cut(c/'model.safetensors'), [], 'model.safetensors has'),
        'moments cut short': (lambda c: cut(c/'optimizer.safetensors'), [], 'optimizer.safetensors has'),
        'step edited': (lambda c: (c/'trainer_state.json').write_text((c/'trainer_state.json').read_text().replace(
                            '"step": 2', '"step": 7', 1)), [], 'trainer_state.json does not match its hash'),
        'file added': (lambda c: (c/'process_0.pt').write_bytes(b'planted'), [], 'process_0.pt is not in manifest.json'),
        'file removed': (lambda c: (c/'process_0.json').unlink(), [], 'process_0.json is missing'),
        'moments of another update': (lambda c: [shutil.copy(c.parent/'step-00000001'/f, c/f) for f in
                                                 ('optimizer.json', 'optimizer.safetensors')] and write_manifest(c, 2),
                                      [], "the optimizer's state has taken 1 steps but its checkpoint says 2"),
        'manifest removed': (lambda c: (c/'manifest.json').unlink(), [], 'has no manifest.json'),
        'step forged, manifest rewritten': (forge, [], 'the folder name says update 2 but manifest.json says 9'),
    }
    argvs, before = [], {}
    for name, (damage, extra, _) in cases.items():
        out = tmp_path/name.replace(' ', '_').replace(',', '')
        shutil.copytree(first, out)
        if damage: damage(ck(out))
        before[name] = snapshot(out)
        argvs.append(argv(out, '--max_steps', 2, '--resume_from', 'latest', *extra))
    for (name, (_, _, msg)), res in zip(cases.items(), run_many(module, 'memlab_train', argvs)):
        refused(res, msg)
        assert snapshot(tmp_path/name.replace(' ', '_').replace(',', '')) == before[name], name   # nothing written

# ---- resume: exact or refused, for every training command ------------------------------------------------------------------
# per command: (flags of a first run that checkpoints, flags that resume it, a defining flag changed, what the refusal names)
RESUMES = {
    'memlab_train': (['--max_steps', 2, '--save_every', 1], ['--resume_from', 'latest'], ['--lora_alpha', 64],
                     ['--lora_alpha 32 -> 64']),
    'memlab_neurocache': (['--checkpointing_steps', 1], ['--resume_from_checkpoint', 'latest'], ['--topk', 8], ['--topk 4 -> 8']),
    'memlab_relora': (['--use_peft', '--lora_r', 4, '--relora', 2, '--num_training_steps', 2, '--save_every', 1], ['--autoresume', 'True'],
                      ['--relora', 3], ['--relora 2 -> 3', '--cycle_length 2 -> 3']),     # issue 40: the merges and the restarts
    'memlab_distill': ([], ['--resume_from_checkpoint', 'latest'], ['--temperature', 2.0, '--logits_loss_fn', 'jsd'],
                       ['--logits_loss_fn kl -> jsd', '--temperature 1.0 -> 2.0']),       # issue 40: the objective
    'memlab_mixer': ([], ['--resume_from', 'latest'], ['--hidden_size', 48], ['--hidden_size 32 -> 48']),
    'memlab_bpt': ([], ['--autoresume=True'], ['--optimizer.adamw_optimizer.lr=0.001'], ['--optimizer.adamw_optimizer.lr']),
}

def test_resume_refuses_a_changed_run(world, tmp_path):
    """Each training command: a run of one or two updates that checkpoints, then resumed with one of its defining flags changed:
    one line naming each changed flag with its old and new value, and nothing in the run folder changes (run_config.json
    included). Two processes in all: the first runs, then the resumes."""
    firsts, resumes = [], []
    for prog, (first, again, changed, said) in RESUMES.items():
        module, out_flag, _, _, base = commands(world)[prog]
        out = tmp_path/prog
        with_out = [a for a in base if not str(a).startswith(f'{out_flag}=')] + ([f'{out_flag}={out}'] if prog == 'memlab_bpt'
                                                                                  else [out_flag, out])
        firsts.append((module, prog, with_out + first)); resumes.append((module, prog, with_out + first + again + changed))
    for (_, prog, _), (code, lines) in zip(firsts, run_commands(firsts)): assert code == 0, (prog, lines[-5:])
    before = {prog: snapshot(tmp_path/prog) for prog in RESUMES}
    for prog in RESUMES: assert any(p.name == 'manifest.json' for p in before[prog]), (prog, sorted(before[prog]))
    for (_, prog, _), res in zip(resumes, run_commands(resumes)):
        refused(res, 'belongs to a run with other settings', *RESUMES[prog][3])
        assert snapshot(tmp_path/prog) == before[prog], prog

def test_a_resume_may_change_what_does_not_define_the_run(world, tmp_path):
    """memlab_train stopped at update 2 continues to 3 with another logging cadence and evaluation size (they may change), where its
    schedule gives the 2 updates it trained the same rates: here they were the cosine's warm-up, and the resumed run follows the
    3-update cosine from update 3, ending with the weights of the run trained straight to 3. A cosine past its warm-up is refused:
    the updates it trained would have had other learning rates."""
    module, out_flag, _, _, base = commands(world)['memlab_train']
    argv = lambda o, *extra: [*base, '--output_dir', tmp_path/o, '--save_every', 1, '--log_every', 1, *extra]
    warm = ['--warmup_steps', 2]      # updates 1 and 2 in the warm-up; update 3 on the cosine, which the length sets
    res = run_many(module, 'memlab_train', [
        argv('warm', '--max_steps', 2, *warm), argv('straight', '--max_steps', 3, *warm),
        argv('warm', '--max_steps', 3, '--resume_from', 'latest', '--log_every', 2, '--max_eval_steps', 2, *warm),
        argv('cos', '--max_steps', 2, '--warmup_steps', 0), argv('cos', '--max_steps', 3, '--resume_from', 'latest', '--warmup_steps', 0)])
    assert [r[0] for r in res[:4]] == [0] * 4, res
    results = lambda o: json.loads((tmp_path/o/'results.json').read_text())
    assert results('warm')['steps'] == 3 and results('warm')['fingerprint'] == results('straight')['fingerprint']
    refused(res[4], 'other learning rates (--max_steps 2 -> 3)')

def test_code_in_weights_and_broken_launch_configs_are_one_line(world, tmp_path):
    """A model folder whose pytorch_model.bin is a pickle that would run code (memlab_train --model, memlab_relora --continue_from),
    and an accelerate launch naming a malformed or missing DeepSpeed JSON: one line naming the file; the pickle never runs."""
    import io, os, torch
    from memlab.models import tiny_model
    planted = tmp_path/'planted'; tiny_model('llama', vocab_size=512).save_pretrained(planted)
    os.remove(planted/'model.safetensors')
    for f in ('tokenizer.json', 'tokenizer_config.json'): (planted/f).write_bytes((world/'tok'/f).read_bytes())
    marker = tmp_path/'RAN'
    class Planted:
        def __reduce__(self): return (io.open, (str(marker), 'w'))
    torch.save({'model.embed_tokens.weight': Planted()}, planted/'pytorch_model.bin')
    (tm, _, _, _, tb), (rm, _, _, _, rb) = commands(world)['memlab_train'], commands(world)['memlab_relora']
    train, relora = run_commands([(tm, 'memlab_train', [*tb, '--model', planted, '--output_dir', tmp_path/'t']),
                                  (rm, 'memlab_relora', [*rb, '--continue_from', planted, '--save_dir', tmp_path/'r'])])
    refused(train, f"refusing to load {planted/'pytorch_model.bin'}: the pickle holds more than tensors (Unsupported global: "
            "GLOBAL io.open")
    refused(relora, f"refusing to load {planted/'pytorch_model.bin'}")
    assert not marker.exists() and not (tmp_path/'t').exists() and not (tmp_path/'r').exists()
    (tmp_path/'bad.json').write_text('{"zero_optimization": {"stage": 3,}')
    module, _, _, _, base = commands(world)['memlab_mixer']
    for ds, said in ((tmp_path/'bad.json', 'is not valid JSON (Expecting property name'), (tmp_path/'none.json', 'does not exist')):
        refused(run_many(module, 'memlab_mixer', [[*base, '--output_dir', tmp_path/'m']], ACCELERATE_USE_DEEPSPEED='true',
                         ACCELERATE_DEEPSPEED_CONFIG_FILE=ds)[0], f'the DeepSpeed config {ds}', said)
    assert not (tmp_path/'m').exists()

def test_every_command_reads_a_corpus_by_one_rule(world, tmp_path):
    "A JSON-lines corpus whose texts are all blank: memlab_bpt refuses it as memlab_train does, in the same words."
    blank = tmp_path/'blank.jsonl'
    blank.write_text(''.join(json.dumps({'text': t}) + '\n' for t in (' ', '\n\n', '\t', '')))
    said = "blank.jsonl holds 4 records but every 'text' is empty"
    (tm, _, _, _, tb), (bm, _, _, _, bb) = commands(world)['memlab_train'], commands(world)['memlab_bpt']
    bb = [a for a in bb if not str(a).startswith('--train_dataset.json_dataset.path')]
    for res in run_commands([(tm, 'memlab_train', [*tb, '--dataset', blank, '--output_dir', tmp_path/'t']),
                             (bm, 'memlab_bpt', [*bb, f'--train_dataset.json_dataset.path={blank}', f'--output_dir={tmp_path/"b"}'])]):
        refused(res, said)
    assert not (tmp_path/'t').exists() and not (tmp_path/'b').exists()

def test_this_file_runs_on_one_worker(request):
    "Under `.ci/test` (pytest-xdist, --dist loadgroup) this file's tests carry its group: its module fixtures are built once."
    if not (hasattr(request.config, 'workerinput') and request.config.getvalue('loadgroup')):
        pytest.skip('not run by pytest-xdist with --dist loadgroup')
    assert request.node.nodeid.endswith('@test_bad_input'), request.node.nodeid

def test_a_launch_runs_again_only_after_a_native_crash():
    "conftest's `run_again_on_crash`: a segfaulted launch is cleared and run once more (with a warning); any other failure, or a second crash, fails."
    from conftest import NativeCrash, run_again_on_crash
    segv = AssertionError('torchrun ... exited 1\n  traceback : Signal 11 (SIGSEGV) received by PID 7')
    def launches(*outcomes):
        calls, cleared = [], []
        def launch():
            calls.append(1); o = outcomes[len(calls) - 1]
            if isinstance(o, Exception): raise o
            return o
        return launch, lambda: cleared.append(len(calls)), calls, cleared
    launch, clear, calls, cleared = launches(segv, 'ok')
    with pytest.warns(NativeCrash, match='SIGSEGV'): assert run_again_on_crash(launch, clear) == 'ok'
    assert calls == [1, 1] and cleared == [1]
    for outcomes in ((AssertionError('exited 1: a wrong loss'), 'ok'), (segv, segv)):
        launch, clear, calls, cleared = launches(*outcomes)
        with pytest.raises(AssertionError), warnings.catch_warnings():
            warnings.simplefilter('ignore', NativeCrash)
            run_again_on_crash(launch, clear)
        assert len(calls) == (1 if outcomes[1] == 'ok' else 2)
