"""Integration tests of memlab_relora (the reference's torchrun_main.py) as real processes: each of the seed's five commands at
small scale with torchrun on 2 CPU processes (and `accelerate launch -m`), save->resume across merges, DDP/ZeRO versus FSDP,
the in-run warm-start switch under DDP with a resume past it, and bad input as one line."""
import json, subprocess, sys
from pathlib import Path
import pytest
from conftest import BIN, ROOT, cli_runner, env, free_port, run, torchrun

# The seed's five commands (002_b342b86074d2232c.txt), verbatim but for the data flags every command here needs (there is no
# network: the data is pretokenized from the embedded pydocs corpus under the seed's directory name).
SEED = [
    "--dataset_path preprocessed_data/wikitext_wikitext-2-v1_gpt2_512 --tokenizer gpt2 --model_config configs/llama_250m.json --batch_size 24 --total_batch_size 96 --lr 5e-4 --max_length 512 "
    "--eval_every 2 --save_every 10 --num_training_steps 20 --distributed_type ddp --tags debug,fsdp_debug",
    "--model_config configs/llama_250m.json --batch_size 24 --total_batch_size 96 --lr 5e-4 --max_length 512 --eval_every 2 "
    "--save_every 10 --num_training_steps 20000 --distributed_type fsdp --tags debug,fsdp_debug",
    "--model_config configs/llama_250m.json --batch_size 24 --total_batch_size 96 --lr 5e-4 --max_length 512 --eval_every 2 "
    "--save_every 10 --num_training_steps 20000 --distributed_type fsdp --tags debug,fsdp_debug",
    "--model_config configs/llama_250m.json --batch_size 24 --total_batch_size 96 --lr 1e-3 --max_length 512 --use_peft "
    "--relora 10 --cycle_length 10 --restart_warmup_steps 5 --scheduler cosine_restarts --warmup_steps 5 "
    "--reset_optimizer_on_relora False --optimizer_magnitude_pruning 0.9 --num_training_steps 20000 --save_every 5000 "
    "--eval_every 5000 --continue_from checkpoints/llama_250m-2023-06-09-11-29-56/model_5000 --distributed_type fsdp "
    "--tags debug,fsdp_debug",
]
SEED.append(SEED[3])   # the fifth command repeats the fourth

# Small scale: a Llama of the same family resolved by stem (llama_9m: hidden 128, 4 layers) with the tokenizer's 512 tokens,
# sequence length 512 kept, 1 row per process and micro-batch, 2 micro-batches per update on 2 processes, fewer updates and a
# ReLoRA cycle of 4 instead of 10; evaluation capped at 2,048 tokens (the reference's 10M is a flag here).
SMALL = {'--model_config': 'configs/llama_9m.json', '--batch_size': '1', '--total_batch_size': '4', '--max_eval_tokens': '2048',
         '--report_to': 'none'}
RELORA_SMALL = {'--relora': '4', '--cycle_length': '4', '--restart_warmup_steps': '2', '--warmup_steps': '2', '--save_every': '6',
                '--eval_every': '11', '--lora_r': '32'}

def command(i:int, data:dict, save_dir, *layers:dict, **changes) -> list:
    "Seed command `i` (1-based) as argv, with the data flags, SMALL and `changes` ({'--flag': value or None to drop})."
    changes = {k: v for d in (*layers, changes) for k, v in d.items()}
    toks = SEED[i - 1].split()
    flags, order = {}, []
    j = 0
    while j < len(toks):
        k = toks[j]
        if j + 1 < len(toks) and not toks[j + 1].startswith('--'): flags[k] = toks[j + 1]; j += 2
        else: flags[k] = None; j += 1                     # a bare flag (--use_peft)
        order.append(k)
    upd = {'--dataset_path': str(data['path']), '--tokenizer': str(data['tokenizer']), '--save_dir': str(save_dir), **SMALL, **changes}
    for k, v in upd.items():
        if k not in flags: order.append(k)
        flags[k] = v
    out = []
    for k in order:
        if k in upd and upd[k] is None and k in changes: continue
        out += [k] + ([flags[k]] if flags[k] is not None else [])
    return out

def results(save_dir) -> dict: return json.loads((Path(save_dir)/'results.json').read_text())
def losses(res:dict, after:int=0) -> list: return [h['loss'] for h in res['history'] if 'loss' in h and h['step'] > after]

@pytest.fixture(scope='module')
def data(tmp_path_factory):
    "A 512-token BPE trained on pydocs and pydocs pretokenized at length 512 by memlab_pretokenize, under the seed's folder name."
    from memlab.cli import run_cli
    from memlab.tokenizers import pretokenize_main, train_tokenizer
    root = tmp_path_factory.mktemp('relora')
    train_tokenizer('pydocs', vocab_size=512, save_dir=root/'tok', take=40, show_progress=False)
    code, out, err = run_cli(pretokenize_main, ['--tokenizer', root/'tok', '--dataset', 'pydocs', '--sequence_length', 512,
                                                '--take', 30, '--save_dir', root/'preprocessed_data',
                                                '--output_name', 'wikitext_wikitext-2-v1_gpt2_512'], prog='memlab_pretokenize')
    assert code == 0, err
    return {'root': root, 'tokenizer': root/'tok', 'path': root/'preprocessed_data'/'wikitext_wikitext-2-v1_gpt2_512'}

@pytest.fixture(scope='module')
def warm(data):
    "Seed command 1 (DDP, full-rank, 20 updates, evaluation every 2, checkpoints at 10 and 20): the warm start of commands 4 and 5."
    out = data['root']/'cmd1'
    torchrun('-m', 'memlab.train_relora', *command(1, data, out))
    return out

def test_seed_1_ddp_full_rank(data, warm):
    r = results(warm)
    assert (r['steps'], r['world_size'], r['distributed_type'], r['merges']) == (20, 2, 'ddp', 0)
    assert r['replicas_agree'] and r['trainable_parameters'] == r['parameters']
    assert 20 * 4 * 511 - 512 < r['tokens_seen'] <= 20 * 4 * 511            # 4 rows of 511 targets per update (one may be the short last row)
    assert [h['step'] for h in r['history'] if 'eval_loss' in h] == list(range(2, 21, 2))
    assert sorted(p.name for p in (warm/'checkpoints').glob('step-*')) == ['step-00000010', 'step-00000020']
    cfg = json.loads((warm/'run_config.json').read_text())
    assert cfg['relora']['tags'] == ['debug', 'fsdp_debug'] and cfg['gradient_accumulation'] == 2
    assert (warm/'model'/'config.json').exists()                             # the exported plain model

def test_seed_2_fsdp_and_3_accelerate_launch_as_written(data, tmp_path):
    """Seed commands 2 (torchrun, FSDP) and 3 (the same flags under `accelerate launch -m`) as written: no --dataset_path (the
    original streams C4), so both train on pydocs, pretokenized once with SmolLM2's tokenizer (one line says so), and the two
    launchers train the same run. A fresh memlab home, but for the converted SmolLM2 (what `.ci/setup` fetched: its own conversion
    is 04_models')."""
    from memlab.models import fetch_smollm2
    home = tmp_path/'home'
    (home/'models').mkdir(parents=True)
    (home/'models'/'SmolLM2-135M').symlink_to(fetch_smollm2(quiet=True), target_is_directory=True)
    small = {'--dataset_path': None, '--tokenizer': None, '--num_training_steps': '3', '--max_length': '64'}
    out2, out3 = tmp_path/'cmd2', tmp_path/'cmd3'
    r2 = torchrun('-m', 'memlab.train_relora', *command(2, data, out2, **small), MEMLAB_HOME=home,
                  ACCELERATE_MIXED_PRECISION='no')                                  # fp32, as command 3's launcher
    r3 = run([BIN/'accelerate', 'launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1', '--mixed_precision', 'no',
              '--dynamo_backend', 'no', '--main_process_port', free_port(), '-m', 'memlab.train_relora',
              *command(3, data, out3, **small)], ACCELERATE_USE_CPU=1, MEMLAB_HOME=home)
    for r in (r2, r3): assert r.stdout.count('no --dataset_path: training on the embedded pydocs corpus') == 1, r.stdout[-2000:]
    assert (home/'pretokenized'/'pydocs_smollm2-135m_64'/'args.json').exists()
    res2, res3 = results(out2), results(out3)
    assert (res2['distributed_type'], res2['world_size'], res3['world_size'], res2['steps']) == ('fsdp', 2, 2, 3)
    assert res2['replicas_agree'] and res3['replicas_agree']
    assert losses(res3) == pytest.approx(losses(res2), rel=1e-6) and len(losses(res2)) == 3   # the other launcher, the same run
    assert res3['fingerprint'] == pytest.approx(res2['fingerprint'], rel=1e-6)

def test_original_format_checkpoint_continues_from_its_update_step(data, warm, tmp_path):
    "A warm start in the original's format (a model folder + training_state.json with update_step) continues from that update."
    import shutil
    orig = tmp_path/'model_10'; shutil.copytree(warm/'model', orig)
    (orig/'training_state.json').write_text(json.dumps({'global_step': 20, 'update_step': 10, 'tokens_seen': 20440}))
    out = tmp_path/'cmd4'
    torchrun('-m', 'memlab.train_relora', *command(4, data, out, RELORA_SMALL, {
        '--continue_from': str(orig), '--num_training_steps': '14', '--dtype': 'float32', '--save_every': '0', '--eval_every': '0'}))
    r = results(out)
    assert r['history'][0]['step'] == 11 and r['steps'] == 14 and r['tokens_seen'] > 20440

@pytest.fixture(scope='module')
def relora_fsdp(data, warm):
    "Seed command 4: FSDP ReLoRA from command 1's checkpoint at update 10, to update 22 (merges after 15 and 19), float32."
    out = data['root']/'cmd4'
    torchrun('-m', 'memlab.train_relora', *command(4, data, out, RELORA_SMALL, {
        '--continue_from': str(warm/'checkpoints'/'step-00000010'), '--num_training_steps': '22', '--dtype': 'float32'}))
    return out

def test_seed_4_fsdp_relora_from_warm_start(data, warm, relora_fsdp):
    r = results(relora_fsdp)
    assert (r['steps'], r['merges'], r['distributed_type']) == (22, 2, 'fsdp') and r['replicas_agree']
    merged = [h for h in r['history'] if 'relora/merge_step' in h]
    assert [h['relora/merge_step'] for h in merged] == [15, 19] and all(h['relora/merge_lr'] == 0 for h in merged)
    assert all(0.89 <= h['relora/reset_fraction_zeroed'] <= 0.9 for h in merged)      # the seed's magnitude pruning, as ReLoRA's
    assert r['history'][0]['step'] == 11 and r['trainable_parameters'] < r['equivalent_parameters']
    w = read_state(warm/'checkpoints'/'step-00000010'/'process_0')['data']
    c = read_state(relora_fsdp/'checkpoints'/'step-00000012'/'process_0')['data']
    assert c['position'] - w['position'] == 2 * 4                           # the data read on from the warm start's position

def test_seed_5_resumes_command_4_exactly(data, warm, relora_fsdp):
    "Command 5 (= command 4) resumed from command 4's checkpoint at update 18 (after a merge, mid-cycle): the same losses."
    out = data['root']/'cmd5'
    torchrun('-m', 'memlab.train_relora', *command(5, data, out, RELORA_SMALL, {
        '--continue_from': str(warm/'checkpoints'/'step-00000010'), '--num_training_steps': '22', '--dtype': 'float32',
        '--resume_from': str(relora_fsdp/'checkpoints'/'step-00000018')}))
    r4, r5 = results(relora_fsdp), results(out)
    assert losses(r5, after=18) == pytest.approx(losses(r4, after=18), rel=1e-6) and len(losses(r5, after=18)) == 4
    assert r5['fingerprint'] == pytest.approx(r4['fingerprint'], rel=1e-6) and r5['merges'] == 2

def test_ddp_zero_agrees_with_fsdp(data, warm, relora_fsdp):
    "Command 4 under DDP with ZeroRedundancyOptimizer: the same updates, merges and magnitude resets as under FSDP."
    out = data['root']/'cmd4_ddp_zero'
    torchrun('-m', 'memlab.train_relora', *command(4, data, out, RELORA_SMALL, {
        '--continue_from': str(warm/'checkpoints'/'step-00000010'), '--num_training_steps': '22', '--dtype': 'float32',
        '--distributed_type': 'ddp', '--optimizer': 'adam_zero', '--save_every': '11'}))
    fsdp, ddp = results(relora_fsdp), results(out)
    assert ddp['distributed_type'] == 'ddp' and ddp['replicas_agree'] and ddp['merges'] == 2
    resets = lambda r: [(h['relora/merge_step'], h['relora/reset_fraction_zeroed']) for h in r['history'] if 'relora/merge_step' in h]
    assert resets(ddp) == resets(fsdp)                         # the same merges, zeroing the same number of entries
    # the same updates to 1e-4 until the last merge; after it, 1e-3: the seed's (ReLoRA's own) pruning leaves entries with a first
    # moment and no second, whose next Adam steps magnify the two runs' rounding differences (DDP's vs FSDP's summation order)
    last = resets(fsdp)[-1][0]
    assert losses(ddp)[:last - 10] == pytest.approx(losses(fsdp)[:last - 10], rel=1e-4)   # updates 11 .. last
    assert losses(ddp, after=last) == pytest.approx(losses(fsdp, after=last), rel=1e-3)
    assert ddp['fingerprint'] == pytest.approx(fsdp['fingerprint'], rel=5e-3)    # the weights after those steps (measured: 1.6e-3)

def read_state(stem):
    from memlab.checkpoints import read_state
    return read_state(stem)

SWITCH = r'''
import json, sys, torch
from memlab.loaders import TokenBatches
from memlab.models import tiny_model
from memlab.relora import (ReLoRACallback, ReLoRAConfig, WarmStartCallback, get_cosine_schedule, get_cosine_schedule_with_restarts,
                           relora_layers)
from memlab.distributed import fingerprint, make_accelerator
from memlab.train_config import TrainConfig
from memlab.trainer import Trainer
out = sys.argv[1]
make_accelerator()          # the process group first: TokenBatches shards the rows by it
def run(name, resume_from=None):
    torch.manual_seed(0)
    model = tiny_model('llama')
    rows = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(0))
    cbs = [WarmStartCallback(4, ReLoRAConfig(r=8), scheduler_fn=lambda o: get_cosine_schedule_with_restarts(o, 8, 1, 4, 1)),
           ReLoRACallback(4, 'random', 0.5, start_step=4)]
    cfg = TrainConfig(output_dir=f"{out}/{name}", max_steps=12, per_device_batch_size=2, lr=3e-3, log_every=1, save_every=6,
                      keep_checkpoints=5, report_to='none', progress=False, distributed_type='ddp', resume_from=resume_from)
    t = Trainer(model, cfg, TokenBatches({'input_ids': rows}, 2, seed=0), callbacks=cbs, scheduler=lambda o: get_cosine_schedule(o, 4, 1))
    t.fit()
    return t
full = run('full')
resumed = run('resumed', f"{out}/full/checkpoints/step-00000006")
rank = torch.distributed.get_rank()
json.dump({'losses': [h['loss'] for h in full.history if 'loss' in h], 'resumed': [h['loss'] for h in resumed.history if 'loss' in h],
           'merges': [h['relora/merge_step'] for h in full.history if 'relora/merge_step' in h],
           'fp': fingerprint(full.unwrapped_model), 'fp_resumed': fingerprint(resumed.unwrapped_model),
           'ddp': type(full.model).__name__, 'relora_layers': len(relora_layers(full.unwrapped_model))},
          open(f"{out}/result_rank{rank}.json", 'w'))
'''

def test_in_run_switch_under_ddp_and_resume_past_it(tmp_path):
    "WarmStartCallback under DDP: full-rank for 4 updates, then ReLoRA (model re-wrapped), merge after 9; resumed from update 6."
    script = tmp_path/'switch.py'; script.write_text(SWITCH)
    torchrun(script, tmp_path)
    r = [json.loads((tmp_path/f'result_rank{i}.json').read_text()) for i in range(2)]
    assert r[0]['ddp'] == 'DistributedDataParallel' and r[0]['relora_layers'] == 28 and r[0]['merges'] == [9]
    assert r[0]['fp'] == r[1]['fp']                                          # replicas identical after the switch and the merge
    assert r[0]['resumed'][6:] == pytest.approx(r[0]['losses'][6:], rel=1e-6)
    assert r[0]['fp_resumed'] == pytest.approx(r[0]['fp'], rel=1e-6)

BAD = [
    (['--relora', '10'], '--relora needs --use_peft'),
    (['--use_peft', '--relora', '5', '--scheduler', 'cosine_restarts', '--restart_warmup_steps', '2', '--warmup_steps', '2',
      '--num_training_steps', '12'], 'is not a multiple of --cycle_length 5'),
    (['--use_peft', '--relora', '5', '--optimizer_magnitude_pruning', '0.9'], 'choose one optimizer reset'),
    (['--max_length', '256'], '--max_length 256 differs from the length 512'),
    (['--continue_from', '.'], 'is not a checkpoint'),
]

BAD_RUNNER = cli_runner('memlab.train_relora', 'memlab_relora')

PLANT = r'''
import io, sys, torch
class Planted:
    def __reduce__(self): return (io.open, (sys.argv[2], 'w'))     # unpickling it would create the file sys.argv[2]
torch.save({'rng': None, 'data': Planted()}, sys.argv[1])
'''

def test_planted_pickle_in_a_warm_start_is_refused(data, warm, tmp_path):
    "A warm start of someone else's run runs none of its pickles: a planted process_0.pt is one line, exit 2."
    import shutil
    planted, marker = tmp_path/'planted', tmp_path/'ran'
    shutil.copytree(warm/'checkpoints'/'step-00000010', planted)
    for f in ('process_0.json', 'process_0.safetensors'): (planted/f).unlink()
    run([sys.executable, '-c', PLANT, planted/'process_0.pt', marker])
    start = lambda: run([sys.executable, '-m', 'memlab.train_relora', '--dataset_path', data['path'],
                         '--tokenizer', data['tokenizer'], '--model_config', 'configs/llama_9m.json', '--batch_size', '1',
                         '--dtype', 'float32', '--num_training_steps', '12', '--continue_from', planted,
                         '--save_dir', tmp_path/'run', '--report_to', 'none'], check=False)
    # The checkpoint's manifest refuses the swapped files first; with a manifest written to match, the pickle refusal.
    from memlab.checkpoints import write_manifest
    for said in (f"{planted/'process_0.json'} is missing", f"refusing to load {planted/'process_0.pt'}"):
        r = start()
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        assert r.returncode == 2 and len(lines) == 1 and said in lines[0], r.stderr
        assert not marker.exists() and not (tmp_path/'run').exists()
        write_manifest(planted, json.loads((planted/'trainer_state.json').read_text())['step'])

def test_bad_input_is_one_line(data, tmp_path):
    "Each bad input exits with status 2 and exactly one line on stderr, before writing anything (all cases in one process)."
    common = ['--dataset_path', str(data['path']), '--model_config', 'configs/llama_9m.json', '--batch_size', '1', '--max_length', '512',
              '--dtype', 'float32', '--save_dir', str(tmp_path/'bad')]
    r = run([sys.executable, '-c', BAD_RUNNER, json.dumps([common + args for args, _ in BAD])])
    for (code, err), (args, msg) in zip(json.loads(r.stdout.strip().splitlines()[-1]), BAD):
        lines = [l for l in err.splitlines() if l.strip()]
        assert code == 2 and len(lines) == 1 and msg in lines[0], (args, err)
    # and the installed entry point itself, as a user runs it
    r = run([sys.executable, '-m', 'memlab.train_relora', *common, *BAD[3][0]], check=False)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and 'error: --max_length 256 differs' in lines[0], r.stderr
    assert not (tmp_path/'bad').exists()
