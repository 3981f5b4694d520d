"""Telemetry added for the memory work: data waiting, MFU, NVML device memory, host peak RSS."""
import json
import sys
import time
import types

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from looplib import optim as lo
from looplib import telemetry as tm
from looplib.data import build_loader
from looplib.loop import fit
from looplib.models import GPT, BertClassifier
from looplib.loss import SequenceCrossEntropy, TokenCrossEntropy
from looplib.telemetry import Telemetry

from conftest import random_tokens, tiny_gpt


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_flops_formula_equals_flop_counter(kind):
    """6 x matmul weights per token + 12 x layers x width x seq_len per token of attention, counted
    by torch's FlopCounterMode on a real forward + backward (math attention, so it is counted)."""
    torch.manual_seed(0)
    if kind == "gpt":
        model, objective = GPT(64, 16, n_layer=3, n_head=2, d_model=32), TokenCrossEntropy()
        labels = torch.randint(0, 64, (5, 16))
    else:
        model = BertClassifier(64, 16, n_layer=3, n_head=2, d_model=32, dropout=0.0)
        objective, labels = SequenceCrossEntropy(), torch.randint(0, 2, (5,))
    batch = {"input_ids": torch.randint(0, 64, (5, 16)), "labels": labels}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        objective(model, batch).backward()
    assert counter.get_total_flops() == 5 * model.flops_per_sequence()
    n_matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    if kind == "gpt":  # the "6N" part: every matmul weight (the tied head once) per token
        assert model.flops_per_sequence() == 6 * n_matmul * 16 + 12 * 3 * 32 * 16 * 16


class SlowTokens(torch.utils.data.Dataset):
    def __init__(self, data, delay):
        self.data, self.delay = data, delay

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.data[i]


def run_rows(tmp_path, dataset, **telemetry_args):
    path = tmp_path / "metrics.jsonl"
    model = tiny_gpt()
    telemetry = Telemetry(path, log_every=2, total_steps=4, progress="lines", **telemetry_args)
    fit(model, build_loader(dataset, batch_size=4, seed=0), objective=TokenCrossEntropy(),
        optimizer=lo.AdamW(lr=1e-3).build(model), max_steps=4, telemetry=telemetry)
    telemetry.close()
    return model, [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_hold_the_promised_keys_and_mfu_is_throughput_times_flops(tmp_path):
    model, rows = run_rows(tmp_path, random_tokens(n=64), flops_per_sample=1e6, peak_flops=2e9)
    assert [r["step"] for r in rows] == [1, 2, 4]
    for r in rows:
        assert {"samples_per_s", "tokens_per_s", "step_time_s", "data_wait_share", "tflops", "mfu",
                "peak_mem_mb", "host_peak_rss_mb"} <= set(r)
        assert "device_mem_used_mb" not in r  # no GPU: the key is left out, silently
        assert 0 <= r["data_wait_share"] <= 1 and r["host_peak_rss_mb"] > 0
        assert r["tflops"] == pytest.approx(r["samples_per_s"] * 1e6 / 1e12, rel=1e-9)
        assert r["mfu"] == pytest.approx(r["samples_per_s"] * 1e6 / 2e9, rel=1e-9)


def test_without_flops_or_peak_there_is_no_mfu(tmp_path):
    _, rows = run_rows(tmp_path, random_tokens(n=64))
    assert not {"mfu", "tflops"} & set(rows[0])
    (tmp_path / "again").mkdir()
    _, rows = run_rows(tmp_path / "again", random_tokens(n=64), flops_per_sample=1e6)
    assert "tflops" in rows[0] and "mfu" not in rows[0]


def test_data_wait_covers_a_slow_loader(tmp_path):
    delay = 0.02
    _, rows = run_rows(tmp_path, SlowTokens(random_tokens(n=64), delay))
    steps = [1, 1, 2]
    waited = sum(r["data_wait_share"] * r["step_time_s"] * n for r, n in zip(rows, steps))
    assert waited >= 4 * 4 * delay  # 4 steps of 4 samples each slept at least `delay`


def test_nvml_reads_the_device_by_uuid(monkeypatch):
    calls = {}

    class Info:
        used = 3 * 2**30

    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.setdefault("init", True),
        nvmlDeviceGetHandleByUUID=lambda uuid: calls.setdefault("uuid", uuid),
        nvmlDeviceGetMemoryInfo=lambda handle: Info())
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(tm, "device_uuid", lambda device: "GPU-1234")
    tm.nvml_handle.cache_clear()
    try:
        assert tm.nvml_used_mb(torch.device("cuda", 1)) == 3 * 1024
        assert calls == {"init": True, "uuid": "GPU-1234"}
        assert tm.nvml_used_mb(torch.device("cpu")) is None
    finally:
        tm.nvml_handle.cache_clear()


def test_nvml_degrades_silently(monkeypatch):
    def broken():
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=broken))
    monkeypatch.setattr(tm, "device_uuid", lambda device: "GPU-1234")
    tm.nvml_handle.cache_clear()
    try:
        assert tm.nvml_used_mb(torch.device("cuda")) is None
    finally:
        tm.nvml_handle.cache_clear()


def test_device_uuid_prefix(monkeypatch):
    props = types.SimpleNamespace(uuid="58f1e6f0-aaaa-bbbb-cccc-000000000000")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert tm.device_uuid(torch.device("cuda")) == "GPU-58f1e6f0-aaaa-bbbb-cccc-000000000000"


def test_peak_flops():
    assert tm.peak_flops(torch.device("cpu"), "bf16") is None
    assert tm.peak_flops(torch.device("cpu"), "bf16", given_tflops=2.5) == 2.5e12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_gpu_rows_hold_nvml_memory(tmp_path):
    path = tmp_path / "metrics.jsonl"
    model = tiny_gpt().cuda()
    telemetry = Telemetry(path, log_every=1, total_steps=2, device="cuda", progress="lines")
    fit(model, build_loader(random_tokens(n=16), batch_size=4, seed=0, device="cuda"),
        objective=TokenCrossEntropy(), optimizer=lo.AdamW(lr=1e-3).build(model), max_steps=2,
        telemetry=telemetry, engine=__import__("looplib").Engine("cuda"))
    telemetry.close()
    row = json.loads(path.read_text().splitlines()[-1])
    assert row["device_mem_used_mb"] >= row["peak_mem_mb"] > 0
