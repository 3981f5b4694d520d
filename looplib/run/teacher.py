"""``loss.teacher=PATH`` (``loss=distill``): the run reads the teacher, as ``model.init_from``
reads a run's weights, and hands it to the objective (``Distill.take``) before the job is set up.

PATH is a transformers model directory (``save_pretrained``'s, a ``*ForCausalLM``: read as
``looplib.hf.CausalLM``), or a finished looplib run: its ``hf/`` export, else its config.yaml and
model.safetensors, else its newest checkpoint (``looplib.store.finished``). A LoRA adapter is
refused (its base and adapter would be two reads: train the teacher with ``peft.merge=true``).

Where the teacher's directory holds its tokenizer (a transformers directory's tokenizer.json; a
looplib run's trained tokenizer kept in its checkpoints, or its ``data.tokenizer``), every token
must have the id the data's tokenizer gives it: a teacher of the same vocabulary size with other
ids would be compared with the wrong tokens, silently. Every refusal names ``loss.teacher``.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from ..data import identity
from ..distill import KEY, TOKENS, refuse_sharding, same_vocabulary
from ..errors import ConfigError
from ..store.finished import hf_directory, load_finished, newest_checkpoint, run_config


def provide(objective, corpus, model: nn.Module | None = None, engine=None) -> None:
    """An objective with a teacher still to read (``objective.unread``: its directory) is given it,
    its vocabulary's size compared with ``model``'s and its tokens with the data's. Others: nothing."""
    path = getattr(objective, "unread", None)
    if not path:
        return
    refuse_sharding(engine)  # before reading a teacher the engine would refuse
    objective.take(load_teacher(path))
    if model is not None:
        same_vocabulary(objective.teacher, model, path)  # (the sizes first: the plainer line)
    same_tokens(getattr(corpus, "tokenizer", None), path)


def check_resumed(objective, expected: identity.Expected | None) -> None:
    """A resumed run's teacher, read from its directory (``provide``), is the checkpoint's
    (``expected``: the identity of the checkpoint the run continues from): another one is refused
    now, before anything is trained. No teacher read from a directory, or no resume: nothing."""
    read = getattr(objective, "path", None) is not None and getattr(objective, "teacher", None) is not None
    if expected is not None and read:
        identity.check({"teacher": objective.fingerprint()}, expected)


def load_teacher(path: str | Path) -> nn.Module:
    """The teacher at ``path`` (see the module's doc), on the CPU."""
    where = Path(path).expanduser()
    if not where.is_dir():
        raise ConfigError(KEY, f"{KEY}={path} is not a directory", "give a transformers model directory or a "
                          "finished looplib run's directory (outputs/DATE/TIME)")
    directory = hf_directory(where)
    try:
        if directory is None:
            return load_finished(where, "cpu").model
        if not (directory / "config.json").is_file():
            raise ConfigError(KEY, f"{directory} holds a LoRA adapter, not a whole model", "train the teacher "
                              "with peft.merge=true (its export is then the merged model), or distil from its base")
        from ..hf import CausalLM
        from ..hf.config import import_transformers
        config = import_transformers().AutoConfig.from_pretrained(str(directory), local_files_only=True)
        if not any(a.endswith("ForCausalLM") for a in config.architectures or ["ForCausalLM"]):
            raise ConfigError(KEY, f"{directory} holds a {', '.join(config.architectures)}, not a causal language "
                              "model", "give a *ForCausalLM directory")
        return CausalLM(path=str(directory))
    except ConfigError as err:
        if err.key == KEY:
            raise
        raise ConfigError(KEY, f"the teacher at {where}: {err.problem}", err.fix) from None


def same_tokens(ours, path) -> None:
    """Every token of the data's tokenizer (``ours``) and of the teacher's has one id in both."""
    if ours is None or not hasattr(ours, "get_vocab"):
        return
    theirs = teacher_tokenizer(Path(path).expanduser())
    if theirs is None:
        return
    mine, other = ours.get_vocab(with_added_tokens=True), theirs.get_vocab(with_added_tokens=True)
    moved = sorted(t for t in set(mine) | set(other) if mine.get(t) != other.get(t))
    if moved:
        t = moved[0]
        raise ConfigError(KEY, f"the teacher at {path} tokenises differently from the data: {len(moved)} tokens have "
                          f"other ids (e.g. {t!r}: {say(other.get(t))} in the teacher's tokenizer, {say(mine.get(t))} "
                          "in the data's)", f"tokenise the data as the teacher did: {TOKENS}")


def say(token_id) -> str:
    return "no id" if token_id is None else f"id {token_id}"


def teacher_tokenizer(where: Path):
    """The teacher's tokenizer (``tokenizers.Tokenizer``), or None when its directory holds none."""
    from tokenizers import Tokenizer
    directory = hf_directory(where)
    files = [directory / "tokenizer.json"] if directory is not None else []
    checkpoint = newest_checkpoint(where) if directory is None else None
    if checkpoint is not None:
        files.append(checkpoint / "tokenizer.json")
    spec = ((run_config(where) or run_config(checkpoint or where)).get("data") or {}).get("tokenizer")
    if directory is None and spec:
        spec = Path(str(spec)).expanduser()
        files.append(spec if spec.is_file() else spec / "tokenizer.json")
    for file in files:
        if file.is_file():
            try:
                return Tokenizer.from_file(str(file))
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception: as if there were none
                return None
    return None
