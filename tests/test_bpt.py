"""Integration tests of memlab_bpt (the seed's `python3 -m llamabpt.train ...`) as real processes: the seed's command at small scale
under torchrun on 2 CPU processes (DDP from --mesh_dim), a checkpoint continued by --autoresume under `accelerate launch` with FSDP
giving the same losses, BPT training against dense training (every chunk size -1), the seed's own --dtype='bf16' against fp32,
and bad input as one line with nothing written."""
import json, shlex, subprocess, sys
from pathlib import Path
import pytest
from conftest import BIN, ROOT, cli_runner, env, free_port, run, torchrun

# The seed's command (004_404aa04a87a7e0f2.txt), verbatim.
SEED = """--mesh_dim='1,64,4' --dtype='bf16' --total_steps=480000 --log_freq=200 --save_model_freq=0 --save_milestone_freq=1000
--load_llama_config='7b' --update_llama_config='' --load_dataset_state='' --load_checkpoint=''
--tokenizer.vocab_file="<path to your llama tokenizer>" --optimizer.type='adamw' --optimizer.adamw_optimizer.weight_decay=0.1
--optimizer.adamw_optimizer.lr=1.5e-4 --optimizer.adamw_optimizer.end_lr=1.5e-5 --optimizer.adamw_optimizer.lr_warmup_steps=2000
--optimizer.adamw_optimizer.lr_decay_steps=480000 --train_dataset.type='json' --train_dataset.text_processor.fields='text'
--train_dataset.json_dataset.path="<path to your training dataset>" --train_dataset.json_dataset.seq_length=32768
--train_dataset.json_dataset.batch_size=64 --train_dataset.json_dataset.tokenizer_processes=16 --checkpointer.save_optimizer_state=True
--llama.scan_layers=True --llama.param_scan_axis=0 --llama.q_chunk_size=2048 --llama.k_chunk_size=4096 --llama.ffn_chunk_size=2048
--llama.head_chunk_size=-1 --llama.loss_chunk_size=-1 --llama.remat_policy='nothing_saveable' --llama.max_sequence_length=32768
--llama.float32_logits=True --autoresume=True"""

# Small scale: the debug preset narrowed to hidden 64 with GQA (4 query heads on 2 key/value heads), rows of 128 tokens, 4 rows per
# update over the 2 processes, 6 updates with a 2-update warm-up, blocks of 32 queries and 64 keys (q < k), FFN chunks of 32, the
# loss in chunks of 48 (a size that does not divide 4 x 128 / 2), checkpoints every 2 updates and milestones every 3, fp32 so that
# runs can be compared to 1e-5 (test_seed_dtype_bf16 runs the seed's own bf16).
SMALL = {'--mesh_dim': '-1,1,1', '--dtype': 'fp32', '--total_steps': '6', '--log_freq': '1', '--save_model_freq': '2',
         '--save_milestone_freq': '3', '--load_llama_config': 'debug',
         '--update_llama_config': "{'hidden_size': 64, 'intermediate_size': 128, 'num_key_value_heads': 2}",
         '--optimizer.adamw_optimizer.lr': '3e-3', '--optimizer.adamw_optimizer.end_lr': '3e-4',
         '--optimizer.adamw_optimizer.lr_warmup_steps': '2', '--optimizer.adamw_optimizer.lr_decay_steps': '20',
         '--train_dataset.json_dataset.seq_length': '128', '--train_dataset.json_dataset.batch_size': '4',
         '--train_dataset.json_dataset.tokenizer_processes': '1', '--llama.q_chunk_size': '32', '--llama.k_chunk_size': '64',
         '--llama.ffn_chunk_size': '32', '--llama.loss_chunk_size': '48', '--llama.max_sequence_length': '128',
         '--report_to': 'none', '--progress': 'False'}
DENSE = {f'--llama.{k}_chunk_size': '-1' for k in ('q', 'k', 'ffn', 'head', 'loss')}

def command(data:dict, out, **changes) -> list:
    "The seed's command as argv (--flag=value), with the data, SMALL and `changes` ({'--flag': value})."
    flags = dict(t.split('=', 1) for t in shlex.split(SEED))
    flags.update({'--tokenizer.vocab_file': str(data['tokenizer']), '--train_dataset.json_dataset.path': str(data['path']),
                  '--output_dir': str(out)}, **SMALL)
    flags.update(changes)
    return [f'{k}={v}' for k, v in flags.items()]

def results(out) -> dict: return json.loads((Path(out)/'results.json').read_text())
def losses(res:dict) -> dict: return {int(k): v for k, v in res['losses'].items()}

@pytest.fixture(scope='module')
def data(tmp_path_factory):
    "A 512-token BPE trained on pydocs, and 20 pydocs documents as a JSON-lines file of {'id', 'text'} records."
    from memlab.data import load_corpus
    from memlab.tokenizers import train_tokenizer
    root = tmp_path_factory.mktemp('bpt')
    docs = load_corpus('pydocs').split('train')[:20]
    (root/'docs.jsonl').write_text(''.join(json.dumps({'id': d.id, 'text': d.text}) + '\n' for d in docs))
    train_tokenizer([d.text for d in docs], vocab_size=512, save_dir=root/'tok', show_progress=False)
    return {'root': root, 'tokenizer': root/'tok', 'path': root/'docs.jsonl'}

@pytest.fixture(scope='module')
def ddp(data):
    "The seed's command, small, under torchrun on 2 processes with --mesh_dim -1,1,1 (DDP)."
    out = data['root']/'ddp'
    torchrun('-m', 'memlab.train_bpt', *command(data, out))
    return out

def test_seed_command_ddp(ddp):
    r = results(ddp)
    assert (r['steps'], r['world_size'], r['distributed_type']) == (6, 2, 'ddp') and r['replicas_agree']
    L = losses(r)
    assert sorted(L) == list(range(1, 7)) and L[6] < L[1] - 0.3                      # the loss falls
    assert r['tokens_seen'] == 6 * 4 * 127                                            # 4 rows of 127 targets per update
    # checkpoints every 2 updates replace each other, milestones every 3 are kept, the last update is always checkpointed
    assert r['checkpoints'] == ['step-00000003', 'step-00000006']
    ck = ddp/'checkpoints'/'step-00000006'
    assert json.loads((ck/'dataset_state.json').read_text())['position'] == 6 * 4
    cfg = json.loads((ddp/'run_config.json').read_text())
    assert cfg['bpt']['q_chunk_size'] == 32 and cfg['bpt']['k_chunk_size'] == 64 and cfg['bpt']['loss_chunk_size'] == 48
    assert cfg['model']['hidden_size'] == 64 and cfg['model']['num_key_value_heads'] == 2 and cfg['model']['vocab_size'] == 512
    plain = json.loads((ddp/'model'/'config.json').read_text())                      # the exported model is a plain Llama
    assert plain['model_type'] == 'llama' and (ddp/'model'/'tokenizer.json').exists()
    from huggingface_hub import ModelCard
    card = ModelCard.load(ddp/'model'/'README.md')                                   # its model card parses: no paths
    assert card.data.base_model is None and 'memlab_bpt' in card.data.tags and str(ddp.parent) not in str(card)
    import torch
    from transformers import AutoModelForCausalLM
    from memlab.models import load_model
    m, ref = load_model(ddp), AutoModelForCausalLM.from_pretrained(ddp/'model')         # the run folder loads as its model
    x = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(): assert torch.equal(m(input_ids=x).logits, ref(input_ids=x).logits)

def test_autoresume_fsdp_accelerate_launch_continues_exactly(data, ddp):
    "3 updates under torchrun with FSDP, then --autoresume=True to 6 under accelerate launch: the DDP run's losses, update by update."
    out = data['root']/'fsdp'
    fsdp = {'--mesh_dim': '1,-1,1'}
    torchrun('-m', 'memlab.train_bpt', *command(data, out, **fsdp, **{'--total_steps': '3'}))
    first = results(out)
    assert first['distributed_type'] == 'fsdp' and first['checkpoints'] == ['step-00000003']
    run([BIN/'accelerate', 'launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1', '--mixed_precision', 'no',
         '--dynamo_backend', 'no', '--main_process_port', free_port(), '-m', 'memlab.train_bpt', *command(data, out, **fsdp)],
        ACCELERATE_USE_CPU=1)
    r = results(out)
    assert r['steps'] == 6 and r['replicas_agree'] and r['history'][0]['step'] == 1     # the history continues the first run's
    got, want = losses(r), losses(results(ddp))
    assert [got[s] for s in range(1, 7)] == pytest.approx([want[s] for s in range(1, 7)], rel=1e-5)
    assert r['fingerprint'] == pytest.approx(results(ddp)['fingerprint'], rel=1e-5)
    import torch
    from memlab.models import load_model                                   # FSDP's gathered state has plain names: loads strictly
    x = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(): torch.testing.assert_close(load_model(out)(input_ids=x).logits, load_model(ddp)(input_ids=x).logits,
                                                     rtol=1e-4, atol=1e-4)

def test_bpt_equals_dense(data, ddp):
    "The same command with every chunk size -1 (Hugging Face's attention, whole FFN, full logits) trains to the same losses."
    out = data['root']/'dense'
    torchrun('-m', 'memlab.train_bpt', *command(data, out, **DENSE, **{'--total_steps': '4', '--save_milestone_freq': '0'}))
    r, want = results(out), losses(results(ddp))
    assert r['bpt']['q_chunk_size'] == -1 and r['replicas_agree']
    assert [losses(r)[s] for s in range(1, 5)] == pytest.approx([want[s] for s in range(1, 5)], rel=1e-5)

def test_seed_dtype_bf16(data, tmp_path):
    """The seed's own --dtype='bf16' (autocast over fp32 weights), not swapped to fp32, with chunked attention: 6
    updates on CPU with each attention kernel, and with selective rematerialisation in fused layers, have the losses of
    the same command in fp32 to 1e-3 relative. bf16 keeps 8 significant bits (unit roundoff 2^-8 per rounded product);
    the loss is a mean over 508 targets of fp32 cross-entropies whose rounding errors mostly cancel (measured: <= 4e-5
    relative over the 6 updates), while the updates lower it by 0.4. Before the fix the seed's flash kernel failed in
    forward (q, k fp32 after RoPE, v bf16) and sdpa in backward."""
    seed_dtype = dict(t.split('=', 1) for t in shlex.split(SEED))['--dtype']
    assert seed_dtype == 'bf16'
    runs = {'fp32': {'--dtype': 'fp32'}, 'flash': {'--dtype': seed_dtype},
            'torch': {'--dtype': seed_dtype, '--llama.attention_kernel': 'torch'},
            'sdpa': {'--dtype': seed_dtype, '--llama.attention_kernel': 'sdpa', '--llama.float32_logits': 'False'},
            'fused-dots': {'--dtype': seed_dtype, '--llama.fused': 'True', '--llama.remat_policy': 'dots_saveable'}}
    quick = {'--save_model_freq': '0', '--save_milestone_freq': '0', '--export_model': 'False'}
    argvs = [command(data, tmp_path/name, **quick, **changes) for name, changes in runs.items()]
    r = run([sys.executable, '-c', cli_runner('memlab.train_bpt', 'memlab_bpt'), json.dumps(argvs)])
    status = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(code == 0 for code, _ in status), status
    want = [losses(results(tmp_path/'fp32'))[s] for s in range(1, 7)]
    assert want[-1] < want[0] - 0.3
    for name in list(runs)[1:]:
        assert json.loads((tmp_path/name/'run_config.json').read_text())['bpt_flags']['run']['dtype'] == 'bf16'
        got = [losses(results(tmp_path/name))[s] for s in range(1, 7)]
        assert got == pytest.approx(want, rel=1e-3), name
        assert max(abs(g - w) / w for g, w in zip(got, want)) > 1e-7, name     # bf16 really ran: not fp32's losses

BAD = [({'--llama.q_chunk_size': '0'}, '--llama.q_chunk_size must be a positive block length or -1'),
       ({'--llama.ffn_chunk_size': '-2'}, '--llama.ffn_chunk_size must be a positive block length or -1'),
       ({'--llama.remat_policy': 'save_everything'}, 'unknown remat policy'),
       ({'--mesh_dim': '1,64,4'}, 'asks for 256 processes but 1 were launched'),    # the seed's mesh, on one process
       ({'--mesh_dim': '1,4,1'}, 'asks for 4 processes but 1 were launched'),
       ({'--dtype': 'fp16'}, 'needs a GPU'),
       ({'--update_llama_config': "{'hiden_size': 64}"}, 'hiden_size is not a LlamaConfig field'),
       ({'--load_llama_config': '8b'}, "unknown --load_llama_config '8b'"),
       ({'--optimizer.type': 'palm'}, 'trains with adamw'),
       ({'--train_dataset.json_dataset.batch_size': '3', '--optimizer.accumulate_gradient_steps': '2'}, 'not a multiple of processes'),
       ({'--load_checkpoint': 'trainstate::/nonexistent/run'}, 'no such folder')]

@pytest.mark.parametrize('changes,message', BAD)
def test_bad_input_is_one_line(data, tmp_path, changes, message):
    from memlab.cli import run_cli
    from memlab.train_bpt import main
    out = tmp_path/'run'
    code, stdout, err = run_cli(main, command(data, out, **changes), prog='memlab_bpt')
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()                                                           # nothing written

def test_bad_model_family_and_config_file(data, tmp_path):
    "A GPT-2 config or pretrained GPT-2 is refused in one line; so is a --config file that does not parse (nothing written)."
    from memlab.cli import run_cli
    from memlab.models import save_tiny_model
    from memlab.train_bpt import main
    (tmp_path/'gpt2.json').write_text(json.dumps({'model_type': 'gpt2', 'n_embd': 64}))
    save_tiny_model('gpt2', tmp_path/'gpt2', vocab_size=512)
    (tmp_path/'bad.yaml').write_text('llama.q_chunk_size: [32\n')
    out = tmp_path/'run'
    for changes, message in [({'--load_llama_config': str(tmp_path/'gpt2.json')}, "is a 'gpt2' config: BPT converts Llama-family"),
                             ({'--load_llama_config': '', '--update_llama_config': '', '--load_checkpoint': f"params::{tmp_path/'gpt2'}"},
                              'BPT converts Llama-family causal LMs'),
                             ({'--config': str(tmp_path/'bad.yaml')}, 'does not parse')]:
        code, stdout, err = run_cli(main, command(data, out, **changes), prog='memlab_bpt')
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()

def test_module_help_and_exit_status(data, tmp_path):
    "`python -m memlab.train_bpt`: --help documents every flag (the JAX-only ones as such); a bad flag exits 2 with one line, no traceback."
    h = run([sys.executable, '-m', 'memlab.train_bpt', '--help'])
    for flag in ('--llama.q_chunk_size', '--optimizer.adamw_optimizer.lr_decay_steps', '--train_dataset.json_dataset.tokenizer_processes',
                 '--train_dataset.text_processor.fields', '--checkpointer.save_optimizer_state', '--mesh_dim', '--autoresume'):
        assert flag in h.stdout
    assert 'does nothing' in h.stdout.split('--llama.scan_layers')[-1][:300]
    out = tmp_path/'run'
    r = run([sys.executable, '-m', 'memlab.train_bpt', *command(data, out, **{'--llama.k_chunk_size': '0'})], check=False)
    assert r.returncode == 2 and 'Traceback' not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()
