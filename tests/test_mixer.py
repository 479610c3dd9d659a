"""Integration tests of memlab_mixer (memlab.train_mixer) as real processes: the tokenizer trainer and pretokenizer make the data;
one process (from a YAML config file), torchrun (DDP) and accelerate launch with the shipped FSDP config (seed 003's form as written,
the process count from the config), each on 2 CPU processes, train the same autoencoder run to the same losses and the same saved
model; the shipped ZeRO-3 config trains the same run, resumes and exports."""
import json, sys
from pathlib import Path
from conftest import BIN, ROOT, SLOW, free_port, run, run_commands
import pytest
import torch

FSDP_CONFIG, ZERO_CONFIG = ROOT/'data'/'configs'/'fsdp_config.yaml', ROOT/'data'/'configs'/'zero_config.yaml'

@pytest.fixture(scope='module')
def rows(tmp_path_factory) -> Path:
    "A 512-entry BPE trained by memlab_train_tokenizer and pydocs packed into rows of 16 tokens by memlab_pretokenize."
    d = tmp_path_factory.mktemp('mixer_data')
    made = run_commands([   # the two commands as their entry points run them, in one process (one interpreter start)
        ('memlab.tokenizers:train_tokenizer_main', 'memlab_train_tokenizer',
         ['--dataset', 'pydocs', '--save_dir', d/'bpe', '--vocab_size', 512, '--take', 40]),
        ('memlab.tokenizers:pretokenize_main', 'memlab_pretokenize',
         ['--tokenizer', d/'bpe', '--dataset', 'pydocs', '--sequence_length', 16, '--take', 40, '--save_dir', d,
          '--output_name', 'rows'])])
    assert [code for code, _ in made] == [0, 0], made
    return d/'rows'

def args(rows, out) -> list:
    "One small autoencoder run: 2 processes × 4 rows × 2 micro-batches = 16 rows per update (1 process: 4 micro-batches)."
    return ['--model', 'autoencoder', '--dataset_path', rows, '--hidden_size', 32, '--num_layers', 2, '--length', 16, '--kernel', 3,
            '--decoder_input', 'unroll', '--compression', 2, '--max_steps', 6, '--per_device_batch_size', 4, '--total_batch_size', 16,
            '--lr', 3e-3, '--scheduler', 'constant', '--log_every', 1, '--eval_every', 3, '--max_eval_steps', 2, '--report_to', 'none',
            '--progress', 'False', '--mixed_precision', 'no', '--output_dir', out]   # fp32: one process, DDP and FSDP compared to 1e-5

def losses(out) -> tuple:
    res = json.loads((Path(out)/'results.json').read_text())
    return res, [h['loss'] for h in res['history'] if 'loss' in h], [h['eval_loss'] for h in res['history'] if 'eval_loss' in h]

@pytest.fixture(scope='module')
def one_run(rows, tmp_path_factory) -> Path:
    "The one-process run that the launches below must equal; it takes its architecture from a config file, which flags override."
    d = tmp_path_factory.mktemp('mixer_one')
    cfg = d/'run.yaml'
    cfg.write_text('model: autoencoder\nhidden_size: 32\nnum_layers: 2\nlength: 16\nkernel: 3\ndecoder_input: unroll\ncompression: 8\n')
    run([sys.executable, '-m', 'memlab.train_mixer', '--config', cfg, *args(rows, d/'one'), '--compression', 2,
         '--max_eval_steps', 4])  # the 16 evaluation rows that 2 processes read in 2 steps
    return d/'one'

def load(out):
    from memlab.mixer import load_mixer
    return load_mixer(Path(out)/'model')

def test_one_process_torchrun_and_fsdp_train_the_same_run(rows, one_run, tmp_path):
    run([BIN/'torchrun', '--nproc_per_node', 2, '--master-port', free_port(), '-m', 'memlab.train_mixer', *args(rows, tmp_path/'ddp')])
    # seed 003's FSDP form as written, without --num_processes: the shipped config's count (2) starts 2 FSDP processes
    for cfg in (FSDP_CONFIG, ZERO_CONFIG): assert 'num_processes: 2' in cfg.read_text()
    run([BIN/'accelerate', 'launch', '--config_file', FSDP_CONFIG, '--main_process_port', free_port(), '-m', 'memlab.train_mixer',
         *args(rows, tmp_path/'fsdp')])
    (one, l1, e1), (ddp, l2, e2), (fsdp, l3, e3) = (losses(p) for p in (one_run, tmp_path/'ddp', tmp_path/'fsdp'))
    assert (one['processes'], ddp['processes'], fsdp['processes']) == (1, 2, 2)
    assert (one['fsdp'], ddp['fsdp'], fsdp['fsdp']) == (False, False, True)
    assert len(l1) == 6 and len(e1) == 2
    assert l2 == pytest.approx(l1, rel=1e-5) and l3 == pytest.approx(l1, rel=1e-5)   # same 16 rows per update, same updates
    assert e2 == pytest.approx(e1, rel=1e-5) and e3 == pytest.approx(e1, rel=1e-5)   # evaluation sharded, then reduced
    assert l1[-1] < l1[0]
    m1, m2, m3 = (load(p) for p in (one_run, tmp_path/'ddp', tmp_path/'fsdp'))                  # FSDP shards gathered into a plain folder
    # The encoder's token-mixing biases shift a position by a constant over its features, which the next LayerNorm removes; only the
    # last position (the memory vector) keeps it. Their other entries get gradients that are zero in exact arithmetic (~1e-10 here), and
    # Adam turns that roundoff into +-lr steps whose sign depends on the summation order: compare those entries through the outputs.
    for (n, p1), p2, p3 in zip(m1.named_parameters(), m2.parameters(), m3.parameters()):
        if n.startswith('encoder.') and n.endswith('token_mixing.bias'): p1, p2, p3 = p1[-1:], p2[-1:], p3[-1:]
        torch.testing.assert_close(p2, p1, rtol=1e-4, atol=1e-5, msg=n)
        torch.testing.assert_close(p3, p1, rtol=1e-4, atol=1e-5, msg=n)
    x = torch.randint(0, m1.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(): o1, o2, o3 = (m(input_ids=x).logits for m in (m1, m2, m3))
    torch.testing.assert_close(o2, o1, rtol=1e-4, atol=1e-4); torch.testing.assert_close(o3, o1, rtol=1e-4, atol=1e-4)
    from memlab.models import load_model                                             # the run folder, as every command reads it
    via = load_model(tmp_path/'fsdp').eval()
    assert type(via).__name__ == 'MaskedMixerAutoencoder'
    with torch.no_grad(): assert torch.equal(via(input_ids=x).logits, o3)
    for p in (one_run, tmp_path/'ddp', tmp_path/'fsdp'):
        assert (p/'log.jsonl').exists() and (p/'loss.png').exists() and (p/'results.md').exists()
    # the model folder is complete for transformers alone: its tokenizer (the pretokenized data's), config.json, and the
    # model code as a standalone file that a process without memlab loads with trust_remote_code
    model_dir = tmp_path/'fsdp'/'model'
    assert (model_dir/'tokenizer.json').exists() and (model_dir/'config.json').exists()
    probe = ("import sys, torch; from transformers import AutoModel, AutoTokenizer\n"
             "m = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval(); AutoTokenizer.from_pretrained(sys.argv[1])\n"
             "assert not any(k == 'memlab' or k.startswith('memlab.') for k in sys.modules), 'memlab was imported'\n"
             "x = torch.randint(0, m.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))\n"
             "torch.save(m(input_ids=x).logits.detach(), sys.argv[2])")
    run([sys.executable, '-c', probe, model_dir, tmp_path/'plain.pt'], HF_MODULES_CACHE=tmp_path/'modules')
    torch.testing.assert_close(torch.load(tmp_path/'plain.pt'), o3, rtol=1e-5, atol=1e-6)

def test_zero3_trains_resumes_and_exports(rows, one_run, tmp_path):
    """Seed 003's third form as written (the shipped ZeRO-3 config, its 2 processes, here over gloo): memlab's loop drives the
    DeepSpeed engine to the losses of one process, stopped and resumed from the engine's checkpoint (bit for bit the uninterrupted
    ZeRO-3 run: the slow tier, MEMLAB_SLOW_TESTS=1), and gathers the partitions into
    a model folder that transformers alone loads. (Commands whose methods read partitioned weights refuse a DeepSpeed launch
    in one line: make_accelerator's test in nbs/05c_distributed.ipynb.)"""
    pytest.importorskip('deepspeed')
    zero = lambda out, *extra: run([BIN/'accelerate', 'launch', '--config_file', ZERO_CONFIG, '--main_process_port', free_port(),
                                    '-m', 'memlab.train_mixer', *args(rows, out), *extra])
    zero(tmp_path/'resumed', '--max_steps', 3)                         # stopped after 3 updates ...
    zero(tmp_path/'resumed', '--resume_from', 'latest')                # ... and continued from the engine's checkpoint to 6
    (_, l1, e1), (r, l3, e3) = (losses(p) for p in (one_run, tmp_path/'resumed'))
    assert (r['processes'], r['distributed'], r['fsdp']) == (2, 'deepspeed', False)
    assert len(l3) == 6 and l3 == pytest.approx(l1, rel=1e-5) and e3 == pytest.approx(e1, rel=1e-5)
    assert (tmp_path/'resumed'/'checkpoints'/'step-00000006'/'deepspeed').is_dir()
    m1, m2 = load(one_run), load(tmp_path/'resumed')
    if SLOW:    # the slow tier: the stopped and continued run is bit for bit the uninterrupted one (a third launch)
        zero(tmp_path/'zero')
        z, l2, e2 = losses(tmp_path/'zero')
        assert l3 == l2 and e3 == e2
        for (n, p2), p3 in zip(load(tmp_path/'zero').named_parameters(), m2.parameters()): assert torch.equal(p2, p3), n
    x = torch.randint(0, m1.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(): o1, o2 = m1(input_ids=x).logits, m2(input_ids=x).logits
    torch.testing.assert_close(o2, o1, rtol=1e-4, atol=1e-4)
    probe = ("import sys, torch; from transformers import AutoModel\n"
             "m = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()\n"
             "assert not any(k == 'memlab' or k.startswith('memlab.') for k in sys.modules), 'memlab was imported'\n"
             "x = torch.randint(0, m.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))\n"
             "torch.save(m(input_ids=x).logits.detach(), sys.argv[2])")
    run([sys.executable, '-c', probe, tmp_path/'resumed'/'model', tmp_path/'plain.pt'], HF_MODULES_CACHE=tmp_path/'modules')
    torch.testing.assert_close(torch.load(tmp_path/'plain.pt'), o2, rtol=1e-5, atol=1e-6)
