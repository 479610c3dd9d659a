"""The seed's mesh (`--mesh_dim='dp,fsdp,tp[,cp]'`) as real processes on CPU over gloo: a tiny Llama trained a few updates under
each mesh gives the one-process losses and gradients within rounding, resumes exactly from its checkpoint (and from one written
under another mesh, or refuses in one line), and memlab_bpt under a mesh saves a model that plain transformers loads.

Default tier: 2 processes (dp; fsdp; tp; cp) with the tiniest model, the meshes one after the other in one launch. The 4-process
meshes (dp; fsdp; dp x fsdp; fsdp x tp; tp over 4; cp over 4; fsdp x cp; a 4-process checkpoint continued on 2) oversubscribe the
2 cores twice over: they run with MEMLAB_SLOW_TESTS=1."""
import json, os, shutil, sys
from pathlib import Path
import pytest
import torch
from conftest import ROOT, run, run_again_on_crash, torchrun
from test_bpt import command, data, losses, results   # the seed's command at small scale, and its data (a module fixture)

SCRIPT = ROOT/'tests'/'dist_train.py'
slow = pytest.mark.skipif(not os.environ.get('MEMLAB_SLOW_TESTS'), reason='4-process meshes: set MEMLAB_SLOW_TESTS=1')

def tensors(out) -> dict:
    from safetensors.torch import load_file
    return load_file(str(Path(out)/'tensors.safetensors'))

def result(out, rank:int=0) -> dict: return json.loads((Path(out)/f'result_rank{rank}.json').read_text())

def assert_same_run(got, want, steps:int, grads:bool=True):
    """Losses to 1e-5, every first-update gradient to 1e-5 of its largest entry, and every final weight to 5e-5 (3 AdamW updates of
    lr 3e-3 from rounding-level gradient differences: AdamW divides a gradient by its own running size, so an entry whose gradient is
    a cancellation near zero moves by up to lr whatever its rounding, in a handful of entries out of 10^5). `grads`: compare the
    first update's gradients (a resumed run's first update is a later one)."""
    g, w = result(got), result(want)
    assert len(g['losses']) == steps and g['losses'] == pytest.approx(w['losses'], rel=1e-5)
    assert g['tokens_seen'] == w['tokens_seen']
    tg, tw = tensors(got), tensors(want)
    assert set(tg) == set(tw)
    for k in tw:
        if k.startswith('grad.') and not grads: continue          # a resumed run's first update is not update 1
        err = (tg[k].double() - tw[k].double()).abs().max().item()
        if k.startswith('grad.'): assert err <= 1e-5 * tw[k].abs().max().item(), (k, err)
        else: assert err <= 5e-5, (k, err)

def jobs(root, *specs, nproc=2, steps=3, extra=()):
    "Run the --job specs ('NAME:MESH') in one launch of `nproc` processes (one process: the references), under `root`."
    args = [a for spec in specs for a in ('--job', spec)] + ['--bpt', '--steps', str(steps), *map(str, extra)]
    if nproc == 1: return run([sys.executable, SCRIPT, root, *args])
    return torchrun(SCRIPT, root, *args, nproc=nproc, ACCELERATE_USE_CPU=1)

def torchrun_into(out, *args, **envkw):
    "torchrun `args`, a command writing into `out`: after a native crash, once more with `out` removed (conftest)."
    return run_again_on_crash(lambda: torchrun(*args, **envkw), lambda: shutil.rmtree(out, ignore_errors=True))

def cut_at(src, dst, step:int):
    "A copy of run folder `src` as if the run had been killed right after checkpoint `step`."
    shutil.copytree(src, dst)
    for ck in (dst/'checkpoints').glob('step-*'):
        if int(ck.name.split('-')[1]) > step: shutil.rmtree(ck)
    (dst/'checkpoints'/'latest').write_text(f'step-{step:08d}')
    for f in dst.glob('result_rank*.json'): f.unlink()

@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    "One process reading the rows of 1 and of 2 data-parallel processes: the runs every mesh must reproduce."
    root = tmp_path_factory.mktemp('mesh-ref')
    jobs(root, 'data1:data=1', 'data2:data=2', nproc=1)
    return root

RING = r'''
import sys, torch, torch.distributed as dist, torch.nn.functional as F
from memlab.bpt.context import ring_attention, zigzag_indices
dist.init_process_group('gloo'); r, cp = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(0)
T = 8 * cp
q, k, v = (torch.randn(2, nh, T, 8, generator=g, dtype=torch.float64) for nh in (4, 2, 2))
pad = torch.ones(2, T, dtype=torch.bool); pad[1, :3] = False                 # left padding in one row
keep = pad[:, None, None, :] & torch.ones(T, T, dtype=torch.bool).tril()
def dense(q, k, v):
    return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=keep | ~keep.any(-1, keepdim=True)) * keep.any(-1)[..., None]
full = [t.clone().requires_grad_() for t in (q, k, v)]
want = dense(*full); w = torch.randn(want.shape, generator=g, dtype=torch.float64)
(want * w).sum().backward()
idx = zigzag_indices(T, cp, r)
worst = 0.0
for kernel in ('torch', 'flash', 'sdpa'):
    mine = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, key_mask=pad[:, idx], q_chunk_size=3, k_chunk_size=2, kernel=kernel)
    (out * w[:, :, idx]).sum().backward()
    for got, ref in [(out, want), *((m.grad, f.grad) for m, f in zip(mine, full))]:
        worst = max(worst, ((got - ref[:, :, idx]).abs().max() / ref.abs().max()).item())
print('worst', worst)
assert worst < 1e-13, worst
'''

@pytest.mark.parametrize('cp', [2, pytest.param(4, marks=slow)])
def test_ring_attention_is_exact(tmp_path, cp):
    """Attention of a row split over cp processes (zig-zag, GQA, a left-padded row, blocks of 3 queries x 2 keys that do not divide
    the chunks) against causal SDPA over the whole row, fp64: output and dq, dk, dv (dk, dv summed around the ring) to 1e-13."""
    script = tmp_path/'ring.py'; script.write_text(RING)
    r = torchrun(script, nproc=cp)
    assert r.stdout.count('worst') == cp

MESHES = {'dp': ('2,1,1', 2), 'fsdp': ('1,2,1', 2), 'tp': ('1,1,2', 1), 'cp': ('1,1,1,2', 1)}

@pytest.fixture(scope='module')
def meshes(tmp_path_factory):
    "3 updates of BPT (chunked attention, FFN and fused loss) under each 2-process mesh, in one launch, checkpoints at 2 and 3."
    root = tmp_path_factory.mktemp('meshes')
    def clear():
        for d in root.iterdir(): shutil.rmtree(d)
    run_again_on_crash(lambda: jobs(root, *(f'{name}:{mesh}' for name, (mesh, _) in MESHES.items()), extra=['--save_every', 2]),
                       clear)
    return root

@pytest.mark.parametrize('name', list(MESHES))
def test_two_process_mesh_matches_one_process(meshes, reference, name):
    "Each 2-process mesh trains what one process reading the same rows trains, update by update."
    r0, r1 = result(meshes/name, 0), result(meshes/name, 1)
    assert r0['world'] == 2 and r0['fingerprint'] == r1['fingerprint']       # the processes agree on the whole model
    assert_same_run(meshes/name, reference/f'data{MESHES[name][1]}', 3)

def test_mesh_resumes_exactly_or_refuses(tmp_path, meshes, reference):
    """The tp run cut after update 2 continues to 3 under tp, and under cp (another mesh with the same data layout: one process's
    rows), in fresh processes; a checkpoint of fsdp (two processes' rows) and one of dp (DDP's format) are refused under tp in one
    line, and cp with a loss that does not split the rows (the plain model's) is refused before anything is written."""
    def launch():
        for name in ('again', 'as_cp'): cut_at(meshes/'tp', tmp_path/name, 2)
        for name in ('fsdp', 'dp'): cut_at(meshes/name, tmp_path/name, 2)
        jobs(tmp_path, 'again:1,1,2', 'as_cp:1,1,1,2', 'fsdp:1,1,2', 'dp:1,1,2', 'plain:1,1,1,2:plain', extra=['--resume', '--catch'])
    def clear():
        for name in ('again', 'as_cp', 'fsdp', 'dp', 'plain'): shutil.rmtree(tmp_path/name, ignore_errors=True)
    run_again_on_crash(launch, clear)
    for name, mesh in (('again', [1, 1, 2, 1]), ('as_cp', [1, 1, 1, 2])):
        assert_same_run(tmp_path/name, reference/'data1', 3, grads=False)
        assert json.loads((tmp_path/name/'checkpoints'/'step-00000003'/'trainer_state.json').read_text())['mesh'] == mesh
    for name, msg in (('fsdp', 'cannot continue under mesh dp=1,fsdp=1,tp=2,cp=1 (1): resume with dp × fsdp = 2'),
                      ('dp', 'was written under ddp; resume it the same way'),
                      ('plain', 'needs a loss that splits each sequence over the cp processes')):
        errors = [(tmp_path/name/f'error_rank{r}.txt').read_text() for r in range(2)]
        assert all(msg in e and '\n' not in e for e in errors), errors
    assert not (tmp_path/'plain'/'checkpoints').exists()

# ---- 4 processes (MEMLAB_SLOW_TESTS=1) -----------------------------------------------------------------------------------------

FOUR = {'dp4': ('4,1,1', 4), 'fsdp4': ('1,4,1', 4), 'dp_x_fsdp': ('2,2,1', 4), 'fsdp_x_tp': ('1,2,2', 2), 'tp4': ('1,1,4', 1),
        'cp4': ('1,1,1,4', 1), 'fsdp_x_cp': ('1,2,1,2', 2)}

@slow
def test_four_process_meshes_match_one_process(tmp_path):
    """dp and fsdp over 4, dp x fsdp (HSDP), fsdp x tp, tp over 4 (4 key/value heads), cp over 4 and fsdp x cp on 4 processes; then the fsdp x tp run
    cut after update 2 continues on 2 processes under fsdp alone (the same two processes' rows): the one-process runs."""
    jobs(tmp_path/'ref', 'data1:data=1', 'data2:data=2', 'data4:data=4', nproc=1, extra=['--kv_heads', 4])
    jobs(tmp_path, *(f'{n}:{m}' for n, (m, _) in FOUR.items()), nproc=4, extra=['--kv_heads', 4, '--save_every', 2])
    for name, (_, d) in FOUR.items():
        assert len({json.dumps(result(tmp_path/name, r)['fingerprint']) for r in range(4)}) == 1, name
        assert_same_run(tmp_path/name, tmp_path/'ref'/f'data{d}', 3)
    cut_at(tmp_path/'fsdp_x_tp', tmp_path/'two'/'on_two', 2)
    jobs(tmp_path/'two', 'on_two:1,2,1', extra=['--kv_heads', 4, '--resume'])
    assert_same_run(tmp_path/'two'/'on_two', tmp_path/'ref'/'data2', 3, grads=False)

# ---- memlab_bpt under a mesh ------------------------------------------------------------------------------------------------------

QUICK = {'--total_steps': '2', '--save_milestone_freq': '0', '--save_model_freq': '0', '--train_dataset.json_dataset.batch_size': '2'}

def test_memlab_bpt_mesh_saves_a_plain_model(data, tmp_path):
    """The seed's command, small, with --mesh_dim tp (1,1,2) and cp (1,1,1,2), on 2 processes: the one-process run's losses, and
    each exported model loads with plain transformers and computes what the one-process run's does."""
    run([sys.executable, '-m', 'memlab.train_bpt', *command(data, tmp_path/'one', **QUICK, **{'--mesh_dim': '1,1,1'})])
    meshes = {'tp': '1,1,2', 'cp': '1,1,1,2'}
    for name, mesh in meshes.items():      # a launch each: a command closes its process group when it ends
        torchrun_into(tmp_path/name, '-m', 'memlab.train_bpt', *command(data, tmp_path/name, **QUICK, **{'--mesh_dim': mesh}),
                      ACCELERATE_USE_CPU=1)
    from transformers import AutoModelForCausalLM
    want, ref = results(tmp_path/'one'), AutoModelForCausalLM.from_pretrained(tmp_path/'one'/'model')
    x = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    for name, mesh in meshes.items():
        got = results(tmp_path/name)
        assert got['replicas_agree'] and got['mesh'] == [int(v) for v in (mesh + ',1').split(',')[:4]]
        assert [losses(got)[s] for s in (1, 2)] == pytest.approx([losses(want)[s] for s in (1, 2)], rel=1e-5)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path/name/'model')
        assert type(plain).__name__ == 'LlamaForCausalLM' and plain.config._attn_implementation == 'sdpa'
        with torch.no_grad():
            torch.testing.assert_close(plain(input_ids=x).logits, ref(input_ids=x).logits, rtol=1e-4, atol=1e-4)

# ---- memlab_train and memlab_relora under a mesh ------------------------------------------------------------------------------

def test_memlab_train_tensor_parallel_writes_the_gathered_model(tmp_path):
    """memlab_train --mesh_dim 1,1,2 (full fine-tuning split by the model's tensor-parallel plan) on 2 processes trains what one
    process trains on the same rows, and writes the model gathered from its shards, which plain transformers loads."""
    from memlab.models import save_tiny_model, load_tokenizer
    save_tiny_model('llama', tmp_path/'tiny', vocab_size=49152, num_layers=2)
    load_tokenizer('smollm2-135m').save_pretrained(tmp_path/'tiny')
    from memlab.data import load_corpus
    docs = load_corpus('pydocs').split('train')[:8]         # a small corpus: 6 training documents, 2 for validation
    (tmp_path/'docs.jsonl').write_text(''.join(json.dumps({'text': d.text[:4000], 'split': 'validation' if i >= 6 else 'train'})
                                               + '\n' for i, d in enumerate(docs)))
    flags = ['--model', tmp_path/'tiny', '--dataset', tmp_path/'docs.jsonl', '--max_steps', '2', '--per_device_batch_size', '2',
             '--max_eval_steps', '1', '--sequence_length', '32', '--report_to', 'none', '--progress', 'false',
             '--mixed_precision', 'no', '--lr', '1e-3', '--lora_r', '0', '--eval_at_start', 'false', '--plot', 'false']
    run([sys.executable, '-m', 'memlab.train', *flags, '--output_dir', tmp_path/'one'])
    torchrun_into(tmp_path/'tp', '-m', 'memlab.train', *flags, '--output_dir', tmp_path/'tp', '--mesh_dim', '1,1,2',
                  ACCELERATE_USE_CPU=1)
    from transformers import AutoModelForCausalLM
    one, tp, tiny = (AutoModelForCausalLM.from_pretrained(tmp_path/k/'model') if k != 'tiny' else
                     AutoModelForCausalLM.from_pretrained(tmp_path/k) for k in ('one', 'tp', 'tiny'))
    assert not torch.equal(one.model.layers[0].mlp.up_proj.weight, tiny.model.layers[0].mlp.up_proj.weight)   # it trained
    for (n, a), b in zip(one.named_parameters(), tp.parameters()): torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=n)

@pytest.fixture(scope='module')
def pretokenized(tmp_path_factory):
    "A 512-token BPE on pydocs and pydocs pretokenized at length 128 by memlab_pretokenize (memlab_relora's data)."
    from memlab.cli import run_cli
    from memlab.tokenizers import pretokenize_main, train_tokenizer
    root = tmp_path_factory.mktemp('relora-mesh')
    train_tokenizer('pydocs', vocab_size=512, save_dir=root/'tok', take=40, show_progress=False)
    code, out, err = run_cli(pretokenize_main, ['--tokenizer', root/'tok', '--dataset', 'pydocs', '--sequence_length', 128,
                                                '--take', 20, '--save_dir', root/'data', '--output_name', 'pydocs_128'],
                             prog='memlab_pretokenize')
    assert code == 0, err
    return root

def test_memlab_relora_full_rank_tensor_parallel(pretokenized, tmp_path):
    """memlab_relora --mesh_dim 1,1,2 (full-rank training, tensor parallel) on 2 processes: the one-process run's losses and merged
    model (with --use_peft, ReLoRA's layers, the same mesh is refused in one line: 31_train_relora's tests)."""
    flags = ['--model_config', 'llama_9m', '--dataset_path', pretokenized/'data'/'pydocs_128', '--tokenizer', pretokenized/'tok',
             '--batch_size', '2', '--max_length', '128', '--num_training_steps', '2', '--warmup_steps', '1', '--lr', '1e-3',
             '--eval_every', '2', '--save_every', '2', '--max_eval_tokens', '256', '--report_to', 'none', '--dtype', 'float32',
             '--progress', 'False']
    run([sys.executable, '-m', 'memlab.train_relora', *flags, '--save_dir', tmp_path/'one'])
    torchrun_into(tmp_path/'tp', '-m', 'memlab.train_relora', *flags, '--save_dir', tmp_path/'tp', '--mesh_dim', '1,1,2',
                  ACCELERATE_USE_CPU=1)
    one, tp = (json.loads((tmp_path/k/'results.json').read_text()) for k in ('one', 'tp'))
    assert tp['mesh'] == [1, 1, 2, 1] and tp['replicas_agree']
    got, want = ([h['loss'] for h in r['history'] if 'loss' in h] for r in (tp, one))
    assert len(got) == 2 and got == pytest.approx(want, rel=1e-5)
    assert tp['fingerprint'] == pytest.approx(one['fingerprint'], rel=1e-4, abs=1e-3)
