"""Bad input, tried the way users meet it, against the command lines it applies to: each is one line on stderr, a non-zero exit,
no traceback, and nothing written or overwritten."""
import json, sys
from pathlib import Path
from conftest import BAD_INPUT, BIN, run
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

@pytest.mark.parametrize('prog', ['memlab_train', 'memlab_neurocache', 'memlab_relora', 'memlab_distill', 'memlab_mixer', 'memlab_bpt',
                                  'memlab_pretokenize', 'memlab_train_tokenizer'])
def test_environment_errors_are_one_line(world, tmp_path, prog):
    "A valid small run succeeds; then each bad environment is one line, exit != 0, no traceback, nothing created or changed."
    module, out_flag, config_flag, model_flag, base = commands(world)[prog]
    kv = (lambda k, v: [f'{k}={v}']) if prog == 'memlab_bpt' else (lambda k, v: [k, v])
    def with_(**over):
        argv = list(base)
        for k, v in over.items():
            if prog != 'memlab_bpt' and k in argv: argv[argv.index(k) + 1] = v
            else: argv = [a for a in argv if not str(a).startswith(f'{k}=')] + kv(k, v)
        return [str(a) for a in argv]
    cases = {'valid run': (with_(**{out_flag: tmp_path/'ok'}), None),
             'output under a regular file': (with_(**{out_flag: world/'a_file'/'sub'}), 'a_file'),
             'output is a file': (with_(**{out_flag: world/'a_file'}), 'a_file'),
             'output cannot be written': (with_(**{out_flag: '/sys/memlab_out'}), '/sys/memlab_out')}
    if config_flag: cases['config file is a folder'] = (with_(**{out_flag: tmp_path/'c', config_flag: world/'a_folder'}), 'a_folder')
    if model_flag: cases['weights cut short'] = (with_(**{out_flag: tmp_path/'w', model_flag: world/'cut_model'}), None)
    r = run([sys.executable, '-c', cli_runner(module, prog), json.dumps([a for a, _ in cases.values()])], timeout=900)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for (name, (argv, where)), (code, err) in zip(cases.items(), res):
        if name == 'valid run': assert code == 0, (prog, err[-3000:]); continue
        BAD_INPUT['tried'] += 1
        lines = [l for l in err.splitlines() if l.strip()]
        assert code != 0 and len(lines) == 1 and 'Traceback' not in err, (prog, name, code, err[-3000:])
        if where: assert where in lines[0], (prog, name, lines[0])
        BAD_INPUT['clean'] += 1
    assert (world/'a_file').read_text() == 'keep me\n' and not Path('/sys/memlab_out').exists()
    assert not (tmp_path/'c').exists() and not (tmp_path/'w').exists()

def test_damaged_or_mismatched_checkpoints_are_one_line(world, tmp_path):
    "memlab_train resumed into another model, from a full fine-tune with LoRA on, and from damaged checkpoint files: one line each."
    module, out_flag, _, _, base = commands(world)['memlab_train']
    out = tmp_path/'run'
    argv = lambda *extra: [str(a) for a in [*base, '--output_dir', out, '--lora_r', 0, *extra]]
    r = run([sys.executable, '-c', cli_runner(module, 'memlab_train'), json.dumps([argv('--max_steps', 2, '--save_every', 1)])])
    assert json.loads(r.stdout.strip().splitlines()[-1])[0][0] == 0
    ck = out/'checkpoints'/'step-00000002'
    other = tmp_path/'other'
    from memlab.models import tiny_model
    tiny_model('llama', vocab_size=512, num_layers=2, seed=1).save_pretrained(other)
    for f in ('tokenizer.json', 'tokenizer_config.json'): (other/f).write_bytes((world/'tok'/f).read_bytes())
    resume = ['--max_steps', 3, '--resume_from', 'latest']
    cases = [(argv(*resume, '--model', other), 'model state does not match'),
             (argv(*resume, '--lora_r', 4), 'does not match'),
             ('trainer_state.json', 'is damaged (not valid JSON'), ('model.safetensors', 'is damaged or cut short'),
             ('optimizer.safetensors', 'is damaged or cut short')]
    for what, msg in cases:
        saved = {p.name: p.read_bytes() for p in ck.iterdir()}
        if isinstance(what, str):                                # damage one file of the checkpoint
            (ck/what).write_bytes(b'{bad' if what.endswith('.json') else saved[what][:len(saved[what]) // 3])
            what = argv(*resume)
        r = run([sys.executable, '-c', cli_runner(module, 'memlab_train'), json.dumps([what])])
        code, err = json.loads(r.stdout.strip().splitlines()[-1])[0]
        BAD_INPUT['tried'] += 1
        lines = [l for l in err.splitlines() if l.strip()]
        assert code != 0 and len(lines) == 1 and msg in lines[0] and 'Traceback' not in err, (what, err[-2000:])
        BAD_INPUT['clean'] += 1
        for name, b in saved.items(): (ck/name).write_bytes(b)   # restore for the next case
        assert sorted(p.name for p in (out/'checkpoints').glob('step-*')) == ['step-00000001', 'step-00000002']
