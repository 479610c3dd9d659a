"""Integration tests of memlab's training loop as real processes: DDP and FSDP on 2 CPU processes, accelerate launch,
2 nodes over loopback, a run killed with SIGKILL (mid-training and mid-save) and resumed, and the no-process-group guard."""
import json, signal, sys
from conftest import BIN, ROOT, free_port, results, run, slow, torchrun
import pytest

SCRIPT = ROOT/'tests'/'dist_train.py'

# Reference runs, each made once and shared by the tests that compare with it (xdist_group: on one pytest worker)
@pytest.fixture(scope='module')
def launched(tmp_path_factory):
    """Uninterrupted 2-process runs of 8 updates under torchrun: DDP, and FSDP with its final checkpoint loaded back in the
    process that saved it; both count which micro-batch each gradient reduction happens in."""
    d = tmp_path_factory.mktemp('launched')
    torchrun(SCRIPT, d/'ddp', '--dist', 'ddp', '--count_comms')
    torchrun(SCRIPT, d/'fsdp', '--dist', 'fsdp', '--count_comms', '--reload')
    return {k: results(d/k) for k in ('ddp', 'fsdp')}

@pytest.fixture(scope='module')
def one_process(tmp_path_factory) -> dict:
    "The uninterrupted one-process run of 8 updates (a checkpoint every 2) that the stopped and resumed runs must equal."
    out = tmp_path_factory.mktemp('one')/'full'
    run([sys.executable, SCRIPT, out, '--steps', '8', '--save_every', '2'])
    return results(out)[0]

@pytest.mark.xdist_group('training_launched')
def test_ddp_and_fsdp_agree_and_learn(launched):
    ddp, fsdp = launched['ddp'], launched['fsdp']
    assert len(ddp) == len(fsdp) == 2 and ddp[0]['world'] == 2 and fsdp[0]['dist'] == 'fsdp'
    assert ddp[0]['fingerprint'] == ddp[1]['fingerprint']            # DDP replicas agree exactly
    assert fsdp[0]['fingerprint'] == fsdp[1]['fingerprint']          # the gathered FSDP model is the same on both ranks
    assert ddp[0]['fingerprint'] == pytest.approx(fsdp[0]['fingerprint'], rel=1e-5, abs=1e-4)  # and FSDP trains what DDP trains
    assert ddp[0]['losses'] == pytest.approx(fsdp[0]['losses'], rel=1e-5)
    assert ddp[0]['losses'][-1] < ddp[0]['losses'][0] - 0.5          # the loss falls
    assert fsdp[0]['reloaded_fingerprint'] == fsdp[0]['fingerprint']  # the sharded checkpoint loads back in the process that saved it
    # gradient accumulation (2 micro-batches per update): gradients are reduced only in the last micro-batch of each update (no_sync)
    for r in (ddp[0], fsdp[0]):
        assert r['reductions_in_micro_batch'] and set(r['reductions_in_micro_batch']) == {1}, (r['dist'], r['reductions_in_micro_batch'][:10])

@slow   # accelerate launch of 2 processes also runs in test_bpt (autoresume), test_distill (on-policy) and test_relora (seed 3)
def test_accelerate_launch_two_processes(tmp_path):
    run([BIN/'accelerate', 'launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1', '--mixed_precision', 'no',
         '--dynamo_backend', 'no', '--main_process_port', free_port(), SCRIPT, tmp_path/'acc', '--steps', '3'], ACCELERATE_USE_CPU=1)
    r = results(tmp_path/'acc')
    assert len(r) == 2 and r[0]['world'] == 2 and r[0]['fingerprint'] == r[1]['fingerprint']

def test_two_nodes_over_loopback(tmp_path):
    "Multi-node launch, simulated as 2 nodes x 1 process on 127.0.0.1 (the same torchrun flags as on a real cluster)."
    import subprocess
    from conftest import env
    port = free_port()
    procs = [subprocess.Popen([str(BIN/'torchrun'), '--nnodes', '2', '--nproc-per-node', '1', '--node-rank', str(i),
                               '--master-addr', '127.0.0.1', '--master-port', str(port), str(SCRIPT), str(tmp_path/'nodes'), '--steps', '3'],
                              cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    r = results(tmp_path/'nodes')
    assert len(r) == 2 and r[0]['world'] == 2 and r[0]['fingerprint'] == r[1]['fingerprint']

def test_no_process_group_is_refused(tmp_path):
    "Under torchrun with ACCELERATE_USE_CPU explicitly off, accelerate forms no group: memlab refuses instead of training 2 copies."
    r = torchrun(SCRIPT, tmp_path/'nogroup', check=False, ACCELERATE_USE_CPU=0)
    assert r.returncode != 0
    assert 'launched as 2 processes but accelerate formed a group of 1' in r.stderr
    assert not list((tmp_path/'nogroup').glob('checkpoints/*'))

@pytest.mark.xdist_group('training_one')
@pytest.mark.parametrize('how', ['--die_at_step', '--die_in_save'])
def test_sigkill_then_resume_gives_the_uninterrupted_losses(one_process, tmp_path, how):
    killed = run([sys.executable, SCRIPT, tmp_path/'killed', '--steps', '8', '--save_every', '2', how, '5' if how == '--die_at_step' else '6'],
                 check=False)
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path/'killed'/'result_rank0.json').exists()
    ckpts = sorted(p.name for p in (tmp_path/'killed'/'checkpoints').iterdir())
    if how == '--die_in_save': assert '.step-00000006.tmp' in ckpts and 'step-00000006' not in ckpts  # half-written, never used
    run([sys.executable, SCRIPT, tmp_path/'killed', '--steps', '8', '--save_every', '2', '--resume'])
    full, resumed = one_process, results(tmp_path/'killed')[0]
    assert resumed['losses'] == pytest.approx(full['losses'], rel=1e-6)
    assert resumed['fingerprint'] == pytest.approx(full['fingerprint'], rel=1e-6)

@pytest.mark.xdist_group('training_one')
@pytest.mark.parametrize('sig', ['SIGTERM', pytest.param('SIGINT', marks=slow)])   # one handler; SIGINT in the slow tier
def test_signal_saves_a_checkpoint_and_resumes_exactly(one_process, tmp_path, sig):
    "SIGTERM (a scheduler) or Ctrl-C after update 3: the update finishes, a checkpoint is saved, one line; resuming gives the full run."
    r = run([sys.executable, SCRIPT, tmp_path/'stopped', '--steps', '8', '--signal_at_step', '3', '--signal', sig], check=False)
    assert r.returncode == 128 + getattr(signal, sig), (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f'stopped by {sig} after update 3' in lines[0] and 'step-00000003' in lines[0], r.stderr[-2000:]
    assert [p.name for p in (tmp_path/'stopped'/'checkpoints').glob('step-*')] == ['step-00000003']
    run([sys.executable, SCRIPT, tmp_path/'stopped', '--steps', '8', '--resume'])
    full, resumed = one_process, results(tmp_path/'stopped')[0]
    assert resumed['losses'] == pytest.approx(full['losses'], rel=1e-6) and len(resumed['losses']) == 8
    assert resumed['fingerprint'] == pytest.approx(full['fingerprint'], rel=1e-6)

@pytest.mark.xdist_group('training_launched')
def test_signal_to_one_of_two_processes_stops_both_at_the_same_update(launched, tmp_path):
    "Under torchrun only rank 0 gets SIGTERM: both ranks agree to stop after update 3 and write one checkpoint together."
    r = torchrun(SCRIPT, tmp_path/'stopped', '--steps', '8', '--signal_at_step', '3', check=False)
    assert r.returncode != 0 and 'stopped by SIGTERM after update 3' in r.stderr, r.stderr[-3000:]
    assert [p.name for p in (tmp_path/'stopped'/'checkpoints').glob('step-*')] == ['step-00000003']
    torchrun(SCRIPT, tmp_path/'stopped', '--steps', '8', '--resume')
    full, resumed = launched['ddp'], results(tmp_path/'stopped')
    assert resumed[0]['losses'] == pytest.approx(full[0]['losses'], rel=1e-6)
    assert resumed[1]['fingerprint'] == pytest.approx(full[1]['fingerprint'], rel=1e-6)

@pytest.mark.xdist_group('training_launched')
def test_fsdp_kill_and_resume(launched, tmp_path):
    r = torchrun(SCRIPT, tmp_path/'killed', '--dist', 'fsdp', '--steps', '8', '--save_every', '2', '--die_at_step', '5', check=False)
    assert r.returncode != 0
    torchrun(SCRIPT, tmp_path/'killed', '--dist', 'fsdp', '--steps', '8', '--save_every', '2', '--resume')
    full, resumed = launched['fsdp'], results(tmp_path/'killed')
    assert resumed[0]['losses'] == pytest.approx(full[0]['losses'], rel=1e-6)
    assert resumed[0]['fingerprint'] == pytest.approx(full[0]['fingerprint'], rel=1e-6)

PLANT = r'''
import io, sys, torch
class Planted:
    def __reduce__(self): return (io.open, (sys.argv[2], 'w'))     # unpickling it would create the file sys.argv[2]
torch.save({'rng': Planted(), 'data': None}, sys.argv[1])
'''

def test_planted_pickle_in_a_checkpoint_is_refused(tmp_path):
    """Resuming from a checkpoint whose process state was swapped for a planted pickle (an older memlab's process_0.pt): one line,
    exit 2, no code run. The manifest refuses it before any file of the checkpoint is read."""
    run([sys.executable, SCRIPT, tmp_path/'run', '--steps', '4', '--save_every', '2'])
    ck, marker = tmp_path/'run'/'checkpoints'/'step-00000004', tmp_path/'ran'
    assert sorted(p.name for p in ck.iterdir() if not p.name.startswith('model')) == [
        'manifest.json', 'optimizer.json', 'optimizer.safetensors', 'process_0.json', 'process_0.safetensors',
        'scheduler_callbacks.json', 'trainer_state.json']             # no pickle written; the manifest last
    for f in ('process_0.json', 'process_0.safetensors'): (ck/f).unlink()
    run([sys.executable, '-c', PLANT, ck/'process_0.pt', marker])
    r = run([sys.executable, SCRIPT, tmp_path/'run', '--steps', '6', '--save_every', '2', '--resume'], check=False)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and f"{ck/'process_0.json'} is missing" in lines[0], r.stderr
    assert not marker.exists()

def test_a_stop_between_logs_keeps_the_logging_window(tmp_path):
    """--log_every 3 and a SIGTERM after update 4, in the middle of a logging window: the checkpoint carries the window's updates, so
    the resumed run logs at update 6 the mean over updates 4 to 6, and every logged loss equals the uninterrupted run's."""
    run([sys.executable, SCRIPT, tmp_path/'full', '--steps', '8', '--log_every', '3'])
    r = run([sys.executable, SCRIPT, tmp_path/'stopped', '--steps', '8', '--log_every', '3', '--signal_at_step', '4'], check=False)
    assert r.returncode == 128 + signal.SIGTERM and 'stopped by SIGTERM after update 4' in r.stderr, r.stderr[-2000:]
    run([sys.executable, SCRIPT, tmp_path/'stopped', '--steps', '8', '--log_every', '3', '--resume'])
    full, resumed = results(tmp_path/'full')[0], results(tmp_path/'stopped')[0]
    assert full['logged_at'] == resumed['logged_at'] == [3, 6, 8]
    assert resumed['losses'] == full['losses'] and resumed['fingerprint'] == full['fingerprint']

WRAPPED = r'''
import json, os, sys, torch
from memlab.bitnet import add_bitnet
from memlab.models import tiny_model
from memlab.relora import ReLoRAConfig, add_relora
from memlab.trainer import BatchList, Trainer
from memlab.train_config import TrainConfig
sys.path.insert(0, sys.argv[3]); from dist_train import fingerprint, make_batches
for mode in sys.argv[2].split(','):          # several runs one after the other in the same processes
    out = f"{sys.argv[1]}/{'full' if mode == 'full' else 'cut'}"
    model = add_relora(add_bitnet(tiny_model('llama', seed=1)), ReLoRAConfig(r=4, lora_dropout=0.0), seed=0)
    cfg = TrainConfig(output_dir=out, max_steps=2 if mode == 'cut' else 4, save_every=2, log_every=1, lr=3e-3,
                      report_to='none', progress=False, per_device_batch_size=2, distributed_type='fsdp',
                      scheduler='constant', resume_from='latest' if mode == 'resume' else None)
    t = Trainer(model, cfg, BatchList(make_batches(6, seed=100 + int(os.environ['RANK']))))
    hist = t.fit()
    json.dump({'losses': [h['loss'] for h in hist if 'loss' in h], 'fingerprint': fingerprint(t.model)},
              open(f"{out}/{mode}_rank{os.environ['RANK']}.json", 'w'))
'''

def test_fsdp_checkpoint_of_wrapped_layers_resumes_exactly(tmp_path):
    "FSDP2 checkpoints of a model whose trainable weights sit inside method wrappers (BitNet latent weights, ReLoRA adapters)."
    script = tmp_path/'wrapped.py'; script.write_text(WRAPPED)
    torchrun(script, tmp_path, 'full,cut', ROOT/'tests')     # the full run and the cut one, in the same two processes
    torchrun(script, tmp_path, 'resume', ROOT/'tests')       # the cut run resumed by new processes
    full, resumed = (json.loads((tmp_path/f).read_text()) for f in ('full/full_rank0.json', 'cut/resume_rank0.json'))
    assert len(resumed['losses']) == 4 and resumed['losses'] == pytest.approx(full['losses'], rel=1e-6)
    assert resumed['fingerprint'] == pytest.approx(full['fingerprint'], rel=1e-6)

@pytest.fixture(scope='module')
def one_lm_run(tmp_path_factory):
    "A tiny Llama with SmolLM2's tokenizer, and memlab_train's one-process run of 3 updates on it: (flags, folder of both)."
    d = tmp_path_factory.mktemp('lm')
    run([sys.executable, '-c', "import sys; from memlab.models import save_tiny_model, load_tokenizer; "
         "save_tiny_model('llama', sys.argv[1], vocab_size=49152); load_tokenizer('smollm2-135m').save_pretrained(sys.argv[1])",
         d/'tiny'])
    flags = ['--model', d/'tiny', '--dataset', 'pydocs', '--max_steps', '3', '--per_device_batch_size', '2',
             '--total_batch_size', '4', '--max_eval_steps', '1', '--sequence_length', '32', '--report_to', 'none',
             '--progress', 'false', '--mixed_precision', 'no', '--lr', '1e-3', '--lora_r', '0']
    run([sys.executable, '-m', 'memlab.train', *flags, '--output_dir', d/'one'])
    return flags, d

@pytest.mark.xdist_group('training_lm')
@pytest.mark.parametrize('launch', ['fsdp', 'zero3'])
def test_memlab_train_sharded_run_writes_the_gathered_model(one_lm_run, tmp_path, launch):
    """memlab_train under FSDP (torchrun) and DeepSpeed ZeRO-3 (accelerate launch with the shipped config) trains what one process
    trains and writes the model gathered from its shards / partitions, which plain transformers loads. Two processes train one
    run: the results table is printed once (by rank 0), not once per process."""
    if launch == 'zero3': pytest.importorskip('deepspeed')
    import torch
    flags, d = one_lm_run
    if launch == 'fsdp':
        r = torchrun('-m', 'memlab.train', *flags, '--output_dir', tmp_path/'sharded', '--distributed_type', 'fsdp')
    else:
        r = run([BIN/'accelerate', 'launch', '--config_file', ROOT/'data'/'configs'/'zero_config.yaml', '--main_process_port',
                 free_port(), '-m', 'memlab.train', *flags, '--output_dir', tmp_path/'sharded'])
    assert r.stdout.count('after training') == 1, r.stdout[-3000:]
    from transformers import AutoModelForCausalLM
    one, sharded = AutoModelForCausalLM.from_pretrained(d/'one'/'model'), AutoModelForCausalLM.from_pretrained(tmp_path/'sharded'/'model')
    assert json.loads((tmp_path/'sharded'/'model'/'config.json').read_text())['architectures'] == ['LlamaForCausalLM']
    tiny = AutoModelForCausalLM.from_pretrained(d/'tiny')
    assert not torch.equal(one.model.layers[0].mlp.up_proj.weight, tiny.model.layers[0].mlp.up_proj.weight)   # it trained
    for (n, a), b in zip(one.named_parameters(), sharded.parameters()): torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=n)
