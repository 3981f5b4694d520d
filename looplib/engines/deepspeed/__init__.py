"""DeepSpeed ZeRO behind looplib's verbs: the loop stays the same loop.

    deepspeed --num_gpus 4 --module looplib.train +engine=deepspeed engine.stage=3
    torchrun --nproc_per_node 4 -m looplib.train +engine=deepspeed engine.offload_optimizer=cpu +optim=cpu_adam

One source of truth: DeepSpeed's JSON config is *derived* from looplib's settings (batch_size,
accum_steps, max_grad_norm, the precision and optim groups) plus the engine's own keys (ZeRO
stage, offload), and printed. ``engine.config`` passes any further raw DeepSpeed keys; a raw
key that would contradict a looplib setting is refused with the setting to use instead.

Who does what:
- the loop decides the accumulation boundary: DeepSpeed runs with
  ``managed_gradient_accumulation: false``, so ``backward()`` only accumulates and each
  ``step()`` (called by the loop once per window) reduces and updates. ``backward()`` never
  hides a step;
- the loop divides each micro-batch's summed loss by the window's item count (over ranks), and
  DeepSpeed does not divide again (``backward(loss, scale_wrt_gas=False)``);
- DeepSpeed owns loss scaling (its fp16 section, mapped from the fp16 precision's scaler
  settings), unscaling, clipping (``gradient_clipping``, which defaults to 1.0 in DeepSpeed if
  not set) and the optimizer step: the loop's ``precision`` and ``optimizer`` here are
  adapters whose verbs call the ``DeepSpeedEngine``;
- the learning-rate schedule stays looplib's, stepped by the loop once per window.

Where it lives: ``engine`` (the ``DeepSpeed`` engine), ``checkpoints`` (its checkpoint format:
ZeRO partitions, ``ZeroCheckpoints``), ``config`` (the derived config, and
``import_deepspeed``), ``precision`` (the loop's precision, handed the ``DeepSpeedEngine`` by
``prepare``), ``optim`` (the loop's optimizer; ``CPUAdam``), ``muon`` (DeepSpeed's own Muon) and
``universal`` (a resume on another number of processes). Each module imports its siblings by
name and none imports the package itself, so no import runs in a circle.

deepspeed is imported only when this engine is chosen.
"""
from .engine import DeepSpeed
from .optim import CPUAdam

__all__ = ["DeepSpeed", "CPUAdam"]
