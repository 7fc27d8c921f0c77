"""Under mixed precision a prepared forward converts its outputs to fp32, as accelerate's does;
inside operations.fp32_loss_only() (the Trainers' training step, where only the loss is read)
it converts only the loss. Checked against accelerate 1.15's own prepared model in the same
test (every output and gradient), and the Trainers against transformers' Trainer on accelerate,
with a model whose loss comes out in bf16, so that the loss's conversion shows in the numbers."""
from __future__ import annotations

import collections

import accelerate
import pytest
import torch
import transformers
from torch import nn

import accelerate_c
from accelerate_c.transformers import Trainer as HFTrainerOnUs
from accelerate_c.utils import operations
from accelerate_c.utils.operations import fp32_loss_only
from helpers import fresh_state  # noqa: F401  (autouse: fresh Accelerator states per test)

Pair = collections.namedtuple("Pair", ["loss", "logits"])


class Net(nn.Module):
    """A linear regressor whose loss stays in bf16 under autocast (products and a mean, none of
    which autocast widens), returned in the structure `kind` names."""

    def __init__(self, kind="dict"):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)
        self.kind = kind

    def forward(self, x, labels=None):
        logits = self.lin(x)
        d = logits - labels.to(logits.dtype) if labels is not None else logits
        loss = (d * d).mean()
        if self.kind == "dict":
            return {"loss": loss, "logits": logits}
        if self.kind == "tuple":
            return (loss, logits)
        if self.kind == "list":
            return [loss, logits]
        if self.kind == "namedtuple":
            return Pair(loss, logits)
        return loss  # a bare tensor


def _leaves(out):
    if isinstance(out, dict):
        return list(out.values())
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]


@pytest.mark.parametrize("kind", ["dict", "tuple", "list", "namedtuple", "tensor"])
def test_only_the_loss_is_converted_inside_and_everything_outside(kind):
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    ref = accelerate.Accelerator(mixed_precision="bf16", cpu=True).prepare(Net(kind))
    ours = accelerate_c.Accelerator(mixed_precision="bf16", cpu=True).prepare(Net(kind))
    want = ref(x, labels=y)
    assert _leaves(want)[0].dtype == torch.float32  # accelerate's conversion; the model's loss is bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _leaves(Net(kind)(x, labels=y))[0].dtype == torch.bfloat16  # the model's own loss
    got = ours(x, labels=y)
    assert type(got) is type(want)
    for a, b in zip(_leaves(got), _leaves(want)):  # outside: every output as accelerate's
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b)
    with fp32_loss_only():
        got = ours(x, labels=y)
    assert type(got) is type(want)
    first, *rest = _leaves(got)
    assert first.dtype == torch.float32 and torch.equal(first, _leaves(want)[0])
    for a, b in zip(rest, _leaves(want)[1:]):  # the rest unconverted: bf16, the values accelerate widened
        assert a.dtype == torch.bfloat16 and torch.equal(a.float(), b)
    # backward from the loss: the same gradients as accelerate's
    _leaves(want)[0].backward()
    first.backward()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_the_context_ends_with_its_block_and_nests():
    net = accelerate_c.Accelerator(mixed_precision="bf16", cpu=True).prepare(Net())
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    with fp32_loss_only():
        with fp32_loss_only():
            pass
        assert net(x, labels=y)["logits"].dtype == torch.bfloat16
    assert net(x, labels=y)["logits"].dtype == torch.float32
    with pytest.raises(RuntimeError):
        with fp32_loss_only():
            raise RuntimeError("boom")
    assert net(x, labels=y)["logits"].dtype == torch.float32


class Rows(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


@pytest.mark.parametrize("trainer", ["transformers_subclass", "own"])
def test_trainers_train_as_transformers_on_accelerate_and_evaluate_in_fp32(tmp_path, monkeypatch, trainer):
    """bf16, accumulation 3 (a division bf16 would round), clipping: the losses, grad norms, eval loss and parameters of
    transformers.Trainer on accelerate, from accelerate_c.transformers.Trainer and from
    accelerate_c.Trainer; their training forwards convert only the loss (counted), their
    evaluation forwards everything (predictions in fp32, as transformers' on accelerate)."""
    common = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, use_cpu=True, report_to="none",
                  disable_tqdm=True, seed=3, optim="adamw_torch", bf16=True, gradient_accumulation_steps=3,
                  max_grad_norm=0.1, learning_rate=0.05, logging_steps=1, max_steps=5, save_strategy="no")
    ref = transformers.Trainer(model=Net(), args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **common),
                               train_dataset=Rows(60, 1), eval_dataset=Rows(12, 2))
    # transformers' Trainer on accelerate first, whole: building ours resets accelerate's state
    ref.train()
    a, pa = ref.evaluate(), ref.predict(Rows(6, 4))
    if trainer == "own":
        ours = accelerate_c.Trainer(model=Net(), args=accelerate_c.TrainingArguments(output_dir=str(tmp_path / "us"),
                                                                                     **common),
                                    train_dataset=Rows(60, 1), eval_dataset=Rows(12, 2))
    else:
        ours = HFTrainerOnUs(model=Net(), args=transformers.TrainingArguments(output_dir=str(tmp_path / "us"), **common),
                             train_dataset=Rows(60, 1), eval_dataset=Rows(12, 2))
    calls = []
    real = operations._convert_loss_to_fp32
    monkeypatch.setattr(operations, "_convert_loss_to_fp32", lambda out: calls.append(1) or real(out))
    ours.train()
    assert len(calls) == 5 * 3  # every training micro-batch, and nothing else
    logs = [[(h["loss"], h["grad_norm"]) for h in t.state.log_history if "loss" in h] for t in (ref, ours)]
    assert len(logs[0]) == len(logs[1]) == 5
    for step, ((la, na), (lb, nb)) in enumerate(zip(*logs)):
        # accelerate_c.Trainer logs the loss rounded to 4 decimals (docs/trainer.md, differences)
        assert lb == pytest.approx(la, rel=1e-6, abs=6e-5 if trainer == "own" else 0), f"step {step} loss"
        assert nb == pytest.approx(na, rel=1e-5), f"step {step} grad norm"
    for p, q in zip(ours.model.parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    calls.clear()
    b = ours.evaluate()
    assert calls == []
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
    pb = ours.predict(Rows(6, 4))
    assert pa.predictions.dtype == pb.predictions.dtype
    torch.testing.assert_close(torch.as_tensor(pb.predictions), torch.as_tensor(pa.predictions), rtol=1e-5, atol=1e-5)


def test_a_loss_function_or_label_smoothing_reads_converted_outputs(tmp_path, monkeypatch):
    """Where the Trainer reads more than the loss (compute_loss_func), the forward converts
    everything, as accelerate's: the function sees fp32 logits."""
    seen = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        seen.append(outputs["logits"].dtype)
        d = outputs["logits"] - labels
        return (d * d).mean()

    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, use_cpu=True,
                                          report_to="none", disable_tqdm=True, bf16=True, max_steps=2,
                                          save_strategy="no")
    t = HFTrainerOnUs(model=Net(), args=args, train_dataset=Rows(8, 1), compute_loss_func=loss_func)
    t.train()
    assert seen == [torch.float32, torch.float32]


class Teacher(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.body(x)
        return (self.head(h), h)  # (logits, hidden), as a transformers model with return_dict=False


class Student(nn.Module):
    """Reads the teacher's second output: accelerate's prepared teacher gives it in fp32."""

    def __init__(self, teacher):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.teacher = nn.Linear(8, 16), [teacher]

    def forward(self, x, labels=None):
        s = self.body(x)
        d = s - self.teacher[0](x)[1]
        return {"loss": (d * d).mean(), "logits": s}


def test_models_called_inside_the_forward_and_hooks_see_what_accelerate_gives():
    """Only the outermost prepared forward converts the loss alone: a prepared model it calls
    (a teacher) converts all its outputs, and with a forward hook on the model (its own or a
    global one) nothing is left unconverted. Against accelerate's prepared models."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(5))
    want = {}
    for name, mod in (("ref", accelerate), ("ours", accelerate_c)):
        acc = mod.Accelerator(mixed_precision="bf16", cpu=True)
        teacher = acc.prepare_model(Teacher(), evaluation_mode=True)
        student = acc.prepare(Student(teacher))
        if name == "ref":
            want = student(x)
            continue
        with fp32_loss_only():
            got = student(x)
        assert torch.equal(got["loss"], want["loss"])  # differs if the teacher's hidden comes back bf16
        assert got["logits"].dtype == torch.bfloat16  # the outer forward's own logits: not converted
        seen = []
        handle = student.register_forward_hook(lambda m, i, out: seen.append(out["logits"].dtype))
        with fp32_loss_only():
            student(x)
        handle.remove()
        glob = torch.nn.modules.module.register_module_forward_hook(
            lambda m, i, out: seen.append(out["logits"].dtype) if m is student else None)
        with fp32_loss_only():
            student(x)
        glob.remove()
        assert seen == [torch.float32, torch.float32]
        with fp32_loss_only():
            assert student(x)["logits"].dtype == torch.bfloat16  # hooks gone: loss only again


Named = collections.namedtuple("Named", ["logits", "loss"])


class NamedNet(Net):
    def forward(self, x, labels=None):
        out = super().forward(x, labels)
        return Named(out["logits"], out["loss"])


def test_a_namedtuple_loss_field_not_first_is_converted(tmp_path, monkeypatch):
    """accelerate_c.Trainer takes the loss by name (a namedtuple's `loss` field), transformers'
    first element: both are converted, so the own Trainer trains as with every output
    converted (accelerate's conversion, patched in for the reference run)."""
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    net = accelerate_c.Accelerator(mixed_precision="bf16", cpu=True).prepare(NamedNet())
    with fp32_loss_only():
        out = net(x, labels=y)
    assert out.loss.dtype == out.logits.dtype == torch.float32  # the first element too (transformers' pick)

    def run(tag):
        args = accelerate_c.TrainingArguments(output_dir=str(tmp_path / tag), use_cpu=True, bf16=True,
                                              per_device_train_batch_size=4, max_steps=3,
                                              gradient_accumulation_steps=3, logging_steps=1, report_to="none",
                                              disable_tqdm=True, save_strategy="no", learning_rate=0.05, seed=3)
        t = accelerate_c.Trainer(model=NamedNet(), args=args, train_dataset=Rows(36, 1))
        t.train()
        return [h["loss"] for h in t.state.log_history if "loss" in h], [p.detach().clone() for p in t.model.parameters()]

    la, pa = run("loss_only")
    monkeypatch.setattr(operations, "_convert_loss_to_fp32", operations.convert_to_fp32)
    lb, pb = run("everything")
    assert la == lb
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
