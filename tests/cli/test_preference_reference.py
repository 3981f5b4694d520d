"""The DPO reference computed once (loss.reference=precomputed): equal to the live reference (a
frozen copy, or the adapters switched off under LoRA), no reference forward while training,
cached beside the pairs' tokens so that a resume or a sweep's next job never computes it again;
and a resume whose reference changed is refused."""
import copy
import json
import logging
import shutil

import pytest
import torch

from looplib import reference as ref
from looplib.engines.local import Engine
from looplib.errors import ConfigError
from looplib.precision import Precision
from looplib.preference import DPO

from conftest import run_cli
from test_data_files import cache_dir, tok, tok_file, write_jsonl  # noqa: F401 (fixtures)
from test_preference import LN2, TINY, gpt, pair_rows, pairs, write_pairs

CPU = Engine("cpu")


def perturbed(model, seed=1, scale=0.03):
    """The policy some steps away from its reference (so that the DPO loss is not ln 2)."""
    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad or "lora" not in n:
                p.add_(scale * torch.randn_like(p))
    return model


def forwards(model):
    """A list that grows by one at every forward pass of ``model``."""
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    return calls


def loss_and_grads(objective, model, batch):
    params = [p for p in model.parameters() if p.requires_grad]
    loss = objective(model, batch)
    return loss, torch.autograd.grad(loss, params)


def assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert abs(la.item() - lb.item()) <= 1e-6 * max(1.0, abs(lb.item())) and abs(lb.item() / 4 - LN2) > 1e-3
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_precomputed_equals_the_frozen_copy_and_training_runs_no_reference_forward(tmp_path, tok_file, tok):  # noqa: F811
    corpus = pairs(tmp_path, tok_file, tok, pair_rows(30), eval_fraction=0.2)
    start = gpt(tok.get_vocab_size())
    pre = DPO(beta=0.3, reference="precomputed")
    pre.attach(start)
    pre.prepare(start, corpus, CPU, Precision(), 3)
    assert pre.reference is None and pre.identity["digest"] != pre.identity["weights"]  # no copy; the cache's key
    assert corpus.train.reference.shape == (len(corpus.train), 2) and corpus.eval.reference.shape == (len(corpus.eval), 2)
    live = DPO(beta=0.3)
    live.attach(start)  # a frozen copy of the same starting weights
    assert live.identity["weights"] == pre.identity["weights"]
    policy = perturbed(start)
    calls = forwards(policy)
    for split, rows in ((corpus.train, [5, 0, 17, 9]), (corpus.eval, [0, 1, 2, 3])):
        batch = corpus.collate([split[i] for i in rows])  # other pairs side by side than in the precomputing pass
        assert batch["reference_logps"].shape == (8,)
        calls.clear()
        got = loss_and_grads(pre, policy, batch)
        assert len(calls) == 1  # the policy's forward alone
        assert_same(got, loss_and_grads(live, policy, {k: v for k, v in batch.items() if k != "reference_logps"}))
    # the rewards it logs are the live reference's too
    a, b = pre.train_metrics(), live.train_metrics()
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], abs=1e-5) for k in a)


def test_precomputed_equals_adapters_off_under_lora(tmp_path, tok_file, tok):  # noqa: F811
    pytest.importorskip("peft")
    from looplib.peft import LoRA
    corpus = pairs(tmp_path, tok_file, tok, pair_rows(16))
    model = LoRA(r=4).wrap(gpt(tok.get_vocab_size()))
    pre, live = DPO(beta=0.3, reference="precomputed"), DPO(beta=0.3)
    pre.attach(model)
    pre.prepare(model, corpus, CPU, Precision(), 4)
    live.attach(model)
    assert pre.adapters is not None and live.reference is None
    assert pre.identity["weights"] == live.identity["weights"]  # the base's digest: the adapters left out
    with torch.no_grad():  # the adapters move: the policy leaves its reference (the base) behind
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05 * torch.randn_like(p))
    batch = corpus.collate([corpus.train[i] for i in (3, 1, 4, 0)])
    calls = forwards(model)
    got = loss_and_grads(pre, model, batch)
    assert len(calls) == 1
    assert_same(got, loss_and_grads(live, model, {k: v for k, v in batch.items() if k != "reference_logps"}))


def test_the_cache_is_read_again_and_keyed_by_weights_and_data(tmp_path, tok_file, tok, monkeypatch, caplog):  # noqa: F811
    corpus = pairs(tmp_path, tok_file, tok)
    start = gpt(tok.get_vocab_size())
    first = DPO(reference="precomputed")
    first.attach(start)
    first.prepare(start, corpus, CPU, Precision(), 4)
    computed = corpus.train.reference.copy()
    assert list(tmp_path.glob("cache/reference-*/train.npy"))

    def never(*a, **k):
        raise AssertionError("computed again")

    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="looplib"):
        m.setattr(ref, "compute", never)
        again, fresh = DPO(reference="precomputed"), pairs(tmp_path, tok_file, tok)  # a resume, a sweep's next job
        again.attach(gpt(tok.get_vocab_size()))
        again.prepare(gpt(tok.get_vocab_size()), fresh, CPU, Precision(), 2)
    assert "read from" in caplog.text and again.identity == first.identity
    assert (fresh.train.reference == computed).all()
    other = DPO(reference="precomputed")  # other starting weights: another key, computed
    other.attach(gpt(tok.get_vocab_size(), seed=3))
    other.prepare(gpt(tok.get_vocab_size(), seed=3), pairs(tmp_path, tok_file, tok), CPU, Precision(), 4)
    assert other.identity["digest"] != first.identity["digest"]
    cached = next(tmp_path.glob(f"cache/reference-{first.identity['digest']}/train.npy"))
    cached.write_bytes(cached.read_bytes()[:-16])  # a damaged cache: computed again and replaced, never trained on
    again, fresh = DPO(reference="precomputed"), pairs(tmp_path, tok_file, tok)
    again.attach(start)
    again.prepare(start, fresh, CPU, Precision(), 4)
    assert (fresh.train.reference == computed).all() and len(cached.read_bytes()) > 0
    assert ref.read(cached.parent, [fresh.train, fresh.eval]) is not None
    fewer = DPO(reference="precomputed")  # other pairs: another key
    fewer.attach(start)
    fewer.prepare(start, pairs(tmp_path, tok_file, tok, pair_rows(12)), CPU, Precision(), 4)
    assert len({first.identity["digest"], fewer.identity["digest"], other.identity["digest"]}) == 3


def test_precomputed_without_prepare_on_other_data_or_a_sharding_engine_is_refused(tmp_path, tok_file, tok):  # noqa: F811
    corpus = pairs(tmp_path, tok_file, tok)
    model = gpt(tok.get_vocab_size())
    objective = DPO(reference="precomputed")
    objective.attach(model)
    with pytest.raises(ConfigError, match="loss.reference"):  # never a silent reference = the policy itself
        objective(model, corpus.collate([corpus.train[i] for i in range(2)]))
    with pytest.raises(ConfigError, match="loss.reference"):
        DPO(reference="cached")

    class Rows(torch.utils.data.Dataset):  # a corpus of one's own, without pairs to carry the values
        def __len__(self):
            return 2

    other = type("Other", (), {"train": Rows(), "eval": None, "collate": None})()
    with pytest.raises(ConfigError, match="data=preference"):
        objective.prepare(model, other, CPU, Precision(), 2)

    class Sharding(Engine):  # DeepSpeed ZeRO-3 (FSDP2 runs the pass: tests/dist/test_fsdp_no_grad_forward.py)
        keeps_modules, label = False, "deepspeed"

    with pytest.raises(ConfigError, match="engine=deepspeed") as err:
        DPO(reference="precomputed").attach(model, Sharding("cpu"))
    assert err.value.key == "loss.reference"


def test_precomputed_run_equals_the_live_run_and_its_resume_reads_the_cache(tmp_path):
    data = write_pairs(tmp_path)
    job = ["data=preference", f"data.path={data}", "loss=dpo", *TINY, "eval_every=3", "checkpoint.every_steps=3"]
    one = {"OMP_NUM_THREADS": "1"}
    read = lambda run: [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert run_cli(*job, "max_steps=5", f"hydra.run.dir={tmp_path / 'live'}", cwd=tmp_path, env=one).returncode == 0
    r = run_cli(*job, "loss.reference=precomputed", "max_steps=5", f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path,
                env=one)
    assert r.returncode == 0, r.stderr
    said = r.stdout + r.stderr
    assert "computed in" in said and "frozen copy" not in said
    live, full = read("live"), read("full")
    assert full[0]["loss"] == LN2 and len(live) == len(full)
    for a, b in zip(full, live):
        for key in ("loss", "eval_loss", "reward_accuracy", "eval_reward_accuracy"):
            assert (key in a) == (key in b) and a.get(key, 0) == pytest.approx(b.get(key, 0), abs=1e-6), key
    assert run_cli(*job, "loss.reference=precomputed", "max_steps=3", f"hydra.run.dir={tmp_path / 'part'}",
                   cwd=tmp_path, env=one).returncode == 0
    r = run_cli(*job, "loss.reference=precomputed", "max_steps=5", "resume=auto", f"hydra.run.dir={tmp_path / 'part'}",
                cwd=tmp_path, env=one)
    assert r.returncode == 0, r.stderr
    said = r.stdout + r.stderr
    assert "read from" in said and "computed in" not in said  # the resume computed nothing again
    assert (tmp_path / "part" / "model.safetensors").read_bytes() == (tmp_path / "full" / "model.safetensors").read_bytes()
    meta = json.loads(next((tmp_path / "part" / "checkpoints").glob("step-*/meta.json")).read_text())
    assert meta["identity"]["reference"]["mode"] == "precomputed"


@pytest.mark.parametrize("mode", ["live", "precomputed"])
def test_a_resume_whose_reference_weights_changed_is_refused(tmp_path, tiny_pretrained, mode):
    """model.path's weights edited between the run and its resume: the config is the same, the
    reference is not. One line, exit 2, the run directory and the cache as they were."""
    transformers = pytest.importorskip("transformers")
    base = tmp_path / "base"
    shutil.copytree(tiny_pretrained, base)
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(24))
    job = ["model=hf", f"model.path={base}", "model.seq_len=48", "data=preference", f"data.path={data}", "loss=dpo",
           f"loss.reference={mode}", "batch_size=4", "log_every=1", "sample_tokens=0", "eval_samples=4",
           "checkpoint.every_steps=2", f"hydra.run.dir={tmp_path / 'run'}"]
    r = run_cli(*job, "max_steps=2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base))
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(str(base))
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    caches = sorted(p.name for p in (tmp_path / "cache").glob("reference-*"))
    r = run_cli(*job, "max_steps=4", "resume=auto", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "DPO reference" in line and "Traceback" not in r.stderr and "new run" in line
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in (tmp_path / "cache").glob("reference-*")) == caches  # nothing computed either


# --- the planner: python -m looplib.plan counts the reference ----------------------------------

def dpo_plan(*overrides):
    from hydra import compose, initialize_config_module

    from looplib.cli.plan import build_plan
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["data=preference", "data.path=pairs.jsonl",
                                                       "data.vocab_size=512", "loss=dpo", "batch_size=4", *overrides])
    return cfg, build_plan(cfg, memory=2**30)


def test_the_plan_counts_the_frozen_copy_and_nothing_for_lora_or_precomputed():
    from looplib.cli.instantiate import instantiate
    cfg, live = dpo_plan()
    model = instantiate(cfg, "model")
    objective = instantiate(cfg, "loss")
    objective.attach(model)  # the copy a run takes: its bytes are the plan's
    real = sum(t.untyped_storage().nbytes() for t in objective.reference.parameters())
    assert live.reference == real > 0 and "frozen copy" in live.reference_kind
    _, pre = dpo_plan("loss.reference=precomputed")
    assert pre.reference == 0 and live.static - pre.static == real and live.peak(4) - pre.peak(4) == real
    from hydra import compose, initialize_config_module

    from looplib.cli.plan import build_plan
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        lm = build_plan(compose(config_name="config", overrides=["data=random", "batch_size=4"]), memory=2**30)
    # a sample is a pair: two sequences' activations (the reference's forward saves none for backward)
    assert live.act_plain.per_sample == pre.act_plain.per_sample == pytest.approx(2 * lm.act_plain.per_sample, rel=0.01)
    pytest.importorskip("peft")
    _, lora = dpo_plan("+peft=lora")
    assert lora.reference == 0 and "adapters" in lora.reference_kind


def test_python_m_looplib_plan_prints_the_reference_row(tmp_path):
    r = run_cli("data=preference", "data.path=pairs.jsonl", "data.vocab_size=512", "loss=dpo", "--memory-gib", "16",
                cwd=tmp_path, module="looplib.plan")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if "DPO reference" in line)
    weights = next(line for line in r.stdout.splitlines() if line.strip().startswith("weights ("))
    assert row.split()[-4] == weights.split()[-4]  # the copy: as many bytes as the weights


def test_two_ddp_processes_share_the_pass_and_train_as_one_process_with_the_live_copy(tmp_path):
    """+engine=ddp: each rank computes every other micro-batch of pairs, the ranks' arrays are
    summed: the same losses and rewards as one process of twice the batch with the frozen copy."""
    from test_engines_ddp import LOSS_RTOL, torchrun

    job = ["data=preference", f"data.path={write_pairs(tmp_path)}", "loss=dpo", *TINY, "max_steps=3", "eval_every=3",
           "+optim=sgd", "optim.momentum=0"]
    two = torchrun("+engine=ddp", *job, "loss.reference=precomputed", "batch_size=2",
                   f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    assert len(list((tmp_path / "cache").glob("reference-*/train.npy"))) == 1  # written once, by rank 0
    one = run_cli(*job, "batch_size=4", f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    read = lambda run: [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    rows = list(zip(read("two"), read("one")))
    assert len(rows) >= 3
    for a, b in rows:
        for key in ("loss", "eval_loss", "reward_accuracy", "eval_reward_margin"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=LOSS_RTOL, abs=1e-5), key
