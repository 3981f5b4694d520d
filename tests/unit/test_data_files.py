"""Data from the user's files: text, instruct and classification corpora, the token cache, packing,
padding, exact resume, bounded memory, and every bad input as one line."""
import json
import os
import random

import pytest
import torch
from torch import nn

from looplib import optim as lo
from looplib.schedule import WarmupCosine
from looplib.accumulation import Accumulation
from looplib.data.cache import load
from looplib.data import (ClassificationCorpus, Epochs, InstructCorpus, RandomCorpus, TextCorpus, build_loader,
                          next_token_example, shift_labels)
from looplib.errors import ConfigError
from looplib.loop import fit
from looplib.models import GPT
from looplib.loss import TokenCrossEntropy
from looplib.precision import FP32
from looplib.store.checkpoint_dir import find_checkpoint
from looplib.store import resume
from looplib.store.saving import Checkpoints
from looplib.train_state import TrainState
from looplib.telemetry import Telemetry


WORDS = "the a model learns data file token window train loop python code value list index and of to".split()
EOT = "<|endoftext|>"


def sentence(rng, lo=3, hi=12):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPLIB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    """A tiny byte-level BPE trained on local text (no download), with its tokenizer_config.json."""
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("tok")
    rng = random.Random(0)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([sentence(rng) for _ in range(300)], vocab_size=300, min_frequency=1,
                            special_tokens=[EOT], show_progress=False)
    bpe.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOT}))
    return root / "tokenizer.json"


@pytest.fixture(scope="module")
def tok(tok_file):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tok_file))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def instruct_rows(n=24, seed=0):
    rng = random.Random(seed)
    return [{"prompt": sentence(rng, 1, 8) + "?", "completion": " " + sentence(rng, 1, 10)} for _ in range(n)]


def instruct(tmp_path, tok_file, tok, rows=None, **kw):
    path = write_jsonl(tmp_path / "inst.jsonl", rows or instruct_rows())
    kw = {"seq_len": 48, "eval_fraction": 0.0, **kw}
    return InstructCorpus(str(path), tokenizer=str(tok_file), vocab_size=tok.get_vocab_size(), **kw)


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


# --- instruct: loss only on completions, accumulation, packing --------------------------------

def test_instruct_item_count_is_the_completion_tokens_only(tmp_path, tok_file, tok):
    rows = instruct_rows()
    corpus = instruct(tmp_path, tok_file, tok, rows)
    eos = tok.token_to_id(EOT)
    for i, row in enumerate(rows):  # the labels are exactly the completion's ids and the EOS
        item = corpus.train[i]
        assert item["labels"][item["labels"] != -100].tolist() == ids(tok, row["completion"]) + [eos]
        assert item["input_ids"].tolist() == (ids(tok, row["prompt"]) + ids(tok, row["completion"]))
    batch = corpus.collate([corpus.train[i] for i in range(8)])
    expected = sum(len(ids(tok, r["completion"])) + 1 for r in rows[:8])
    assert TokenCrossEntropy().count(batch) == expected
    assert batch["attention_mask"].sum().item() == sum(len(corpus.train[i]["input_ids"]) for i in range(8))


def test_prompt_tokens_carry_no_gradient(tmp_path, tok_file, tok):
    corpus = instruct(tmp_path, tok_file, tok)

    class Spy(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.gpt = GPT(vocab_size=tok.get_vocab_size(), seq_len=48, n_layer=1, n_head=2, d_model=16)

        def forward(self, input_ids):
            self.logits = self.gpt(input_ids)
            self.logits.retain_grad()
            return self.logits

    spy = Spy()
    batch = corpus.collate([corpus.train[i] for i in range(6)])
    TokenCrossEntropy()(spy, batch).backward()
    grad = spy.logits.grad.abs().sum(-1)
    assert (grad[batch["labels"] == -100] == 0).all()
    assert (grad[batch["labels"] != -100] > 0).all()


def one_update(rows, collate, micro, accum, vocab):
    torch.manual_seed(0)
    model = GPT(vocab_size=vocab, seq_len=48, n_layer=2, n_head=2, d_model=32)
    batches = [collate(rows[i:i + micro]) for i in range(0, len(rows), micro)]
    fit(model, batches, objective=TokenCrossEntropy(), optimizer=lo.SGD(lr=0.5, momentum=0.0).build(model),
        max_steps=1, accumulation=Accumulation(accum))
    return model


def test_variable_length_records_accumulate_exactly(tmp_path, tok_file, tok):
    corpus = instruct(tmp_path, tok_file, tok)
    rows = [corpus.train[i] for i in range(8)]
    assert len({len(r["input_ids"]) for r in rows}) > 3 and len({int((r["labels"] != -100).sum()) for r in rows}) > 3
    full = one_update(rows, corpus.collate, 8, 1, tok.get_vocab_size())
    split = one_update(rows, corpus.collate, 2, 4, tok.get_vocab_size())
    for p, q in zip(full.parameters(), split.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_packing_keeps_examples_apart_and_whole(tmp_path, tok_file, tok):
    pytest.importorskip("transformers")
    from looplib.hf import CausalLM

    packed = instruct(tmp_path, tok_file, tok, seq_len=64, pack=True)
    single = instruct(tmp_path, tok_file, tok, seq_len=64)
    assert len(packed.train) < len(single.train) / 2
    k = 0
    for w in range(len(packed.train)):
        item = packed.train[w]
        assert len(item["input_ids"]) <= 64
        starts = (item["position_ids"] == 0).nonzero().flatten().tolist() + [len(item["input_ids"])]
        for a, b in zip(starts, starts[1:]):  # each segment is one whole example, its labels its own
            assert torch.equal(item["input_ids"][a:b], single.train[k]["input_ids"])
            assert torch.equal(item["labels"][a:b], single.train[k]["labels"])
            k += 1
    assert k == len(single.train)  # every example once, in order
    # and no attention across examples: the packed loss is the sum of the examples' own losses
    torch.manual_seed(0)
    model = CausalLM(seq_len=64, model_type="llama", vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    loss, n = TokenCrossEntropy(), len((packed.train[0]["position_ids"] == 0).nonzero())
    together = loss(model, packed.collate([packed.train[0], packed.train[1]]))
    n += len((packed.train[1]["position_ids"] == 0).nonzero())
    apart = sum(loss(model, single.collate([single.train[i]])) for i in range(n))
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-4)
    with pytest.raises(ConfigError, match="data.pack: GPT takes no position_ids"):
        loss(GPT(vocab_size=tok.get_vocab_size(), seq_len=64, n_layer=1, n_head=1, d_model=8),
             packed.collate([packed.train[0]]))


def test_chat_messages_learn_the_assistant_turns_only(tmp_path, tok_file, tok):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    model_dir = tmp_path / "model"
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}" + EOT + "{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tok_file)), eos_token=EOT,
                                         chat_template=template).save_pretrained(model_dir)
    chat = [{"role": "user", "content": "the model"}, {"role": "assistant", "content": "learns data"},
            {"role": "user", "content": "and"}, {"role": "assistant", "content": "the loop"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}] * 3)
    corpus = InstructCorpus(str(path), seq_len=64, tokenizer=str(model_dir), vocab_size=tok.get_vocab_size(),
                            eval_fraction=0.0)
    item = corpus.train[0]
    learned = item["labels"][item["labels"] != -100].tolist()
    assert learned == ids(tok, "learns data" + EOT) + ids(tok, "the loop" + EOT)
    assert corpus.sample_prompt() == ""  # no held-out data here


# --- text: windows, split by document, the cache, memory --------------------------------------

def text_files(tmp_path, n=12, seed=0):
    rng = random.Random(seed)
    root = tmp_path / "texts"
    root.mkdir()
    docs = [" ".join(sentence(rng) + "." for _ in range(rng.randint(2, 6))) for _ in range(n)]
    for i, doc in enumerate(docs):
        (root / f"doc{i:02d}.txt").write_text(doc)
    return root, docs


def test_text_windows_cover_every_document_and_split_by_document(tmp_path, tok_file, tok):
    root, docs = text_files(tmp_path)
    corpus = TextCorpus(str(root), seq_len=8, tokenizer=str(tok_file), vocab_size=tok.get_vocab_size(),
                        eval_fraction=0.25, seed=3)
    eos = tok.token_to_id(EOT)
    streams = {}
    for name, split in (("train", corpus.train), ("eval", corpus.eval)):
        rows = [split[i] for i in range(len(split))]
        for r in rows:  # labels are the next tokens
            assert torch.equal(r["labels"][:-1], r["input_ids"][1:])
        streams[name] = torch.cat([r["input_ids"] for r in rows] + [rows[-1]["labels"][-1:]]).tolist()
    per_doc = [ids(tok, d) + [eos] for d in docs]
    train_docs, eval_docs = corpus.train_docs, corpus.eval_docs
    assert set(train_docs).isdisjoint(eval_docs) and len(train_docs) + len(eval_docs) == len(docs) == 12
    assert len(eval_docs) == 3
    for name, chosen in (("train", train_docs), ("eval", eval_docs)):
        whole = sum((per_doc[j] for j in chosen), [])
        assert streams[name] == whole[:len(streams[name])] and len(whole) - len(streams[name]) < 8


def test_formats_give_the_same_documents(tmp_path, tok_file, tok):
    rows = [{"text": "the model learns", "id": 1}, {"text": "data, \"file\"\nand token", "id": 2}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    with open(tmp_path / "a.csv", "w", newline="") as fh:
        import csv
        w = csv.DictWriter(fh, ["text", "id"])
        w.writeheader()
        w.writerows(rows)
    files = {"jsonl": write_jsonl(tmp_path / "a.jsonl", rows), "json": tmp_path / "a.json", "csv": tmp_path / "a.csv"}
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
        files["parquet"] = tmp_path / "a.parquet"
    except ImportError:
        pass
    eos = tok.token_to_id(EOT)
    for fmt, path in files.items():
        c = TextCorpus(str(path), seq_len=4, tokenizer=str(tok_file), vocab_size=tok.get_vocab_size(), eval_fraction=0)
        got = c.train.tokens.read(0, len(c.train.tokens)).tolist()
        assert got == ids(tok, rows[0]["text"]) + [eos] + ids(tok, rows[1]["text"]) + [eos], fmt


def test_tokenised_once_corrupt_cache_rebuilt_edit_retokenises(tmp_path, tok_file, tok, cache_dir, caplog):
    root, _ = text_files(tmp_path)
    make = lambda: TextCorpus(str(root), seq_len=8, tokenizer=str(tok_file), vocab_size=tok.get_vocab_size())  # noqa: E731
    first = make()
    (entry,) = [p for p in cache_dir.iterdir() if p.name.startswith("text-")]
    stamp = (entry / "meta.json").stat().st_mtime_ns
    again = make()
    assert (entry / "meta.json").stat().st_mtime_ns == stamp  # read from the cache
    expected = first.train[3]["input_ids"]
    assert torch.equal(again.train[3]["input_ids"], expected)
    with open(entry / "tokens.bin", "r+b") as fh:  # a crash mid-write: truncated
        fh.truncate(10)
    rebuilt = make()
    assert "corrupt" in caplog.text and torch.equal(rebuilt.train[3]["input_ids"], expected)
    (root / "doc00.txt").write_text("the loop learns")
    make()
    assert len([p for p in cache_dir.iterdir() if p.name.startswith("text-")]) == 2
    assert not [p for p in cache_dir.iterdir() if ".tmp" in p.name]


def test_trained_tokenizer_when_none_is_given(tmp_path):
    root, docs = text_files(tmp_path)
    corpus = TextCorpus(str(root), seq_len=8, tokenizer=None, vocab_size=300)
    assert corpus.tokenizer_source is None and corpus.vocab_size == 300
    assert corpus.decode(corpus.encode(docs[0])) == docs[0]
    assert corpus.eos_id == corpus.tokenizer.token_to_id(EOT) and corpus.sample_prompt()


def test_resume_mid_epoch_on_file_data_is_bitwise_exact(tmp_path, tok_file, tok):
    corpus = instruct(tmp_path, tok_file, tok, rows=instruct_rows(30))

    def session(root, seed):
        torch.manual_seed(seed)
        model = GPT(vocab_size=tok.get_vocab_size(), seq_len=48, n_layer=2, n_head=2, d_model=32, dropout=0.1)
        optimizer = lo.AdamW(lr=1e-2).build(model)
        epochs = Epochs(build_loader(corpus.train, batch_size=4, seed=5, collate_fn=corpus.collate))
        rows, telemetry = [], Telemetry(enabled=False, log_every=1)
        telemetry.write = rows.append
        ckpt = Checkpoints(root, every_steps=3, keep=2, max_bad_steps=0, config={"a": 1})
        scheduler, precision = WarmupCosine(warmup_steps=2).build(optimizer, 7), FP32()
        ckpt.bind(model=model, optimizer=optimizer, scheduler=scheduler, precision=precision, epochs=epochs)
        kw = dict(objective=TokenCrossEntropy(), optimizer=optimizer, scheduler=scheduler, precision=precision,
                  accumulation=Accumulation(2), telemetry=telemetry, checkpoints=ckpt)
        return model, epochs, rows, ckpt, kw

    model, epochs, full_rows, _, kw = session(None, 0)  # 8 batches an epoch: 4 steps; step 3 is mid-epoch
    fit(model, epochs, max_steps=7, **kw)
    final = {k: v.clone() for k, v in model.state_dict().items()}
    model, epochs, _, _, kw = session(tmp_path / "ck", 0)
    fit(model, epochs, max_steps=4, **kw)
    model, epochs, rows, ckpt, kw = session(tmp_path / "ck", 123)
    state = TrainState()
    resume.load(ckpt, find_checkpoint(tmp_path / "ck"), state)
    assert state.step == 3 and state.batches_seen == 6
    fit(model, epochs, max_steps=7, state=state, **kw)
    losses = lambda rs: {r["step"]: r["loss"] for r in rs if "loss" in r}  # noqa: E731
    assert losses(rows) == {s: v for s, v in losses(full_rows).items() if s > 3}
    assert all(torch.equal(v, final[k]) for k, v in model.state_dict().items())


# --- classification --------------------------------------------------------------------------

def test_classification_labels_names_or_integers(tmp_path, tok_file, tok):
    rows = [{"text": sentence(random.Random(i), 1, 4), "label": ["pos", "neg", "meh"][i % 3]} for i in range(30)]
    corpus = ClassificationCorpus(seq_len=16, path=str(write_jsonl(tmp_path / "c.jsonl", rows)), tokenizer=str(tok_file),
                                  vocab_size=tok.get_vocab_size(), eval_fraction=0.2)
    assert corpus.label_names == ["meh", "neg", "pos"]
    got = sorted((corpus.train[i]["labels"].item(), corpus.decode(corpus.train[i]["input_ids"].tolist()))
                 for i in range(len(corpus.train)))
    want = sorted((corpus.label_names.index(r["label"]), r["text"]) for r in rows)
    assert set(got) < set(want) and len(got) + len(corpus.eval) == 30
    batch = corpus.collate([corpus.train[i] for i in range(4)])
    assert batch["labels"].shape == (4,) and batch["attention_mask"].shape == batch["input_ids"].shape
    corpus.save(tmp_path)
    assert json.loads((tmp_path / "labels.json").read_text())["id2label"] == {"0": "meh", "1": "neg", "2": "pos"}
    ints = ClassificationCorpus(seq_len=16, path=str(write_jsonl(tmp_path / "i.jsonl", [{"text": "a", "label": 2},
                                {"text": "b", "label": 0}])), tokenizer=str(tok_file), vocab_size=tok.get_vocab_size(),
                                eval_fraction=0)
    assert ints.label_names == ["0", "1", "2"] and ints.train[0]["labels"].item() == 2


def test_classification_without_path_is_the_guides_random_data():
    a, b = ClassificationCorpus(seq_len=32), RandomCorpus(32, 30522, 512, 64, num_classes=2, seed=0)
    assert a.vocab_size == 30522 and len(a.train) == 512 and a.collate is None
    for x, y in ((a.train[7], b.train[7]), (a.eval[3], b.eval[3])):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])


# --- labels made in one place; bad input -----------------------------------------------------

def test_unshifted_labels_are_refused():
    ids = torch.randint(0, 50, (2, 9))
    assert TokenCrossEntropy().count(next_token_example(ids[0]) | {}) == 8
    with pytest.raises(ConfigError, match="labels equal its input_ids") as err:
        TokenCrossEntropy().count({"input_ids": ids, "labels": ids.clone()})
    assert "\n" not in str(err.value)
    same = torch.full((1, 9), 7)  # one repeated token: equal to its own shift, rightly
    assert TokenCrossEntropy().count({"input_ids": same, "labels": same}) == 9
    hf = ids.clone()
    hf[:, :4] = -100  # the Hugging Face convention: the prompt masked, the rest unshifted
    with pytest.raises(ConfigError, match="Hugging Face convention.*shift_labels"):
        TokenCrossEntropy().count({"input_ids": ids, "labels": hf})
    assert TokenCrossEntropy().count({"input_ids": ids, "labels": shift_labels({"labels": hf})["labels"]}) == 2 * 5
    # two packed examples of one repeated token each: shifted rightly, though each label equals its input
    packed = {"input_ids": torch.tensor([[3, 3, 3, 5, 5, 5]]), "labels": torch.tensor([[3, 3, 3, 5, 5, 5]]),
              "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}
    assert TokenCrossEntropy().count(packed) == 6


def fifo(path):
    os.mkfifo(path)
    return path


def bad_cases(tmp_path, tok_file, tok):
    t = dict(tokenizer=str(tok_file), vocab_size=tok.get_vocab_size())
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "empty" / "b.md").write_text("  \n")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n')
    write_jsonl(tmp_path / "body.jsonl", [{"body": "x", "id": 1}])
    write_jsonl(tmp_path / "qa.jsonl", [{"question": "x", "answer": "y"}])
    (tmp_path / "latin1.txt").write_bytes(b"the model\ncaf\xe9 au lait\n")
    (tmp_path / "short.txt").write_text("the model")
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a", "label": "pos"}, {"text": "b", "label": "neg"}])
    write_jsonl(tmp_path / "held.jsonl", [{"text": "c", "label": "pos"}, {"text": "d", "label": "maybe"}])
    from tokenizers import ByteLevelBPETokenizer
    bpe = ByteLevelBPETokenizer()  # a tokenizer with no end-of-text token of any known name
    bpe.train_from_iterator(["the model learns"] * 20, vocab_size=270, special_tokens=["<pad>"], show_progress=False)
    (tmp_path / "no_eos").mkdir()
    bpe.save(str(tmp_path / "no_eos" / "tokenizer.json"))
    no_eos = dict(tokenizer=str(tmp_path / "no_eos" / "tokenizer.json"), vocab_size=bpe.get_vocab_size())
    return {
        "no eos for text": (lambda: TextCorpus(str(tmp_path / "short.txt"), 2, **no_eos),
                            "data.tokenizer: the tokenizer at " + no_eos["tokenizer"] + " has no end-of-text token to "
                            "end documents with; use a tokenizer with an eos_token"),
        "no eos for instruct": (lambda: InstructCorpus(str(tmp_path / "qa.jsonl"), 8, **no_eos),
                                "has no end-of-text token to end completions with"),
        "missing path": (lambda: TextCorpus(str(tmp_path / "nope"), 8, **t),
                         f"data.path: {tmp_path / 'nope'} does not exist"),
        "no path": (lambda: TextCorpus(None, 8, **t), "data.path: no files given"),
        "empty files": (lambda: TextCorpus(str(tmp_path / "empty"), 8, **t), "holds no text"),
        "empty files, a tokenizer to train": (lambda: TextCorpus(str(tmp_path / "empty"), 8, vocab_size=300),
                                              f"data.path: {tmp_path / 'empty' / 'a.txt'} and 1 more holds no text"),
        "a named pipe": (lambda: TextCorpus(str(fifo(tmp_path / "pipe")), 8, **t),
                         f"data.path: {tmp_path / 'pipe'} is a named pipe (FIFO), not a file or directory of data"),
        "not JSON": (lambda: TextCorpus(str(tmp_path / "bad.jsonl"), 8, **t), f"{tmp_path / 'bad.jsonl'}:3 is not JSON"),
        "missing field": (lambda: TextCorpus(str(tmp_path / "body.jsonl"), 8, **t),
                          "data.field: " + str(tmp_path / "body.jsonl") + ":1 has no field 'text' (fields: body, id)"),
        "missing prompt": (lambda: InstructCorpus(str(tmp_path / "qa.jsonl"), 8, **t), "(fields: question, answer)"),
        "non-UTF-8": (lambda: TextCorpus(str(tmp_path / "latin1.txt"), 8, **t), "is not UTF-8 text (byte 13"),
        "too short": (lambda: TextCorpus(str(tmp_path / "short.txt"), 64, eval_fraction=0, **t), "too few for one window"),
        "one document": (lambda: TextCorpus(str(tmp_path / "short.txt"), 2, **t), "data.eval_fraction"),
        "unknown eval label": (lambda: ClassificationCorpus(8, str(tmp_path / "train.jsonl"),
                                                            eval_path=str(tmp_path / "held.jsonl"), **t),
                               "data.eval_path: label 'maybe'"),
        "vocab mismatch": (lambda: TextCorpus(str(tmp_path / "short.txt"), 8, tokenizer=str(tok_file), vocab_size=99),
                           "data.vocab_size=99 but the tokenizer"),
    }


def test_every_bad_input_is_one_line_and_leaves_no_cache(tmp_path, tok_file, tok, cache_dir):
    for name, (make, message) in bad_cases(tmp_path, tok_file, tok).items():
        with pytest.raises(ConfigError) as err:
            make()
        assert message in str(err.value) and "\n" not in str(err.value), (name, str(err.value))
        entries = list(cache_dir.iterdir()) if cache_dir.exists() else []  # none half-written
        assert all(".tmp" not in p.name and (not p.name.startswith("text-") or load(p)) for p in entries), name
        assert not [p for p in entries if p.name.startswith("tokenizer-")], name  # none trained on nothing
    replaced = TextCorpus(str(tmp_path / "latin1.txt"), 2, eval_fraction=0, errors="replace", tokenizer=str(tok_file),
                          vocab_size=tok.get_vocab_size())
    assert "caf\ufffd" in replaced.decode(replaced.train.tokens.read(0, len(replaced.train.tokens)).tolist())


def test_two_lists_of_files_that_share_a_file_do_not_wait_on_each_other(tmp_path, caplog):
    """The digests' index holds one lock per list of files (looplib.data.index): a list that only
    shares its first file with one being built does not wait for it; the same list does."""
    import logging
    import threading

    from looplib.data.index import file_digests

    a, b, c = (tmp_path / f"{n}.txt" for n in "abc")
    for f in (a, b, c):
        f.write_text(f"{f.name}\n")
    root = tmp_path / "cache"
    inside, leave = threading.Event(), threading.Event()

    def held(digests):  # the first list's build, still going
        inside.set()
        assert leave.wait(60)

    builder = threading.Thread(target=file_digests, args=([a, b],), kwargs=dict(root=root, then=held))
    builder.start()
    assert inside.wait(60)
    try:
        waited = lambda: any("waiting for another process" in r.getMessage() for r in caplog.records)  # noqa: E731
        with caplog.at_level(logging.WARNING, logger="looplib"):
            got = []
            other = threading.Thread(target=lambda: got.append(file_digests([a, c], root=root)))
            other.start()
            while other.is_alive() and not waited():
                threading.Event().wait(0.05)
            assert not waited()  # it finished while [a, b] is held, without waiting
            assert len(got[0]) == 2 and got[0][0] != got[0][1]
            same = threading.Thread(target=file_digests, args=([a, b],), kwargs=dict(root=root))
            same.start()
            while not waited():
                assert same.is_alive()  # the same list waits for the lock rather than finish
                threading.Event().wait(0.05)
    finally:
        leave.set()
        builder.join()
    same.join()
    other.join()
