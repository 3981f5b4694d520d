"""GRPO in the loop (issue 41): data=prompts, the reward group, loss=grpo's loss, its gradients and its
accumulation, the rollouts' seeding. The command line's runs: tests/cli/test_grpo_cli.py."""
from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from looplib import optim as lo
from looplib.accumulation import Accumulation
from looplib.data.loading import Epochs, build_loader
from looplib.data.prompts import PromptCorpus
from looplib.engines import Engine
from looplib.errors import ConfigError
from looplib.grpo import GRPO, Rollouts, group_advantages, nucleus
from looplib.loop import fit
from looplib.models import GPT
from looplib.precision import Precision
from looplib.train_state import TrainState
from looplib.reward import ExactAnswer, Format, Weighted, final_answer, score

from test_data_files import cache_dir, sentence, tok, tok_file, write_jsonl  # noqa: F401 (fixtures)


def prompt_rows(n=24, seed=0):
    rng = random.Random(seed)
    return [{"prompt": sentence(rng, 1, 6) + " " + str(i) + "?", "answer": str(i), "tests": [i, {"k": "v"}]}
            for i in range(n)]


def prompts(tmp_path, tok_file, tok, rows=None, **kw):  # noqa: F811
    path = write_jsonl(tmp_path / "prompts.jsonl", rows or prompt_rows())
    kw = {"seq_len": 40, "eval_fraction": 0.0, **kw}
    return PromptCorpus(str(path), tokenizer=str(tok_file), vocab_size=tok.get_vocab_size(), **kw)


def gpt(vocab, seed=0):
    torch.manual_seed(seed)
    return GPT(vocab_size=vocab, seq_len=40, n_layer=1, n_head=2, d_model=32)


# --- data=prompts --------------------------------------------------------------------------------

def test_prompts_keep_every_other_field_and_split_held_out_by_record(tmp_path, tok_file, tok):  # noqa: F811
    rows = prompt_rows()
    corpus = prompts(tmp_path, tok_file, tok, rows, eval_fraction=0.25)
    assert len(corpus.train) + len(corpus.eval) == len(rows) and len(corpus.eval) == 6
    seen = set()
    for split in (corpus.train, corpus.eval):
        for i in range(len(split)):
            sample = split[i]
            record = rows[sample["index"]]
            assert sample["records"] == record  # every field as read, nested ones too
            assert sample["prompt_ids"].tolist() == tok.encode(record["prompt"]).ids
            seen.add(sample["index"])
    assert seen == set(range(len(rows)))
    batch = corpus.collate([corpus.train[i] for i in range(3)])
    assert len(batch["prompt_ids"]) == 3 and batch["index"].tolist() == [corpus.train[i]["index"] for i in range(3)]


def test_prompts_read_csv_like_jsonl(tmp_path, tok_file, tok):  # noqa: F811
    rows = prompt_rows(8)
    (tmp_path / "p.csv").write_text("prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in rows))
    corpus = PromptCorpus(str(tmp_path / "p.csv"), seq_len=40, tokenizer=str(tok_file),
                          vocab_size=tok.get_vocab_size(), eval_fraction=0.0)
    assert [corpus.train[i]["records"]["answer"] for i in range(8)] == [r["answer"] for r in rows]


def test_a_record_without_its_prompt_names_file_record_and_setting(tmp_path, tok_file, tok):  # noqa: F811
    rows = prompt_rows(8)
    rows[3] = {"question": "no prompt here", "answer": "1"}
    with pytest.raises(ConfigError) as err:
        prompts(tmp_path, tok_file, tok, rows)
    assert err.value.key == "data.prompt_field" and "prompts.jsonl:4" in str(err.value)
    (tmp_path / "plain.txt").write_text("what is 2 + 3?\n")
    with pytest.raises(ConfigError) as err:
        PromptCorpus(str(tmp_path / "plain.txt"), seq_len=40, tokenizer=str(tok_file), vocab_size=tok.get_vocab_size())
    assert err.value.key == "data.path" and "prompts are records" in str(err.value)
    rows[3] = {"prompt": "  ", "answer": "1"}
    with pytest.raises(ConfigError) as err:
        prompts(tmp_path, tok_file, tok, rows)
    assert err.value.key == "data.prompt_field" and "prompts.jsonl:4: the prompt is empty" in str(err.value)


def test_chat_prompts_are_rendered_up_to_the_assistants_turn_and_reach_the_reward_as_written(tmp_path, tiny_pretrained):
    transformers = pytest.importorskip("transformers")
    turns = [{"role": "user", "content": "two plus two?"}, {"role": "assistant", "content": "four"},
             {"role": "user", "content": "and three?"}]
    rows = [{"prompt": turns, "answer": "5"}, {"prompt": "plain text", "answer": "1"}] * 3
    corpus = PromptCorpus(str(write_jsonl(tmp_path / "chat.jsonl", rows)), seq_len=200, tokenizer=str(tiny_pretrained),
                          vocab_size=384, eval_fraction=0.0)
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_pretrained))
    want = hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    sample = next(corpus.train[i] for i in range(len(corpus.train)) if corpus.train[i]["index"] == 0)
    assert corpus.tokenizer.decode(sample["prompt_ids"].tolist(), skip_special_tokens=False) == want
    assert sample["records"]["prompt"] == turns

    seen = []

    def reward(prompts, completions, records):
        seen.extend(prompts)
        return [0.0] * len(completions)
    model = torch.nn.Module()
    vocab = corpus.vocab_size
    model.forward = lambda ids, **_: torch.zeros(ids.shape[0], ids.shape[1], vocab)  # uniform: any token
    _, source = rollouts(corpus, model, 2, reward, group_size=2)
    next(iter(source))
    assert turns in seen and all(p in (turns, "plain text") for p in seen) and len(seen) == 4


# --- rewards -------------------------------------------------------------------------------------

def test_exact_answer_reads_boxed_then_last_number():
    assert final_answer(r"so \boxed{\frac{1}{2}} it is 3") == r"\frac{1}{2}"
    assert final_answer("2 + 3 = 5, then 1,000.") == "1,000"
    reward = ExactAnswer()
    completions = ["2 + 3 = 5", r"\boxed{5}", "5.0", "it is 6", "", "1,000"]
    records = [{"answer": "5"}] * 5 + [{"answer": 1000}]
    assert reward([None] * 6, completions, records) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    fmt = Format(r"<answer>.*</answer>")
    assert fmt([None] * 2, ["x <answer>5</answer>", "5"], [{}] * 2) == [1.0, 0.0]
    both = Weighted({"exact": ExactAnswer(weight=1.0), "format": Format(r"\\boxed\{.*\}", weight=0.25)})
    assert score(both, [None] * 3, [r"\boxed{5}", "5", "x"], [{"answer": "5"}] * 3).tolist() == [1.25, 1.0, 0.0]


def raises(prompts, completions, records):
    raise ValueError("no answer key")


def nan(prompts, completions, records):
    return [float("nan")] * len(completions)


def short(prompts, completions, records):
    return [1.0] * (len(completions) - 1)


@pytest.mark.parametrize("bad,said", [(raises, "raised ValueError: no answer key"), (nan, "returned nan"),
                                      (short, "returned 3 values for 4 completions")])
def test_a_bad_reward_is_refused_in_one_line_naming_it_and_the_prompt(bad, said):
    with pytest.raises(ConfigError) as err:
        score(bad, ["What is 2+3?"] * 4, ["5"] * 4, [{"answer": "5"}] * 4)
    text = str(err.value)
    assert err.value.key == "reward" and bad.__name__ in text and said in text and "What is 2+3?" in text
    assert "\n" not in text


# --- the loss ------------------------------------------------------------------------------------

def fixed_batch(vocab, rows=6, width=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    labels = torch.randint(0, vocab, (rows, width), generator=g)
    starts = torch.randint(1, 5, (rows,), generator=g)
    ends = torch.randint(7, width + 1, (rows,), generator=g)
    at = torch.arange(width)[None]
    labels = labels.masked_fill((at < starts[:, None]) | (at >= ends[:, None]), -100)
    rewards = torch.randint(0, 2, (rows,), generator=g).double()
    return {"input_ids": ids, "labels": labels, "rewards": rewards.float(),
            "advantages": group_advantages(rewards, 3).float(),
            "old_logps": -torch.rand(rows, width, generator=g) * 6}


def by_hand(model, reference, batch, eps_low, eps_high, beta, temperature):
    """GRPO's token-level loss written out: per counted token -min(r A, clip(r) A) + beta KL, summed."""
    logp_all = torch.log_softmax(model(batch["input_ids"]).float() / temperature, dim=-1)
    ref_all = torch.log_softmax(reference(batch["input_ids"]).float() / temperature, dim=-1)
    total = torch.zeros(())
    rows, cols = batch["labels"].shape
    for i in range(rows):
        a = batch["advantages"][i]
        for t in range(cols):
            y = int(batch["labels"][i, t])
            if y == -100:
                continue
            lp, ref = logp_all[i, t, y], ref_all[i, t, y].detach()
            r = torch.exp(lp - batch["old_logps"][i, t])
            loss = -torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
            total = total + loss + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
    return total


@pytest.mark.parametrize("beta,eps_high", [(0.0, None), (0.04, 0.28)])
def test_grpo_loss_and_gradients_equal_a_hand_written_one(beta, eps_high):
    model = gpt(64)
    objective = GRPO(group_size=3, epsilon=0.2, epsilon_high=eps_high, beta=beta, temperature=0.7)
    objective.attach(model)
    assert (objective.reference is not None) == bool(beta)  # no copy without a KL
    reference = objective.reference or copy.deepcopy(model)
    with torch.no_grad():
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = fixed_batch(64)
    params = list(model.parameters())
    mine = objective(model, batch)
    theirs = by_hand(model, reference, batch, 0.2, eps_high or 0.2, beta, 0.7)
    assert objective.count(batch) == int((batch["labels"] != -100).sum())
    assert abs(mine.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item()))
    for g, e in zip(torch.autograd.grad(mine, params), torch.autograd.grad(theirs, params)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    metrics = objective.train_metrics()
    assert metrics["clipped"] > 0  # the old log-probabilities are far: some ratios clipped
    with torch.no_grad():
        p = torch.softmax(model(batch["input_ids"]).float() / 0.7, dim=-1)
        entropy = -(p * p.log()).sum(-1)[batch["labels"] != -100].mean().item()
    assert metrics["entropy"] == pytest.approx(entropy, rel=1e-5)


def test_group_advantages_are_centred_and_scaled_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    adv = group_advantages(rewards, 3)
    assert adv[3:].abs().max() == 0  # a group of equal rewards teaches nothing
    assert adv[:3].sum().abs() < 1e-12 and adv[0] > 0 > adv[1]
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert nucleus(probs, 0.7)[0].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])


# --- rollouts as the window's data -------------------------------------------------------------------

def rollouts(corpus, model, micro, reward=None, group_size=4, **loss):
    loader = build_loader(corpus.train, batch_size=micro, seed=0, collate_fn=corpus.collate, device="cpu")
    objective = GRPO(group_size=group_size, max_new_tokens=6, **{"temperature": 1.0, **loss})
    return objective, Rollouts(loader, objective, lambda: model, reward or ExactAnswer(), corpus, Engine("cpu"),
                               Precision(), seed=3)


def test_a_prompts_completions_do_not_depend_on_the_batch_it_is_in(tmp_path, tok_file, tok):  # noqa: F811
    corpus = prompts(tmp_path, tok_file, tok)
    model = gpt(tok.get_vocab_size())
    _, eight = rollouts(corpus, model, 8)
    _, four = rollouts(corpus, model, 4)
    big = next(iter(eight))
    batches = iter(four)
    small = [next(batches), next(batches)]
    for key in ("rewards", "advantages"):
        torch.testing.assert_close(big[key], torch.cat([s[key] for s in small]), rtol=0, atol=0)
    rows = [(r[m == 1]).tolist() for s in small for r, m in zip(s["input_ids"], s["attention_mask"])]
    assert rows == [(r[m == 1]).tolist() for r, m in zip(big["input_ids"], big["attention_mask"])]
    counted = big["labels"] != -100
    assert counted.sum(1).min() >= 1 and counted.sum(1).max() <= 6  # a completion: 1..max_new_tokens tokens
    assert len({tuple(r) for r in rows}) > 8  # sampled, not one completion repeated


def test_grpo_8_prompts_equals_accumulation_2_x_4(tmp_path, tok_file, tok):  # noqa: F811
    """One window of 8 prompts and a window of 2 x 4: the same completions (seeded per prompt), the
    same update (the loss normalised by the window's completion tokens)."""
    corpus = prompts(tmp_path, tok_file, tok)

    def reward(prompts, completions, records):  # a reward that varies within groups: every advantage non-zero
        return [len(c) % 3 for c in completions]

    def one_update(micro, accum):
        model = gpt(tok.get_vocab_size())
        objective, source = rollouts(corpus, model, micro, reward)
        fit(model, source, objective=objective, max_steps=1, accumulation=Accumulation(accum),
            optimizer=lo.SGD(lr=0.5, momentum=0.0, weight_decay=0.0).build(model))
        return model
    full, split = one_update(8, 1), one_update(4, 2)
    start = gpt(tok.get_vocab_size())
    moved = max((p - q).abs().max().item() for p, q in zip(full.parameters(), start.parameters()))
    assert math.isfinite(moved) and moved > 1e-4
    for p, q in zip(full.parameters(), split.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # and both are the step on the mean loss per completion token (the item is the token)
    objective, source = rollouts(corpus, start, 8, reward)
    batch = next(iter(source))
    tokens = int((batch["labels"] != -100).sum())
    assert tokens > len(batch["labels"])  # more tokens than completions: a mean per completion would differ
    grads = torch.autograd.grad(objective(start, batch) / tokens, list(start.parameters()))
    for p, g, q in zip(start.parameters(), grads, full.parameters()):
        torch.testing.assert_close(p.detach() - 0.5 * g, q.detach(), rtol=1e-5, atol=1e-6)


# --- several updates per rollout (loss.updates_per_rollout) ----------------------------------------

def varied(prompts, completions, records):  # a reward that varies within groups: every advantage non-zero
    return [len(c) % 3 for c in completions]


def test_two_updates_per_rollout_equal_two_hand_written_steps(tmp_path, tok_file, tok):  # noqa: F811
    """updates_per_rollout=2: two SGD steps on one rollout batch, the second's ratio against the
    log-probabilities the completions were sampled with (clipped where it moved past epsilon); the
    prompts are read once."""
    corpus, vocab, lr, eps = prompts(tmp_path, tok_file, tok), tok.get_vocab_size(), 2.0, 0.02
    model = gpt(vocab)
    objective, source = rollouts(corpus, model, 8, varied, updates_per_rollout=2, epsilon=eps)
    state, epochs = TrainState(), Epochs(source)
    fit(model, epochs, objective=objective, max_steps=2, accumulation=objective.accumulation(1, state), state=state,
        optimizer=lo.SGD(lr=lr, momentum=0.0, weight_decay=0.0).build(model))
    assert epochs.batches_seen == 1 and state.step == 2 and "rollout" not in state.extra  # one rollout, trained twice
    assert objective.train_metrics()["clipped"] > 0  # the second update's ratios moved past the clip range

    start = gpt(vocab)
    _, again = rollouts(corpus, start, 8, varied, updates_per_rollout=2, epsilon=eps)
    batch = next(iter(again))  # the same completions (the same seeds, the same weights)
    counted = batch["labels"] != -100
    with torch.no_grad():  # sampled by the starting policy: the first update's ratio is exactly 1
        assert torch.equal(batch["old_logps"][counted], GRPO().logps(start, batch)[counted])
    tokens = int(counted.sum())
    for _ in range(2):
        params = list(start.parameters())
        grads = torch.autograd.grad(by_hand(start, start, batch, eps, eps, 0.0, 1.0) / tokens, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(lr * g)
    for p, q in zip(start.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_run_stopped_between_a_rollouts_updates_resumes_it(tmp_path, tok_file, tok):  # noqa: F811
    """The state after the first of two updates holds the rollout; a fresh model, optimizer and data
    stream restored from it (as a checkpoint restores them) finish bit for bit as the run that went on."""
    corpus, vocab = prompts(tmp_path, tok_file, tok), tok.get_vocab_size()

    def start(model_state=None, optim_state=None, position=None, extra=None, step=0):
        model = gpt(vocab)
        if model_state:
            model.load_state_dict(model_state)
        objective, source = rollouts(corpus, model, 4, varied, updates_per_rollout=2)
        optimizer = lo.AdamW(lr=1e-2).build(model)
        if optim_state:
            optimizer.load_state_dict(optim_state)
        epochs = Epochs(source)
        if position:
            epochs.restore(position)
        state = TrainState(step=step, extra=copy.deepcopy(extra) if extra else {})
        return model, objective, optimizer, epochs, state

    def run(parts, max_steps):
        model, objective, optimizer, epochs, state = parts
        fit(model, epochs, objective=objective, max_steps=max_steps, optimizer=optimizer, state=state,
            accumulation=objective.accumulation(2, state))
        return parts
    whole = run(start(), 5)
    cut = run(start(), 3)
    model, _, optimizer, epochs, state = cut
    assert state.extra["rollout"]["done"] == 1 and len(state.extra["rollout"]["batches"][0]) == 2
    resumed = run(start(copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), epochs.position(),
                        state.extra, state.step), 5)
    assert resumed[3].batches_seen == whole[3].batches_seen == 6  # three rollouts of 2 micro-batches
    for p, q in zip(whole[0].parameters(), resumed[0].parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ConfigError) as err:  # a rollout saved on 2 processes, resumed on 1
        run(start(extra={"rollout": {"batches": [[], []], "done": 1}}), 1)
    assert err.value.key == "resume"


# --- parity with TRL's GRPOTrainer (pip install 'looplib[test]' brings trl) ------------------------

@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_equals_trl_grpo_trainer_loss_and_gradients(tmp_path, tiny_pretrained, beta):
    """TRL's own loss (``GRPOTrainer._compute_loss``, loss_type=bnpo: summed over the completion tokens and
    divided by their count, as looplib's loop divides) on fixed completions, advantages and old
    log-probabilities of a tiny Llama, against looplib's GRPO on the same tokens: within 1e-6 (fp32)."""
    pytest.importorskip("trl")
    datasets, transformers = pytest.importorskip("datasets"), pytest.importorskip("transformers")
    from trl import GRPOConfig, GRPOTrainer

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_pretrained))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_pretrained), dtype=torch.float32)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], per_device_train_batch_size=4, num_generations=2,
                      use_cpu=True, bf16=False, loss_type="bnpo", beta=beta, epsilon=0.2, epsilon_high=0.28,
                      temperature=0.7,
                      save_strategy="no", disable_tqdm=True, max_completion_length=8)
    trainer = GRPOTrainer(model=model, args=args, processing_class=tok, reward_funcs=[lambda completions, **_: [0.0]
                                                                                      * len(completions)],
                          train_dataset=datasets.Dataset.from_list([{"prompt": "a b c"}] * 4))
    reference = copy.deepcopy(trainer.model).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # the policy away from the reference
        for p in trainer.model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    g = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (4, 5), generator=g)
    completion_ids = torch.randint(3, vocab, (4, 7), generator=g)
    completion_mask = (torch.arange(7)[None] < torch.tensor([[7], [3], [5], [1]])).long()
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([torch.ones_like(prompt_ids), completion_mask], 1)
    old = -torch.rand(4, 7, generator=g) * 6
    advantages = torch.tensor([0.7, -0.7, 1.2, -1.2])

    class Logits(torch.nn.Module):  # looplib's side: the model as a function of ids and mask -> logits
        def __init__(self, hf):
            super().__init__()
            self.hf = hf

        def forward(self, input_ids, attention_mask=None):
            return self.hf(input_ids=input_ids, attention_mask=attention_mask).logits

    with torch.no_grad():
        ref_logps = torch.log_softmax(Logits(reference)(ids, mask)[:, 4:-1].float() / 0.7, -1)
        ref_logps = ref_logps.gather(-1, completion_ids[..., None]).squeeze(-1)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": old,
              "ref_per_token_logps": ref_logps}
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    theirs = trainer._compute_loss(trainer.model, inputs)
    expected = torch.autograd.grad(theirs, params)

    labels = ids[:, 1:].clone()
    labels[:, :4] = -100
    labels[:, 4:] = labels[:, 4:].masked_fill(completion_mask == 0, -100)
    full_old = torch.zeros(labels.shape)
    full_old[:, 4:] = old
    ours_batch = {"input_ids": ids[:, :-1], "labels": labels, "attention_mask": mask[:, :-1], "advantages": advantages,
                  "old_logps": full_old}
    objective = GRPO(group_size=2, beta=beta, epsilon=0.2, epsilon_high=0.28, temperature=0.7)
    objective.reference = Logits(reference).eval()
    mine = objective(Logits(trainer.model), ours_batch) / objective.count(ours_batch)
    grads = torch.autograd.grad(mine, params)
    assert abs(mine.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item())) and abs(theirs.item()) > 1e-3
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_train_model_runs_grpo_from_python(tmp_path, tok_file, tok):  # noqa: F811
    from looplib import train_model
    corpus = prompts(tmp_path, tok_file, tok)
    got = []

    def reward(prompts, completions, records):
        got.append(len(completions))
        records[0]["answer"] = "changed by the reward"  # a copy: the data keep their records
        return [float(len(c) % 2) for c in completions]
    trained = train_model(gpt(tok.get_vocab_size()), corpus, objective=GRPO(group_size=2, max_new_tokens=4),
                          reward=reward, max_steps=2, batch_size=3, sample_tokens=0, log_every=1,
                          metrics=tmp_path / "m.jsonl")
    assert trained.state.step == 2 and got == [6, 6]
    assert all(corpus.train.record(i)["answer"] == str(i) for i in range(len(prompt_rows())))
    assert {"reward", "completion_tokens", "clipped"} <= set(trained.last_row)
    with pytest.raises(ConfigError) as err:
        train_model(gpt(tok.get_vocab_size()), corpus, objective=GRPO(group_size=2, max_new_tokens=4), max_steps=1,
                    batch_size=3, sample_tokens=0)
    assert err.value.key == "reward"
