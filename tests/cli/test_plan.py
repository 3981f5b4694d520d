"""The memory planner: static bytes equal the real tensors' bytes, ZeRO follows the paper,
activations match what autograd really saves on the CPU, recommendations follow the guides."""
import pytest
import torch
from hydra import compose, initialize_config_module

from looplib.models import GPT
from looplib.cli.plan import build_plan
from looplib.plan import default_checkpointing, recommendations, zero_per_rank

from conftest import run_cli


def real_state_bytes(opt):
    seen, total = set(), 0
    for state in opt.state.values():
        for t in state.values():
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def test_the_peak_of_a_checkpointed_bf16_lm_is_the_loss_backward_without_the_blocks_copies():
    """Under +checkpointing=blocks the blocks' 16-bit weight copies live to the end of forward
    (autocast's cache) but not into backward; offload packs them to host memory."""
    over = ("data=random", "data.vocab_size=4096", "model.seq_len=64", "batch_size=8", "+precision=bf16")
    blocks = build_plan(compose_with(*over, "+checkpointing=blocks"), memory=2**30)
    with torch.device("meta"):
        model = GPT(vocab_size=4096, seq_len=64, n_layer=4, n_head=4, d_model=128)
    linears = [m for b in model.blocks for m in b.modules() if isinstance(m, torch.nn.Linear)]
    in_blocks = sum(2 * p.numel() for m in linears for p in m.parameters())
    assert blocks.copies_freed == in_blocks and blocks.copies == in_blocks + 2 * 4096 * 128  # the tied head stays
    use = blocks.activations
    assert use.transient.at(8) == 2 * 8 * 64 * 4096 * 4 > use.device.at(8)  # the loss's, more than all saved
    assert blocks.peak(8) == (blocks.weights + blocks.optim_state + blocks.copies - in_blocks + use.device.at(8)
                              + use.transient.at(8))
    assert blocks.uses["offload"].host.fixed == in_blocks  # the copies, packed once per forward


def compose_with(*overrides):
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_recommendations_follow_the_guides_order():
    cfg = compose_with("model=bert_tiny", "data=classification", "loss=classification", "batch_size=4")
    roomy = build_plan(cfg.copy(), memory=2**30)
    recs = recommendations(roomy)
    assert recs[0].startswith("largest micro-batch that fits at any accumulation: ")
    assert "batch_size=4 accum_steps=1" in recs[0]
    assert not any("ZeRO" in r or "checkpointing" in r for r in recs)
    fits = int(recs[0].split(": ")[1].split()[0].rstrip(";"))
    assert fits % 8 == 0 and fits >= 8
    static = roomy.static
    tight = build_plan(cfg.copy(), memory=int((static + roomy.act_plain.at(1) // 2) / 0.9))
    recs = recommendations(tight)
    assert recs[0].startswith("not even a micro-batch of 1 fits")
    order = [next(i for i, r in enumerate(recs) if r.startswith(s)) for s in
             ("+checkpointing=blocks", "+optim=adam8bit", "+precision=bf16")]
    assert order == sorted(order) and not any("ZeRO" in r for r in recs)
    tiny = build_plan(cfg.copy(), memory=static // 2, world=8)
    assert "ZeRO" in recommendations(tiny)[-1] and "8 rank(s)" in recommendations(tiny)[-1]


def test_the_peak_counts_gradients_beside_activations_only_when_accumulating():
    """The loop frees gradients after each update: without accumulation the forward pass ends
    with none allocated, with accumulation they live through the next micro-batches."""
    base = ("model=bert_tiny", "data=classification", "loss=classification", "batch_size=32")
    one = build_plan(compose_with(*base), memory=2**30)
    two = build_plan(compose_with(*base, "accum_steps=2"), memory=2**30)
    held = one.weights + one.copies + one.optim_state
    assert one.activations.at(32) > one.gradients  # activations dominate at this batch
    assert one.peak(32) == held + one.activations.at(32) < one.static + one.activations.at(32)
    assert two.peak(32) == two.static + two.activations.at(32)
    assert one.peak(1) == held + max(one.gradients, one.activations.at(1))


def test_checkpointed_estimate_uses_the_configured_strategy():
    cfg = compose_with("model=bert_tiny", "data=classification", "loss=classification",
                       "+checkpointing=blocks", "checkpointing.every=2")
    plan = build_plan(cfg, memory=2**30)
    assert plan.checkpointing_on and plan.chosen == ["blocks.0"]
    every_block = build_plan(compose_with("model=bert_tiny", "data=classification", "loss=classification"),
                             memory=2**30)
    assert not every_block.checkpointing_on and every_block.chosen == ["blocks.0", "blocks.1"]
    assert every_block.act_ckpt.per_sample < plan.act_ckpt.per_sample  # fewer modules, less saved
    assert plan.act_plain == every_block.act_plain and default_checkpointing().every == 1


def test_cli_prints_the_anatomy(tmp_path):
    out = run_cli("data=random", "+optim=sgd", "--world-size", "4", "--memory-gib", "16", cwd=tmp_path,
                  module="looplib.plan")
    assert out.returncode == 0, out.stderr
    with torch.device("meta"):
        model = GPT(vocab_size=512, seq_len=128, n_layer=4, n_head=4, d_model=128)
    n = sum(p.numel() for p in model.parameters())
    for line in ("weights (4 bytes/param)", "gradients", "optimizer state (SGD)"):
        assert any(row.strip().startswith(line) and f"{4 * n:,} B" in row for row in out.stdout.splitlines()), line
    assert "4 rank(s)" in out.stdout and "device memory (given)" in out.stdout and "recommendations:" in out.stdout
    assert not list(tmp_path.iterdir())  # no run directory


@pytest.mark.parametrize("args,message", [
    (["batch_size=-1"], "looplib: error: batch_size: batch_size must be at least 1"),
    (["--world-size", "0"], "looplib: error: --world-size: must be at least 1"),
    (["+precision=fp64"], "looplib: error: In 'config': Could not find 'precision/fp64'"),
])
def test_cli_errors(args, message, tmp_path):
    out = run_cli(*args, cwd=tmp_path, module="looplib.plan")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_plan_against_the_allocator_peak_on_a_gpu(precision):
    """The static part is exact; the planned peak should land near the CUDA
    allocator's peak of a real step (the relative error is printed: report it)."""
    cfg = compose_with("model=gpt2_small", "data=random", "batch_size=4", f"+precision={precision}")
    plan = build_plan(cfg.copy(), memory=torch.cuda.get_device_properties(0).total_memory)
    from looplib.cli.main import build_job
    job = build_job(cfg)
    opt = job.optim.build(job.model)
    batch = {"input_ids": torch.randint(0, 512, (4, 1024), device="cuda"),
             "labels": torch.randint(0, 512, (4, 1024), device="cuda")}
    for _ in range(2):  # the second step: optimizer state exists, as in training
        torch.cuda.reset_peak_memory_stats()
        with job.precision.autocast():
            loss = job.objective(job.model, batch) / 4096
        job.precision.backward(loss)
        job.precision.step(opt)
        opt.zero_grad(set_to_none=True)  # as the loop does: no gradients during the next forward
    peak = torch.cuda.max_memory_allocated()
    planned = plan.peak(4)
    print(f"\nplan {planned / 2**20:.0f} MiB, allocator peak {peak / 2**20:.0f} MiB, error {planned / peak - 1:+.1%}")
    assert 0.7 < planned / peak < 1.3


def test_fsdp_per_rank_and_the_engine_choice():
    """FSDP2 per rank = (parameters + gradients + optimizer state) / world, which is ZeRO-3's
    model state, plus the largest unit gathered whole with its unsharded gradients. The engine
    recommended is DDP while the model state fits, then the first sharding that fits."""
    cfg = compose_with("data=random", "batch_size=4", "model.n_layer=8")
    plan = build_plan(cfg.copy(), memory=2**30, world=8)
    d = 128  # one Block: qkv + proj + 2 MLP matrices (12 d^2), their biases (9 d), 2 LayerNorms (4 d)
    assert plan.fsdp_unit == ("blocks.0", 4 * (12 * d * d + 9 * d + 4 * d))  # fp32: 4 bytes each
    sharded = -(-(plan.weights + plan.gradients + plan.optim_state) // 8)
    assert sharded == zero_per_rank(*plan.zero_layout(), 8, 3)
    assert plan.fsdp() == sharded + 2 * plan.fsdp_unit[1] and plan.fsdp(offload=True) == 2 * plan.fsdp_unit[1]
    act = plan.act_ckpt.at(1)

    def choice(usable):
        return recommendations(build_plan(cfg.copy(), memory=int(usable / 0.9) + 1, world=8))[-1]
    assert "+engine=ddp over 8 rank(s)" in choice(2**30)
    assert "+engine=fsdp (shards + the largest unit, blocks.0, gathered) over 8 rank(s)" in choice(plan.fsdp() + act)
    assert "DeepSpeed ZeRO-2" in choice(zero_per_rank(*plan.zero_layout(), 8, 2) + act)
    assert "+engine=fsdp engine.offload=cpu" in choice(plan.fsdp(offload=True) + act)
    assert "use more ranks" in choice(act // 2)


def test_under_lora_gradients_and_optimizer_state_are_planned_for_the_adapter_only():
    """+peft=lora: weights for the whole model, gradients and optimizer state for the parameters
    that train, equal to the adapted model's real ones after a step."""
    pytest.importorskip("peft", reason="peft is not installed (pip install 'looplib[peft]')")
    from looplib.cli.instantiate import instantiate
    cfg = compose_with("model=tiny", "+peft=lora", "data=random")
    plan = build_plan(cfg, memory=2**30)

    torch.manual_seed(0)
    model = instantiate(cfg, "peft").wrap(instantiate(cfg, "model"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = instantiate(cfg, "optim").build(model)
    ids = torch.randint(0, model.vocab_size, (2, 16))
    loss = instantiate(cfg, "loss")(model, {"input_ids": ids, "labels": ids})
    loss.backward()
    opt.step()
    assert plan.n_params == sum(p.numel() for p in trainable) < plan.n_total == sum(p.numel() for p in model.parameters())
    assert plan.weights == sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert plan.gradients == sum(p.grad.untyped_storage().nbytes() for p in trainable)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert plan.optim_state == real_state_bytes(opt) > 0


def test_the_plan_prints_the_teachers_row(tmp_path):
    from safetensors.torch import save_model

    from conftest import tiny_gpt
    from looplib.plan.render import render
    teacher = tiny_gpt(vocab=512)
    save_model(teacher, str(tmp_path / "model.safetensors"))
    with initialize_config_module(config_module="looplib.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["data=random", "data.vocab_size=512", "loss=distill",
                                                       f"loss.teacher={tmp_path}", "loss.teacher_dtype=bfloat16",
                                                       "batch_size=4"])
        with_teacher = build_plan(cfg, memory=2**30)
        without = build_plan(compose(config_name="config", overrides=["data=random", "data.vocab_size=512",
                                                                      "batch_size=4"]), memory=2**30)
    size = 2 * sum(p.numel() for p in teacher.parameters())
    assert with_teacher.reference == size and with_teacher.static - without.static == size
    row = next(line for line in render(with_teacher).splitlines() if "distillation teacher" in line)
    assert str(tmp_path) in row and "bfloat16" in row
