"""A run's identity and the held-out loss as a property of the weights: a resume on changed data
or a changed tokenizer is refused in one line and writes nothing; a trained tokenizer is never
trained again under a checkpoint; a corrupt token cache is rebuilt, not trained on; the same
weights give the same eval_loss for any batch size (2 processes: tests/dist/test_engines_ddp.py)."""
import random

import pytest
import torch

from conftest import random_tokens, tiny_gpt
from dist_workers import Masked  # random tokens, labels divisible by 3 masked: uneven token counts
from looplib import train_model
from looplib.data import TextCorpus, held_out
from looplib.engines import Engine
from looplib.errors import ConfigError
from looplib.evaluation import evaluate
from looplib.loss import TokenCrossEntropy
from looplib.precision import FP32

WORDS = "the loop trains a model on data with steps and batches of tokens every epoch".split()


def write_corpus(root, n=12, seed=0):
    rng = random.Random(seed)
    root.mkdir(exist_ok=True)
    for i in range(n):
        (root / f"doc{i:02d}.txt").write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12))
                                                         for _ in range(30)))
    return root


def files_of(root):
    """Every file's bytes, but the digest index (``$LOOPLIB_CACHE/index/``, looplib.data.index) and
    the empty files its OS lock is taken on (``locks/``): a cache of what each data file hashed to,
    which a run that reads a changed file brings up to date whether it then trains or is refused;
    the tokenizers and token caches must not move."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.relative_to(root).parts[0] not in ("index", "locks")}


@pytest.fixture
def cache(tmp_path):
    return {"LOOPLIB_CACHE": str(tmp_path / "cache")}


def test_train_model_refuses_a_resume_on_changed_data(tmp_path, monkeypatch):
    """train_model's corpus is built before it is called: the checkpoint's fingerprint is compared
    when the resume finds it, and the run directory stays as it was."""
    monkeypatch.setenv("LOOPLIB_CACHE", str(tmp_path / "cache"))
    corpus, run = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    data = lambda: TextCorpus(str(corpus), seq_len=16, vocab_size=300)  # noqa: E731
    common = dict(max_steps=2, batch_size=4, checkpoint_every=2, device="cpu", run_dir=run, export=None)
    train_model(tiny_gpt(vocab=300), data(), **common)
    before = files_of(run)
    (corpus / "doc07.txt").write_text("another text altogether")
    with pytest.raises(ConfigError, match="doc07.txt edited"):
        train_model(tiny_gpt(vocab=300), data(), **{**common, "max_steps": 4}, resume="auto")
    assert files_of(run) == before


def eval_loss(model, data, samples, batch_size):
    return evaluate(model, held_out(data, samples, batch_size=batch_size), TokenCrossEntropy(), FP32(), Engine("cpu"))


def test_the_held_out_loss_is_the_same_for_any_batch_size():
    """Token-weighted over a fixed set: batch 4 and 8 (and 3, a short last batch) agree to 1e-6,
    and equal the sum of every token's loss over the set divided by the token count."""
    model, data = tiny_gpt(), Masked(random_tokens(21, seed=3))
    got = [eval_loss(model, data, 15, b) for b in (4, 8, 3)]
    assert got[1] == pytest.approx(got[0], abs=1e-6) and got[2] == pytest.approx(got[0], abs=1e-6)
    chosen = [i * 21 // 15 for i in range(15)]
    with torch.no_grad():
        total = sum(TokenCrossEntropy()(model, {k: v[None] for k, v in data[i].items()}).double() for i in chosen)
    count = sum(int((data[i]["labels"] != -100).sum()) for i in chosen)
    assert got[0] == pytest.approx(float(total) / count, abs=1e-6)


def test_every_rank_gets_an_equal_share_of_the_held_out_set():
    """Two ranks: shares of the same 15 sequences, padded to as many batches each; the padding
    carries no loss. The union is the one-process set."""
    data = Masked(random_tokens(21, seed=3))
    one = [s for b in held_out(data, 15, batch_size=4) for s in b["input_ids"]]
    shares = [held_out(data, 15, batch_size=4, rank=r, world=2) for r in (0, 1)]
    assert [len(s) for s in shares] == [2, 2]
    samples = [(ids, labels) for share in shares for b in share for ids, labels in zip(b["input_ids"], b["labels"])]
    real = [ids for ids, labels in samples if (labels != -100).any()]
    assert len(samples) == 16 and len(real) == 15
    assert sorted(map(tuple, map(torch.Tensor.tolist, real))) == sorted(map(tuple, map(torch.Tensor.tolist, one)))


def test_a_large_cache_is_read_in_full_once_after_each_change(tmp_path, monkeypatch):
    """Past FULL_CHECK_BYTES, an unchanged file is checked in sampled chunks; any write through
    the file system (here: one chunk zeroed in place) makes the next open check it in full."""
    from looplib.data import cache
    monkeypatch.setattr(cache, "FULL_CHECK_BYTES", 0)   # every file is "large"
    monkeypatch.setattr(cache, "CHUNK_BYTES", 64)       # 40 chunks of 32 ids
    reads = []
    crc = cache.crc_of
    monkeypatch.setattr(cache, "crc_of", lambda path, *a, **k: reads.append(path.name) or crc(path, *a, **k))
    made = cache.build("t", "k", 1000, lambda w: w.add(list(range(1, 1281))), root=tmp_path)
    assert reads.count("tokens.bin") == 40  # opened once built: in full (then recorded in checked.json)
    for _ in range(2):
        reads.clear()
        assert len(cache.load(made.path)) == 1
        assert 8 <= reads.count("tokens.bin") <= 10  # the first, the last and 8 at random
    with open(made.path / "tokens.bin", "r+b") as fh:
        fh.seek(20 * 64)
        fh.write(bytes(64))
    found, why = cache.opened(made.path)
    assert found is None and why.startswith("corrupt (bytes 1280-1344 of tokens.bin")
