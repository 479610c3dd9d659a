"""memlab's GPU paths, checked on the GPU itself: every test here needs CUDA and is skipped without it.

The paths are also run on CPU by the notebooks (through `kernel='native'`, `compiled='aot_eager'`, `check_fused_attention('cpu')`);
what only a GPU can show is that CUDA's own kernels (FlashAttention / memory-efficient SDPA, inductor's generated code) give the
same numbers. On a GPU machine: `pytest -q tests/test_gpu.py`, then `memlab_bench bpt|neurocache|distill --device cuda` for the
speed and memory figures."""
import pytest, torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = 'cuda'

def naive_attention(q, k, v, keep):
    "Dense reference in fp64: GQA by repetition, rows that see no key give 0."
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~keep, float('-inf')), -1).nan_to_num(0.) @ v.double()

@pytest.mark.parametrize('padded', [False, True])
def test_bpt_native_attention_is_exact_on_cuda(padded):
    "BPT's default on CUDA ('auto' = 'native', the device's fused SDPA) against dense attention, output and gradients."
    from memlab.bpt import blockwise_attention, resolve_kernel
    assert resolve_kernel('auto', DEV) == 'native'
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(2, h, 300, 64, generator=g, device=DEV, requires_grad=True) for h in (8, 2, 2))
    pad = torch.ones(2, 300, dtype=torch.bool, device=DEV)
    if padded: pad[1, :37] = False
    keep = torch.ones(300, 300, dtype=torch.bool, device=DEV).tril()[None, None] & pad[:, None, None, :]
    out = blockwise_attention(q, k, v, 128, 128, attention_mask=pad if padded else None)
    ref = naive_attention(q, k, v, keep)
    assert (out.double() - ref).abs().max() < 1e-4
    do = torch.randn(out.shape, generator=g, device=DEV)
    got = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(ref, (q, k, v), do.double())
    for a, b in zip(got, want): assert (a.double() - b).abs().max() < 1e-3

def test_bpt_model_native_matches_hf_on_cuda():
    "A converted Llama (README chunks, fused loss) against the unconverted one on CUDA, bf16 autocast: loss and gradients."
    import copy
    from memlab.bpt import BPTConfig, add_bpt
    from memlab.models import tiny_model
    base = tiny_model('llama').to(DEV)
    m = add_bpt(copy.deepcopy(base), BPTConfig(q_chunk_size=32, k_chunk_size=32, ffn_chunk_size=32, loss_chunk_size=32))
    ids = torch.randint(0, base.config.vocab_size, (2, 100), device=DEV)
    res = []
    for model in (base, m):
        with torch.autocast(DEV, dtype=torch.bfloat16): loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        res.append((loss.detach().float(), [p.grad.float().clone() for p in model.parameters()]))
    assert abs(res[0][0] - res[1][0]) / res[0][0] < 1e-2
    for a, b in zip(res[0][1], res[1][1]): assert (a - b).abs().max() <= 0.05 * a.abs().max() + 1e-6

def test_bpt_compiled_layers_on_cuda():
    "BPT with compiled decoder layers (inductor) against the uncompiled conversion: the same loss and gradients."
    import copy
    from memlab.bpt import BPTConfig, add_bpt
    from memlab.models import tiny_model
    base = tiny_model('llama').to(DEV)
    ids = torch.randint(0, base.config.vocab_size, (2, 128), device=DEV)
    res = []
    for compile in (False, True):
        m = add_bpt(copy.deepcopy(base), BPTConfig(loss_chunk_size=64, compile=compile))
        loss = m(input_ids=ids, labels=ids).loss; loss.backward()
        res.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
    assert torch.allclose(res[0][0], res[1][0], rtol=1e-4)
    for a, b in zip(res[0][1], res[1][1]): assert torch.allclose(a, b, rtol=1e-3, atol=1e-5)

def test_bpt_compiled_loss_chunk_on_cuda():
    "The fused LM-head loss with its chunk compiled by inductor (CUDA's default) equals the eager chunk."
    from memlab.bpt import fused_linear_cross_entropy
    g = torch.Generator(device=DEV).manual_seed(0)
    h = torch.randn(777, 64, generator=g, device=DEV, requires_grad=True)
    W = torch.randn(5000, 64, generator=g, device=DEV, requires_grad=True)
    t = torch.randint(0, 5000, (777,), generator=g, device=DEV); t[:50] = -100
    outs = []
    for compiled in (False, True):
        loss = fused_linear_cross_entropy(h, W, t, 256, compiled=compiled)
        outs.append((loss.detach(), *torch.autograd.grad(loss, (h, W))))
    for a, b in zip(*outs): assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)

@pytest.mark.parametrize('layout', ['left', 'right', 'holes'])
def test_bpt_native_padding_is_exact_and_linear_on_cuda(layout):
    """BPT's native path with a key-padding mask: exact against dense attention, and its peak device memory (forward and
    backward) doubles from T to 2T: no (T, T) mask is made or kept for backward."""
    from memlab.bpt import blockwise_attention
    def case(T, seed=0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        q, k, v = (torch.randn(2, h, T, 64, generator=g, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                   for h in (8, 2, 2))
        pad = torch.ones(2, T, dtype=torch.bool, device=DEV)
        if layout == 'left': pad[0, :T // 4] = False
        elif layout == 'right': pad[1, T - T // 8:] = False
        else: pad[0, T // 3:T // 2] = False; pad[1, ::7] = False
        return q, k, v, pad
    q, k, v, pad = case(300)
    keep = torch.ones(300, 300, dtype=torch.bool, device=DEV).tril()[None, None] & pad[:, None, None, :]
    out = blockwise_attention(q, k, v, 128, 128, attention_mask=pad, kernel='native')
    ref = naive_attention(q, k, v, keep)
    assert (out.double() - ref).abs().max() < 2e-2
    do = torch.randn(out.shape, device=DEV, dtype=out.dtype)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do.double())):
        assert (a.double() - b).abs().max() <= 3e-2 * b.abs().max()
    peaks = []
    for T in (8192, 16384):
        q, k, v, pad = case(T)
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        blockwise_attention(q, k, v, 1024, 1024, attention_mask=pad, kernel='native').sum().backward()
        torch.cuda.synchronize(); peaks.append(torch.cuda.max_memory_allocated() - base)
        del q, k, v, pad
    assert peaks[1] < 2.5 * peaks[0], peaks

def test_bpt_defaults_are_the_fast_path_on_cuda():
    """`add_bpt(model)` with no configuration on CUDA: the CUDA table (native attention, FFN whole, the fused loss), the
    loss of the unconverted model, and peak memory within 1.5x of the README's configuration (no full logits; the
    FFN whole, as the H200 runs found faster, keeps one layer's FFN intermediates in backward)."""
    import transformers
    from memlab.bpt import BPT_DEFAULTS, BPTConfig, add_bpt, bpt_config_of
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=8192, max_position_embeddings=16384)
    ids = torch.randint(0, 8192, (1, 16384), generator=torch.Generator().manual_seed(0)).to(DEV)
    res = {}
    for name, bpt in (('dense', None), ('defaults', 'defaults'),
                      ('README', BPTConfig(q_chunk_size=1024, k_chunk_size=1024, ffn_chunk_size=1024, loss_chunk_size=1024))):
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(cfg).to(DEV).train()
        if bpt == 'defaults':
            add_bpt(m)
            assert {n: getattr(bpt_config_of(m), n) for n in BPT_DEFAULTS['cuda']} == BPT_DEFAULTS['cuda']
        elif bpt is not None: add_bpt(m, bpt)
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        with torch.autocast(DEV, dtype=torch.bfloat16): loss = m(input_ids=ids, labels=ids).loss
        loss.backward(); torch.cuda.synchronize()
        res[name] = (loss.item(), torch.cuda.max_memory_allocated() - base)
        del m, loss
    assert abs(res['defaults'][0] - res['dense'][0]) <= 1e-2 * res['dense'][0]
    assert res["defaults"][1] <= 1.5 * res["README"][1], res

def test_bpt_fused_head_casts_once_on_cuda():
    """The fused LM-head loss under bf16 autocast with its compiled chunk (CUDA's default): one cast of the head per call
    whatever the number of chunks, no (V, C) tensor per chunk, and the loss and gradients of the autocast logits."""
    from memlab.bpt import fused_linear_cross_entropy
    V, C, N = 5000, 64, 1024
    g = torch.Generator(device=DEV).manual_seed(0)
    h = torch.randn(N, C, generator=g, device=DEV, requires_grad=True)
    W = torch.randn(V, C, generator=g, device=DEV, requires_grad=True)
    t = torch.randint(0, V, (N,), generator=g, device=DEV)
    class HeadWork(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self): super().__init__(); self.casts = self.made = 0
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].numel() == V * C: self.casts += 1
            if (isinstance(out, torch.Tensor) and out.numel() == V * C
                    and not any(r.alias_info is not None for r in func._schema.returns)): self.made += 1
            return out
    seen = []
    for size in (N, 128):
        with torch.autocast(DEV, dtype=torch.bfloat16), HeadWork() as w: loss = fused_linear_cross_entropy(h, W, t, size)
        seen.append((w.casts, w.made))
        got = (loss, *torch.autograd.grad(loss, (h, W)))
    assert seen[0] == seen[1] and seen[0][0] == 1 and seen[0][1] <= 3, seen
    with torch.autocast(DEV, dtype=torch.bfloat16): ref = F.cross_entropy((h @ W.T).float(), t)
    want = (ref, *torch.autograd.grad(ref, (h, W)))
    for a, b in zip(got, want): assert (a - b).abs().max() <= 2e-2 * b.abs().max() + 1e-4

def test_bpt_compiled_layers_compile_once_on_cuda():
    """compile=True (inductor) with FFN chunks: the count of compiled graphs stays put over sequence lengths."""
    from torch._dynamo.utils import counters
    from memlab.bpt import BPTConfig, add_bpt
    from memlab.models import tiny_model
    from memlab.runtime import reset_compiled
    reset_compiled(); counters.clear()
    m = add_bpt(tiny_model('llama').to(DEV), BPTConfig(q_chunk_size=64, k_chunk_size=64, ffn_chunk_size=64,
                                                       loss_chunk_size=64, compile=True))
    graphs = []
    for T in (96, 160, 224, 288, 352):
        ids = torch.randint(0, 256, (1, T), device=DEV)
        with torch.autocast(DEV, dtype=torch.bfloat16): m(input_ids=ids, labels=ids).loss.backward()
        graphs.append(counters['stats']['unique_graphs'])
    reset_compiled()
    assert graphs[0] > 0 and graphs[-1] == graphs[1], graphs

def test_neurocache_fused_attention_on_cuda():
    "Joint attention's kernels on CUDA: the once-per-device check (fp32 and bf16, both routes) passes, so they are used."
    from memlab.neurocache.attention import _fusable, check_fused_attention
    assert check_fused_attention(DEV) == (True, '')
    assert _fusable(torch.zeros(1, device=DEV, dtype=torch.bfloat16))

def test_neurocache_fused_attention_refused_on_cuda(monkeypatch):
    """The refusing case of the check above: a kernel whose results differ from plain PyTorch on this GPU is refused, warned
    about once, and remembered, so joint attention's plain route serves (the CPU half, and a kernel that raises:
    20_2_attention's hidden tests)."""
    from memlab.neurocache import attention as A
    good = A.fused_attention
    monkeypatch.setattr(A, 'fused_attention', lambda *a, **k: (lambda o, l: (o + 1e-2, l))(*good(*a, **k)))
    assert A.check_fused_attention(DEV) == (False, 'its results differ from plain PyTorch in torch.float32')
    monkeypatch.setattr(A, '_FUSED_OK', {})
    q = torch.zeros(1, device=DEV, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match='is not usable'): assert not A._fusable(q)
    assert not A._fusable(q)                                                   # remembered: not checked again

@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('padded', [False, True])
def test_neurocache_joint_one_call_matches_reference_on_cuda(dtype, padded):
    """A joint layer in one call (flash attention with grouped-query heads as they are in bf16 without a mask, else
    memory-efficient attention; backward with the joint output and logsumexp, no padding) against the reference route
    (the kernel's output and logsumexp, then joint_mix) on CUDA: output and gradients."""
    from memlab.neurocache.attention import fused_attention, joint_fused_attention, joint_mix
    g = torch.Generator(device=DEV).manual_seed(0)
    B, H, nkv, T, hs, W = 2, 9, 3, 300, 64, 32
    rnd = lambda *s: torch.randn(*s, generator=g, device=DEV).to(dtype)
    q, k, v = (rnd(*s).requires_grad_() for s in ((B, H, T, hs), (B, nkv, T, hs), (B, nkv, T, hs)))
    qd = rnd(B, T, H * hs).requires_grad_()
    km, vm = rnd(nkv, B, T, W, hs), rnd(nkv, B, T, W, hs)
    ok = torch.rand(B, T, W, generator=g, device=DEV) > 0.3
    mask = None
    if padded:
        mask = torch.ones(B, 1, T, T, dtype=torch.bool, device=DEV).tril(); mask[1, ..., :37] = False
    u, lse = fused_attention(q, k, v, mask, mask is None)
    ref = joint_mix(u.transpose(1, 2).reshape(B, T, H * hs), lse.transpose(1, 2), qd, km, vm, ok).view(B, T, H, hs)
    got = joint_fused_attention(q, k, v, mask, mask is None, None, qd, km, vm, ok).transpose(1, 2)
    w = torch.randn(ref.shape, generator=g, device=DEV)
    g_ref, g_got = (torch.autograd.grad((o.float() * w).sum(), (q, k, v, qd)) for o in (ref, got))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    for a, b in zip(g_got, g_ref): torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)

def test_neurocache_training_step_makes_no_host_sync_on_cuda():
    """A steady-state training update of a Neurocache model (joint and separate designs, bf16 autocast, a padded row)
    asks CUDA for no host sync from memlab's code: torch's sync debug mode warns at every sync, and none comes from
    memlab (the model's own code may sync; it is not memlab's)."""
    import traceback, warnings
    from memlab.models import tiny_model
    from memlab.neurocache import NeurocacheConfig, add_neurocache, reset_cache
    g = torch.Generator().manual_seed(0)
    segs = [torch.randint(2, 256, (2, 64), generator=g).to(DEV) for _ in range(2)]
    mask = torch.ones(2, 64, dtype=torch.long, device=DEV); mask[1, :5] = 0
    for design in ('joint', 'separate'):
        model = add_neurocache(tiny_model('llama').to(DEV), NeurocacheConfig(
            cache_size=256, topk=4, compression_factor=4, cache_attention=design, retrieval_map='1:1',
            attention_layers='1-3', lora_r=4)).train()
        reset_cache(model)
        ours = []
        def show(message, category, filename, lineno, file=None, line=None):
            "Where a sync warning comes from: the innermost frame outside torch and warnings."
            site = next((f for f in reversed(traceback.extract_stack()[:-1])
                         if '/torch/' not in f.filename and not f.filename.endswith('warnings.py')), None)
            if site is not None and '/memlab/' in site.filename: ours.append(f"{site.filename}:{site.lineno}: {message}")
        for i, s in enumerate(segs):
            with warnings.catch_warnings():
                warnings.simplefilter('always'); warnings.showwarning = show
                torch.cuda.set_sync_debug_mode('warn' if i else 'default')       # the second update: steady state
                try:
                    with torch.autocast(DEV, dtype=torch.bfloat16):
                        loss = model(input_ids=s, attention_mask=mask if i else None, labels=s).loss
                    loss.backward()
                finally: torch.cuda.set_sync_debug_mode('default')
        assert not ours, (design, ours)

def test_distill_compiled_chunks_and_measured_size_on_cuda(tmp_path, monkeypatch):
    """Distillation's compiled chunk terms (closed-form gradients) equal the eager ones on CUDA; the chunk size is measured
    there, within the free memory, once per machine (kept in memlab_home), not the CPU's."""
    import json
    import memlab.distill.losses as L
    g = torch.Generator(device=DEV).manual_seed(0)
    s = torch.randn(600, 3000, generator=g, device=DEV, requires_grad=True)
    t = torch.randn(600, 3000, generator=g, device=DEV)
    for name in ('kl', 'reverse_kl', 'jsd'):
        vals = []
        for compiled in (False, True):
            total, _ = L.loss_sum(name, s, t, chunk_size=128, compiled=compiled)
            vals.append((total.detach(), torch.autograd.grad(total, s)[0]))
        assert torch.allclose(vals[0][0], vals[1][0], rtol=1e-4)
        assert torch.allclose(vals[0][1], vals[1][1], rtol=1e-3, atol=1e-6)
    r = L.measure_chunk_size(3000, DEV, n_tokens=1024)
    assert r['chunk_size'] in r['times']
    r = L.measure_chunk_size(3000, DEV, n_tokens=1024, memory_fraction=1e-4)    # a nearly full device: no error
    assert r['chunk_size'] >= 16
    monkeypatch.setenv('MEMLAB_HOME', str(tmp_path)); monkeypatch.setattr(L, '_MEASURED', {})
    size = L.auto_chunk_size(3000, device=DEV)
    assert size >= 16 and list(json.loads((tmp_path/'machine.json').read_text())['kd_chunk_size'].values()) == [size]
    monkeypatch.setattr(L, '_MEASURED', {})                                      # a new process on this machine
    monkeypatch.setattr(L, 'measure_chunk_size', lambda *a, **k: pytest.fail('measured twice'))
    assert L.auto_chunk_size(3000, device=DEV) == size

def test_distill_fused_head_in_bf16_on_cuda():
    """The fused KD loss (student and teacher as Hidden) under bf16 autocast multiplies its heads in bf16 as the models would:
    its value and gradients match the naive loss on bf16 logits, and what it holds is within the bound its own buffers
    give (the CPU twin: 41_0_losses, "The fused path's own buffers"), far under the naive loss's."""
    from memlab.distill.losses import CHUNK_BYTES_PER_LOGIT, Hidden, loss_sum
    g = torch.Generator(device=DEV).manual_seed(0)
    N, C, V, chunk = 2048, 512, 32000, 256
    hs = torch.randn(N, C, generator=g, device=DEV, requires_grad=True)
    ws = (torch.randn(V, C, generator=g, device=DEV) / C ** 0.5).requires_grad_()
    ht, wt = torch.randn(N, C, generator=g, device=DEV), torch.randn(V, C, generator=g, device=DEV) / C ** 0.5
    def peak(fn):
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        out = fn(); torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base
    def naive():
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = F.kl_div(F.linear(hs, ws).float().log_softmax(-1), F.linear(ht, wt).float().log_softmax(-1),
                            log_target=True, reduction='sum')   # KL(teacher || student) summed over tokens
        return loss.detach(), torch.autograd.grad(loss, (hs, ws))
    def fused():
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss, _ = loss_sum('kl', Hidden(hs, ws), Hidden(ht, wt), chunk_size=chunk)
        return loss.detach(), torch.autograd.grad(loss, (hs, ws))
    fused()                                                    # compiles the chunk terms (CUDA's default): not measured
    (vn, gn), naive_extra = peak(naive)
    (vf, gf), extra = peak(fused)
    assert torch.allclose(vf, vn, rtol=2e-3)
    for a, b in zip(gf, gn): assert (a - b).abs().max() <= 2e-2 * b.abs().max()
    # the bf16 casts of both heads and the head's bf16 gradient buffer (in the backward: that buffer and the fp32 gradient
    # it becomes), the states' fp32 gradient and the teacher's bf16 states, one chunk of CHUNK_BYTES_PER_LOGIT per logit
    bound = 6 * V * C + 6 * N * C + CHUNK_BYTES_PER_LOGIT * chunk * V
    assert extra <= bound, (extra, bound)
    assert extra < naive_extra / 2, (extra, naive_extra)

def test_bpt_offload_on_cuda():
    """BPT with its checkpoints offloaded to pinned host memory: the same loss and gradients, less device memory at the peak;
    one offloader for all layers, each layer's input prefetched during backward, host buffers page-locked at their exact
    size (no power-of-two rounding) and reused by the next step."""
    import transformers
    from memlab.bpt import BPTConfig, add_bpt
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
                                   num_key_value_heads=4, vocab_size=4096, max_position_embeddings=16384)
    ids = torch.randint(0, 4096, (1, 16384), generator=torch.Generator().manual_seed(0)).to(DEV)
    res = []
    for offload in (False, True):
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(cfg).to(DEV).train()
        add_bpt(m, BPTConfig(q_chunk_size=1024, k_chunk_size=1024, ffn_chunk_size=1024, loss_chunk_size=1024,
                             offload=offload))
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward(); torch.cuda.synchronize()
        res.append((loss.item(), {n: p.grad.float().clone() for n, p in m.named_parameters()},
                    torch.cuda.max_memory_allocated() - base))
        if offload:
            off = m.model.layers[0].offload
            assert all(layer.offload is off for layer in m.model.layers)
            n_layers = len(m.model.layers)
            assert off.stats['prefetched'] >= n_layers - 1, off.stats      # every layer but the last found its input back
            step_bytes, allocations = off.bytes, off.pool.allocations
            assert off.pool._registered and all(b.is_pinned() for b in off.pool._registered.values())
            assert step_bytes <= off.pool.bytes <= step_bytes + 4096 * allocations, (off.pool.bytes, step_bytes)
            m.zero_grad(set_to_none=True)
            with torch.autocast(DEV, dtype=torch.bfloat16): m(input_ids=ids, labels=ids).loss.backward()
            torch.cuda.synchronize()
            assert off.pool.allocations == allocations                        # the second step reuses the buffers
        del m
    (l0, g0, p0), (l1, g1, p1) = res
    # the same numbers (only where the checkpoints wait changed), up to CUDA's non-deterministic gradient reductions
    assert abs(l1 - l0) <= 1e-6 * abs(l0)
    for n in g0: torch.testing.assert_close(g1[n], g0[n], rtol=1e-3, atol=1e-5, msg=n)
    assert p1 < p0, (p0, p1)

def test_distill_liger_backend_matches_memlab_on_cuda():
    """Where liger-kernel is installed: its fused linear JSD, through memlab's backend='liger', gives memlab's values and
    gradients for kl, reverse_kl and jsd (temperature 2, a mask); 'auto' runs whichever measured faster."""
    pytest.importorskip('liger_kernel')
    from memlab.distill.losses import Hidden, objective_sums
    g = torch.Generator(device=DEV).manual_seed(0)
    N, Cs, Ct, V = 512, 256, 384, 8000
    hs = torch.randn(2, N // 2, Cs, generator=g, device=DEV)
    ws = torch.randn(V, Cs, generator=g, device=DEV) / Cs ** 0.5
    ht, wt = torch.randn(2, N // 2, Ct, generator=g, device=DEV), torch.randn(V, Ct, generator=g, device=DEV) / Ct ** 0.5
    mask = torch.rand(2, N // 2, generator=g, device=DEV) > 0.2
    for name, beta in (('kl', None), ('reverse_kl', None), ('jsd', 0.3)):
        res = []
        for backend in ('memlab', 'liger', 'auto'):
            x, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
            total, kd, _, n = objective_sums(name, Hidden(x, w), Hidden(ht, wt), mask=mask, temperature=2.0, beta=beta,
                                             chunk_size=128, backend=backend)
            total.backward()
            res.append((total.detach(), x.grad, w.grad))
        for other in res[1:]:
            torch.testing.assert_close(other[0], res[0][0], rtol=1e-4, atol=1e-4)
            for a, b in zip(other[1:], res[0][1:]): torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)

def test_mixer_assert_causal_on_cuda():
    "The causality check takes CUDA input (its random tokens are drawn on the CPU and moved)."
    from memlab.mixer import assert_causal
    ids = torch.randint(0, 50, (2, 16), device=DEV)
    emb = torch.nn.Embedding(50, 8).to(DEV)
    assert_causal(lambda x: emb(x).cumsum(1), ids, 5, 50)
