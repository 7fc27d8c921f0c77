"""accelerate_c's Trainer with train_sampling_strategy="group_by_length", recording which rows
each micro-batch held and the global torch RNG state as each epoch began (its length-grouped
order is drawn from that RNG, as transformers' is), for tests/test_group_by_length.py.

    trainer_group_by_length.py OUT RESULT [save|resume]   (writes RESULT.<rank> on every process)

`save` checkpoints every 5 optimizer steps; `resume` resumes from the newest checkpoint in OUT
(the rows seen and the parameters then cover the resumed part only).

Also imported by the test for its rows, collator and model."""
from __future__ import annotations

import sys

import torch
from torch import nn

VOCAB, N_ROWS = 64, 45


def make_rows(n=N_ROWS, seed=0, lo=2, hi=14):
    """Rows of random lengths in [lo, hi); row i starts with token i, so a batch tells which
    rows it holds."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(lo, hi, (), generator=g))
        ids = torch.cat([torch.tensor([i]), torch.randint(0, VOCAB, (length - 1,), generator=g)])
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def pad(rows):
    """Right-padding collator (labels -100 on the padding); ignores other keys."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        x = torch.as_tensor(r["input_ids"])
        ids[i, :len(x)], labels[i, :len(x)], mask[i, :len(x)] = x, torch.as_tensor(r["labels"]), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def first_tokens(loader) -> list:
    """The rows of each batch of one pass over `loader`."""
    return [batch["input_ids"][:, 0].tolist() for batch in loader]


class Recorder(nn.Module):
    """A tiny next-token model that records the rows of every batch it is given."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)
        self.seen = []

    def forward(self, input_ids, attention_mask=None, labels=None):
        self.seen.append(input_ids[:, 0].tolist())
        logits = self.head(self.emb(input_ids))
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


def main(out, result, mode=None):
    from accelerate_c import Trainer, TrainerCallback, TrainingArguments

    model = Recorder()

    class EpochStart(TrainerCallback):
        rng, marks = [], []

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.rng.append(torch.get_rng_state())
            self.marks.append(len(model.seen))

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             num_train_epochs=2, train_sampling_strategy="group_by_length", learning_rate=1e-3,
                             use_cpu=True, save_strategy="steps" if mode else "no", save_steps=5, logging_steps=100,
                             disable_tqdm=True, seed=5)
    trainer = Trainer(model, args, data_collator=pad, train_dataset=make_rows(), callbacks=[EpochStart()])
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    acc = trainer.accelerator
    torch.save({"seen": model.seen, "marks": EpochStart.marks, "rng": EpochStart.rng,
                "num_processes": acc.num_processes, "global_step": trainer.state.global_step,
                "params": {k: v.detach().clone() for k, v in model.state_dict().items()}},
               f"{result}.{acc.process_index}")
    acc.wait_for_everyone()


if __name__ == "__main__":
    main(*sys.argv[1:4])
