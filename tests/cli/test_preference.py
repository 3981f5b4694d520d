"""Preference pairs and objectives: data=preference (tokenised pairs, loss only on completions, a
pair in one micro-batch, split by pair, truncation, bad input), loss=dpo|simpo|orpo (ln 2 at the
first step, equal to a hand-written loss and its gradients, accumulation-exact, resume bit for
bit) and their refusals."""
import copy
import json
import re
import logging
import math
import random

import pytest
import torch
import torch.nn.functional as F

from looplib import optim as lo
from looplib.accumulation import Accumulation
from looplib.data.preference import PreferenceCorpus
from looplib.errors import ConfigError
from looplib.loop import fit
from looplib.models import GPT
from looplib.preference import DPO, ORPO, SimPO

from conftest import run_cli
from test_data_files import EOT, cache_dir, ids, sentence, tok, tok_file, write_jsonl  # noqa: F401 (fixtures)

LN2 = torch.tensor(math.log(2), dtype=torch.float32).item()


def pair_rows(n=24, seed=0):
    rng = random.Random(seed)
    return [{"prompt": sentence(rng, 1, 8) + "?", "chosen": " " + sentence(rng, 1, 10),
             "rejected": " " + sentence(rng, 1, 10)} for _ in range(n)]


def pairs(tmp_path, tok_file, tok, rows=None, **kw):  # noqa: F811
    path = write_jsonl(tmp_path / "pairs.jsonl", rows or pair_rows())
    kw = {"seq_len": 48, "eval_fraction": 0.0, **kw}
    return PreferenceCorpus(str(path), tokenizer=str(tok_file), vocab_size=tok.get_vocab_size(), **kw)


def gpt(vocab, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return GPT(vocab_size=vocab, seq_len=48, n_layer=2, n_head=2, d_model=32, dropout=dropout)


# --- data=preference -------------------------------------------------------------------------

def test_pair_is_two_sequences_in_one_batch_with_loss_on_completions_only(tmp_path, tok_file, tok):  # noqa: F811
    rows = pair_rows()
    corpus = pairs(tmp_path, tok_file, tok, rows)
    eos = tok.token_to_id(EOT)
    for i, row in enumerate(rows):
        item = corpus.train[i]
        for side in ("chosen", "rejected"):
            labels = item[f"{side}_labels"]
            assert labels[labels != -100].tolist() == ids(tok, row[side]) + [eos]
            assert item[f"{side}_input_ids"].tolist() == ids(tok, row["prompt"]) + ids(tok, row[side])
    batch = corpus.collate([corpus.train[i] for i in range(3)])
    assert batch["input_ids"].shape[0] == 6 and batch["chosen"].tolist() == [True] * 3 + [False] * 3
    for j in range(3):  # row j is pair j's chosen sequence, row 3 + j its rejected one
        n = len(corpus.train[j]["rejected_input_ids"])
        assert batch["input_ids"][3 + j, :n].tolist() == corpus.train[j]["rejected_input_ids"].tolist()
        assert batch["attention_mask"][3 + j].sum() == n
    assert DPO().count(batch) == 3


def test_held_out_split_is_by_pair(tmp_path, tok_file, tok):  # noqa: F811
    rows = pair_rows(40)
    corpus = pairs(tmp_path, tok_file, tok, rows, eval_fraction=0.25)
    assert len(corpus.train) + len(corpus.eval) == 40 and len(corpus.eval) == 10
    texts = {(r["prompt"] + r["chosen"], r["prompt"] + r["rejected"]) for r in rows}
    seen = set()
    for split in (corpus.train, corpus.eval):
        for i in range(len(split)):
            item = split[i]
            got = tuple(corpus.decode(item[f"{s}_input_ids"].tolist()) for s in ("chosen", "rejected"))
            assert got in texts  # both halves of one record, never one half in each split
            seen.add(got)
    assert len(seen) == len({t for t in texts})


def test_long_pairs_are_cut_as_set_and_counted(tmp_path, tok_file, tok, caplog):  # noqa: F811
    rows = [{"prompt": "the model learns data?", "chosen": " data file token" * 2, "rejected": " a loop"},
            {"prompt": "code?", "chosen": " value", "rejected": " list"}]
    prompt, chosen = ids(tok, rows[0]["prompt"]), ids(tok, rows[0]["chosen"])
    with caplog.at_level(logging.WARNING, logger="looplib"):
        start = pairs(tmp_path, tok_file, tok, rows, seq_len=16)
    assert "1 of 2 training pairs are longer than seq_len + 1 = 17 tokens" in caplog.text
    eos = tok.token_to_id(EOT)
    seq, rejected = prompt + chosen + [eos], prompt + ids(tok, rows[0]["rejected"]) + [eos]
    cut = min(len(prompt), len(seq) - 17)
    assert 0 < cut < len(prompt)  # prompt_start: the prompt's start dropped, its end kept, from both sequences
    item = start.train[0]
    assert item["chosen_input_ids"].tolist() == seq[cut:][:16]
    assert item["rejected_input_ids"].tolist() == rejected[cut:][:-1]
    end = pairs(tmp_path, tok_file, tok, rows, seq_len=16, truncation="completion_end")
    c = end.train[0]["chosen_input_ids"].tolist()  # the prompt whole, the completion cut at its end
    assert c == (prompt + chosen)[:16] and len(prompt) < 16
    assert end.train[0]["rejected_input_ids"].tolist()[:len(prompt)] == prompt
    with pytest.raises(ConfigError, match="data.truncation"):
        pairs(tmp_path, tok_file, tok, rows, truncation="middle")


def test_identical_completions_are_warned_with_their_count(tmp_path, tok_file, tok, caplog):  # noqa: F811
    rows = pair_rows(10)
    for r in rows[:3]:
        r["rejected"] = r["chosen"]
    with caplog.at_level(logging.WARNING, logger="looplib"):
        pairs(tmp_path, tok_file, tok, rows)
    assert "3 of 10 training pairs have a chosen completion identical to the rejected one" in caplog.text


def test_a_record_without_chosen_names_file_record_and_field(tmp_path, tok_file, tok):  # noqa: F811
    rows = pair_rows(5)
    del rows[3]["chosen"]
    with pytest.raises(ConfigError) as err:
        pairs(tmp_path, tok_file, tok, rows)
    assert err.value.key == "data.chosen_field"
    assert "pairs.jsonl:4" in str(err.value) and "'chosen'" in str(err.value)


# --- the objectives --------------------------------------------------------------------------

def batch_of(corpus, n=4, start=0):
    return corpus.collate([corpus.train[i] for i in range(start, start + n)])


def test_first_dpo_step_is_ln2_with_a_frozen_copy_and_with_lora(tmp_path, tok_file, tok):  # noqa: F811
    corpus = pairs(tmp_path, tok_file, tok)
    batch = batch_of(corpus)
    full = DPO(beta=0.1)
    model = gpt(tok.get_vocab_size())
    full.attach(model)
    assert full.reference is not model and not any(p.requires_grad for p in full.reference.parameters())
    assert (full(model, batch) / full.count(batch)).item() == LN2
    pytest.importorskip("peft")
    from looplib.peft import LoRA
    adapted = LoRA(r=4).wrap(gpt(tok.get_vocab_size()))
    lora = DPO(beta=0.1)
    lora.attach(adapted)
    assert lora.reference is None and lora.adapters is not None  # no second copy
    loss = lora(adapted, batch)
    assert (loss / lora.count(batch)).item() == LN2
    loss.backward()  # the adapters' B matrices get a gradient; the base none
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in adapted.named_parameters() if "lora_B" in n)
    with torch.no_grad():  # once the adapters move, the policy leaves the reference (switched off) behind
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
    assert abs((lora(adapted, batch) / 4).item() - LN2) > 1e-4


def sequence_logps(model, batch):
    """Hand-written: log-softmax, the label's log-probability, summed over completion tokens."""
    logp = torch.log_softmax(model(batch["input_ids"]).float(), -1)
    labels = batch["labels"]
    picked = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * (labels != -100)
    return picked.sum(-1), (labels != -100).sum(-1)


def by_hand(kind, model, reference, batch, beta, ls=0.0, gamma=0.5):
    p, n = sequence_logps(model, batch)
    c = batch["chosen"]
    if kind in ("ipo", "simpo", "orpo"):
        p = p / n
    if kind == "simpo":
        x = beta * (p[c] - p[~c]) - gamma
        return (-(1 - ls) * F.logsigmoid(x) - ls * F.logsigmoid(-x)).sum()
    if kind == "orpo":
        odds = (p[c] - p[~c]) - (torch.log(1 - torch.exp(p[c])) - torch.log(1 - torch.exp(p[~c])))
        return (-p[c] - beta * F.logsigmoid(odds)).sum()
    with torch.no_grad():
        r, _ = sequence_logps(reference, batch)
    r = r / n if kind == "ipo" else r
    h = (p[c] - p[~c]) - (r[c] - r[~c])
    if kind == "ipo":
        return ((h - 1 / (2 * beta)) ** 2).sum()
    return (-(1 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h)).sum()


@pytest.mark.parametrize("kind, make", [
    ("sigmoid", lambda: DPO(beta=0.3, label_smoothing=0.1)), ("ipo", lambda: DPO(beta=0.3, type="ipo")),
    ("simpo", lambda: SimPO(beta=2.0, gamma=0.5, label_smoothing=0.1)), ("orpo", lambda: ORPO(beta=0.2))])
def test_loss_and_gradients_equal_a_hand_written_one(tmp_path, tok_file, tok, kind, make):  # noqa: F811
    corpus = pairs(tmp_path, tok_file, tok)
    batch = batch_of(corpus, 6)
    start = gpt(tok.get_vocab_size())
    model = copy.deepcopy(start)
    with torch.no_grad():  # away from the reference, so the DPO loss is not ln 2 everywhere
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    objective = make()
    if isinstance(objective, DPO):
        objective.attach(start)
    mine = objective(model, batch)
    grads = torch.autograd.grad(mine, list(model.parameters()))
    ls = getattr(objective, "label_smoothing", 0.0)
    theirs = by_hand(kind, model, start, batch, objective.beta, ls)
    expected = torch.autograd.grad(theirs, list(model.parameters()))
    assert abs(mine.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item()))
    assert abs(mine.item() / 6 - LN2) > 1e-3 or kind != "sigmoid"
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    metrics = objective.train_metrics()
    assert set(metrics) >= {"reward_chosen", "reward_rejected", "reward_accuracy", "reward_margin"}
    assert metrics["reward_margin"] == pytest.approx(metrics["reward_chosen"] - metrics["reward_rejected"])


def one_update(corpus, rows, micro, accum, vocab):
    model = gpt(vocab)
    objective = DPO(beta=0.5)
    objective.attach(model)
    with torch.no_grad():  # a policy apart from its reference: gradients that differ from pair to pair
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batches = [corpus.collate(rows[i:i + micro]) for i in range(0, len(rows), micro)]
    fit(model, batches, objective=objective, optimizer=lo.SGD(lr=0.5, momentum=0.0, weight_decay=0.0).build(model), max_steps=1,
        accumulation=Accumulation(accum))
    return model


def test_dpo_batch_8_equals_batch_2_times_accumulation_4(tmp_path, tok_file, tok):  # noqa: F811
    corpus = pairs(tmp_path, tok_file, tok)
    rows = [corpus.train[i] for i in range(8)]
    assert len({len(r["chosen_input_ids"]) + len(r["rejected_input_ids"]) for r in rows}) > 3
    full = one_update(corpus, rows, 8, 1, tok.get_vocab_size())
    split = one_update(corpus, rows, 2, 4, tok.get_vocab_size())
    for p, q in zip(full.parameters(), split.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # and both are the step on the mean loss per pair (the item is the pair, not the token or the sequence)
    model = gpt(tok.get_vocab_size())
    start = copy.deepcopy(model)
    with torch.no_grad():
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    grads = torch.autograd.grad(by_hand("sigmoid", model, start, corpus.collate(rows), 0.5) / 8,
                                list(model.parameters()))
    for p, g, q in zip(model.parameters(), grads, full.parameters()):
        torch.testing.assert_close(p.detach() - 0.5 * g, q.detach(), rtol=1e-5, atol=1e-6)


# --- the command line: refusals, metrics, resume ------------------------------------------------

TINY = ["model.n_layer=1", "model.seq_len=32", "batch_size=4", "log_every=1", "sample_tokens=0", "eval_samples=4"]


def write_pairs(tmp_path, n=40):
    return write_jsonl(tmp_path / "pairs.jsonl", pair_rows(n))


def test_dpo_on_data_without_pairs_and_pairs_under_loss_lm_are_refused(tmp_path):
    inst = write_jsonl(tmp_path / "inst.jsonl", [{"prompt": "a?", "completion": " b"}] * 20)
    r = run_cli("data=instruct", f"data.path={inst}", "loss=dpo", *TINY, f"hydra.run.dir={tmp_path / 'a'}",
                cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "pairs" in line and "data=preference" in line and "Traceback" not in r.stderr
    assert not (tmp_path / "a" / "metrics.jsonl").exists() and not (tmp_path / "a" / "checkpoints").exists()
    r = run_cli("data=preference", f"data.path={write_pairs(tmp_path)}", *TINY, f"hydra.run.dir={tmp_path / 'b'}",
                cwd=tmp_path)
    assert r.returncode == 2 and "loss=dpo" in r.stderr.strip().splitlines()[-1], r.stderr
    assert not (tmp_path / "b" / "metrics.jsonl").exists()


def test_dpo_run_logs_rewards_and_resumes_bit_for_bit(tmp_path):
    data = write_pairs(tmp_path)
    job = ["data=preference", f"data.path={data}", "loss=dpo", *TINY, "eval_every=3", "checkpoint.every_steps=3"]
    one = {"OMP_NUM_THREADS": "1"}  # bit for bit on the CPU: one thread's order of sums (as tests/test_resume_cli.py)
    r = run_cli(*job, "max_steps=6", f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path, env=one)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    first = next(x for x in rows if x.get("step") == 1 and "loss" in x)
    assert first["loss"] == LN2 and first["reward_margin"] == 0.0 and "pairs_per_s" in first
    assert any("eval_reward_accuracy" in x for x in rows)
    part = tmp_path / "part"
    assert run_cli(*job, "max_steps=3", f"hydra.run.dir={part}", cwd=tmp_path, env=one).returncode == 0
    r = run_cli(*job, "max_steps=6", "resume=auto", f"hydra.run.dir={part}", cwd=tmp_path, env=one)
    assert r.returncode == 0, r.stderr
    assert (part / "model.safetensors").read_bytes() == (tmp_path / "full" / "model.safetensors").read_bytes()


# --- parity with TRL's DPOTrainer (pip install 'looplib[test]' brings trl) -----------------------

@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_dpo_equals_trl_dpo_trainer_loss_gradients_and_rewards(tmp_path, tiny_pretrained, kind):
    """TRL's own loss (``DPOTrainer._compute_loss``) on its own collated batch of a tiny Llama,
    against looplib's DPO on the same tokens: loss, gradients and logged rewards within 1e-6 (fp32)."""
    pytest.importorskip("trl")
    datasets, transformers = pytest.importorskip("datasets"), pytest.importorskip("transformers")
    from trl import DPOConfig, DPOTrainer

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_pretrained))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_pretrained), dtype=torch.float32)
    rng = random.Random(0)
    rows = [{"prompt": sentence(rng, 2, 8) + "?", "chosen": " " + sentence(rng, 1, 9),
             "rejected": " " + sentence(rng, 1, 9)} for _ in range(4)]
    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], per_device_train_batch_size=4, beta=0.3,
                     use_cpu=True, max_length=64, loss_type=[kind], save_strategy="no", disable_tqdm=True)
    trainer = DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    torch.manual_seed(0)
    with torch.no_grad():  # the policy away from the reference (TRL's copy of the starting weights)
        for p in trainer.model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    trainer.model.train()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    theirs = trainer._compute_loss(trainer.model, batch, False)
    expected = torch.autograd.grad(theirs, params)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    class Logits(torch.nn.Module):  # looplib's side: the model as a function of ids and mask -> logits
        def __init__(self, hf):
            super().__init__()
            self.hf = hf

        def forward(self, input_ids, attention_mask=None):
            return self.hf(input_ids=input_ids, attention_mask=attention_mask).logits

    ids, done = batch["input_ids"], batch["completion_mask"][:, 1:] == 0
    ours_batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:].masked_fill(done, -100),
                  "attention_mask": batch["attention_mask"][:, :-1], "chosen": torch.arange(8) < 4}
    objective = DPO(beta=0.3, type=kind)
    objective.reference = Logits(trainer.ref_model).eval()
    policy = Logits(trainer.model)
    mine = objective(policy, ours_batch) / objective.count(ours_batch)
    grads = torch.autograd.grad(mine, params)
    assert abs(mine.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item())) and abs(theirs.item() - LN2) > 1e-3
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    metrics = objective.train_metrics()
    # rewards are beta x differences of summed log-probabilities near -100, whose fp32 spacing is 8e-6: TRL's
    # fused head sums in another order, so they agree to that, not to 1e-6
    for name in ("chosen", "rejected", "margins", "accuracies"):
        ours = {"margins": "reward_margin", "accuracies": "reward_accuracy"}.get(name, f"reward_{name}")
        assert metrics[ours] == pytest.approx(logged[f"rewards/{name}"], abs=1e-5)
    assert metrics["logp_chosen"] == pytest.approx(logged["logps/chosen"], abs=1e-4)


def test_chat_pairs_carry_loss_on_the_last_assistant_turn_only(tmp_path, tiny_pretrained):
    """Chat form: the prompt's turns in a separate list or inside each completion's messages; the
    conversation rendered with the tokenizer's chat template, loss on the final assistant turn."""
    pytest.importorskip("transformers")
    turns = [{"role": "user", "content": "two plus two?"}, {"role": "assistant", "content": "four"},
             {"role": "user", "content": "and three?"}]
    good, bad = [{"role": "assistant", "content": "five"}], [{"role": "assistant", "content": "six"}]
    rows = [{"prompt": turns, "chosen": good, "rejected": bad}, {"chosen": turns + good, "rejected": turns + bad}] * 3
    corpus = PreferenceCorpus(str(write_jsonl(tmp_path / "chat.jsonl", rows)), seq_len=200, tokenizer=str(tiny_pretrained),
                              vocab_size=384, eval_fraction=0.0)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny_pretrained / "tokenizer.json"))
    for i in range(2):  # both layouts give the same tokens
        item = corpus.train[i]
        for side, answer in (("chosen", "five"), ("rejected", "six")):
            labels = item[f"{side}_labels"]
            learnt = tok.decode(labels[labels != -100].tolist(), skip_special_tokens=False)
            assert learnt.startswith(answer) and "four" not in learnt  # the earlier assistant turn is prompt
            text = tok.decode(item[f"{side}_input_ids"].tolist(), skip_special_tokens=False)
            assert text.startswith("<|user|>\ntwo plus two?") and "four" in text
    assert corpus.train[0]["chosen_input_ids"].tolist() == corpus.train[1]["chosen_input_ids"].tolist()


def test_dpo_under_lora_from_the_command_line_starts_at_ln2(tmp_path):
    pytest.importorskip("peft")
    r = run_cli("data=preference", f"data.path={write_pairs(tmp_path)}", "loss=dpo", "+peft=lora", "peft.allow_random_base=true", *TINY,
                "max_steps=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "adapters switched off" in r.stdout + r.stderr
    assert re.search(r"step 1/2  loss 0\.6931  [\d,]+ pairs/s", r.stdout + r.stderr)  # (was "pai/s")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == LN2 and rows[1]["loss"] != LN2 and (tmp_path / "run" / "adapter").is_dir()


def test_dpo_on_two_processes_equals_one_process_of_twice_the_batch(tmp_path):
    """+engine=ddp, 2 processes of 2 pairs = 1 process of 4 pairs: the same losses, rewards and weights
    (the window's pairs are counted over both ranks)."""
    from safetensors.torch import load_file
    from test_engines_ddp import LOSS_RTOL, WEIGHT_ATOL, torchrun

    job = ["data=preference", f"data.path={write_pairs(tmp_path)}", "loss=dpo", *TINY, "max_steps=3", "eval_every=3",
           "+optim=sgd", "optim.momentum=0"]
    two = torchrun("+engine=ddp", *job, "batch_size=2", f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    one = run_cli(*job, "batch_size=4", f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    read = lambda run: [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    for a, b in zip(read("two"), read("one")):
        for key in ("loss", "eval_loss", "reward_accuracy"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=LOSS_RTOL, abs=1e-7), key
        for key in ("reward_margin", "eval_reward_margin"):  # beta x differences of log-probabilities near -100:
            if key in b:  # the all-reduce's last bit in the weights moves them by the fp32 spacing there
                assert a[key] == pytest.approx(b[key], abs=1e-5), key
    weights, expected = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert max((weights[k] - expected[k]).abs().max().item() for k in expected) < WEIGHT_ATOL
