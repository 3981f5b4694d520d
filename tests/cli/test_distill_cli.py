"""loss=distill from the command line: a student distilled from a finished looplib run (data=instruct
and data=text, the two terms in metrics.jsonl), and the teacher refused in one line, nothing
written, for another vocabulary size or other token ids."""
import json
import random

import pytest

from conftest import run_cli

WORDS = "the a model learns data file token window train loop code value list print".split()
TINY = ["model.n_layer=1", "model.n_head=2", "model.seq_len=32", "batch_size=4", "log_every=1", "sample_tokens=0",
        "eval_samples=4", "data.vocab_size=300"]


def write_examples(path, n=60, seed=0):
    rng = random.Random(seed)
    rows = [{"prompt": " ".join(rng.choices(WORDS, k=5)) + "?", "completion": " " + " ".join(rng.choices(WORDS, k=6))}
            for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, token_cache):
    """A finished looplib run (a bundled GPT wider than the students) on instruction data."""
    root = tmp_path_factory.mktemp("distill")
    data = write_examples(root / "inst.jsonl")
    r = run_cli("data=instruct", f"data.path={data}", *TINY, "model.d_model=32", "max_steps=3",
                f"hydra.run.dir={root / 'teacher'}", cwd=root, env={"LOOPLIB_CACHE": token_cache})
    assert r.returncode == 0, r.stderr
    return root


def rows_of(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_student_distilled_from_a_finished_run_logs_both_terms(teacher, token_cache):
    run = teacher / "student"
    r = run_cli("data=instruct", f"data.path={teacher / 'inst.jsonl'}", "loss=distill",
                f"loss.teacher={teacher / 'teacher'}",
                "loss.temperature=2", "loss.alpha=0.7", *TINY, "model.d_model=16", "max_steps=2", "eval_every=2",
                f"hydra.run.dir={run}", cwd=teacher, env={"LOOPLIB_CACHE": token_cache})
    assert r.returncode == 0, r.stderr
    assert "distillation teacher" in r.stdout + r.stderr
    rows = rows_of(run)
    first = next(x for x in rows if x.get("step") == 1 and "loss" in x)
    # the logged loss is the two logged terms' mix: (1 - alpha) CE + alpha T^2 D, per token
    assert first["loss"] == pytest.approx(0.3 * first["loss_ce"] + 0.7 * 4 * first["loss_distill"], rel=1e-5)
    assert first["loss_distill"] > 0 and "tokens_per_s" in first
    evaluated = next(x for x in rows if "eval_loss" in x)
    assert evaluated["eval_loss"] == pytest.approx(0.3 * evaluated["eval_loss_ce"]
                                                   + 2.8 * evaluated["eval_loss_distill"], rel=1e-5)
    assert (run / "model.safetensors").is_file()


def test_data_text_with_the_teachers_tokenizer(teacher, token_cache):
    """data=text tokenised with the teacher run's tokenizer (kept in its checkpoint) distils too."""
    texts = teacher / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": json.loads(x)["prompt"] + json.loads(x)["completion"]}) + "\n"
                             for x in (teacher / "inst.jsonl").read_text().splitlines()))
    (tokenizer,) = (teacher / "teacher" / "checkpoints").glob("step-*/tokenizer.json")
    r = run_cli("data=text", f"data.path={texts}", f"data.tokenizer={tokenizer}", "loss=distill",
                f"loss.teacher={teacher / 'teacher'}", "loss.kind=jsd", *TINY,
                "model.d_model=16", "max_steps=1", f"hydra.run.dir={teacher / 'text'}", cwd=teacher,
                env={"LOOPLIB_CACHE": token_cache})
    assert r.returncode == 0, r.stderr
    assert rows_of(teacher / "text")[0]["loss_distill"] > 0


def test_a_distilled_run_resumes_bit_for_bit(teacher, token_cache):
    """The teacher is read again and placed before the checkpoint loads: killed at step 2 and resumed,
    the run ends with the uninterrupted run's weights."""
    job = ["data=instruct", f"data.path={teacher / 'inst.jsonl'}", "loss=distill",
           f"loss.teacher={teacher / 'teacher'}",
           "loss.kind=reverse_kl", *TINY, "model.d_model=16", "checkpoint.every_steps=2"]
    env = {"LOOPLIB_CACHE": token_cache, "OMP_NUM_THREADS": "1"}  # one thread's order of sums
    full, part = teacher / "full", teacher / "part"
    assert run_cli(*job, "max_steps=4", f"hydra.run.dir={full}", cwd=teacher, env=env).returncode == 0
    assert run_cli(*job, "max_steps=2", f"hydra.run.dir={part}", cwd=teacher, env=env).returncode == 0
    r = run_cli(*job, "max_steps=4", "resume=auto", f"hydra.run.dir={part}", cwd=teacher, env=env)
    assert r.returncode == 0, r.stderr
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert [x["loss_distill"] for x in rows_of(part) if "loss_distill" in x] == \
        [x["loss_distill"] for x in rows_of(full) if "loss_distill" in x]


@pytest.mark.parametrize("data, vocab, words", [
    ("inst.jsonl", 280, ["300 tokens, the student 280", "data.vocab_size=300"]),
    ("other.jsonl", 300, ["tokenises differently", "tokenizer.json"])])
def test_a_teacher_of_another_vocabulary_is_refused_in_one_line(teacher, token_cache, data, vocab, words):
    write_examples(teacher / "other.jsonl", seed=7)  # other text: a tokenizer of the same size with other ids
    run = teacher / f"refused-{vocab}"
    r = run_cli("data=instruct", f"data.path={teacher / data}", "loss=distill", f"loss.teacher={teacher / 'teacher'}",
                *TINY, f"data.vocab_size={vocab}", "model.d_model=16", "max_steps=2",
                f"hydra.run.dir={run}", cwd=teacher, env={"LOOPLIB_CACHE": token_cache})
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("looplib: error: loss.teacher:") and all(w in line for w in words), r.stderr
    assert "Traceback" not in r.stderr
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    assert not (run / "config.yaml").exists()


def test_a_resume_whose_teacher_changed_is_refused(teacher, token_cache):
    """The teacher's weights are in every checkpoint's fingerprint: a teacher edited in place since
    (the same path, so the same config) is refused in one line, the run left as it was."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    moved = teacher / "teacher-copy"
    shutil.copytree(teacher / "teacher", moved)
    job = ["data=instruct", f"data.path={teacher / 'inst.jsonl'}", "loss=distill", f"loss.teacher={moved}", *TINY,
           "model.d_model=16", "checkpoint.every_steps=1"]
    env = {"LOOPLIB_CACHE": token_cache}
    run = teacher / "changed"
    assert run_cli(*job, "max_steps=1", f"hydra.run.dir={run}", cwd=teacher, env=env).returncode == 0
    weights = load_file(moved / "model.safetensors")
    save_file({k: v + 0.01 * torch.ones_like(v) for k, v in weights.items()}, moved / "model.safetensors")
    before = (run / "model.safetensors").read_bytes()
    r = run_cli(*job, "max_steps=2", "resume=auto", f"hydra.run.dir={run}", cwd=teacher, env=env)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "the distillation teacher (loss.teacher) differs from that the checkpoint" in line
    assert "Traceback" not in r.stderr
    assert (run / "model.safetensors").read_bytes() == before and not list(run.glob("checkpoints/step-*2"))
    save_file(weights, moved / "model.safetensors")  # put back: the resume goes on
    assert run_cli(*job, "max_steps=2", "resume=auto", f"hydra.run.dir={run}", cwd=teacher, env=env).returncode == 0
