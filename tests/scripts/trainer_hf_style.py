"""A transformers-style training script, ported by changing one import line:

    from transformers import Trainer, TrainingArguments
becomes
    from accelerate_c import Trainer, TrainingArguments

The model follows transformers' convention (takes `labels`, returns {"loss", "logits"}), the
dataset is a list of dict samples (with an extra column the model does not take, dropped as
transformers' remove_unused_columns does), compute_metrics unpacks an EvalPrediction."""
import sys

import numpy as np
import torch
from torch import nn

from accelerate_c import Trainer, TrainingArguments


class Classifier(nn.Module):
    def __init__(self, features=8, classes=3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, classes))

    def forward(self, inputs, labels=None):
        logits = self.body(inputs)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def make_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)) * 2
    labels = torch.randint(0, 3, (n,), generator=g)
    x = centers[labels] + 0.5 * torch.randn(n, 8, generator=g)
    return [{"inputs": x[i], "label": int(labels[i]), "idx": i} for i in range(n)]


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def main(output_dir="hf_style_out"):
    torch.manual_seed(0)
    model = Classifier()
    args = TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=3,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=16,
        learning_rate=1e-2,
        weight_decay=0.01,
        warmup_ratio=0.1,
        eval_strategy="epoch",
        save_strategy="epoch",
        save_total_limit=1,
        logging_steps=5,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=make_split(32, 1), eval_dataset=make_split(24, 2),
                      compute_metrics=compute_metrics)
    before = trainer.evaluate()
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()
    return {"eval_before": before, "eval": metrics}


if __name__ == "__main__":
    print(main(*sys.argv[1:]))
