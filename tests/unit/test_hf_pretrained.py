"""Pretrained Hugging Face directories in, directories transformers and peft load out.

One tiny pretrained Llama directory (``tiny_pretrained``, made offline in conftest) serves
every test: fine-tuning starts from its weights (the first loss is transformers' own on the
same batch), ``<run dir>/hf`` reloads with the trained model's logits (full fine-tuning, LoRA
adapter and merged, classification), bad inputs are one line, and generate samples a run."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from looplib import AdamW, ConfigError, LoRA, RandomTokens, train_model
from looplib.loss import SequenceCrossEntropy
from looplib.store.export import write_exports


transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'looplib[hf]')")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'looplib[peft]')")

SEQ, VOCAB = 16, 384


def ids_batch(n=3, seed=7):
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def corpus_like(tiny_pretrained, **extra):
    """What the data groups hand over (the contract's Corpus attributes), tokenizer from the model."""
    return SimpleNamespace(**{"tokenizer_source": str(tiny_pretrained), "tokenizer": None, "vocab_size": VOCAB,
                              "label_names": None, "pad_id": 1, "eos_id": 0, **extra})


def logits_of(model, ids, **kw):
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, **kw)
    return out if isinstance(out, torch.Tensor) else out.logits


def test_lora_adapter_and_merged_export_reload_with_the_trained_logits(tiny_pretrained, tmp_path):
    from looplib.hf import CausalLM
    lora = LoRA(r=4, alpha=8, target_modules=["all-linear"])
    result = train_model(CausalLM(seq_len=SEQ, path=str(tiny_pretrained)), RandomTokens(8, SEQ, VOCAB),
                         max_steps=3, batch_size=4, peft=lora, optim=AdamW(lr=2e-2), device="cpu")
    ids = ids_batch()
    trained = logits_of(result.model, ids)
    write_exports(result.model, tmp_path / "adapter", lora.exports(), corpus=corpus_like(tiny_pretrained))
    config = json.loads((tmp_path / "adapter" / "hf" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_pretrained.resolve())
    adapter = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter" / "hf")  # no missing keys
    torch.testing.assert_close(logits_of(adapter, ids), trained, rtol=1e-5, atol=1e-5)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_pretrained)
    assert not torch.allclose(logits_of(base, ids), trained, atol=1e-3)  # the adapter matters
    write_exports(result.model, tmp_path / "merged", LoRA(r=4, alpha=8, target_modules=["all-linear"], merge=True).exports())
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged" / "hf")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits_of(merged, ids), trained, rtol=1e-4, atol=1e-4)


def test_lora_on_a_model_built_from_a_config_saves_the_base_it_points_at(tmp_path):
    from looplib.hf import CausalLM
    torch.manual_seed(0)
    model = CausalLM(seq_len=SEQ, model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ)
    lora = LoRA(r=2, allow_random_base=True)  # no target_modules: peft's defaults for llama; a random base, knowingly
    result = train_model(model, RandomTokens(8, SEQ, 64), max_steps=2, batch_size=4, peft=lora,
                         optim=AdamW(lr=2e-2), device="cpu")
    write_exports(result.model, tmp_path, lora.exports())
    config = json.loads((tmp_path / "hf" / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == (tmp_path / "hf_base").resolve()
    defaults = peft.utils.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["llama"]
    assert sorted(config["target_modules"]) == sorted(defaults)
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "hf")
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(result.model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("adapter", [False, True], ids=["full", "lora"])
def test_classifier_on_the_pretrained_backbone_exports_with_its_label_map(tiny_pretrained, tmp_path, adapter):
    from looplib.hf import SequenceClassifier
    model = SequenceClassifier(seq_len=SEQ, num_labels=3, path=str(tiny_pretrained))
    backbone = transformers.AutoModel.from_pretrained(tiny_pretrained)
    torch.testing.assert_close(model.hf.model.layers[0].mlp.up_proj.weight, backbone.layers[0].mlp.up_proj.weight)
    corpus = corpus_like(tiny_pretrained, label_names=["neg", "neu", "pos"])
    model.check_data(corpus)
    lora = LoRA(r=2, target_modules=["all-linear"]) if adapter else None
    data = RandomTokens(8, SEQ, VOCAB, num_classes=3)
    result = train_model(model, data, max_steps=2, batch_size=4, objective=SequenceCrossEntropy(), peft=lora,
                         optim=AdamW(lr=1e-2), device="cpu", eval_dataset=data, metrics=tmp_path / "m.jsonl",
                         log_every=1)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert "sequences_per_s" in rows[0] and "tokens_per_s" not in rows[0]  # classification counts sequences
    with torch.no_grad():  # eval accuracy, not perplexity: the final model's, on the 8 sequences
        predicted = torch.cat([result.model(d["input_ids"][None]) for d in data]).argmax(-1)
    assert rows[-1]["eval_accuracy"] == (predicted == data.labels).float().mean().item()
    assert "eval_perplexity" not in rows[-1]
    write_exports(result.model, tmp_path, (lora or __import__("looplib").FullModel()).exports(), corpus=corpus)
    auto = peft.AutoPeftModelForSequenceClassification if adapter else transformers.AutoModelForSequenceClassification
    loaded = auto.from_pretrained(tmp_path / "hf")
    ids = ids_batch()
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(result.model, ids), rtol=1e-5, atol=1e-5)
    assert loaded.config.id2label == {0: "neg", 1: "neu", 2: "pos"}


@pytest.mark.parametrize("case, key, words", [
    ("missing", "model.path", "does not exist"),
    ("no config", "model.path", "no config.json"),
    ("no weights", "model.path", "holds no weights"),
    ("typo", "model.hiden_size", "did you mean model.hidden_size"),
    ("hub name", "model.pretrained_model_name_or_path", "use model.path=DIR"),
    ("too long", "model.seq_len", "longer than the model's 64 positions"),
])
def test_bad_model_inputs_are_one_line_naming_the_key(tiny_pretrained, tmp_path, case, key, words):
    from looplib.hf import CausalLM
    (tmp_path / "empty").mkdir()
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text((tiny_pretrained / "config.json").read_text())
    args = {"missing": dict(path=str(tmp_path / "nope")), "no config": dict(path=str(tmp_path / "empty")),
            "no weights": dict(path=str(tmp_path / "config_only")),
            "typo": dict(path=str(tiny_pretrained), hiden_size=8),
            "hub name": dict(model_type="llama", pretrained_model_name_or_path=str(tiny_pretrained)),
            "too long": dict(path=str(tiny_pretrained), seq_len=65)}[case]
    with pytest.raises(ConfigError) as err:
        CausalLM(**{"seq_len": SEQ, **args})
    assert err.value.key == key and words in str(err.value) and "\n" not in str(err.value)


def test_a_vocabulary_larger_than_the_embeddings_is_refused(tiny_pretrained):
    from looplib.hf import CausalLM
    model = CausalLM(seq_len=SEQ, path=str(tiny_pretrained))
    model.check_data(SimpleNamespace(vocab_size=VOCAB))
    with pytest.raises(ConfigError, match=f"has {VOCAB + 1} tokens but the model at .* embeds only {VOCAB}"):
        model.check_data(SimpleNamespace(vocab_size=VOCAB + 1))


def test_block_checkpointing_finds_transformers_layers_by_type_and_keeps_gradients(tiny_pretrained):
    from looplib.activations import ActivationCheckpointing
    from looplib.hf import CausalLM
    from looplib.plan import default_checkpointing
    ids = ids_batch(2)
    grads = []
    for strategy in (None, default_checkpointing()):
        model = CausalLM(seq_len=SEQ, path=str(tiny_pretrained))
        if strategy is not None:
            assert [n for n, _ in strategy.chosen(model)] == ["hf.model.layers.0", "hf.model.layers.1"]
            strategy.apply(model)
        model(ids).float().logsumexp(-1).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert isinstance(default_checkpointing(), ActivationCheckpointing)


def test_large_exports_are_sharded_and_a_sharded_directory_loads(tiny_pretrained, tmp_path):
    from looplib import FullModel
    from looplib.hf import CausalLM
    model = CausalLM(seq_len=SEQ, path=str(tiny_pretrained), max_shard_size="100KB")
    write_exports(model, tmp_path, FullModel().exports(), corpus=corpus_like(tiny_pretrained))
    shards = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    again = CausalLM(seq_len=SEQ, path=str(tmp_path / "hf"))   # fine-tuning starts from the shards
    ids = ids_batch()
    torch.testing.assert_close(logits_of(again, ids), logits_of(model, ids), rtol=0, atol=0)
