"""Hugging Face ``transformers`` models in looplib: pretrained from a local directory, or built
from a config; exported back as a directory transformers and peft load.

``CausalLM`` (``model=hf``, ``model=llama_tiny``) wraps a causal LM so it behaves like the
bundled GPT: ``model(input_ids) -> logits`` and ``generate(ids, n)``; the usual ``loss=lm``
objective then works unchanged. ``SequenceClassifier`` (``model=hf_classifier``) wraps
``AutoModelForSequenceClassification``: ``model(input_ids, attention_mask) -> logits`` for
``loss=classification``. With ``path`` the weights come from a local directory (config.json +
safetensors, sharded or not) with ``local_files_only``: nothing is ever downloaded. Without
``seq_len`` the window is the model's positions, at most 1024 (a classifier: 128).

At the end of a run ``export`` writes ``<run dir>/hf/``: full weights (sharded beyond
``max_shard_size``), or with LoRA the adapter whose ``base_model_name_or_path`` is a loadable
base (``path``, or ``<run dir>/hf_base/`` saved beside it when the model was built from a
config, or is a classifier whose head ``path`` lacks), or merged weights (``peft.merge=true``);
tokenizer files beside them.

One module per concern: ``models`` (the wrappers), ``config`` (loading a config and checking
it, the default window), ``export`` (``hf/``). ``CausalLMLoss``, the objective for an unwrapped
``transformers`` model, lives with the other objectives in ``looplib.loss`` and is importable
from here too. transformers is imported only when one of these is used
(``pip install 'looplib[hf]'``).
"""
from ..loss import CausalLMLoss
from .config import (check_keys, check_model_dir, check_positions, config_class_for, config_keys, default_seq_len,
                     import_transformers, load_config, load_weights, model_positions, one_line, window)
from .export import export_model, has_tokenizer, label_map, merge_lora, save_tokenizer
from .models import CausalLM, HFModel, SequenceClassifier

__all__ = ["CausalLM", "SequenceClassifier", "HFModel", "CausalLMLoss", "import_transformers", "load_config",
           "check_keys", "check_model_dir", "check_positions", "config_class_for", "config_keys", "load_weights",
           "model_positions", "window", "default_seq_len", "one_line", "export_model", "merge_lora", "label_map",
           "save_tokenizer", "has_tokenizer"]
