"""Sampler seeding, loader settings, the default corpus."""
import pytest
import torch

from looplib.data import EpochSampler, Epochs, PythonSource, RandomTokens, TokenChunks, build_loader


def test_epoch_sampler_is_seeded_per_epoch():
    a, b = EpochSampler(50, seed=1), EpochSampler(50, seed=1)
    assert list(a) == list(b) and sorted(a) == list(range(50))
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == list(range(50))
    assert list(EpochSampler(50, seed=2)) != first


def test_epoch_sampler_splits_ranks_and_resumes():
    full = EpochSampler(10, seed=0).order()
    r0, r1 = EpochSampler(10, seed=0, rank=0, world=2), EpochSampler(10, seed=0, rank=1, world=2)
    assert sorted(list(r0) + list(r1)) == sorted(full) and len(r0) == 5
    r0.set_epoch(0, start=3)
    assert list(r0) == full[0::2][3:]


def test_epochs_stream_counts_position():
    loader = build_loader(RandomTokens(10, 4, 16), batch_size=3, seed=0)
    epochs = Epochs(loader)
    stream = iter(epochs)
    assert len(list(next(stream))) == 4 and epochs.batches_seen == 4
    next(stream)
    assert epochs.epoch == 1


def test_loader_settings():
    ds = RandomTokens(8, 4, 16)
    loader = build_loader(ds, batch_size=4, seed=0, num_workers=2, persistent_workers=True,
                          prefetch_factor=3, pin_memory="auto", device=torch.device("cpu"))
    assert loader.num_workers == 2 and loader.persistent_workers and loader.prefetch_factor == 3
    assert loader.pin_memory is False  # auto: only when training on CUDA
    assert [b["input_ids"].shape for b in loader] == [(4, 4), (4, 4)]


def test_token_chunks_shift_labels():
    ds = TokenChunks(torch.arange(11), 5)
    assert len(ds) == 2
    assert ds[1]["input_ids"].tolist() == [5, 6, 7, 8, 9] and ds[1]["labels"].tolist() == [6, 7, 8, 9, 10]


def test_python_source_corpus(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for i in range(20):
        (root / f"mod{i:02d}.py").write_text(f"def function_{i}(x):\n    return x * {i} + 1\n" * 30)
    corpus = PythonSource(seq_len=16, vocab_size=300, root=str(root), cache_dir=str(tmp_path / "c"))
    assert len(corpus.train) > 0 and len(corpus.eval) > 0
    text = "def function_3(x):\n"
    assert corpus.decode(corpus.encode(text)) == text
    assert corpus.train.tokens.array.max() < 300
    # the tokenizer and the tokens in data.cache_dir, as the other data's are cached
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "c").iterdir() if p.name != "locks") == ["pysource", "tokenizer"]
    again = PythonSource(seq_len=16, vocab_size=300, root=str(root), cache_dir=str(tmp_path / "c"))
    assert again.train.tokens.path == corpus.train.tokens.path  # from the cache
    assert all(torch.equal(again.train[i]["input_ids"], corpus.train[i]["input_ids"]) for i in range(len(corpus.train)))


def test_python_source_without_files(tmp_path):
    from looplib.errors import ConfigError
    with pytest.raises(ConfigError, match="too few to train on and hold one out"):
        PythonSource(seq_len=8, root=str(tmp_path), cache_dir=str(tmp_path))


def test_a_tokenizer_that_learned_fewer_tokens_than_asked_says_so(tmp_path, caplog):
    """The log said "training a 8192-token tokenizer" of one that came out with 7,396 (issue 43): it
    now says "up to", and then how many were learned and how many embeddings go unused."""
    import logging
    from looplib.data.tokenizer import trained
    texts = ["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20]
    with caplog.at_level(logging.INFO, logger="looplib"):
        info = trained(lambda: iter(texts), 2048, tmp_path / "tok", None, sum(map(len, texts)))
    learned = info.tokenizer.get_vocab_size()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert learned < 2048 and "of up to 2048 tokens" in said
    assert f"the tokenizer learned {learned} tokens" in said and f"{2048 - learned} never used" in said
