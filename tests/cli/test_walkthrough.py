"""docs/fine-tuning.md "Fine-tune your own model on your own data", every command as typed (fewer steps).

The blocks of that section run in order in one shell in a fresh directory: make the tiny
pretrained model, continue pretraining on a text folder, LoRA on instruct JSONL, load the
adapter with peft and generate, looplib.generate, CSV classification and its reload in
transformers. Only ``max_steps`` is lowered (to keep CI short); a docs edit that breaks a
command breaks this test. The logits of each reloaded result against looplib's own model are
compared in tests/unit/test_hf_pretrained.py.
"""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO


def walkthrough() -> str:
    text = (REPO / "docs" / "fine-tuning.md").read_text()
    section = text.split("## Fine-tune your own model on your own data", 1)[1].split("\n## ", 1)[0]
    blocks, current = [], []
    for line in section.splitlines() + [""]:
        if line.startswith("    ") or (current and not line.strip()):
            current.append(line)
        elif current:
            blocks.append(textwrap.dedent("\n".join(current)).strip())
            current = []
    return "\n\n".join(blocks)


@pytest.mark.slow
def test_readme_walkthrough_runs_as_typed(tmp_path, token_cache):
    pytest.importorskip("peft")
    script = re.sub(r"max_steps=\d+", "max_steps=3", walkthrough())
    assert script.count("python -m looplib.train") == 3 and "make_tiny_model" in script
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                       timeout=900, env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                                         "LOOPLIB_CACHE": token_cache, "OMP_NUM_THREADS": "1",
                                         "PYTHONWARNINGS": "ignore", "LOOPLIB_PLOT": "0"})  # no loss.png: CI time
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    runs = tmp_path / "runs"
    assert (runs / "pretrain" / "hf" / "config.json").is_file()
    assert (runs / "lora" / "hf" / "adapter_config.json").is_file()
    assert (runs / "classify" / "labels.json").is_file()
    assert re.search(r"\['(pos|neg)', '(pos|neg)'\]", r.stdout), r.stdout[-2000:]  # the classifier reloaded
