"""A tiny training run through memlab's loop, for the integration tests (launched plainly, with torchrun, or killed on purpose).

python tests/dist_train.py OUT [--dist ddp|fsdp] [--steps N] [--save_every K] [--log_every L] [--die_at_step S] [--die_in_save S]
                             [--signal_at_step S --signal SIGTERM|SIGINT] [--resume]
python tests/dist_train.py ROOT --job NAME:dp,fsdp,tp[,cp][:plain] ... [--bpt] [--steps N] [--save_every K] [--resume] [--catch]
python tests/dist_train.py ROOT --job NAME:data=D ...            (one process reading the rows of D data-parallel processes)
Writes OUT/result_rank{r}.json with the losses and a fingerprint of the final parameters; a --job run (several in one launch, one
after the other in the same processes, each in ROOT/NAME) also writes ROOT/NAME/tensors.safetensors: its final weights and its
first update's gradients, in full. --catch: a job refused with a one-line error writes ROOT/NAME/error_rank{r}.txt and the next
job runs.
"""
import argparse, json, os, signal, sys
from pathlib import Path
import torch
from memlab.cli import cli_main
from memlab.models import tiny_model
from memlab.trainer import Trainer, BatchList
from memlab.train_config import TrainConfig
from memlab.protocol import Callback, causal_lm_loss

def make_batches(n, B=2, T=16, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab // 8, (B, T + 1), generator=g)  # a small alphabet, so the loss can fall quickly
        labels = ids[:, 1:].clone(); labels[:, : (i * 3) % T] = -100
        out.append({'input_ids': ids[:, :-1], 'labels': labels, 'attention_mask': torch.ones(B, T, dtype=torch.long)})
    return out

class Die(Callback):
    "Kill this process with SIGKILL after update `at_step`, or in the middle of writing the checkpoint of `in_save`."
    def __init__(self, at_step=None, in_save=None): self.at_step, self.in_save = at_step, in_save
    def on_step_end(self, t):
        if self.at_step and t.step == self.at_step: os.kill(os.getpid(), signal.SIGKILL)
    def on_save(self, t, folder):
        if self.in_save and t.step == self.in_save: os.kill(os.getpid(), signal.SIGKILL)

class SendSignal(Callback):
    "Send `signum` to this process (rank 0 only) at the end of update `at_step`, as a user's Ctrl-C or a scheduler's SIGTERM would."
    def __init__(self, at_step=None, signum=signal.SIGTERM): self.at_step, self.signum = at_step, signum
    def on_step_end(self, t):
        if self.at_step and t.step == self.at_step and t.accelerator.process_index == 0: os.kill(os.getpid(), self.signum)

@cli_main
def main():
    p = argparse.ArgumentParser()
    p.add_argument('out'); p.add_argument('--dist', default='ddp'); p.add_argument('--steps', type=int, default=8)
    p.add_argument('--save_every', type=int, default=0); p.add_argument('--die_at_step', type=int); p.add_argument('--die_in_save', type=int)
    p.add_argument('--signal_at_step', type=int); p.add_argument('--signal', default='SIGTERM')
    p.add_argument('--resume', action='store_true'); p.add_argument('--accum', type=int, default=2)
    p.add_argument('--log_every', type=int, default=1)
    p.add_argument('--count_comms', action='store_true', help='record which micro-batch each gradient reduction happens in')
    p.add_argument('--reload', action='store_true', help='after training, load the final checkpoint into a new model in this process')
    p.add_argument('--job', action='append', help='NAME:MESH (dp,fsdp,tp[,cp]; :plain = no BPT) or NAME:data=D, into OUT/NAME')
    p.add_argument('--bpt', action='store_true', help='the model made blockwise (BPT, small chunks, fused loss)')
    p.add_argument('--kv_heads', type=int, default=2)
    p.add_argument('--catch', action='store_true', help="record a job's one-line refusal and go on to the next job")
    a = p.parse_args()
    if a.job: return run_jobs(a)
    rank = int(os.environ.get('RANK', 0)); world = int(os.environ.get('WORLD_SIZE', 1))
    cfg = TrainConfig(output_dir=a.out, max_steps=a.steps, save_every=a.save_every, log_every=a.log_every, lr=3e-3, report_to='none',
                      progress=False, per_device_batch_size=2, total_batch_size=2 * world * a.accum, distributed_type=a.dist,
                      resume_from='latest' if a.resume else None, seed=5, warmup_steps=0, scheduler='constant',
                      mixed_precision='no')   # fp32: the tests compare DDP, FSDP and resumed runs to 1e-6
    calls, comms = [0], []
    def loss_fn(model, batch):  # counts micro-batches, so that a gradient reduction knows which one it belongs to
        calls[0] += 1
        return causal_lm_loss(model, batch)
    t = Trainer(tiny_model('llama', seed=1), cfg, BatchList(make_batches(6, seed=100 + rank)),
                callbacks=[Die(a.die_at_step, a.die_in_save), SendSignal(a.signal_at_step, getattr(signal, a.signal))], loss_fn=loss_fn)
    if a.count_comms: count_gradient_reductions(t, lambda: comms.append((calls[0] - 1) % a.accum))
    hist = t.fit()
    fp, reloaded = fingerprint(t.model), None
    if a.reload:  # save-then-load in one process (sharded checkpoints that could not be read back right after saving shipped elsewhere)
        import dataclasses
        t2 = Trainer(tiny_model('llama', seed=7), dataclasses.replace(cfg, resume_from='latest'), BatchList(make_batches(6, seed=100 + rank)),
                     callbacks=[Die(), SendSignal()], loss_fn=loss_fn)
        reloaded = fingerprint(t2.model)
    Path(a.out, f'result_rank{t.accelerator.process_index}.json').write_text(json.dumps(
        {'losses': [h['loss'] for h in hist if 'loss' in h], 'logged_at': [h['step'] for h in hist if 'loss' in h], 'fingerprint': fp, 'world': t.world_size,
         'dist': 'fsdp' if t.fsdp else 'ddp', 'reductions_in_micro_batch': comms, 'reloaded_fingerprint': reloaded}))

MESH_T = 16       # tokens per row of the mesh runs: a multiple of 2 x cp for cp up to 4 (the zig-zag split)

def mesh_batches(steps, data_world, accum, seed=0, B=2, T=MESH_T, vocab=256) -> list:
    "Every micro-batch of `steps` updates, in order: update u's micro-batch m of data rank d at (u * data_world + d) * accum + m."
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps * data_world * accum):
        ids = torch.randint(0, vocab // 8, (B, T + 1), generator=g)
        labels = ids[:, 1:].clone(); labels[0, : (i * 5) % T] = -100      # a different count of targets in every row
        out.append({'input_ids': ids[:, :-1], 'labels': labels, 'attention_mask': torch.ones(B, T, dtype=torch.long)})
    return out

def full(t): return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()   # a collective for a DTensor

class FirstGrads(Callback):
    "Keep every parameter's full gradient at the first update of this process (after the reduction, before clipping)."
    def __init__(self): self.grads = None
    def on_before_optimizer_step(self, t):
        if self.grads is None:
            self.grads = {n: full(p.grad) for n, p in sorted(t.unwrapped_model.named_parameters())}

def run_jobs(a):
    "Each --job in turn, in these processes (one process group, one DeviceMesh per shape)."
    from memlab.core import MemlabError
    from memlab.distributed import make_accelerator
    acc = make_accelerator('no')                                        # the process group, before any mesh
    for job in a.job:
        name, spec, *opt = job.split(':')
        out = Path(a.out)/name
        try: train_on_mesh(a, out, acc, None if spec.startswith('data=') else spec,
                           int(spec[5:]) if spec.startswith('data=') else None, a.bpt and 'plain' not in opt)
        except MemlabError as e:
            if not a.catch: raise
            out.mkdir(parents=True, exist_ok=True)
            (out/f"error_rank{os.environ.get('RANK', 0)}.txt").write_text(str(e))

def train_on_mesh(a, out, acc, mesh, data_world, bpt):
    "A run on process mesh `mesh`, or its one-process reference reading the rows of `data_world` processes."
    from memlab.distributed import data_rank, device_mesh, resolve_mesh
    shape = resolve_mesh(mesh, acc.num_processes) if mesh else None
    rank, data_world = data_rank(shape, acc.process_index) if shape else (0, data_world)
    accum, per_update = a.accum, data_world * a.accum
    every = mesh_batches(a.steps, data_world, accum)
    mine = ([b for u in range(a.steps) for b in every[u * per_update + rank * accum:u * per_update + (rank + 1) * accum]]
            if shape else every)
    cfg = TrainConfig(output_dir=str(out), max_steps=a.steps, save_every=a.save_every, log_every=1, lr=3e-3,
                      report_to='none', progress=False, per_device_batch_size=2, total_batch_size=2 * per_update,
                      mesh_dim=mesh, resume_from='latest' if a.resume else None, seed=5, warmup_steps=0,
                      scheduler='constant', mixed_precision='no', max_grad_norm=0.5)   # clipped: the global norm counts
    model, loss_fn = tiny_model('llama', seed=1, num_layers=2, num_kv_heads=a.kv_heads), causal_lm_loss
    if bpt:
        from memlab.bpt import BPTConfig, add_bpt, bpt_causal_lm_loss
        model = add_bpt(model, BPTConfig(q_chunk_size=4, k_chunk_size=4, ffn_chunk_size=4, head_chunk_size=8,
                                         attention_kernel='torch'))
        loss_fn = bpt_causal_lm_loss
    if shape and shape.cp > 1 and bpt:            # context parallelism is BPT's (without it the loop refuses the mesh)
        from memlab.bpt.context import add_context_parallel, ContextParallelLoss
        group = device_mesh(shape)['cp'].get_group()
        model = add_context_parallel(model, group, q_chunk_size=4, k_chunk_size=4, kernel='torch')
        loss_fn = ContextParallelLoss(loss_fn, group)
    grads = FirstGrads()
    t = Trainer(model, cfg, BatchList(mine, loop=False), callbacks=[grads], loss_fn=loss_fn, accelerator=acc)
    hist = t.fit()
    tensors = {f'param.{k}': full(v) for k, v in sorted(t.unwrapped_model.state_dict().items())}
    tensors.update({f'grad.{k}': v for k, v in (grads.grads or {}).items()})
    if t.is_main:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out/'tensors.safetensors'))
    (out/f'result_rank{t.accelerator.process_index}.json').write_text(json.dumps(
        {'losses': [h['loss'] for h in hist if 'loss' in h], 'fingerprint': fingerprint(t.model), 'world': t.world_size,
         'mesh': list(t.mesh), 'tokens_seen': t.tokens_seen}))

def fingerprint(model) -> list:
    "Sum of every parameter (gathered when sharded), in name order."
    full = {k: v.full_tensor() if hasattr(v, 'full_tensor') else v for k, v in model.state_dict().items()}
    return [float(v.double().sum()) for k, v in sorted(full.items())]

def count_gradient_reductions(trainer, record):
    "Call `record()` at every gradient reduction: a DDP communication hook, or FSDP2's reduce-scatter."
    import torch.distributed as dist
    if trainer.fsdp:
        for name in ('reduce_scatter_single', 'reduce_scatter_tensor'):
            f = getattr(dist, name, None)
            if f is None: continue
            def counted(*args, _f=f, **kw): record(); return _f(*args, **kw)
            setattr(dist, name, counted)
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        def hook(state, bucket): record(); return allreduce_hook(state, bucket)
        trainer.model.register_comm_hook(None, hook)

if __name__ == '__main__': main()
