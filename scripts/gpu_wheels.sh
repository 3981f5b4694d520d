#!/usr/bin/env bash
# The Python packages a fresh GPU machine without network needs for scripts/gpu_figures.sh, as
# wheels in .whl/ (git-ignored), downloaded here where pip reaches the package index:
#
#     bash scripts/gpu_wheels.sh            # into .whl/ (about 30 MB: see docs/testing.md)
#     bash scripts/gpu_wheels.sh DIR
#
# The GPU machines here run CPython 3.12 on x86-64 with torch 2.11 (CUDA 13.0), transformers,
# accelerate, peft, triton, pandas, pyarrow ... already (/work/.library/device/KINDS.md); these
# are what they lack: looplib's own needs (Hydra, OmegaConf, its ANTLR runtime), bitsandbytes
# (QLoRA, 8-bit Adam), torchao (fp8), liger-kernel, and the peers of scripts/bench_peers.py:
# torchtitan and unsloth with what they import. --no-deps throughout: each needed one is listed.
# Two wheels are slimmed to fit one call's 64 MiB (the working tree travels too): bitsandbytes
# keeps its CUDA 13 libraries only (43 MB -> about 5), unsloth drops its web studio (29 MB -> 2).
# Install on the machine (docs/testing.md):
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
out=${1:-.whl}
py=${PYTHON:-python3}
mkdir -p "$out"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
wheels=(
    hydra-core==1.3.8 omegaconf==2.3.0                      # looplib (antlr4 4.9.3 is built below: no wheel on the index)
    bitsandbytes==0.50.2 torchao==0.18.0 liger-kernel==0.8.5
    torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 spmd_types==0.2.3 tyro==1.0.17
    docstring_parser==0.18.0 typeguard==4.6.1 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
    unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 cut_cross_entropy==25.1.1 msgspec==0.22.0
)
for w in "${wheels[@]}"; do
    [[ $w == \#* ]] && continue
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$out" "$w"
done
"$py" -m pip wheel -q --no-deps -w "$out" antlr4-python3-runtime==4.9.3   # pure Python, from its sdist
"$py" - "$out" <<'EOF'
"""Slim two wheels: drop files the GPU machines never load, and their RECORD lines."""
import sys, zipfile
from pathlib import Path

out = Path(sys.argv[1])
drop = {"bitsandbytes-": lambda n: n.startswith("bitsandbytes/libbitsandbytes_")
        and not n.endswith(("_cuda130.so", "_cuda132.so", "_cpu.so")),
        "unsloth-": lambda n: n.startswith(("studio/", "unsloth_cli/"))}
for wheel in sorted(out.glob("*.whl")):
    rule = next((rule for prefix, rule in drop.items() if wheel.name.startswith(prefix)), None)
    if rule is None:
        continue
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if rule(item.filename):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"\n".join(line for line in data.split(b"\n") if not rule(line.split(b",")[0].decode()))
            dst.writestr(item, data)
    before = wheel.stat().st_size
    slim.replace(wheel)
    print(f"slimmed {wheel.name}: {before / 2**20:.1f} -> {wheel.stat().st_size / 2**20:.1f} MiB")
EOF
total=$(du -cb "$out"/*.whl | tail -1 | cut -f1)
echo "$(ls "$out"/*.whl | wc -l) wheels in $out: $((total / 1048576)) MiB (one call carries 64 MiB with the working tree)"
if [ "$total" -gt $((56 * 1048576)) ]; then echo "too large for one call: drop a peer's wheels" >&2; exit 1; fi
