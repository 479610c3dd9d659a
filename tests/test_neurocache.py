"""Integration tests of memlab_neurocache (the reference's train_neurocache.py) as real processes: the seed's two commands at
small scale (the first under `accelerate launch -m` in one process, refused with fp16 on a CPU and run with bf16; the second under
`accelerate launch` with 2 CPU processes, nf4 base, replicas and per-rank row continuity checked), exact resume, --only_evaluate
reproducing a run's final evaluation, a whole-split evaluation that does not depend on processes (`torchrun -m`) or rows, and bad
input as one line."""
import json, sys
from pathlib import Path
import pytest
from conftest import BIN, ROOT, cli_runner, free_port, run

# The seed's two commands (000_744d84209cd43193.txt), verbatim but for the output folder, the model (a tiny OPT with a BPE of
# pydocs, standing in for facebook/opt-350m and opt-1.3b) and the dataset (pydocs for long_pile:1.1.0, which is private).
SEED_1 = ("--output_dir /localscratch/proj12/nc/baseline_opt350m/ --model_name_or_path facebook/opt-350m --dataset_name long_pile:1.1.0 "
          "--sequence_length 1024 --max_eval_steps 1000 --evaluate_every_steps 1000 --checkpointing_steps 5000 --with_tracking "
          "--gradient_accumulation_steps 4 --per_device_batch_size 8")
SEED_2 = ("--output_dir /localscratch/proj12/nc/lp1.1_opt1.3b_final/ --model_name_or_path facebook/opt-1.3b --dataset_name long_pile:1.1.0 "
          "--disable_grad_checkpointing --gradient_accumulation_steps 2 --per_device_train_batch_size 2 --per_device_eval_batch_size 4 "
          "--lora_modules fc1,fc2 --cache_size 16384 --cache_dtype bfloat16 --with_tracking --nf4")
# Small scale: segments of 32 tokens, 4 updates, evaluation and checkpoints every 2, 3 evaluation batches, a 256-entry cache
# searched for the top 4, 2 rows instead of 8.
SMALL = {'--sequence_length': '32', '--max_eval_steps': '3', '--evaluate_every_steps': '2', '--checkpointing_steps': '2',
         '--max_train_steps': '4', '--cache_size': '256', '--topk': '4', '--num_warmup_steps': '1', '--logging_steps': '1',
         '--per_device_batch_size': '2', '--gradient_accumulation_steps': '2', '--progress': 'false'}

def command(seed:str, data:dict, out, *layers:dict) -> list:
    "A seed command as argv with the stand-ins and `layers` of changes applied ({'--flag': value, or None for a bare flag})."
    toks, flags, j = seed.split(), {}, 0
    while j < len(toks):
        if j + 1 < len(toks) and not toks[j + 1].startswith('--'): flags[toks[j]] = toks[j + 1]; j += 2
        else: flags[toks[j]] = None; j += 1                                  # a bare flag (--with_tracking, --nf4)
    flags.update({'--output_dir': str(out), '--model_name_or_path': str(data['model']), '--dataset_name': 'pydocs'})
    for layer in layers: flags.update(layer)
    return [t for k, v in flags.items() for t in ([k] if v is None else [k, v])]

def accelerate(*args, processes:int=1, precision:str='bf16', check=True):
    "`accelerate launch` as the seed runs it (on this CPU machine: --multi_gpu over gloo with ACCELERATE_USE_CPU for 2 processes)."
    multi = ['--multi_gpu', '--num_processes', str(processes), '--num_machines', '1', '--main_process_port', str(free_port())] if processes > 1 else []
    return run([BIN/'accelerate', 'launch', *multi, '--mixed_precision', precision, '--dynamo_backend', 'no', *args],
               check=check, ACCELERATE_USE_CPU=1)

def results(out) -> dict: return json.loads((Path(out)/'results.json').read_text())
def losses(res:dict, after:int=0) -> list: return [h['loss'] for h in res['history'] if 'loss' in h and h['step'] > after]

@pytest.fixture(scope='module')
def data(tmp_path_factory):
    "A tiny OPT (4 layers, hidden 64) whose folder holds a 512-token BPE trained on 10 pydocs documents."
    from memlab.models import save_tiny_model
    from memlab.tokenizers import train_tokenizer
    root = tmp_path_factory.mktemp('neurocache')
    tok = train_tokenizer('pydocs', vocab_size=512, take=10, show_progress=False)
    save_tiny_model('opt', root/'tiny-opt', vocab_size=len(tok)); tok.save_pretrained(root/'tiny-opt')
    return {'root': root, 'model': root/'tiny-opt'}

@pytest.fixture(scope='module')
def seed1(data):
    "Seed command 1 under `accelerate launch -m` in one process: refused with fp16 (on a CPU), then run with bf16."
    out = data['root']/'seed1'
    r = accelerate('-m', 'memlab.train_neurocache', *command(SEED_1, data, out, SMALL), precision='fp16', check=False)
    fp16 = (r.returncode, [l for l in r.stderr.splitlines() if 'error' in l.lower()], out.exists())
    accelerate('-m', 'memlab.train_neurocache', *command(SEED_1, data, out, SMALL), precision='bf16')
    return out, fp16

def test_seed_1_refuses_fp16_on_cpu_and_runs_bf16(seed1):
    out, (code, errors, existed) = seed1
    assert code != 0 and not existed and len(errors) >= 1 and 'fp16 mixed precision' in errors[0] and 'use bf16' in errors[0]
    r = results(out)
    assert (r['steps'], r['world_size'], r['mixed_precision'], r['mode']) == (4, 1, 'bf16', 'train') and r['cache_enabled']
    assert r['neurocache']['lora_modules'] is None and r['neurocache']['retrieval_map'] == '3:3'   # OPT's FFN (fc1, fc2), layer ⌊3·4/4⌋
    assert [h['step'] for h in r['history'] if 'eval_loss' in h] == [2, 4]
    assert r['eval']['tokens'] == 3 * 4 * 32 and r['test']['tokens'] > 0         # 3 batches of 4 evaluation rows of 32 targets
    assert sorted(p.name for p in (out/'checkpoints').glob('step-*')) == ['step-00000002', 'step-00000004']
    assert all((out/f).exists() for f in ('neurocache_config.json', 'neurocache_model.safetensors', 'loss.png', 'log.jsonl', 'tensorboard'))
    assert (out/'checkpoints'/'step-00000002'/'neurocache_caches_rank0.safetensors').exists()
    # the whole model for transformers alone (LoRA merged), with its tokenizer: tested in nbs/20_neurocache.ipynb
    assert all((out/f).exists() for f in ('config.json', 'model.safetensors', 'modeling_memlab_neurocache.py', 'tokenizer.json'))

RECORDER = r'''
import json, os, sys
from memlab.protocol import Callback
from memlab.train_neurocache import parse_neurocache_args, train_neurocache

class Record(Callback):
    "Record what each training micro-batch of this process holds: per row, start_of_sequence, first input and last target."
    def on_train_begin(self, trainer):
        self.rows, inner = [], trainer.loss_fn
        def loss_fn(model, batch):
            if model.training:
                self.rows.append([[bool(s), [int(t) for t in i[:8]], int(l[m.sum() - 1]), int(m.sum())] for s, i, l, m in
                                  zip(batch['start_of_sequence'], batch['input_ids'], batch['labels'], batch['attention_mask'])])
            return inner(model, batch)
        trainer.loss_fn = loss_fn
    def on_train_end(self, trainer):
        json.dump(self.rows, open(os.path.join(sys.argv[1], f"rows_rank{trainer.accelerator.process_index}.json"), 'w'))

cfg, nc = parse_neurocache_args(sys.argv[2:])
train_neurocache(cfg, nc, callbacks=[Record()])
'''

def test_seed_2_two_processes_nf4(data, tmp_path):
    "Seed command 2 under `accelerate launch` with 2 CPU processes (bf16, nf4 base, LoRA on fc1,fc2): replicas agree, rows stay continuous."
    out, script = data['root']/'seed2', tmp_path/'record.py'
    script.write_text(RECORDER)
    small = {k: v for k, v in SMALL.items() if k != '--per_device_batch_size'}
    accelerate(script, tmp_path, *command(SEED_2, data, out, small, {'--max_train_steps': '6'}), processes=2, precision='bf16')
    r = results(out)
    assert (r['steps'], r['world_size'], r['distributed_type'], r['mixed_precision']) == (6, 2, 'ddp', 'bf16') and r['replicas_agree']
    assert r['neurocache']['lora_modules'] == ['fc1', 'fc2'] and r['neurocache']['cache_dtype'] == 'bfloat16'
    assert r['base_4bit'] and r['trainable_parameters'] < r['parameters']
    assert (out/'neurocache_config.json').exists() and not (out/'config.json').exists()   # an nf4 base: memlab's files only
    starts = []
    for rank in range(2):
        steps = json.loads((tmp_path/f'rows_rank{rank}.json').read_text())
        assert len(steps) == 6 * 2                                           # 6 updates of 2 micro-batches on each process
        assert all(row[0] for row in steps[0])                               # every row starts with a document
        for prev, cur in zip(steps, steps[1:]):
            for (_, _, last, n), (sos, first, _, _) in zip(prev, cur):
                if not sos: assert n == 32 and first[0] == last              # the row continues its document: no gap, no jump
        starts.append({tuple(row[1]) for step in steps for row in step if row[0]})
    assert starts[0] and starts[1] and not starts[0] & starts[1]             # each process reads its own documents

RUNNER = cli_runner('memlab.train_neurocache', 'memlab_neurocache')

def run_many(argvs:list) -> list:
    "Run several memlab_neurocache command lines in one process (one start-up); (exit status, stderr) of each."
    r = run([sys.executable, '-c', RUNNER, json.dumps([[str(a) for a in argv] for argv in argvs])], ACCELERATE_MIXED_PRECISION='bf16')
    return json.loads(r.stdout.strip().splitlines()[-1])

def test_resume_and_only_evaluate_reproduce_the_run(data, seed1):
    "Resumed from its update-2 checkpoint, seed command 1 repeats updates 3-4 exactly; --only_evaluate of its Neurocache reproduces its final evaluation."
    out, _ = seed1
    resumed, ev, ev_big = data['root']/'seed1_resumed', data['root']/'seed1_eval', data['root']/'seed1_eval_big'
    import shutil
    shutil.copytree(out/'checkpoints'/'step-00000002', resumed/'checkpoints'/'step-00000002')
    shutil.copy(out/'log.jsonl', resumed/'log.jsonl')
    base = command(SEED_1, data, out, SMALL)
    argv = lambda o, *extra: [a if a != str(out) else str(o) for a in base] + list(extra)
    res = run_many([argv(resumed, '--resume_from_checkpoint', resumed/'checkpoints'/'step-00000002'),
                    argv(ev, '--only_evaluate', '--pretrained_neurocache', out),
                    argv(ev_big, '--only_evaluate', '--pretrained_neurocache', out, '--eval_cache_size', 1024, '--cache_type', 'LRU')])
    assert all(code == 0 for code, _ in res), res
    a, b, e, big = results(out), results(resumed), results(ev), results(ev_big)
    assert losses(b, after=2) == pytest.approx(losses(a, after=2), rel=1e-6) and len(losses(b, after=2)) == 2
    assert b['fingerprint'] == pytest.approx(a['fingerprint'], rel=1e-6)
    assert e['eval']['loss'] == pytest.approx(a['eval']['loss'], rel=1e-6) and e['test']['loss'] == pytest.approx(a['test']['loss'], rel=1e-6)
    assert e['mode'] == 'evaluate' and e['eval']['tokens'] == a['eval']['tokens']
    assert big['neurocache']['eval_cache_size'] == 1024 and big['neurocache']['cache_type'] == 'LRU'

def test_whole_split_evaluation_does_not_depend_on_processes_or_rows(data, seed1, tmp_path):
    """--only_evaluate over a whole split (--max_eval_steps 0): one process with 4 rows and `torchrun -m` with 2 processes of 3 rows
    give the same token-weighted loss over the same tokens (every document is read from its start with its own cache)."""
    from memlab.data import load_corpus
    docs = load_corpus('pydocs').split('validation')[:7]
    corpus = tmp_path/'small.jsonl'
    corpus.write_text(''.join(json.dumps({'id': d.id, 'text': d.text[:2000 + 500 * i], 'split': 'validation'}) + '\n'
                              for i, d in enumerate(docs)))
    out, _ = seed1
    common = ['--model_name_or_path', data['model'], '--dataset_name', corpus, '--only_evaluate', '--pretrained_neurocache', out,
              '--sequence_length', 32, '--max_eval_steps', 0, '--test_split', 'none', '--mixed_precision', 'no', '--progress', 'false']
    [(code, err)] = run_many([common + ['--output_dir', tmp_path/'one', '--per_device_eval_batch_size', 4]])
    assert code == 0, err
    run([BIN/'torchrun', '--nproc-per-node', 2, '--master-port', free_port(), '-m', 'memlab.train_neurocache', *common,
         '--output_dir', tmp_path/'two', '--per_device_eval_batch_size', 3])
    one, two = results(tmp_path/'one'), results(tmp_path/'two')
    assert (one['world_size'], two['world_size']) == (1, 2)
    assert one['eval']['tokens'] == two['eval']['tokens'] > 7 * 2000 // 8
    assert two['eval']['loss'] == pytest.approx(one['eval']['loss'], rel=1e-5)

def test_bad_input_is_one_line(data, tmp_path):
    "Each bad input exits with status 2 and one line on stderr, before writing anything (all cases in one process)."
    from memlab.models import save_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig
    neox = tmp_path/'neox'
    AutoModelForCausalLM.from_config(GPTNeoXConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                   intermediate_size=64)).save_pretrained(neox)
    AutoTokenizer.from_pretrained(data['model']).save_pretrained(neox)
    held = tmp_path/'held'; held.mkdir(); (held/'results.json').write_text('{}')
    bad = tmp_path/'bad'
    common = ['--model_name_or_path', data['model'], '--dataset_name', 'pydocs', '--output_dir', bad, '--sequence_length', 32,
              '--max_train_steps', 2, '--progress', 'false']
    BAD = [(['--cache_size', '0'], 'cache_size must be a positive integer'),
           (['--neighborhood_size', '3'], 'neighborhood_size must be 1 or an even number'),
           (['--retrieval_map', '9:9'], 'names a layer outside the model'),
           (['--attention_layers', '3,7'], 'attention layer 7 is outside the model'),
           (['--retrieval_map', '3:3', '--attention_layers', '2,3'], 'below the lowest retrieving layer'),
           (['--retrieval_map', '3->3'], 'does not parse'),
           (['--model_name_or_path', neox], "Neurocache supports the llama, mistral, opt, gpt2, phi, gptj families"),
           (['--dataset_name', 'long_pile:1.1.0'], 'long_pile'),
           (['--mixed_precision', 'fp16'], 'fp16 mixed precision'),
           (['--disable_neurocache', '--disable_lora'], 'leaves nothing to train'),
           (['--lora_modules', 'gate_proj,up_proj,down_proj'], 'match no FFN linear of a opt layer'),
           (['--pretrained_neurocache', tmp_path/'nothing'], 'is not a saved Neurocache'),
           (['--eval_split', 'heldout'], 'heldout'),
           (['--output_dir', held], 'already holds a run')]
    res = run_many([common + args for args, _ in BAD])
    for (code, err), (args, msg) in zip(res, BAD):
        lines = [l for l in err.splitlines() if l.strip()]
        assert code == 2 and len(lines) == 1 and msg in lines[0], (args, err)
    assert not bad.exists()
    r = run([sys.executable, '-m', 'memlab.train_neurocache', *map(str, common), '--cache_size', '0'], check=False)   # as a user runs it
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and 'error: cache_size must be a positive integer' in lines[0], r.stderr
    assert not bad.exists()
    r = run([sys.executable, '-m', 'memlab.train_neurocache', '--help'])
    assert all(f in r.stdout for f in ('--per_device_batch_size', '--eval_cache_size', '--pretrained_neurocache', '16384'))

# --- the training step's host syncs, counted on the CPU (unit test, seconds) ---

def test_training_step_asks_for_no_host_sync(monkeypatch):
    """A steady-state training update (cache filled, one row padded) of the joint and the separate design (on its GPU path)
    runs no operation of memlab's that would make a CUDA host wait: nonzero, unique, boolean-mask indexing, item,
    masked_select, a tensor from Python data (a TorchDispatchMode sees every operation, with the line that asked for it)."""
    import traceback
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    import memlab.neurocache.layer as nc_layer
    from memlab.models import tiny_model
    from memlab.neurocache import NeurocacheConfig, add_neurocache, reset_cache
    waits = {'aten.nonzero.default', 'aten._unique2.default', 'aten.unique_dim.default', 'aten.unique_consecutive.default',
             'aten._local_scalar_dense.default', 'aten.masked_select.default', 'aten.is_nonzero.default',
             'aten.repeat_interleave.Tensor', 'aten.lift_fresh.default'}
    class HostSyncs(TorchDispatchMode):
        def __init__(self): super().__init__(); self.found = []
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            masked = name.startswith(('aten.index.', 'aten.index_put')) and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_leaves(args[1]))
            if name in waits or masked:
                site = next((f for f in reversed(traceback.extract_stack()[:-1]) if '/torch/' not in f.filename), None)
                if site is not None and '/memlab/' in site.filename: self.found.append(f"{name} at {site.filename}:{site.lineno}")
            return func(*args, **(kwargs or {}))
    g = torch.Generator().manual_seed(0)
    segs = [torch.randint(2, 256, (2, 8), generator=g) for _ in range(2)]
    mask = torch.ones(2, 8, dtype=torch.long); mask[1, :3] = 0
    monkeypatch.setattr(nc_layer, 'DEDUP_DEVICES', ())                      # the GPU's path, here on the CPU
    for design in ('joint', 'separate'):
        model = add_neurocache(tiny_model('llama'), NeurocacheConfig(cache_size=64, compression_factor=4, topk=4,
                                                                     cache_attention=design, lora_r=4)).train()
        reset_cache(model)
        for s, m in ((segs[0], None), (segs[1], mask)):
            with HostSyncs() as hs: model(input_ids=s, attention_mask=m, labels=s).loss.backward()
        assert hs.found == [], (design, hs.found)
