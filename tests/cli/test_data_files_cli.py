"""Your own data through the command line: a memory-mapped corpus, a text run, the vocabulary (the in-process tests: tests/unit/test_data_files.py)."""
import subprocess
import sys
import textwrap
import numpy as np
import pytest

from conftest import REPO, run_cli
from test_data_files import cache_dir, text_files, tok, tok_file  # noqa: F401 - helpers and fixtures (cache_dir: autouse)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_memory_mapped_corpus_trains_with_bounded_memory(tmp_path):
    """128 MB of tokens, 4x the 32 MB the process may grow by: a few training steps, every long
    window read once, then short windows all over the file. The resident set (sampled after
    every read) stays within the bound."""
    from looplib.data.cache import seal

    root, n = tmp_path / "big", 64 << 20
    root.mkdir()
    tokens = np.memmap(root / "tokens.bin", dtype="<u2", mode="w+", shape=(n,))
    block = (np.arange(1 << 24) % 64).astype("<u2")
    for i in range(0, n, len(block)):
        tokens[i:i + len(block)] = block
    tokens.flush()
    del tokens
    np.save(root / "offsets.npy", np.array([0, n], dtype=np.int64))
    seal(root, "<u2")  # meta.json with the checksums a cache carries
    script = textwrap.dedent(f"""
        import pathlib, resource, numpy as np, torch
        from looplib.data import TokenWindows, build_loader
        from looplib.data.cache import load
        from looplib.models import GPT
        from looplib.loss import TokenCrossEntropy
        data, loss = load(pathlib.Path({str(root)!r})), TokenCrossEntropy()
        train = TokenWindows(data, np.arange(1), 1024)
        model = GPT(vocab_size=64, seq_len=1024, n_layer=1, n_head=1, d_model=16)
        for step, batch in zip(range(3), build_loader(train, batch_size=2, seed=0)):  # plain SGD (torch.optim
            (loss(model, batch) / loss.count(batch)).backward()                     # imports dynamo: seconds)
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        rss = lambda: int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() >> 20
        base, peak, sweep = rss(), 0, TokenWindows(data, np.arange(1), 1 << 18)
        for i in range(len(sweep)):  # ru_maxrss would hide growth under the training's own peak
            assert int(sweep[i]["labels"][-1]) == (i + 1) * (1 << 18) % 64
            peak = max(peak, rss())
        for i in torch.randperm(len(train))[:4000].tolist():  # short reads all over the file
            train[i]
            peak = max(peak, rss())
        print(len(train), len(sweep), peak - base)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, cwd=REPO)
    assert r.returncode == 0, r.stderr
    windows, read, grew_mb = map(int, r.stdout.split())
    assert windows == (n - 1) // 1024 and read == (n - 1) >> 18
    assert grew_mb < 32, f"RSS grew by {grew_mb} MB while reading {2 * n >> 20} MB of tokens"


def test_cli_text_run_and_bad_path(tmp_path):
    root, _ = text_files(tmp_path, n=20)
    args = ["data=text", f"data.path={root}", "data.vocab_size=300", "model.seq_len=16", "model.n_layer=1",
            "max_steps=2", "batch_size=4", "sample_tokens=0", "eval_samples=4", "loader.num_workers=1"]
    ok = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert ok.returncode == 0, ok.stderr
    assert "eval_loss" in (tmp_path / "run" / "metrics.jsonl").read_text()
    bad = run_cli("data=instruct", f"data.path={tmp_path / 'missing.jsonl'}", f"hydra.run.dir={tmp_path / 'bad'}",
                  cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert bad.returncode == 2 and not (tmp_path / "bad").exists()
    assert bad.stderr.strip().splitlines()[-1] == f"looplib: error: data.path: {tmp_path / 'missing.jsonl'} does not exist; " \
        "give an existing file, directory or glob in data.path"


def test_vocab_size_follows_the_tokenizer(tok_file, tok):
    from hydra import compose, initialize_config_module

    from looplib.cli.resolvers import register_resolvers
    register_resolvers()  # as looplib.train does
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        given = compose(config_name="config", overrides=["data=instruct", f"data.tokenizer={tok_file}"])
        trained = compose(config_name="config", overrides=["data=text"])
    assert given.data.vocab_size == given.model.vocab_size == tok.get_vocab_size() == 300
    assert trained.data.vocab_size == 8192 and trained.data.tokenizer is None
