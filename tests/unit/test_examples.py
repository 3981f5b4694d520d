"""examples/my_research: a user's own package and config directory, run end to end.

Every extension (precision, optimizer factory, loss, model, data) is selected both ways a
user can: from the user's config directory (``--config-dir``/``hydra.searchpath``, as
``+group=option`` or ``group=option``) and by dotted path (``group._target_=...``). Each
extension's behaviour is then checked against a hand-written reference.
"""
import sys

import torch
import torch.nn.functional as F

from conftest import REPO, tiny_gpt

EXAMPLE = REPO / "examples" / "my_research"
CONF = EXAMPLE / "conf"

sys.path.insert(0, str(EXAMPLE))
from my_research import GRULM, BF16FP32Norms, ByteCorpus, LabelSmoothedLM, Lion, LionFactory  # noqa: E402


def test_example_yaml_files_open_with_their_command():
    for path in CONF.rglob("*.yaml"):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# python -m looplib.train --config-dir examples/my_research/conf"), path


# ------------------------------------------------------------------ behaviour of each extension


class LinearThenNorm(torch.nn.Module):
    """A norm fed by a matmul: under bf16 autocast its input is bf16. (Its class name ends in
    "Norm" on purpose: only leaf modules named like norms count as norms.)"""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.lin(x))


def test_fp32_norms_precision_runs_norms_in_fp32():
    torch.manual_seed(0)
    model, x = LinearThenNorm(), torch.randn(4, 8)
    from looplib import BF16
    bf16 = BF16()
    bf16.setup("cpu")
    with bf16.autocast():
        assert model(x).dtype == torch.bfloat16          # plain bf16: the norm runs in bf16
    precision = BF16FP32Norms()
    precision.setup("cpu")
    with precision.autocast():
        ours = model(x)
        assert model.lin(x).dtype == torch.bfloat16      # matmuls still run in bf16
    assert ours.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.lin(x)
    reference = F.layer_norm(h.float(), (8,), model.norm.weight, model.norm.bias)
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):   # the hooks are gone once the context closes
        assert model(x).dtype == torch.bfloat16


def test_lion_step_matches_the_formula():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    m0, lr, wd, (b1, b2) = torch.zeros(5), 0.1, 0.5, (0.9, 0.99)
    opt = LionFactory(lr=lr, weight_decay=wd, betas=(b1, b2)).create([{"params": [p], "weight_decay": wd}])
    assert isinstance(opt, Lion)
    for _ in range(3):
        g = torch.randn(5)
        expected = p.detach() * (1 - lr * wd) - lr * torch.sign(b1 * m0 + (1 - b1) * g)
        m0 = b2 * m0 + (1 - b2) * g
        p.grad = g.clone()
        opt.step()
        torch.testing.assert_close(p.detach(), expected)
        torch.testing.assert_close(opt.state[p]["exp_avg"], m0)


def test_label_smoothed_loss_sums_and_counts():
    model = tiny_gpt()
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (3, 16))
    labels = torch.randint(0, 64, (3, 16))
    labels[0, :5] = -100
    batch = {"input_ids": ids, "labels": labels}
    loss = LabelSmoothedLM(smoothing=0.2)
    assert loss.count(batch) == 48 - 5
    mean = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), label_smoothing=0.2)
    torch.testing.assert_close(loss(model, batch), mean * 43)


def test_label_smoothed_loss_keeps_accumulation_exact():
    """(batch 8, accumulation 1) == (batch 2, accumulation 4) with unequal counted tokens."""
    from looplib import SGD, Accumulation, fit

    torch.manual_seed(2)
    ids = torch.randint(0, 64, (8, 16))
    labels = torch.randint(0, 64, (8, 16))
    for i in range(8):
        labels[i, : 2 * i] = -100  # micro-batches hold different numbers of counted tokens
    samples = [{"input_ids": ids[i], "labels": labels[i]} for i in range(8)]
    results = []
    for bs, acc in ((8, 1), (2, 4)):
        model = tiny_gpt()
        loader = torch.utils.data.DataLoader(samples, batch_size=bs)
        fit(model, loader, objective=LabelSmoothedLM(0.1), optimizer=SGD(lr=0.5).build(model),
            accumulation=Accumulation(acc), max_steps=1)
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)
    assert not torch.equal(results[0], torch.cat([p.detach().flatten() for p in tiny_gpt().parameters()]))


def test_byte_corpus_follows_the_data_contract():
    corpus = ByteCorpus(seq_len=16, max_bytes=20_000)
    sample = corpus.train[3]
    assert set(sample) == {"input_ids", "labels"}
    assert sample["input_ids"].dtype == torch.long and sample["input_ids"].shape == (16,)
    torch.testing.assert_close(sample["labels"][:-1], sample["input_ids"][1:])
    assert len(corpus.train) > len(corpus.eval) > 0
    text = "def f(x):\n    return 'é'\n"
    assert corpus.decode(corpus.encode(text)) == text
    model = GRULM(vocab_size=256, seq_len=16, d_model=16, n_layer=1)
    assert model(sample["input_ids"][None]).shape == (1, 16, 256)
