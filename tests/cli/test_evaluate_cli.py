"""``python -m looplib.evaluate`` on a finished tiny GRPO run: the mean reward and pass@k equal a
hand count over completions re-sampled by hand with the same seeds; the record is rewritten only
by the same evaluation; every refusal is one line, exit status 2, nothing written; and
``--lm-eval`` on a local multiple-choice task equals a hand count of the choices' log-likelihoods."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_cli

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
TASKS = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
REWARDS = '''
def letters(prompts, completions, records):
    for prompt, record in zip(prompts, records):
        assert record["note"] == {"kept": [int(prompt[0]), int(prompt[2])]}, record  # every field, untouched
    return [float(sum(ch.isalpha() for ch in c)) for c in completions]


def broken(prompts, completions, records):
    return [float("nan")] * len(completions)
'''


def letters(completions):
    return [float(sum(ch.isalpha() for ch in c)) for c in completions]


def write_sums(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "note": {"kept": [a, b]}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory, token_cache):
    """A tiny GRPO run (one step) and five held-out prompts beside it."""
    root = tmp_path_factory.mktemp("evaluate")
    (root / "my_rewards.py").write_text(REWARDS)
    job = ["data=prompts", f"data.path={write_sums(root / 'sums.jsonl', 16, 0)}", "loss=grpo", "+reward=exact_answer",
           "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=24", "data.vocab_size=300",
           "batch_size=2", "sample_tokens=0", "loss.group_size=2", "loss.max_new_tokens=4", "max_steps=1",
           f"hydra.run.dir={root / 'run'}"]
    r = run_cli(*job, cwd=root, env={"LOOPLIB_CACHE": token_cache, **ONE_THREAD})
    assert r.returncode == 0, r.stderr
    write_sums(root / "held_out.jsonl", 5, 1)
    return root


def evaluate(root: Path, *args: str, cache: str):
    return run_cli(*args, cwd=root, module="looplib.evaluate",
                   env={"LOOPLIB_CACHE": cache, "PYTHONPATH": str(root), **ONE_THREAD})


def test_mean_reward_and_pass_at_k_equal_a_hand_count_of_completions_sampled_by_hand(finished, token_cache, tmp_path):
    from looplib import load_finished
    from looplib.data.tokenizer import load_tokenizer
    from looplib.evaluation_rewards import pass_at_k
    from looplib.grpo import prompt_seed, sample
    root = finished
    out = tmp_path / "letters.json"
    r = evaluate(root, str(root / "run"), "data=prompts", "data.path=held_out.jsonl", "+reward._target_=my_rewards.letters",
                 "n=4", "k=1,3", "max_new_tokens=5", "temperature=1.3", "top_p=0.9", "seed=3", "threshold=2",
                 f"--out={out}", "--samples", cache=token_cache)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    # by hand: the run's model and tokenizer, each prompt's generator seeded as GRPO seeds it (epoch 0, its record)
    done = load_finished(root / "run", "cpu")
    info = load_tokenizer(str(sorted((root / "run" / "checkpoints").iterdir())[-1] / "tokenizer.json"))
    records = [json.loads(x) for x in (root / "held_out.jsonl").read_text().splitlines()]
    rewards, passed = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for index, record in enumerate(records):
            gen = torch.Generator().manual_seed(prompt_seed(3, 0, index))
            with torch.no_grad():
                group = sample(done.model, torch.tensor(info.encode(record["prompt"])), 4, 5, 1.3, 0.9, info.eos_id, gen)
            texts = [info.tokenizer.decode(row[:row.index(info.eos_id)] if info.eos_id in row else row)
                     for row in group.tolist()]
            rewards += letters(texts)
            passed.append(sum(v >= 2 for v in letters(texts)))
    finally:
        torch.set_num_threads(threads)
    mean = sum(rewards) / len(rewards)
    assert got["rewards"]["my_rewards.letters"]["mean"] == pytest.approx(mean)
    assert got["rewards"]["my_rewards.letters"]["std"] == pytest.approx(torch.tensor(rewards).std(unbiased=False).item())
    assert got["pass_at_k"] == pytest.approx({k: sum(pass_at_k(4, c, int(k)) for c in passed) / 5 for k in ("1", "3")})
    assert 0 < mean and 0 < sum(passed) < 20  # the hand count is not trivially empty or full
    assert (got["prompts"], got["samples_per_prompt"], got["pass_threshold"]) == (5, 4, 2.0)
    assert got["sampling"] == {"n": 4, "max_new_tokens": 5, "temperature": 1.3, "top_p": 0.9, "seed": 3}
    assert got["evaluation"]["run"]["dir"] == str((root / "run").resolve())
    assert got["evaluation"]["data"]["files"] == [str(root / "held_out.jsonl")]
    assert got["evaluation"]["data"]["split"] == "all" and got["evaluation"]["data"]["identity"]["tokenizer"]
    lines = [json.loads(x) for x in (tmp_path / "letters.samples.jsonl").read_text().splitlines()]
    assert len(lines) == 20 and [x["reward"] for x in lines] == rewards and lines[0]["prompt"] == records[0]["prompt"]
    table = r.stdout.splitlines()
    assert table[0].startswith("5 prompts x 4 samples") and table[2].split()[0] == "my_rewards.letters"


def test_the_same_evaluation_is_rewritten_and_another_one_is_refused(finished, token_cache):
    root = finished
    job = [str(root / "run"), "data=prompts", "data.path=held_out.jsonl", "+reward=exact_answer", "n=2",
           "max_new_tokens=3"]
    r = evaluate(root, *job, cache=token_cache)
    assert r.returncode == 0, r.stderr
    record = root / "run" / "eval" / "rewards-held_out.json"
    first = json.loads(record.read_text())
    assert first["pass_at_k"].keys() == {"1", "2"} and "ExactAnswer" in first["rewards"]
    again = evaluate(root, *job, cache=token_cache)
    assert again.returncode == 0, again.stderr
    assert json.loads(record.read_text())["rewards"] == first["rewards"]  # reproducible: the same seeds
    before = record.read_bytes()
    other = evaluate(root, *job, "temperature=0.5", cache=token_cache)
    assert other.returncode == 2
    assert other.stderr.strip().splitlines() == [
        f"looplib: error: --out: {record} holds another "
        "evaluation (its sampling differs): it is not replaced; give --out PATH for this one, or move the file away"]
    assert record.read_bytes() == before


def test_a_held_out_split_asked_for_is_evaluated_alone(finished, token_cache, tmp_path):
    from looplib.data.files import split_documents
    root = finished
    out = tmp_path / "split.json"
    r = evaluate(root, str(root / "run"), "data=prompts", "data.path=sums.jsonl", "data.eval_fraction=0.25",
                 "+reward=exact_answer", "n=1", "max_new_tokens=2", f"--out={out}", "--samples", cache=token_cache)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    held = split_documents(16, 0.25, 0, "sums.jsonl")[1].tolist()  # the records training held out (data.seed 0)
    assert got["prompts"] == 4 and got["evaluation"]["data"]["split"] == "held-out"
    assert [json.loads(x)["index"] for x in (tmp_path / "split.samples.jsonl").read_text().splitlines()] == held


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory):
    """A bundled classifier's run directory (config.yaml + model.safetensors)."""
    from safetensors.torch import save_model
    from looplib.models.bert import BertClassifier
    run = tmp_path_factory.mktemp("classifier")
    options = dict(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16, num_classes=2)
    (run / "config.yaml").write_text(json.dumps({"model": {"_target_": "looplib.models.bert.BertClassifier", **options}}))
    save_model(BertClassifier(**options), str(run / "model.safetensors"))
    return run


REFUSALS = [
    ("not a run", ["{empty}", "data=prompts", "data.path=held_out.jsonl", "+reward=exact_answer"],
     "RUN_DIR: {empty} holds neither hf/ nor config.yaml"),
    ("no reward", ["{run}", "data=prompts", "data.path=held_out.jsonl"], "reward: no reward was chosen"),
    ("no prompts", ["{run}", "data=text", "data.path=held_out.jsonl", "+reward=exact_answer"],
     "data: the data (looplib.data.TextCorpus) hold no prompts"),
    ("k above n", ["{run}", "data=prompts", "data.path=held_out.jsonl", "+reward=exact_answer", "n=2", "k=1,4"],
     "k: pass@4 needs at least 4 completions per prompt, and n=2"),
    ("classifier", ["{classifier}", "data=prompts", "data.path=held_out.jsonl", "+reward=exact_answer"],
     "RUN_DIR: {classifier} holds a classifier"),
    ("broken reward", ["{run}", "data=prompts", "data.path=held_out.jsonl", "+reward._target_=my_rewards.broken", "n=2",
                       "max_new_tokens=2"], "reward: the reward my_rewards.broken returned nan for completion 0"),
    ("not a setting", ["{run}", "data=prompts", "data.path=held_out.jsonl", "+reward=exact_answer", "lr=0.1"],
     "lr: lr=0.1 is not a setting of python -m looplib.evaluate"),
    ("the run's tokenizer", ["{run}", "data=prompts", "data.path=held_out.jsonl", "data.tokenizer=gpt2",
                             "+reward=exact_answer"], "data.tokenizer: the prompts are tokenised as the run's model"),
]


@pytest.mark.parametrize("name,args,line", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_bad_input_is_one_line_exit_2_and_nothing_written(name, args, line, finished, classifier_run, token_cache, tmp_path):
    root = finished
    run = tmp_path / "run"
    shutil.copytree(root / "run", run, ignore=shutil.ignore_patterns("eval"))
    where = {"run": str(run), "empty": str(tmp_path / "empty"), "classifier": str(classifier_run)}
    (tmp_path / "empty").mkdir()
    r = evaluate(root, *[a.format(**where) for a in args], cache=token_cache)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("looplib: error: " + line.format(**where)), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not (run / "eval").exists() and not (classifier_run / "eval").exists()


def test_lm_eval_on_a_local_task_equals_a_hand_count_of_the_choices_loglikelihoods(finished, token_cache, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'looplib[eval]')")
    from looplib import load_finished
    from looplib.data.tokenizer import load_tokenizer
    root = finished
    out = tmp_path / "harness.json"
    r = run_cli(str(root / "run"), "--lm-eval", str(TASKS / "tiny_choice.yaml"), f"--out={out}", cwd=tmp_path,
                module="looplib.evaluate", env={"LOOPLIB_CACHE": token_cache, "HF_DATASETS_CACHE": str(tmp_path / "hf"),
                                                **ONE_THREAD})
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())["results"]["tiny_choice"]["acc,none"]
    done = load_finished(root / "run", "cpu")
    info = load_tokenizer(str(sorted((root / "run" / "checkpoints").iterdir())[-1] / "tokenizer.json"))
    encode = lambda text: info.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    right = 0
    docs = [json.loads(x) for x in (TASKS / "tiny_choice.jsonl").read_text().splitlines()]
    for doc in docs:
        scores = []
        for choice in doc["choices"]:
            # the harness puts its target_delimiter (" ") between the question and each choice
            ids, start = encode(doc["question"] + " " + choice), len(encode(doc["question"]))
            with torch.no_grad():
                logp = torch.log_softmax(done.model(torch.tensor([ids[:-1]]))[0].float(), -1)
            scores.append(sum(logp[j - 1, ids[j]].item() for j in range(start, len(ids))))
        right += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    assert got == pytest.approx(right / len(docs))
    assert "tiny_choice" in r.stdout and "acc" in r.stdout


def test_a_transformers_model_is_evaluated_with_its_own_tokenizer(tiny_pretrained, finished, token_cache, tmp_path):
    from looplib import load_finished
    from looplib.data.tokenizer import load_tokenizer
    from looplib.grpo import prompt_seed, sample
    root = finished
    out = tmp_path / "hf.json"
    r = evaluate(root, str(tiny_pretrained), "data=prompts", "data.path=held_out.jsonl",
                 "+reward._target_=my_rewards.letters", "n=2", "max_new_tokens=4", f"--out={out}", cache=token_cache)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    done = load_finished(tiny_pretrained, "cpu")
    info = load_tokenizer(str(tiny_pretrained))  # [BOS] + the prompt's ids, as data=prompts assembles a text prompt
    logits = lambda ids: done.model(input_ids=ids).logits  # noqa: E731
    rewards = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for index, record in enumerate(json.loads(x) for x in (root / "held_out.jsonl").read_text().splitlines()):
            gen = torch.Generator().manual_seed(prompt_seed(0, 0, index))
            with torch.no_grad():
                group = sample(logits, torch.tensor(info.encode(record["prompt"])), 2, 4, 1.0, 1.0, info.eos_id, gen)
            rewards += letters([info.tokenizer.decode(row[:row.index(info.eos_id)] if info.eos_id in row else row)
                                for row in group.tolist()])
    finally:
        torch.set_num_threads(threads)
    assert got["rewards"]["my_rewards.letters"]["mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert got["evaluation"]["run"]["loaded"] == str(tiny_pretrained.resolve())


def test_lm_eval_without_the_extra_is_refused_naming_it(finished, monkeypatch, capsys):
    import sys
    from looplib.cli.evaluate import main
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    assert main([str(finished / "run"), "--lm-eval", str(TASKS)]) == 2
    assert capsys.readouterr().err.strip() == (
        "looplib: error: --lm-eval: python -m looplib.evaluate --lm-eval needs the lm_eval package, which does not "
        "import (import of lm_eval halted; None in sys.modules); pip install 'looplib[eval]'")
    assert not (finished / "run" / "eval" / "lm-eval-lm_eval.json").exists()
