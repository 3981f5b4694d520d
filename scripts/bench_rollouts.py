"""Rollout throughput: looplib's sampler (``looplib.sampling.sample_groups``: every prompt's group
in one batch, a key/value cache) against transformers' ``generate`` and against the uncached
sampler it replaced (``looplib.sampling.sample``: whole sequences each token, one prompt at a time),
on the same model and the same prompts, in one run. Prints completion tokens per second and the
ratios; asserts nothing (a measurement, not a test).

    python scripts/bench_rollouts.py                                   # a small Llama, CPU
    python scripts/bench_rollouts.py --device cuda --hidden 512 --layers 8 --prompts 32 --group 8 --new 256
    python scripts/bench_rollouts.py --tiny                            # seconds: well-formed output

The model is a transformers Llama built from a config (random weights: the tokens are noise, the
arithmetic is that of a real one), wrapped as ``model=llama_tiny`` wraps it; the bundled GPT of the
same width is measured too (looplib's sampler and the uncached one: transformers cannot run it).
Every completion runs to ``--new`` tokens (no stop token), so each sampler produces the same number
of tokens; each is timed ``--repeats`` times after one warm-up, the median kept. Prompts are of
different lengths (left padding is part of the cost).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def timed(fn, repeats: int, device: str) -> float:
    fn()  # warm-up: allocations, kernels chosen
    out = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=48, help="the longest prompt (the others shorter)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tiny", action="store_true", help="a model and batch that run in seconds")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.vocab, args.prompts = 64, 2, 512, 4
        args.group, args.new, args.prompt_len, args.repeats = 2, 8, 12, 1

    from looplib.hf import CausalLM
    from looplib.models import GPT
    from looplib.sampling import sample, sample_groups

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    positions = args.prompt_len + args.new
    torch.manual_seed(0)
    llama = CausalLM(model_type="llama", seq_len=positions, vocab_size=args.vocab, max_position_embeddings=positions,
                     hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                     num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 128))
    gpt = GPT(vocab_size=args.vocab, seq_len=positions, n_layer=args.layers, n_head=max(1, args.hidden // 64),
              d_model=args.hidden)
    llama, gpt = llama.to(device, dtype).eval(), gpt.to(device, dtype).eval()
    g = torch.Generator().manual_seed(1)
    lengths = [max(1, args.prompt_len - (i * args.prompt_len) // (2 * args.prompts)) for i in range(args.prompts)]
    prompts = [torch.randint(3, args.vocab, (n,), generator=g).to(device) for n in lengths]
    tokens = args.prompts * args.group * args.new

    def gens():
        return [torch.Generator(device).manual_seed(i) for i in range(args.prompts)]

    def looplib_batched(model):
        return lambda: sample_groups(model, prompts, args.group, args.new, 1.0, 1.0, None, gens(), pad=0)

    def uncached(model):
        return lambda: [sample(model, p, args.group, args.new, 1.0, 1.0, None, gen) for p, gen in zip(prompts, gens())]

    width = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long, device=device), p]) for p in prompts])
    mask = (torch.arange(width, device=device)[None] >= (width - torch.tensor(lengths, device=device))[:, None]).long()

    def transformers_generate():
        return llama.hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                                 temperature=1.0, num_return_sequences=args.group, max_new_tokens=args.new,
                                 min_new_tokens=args.new, pad_token_id=0, eos_token_id=None)

    seconds = {}
    with torch.no_grad():
        seconds["llama: looplib (batched, cached)"] = timed(looplib_batched(llama), args.repeats, args.device)
        seconds["llama: transformers generate"] = timed(transformers_generate, args.repeats, args.device)
        seconds["llama: uncached, per prompt (before)"] = timed(uncached(llama), args.repeats, args.device)
        seconds["gpt: looplib (batched, cached)"] = timed(looplib_batched(gpt), args.repeats, args.device)
        seconds["gpt: uncached, per prompt (before)"] = timed(uncached(gpt), args.repeats, args.device)
    rate = {k: tokens / s for k, s in seconds.items()}
    print(f"{args.prompts} prompts x {args.group} completions x {args.new} tokens ({tokens} tokens), prompts of "
          f"{min(lengths)}-{max(lengths)} tokens; hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"{args.dtype} on {args.device}, median of {args.repeats}")
    for k, r in rate.items():
        print(f"  {k:40s} {r:10.0f} tokens/s  ({seconds[k]:.3f} s)")
    ratios = {"llama: looplib / transformers generate": rate["llama: looplib (batched, cached)"] /
              rate["llama: transformers generate"],
              "llama: looplib / uncached (before)": rate["llama: looplib (batched, cached)"] /
              rate["llama: uncached, per prompt (before)"],
              "gpt: looplib / uncached (before)": rate["gpt: looplib (batched, cached)"] /
              rate["gpt: uncached, per prompt (before)"]}
    for k, r in ratios.items():
        print(f"  {k:40s} {r:6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tokens_per_s": rate, "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
