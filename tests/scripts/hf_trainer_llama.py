"""One transformers.Trainer script, run on real accelerate (`--backend accelerate`: transformers'
own Trainer) or on accelerate_c (`--backend accelerate_c`: accelerate_c.transformers.Trainer,
the only line that differs). A tiny LlamaForCausalLM from a config, gradient accumulation,
clipping, eval with compute_metrics, save_steps + save_total_limit.

    script.py OUT RESULT.json --backend B [--mp no,bf16] [--part MP --interrupt-at K] [--resume MP]

For each precision in --mp, trains into OUT/<mp> and writes the log history, train_loss,
eval metrics, the checkpoints left and the final parameters (OUT/<mp>/final.pt, rank 0) under
RESULT.json's key <mp>. --part MP then runs the same training into OUT/<MP>-part, stopped after
step K (key "<MP>-part"); --resume MP, in a later process, continues OUT/<MP>-part from its
newest checkpoint (key "<MP>-resumed")."""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

VOCAB, SEQ = 64, 16


def make_model(seed=0, hidden=32, layers=2, vocab=VOCAB):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def make_data(n, seed, vocab=VOCAB, seq=SEQ):
    g = torch.Generator().manual_seed(seed)
    # a learnable pattern (next token = previous + 1) under noise, so eval accuracy moves
    start = torch.randint(0, vocab, (n, 1), generator=g)
    ids = (start + torch.arange(seq)) % vocab
    noise = torch.rand(n, seq, generator=g) < 0.2
    ids = torch.where(noise, torch.randint(0, vocab, (n, seq), generator=g), ids)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def compute_metrics(p):
    preds, labels = p
    preds = preds.argmax(-1)[:, :-1]
    labels = labels[:, 1:]
    mask = labels != -100
    return {"accuracy": float((preds[mask] == labels[mask]).mean())}


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def trainer_class(backend):
    if backend == "accelerate":
        return transformers.Trainer
    from accelerate_c.transformers import Trainer  # the one-line change a user makes

    return Trainer


def run(out, backend, mp, interrupt_at=None, resume=False, max_steps=8, save_model=False):
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4, gradient_accumulation_steps=2,
        max_grad_norm=0.5, learning_rate=3e-3, warmup_steps=2, max_steps=max_steps, logging_steps=1,
        eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=2, save_total_limit=2,
        bf16=(mp == "bf16"), fp16=(mp == "fp16"), use_cpu=True, report_to="none", seed=7, disable_tqdm=True, dataloader_num_workers=0)
    callbacks = [StopAt(interrupt_at)] if interrupt_at else []
    trainer = trainer_class(backend)(model=make_model(), args=args, train_dataset=make_data(48, 1),
                                     eval_dataset=make_data(10, 2), compute_metrics=compute_metrics,
                                     callbacks=callbacks)
    result = trainer.train(resume_from_checkpoint=True if resume else None)
    metrics = trainer.evaluate()
    # every process: under full sharding the weights are gathered (a collective)
    state = trainer.accelerator.get_state_dict(trainer.model)
    if trainer.accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in state.items()}, os.path.join(out, "final.pt"))
    reloaded = None
    if save_model:  # trainer.save_model() writes what from_pretrained loads, equal to the trained weights
        trainer.save_model(os.path.join(out, "saved"))  # every process (a collective under full sharding)
        trainer.accelerator.wait_for_everyone()
    if save_model and trainer.accelerator.is_main_process:  # its state: the others get {} under FSDP
        back = LlamaForCausalLM.from_pretrained(os.path.join(out, "saved")).state_dict()
        reloaded = all(torch.equal(back[k].float(), v.float()) for k, v in state.items() if k in back) and \
            set(back) <= set(state)
    return {"saved_model_reloads": reloaded,"log_history": trainer.state.log_history, "train_loss": result.training_loss,
            "global_step": result.global_step, "eval": metrics,
            "checkpoints": sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")),
            "num_processes": trainer.accelerator.num_processes,
            "accelerator": type(trainer.accelerator).__module__}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("result")
    p.add_argument("--backend", choices=("accelerate", "accelerate_c"), required=True)
    p.add_argument("--mp", default="")
    p.add_argument("--part", default=None)
    p.add_argument("--interrupt-at", type=int, default=4)
    p.add_argument("--resume", default=None)
    p.add_argument("--save-model", action="store_true", help="after training, save_model() and from_pretrained()")
    a = p.parse_args()
    results = {}
    for mp in filter(None, a.mp.split(",")):
        results[mp] = run(os.path.join(a.out, mp), a.backend, mp, save_model=a.save_model)
    if a.part:
        results[f"{a.part}-part"] = run(os.path.join(a.out, f"{a.part}-part"), a.backend, a.part, a.interrupt_at)
    if a.resume:
        results[f"{a.resume}-resumed"] = run(os.path.join(a.out, f"{a.resume}-part"), a.backend, a.resume,
                                             resume=True)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(a.result, "w") as f:
            json.dump(results, f, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
    if a.backend == "accelerate":
        # the reference: torch's gloo process group left alive at interpreter exit aborted one
        # torchrun process once ("terminate called without an active exception", a fresh-clone
        # run under load); end it as a torchrun script should
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
