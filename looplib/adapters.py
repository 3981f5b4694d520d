"""The peft group's former home, kept so that existing ``_target_: looplib.adapters.X`` paths and
imports keep working: the code lives in ``looplib/peft.py`` (config group ``peft``)."""
from .peft import ALL_LINEAR, GPT_LINEARS, FullModel, LoRA, import_peft, load_lora  # noqa: F401
