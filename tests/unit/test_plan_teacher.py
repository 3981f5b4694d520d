"""The memory plan counts loss=distill's teacher beside the student, as the run holds it: cast to
loss.teacher_dtype, tied weights once; a teacher not read yet from its files' headers."""
import copy

from safetensors.torch import save_model

from conftest import tiny_gpt
from looplib.distill import Distill
from looplib.plan.budget import teacher_bytes


def held(objective):
    """The bytes the taken teacher holds (its parameters' and buffers' storage, tied ones once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*objective.teacher.parameters(), *objective.teacher.buffers()]}
    return sum(storages.values())


def test_the_teacher_is_counted_as_the_run_holds_it(tmp_path):
    teacher = tiny_gpt(vocab=96)
    save_model(teacher, str(tmp_path / "model.safetensors"))  # a finished run's weights (tied ones stored once)
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        taken = Distill(teacher=copy.deepcopy(teacher), teacher_dtype=dtype)
        count, kind = teacher_bytes(taken)
        assert count == held(taken) > 0 and dtype in kind
        n = sum(p.numel() for p in teacher.parameters())  # (the tied head counted once)
        assert count == n * size
        unread = Distill(teacher=str(tmp_path), teacher_dtype=dtype)
        assert unread.unread and teacher_bytes(unread) == (count, f"{tmp_path} in {dtype}")
