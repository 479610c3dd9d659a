"""Integration tests of memlab_distill (memlab.train_distill, Distily's command line) as real processes on tiny models and the
embedded corpus: one process and `accelerate launch` on 2 CPU processes train the same student (replicas agree); the model card
lists the measured metrics; top-k teacher shards are generated once (k = vocabulary: the same training as the online teacher) and
reused; on-policy distillation with a forward-KL warm-up runs on 2 processes with equal replicas, reproducibly; a BitNet
student exports packed weights that reload to the evaluated model; bad input is one line, exit 2, nothing written."""
import json, sys
from pathlib import Path
import pytest
import torch
from conftest import BIN, ROOT, free_port, run, run_commands

PYTHON = sys.executable

@pytest.fixture(scope='module')
def teacher(tmp_path_factory) -> Path:
    "A 4-layer Llama (hidden 64) over a 512-token BPE trained on pydocs, saved with its tokenizer (random weights: a test teacher)."
    from memlab.models import tiny_model
    from memlab.tokenizers import train_tokenizer
    d = tmp_path_factory.mktemp('distill')/'teacher'
    train_tokenizer('pydocs', vocab_size=512, save_dir=d, take=40, show_progress=False)
    tiny_model('llama', vocab_size=512, num_layers=4, hidden_size=64, intermediate_size=128, seed=3).save_pretrained(d)
    return d

def args(teacher, out, *extra) -> list:
    "A small run: a 2-layer student (teacher layers 0 and 3 and the head copied), 64 rows of 32 tokens, 4 rows per update, 6 updates."
    return ['--teacher_model_name_or_path', teacher, '--student_model_config', '{"num_hidden_layers": 2}',
            '--copy_teacher_modules', 'layers,lm_head', '--dataset_sample_size', 64, '--dataset_max_seq_length', 32,
            '--dataset_test_size', 0.125, '--ppl_evaluators', '[{"name": "pydocs_ppl", "dataset": "pydocs", "split": "validation", "sample_size": 8}]',
            '--max_steps', 6, '--learning_rate', 3e-3, '--lr_scheduler_type', 'constant', '--logging_steps', 1, '--eval_steps', 3,
            '--per_device_eval_batch_size', 4, '--bf16', 'False', '--gradient_checkpointing', 'False', '--report_to', 'none',
            '--disable_tqdm', 'True', '--output_dir', out, *extra]

def results(out) -> dict: return json.loads((Path(out)/'results.json').read_text())
def losses(res) -> list: return [h['loss'] for h in res['history'] if 'loss' in h]

@pytest.fixture(scope='module')
def online(teacher, tmp_path_factory) -> Path:
    "One process, 2 rows per micro-batch, 2 micro-batches per update, forward KL with the teacher online."
    out = tmp_path_factory.mktemp('online')/'run'
    run([PYTHON, '-m', 'memlab.train_distill', *args(teacher, out, '--per_device_train_batch_size', 2, '--gradient_accumulation_steps', 2)])
    return out

def test_run_writes_student_card_results_plot(online):
    r = results(online)
    assert (r['steps'], r['world_size'], r['train_rows'], r['test_rows']) == (6, 1, 56, 8)
    m = r['metrics']['pydocs_ppl']
    assert m['student'] < m['student_before'] and m['tokens'] == 8 * 31
    ev = [h['eval_loss'] for h in r['history'] if 'eval_loss' in h]
    assert len(ev) == 3 and ev[-1] < ev[0]                       # the objective on held-out rows, at 0, 3 and 6
    for f in ('README.md', 'model.safetensors', 'config.json', 'tokenizer.json', 'loss.png', 'log.jsonl'):
        assert (online/f).exists(), f
    card = (online/'README.md').read_text()
    assert f"| pydocs_ppl (perplexity) | {m['teacher']:.4g} | {m['student']:.4g} |" in card         # the measured numbers
    assert f"| pydocs_ppl, student before training | — | {m['student_before']:.4g} |" in card
    meta = card.split('---')[1]                  # the teacher is a local folder: no base_model (never a path)
    assert 'base_model' not in meta and 'model-index' in meta and 'fine-tuned from' not in card.lower()
    assert f"| parameters | {r['teacher_parameters']:,} | {r['student_parameters']:,} |" in card
    assert r['train_tokens'] == 6 * 4 * 31 and f"Training tokens: {r['train_tokens']:,}" in card and 'Peak memory' in card
    from transformers import AutoModelForCausalLM                  # a plain Hugging Face folder
    assert AutoModelForCausalLM.from_pretrained(online).config.num_hidden_layers == 2

def test_accelerate_launch_two_processes_agree(teacher, online, tmp_path):
    "2 processes x 2 rows = the same 4 rows per update as 1 process x 2 rows x 2 micro-batches: same losses, same student."
    out = tmp_path/'ddp'
    run([BIN/'accelerate', 'launch', '--multi_gpu', '--num_processes', 2, '--num_machines', 1, '--mixed_precision', 'no',
         '--dynamo_backend', 'no', '--main_process_port', free_port(), '-m', 'memlab.train_distill',
         *args(teacher, out, '--per_device_train_batch_size', 2)], ACCELERATE_USE_CPU=1)
    one, two = results(online), results(out)
    assert two['world_size'] == 2 and two['replicas_agree']        # checked across ranks inside the run (fingerprints all-gathered)
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    assert two['metrics']['pydocs_ppl']['student'] == pytest.approx(one['metrics']['pydocs_ppl']['student'], rel=1e-5)
    assert two['fingerprint'] == pytest.approx(one['fingerprint'], rel=1e-5)

def test_on_policy_under_accelerate_launch(teacher, tmp_path):
    """On-policy reverse KL after a forward-KL warm-up on 2 processes: each samples its own rows from its unwrapped student,
    the replicas stay equal, and the run is reproducible (the same command twice gives the same losses)."""
    gkd = ['--per_device_train_batch_size', 2, '--on_policy_fraction', 0.5, '--on_policy_prompt_length', 16,
           '--logits_loss_fn', 'reverse_kl', '--kl_warmup_steps', 2]
    outs = [tmp_path/'gkd1', tmp_path/'gkd2']
    for out in outs:
        run([BIN/'accelerate', 'launch', '--multi_gpu', '--num_processes', 2, '--num_machines', 1, '--mixed_precision', 'no',
             '--dynamo_backend', 'no', '--main_process_port', free_port(), '-m', 'memlab.train_distill',
             *args(teacher, out, *gkd)], ACCELERATE_USE_CPU=1)
    a, b = results(outs[0]), results(outs[1])
    assert a['world_size'] == 2 and a['replicas_agree'] and a['teacher_outputs'] == 'online'
    assert (a['objective']['on_policy_fraction'], a['objective']['kl_warmup_steps']) == (0.5, 2)
    assert len(losses(a)) == 6 and losses(a) == losses(b)
    assert a['metrics']['pydocs_ppl']['student'] < a['metrics']['pydocs_ppl']['student_before']

def test_topk_shards_generated_once_then_reused(teacher, online, tmp_path):
    "--teacher_topk_only writes the shards; a run reads them back (k = vocabulary, fp32: the online run's training, exactly)."
    shards = tmp_path/'topk'
    topk = ['--teacher_topk_dir', shards, '--teacher_topk_k', 512, '--teacher_topk_dtype', 'float32',
            '--per_device_eval_batch_size', 5]      # batches that do not divide the rows: loaders pad the last one
    r = run([PYTHON, '-m', 'memlab.train_distill', *args(teacher, tmp_path/'gen', *topk, '--teacher_topk_only', 'True')])
    index = json.loads((shards/'index.json').read_text())
    assert (index['k'], index['rows'], index['complete']) == (512, 64, True) and not (tmp_path/'gen').exists()
    stamp = (shards/'index.json').stat().st_mtime_ns
    r = run([PYTHON, '-m', 'memlab.train_distill', *args(teacher, tmp_path/'offline', *topk, '--per_device_train_batch_size', 2,
                                                           '--gradient_accumulation_steps', 2)])
    assert 'writing the teacher' not in r.stdout and (shards/'index.json').stat().st_mtime_ns == stamp
    off, on = results(tmp_path/'offline'), results(online)
    assert off['teacher_outputs'].startswith('top-512 shards')
    assert losses(off) == pytest.approx(losses(on), rel=1e-4)
    assert off['metrics']['pydocs_ppl']['student'] == pytest.approx(on['metrics']['pydocs_ppl']['student'], rel=1e-4)

def test_bitnet_student_exports_packed_weights(teacher, tmp_path, monkeypatch):
    "A BitNet student is written in transformers' own BitNet format: plain from_pretrained runs it, as memlab trained it."
    out = tmp_path/'bitnet'
    run([PYTHON, '-m', 'memlab.train_distill', *args(teacher, out, '--student_model_as_bitnet', 'True', '--per_device_train_batch_size', 4)])
    r = results(out)
    from memlab.distill import perplexity
    from memlab.distill import build_data, DatasetArguments, EvalArguments
    from memlab.models import load_model, load_tokenizer
    from transformers import AutoModelForCausalLM
    from transformers.integrations.bitnet import BitLinear as HFBitLinear
    # transformers' BitLinear compiles two small functions on first use; eager here keeps the test to seconds
    monkeypatch.setattr(torch._dynamo.config, 'disable', True)
    # 2 layers x (q, o: 64x64; k, v: 64x32 (2 KV heads); gate, up, down: 64x128) ternary weights, packed 4 per byte
    assert r['packed']['ternary_params'] == 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) == 73_728
    assert r['packed']['packed_weights'] == 73_728 // 4 and r['packed']['format'] == 'transformers'
    assert json.loads((out/'config.json').read_text())['quantization_config']['quant_method'] == 'bitnet'
    plain = AutoModelForCausalLM.from_pretrained(out).eval()          # transformers alone
    assert sum(isinstance(m, HFBitLinear) for m in plain.modules()) == 14
    ev = build_data(DatasetArguments(dataset_sample_size=64, dataset_max_seq_length=32), EvalArguments(
        ppl_evaluators=[{'name': 'pydocs_ppl', 'dataset': 'pydocs', 'split': 'validation', 'sample_size': 8}]), load_tokenizer(out))
    # the perplexity memlab measured at the end of training, from the exported ternary weights
    assert perplexity(plain, ev.evaluators['pydocs_ppl'])['ppl'] == pytest.approx(r['metrics']['pydocs_ppl']['student'], rel=1e-4)
    card = (out/'README.md').read_text()
    assert 'from_pretrained(folder)' in card and '- bitnet' in card
    # memlab.load_model gives the same model
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(): assert torch.equal(load_model(out)(input_ids=ids).logits, plain(input_ids=ids).logits)

def test_bad_input_is_one_line(teacher, tmp_path):
    "Each refusal: exit 2, one line on stderr, no traceback, the output folder never created (one process runs all cases)."
    from memlab.models import tiny_model
    from memlab.tokenizers import train_tokenizer
    other_vocab = tmp_path/'vocab600'
    tiny_model('llama', vocab_size=600, num_layers=2, hidden_size=64, intermediate_size=128).save_pretrained(other_vocab)
    other_tok = tmp_path/'other_tok'          # a student with the teacher's vocabulary size but another tokenizer
    train_tokenizer('pydocs', vocab_size=512, save_dir=other_tok, take=20, show_progress=False)
    tiny_model('llama', vocab_size=512, num_layers=2, hidden_size=64, intermediate_size=128).save_pretrained(other_tok)
    shards = tmp_path/'shards'
    run([PYTHON, '-m', 'memlab.train_distill', *args(teacher, tmp_path/'x', '--teacher_topk_dir', shards, '--teacher_topk_only', 'True')])
    existing = ['--student_model_config', '', '--copy_teacher_modules', '']   # an existing student: nothing built, nothing copied
    cases = [
        (['--student_model_name_or_path', other_vocab, *existing], 'vocabularies differ (teacher 512, student 600 tokens)'),
        (['--student_model_name_or_path', other_tok, *existing], 'teacher and student tokenizers differ'),
        (['--logits_loss_fn', 'kld'], "unknown logits_loss_fn 'kld'"),
        (['--hs_weight', 1, '--hs_layer_mapper', 'middle'], 'unknown layer mapper'),
        # a projector that cannot map the widths: a wider student and the orthogonal projector (it needs student <= teacher width)
        (['--student_model_config', '{"hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 128}', '--copy_teacher_modules', '',
          '--hs_weight', 1, '--hs_projector', 'orthogonal'], 'student width <= teacher width'),
        (['--teacher_model_name_or_path', other_tok, '--teacher_topk_dir', shards], 'were made with tokenizer'),
        (['--dataset_uri', 'wikimedia/wikipedia'], 'unreachable'),
        (['--teacher_topk_dir', shards, '--on_policy_fraction', 0.5], '--on_policy_fraction needs an online teacher'),
        (['--on_policy_fraction', 0.5, '--ce_weight', 0.1], "the student's own samples"),
    ]
    argvs = [[str(a) for a in args(teacher, tmp_path/f'bad{i}', *bad)] for i, (bad, _) in enumerate(cases)]
    code = ("import json, sys\nfrom accelerate.state import AcceleratorState\nfrom memlab.cli import run_cli\n"
            "from memlab.train_distill import main\nout = []\nfor argv in json.loads(sys.argv[1]):\n"
            "    AcceleratorState._reset_state(True)\n    code, _, err = run_cli(main, argv, prog='memlab_distill')\n"
            "    out.append([code, err])\nprint(json.dumps(out))")
    r = run([PYTHON, '-c', code, json.dumps(argvs)])
    for i, ((bad, msg), (code, err)) in enumerate(zip(cases, json.loads(r.stdout.strip().splitlines()[-1]))):
        lines = [l for l in err.splitlines() if l.strip()]
        assert code == 2 and len(lines) == 1 and msg in lines[0] and 'Traceback' not in err, (bad, code, err[-1500:])
        assert not (tmp_path/f'bad{i}').exists(), bad

def test_help_has_every_distily_flag():
    "Distily's field names (its six argument groups) and Hugging Face's training names are all flags."
    r = run([PYTHON, '-m', 'memlab.train_distill', '--help'])
    for flag in ('student_model_name_or_path', 'student_config_name_or_path', 'student_model_config', 'reinitialize_weights',
                 'copy_teacher_modules', 'student_model_as_bitnet', 'student_model_use_liger', 'teacher_model_name_or_path', 'teacher_load_in_8bit',
                 'teacher_load_in_4bit', 'dataset_uri', 'dataset_subset', 'dataset_split', 'dataset_column_name', 'dataset_sample_size',
                 'dataset_max_seq_length', 'dataset_test_size', 'dataset_shuffle_seed', 'ppl_evaluators', 'ppl_extra_evaluators',
                 'harness_benchmarks', 'harness_benchmark_limit', 'harness_benchmark_bootstrap_iters', 'extra_grad_stats',
                 'logits_weight', 'logits_loss_fn', 'hs_weight', 'hs_loss_fn', 'hs_layer_mapper', 'hs_norm', 'hs_projector',
                 'attn_weight', 'attn_loss_fn', 'attn_layer_mapper', 'attn_norm', 'attn_projector', 'eval_teacher_metrics',
                 'output_dir', 'learning_rate', 'per_device_train_batch_size', 'per_device_eval_batch_size', 'gradient_accumulation_steps',
                 'num_train_epochs', 'max_steps', 'warmup_ratio', 'lr_scheduler_type', 'bf16', 'gradient_checkpointing',
                 'logging_steps', 'eval_steps', 'eval_on_start', 'save_steps', 'report_to', 'optim', 'max_grad_norm',
                 'kl_warmup_steps', 'on_policy_fraction', 'on_policy_prompt_length', 'on_policy_new_tokens', 'on_policy_temperature'):
        assert f"--{flag} " in r.stdout, flag

def test_harness_benchmarks_score_teacher_and_student(teacher, tmp_path):
    "Distily's --harness_benchmarks runs lm-evaluation-harness (a local task, offline) on the teacher and the student: results and card."
    from memlab.evaluation import lm_eval_task
    rows = [{'question': 'The documentation of', 'choices': [' Python', ' zebra'], 'answer': 0},
            {'question': 'import os', 'choices': ['\n', ' banana'], 'answer': 0},
            {'question': 'def main', 'choices': ['():', ' sky'], 'answer': 0}]
    tasks = lm_eval_task(tmp_path/'tasks', 'memlab_pyfacts', rows)
    out = tmp_path/'harness'
    run([PYTHON, '-m', 'memlab.train_distill', *args(teacher, out, '--max_steps', 2, '--harness_benchmarks', '["memlab_pyfacts"]',
                                                     '--harness_include_path', tasks)])
    h = results(out)['harness']['memlab_pyfacts']
    assert set(h) == {'teacher', 'student'} and all(0 <= h[w]['acc'] <= 1 for w in h)
    card = (out/'README.md').read_text()
    assert 'memlab_pyfacts acc (lm-evaluation-harness)' in card
    from huggingface_hub import ModelCard
    assert any('memlab_pyfacts' in str(r.metric_name) or 'memlab_pyfacts' in str(r.dataset_name)
               for r in ModelCard.load(out/'README.md').data.eval_results or []), 'no model-index entry'
    # bad harness flags are one line before anything loads
    bad = [(['--harness_benchmarks', '[1]'], 'JSON list of lm-eval task names'),
           (['--harness_include_path', tmp_path/'none', '--harness_benchmarks', '["x"]'], 'is not a folder')]
    refusals = run_commands([('memlab.train_distill', 'memlab_distill', args(teacher, tmp_path/'bad', *flags)) for flags, _ in bad])
    for (code, lines), (_, msg) in zip(refusals, bad):
        assert code == 2 and len(lines) == 1 and msg in lines[0] and not (tmp_path/'bad').exists(), lines[-30:]

# --- the losses' memory accounting and the chunk size's guards (unit tests, seconds on a CPU) ---

def tensor_bytes():
    "A TorchDispatchMode counting the peak bytes of the tensors created inside it (41_0_losses: `TensorBytes`)."
    import weakref
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    class TensorBytes(TorchDispatchMode):
        def __init__(self): super().__init__(); self.size, self.refs, self.now, self.peak = {}, {}, 0, 0
        def _drop(self, key):
            self.refs[key] -= 1
            if not self.refs[key]: self.now -= self.size.pop(key); del self.refs[key]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor): continue
                key = t.untyped_storage().data_ptr()
                if key not in self.size:
                    if key in given: continue
                    self.size[key], self.refs[key] = t.untyped_storage().nbytes(), 0
                    self.now += self.size[key]; self.peak = max(self.peak, self.now)
                self.refs[key] += 1; weakref.finalize(t, self._drop, key)
            return out
    return TensorBytes()

def test_kl_loss_is_chunked_by_default_at_a_quarter_of_naive_memory():
    "kl_loss() on logits, as a user calls it, holds at most a quarter of what the naive F.kl_div holds, and gives its value."
    import torch.nn.functional as F
    from memlab.distill.losses import kl_loss
    torch.manual_seed(0)
    s0, t = torch.randn(2048, 16384), torch.randn(2048, 16384)
    peaks, vals = {}, {}
    for path in ('naive', 'kl_loss'):
        s = s0.clone().requires_grad_()
        with tensor_bytes() as tb:
            loss = (F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction='sum') / 2048
                    if path == 'naive' else kl_loss(s, t))
            loss.backward()
        peaks[path], vals[path] = tb.peak, loss.item()
    assert peaks['kl_loss'] <= peaks['naive'] / 4, peaks
    assert vals['kl_loss'] == pytest.approx(vals['naive'], rel=1e-5)

def test_fused_head_accounting_on_cpu():
    """tests/test_gpu.py's bound for the fused KD loss (fp32 heads, bf16 autocast, the head's gradient in bf16 as on a GPU),
    on the CPU: 6·V·C (two head casts and the gradient buffer) + 6·N·C + CHUNK_BYTES_PER_LOGIT · chunk · V; one more fp32
    head-sized tensor would not fit."""
    from memlab.distill.losses import CHUNK_BYTES_PER_LOGIT, Hidden, loss_sum
    N, C, V, chunk = 512, 256, 4000, 16
    bound = 6 * V * C + 6 * N * C + CHUNK_BYTES_PER_LOGIT * chunk * V
    torch.manual_seed(0)
    hs, ws = torch.randn(N, C, requires_grad=True), (torch.randn(V, C) / C ** 0.5).requires_grad_()
    ht, wt = torch.randn(N, C), torch.randn(V, C) / C ** 0.5
    with tensor_bytes() as tb:
        with torch.autocast('cpu', dtype=torch.bfloat16):
            loss, _ = loss_sum('kl', Hidden(hs, ws), Hidden(ht, wt), chunk_size=chunk, grad_dtype=torch.bfloat16)
        torch.autograd.grad(loss, (hs, ws))
    assert tb.peak <= bound < tb.peak + 4 * V * C, (tb.peak, bound)

def test_chunk_size_measurement_survives_out_of_memory(monkeypatch):
    "measure_chunk_size under a faked short device: fewer tokens, only the chunks that fit, every allocation guarded."
    import memlab.distill.losses as L
    kw = dict(n_tokens=256, dtype=torch.float32, candidates=(2**13, 2**15, 2**17))
    monkeypatch.setattr(L, '_free_bytes', lambda dev: 2 * 2**20)
    r = L.measure_chunk_size(512, 'cpu', **kw)
    assert (r['n_tokens'], sorted(r['times'])) == (85, [16])
    monkeypatch.setattr(L, '_free_bytes', lambda dev: None)
    def oom(s, t, chunk, compiled, sync):
        if chunk >= 64: raise torch.OutOfMemoryError('fake')
        return 1e-3
    monkeypatch.setattr(L, '_time_chunk', oom)
    assert sorted(L.measure_chunk_size(512, 'cpu', **kw)['times']) == [16]
    def no_memory(*a, **k): raise torch.OutOfMemoryError('fake')
    monkeypatch.setattr(torch, 'randn', no_memory)
    assert L.measure_chunk_size(512, 'cpu', **kw) == {'chunk_size': 16, 'times': {}, 'n_tokens': 256}

def test_chunk_size_measured_once_per_machine(tmp_path, monkeypatch):
    "Ranks starting together: the first measures under the file lock, the others read its result from memlab_home."
    import threading, time
    import memlab.distill.losses as L
    monkeypatch.setenv('MEMLAB_HOME', str(tmp_path))
    calls, got = [], []
    def measure(): calls.append(1); time.sleep(0.2); return 77
    ranks = [threading.Thread(target=lambda: got.append(L._cached_measurement('GPU | vocab 9', measure))) for _ in range(4)]
    for r in ranks: r.start()
    for r in ranks: r.join()
    assert got == [77] * 4 and len(calls) == 1
    assert json.loads((tmp_path/'machine.json').read_text())['kd_chunk_size'] == {'GPU | vocab 9': 77}
