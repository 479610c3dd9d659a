"""A tiny training run through memlab's loop, for the integration tests (launched plainly, with torchrun, or killed on purpose).

python tests/dist_train.py OUT [--dist ddp|fsdp] [--steps N] [--save_every K] [--log_every L] [--die_at_step S] [--die_in_save S]
                             [--signal_at_step S --signal SIGTERM|SIGINT] [--resume]
Writes OUT/result_rank{r}.json with the losses and a fingerprint of the final parameters.
"""
import argparse, json, os, signal, sys
from pathlib import Path
import torch
from memlab.core import cli_main
from memlab.models import tiny_model
from memlab.training import Trainer, TrainConfig, BatchList, Callback, causal_lm_loss

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
    a = p.parse_args()
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
