"""+engine=fsdp +peft=qlora on a tiny transformers Llama (gloo, two processes): the losses of one
process, the 4-bit base sharded and still packed, the constants whole on every rank and in the
checkpoint, resume on one process equal to the uninterrupted two-process run, the adapter loaded by
peft on the 4-bit and on the full-precision base; and the planner's per-rank bytes against the bytes
each rank of a real two-process run holds."""
import json

import pytest
import torch

import dist_workers as W
from conftest import needs_bnb, run_cli
from looplib.plan.advice import human
from test_engines_ddp import torchrun

peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'looplib[peft]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'looplib[hf]')")
pytestmark = needs_bnb

# 4 AdamW steps of lr 3e-2 on the adapters: two ranks sum their halves of each window in another
# order than one process (float rounding, magnified where Adam divides by a tiny sqrt(v))
LOSS_RTOL, ADAPTER_ATOL = 1e-6, 1e-4


def model(model_dir) -> list[str]:
    """The tiny Llama read from model.path, QLoRA r=4 on every linear layer, on random tokens."""
    return ["model=hf", f"model.path={model_dir}", "model.seq_len=32", "+peft=qlora", "peft.r=4", "peft.alpha=8",
            "data=random", "data.vocab_size=384"]


def job(model_dir) -> list[str]:
    """Four steps of two micro-batches, a checkpoint every two; blocks recomputed in backward (under FSDP
    inside the gathered block, where bitsandbytes puts the constants back on the gathered weight again)."""
    return [*model(model_dir), "+checkpointing=blocks", "max_steps=4", "accum_steps=2", "log_every=1", "eval_every=0",
            "eval_samples=0", "sample_tokens=0", "lr=3e-2", "checkpoint.every_steps=2"]


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def adapter(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(run_dir / "hf" / "adapter_model.safetensors")


def test_two_processes_equal_one_and_resume_on_one(tiny_pretrained, tmp_path):
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    import re
    header = re.compile(r"training .*?\(([0-9.]+M parameters, [0-9.]+M trained, the base's [0-9.]+M held in 4 bits)\)")
    r = run_cli(*job(tiny_pretrained), "batch_size=4", f"hydra.run.dir={one}", cwd=tmp_path)  # the local engine
    assert r.returncode == 0, r.stderr
    said = header.findall(r.stdout + r.stderr)
    r = torchrun(*job(tiny_pretrained), "+engine=fsdp", "batch_size=2", f"hydra.run.dir={two}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert said and header.findall(r.stdout + r.stderr)[:1] == said  # counted before sharding: the same model
    assert losses(two) == pytest.approx(losses(one), rel=LOSS_RTOL)
    a, b = adapter(one), adapter(two)
    assert a.keys() == b.keys() and len(a) == 28  # 2 layers x 7 linear layers x (A, B)
    assert all(b[k].abs().min() > 0 for k in b if "lora_B" in k)  # trained: B starts at zero
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=ADAPTER_ATOL, rtol=0)

    # the checkpoint: each packed weight in fp32 (8 weights an element), one half written by each rank,
    # and every layer's quantisation constants whole, once
    import torch.distributed.checkpoint as dcp
    ckpt = two / "checkpoints" / "step-00000002"
    meta = dcp.FileSystemReader(str(ckpt / "shards")).read_metadata().state_dict_metadata
    width = json.loads((tiny_pretrained / "config.json").read_text())["hidden_size"]
    q = meta["model.hf.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert q.properties.dtype == torch.float32 and tuple(q.size) == (width * width // 8, 1)
    assert sorted(c.offsets[0] for c in q.chunks) == [0, width * width // 16]
    constants = [k for k in meta if k.startswith("quant_constants.")]
    assert len(constants) == 14 * 5  # absmax, quant_map, nested_absmax, nested_quant_map, the packed description
    assert all(len(meta[k].chunks) == 1 for k in constants)

    # the same command on one process from step 2: the accumulation doubles, the run continues as it did
    r = run_cli(*job(tiny_pretrained), "+engine=fsdp", "batch_size=2", f"resume={ckpt}",
                f"hydra.run.dir={resumed}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resume: 2 -> 1 processes: accum_steps 2 -> 4, global batch 8 kept" in r.stdout
    assert losses(resumed) == pytest.approx({s: losses(two)[s] for s in (3, 4)}, rel=1e-5)
    c = adapter(resumed)
    for key in a:
        torch.testing.assert_close(c[key], b[key], atol=1e-5, rtol=0)

    # another engine cannot read the packed shards: one line, before anything is built
    r = run_cli(*job(tiny_pretrained), "batch_size=2", f"resume={ckpt}", f"hydra.run.dir={tmp_path / 'local'}",
                cwd=tmp_path)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0] == ("looplib: error: resume: the checkpoint holds a 4-bit base (+peft=qlora) as +engine=fsdp "
                        "packs it (float shards), which +engine=local cannot load; resume with +engine=fsdp (on any "
                        "number of processes), or start a new run")

    # the exported adapter loads with peft on the 4-bit base (as python -m looplib.generate does) and on model.path
    from looplib.store.finished import load_hf, run_config
    from looplib.quantize import is_4bit
    on_4bit = load_hf(two / "hf", torch.device("cpu"), run_config(two))[0]
    assert isinstance(on_4bit, peft.PeftModel) and sum(is_4bit(m) for m in on_4bit.modules()) == 14
    full = peft.AutoPeftModelForCausalLM.from_pretrained(str(two / "hf")).eval()
    ids = torch.randint(0, 384, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert 0 < (full(input_ids=ids).logits - on_4bit(input_ids=ids).logits).abs().max() < 0.5


# ------------------------------------------------------------------ the planner against counted bytes

def compose(*overrides):
    from hydra import compose as hydra_compose, initialize_config_module
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def local_bytes(tensors) -> int:
    """Bytes of each tensor's storage on this rank (a DTensor: its shard, padding included), each once."""
    seen = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def counting_worker(rank: int, world: int, port: int, out: str, model_dir: str) -> None:
    """One rank of a real run: the bytes it holds by kind after a step, and what autograd saves in a forward."""
    from pathlib import Path

    from looplib.cli.instantiate import instantiate
    from looplib.engines.fsdp import FSDP
    from looplib.loss import TokenCrossEntropy
    from looplib.optim import AdamW
    from looplib.precision import FP32
    from looplib.quantize import is_4bit, quant_tensors
    W.set_env(rank, world, port)
    cfg = compose(*model(model_dir), "batch_size=2", "+engine=fsdp")
    engine, strategy = FSDP("cpu"), instantiate(cfg, "peft")
    strategy.check(engine, FP32())
    with strategy.loading():
        net = instantiate(cfg, "model")
    net = engine.setup(strategy.wrap(net))
    optimizer = AdamW(lr=1e-2).build(net)
    g = torch.Generator().manual_seed(rank)
    batch = {"input_ids": torch.randint(0, 384, (2, 32), generator=g)}
    batch["labels"] = batch["input_ids"]
    TokenCrossEntropy()(net, batch).backward()
    optimizer.step()  # the state exists; the gradients stay (not zeroed)

    saved = {}

    def pack(t):  # what autograd holds for backward, parameters (the gathered ones FSDP swapped in) left out
        params = {p.untyped_storage().data_ptr() for p in net.parameters() if not hasattr(p, "to_local")}
        if not isinstance(t, torch.nn.Parameter) and t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = TokenCrossEntropy()(net, batch)
    loss.backward()

    layers = [m for m in net.modules() if is_4bit(m, planned=False)]
    packed = {id(m.weight) for m in layers}
    params = list({id(p): p for p in net.parameters()}.values())
    local = [p.to_local() for p in params if id(p) in packed]
    counted = {
        "packed": local_bytes(p for p in params if id(p) in packed),
        "constants": local_bytes(t for m in layers for t in quant_tensors(SimpleWeight(m.quant_state))),
        "frozen": local_bytes(p for p in params if id(p) not in packed and not p.requires_grad),
        "adapters": local_bytes(p for p in params if p.requires_grad),
        "gradients": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": local_bytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)),
        "activations": sum(saved.values()),
        "packed_dtypes": sorted({str(t.dtype) for t in local}), "packed_width": {t.shape[1] for t in local},
        "frozen_base": all(not p.requires_grad for p in params if id(p) in packed),
    }
    # the export under FSDP: the adapter, and with peft.merge=true the gathered packed bytes
    # dequantised with each layer's constants, the adapter merged
    from looplib.peft import QLoRA
    from looplib.store.export import write_exports
    write_exports(net, Path(out) / "adapter", QLoRA(r=4, alpha=8).exports(), engine)
    write_exports(net, Path(out) / "merged", QLoRA(r=4, alpha=8, merge=True).exports(), engine)
    if engine.is_main:
        torch.save(counted, Path(out) / "counted.pt")
    engine.close()


class SimpleWeight:
    """``quant_tensors`` reads ``param.quant_state``: the module's own state, whole on every rank."""

    def __init__(self, quant_state):
        self.quant_state = quant_state


def test_planner_per_rank_bytes_are_the_bytes_two_ranks_hold(tiny_pretrained, tmp_path):
    from looplib.cli.plan import build_plan
    W.spawn(counting_worker, 2, tmp_path, str(tiny_pretrained))
    counted = torch.load(tmp_path / "counted.pt", weights_only=False)
    assert counted["packed_dtypes"] == ["torch.float32"] and counted["packed_width"] == {1}  # packed, sharded
    assert counted["frozen_base"]
    cfg = compose(*model(tiny_pretrained), "batch_size=2", "+engine=fsdp")
    plan = build_plan(cfg, world=2, memory=2**30)
    planned = plan.fsdp_4bit(2)
    assert plan.engine == "fsdp" and plan.four_bit
    for kind in ("packed", "constants", "frozen", "adapters", "gradients", "optimizer"):
        assert planned[kind] == pytest.approx(counted[kind], rel=0.05), kind
    assert plan.activations.device.at(2) == pytest.approx(counted["activations"], rel=0.05)
    # each rank holds half of the packed base (padding apart) and every constant
    assert planned["packed"] == pytest.approx(plan.sharded4.per_rank(1)["packed"] / 2, rel=0.01)
    assert planned["constants"] == plan.sharded4.per_rank(1)["constants"]

    # peft.merge=true under FSDP: each merged weight is model.path's quantised to NF4 (double
    # quantisation, blocks of 64: the same bytes the run held) and dequantised, plus alpha/r x B @ A
    # of the adapter the same run exported
    import bitsandbytes.functional as F
    from safetensors.torch import load_file
    merged = load_file(tmp_path / "merged" / "hf" / "model.safetensors")
    original = load_file(tiny_pretrained / "model.safetensors")
    lora = load_file(tmp_path / "adapter" / "hf" / "adapter_model.safetensors")
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "hf" / "config.json").read_text())
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        key = f"model.layers.1.{name}.weight"
        base = F.dequantize_4bit(*F.quantize_4bit(original[key], quant_type="nf4", compress_statistics=True))
        a, b = (lora[f"base_model.model.model.layers.1.{name}.lora_{x}.weight"] for x in "AB")
        assert b.abs().max() > 0  # trained a step: the merge adds something
        torch.testing.assert_close(merged[key], base + 8 / 4 * b @ a, atol=1e-6, rtol=0)


def test_the_planner_says_whether_it_fits_and_what_to_turn_on(tiny_pretrained):
    """Under +engine=fsdp the advice is per rank: fits as configured; else an activation strategy that
    fits on these ranks; else the fewest ranks that fit; and on one device that is too small, FSDP's."""
    from looplib.cli.plan import build_plan
    from looplib.plan.advice import recommendations
    from looplib.plan.render import render
    cfg = compose(*model(tiny_pretrained), "batch_size=2", "+engine=fsdp")

    def advice(usable, world=2, config=cfg):
        return recommendations(build_plan(config.copy(), world=world, memory=int(usable / 0.9) + 1))
    plan = build_plan(cfg.copy(), world=2, memory=2**30)
    peak, uses = plan.fsdp_4bit(2)["peak"], plan.uses
    assert advice(peak) == [f"+engine=fsdp over 2 rank(s) (torchrun --nproc_per_node 2) shards the 4-bit base: "
                            f"{human(peak)} per rank of {human(int(int(peak / 0.9 + 1) * 0.9))} usable: fits"]
    selective = plan.fsdp_4bit(2, uses["selective"])["peak"]
    said = advice(selective)
    assert said[0].startswith("+engine=fsdp over 2 rank(s) (torchrun --nproc_per_node 2): ") and "does NOT fit" in said[0]
    assert said[1] == f"+checkpointing=selective: {human(selective)} per rank: fits"
    offload_on_3 = plan.fsdp_4bit(3, uses["offload"])["peak"]
    assert offload_on_3 < plan.fsdp_4bit(2, uses["offload"])["peak"]  # more ranks, smaller shards
    assert advice(offload_on_3)[1] == (f"--world-size 3 (torchrun --nproc_per_node 3) with +checkpointing=offload: "
                                       f"{human(offload_on_3)} per rank: fits")
    assert "not even 64 ranks fit it" in advice(1000)[1]
    # the rows: each a share of the whole but the constants, and the peak their sum
    rows = render(plan)
    assert "quantisation constants (whole on every rank)" in rows and "DeepSpeed ZeRO: refused" in rows
    r, whole = plan.fsdp_4bit(2), plan.sharded4.per_rank(1)
    assert r["constants"] == whole["constants"] and r["adapters"] == pytest.approx(whole["adapters"] / 2, rel=0.01)
    assert r["peak"] == sum(v for k, v in r.items() if k != "peak")
    # the local engine on one device too small for the 4-bit base: FSDP over the ranks that fit
    local = compose(*model(tiny_pretrained), "batch_size=2")
    one = build_plan(local.copy(), memory=2**30)
    said = advice(one.static + one.act_ckpt.at(1) // 2, world=1, config=local)
    assert any("does not fit one device: +engine=fsdp over 1 rank(s)" in line for line in said), said
