"""torch.compile as a strategy: ``+compile=default`` (or another mode); absent means eager.

The model is compiled in place with ``nn.Module.compile``: its class, ``state_dict`` keys and
methods stay as they were, so saving, LoRA, activation checkpointing (applied to the blocks
before this) and accumulation all see the same module. Compilation happens on the first
forward pass (seconds to minutes); a change of shape, dtype or train/eval mode recompiles.
``compile.loss=true`` compiles the objective's call too (the model's forward and the loss in
one graph where dynamo can: the logits' cast and the cross-entropy fuse). ``compile.regional=true``
compiles each repeated block (the classes in ``compile.blocks``) once instead of the whole model:
the blocks share one compiled graph, so the cold start stops growing with depth; the rest runs
eagerly. ``compile.optimizer=true`` compiles the end of the step too: the gradient norm, the
clipping, the inf/NaN skip (on the device) and the optimizer's update in ONE compiled region
(``TorchCompile.clip_and_step``: the verb the loop ends each window with, ``looplib.loop.EagerStep``'s
in plain PyTorch; the optimizer itself is left as it is; inductor fuses the
per-parameter foreach kernels; under ``mode=reduce-overhead`` the forward and backward replay as CUDA
graphs and the region runs as inductor's kernels without one: ``step_options``). The seconds spent compiling (forward, backward where it is compiled
lazily, the optimizer step) are written to metrics.jsonl as a ``compile_s`` row at the end of the run.
"""
from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import Literal, get_args

import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from .errors import ConfigError
from .loop import EagerStep, clip_grad_norm

Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
MODES = get_args(Mode)
# the repeated blocks compile.regional compiles one by one (as +checkpointing=blocks finds them)
BLOCKS = ("Block", "GradientCheckpointingLayer", "GPT2Block", "BertLayer", "LlamaDecoderLayer", "MistralDecoderLayer",
          "Qwen2DecoderLayer")


class Compile(EagerStep):
    """Eager PyTorch: the null object. Its ``clip_and_step`` (``EagerStep``'s) ends each window
    of the loop: unscale, clip, step."""

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def check(self, corpus) -> None:
        """Refuse data this compile mode cannot run (build time, before the model exists)."""

    def check_optimizer(self, optim, device) -> None:
        """Refuse an optimizer this strategy cannot compile (build time: the factory, not the optimizer)."""

    def check_accumulation(self, accum_steps: int) -> None:
        """Refuse an accumulation window this strategy cannot train exactly (build time)."""

    def wrap_loss(self, objective):
        return objective

    def compile_step(self, optimizer) -> None:
        """Refuse an optimizer this strategy cannot compile, or compile its step for
        ``clip_and_step`` (compile.optimizer=true); the optimizer itself is left as it is."""

    def report(self) -> dict:
        """What compiling cost, for metrics.jsonl (nothing when nothing was compiled)."""
        return {}


NoCompile = Compile


class TorchCompile(Compile):
    """``model.compile(mode=..., backend=..., fullgraph=..., dynamic=...)``.

    ``reduce-overhead`` adds CUDA graphs (fewer kernel launches for small batches; CUDA only,
    and static shapes only: ``dynamic=true`` is refused with it);
    ``max-autotune`` benchmarks kernels at compile time (slow to compile, fastest to run).
    """

    def __init__(self, mode: Mode = "default", backend: str = "inductor", fullgraph: bool = False,
                 dynamic: bool | None = None, loss: bool = False, optimizer: bool = False, regional: bool = False,
                 blocks: list[str] | tuple[str, ...] = BLOCKS):
        if mode not in MODES:
            raise ConfigError("compile.mode", f"unknown mode {mode!r}", f"use one of {', '.join(MODES)}")
        import torch._dynamo
        backends = torch._dynamo.list_backends(exclude_tags=())
        if backend not in backends:
            raise ConfigError("compile.backend", f"unknown backend {backend!r}",
                              f"use inductor (or one of {', '.join(backends)})")
        if mode == "reduce-overhead" and dynamic:
            raise ConfigError("compile.dynamic", "CUDA graphs (mode reduce-overhead) replay fixed shapes: "
                              "dynamic=true would record a graph per shape", "use compile.dynamic=null or false, "
                              "or +compile=default for inputs whose shapes vary")
        if regional and loss:
            raise ConfigError("compile.loss", "compile.loss=true compiles the model's forward together with the loss, "
                              "which would compile the whole model again around its compiled blocks",
                              "leave compile.loss=false with compile.regional=true (or compile.regional=false)")
        if regional and not blocks:
            raise ConfigError("compile.blocks", "compile.regional=true needs the repeated blocks' class names",
                              "name them, e.g. compile.blocks=[Block] (looplib's GPT) or [LlamaDecoderLayer]")
        self.mode, self.backend, self.fullgraph, self.dynamic, self.loss = mode, backend, fullgraph, dynamic, loss
        self.optimizer, self.regional, self.blocks = optimizer, regional, tuple(blocks)
        self.clock = CompileClock()
        self.steps: CompiledStep | None = None  # compile.optimizer=true: the optimizer's step, compiled

    def options(self) -> dict:
        mode = {"mode": self.mode} if self.backend == "inductor" else {}
        return dict(backend=self.backend, fullgraph=self.fullgraph, dynamic=self.dynamic, **mode)

    def check(self, corpus):
        if self.mode == "reduce-overhead" and getattr(corpus, "collate", None) is not None:
            raise ConfigError("compile.mode", "CUDA graphs (reduce-overhead) replay fixed shapes, and this data pads "
                              "each batch to its longest example", "use data.pack=true (fixed windows), or "
                              "+compile=default")

    def check_accumulation(self, accum_steps):
        # CUDA graph trees hand a backward's gradients out of their own memory pool; a second backward
        # before the optimizer step finds them overwritten (PyTorch issue 169545: the error of the GPU
        # tests on an H200, 2026-11-28) or adds to a stolen buffer and trains on a fraction of the
        # window's gradient without a word (reported on PyTorch issue 96693)
        if self.mode == "reduce-overhead" and accum_steps > 1:
            raise ConfigError("compile.mode", f"CUDA graphs (reduce-overhead) cannot accumulate gradients over "
                              f"accum_steps={accum_steps} micro-batches: torch's CUDA graph trees overwrite the first "
                              "micro-batch's gradients", "use accum_steps=1 with a larger batch_size, or "
                              "+compile=default")

    def wrap(self, model):
        if self.mode == "reduce-overhead":
            device = next(model.parameters(), torch.empty(0)).device
            if device.type != "cuda":
                raise ConfigError("compile.mode", f"reduce-overhead records CUDA graphs, and the model is on {device}",
                                  "use +compile=default on this device")
        self.clock.start()
        if not self.regional:
            model.compile(**self.options())
            return model
        from .activations import ActivationCheckpointing  # the same finder as +checkpointing=blocks
        units = ActivationCheckpointing(types=self.blocks).chosen(model)
        if not units:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError("compile.blocks", f"compile.regional=true: no submodule of {type(model).__name__} is "
                              f"one of {list(self.blocks)}", f"choose the repeated block among: {', '.join(classes)}")
        for _, unit in units:  # in place: names, state-dict keys and hooks stay; one graph serves every block
            unit.compile(**self.options())
        return model

    def wrap_loss(self, objective):
        return CompiledLoss(objective, self.options()) if self.loss else objective

    def check_optimizer(self, optim, device):
        impl = getattr(optim, "impl", None)
        if self.optimizer and (impl == "fused" or (impl == "auto" and torch.device(device).type == "cuda")):
            raise ConfigError("compile.optimizer", f"optim.impl={impl} steps {type(optim).__name__} with fused kernels "
                              f"{'on this device ' if impl == 'auto' else ''}already, which torch.compile leaves as "
                              "they are", "use optim.impl=foreach (inductor then fuses the step's kernels itself), "
                              "or compile.optimizer=false")

    def compile_step(self, optimizer):
        if not self.optimizer:
            return
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError("compile.optimizer", f"the engine steps its own optimizer ({type(optimizer).__name__}), "
                              "not a torch.optim one", "leave compile.optimizer=false with this engine")
        if any(group.get("fused") for group in optimizer.param_groups):
            raise ConfigError("compile.optimizer", f"{type(optimizer).__name__} runs fused kernels already, which "
                              "torch.compile leaves as they are", "use optim.impl=foreach (inductor then fuses the "
                              "step's kernels itself), or compile.optimizer=false")
        self.clock.start()
        self.steps = CompiledStep(optimizer, self.options())

    def clip_and_step(self, optimizer, precision, params, max_norm):
        """compile.optimizer=true: the unscale, clip and step in one compiled region where it can
        (``CompiledStep.clip_and_step``; its step compiled for this optimizer on the first call
        if ``compile_step`` did not do it before); otherwise ``EagerStep``'s."""
        if not self.optimizer:
            return super().clip_and_step(optimizer, precision, params, max_norm)
        if self.steps is None or self.steps.optimizer is not optimizer:
            self.compile_step(optimizer)
        return self.steps.clip_and_step(precision, params, max_norm)

    def report(self):
        return self.clock.report()


class CompiledLoss:
    """An objective whose ``__call__`` (model forward + loss) runs through ``torch.compile``;
    ``count`` and every other attribute are the objective's own."""

    def __init__(self, objective, options: dict):
        self.objective = objective
        self.compiled = torch.compile(objective.__call__, **options)

    def __call__(self, model, batch):
        return self.compiled(model, batch)

    def __getattr__(self, name):
        return getattr(self.objective, name)


class CompiledStep:
    """An optimizer's step through ``torch.compile`` (its step hooks included: looplib's count of
    real updates sees every step), and ``clip_and_step``: the loop's unscale, clip and step with the
    gradient norm, the clipping, the non-finite skip and the update in ONE compiled region (one
    inductor graph; never a CUDA graph: ``step_options``). The optimizer itself is left as it is:
    where the region declines, the precision steps a ``Stepping`` view of it, whose ``step`` is the
    compiled one.

    - **The skip on the device.** A step whose gradients are not finite (fp32/bf16: the gradient
      norm; fp16: the loss scaler's flag, set by its unscale) updates nothing: the region keeps
      each parameter's and state tensor's value from before the update where the flag is set
      (``torch.where``, no host-device sync) and returns the flag, as a fused kernel's skip does.
    - **The first real update runs eagerly** (the uncompiled step after the loop's eager clip): it
      makes the optimizer's state, which a skipped step must leave unmade. Each step after it runs
      the region.
    - **Where the region cannot keep a value** (a state entry that is not a plain tensor: FSDP's
      DTensors, bitsandbytes' and torchao's 8-bit states) the clip runs eagerly (``EagerStep``'s)
      and the step alone is compiled (logged once); so too for a precision whose own ``step`` the region
      does not know (a subclass that overrides ``step`` without ``stepped``: ``joins_region``).
    - **The learning rate.** On a GPU each group's rate becomes a 0-dim tensor on the parameters'
      device, so a schedule that changes it writes into the tensor (``fill_``) and never recompiles
      (torch.compile then steps foreach optimizers with capturable kernels, which read the rate on
      the device; the eager first step is made capturable too, as torch.compile would make it); on
      a CPU it stays a number (a tensor rate needs those)."""

    def __init__(self, optimizer: torch.optim.Optimizer, options: dict):
        # the class's step (torch wraps it to run the step hooks), not an LR scheduler's wrapper of
        # the optimizer's step: the call is noted as that wrapper would (_opt_called)
        self.optimizer, self.step = optimizer, type(optimizer).step.__get__(optimizer)
        options = step_options(options)
        self.compiled = torch.compile(self.step, **options)
        # the update alone: torch wraps it to run the hooks and to break the graph around it (so that a
        # step compiled on its own is traced without grad); the region runs without grad throughout
        self.update = inspect.unwrap(type(optimizer).step).__get__(optimizer)
        self.region = torch.compile(self._clip_and_step, **options)
        self.stepping = Stepping(optimizer, self)  # what the precision steps where the region declines
        self.made, self.plain = False, None  # a real update happened; the state is plain tensors
        self._made = optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, *_):
        self.made = True

    def __call__(self, closure=None):
        self.optimizer._opt_called = True
        if closure is not None:  # a closure re-evaluates the model: not something to compile
            return self.step(closure)
        if not self.made:
            self._on_device(lr=False)
            return self.step()
        self._on_device()
        return self.compiled()

    def _on_device(self, lr: bool = True) -> None:
        """On a GPU, what torch.compile does to the groups of a step it compiles: capturable kernels
        where the state is not made yet, and (``lr``) the learning rate a device tensor."""
        for group in self.optimizer.param_groups:
            params = group["params"]
            if not params or not params[0].is_cuda:
                continue
            if "capturable" in group and not any(p in self.optimizer.state for p in params):
                group["capturable"] = True
            if lr and not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), device=params[0].device)
            for p in params if lr else ():  # a step count loaded from an eager run's checkpoint: on the CPU
                state = self.optimizer.state.get(p, {})
                if isinstance(state.get("step"), torch.Tensor) and state["step"].is_cpu:
                    state["step"] = state["step"].to(p.device)  # where torch.compile would move it, before the region

    def clip_and_step(self, precision, params: list[torch.Tensor], max_norm: float | None):
        """The loop's unscale, clip and step: in the compiled region (``in_region``), or where it
        declines ``EagerStep``'s on the ``Stepping`` view (the clip eager, the step compiled but at
        the first real update). ``(grad_norm, skipped)`` either way."""
        done = self.in_region(precision, params, max_norm)
        return done if done is not None else EagerStep().clip_and_step(self.stepping, precision, params, max_norm)

    def in_region(self, precision, params: list[torch.Tensor], max_norm: float | None):
        """The loop's unscale, clip and step in one compiled region: ``(grad_norm, skipped)`` as the
        eager ones return them (``skipped``: a device flag, 1.0 where the update was skipped, or None
        where the step hooks tell). None where the eager path runs instead (the first real update;
        state the region cannot keep; no gradients at all)."""
        if not self.made or not any(p.grad is not None for p in params) or not joins_region(precision):
            return None
        if self.plain is None:
            self.plain = plain_state(self.optimizer)
            if not self.plain:
                logging.getLogger("looplib").info(
                    "compile.optimizer: %s keeps state the compiled clip-and-step cannot restore on a skipped "
                    "step (DTensors or quantised states): clipping runs eagerly, the step alone is compiled",
                    type(self.optimizer).__name__)
        if not self.plain:
            return None
        precision.unscale(self.optimizer)  # fp16: once, before the norm (its own flag set here)
        self._on_device()
        opt = self.optimizer
        opt._opt_called = True
        for hook in (*_global_optimizer_pre_hooks.values(), *opt._optimizer_step_pre_hooks.values()):
            hook(opt, (opt,), {})  # the step's hooks, as torch's wrapper of step runs them, outside the graph
        with torch.no_grad():
            grad_norm, skipped = self.region(params, max_norm or 0.0, precision.skips_on(opt))
        for hook in (*opt._optimizer_step_post_hooks.values(), *_global_optimizer_post_hooks.values()):
            hook(opt, (opt,), {})  # a skipped update fires them too: ``skipped`` says it was one
        precision.stepped(opt)  # fp16: the scaler's update
        return grad_norm, skipped

    def _clip_and_step(self, params, max_norm: float, skips_on):
        norm = clip_grad_norm(params, max_norm)  # the loop's own, traced
        if skips_on is None:  # nothing skips (precision.skip_nonfinite=false): the step hooks count
            self.update()
            return norm, None
        skip = ~torch.isfinite(norm) if isinstance(skips_on, str) else skips_on > 0
        kept = updated_tensors(self.optimizer)
        before = [t.clone() for t in kept]
        self.update()
        for t, old in zip(kept, before):
            t.copy_(torch.where(skip, old, t))
        return norm, skip.float()


class Stepping:
    """An optimizer as the precision steps it where the compiled region declines: every attribute
    (and every attribute set) the optimizer's own, but ``step``, which is ``CompiledStep``'s call.
    The optimizer is not changed; one view per optimizer, so GradScaler's record of it (by
    ``id``) holds from its unscale to its step."""

    def __init__(self, optimizer: torch.optim.Optimizer, step: CompiledStep):
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "step", step)

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def __setattr__(self, name, value):
        setattr(self.optimizer, name, value)

    def __delattr__(self, name):
        delattr(self.optimizer, name)


def step_options(options: dict) -> dict:
    """The compile options of the optimizer's step and the clip-and-step region: the model's, without
    CUDA graphs. The gradients the region reads are the outputs of the backward's CUDA graph, and a
    graph invoked after the backward starts a new generation of the cudagraph trees, which frees them
    (H200, torch 2.11, 2026-11-28: "accessing tensor output of CUDAGraphs that has been overwritten by a
    subsequent run" at the region's first norm). Read by uncaptured kernels they stay valid until the
    next forward, as in an eager step; inductor still fuses the foreach kernels into a few launches."""
    mode = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}.get(options.get("mode"))
    return {**options, "mode": mode} if mode else dict(options)


def joins_region(precision) -> bool:
    """Whether the region may stand in for ``precision.step``: the class that defines its ``step``
    defines ``stepped`` too (looplib's precisions; a subclass that overrides ``step`` alone keeps
    the loop's eager path, which runs its own ``step``)."""
    owner = next((c for c in type(precision).__mro__ if "step" in vars(c)), None)
    return owner is not None and "stepped" in vars(owner) and hasattr(precision, "skips_on")


def updated_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a step may change: the parameters that have gradients and their state tensors."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return params + [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]


def plain_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter and state entry is a plain tensor (one ``torch.where`` can keep it)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    values = [v for state in optimizer.state.values() for v in state.values()]
    return all(type(t) in (torch.Tensor, nn.Parameter) for t in params + values)


class CompileClock:
    """Seconds inside torch.compile (dynamo, AOTAutograd, inductor; lazily compiled backward
    graphs too), through dynamo's compile start/end callbacks. Nested compiles count once."""

    def __init__(self):
        self.seconds, self.compiles, self._t0, self._on = 0.0, 0, None, False
        self._lock = threading.Lock()

    def start(self) -> None:
        if self._on:
            return
        from torch._dynamo.callback import callback_handler
        callback_handler.register_start_callback(self._begin)
        callback_handler.register_end_callback(self._end)
        self._on = True

    def _begin(self, _args) -> None:
        with self._lock:
            self._t0 = time.perf_counter()

    def _end(self, _args) -> None:
        with self._lock:
            if self._t0 is not None:
                self.seconds += time.perf_counter() - self._t0
                self.compiles += 1
                self._t0 = None

    def report(self) -> dict:
        return {"compile_s": round(self.seconds, 3), "compiles": self.compiles} if self._on else {}
