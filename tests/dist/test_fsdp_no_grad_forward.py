"""FSDP2: a forward without gradients before training (an evaluation, GRPO's sampling, DPO's
reference pass) leaves the first updates exactly as without it.

Such a forward used to leave the root (and, with engine.reshard_after_forward=false, every block)
gathered: ``model.parameters()`` then yielded the gathered tensors, an optimizer built then never
updated the root and stepped into freed storage (a segfault at exit); a first forward under
inference mode (looplib's evaluation) left inference tensors that training's gathers could not
write. Weights after two steps, bit for bit, with and without the pass, under both reshard settings."""
import torch

import dist_workers as W
import no_grad_workers as N


def test_a_forward_without_gradients_before_training_changes_nothing(tmp_path):
    W.spawn(N.worker, 2, tmp_path)
    got = torch.load(tmp_path / "no_grad.pt", weights_only=True)
    for reshard in (True, False):
        plain = got[f"none/{reshard}"]
        for name in N.PASSES:
            weights = got[f"{name}/{reshard}"]
            assert weights.keys() == plain.keys()
            changed = [k for k in plain if not torch.equal(weights[k], plain[k])]
            assert not changed, (name, reshard, changed)
    # the two steps moved the weights (the root's too): a pass that froze them would show
    start = W.tiny_gpt().state_dict()
    assert all(not torch.equal(got["none/True"][k], start[k]) for k in ("tok_emb.weight", "ln_f.weight"))
