"""+optim=muon: torch.optim.Muon on the hidden matrices, AdamW on the rest, as one optimizer."""
import re

import pytest
import torch

from conftest import random_tokens, tiny_gpt
from looplib.errors import ConfigError
from looplib.loss import TokenCrossEntropy
from looplib.muon import Muon, MuonAdamW, hidden_matrices
from looplib.schedule import WSD

GPT_MATRICES = r"blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(0|2))\.weight"
LLAMA_MATRICES = r".*layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"


def tiny_llama():
    pytest.importorskip("transformers")
    from looplib.hf.models import CausalLM
    torch.manual_seed(0)
    return CausalLM(seq_len=16, model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)


def by_hand(model, pattern, lr, adam_lr, wd, adam_wd):
    """The reference: torch.optim.Muon on the parameters named by ``pattern``, torch.optim.AdamW
    on the rest (2-D outside the blocks and not an embedding: decayed; the rest not)."""
    names = dict(model.named_parameters())
    matrices = [p for n, p in names.items() if re.fullmatch(pattern, n)]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    rest = [p for n, p in names.items() if not re.fullmatch(pattern, n)]
    decayed = [p for p in rest if p.ndim == 2 and id(p) not in embeddings]
    plain = [p for p in rest if p.ndim != 2 or id(p) in embeddings]
    muon = torch.optim.Muon(matrices, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw")
    groups = [g for g in ({"params": decayed, "weight_decay": adam_wd}, {"params": plain, "weight_decay": 0.0})
              if g["params"]]
    adamw = torch.optim.AdamW(groups, lr=adam_lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    return [muon, adamw], matrices


@pytest.mark.parametrize("make, pattern, count", [(tiny_gpt, GPT_MATRICES, 2 * 4), (tiny_llama, LLAMA_MATRICES, 2 * 7)],
                         ids=["gpt", "llama"])
def test_update_equals_torch_muon_plus_adamw_bit_for_bit(make, pattern, count):
    """The blocks found from the structure (GPT's ``blocks``, Llama's ``model.layers`` inside
    looplib's wrapper), each family with its own lr and weight decay, three steps."""
    ours, ref = make(), make()
    factory = Muon(lr=2e-2, weight_decay=0.05, adam_lr=3e-3, adam_weight_decay=0.2)
    opt = factory.build(ours)
    assert isinstance(opt, MuonAdamW) and opt.param_groups[0]["use_muon"]
    reference, matrices = by_hand(ref, pattern, 2e-2, 3e-3, 0.05, 0.2)
    names = {id(p): n for n, p in ours.named_parameters()}
    ref_names = {id(p): n for n, p in ref.named_parameters()}
    assert [names[id(p)] for p in opt.param_groups[0]["params"]] == [ref_names[id(p)] for p in matrices]
    assert len(matrices) == count
    data, objective = random_tokens(8), TokenCrossEntropy()
    for step in range(3):
        batch = {k: torch.stack([data[i][k] for i in range(4 * (step % 2), 4 * (step % 2) + 4)]) for k in data[0]}
        for model, optimizers in ((ours, [opt]), (ref, reference)):
            objective(model, batch).backward()
            for o in optimizers:
                o.step()
                o.zero_grad()
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name


def test_state_dict_round_trips_and_a_schedule_scales_both_families():
    """A fresh optimizer loaded from ``state_dict()`` continues exactly as the one that saved it;
    the schedule's factor multiplies Muon's lr and AdamW's alike."""
    data, objective = random_tokens(8), TokenCrossEntropy()
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in data[0]}
    a = tiny_gpt()
    factory = Muon(lr=2e-2, adam_lr=4e-3)
    opt = factory.build(a)
    sched = WSD(warmup_steps=2, decay_fraction=0.5).build(opt, 6)
    for _ in range(3):
        objective(a, batch).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2e-2, 4e-3])  # step 3 of 6: stable
    b = tiny_gpt()
    b.load_state_dict(a.state_dict())
    opt_b = factory.build(b)
    sched_b = WSD(warmup_steps=2, decay_fraction=0.5).build(opt_b, 6)  # as a resume does: build, then load
    opt_b.load_state_dict(torch.load(save(opt.state_dict()), weights_only=True))
    sched_b.load_state_dict(sched.state_dict())
    state = opt_b.state[opt_b.param_groups[0]["params"][0]]
    assert set(state) == {"momentum_buffer"}
    assert set(opt_b.state[opt_b.param_groups[1]["params"][0]]) == {"step", "exp_avg", "exp_avg_sq"}
    for model, o, s in ((a, opt, sched), (b, opt_b, sched_b)):
        for _ in range(2):
            objective(model, batch).backward()
            o.step()
            s.step()
            o.zero_grad()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2e-2 / 3, 4e-3 / 3])  # 1 of 3 cool-down steps left
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def save(state):
    import io
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_the_planner_counts_one_buffer_per_muon_matrix_and_two_for_the_rest():
    from looplib.plan import optimizer_state_bytes_of, state_tensor_bytes
    model = tiny_gpt()
    factory = Muon()
    matrices = {id(p) for p in hidden_matrices(model)}
    params = list(model.parameters())
    rule = optimizer_state_bytes_of(factory, model)
    assert rule == sum(4 * p.numel() for p in params if id(p) in matrices) + \
        sum(8 * p.numel() + 4 for p in params if id(p) not in matrices)  # two moments and a step
    opt = factory.build(model)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    assert rule == state_tensor_bytes(opt)


def test_refusals_are_one_line():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError) as err:
        Muon().build(model)
    assert err.value.key == "optim.blocks" and "found no trainable 2-D weight" in str(err.value)
    assert len(Muon(blocks=["Linear"]).build(model).param_groups[0]["params"]) == 2  # named: taken
    from looplib.engines.fsdp import FSDP
    from looplib.precision import FP32
    engine = FSDP.__new__(FSDP)  # only its check: no process group
    engine.offload, engine.device, engine.reduce_dtype = "cpu", torch.device("cuda"), "float32"
    with pytest.raises(ConfigError) as err:
        engine.check(None, FP32(), Muon())
    assert err.value.key == "engine.offload" and "Newton-Schulz" in str(err.value)


def test_fp32_newton_schulz_is_torchs_iteration_in_fp32():
    from torch.optim._muon import _zeropower_via_newtonschulz
    from looplib.muon import NS_COEFFICIENTS, newton_schulz
    torch.manual_seed(0)
    for shape in ((24, 8), (8, 24), (16, 16)):
        g = torch.randn(shape)
        assert torch.equal(newton_schulz(g, NS_COEFFICIENTS, 5, 1e-7, "bf16"),
                           _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7))
        fp32 = newton_schulz(g, NS_COEFFICIENTS, 5, 1e-7, "fp32")
        assert fp32.dtype == torch.float32 and fp32.shape == g.shape
        torch.testing.assert_close(fp32, _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7).float(),
                                   atol=3e-2, rtol=0)  # bf16's rounding, five iterations deep
        singular = torch.linalg.svdvals(fp32)
        assert 0.3 < singular.min() and singular.max() < 1.3  # roughly orthogonal (Muon's five steps: about 0.5-1.2)
