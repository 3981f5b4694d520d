"""``looplib.evaluation_rewards`` (python -m looplib.evaluate's numbers): the pass@k estimator
against hand-worked values and a count over every draw, the summary and table of a hand-made
evaluation, and the completions sampled exactly as loss=grpo samples them."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from conftest import tiny_gpt
from looplib.evaluation_rewards import Evaluated, Sampling, evaluate, pass_at_k, samples, summary, table
from looplib.grpo import prompt_seed, sample
from looplib.reward import ExactAnswer, Format, Weighted


def test_pass_at_k_equals_hand_worked_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)          # c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)     # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)    # 1 - C(3,3)/C(5,3)
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)  # 1 - C(7,4)/C(10,4)
    assert pass_at_k(3, 0, 3) == 0.0 and pass_at_k(3, 2, 2) == 1.0 and pass_at_k(1, 1, 1) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)  # k above n: no estimate
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_pass_at_k_is_the_share_of_k_draws_that_hold_a_pass():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                draws = list(itertools.combinations(range(n), k))  # samples 0..c-1 pass
                share = sum(any(i < c for i in d) for d in draws) / len(draws)
                assert pass_at_k(n, c, k) == pytest.approx(share, abs=1e-12), (n, c, k)


def test_summary_and_table_hold_the_hand_counted_numbers():
    found = Evaluated(indices=[3, 7, 9], texts=[["a", "b"], ["c", "d"], ["e", "f"]],
                      rewards=[[1.0, 0.0], [0.0, 0.0], [1.0, 0.5]], parts={"exact": [2.0, 2.0, 6], "form": [3.0, 3.0, 6]})
    s = Sampling(n=2, max_new_tokens=8, temperature=0.7, top_p=0.9, seed=5)
    out = summary(found, s, [1, 2], 1.0, "Weighted")
    mean = 2.5 / 6
    assert out["rewards"]["Weighted"]["mean"] == pytest.approx(mean)
    assert out["rewards"]["Weighted"]["std"] == pytest.approx(math.sqrt(2.25 / 6 - mean ** 2))
    assert out["rewards"]["exact"] == pytest.approx({"mean": 1 / 3, "std": math.sqrt(1 / 3 - 1 / 9)})
    assert out["rewards"]["form"] == pytest.approx({"mean": 0.5, "std": 0.5})
    # passes (reward >= 1): 1 of 2, 0 of 2, 1 of 2 (0.5 does not pass)
    assert out["pass_at_k"] == pytest.approx({"1": (0.5 + 0 + 0.5) / 3, "2": (1 + 0 + 1) / 3})
    assert summary(found, s, [1], 0.5, "W")["pass_at_k"]["1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert (out["prompts"], out["samples_per_prompt"], out["completions"]) == (3, 2, 6)
    assert out["sampling"] == {"n": 2, "max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 5}
    assert json.loads(json.dumps(out)) == out
    text = table(out).splitlines()
    assert text[0] == "3 prompts x 2 samples (temperature 0.7, top_p 0.9, max_new_tokens 8, seed 5)"
    assert text[1].split() == ["reward", "mean", "std"]
    assert text[2].split() == ["Weighted", f"{mean:.4f}", f"{math.sqrt(2.25 / 6 - mean ** 2):.4f}"]
    assert [r.split() for r in text[5:7]] == [["pass@1", "0.3333"], ["pass@2", "0.6667"]]
    lines = [json.loads(x) for x in samples(found, 1.0, lambda i: f"p{i}").splitlines()]
    assert lines[5] == {"index": 9, "prompt": "p9", "sample": 1, "completion": "f", "reward": 0.5, "passed": False}


class Prompts:
    """Stands for PromptExamples: prompt ids, the record's index, the record."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids, index, record = self.rows[i]
        return {"prompt_ids": torch.tensor(ids), "index": index, "records": record}


def test_evaluate_samples_as_grpo_does_and_scores_every_completion_with_its_record():
    model = tiny_gpt(vocab=64, seq_len=16)
    rows = [([1, 2, 3], 4, {"prompt": "a", "answer": "7", "extra": {"x": [1]}}), ([5, 6], 11, {"prompt": "b", "answer": "9"})]
    s = Sampling(n=3, max_new_tokens=5, temperature=0.9, top_p=0.8, seed=2)
    decode = lambda ids: " ".join(str(i) for i in ids)  # noqa: E731
    seen = []

    def reward(prompts, completions, records):
        seen.append((list(prompts), [dict(r) for r in records]))
        return [float(len(c.split())) for c in completions]

    found = evaluate(model, Prompts(rows), reward, s, decode, stop=0, device=torch.device("cpu"))
    for (ids, index, record), texts, values, (prompts, records) in zip(rows, found.texts, found.rewards, seen):
        gen = torch.Generator().manual_seed(prompt_seed(2, 0, index))
        by_hand = sample(model, torch.tensor(ids), 3, 5, 0.9, 0.8, 0, gen)
        want = []
        for row in by_hand.tolist():
            want.append(" ".join(str(i) for i in (row[:row.index(0)] if 0 in row else row)))
        assert texts == want and values == [float(len(w.split())) for w in want]
        assert prompts == [record["prompt"]] * 3 and records == [record] * 3  # every field, as the record has it
    assert found.indices == [4, 11] and model.training  # (sampled in eval mode, then put back)


def test_a_weighted_reward_reports_each_part():
    model = tiny_gpt(vocab=64, seq_len=16)
    reward = Weighted({"exact": ExactAnswer(), "digits": Format(pattern="[0-9]")}, {"digits": 0.5})
    found = evaluate(model, Prompts([([1, 2], 0, {"prompt": "q", "answer": "1"})]), reward, Sampling(n=4, max_new_tokens=3),
                     lambda ids: "".join(str(i % 10) for i in ids), stop=None, device=torch.device("cpu"))
    out = summary(found, Sampling(n=4), [1], 1.0, "Weighted")
    assert set(out["rewards"]) == {"Weighted", "exact", "digits"} and out["rewards"]["digits"]["mean"] == 1.0
    assert out["rewards"]["Weighted"]["mean"] == pytest.approx(out["rewards"]["exact"]["mean"] + 0.5)
