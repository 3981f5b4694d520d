"""What a run trained on, through the command line: changed data, a changed tokenizer, a zeroed cache, eval_batches (the in-process tests: tests/unit/test_identity.py)."""
import json

from conftest import run_cli
from test_identity import WORDS, cache, files_of, write_corpus  # noqa: F401 - helpers and fixtures the tests share


TINY = ["data=text", "data.vocab_size=300", "model.seq_len=16", "model.n_layer=1", "model.d_model=32",
        "model.n_head=2", "batch_size=4", "log_every=1", "eval_every=0", "eval_samples=8", "sample_tokens=0"]


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def refused(r, *said):
    lines = [line for line in r.stderr.splitlines() if line.startswith("looplib:")]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(s in lines[0] for s in said), lines[0]
    return lines[0]


def test_changed_data_under_a_checkpoint_is_refused_and_the_trained_tokenizer_is_never_retrained(tmp_path, cache):
    """Edit a file, then delete one: each resume is one line naming the file, exit 2, every file of
    the run and of the cache as it was (nothing tokenised, no tokenizer trained). With the data
    back and the tokenizer's cache gone, the resume takes the checkpoint's copy of the tokenizer."""
    corpus, run = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    args = [*TINY, f"data.path={corpus}", "checkpoint.every_steps=2", f"hydra.run.dir={run}"]
    assert run_cli(*args, "max_steps=2", cwd=tmp_path, env=cache).returncode == 0
    before, cached = files_of(run), files_of(tmp_path / "cache")
    original = (corpus / "doc03.txt").read_text()

    (corpus / "doc03.txt").write_text(original + "\nan edit")
    line = refused(run_cli(*args, "max_steps=4", "resume=auto", cwd=tmp_path, env=cache),
                   "resume: the training data and the held-out data differ", f"in {corpus}: doc03.txt edited",
                   "start a new run in a new directory")
    assert "step-00000002" in line
    assert files_of(run) == before and files_of(tmp_path / "cache") == cached
    # sampling the run on the edited data: refused too (a retrained tokenizer: other ids, silently)
    refused(run_cli(str(run), "--tokens", "4", cwd=tmp_path, env=cache, module="looplib.generate"),
            "RUN_DIR: the training data and the held-out data differ", "doc03.txt edited",
            "its tokenizer and prompts would not be the ones its weights learned")
    assert files_of(tmp_path / "cache") == cached
    (corpus / "doc03.txt").write_text(original)
    (corpus / "doc05.txt").unlink()
    refused(run_cli(*args, "max_steps=4", "resume=auto", cwd=tmp_path, env=cache), "doc05.txt missing")
    assert files_of(run) == before and files_of(tmp_path / "cache") == cached

    write_corpus(corpus)  # the data as they were; the tokenizer's cache lost
    (trained,) = (tmp_path / "cache").glob("tokenizer-*")
    copy = (run / "checkpoints" / "step-00000002" / "tokenizer.json").read_bytes()
    assert json.loads((trained / "tokenizer.json").read_bytes()) == json.loads(copy)
    for f in trained.iterdir():
        f.unlink()
    trained.rmdir()
    r = run_cli(*args, "max_steps=4", "resume=auto", cwd=tmp_path, env=cache)
    assert r.returncode == 0, r.stderr
    assert "training a 300-token byte-level BPE" not in r.stdout + r.stderr
    assert (trained / "tokenizer.json").read_bytes() == copy  # put back from the checkpoint
    assert len(losses(run)) == 4
    (trained / "tokenizer.json").unlink()  # and looplib.generate takes the checkpoint's copy too
    r = run_cli(str(run), "--tokens", "4", cwd=tmp_path, env=cache, module="looplib.generate")
    assert r.returncode == 0 and "training a 300-token" not in r.stdout + r.stderr, r.stderr
    assert (trained / "tokenizer.json").read_bytes() == copy


def test_a_changed_tokenizer_file_under_a_checkpoint_is_refused(tmp_path, cache):
    """data.tokenizer=FILE edited in place (two ids swapped: the same size, other ids)."""
    from tokenizers import ByteLevelBPETokenizer
    corpus, run, tok = write_corpus(tmp_path / "corpus"), tmp_path / "run", tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(WORDS)] * 20, vocab_size=280, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save(str(tok))
    args = [a for a in TINY if not a.startswith("data.vocab_size")] + [f"data.path={corpus}", f"data.tokenizer={tok}",
                                                                       f"hydra.run.dir={run}"]
    assert run_cli(*args, "max_steps=2", cwd=tmp_path, env=cache).returncode == 0
    before, cached = files_of(run), files_of(tmp_path / "cache")
    spec = json.loads(tok.read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok.write_text(json.dumps(spec))
    refused(run_cli(*args, "max_steps=4", "resume=auto", cwd=tmp_path, env=cache),
            "resume: the tokenizer differs from that the checkpoint", "tokenizer.json edited")
    assert files_of(run) == before and files_of(tmp_path / "cache") == cached


def test_a_token_cache_zeroed_in_place_is_rebuilt_and_trains_as_a_clean_one(tmp_path, cache):
    corpus = write_corpus(tmp_path / "corpus")
    args = [*TINY, f"data.path={corpus}", "max_steps=3", "checkpoint.enabled=false"]
    assert run_cli(*args, f"hydra.run.dir={tmp_path / 'clean'}", cwd=tmp_path, env=cache).returncode == 0
    (tokens,) = (tmp_path / "cache").glob("text-*/tokens.bin")
    size = tokens.stat().st_size
    with open(tokens, "r+b") as fh:  # same size, every id 0
        fh.write(bytes(size))
    r = run_cli(*args, f"hydra.run.dir={tmp_path / 'again'}", cwd=tmp_path, env=cache)
    assert r.returncode == 0, r.stderr
    assert f"the token cache {tokens.parent} is corrupt (bytes 0-{size} of tokens.bin do not match" in r.stderr
    assert losses(tmp_path / "again") == losses(tmp_path / "clean") and any(tokens.read_bytes())


def test_eval_batches_is_refused_naming_eval_samples(tmp_path):
    r = run_cli("data=random", "batch_size=4", "eval_batches=2", cwd=tmp_path)
    refused(r, "eval_batches: eval_batches is now eval_samples", "use eval_samples=8")
    assert not (tmp_path / "outputs").exists()
