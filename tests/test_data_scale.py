"""Data at the scale users bring: refusals before the tokenizer trains, memory and time that do not
grow with the length of a line, one build per cache entry, tokens brought ready-made."""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from looplib.data import TextCorpus
from looplib.data.readers import CHUNK_BYTES, text_pieces
from looplib.errors import ConfigError

from conftest import REPO


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPLIB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def built(cache_dir) -> list[str]:
    """The cache's entries (tokenizers, token caches), not its index of file digests or its locks."""
    return sorted(p.name for p in cache_dir.iterdir() if p.name not in ("index", "locks")) if cache_dir.exists() else []


def test_one_document_is_refused_before_a_tokenizer_trains(tmp_path, cache_dir, monkeypatch):
    """One plain-text file with the default held-out fraction: the document count is known from
    the file list, so the refusal comes before any training and the cache holds nothing."""
    import tokenizers

    trained = []
    real = tokenizers.ByteLevelBPETokenizer.train_from_iterator
    monkeypatch.setattr(tokenizers.ByteLevelBPETokenizer, "train_from_iterator",
                        lambda *a, **k: trained.append(1) or real(*a, **k))
    (tmp_path / "one.txt").write_text("the model learns the loop. " * 200)
    with pytest.raises(ConfigError) as err:
        TextCorpus(str(tmp_path / "one.txt"), seq_len=8, vocab_size=300)
    assert str(err.value).startswith("data.eval_fraction: ") and "holds 1 document(s)" in str(err.value)
    assert trained == [] and built(cache_dir) == []
    (tmp_path / "rows.jsonl").write_text('{"text": "a b c"}\n\n{"text": "d e f"}\n')
    with pytest.raises(ConfigError, match="holds 2 document"):  # at most one per line that is not blank
        TextCorpus(str(tmp_path / "rows.jsonl"), seq_len=8, vocab_size=300, eval_fraction=0.9)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ConfigError, match="holds no text"):
        TextCorpus(str(tmp_path / "empty"), seq_len=8, vocab_size=300)
    assert trained == [] and built(cache_dir) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_one_line_before_any_work(tmp_path, cache_dir):
    root = tmp_path / "texts"
    root.mkdir()
    for i in range(3):
        (root / f"d{i}.txt").write_text("the model learns " * 20)
    (root / "d1.txt").chmod(0)
    with pytest.raises(ConfigError) as err:
        TextCorpus(str(root), seq_len=8, vocab_size=300)
    assert str(err.value).startswith(f"data.path: {root / 'd1.txt'} cannot be read") and "\n" not in str(err.value)
    assert built(cache_dir) == []


def test_a_refusal_after_training_leaves_no_tokenizer(tmp_path, cache_dir):
    """Too few tokens for one window is known only after tokenising: the tokenizer this run
    trained goes with the refusal."""
    root = tmp_path / "texts"
    root.mkdir()
    for i in range(3):
        (root / f"d{i}.txt").write_text("the model learns")
    with pytest.raises(ConfigError, match="too few for one window"):
        TextCorpus(str(root), seq_len=4096, vocab_size=300, eval_fraction=0)
    assert not [p for p in cache_dir.iterdir() if p.name.startswith("tokenizer-")]


def test_long_lines_are_cut_at_whitespace_or_a_character_boundary(tmp_path):
    words = ("naïve café → " * (CHUNK_BYTES // 8)).encode()  # no newline; multi-byte characters
    solid = ("é" * (CHUNK_BYTES // 2 + 7) + "→" * 1000).encode()  # no whitespace either
    for name, data in (("words", words), ("solid", solid)):
        (tmp_path / name).write_bytes(data)
        pieces = list(text_pieces(tmp_path / name))
        assert "".join(pieces).encode() == data and len(pieces) > 1, name
        assert max(len(p.encode()) for p in pieces) <= CHUNK_BYTES, name
        if name == "words":  # before a space: a byte-level BPE keeps " word" whole
            assert all(p.startswith(" ") for p in pieces[1:])


PEAK = textwrap.dedent("""
    import os, sys, threading, time
    def tree_rss(root):
        kids = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                kids.setdefault(int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]), []).append(int(pid))
            except (OSError, IndexError, ValueError):
                pass
        total, todo = 0, [root]
        while todo:
            pid = todo.pop()
            todo += kids.get(pid, [])
            try:
                total += int(open(f"/proc/{pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                pass
        return total
    """)


def run_with_peak(script: str, timeout: int) -> tuple[subprocess.CompletedProcess | None, int]:
    """``script`` in a fresh interpreter (killed after ``timeout`` s: None), and the peak resident
    memory of its whole process tree (sampled from /proc: ``ru_maxrss`` misses children and
    threads' transient peaks between samples less often than one would hope)."""
    ns = {}
    exec(PEAK, ns)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "2"})
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], ns["tree_rss"](proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, peak[0]
    finally:
        done.set()
        sampler.join()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), peak[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_pathological_lines_train_in_bounded_time_and_memory(tmp_path):
    """A 4 MB line of one repeated character (its tokenizer's training hung for minutes) and a
    6 MB line of words (one piece of 6 MB: hundreds of MB per MB of line) build a corpus within
    the timeout and a bounded peak over the whole process tree."""
    (tmp_path / "same.txt").write_bytes(b"a" * (4 << 20))
    (tmp_path / "words.txt").write_bytes(b" ".join(b"w%d" % (i % 5000) for i in range(6 << 18)))
    (tmp_path / "short.txt").write_text("the model learns\n")
    script = textwrap.dedent(f"""
        import os
        os.environ["LOOPLIB_CACHE"] = {str(tmp_path / "cache")!r}
        from looplib.data import TextCorpus
        c = TextCorpus({str(tmp_path)!r}, seq_len=64, vocab_size=512, eval_fraction=0.3)
        print(len(c.train), c.train.n_tokens + c.eval.n_tokens)
    """)
    done, peak = run_with_peak(script, timeout=150)
    assert done is not None, "building the corpus did not finish in 150 s"
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[0]) > 0
    print("peak MB", peak >> 20)
    assert peak < 1000 << 20, f"peak {peak >> 20} MB over the process tree for 10 MB of text"
