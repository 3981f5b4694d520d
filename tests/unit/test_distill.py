"""loss=distill in process: equal to a hand-written divergence over the full logits (each kind,
chunked or not, a padded vocabulary, a transformers teacher), peak memory below the unchunked
loss's, accumulation-exact, the two terms in the metrics, and its refusals."""
import copy
import json
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from looplib import optim as lo
from looplib import train_model
from looplib.accumulation import Accumulation
from looplib.distill import Distill
from looplib.errors import ConfigError
from looplib.loop import fit
from looplib.models import GPT
from looplib.run import teacher as reading

from conftest import random_tokens

V = 50


def gpt(seed=0, vocab=V, d_model=16, n_layer=1, **kw):
    """A tiny GPT whose logits spread as a trained model's do (a fresh one's are near uniform, and the
    divergence between two of them too close to 0 for fp32 to tell two ways of summing it apart)."""
    torch.manual_seed(seed)
    model = GPT(vocab_size=vocab, seq_len=32, n_layer=n_layer, n_head=2, d_model=d_model, **kw)
    with torch.no_grad():
        model.ln_f.weight.mul_(20)
    return model


def batch_of(n=4, t=12, vocab=V, seed=1):
    """Tokens with a prompt (-100) of a different length on every row and padding on some."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, t + 1), generator=g)
    labels = ids[:, 1:].clone()
    for i in range(n):
        labels[i, :1 + i % 5] = -100
        if i % 3 == 2:
            labels[i, t - 2:] = -100
    return {"input_ids": ids[:, :-1], "labels": labels}


def teacher_of(objective, teacher):
    objective.teacher = teacher.requires_grad_(False).eval()
    return objective


def by_hand(student, teacher, batch, kind, temperature, alpha, beta=0.5):
    """The full logits of both, the divergence written with F.kl_div, per token, summed."""
    z = student(batch["input_ids"]).float()
    with torch.no_grad():
        zt = teacher(batch["input_ids"]).float()
    labels = batch["labels"]
    keep = labels != -100
    ce = F.cross_entropy(z.flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="sum")
    logp, logq = torch.log_softmax(z / temperature, -1), torch.log_softmax(zt / temperature, -1)
    if kind == "forward_kl":  # kl_div(input, target) = sum target (log target - input)
        d = F.kl_div(logp, logq, log_target=True, reduction="none").sum(-1)
    elif kind == "reverse_kl":
        d = F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)
    else:
        logm = torch.log(beta * logp.exp() + (1 - beta) * logq.exp())
        d = beta * F.kl_div(logm, logp, log_target=True, reduction="none").sum(-1) \
            + (1 - beta) * F.kl_div(logm, logq, log_target=True, reduction="none").sum(-1)
    kd = (d * keep).sum()
    return (1 - alpha) * ce + alpha * temperature ** 2 * kd, ce, kd


@pytest.mark.parametrize("kind, temperature, alpha, beta", [
    ("forward_kl", 2.0, 0.5, 0.5), ("reverse_kl", 1.5, 0.7, 0.5), ("jsd", 1.0, 1.0, 0.5), ("jsd", 3.0, 0.3, 0.2)])
@pytest.mark.parametrize("chunk_size", [7, 4096])
def test_loss_and_gradients_equal_a_hand_written_divergence_over_the_full_logits(kind, temperature, alpha, beta,
                                                                                 chunk_size):
    teacher = gpt(seed=1, d_model=24, n_layer=2)  # another width and depth: only the vocabulary is shared
    student = gpt(seed=0, pad_vocab_to=64)  # padded rows in the student's head: never predicted
    batch = batch_of()
    objective = teacher_of(Distill(temperature=temperature, alpha=alpha, kind=kind, beta=beta, chunk_size=chunk_size),
                           teacher)
    mine = objective(student, batch)
    grads = torch.autograd.grad(mine, list(student.parameters()))
    wide = copy.deepcopy(student).double()  # the reference in float64: both fp32 ways round alike, ~1e-7
    theirs, ce, kd = by_hand(wide, copy.deepcopy(teacher).double(), batch, kind, temperature, alpha, beta)
    expected = torch.autograd.grad(theirs, list(wide.parameters()))
    assert abs(mine.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item()))
    assert kd.item() > 1.0  # the two models differ: the divergence is no zero that anything would match
    scale = max(e.abs().max().item() for e in expected)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-6 * scale)
    n = objective.count(batch)
    metrics = objective.train_metrics()  # each term per token, as the metrics rows give them
    assert metrics["loss_ce"] == pytest.approx(ce.item() / n, rel=1e-6)
    assert metrics["loss_distill"] == pytest.approx(kd.item() / n, rel=1e-6)
    assert objective.train_metrics() == {}  # read once, then reset


def test_a_teacher_equal_to_the_student_adds_nothing_but_its_share_of_the_cross_entropy():
    student = gpt()
    objective = teacher_of(Distill(alpha=0.25, temperature=2.0), copy.deepcopy(student))
    batch = batch_of()
    ce = F.cross_entropy(student(batch["input_ids"]).flatten(0, -2), batch["labels"].flatten(), reduction="sum")
    torch.testing.assert_close(objective(student, batch), 0.75 * ce, rtol=1e-6, atol=1e-6)


def test_a_transformers_directory_is_a_teacher(tiny_pretrained):
    """loss.teacher=DIR of save_pretrained: read as looplib.hf.CausalLM; the loss over its logits."""
    objective = Distill(teacher=str(tiny_pretrained), temperature=2.0, kind="reverse_kl", chunk_size=9)
    student = gpt(vocab=384, d_model=16)
    reading.provide(objective, None)  # what a run does: read the teacher (no corpus to hold its tokens to)
    objective.check_data(None, student)
    objective.attach(student)
    assert type(objective.teacher).__name__ == "CausalLM" and not objective.teacher.training
    assert not any(p.requires_grad for p in objective.teacher.parameters())
    batch = batch_of(vocab=384)
    mine = objective(student, batch)
    theirs, _, _ = by_hand(student, objective.teacher, batch, "reverse_kl", 2.0, 0.5)
    assert abs(mine.item() - theirs.item()) <= 1e-6 * abs(theirs.item())
    half = Distill(teacher=reading.load_teacher(tiny_pretrained), teacher_dtype="bfloat16")  # a module, from Python
    half.attach(student)
    assert {p.dtype for p in half.teacher.parameters()} == {torch.bfloat16}
    assert torch.isfinite(half(student, batch))


class Peak(TorchDispatchMode):
    """Bytes of tensor storage alive at once, at most, among those made inside the mode (the CPU
    allocator's figures as PyTorch's ops see them: every output's storage, freed when it dies)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()

    def free(self, ptr, size):
        self.seen.discard(ptr)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
                if size and ptr not in self.seen:
                    self.seen.add(ptr)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self.free, ptr, size)
        return out


def peak_bytes(step) -> int:
    with Peak() as peak:
        step()
    return peak.peak


def test_peak_memory_is_below_the_unchunked_losss():
    vocab, rows = 4096, 16 * 32
    teacher, student = gpt(seed=1, vocab=vocab, d_model=16), gpt(seed=0, vocab=vocab)
    batch = batch_of(16, 32, vocab)
    objective = teacher_of(Distill(temperature=2.0, chunk_size=16), teacher)
    chunked = peak_bytes(lambda: objective(student, batch).backward())
    whole = peak_bytes(lambda: by_hand(student, teacher, batch, "forward_kl", 2.0, 0.5)[0].backward())
    one_chunk = peak_bytes(lambda: teacher_of(Distill(temperature=2.0, chunk_size=rows), teacher)(student, batch)
                           .backward())
    logits = rows * vocab * 4  # one fp32 (tokens x vocab) tensor
    assert chunked < logits < 2 * logits < whole  # never two whole logit tensors; the plain loss holds more
    assert chunked < one_chunk / 4  # and the chunking is what saves it
    print(f"peak: chunked {chunked / 2**20:.2f} MiB, one chunk {one_chunk / 2**20:.2f} MiB, "
          f"unchunked {whole / 2**20:.2f} MiB, one logits tensor {logits / 2**20:.2f} MiB")


def one_update(batches, accum):
    student = gpt(seed=0)
    objective = teacher_of(Distill(temperature=2.0, alpha=0.6, kind="jsd", chunk_size=5), gpt(seed=1, d_model=24))
    fit(student, batches, objective=objective, max_steps=1, accumulation=Accumulation(accum),
        optimizer=lo.SGD(lr=0.5, momentum=0.0, weight_decay=0.0).build(student))
    return student


def test_batch_8_equals_batch_2_times_accumulation_4():
    batch = batch_of(8, 12)  # rows of 6 to 11 loss-bearing tokens: a mean per micro-batch would weigh them apart
    assert len({int((batch["labels"][i] != -100).sum()) for i in range(8)}) > 3
    split = [{k: v[i:i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    full, parts = one_update([batch], 1), one_update(split, 4)
    for p, q in zip(full.parameters(), parts.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # and both are the step on the mean loss per token of the 8 rows
    student, teacher = gpt(seed=0), gpt(seed=1, d_model=24)
    loss = by_hand(student, teacher, batch, "jsd", 2.0, 0.6)[0] / int((batch["labels"] != -100).sum())
    for p, g, q in zip(student.parameters(), torch.autograd.grad(loss, list(student.parameters())), full.parameters()):
        torch.testing.assert_close(p.detach() - 0.5 * g, q.detach(), rtol=1e-5, atol=1e-6)


def test_refusals():
    objective = teacher_of(Distill(teacher="somewhere"), gpt(vocab=60))
    with pytest.raises(ConfigError) as err:
        objective.check_data(None, gpt())
    assert err.value.key == "loss.teacher" and f"60 tokens, the student {V}:" in str(err.value)

    class Sharding:  # DeepSpeed ZeRO-3 (FSDP2 places the teacher: tests/dist/test_fsdp_no_grad_forward.py)
        keeps_modules, label, device = False, "deepspeed", torch.device("cpu")
    with pytest.raises(ConfigError, match="engine=deepspeed shards"):
        teacher_of(Distill(), gpt()).attach(gpt(), Sharding())
    class Corpus:  # sequences of 40 tokens, and a teacher of 32 positions
        train = [{"input_ids": torch.zeros(40, dtype=torch.long)}]
    with pytest.raises(ConfigError, match="sequences hold 40 tokens, more than the teacher's 32 positions"):
        teacher_of(Distill(), gpt()).check_data(Corpus(), gpt())
    with pytest.raises(ConfigError, match="loss.beta"):
        Distill(kind="jsd", beta=0.0)
    with pytest.raises(ConfigError, match="loss.teacher.*is not a directory"):
        reading.provide(Distill(teacher="/nonexistent/teacher"), None)
    with pytest.raises(ConfigError, match="teacher at /nonexistent/teacher is not read.*load_teacher"):
        Distill(teacher="/nonexistent/teacher").attach(gpt())
    with pytest.raises(ConfigError, match="attach"):
        Distill()(gpt(), batch_of())


def test_train_model_takes_a_teacher_module_and_logs_both_terms(tmp_path):
    """From Python: Distill(teacher=MODULE) through train_model, checked and placed as a run does."""
    path = tmp_path / "metrics.jsonl"
    objective = Distill(teacher=gpt(seed=1, vocab=64, d_model=24), temperature=2.0)
    train_model(gpt(vocab=64), random_tokens(n=16), objective=objective, max_steps=2, batch_size=4, metrics=path,
                log_every=1, device="cpu")
    rows = [json.loads(x) for x in path.read_text().splitlines() if '"loss"' in x]
    assert len(rows) == 2 and all(r["loss"] == pytest.approx(0.5 * r["loss_ce"] + 2 * r["loss_distill"], rel=1e-5)
                                  for r in rows)
    with pytest.raises(ConfigError, match=r"the teacher \(GPT\) has a vocabulary of 50 tokens, the student 64"):
        train_model(gpt(vocab=64), random_tokens(n=16), objective=Distill(teacher=gpt()), max_steps=1, batch_size=4,
                    device="cpu")
