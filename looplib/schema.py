"""What a setting may hold, said once, next to the argument it describes.

Every class a config group selects annotates its constructor arguments, ranges included::

    def __init__(self, lr: Positive[float] = LR, betas: tuple[Beta, Beta] = BETAS,
                 impl: Literal["auto", "fused", "foreach", "for-loop"] = "auto"): ...

and ``check_options`` holds a group's keys against that signature at build time, before
anything is built: a key the class does not take (with the closest name it does take), a
required key that is missing, a value of the wrong type, out of range, or not finite (inf and
nan are refused in every float setting). The vocabulary is plain ``typing``: ``int``,
``float``, ``bool``, ``str``, ``None``, ``Literal``, unions, ``list[X]``, ``tuple[X, Y]``,
``tuple[X, ...]``, ``dict``, dataclasses (a section of keys, like ``loader``) and
``Annotated[X, Range(...)]``; ``Positive[X]``, ``NonNegative[X]``, ``Beta``, ``Fraction`` and
``Seed`` name the common ranges. Anything else (a class of your own) is taken as it is.

A class whose constructor takes ``**kwargs`` accepts any further key, unless it says which
with a classmethod ``extra_keys(options) -> set of names``, or checks them itself (``looplib.hf``).
Values are not converted: ``lr='1e-3'`` (a quoted string) is refused, not guessed at.
This module imports neither Hydra nor OmegaConf; it works on plain values.
"""
from __future__ import annotations

import collections.abc
import difflib
import inspect
import math
import types
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Annotated, Any, Literal, TypeVar, Union

from .errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Range:
    """Bounds of a number: ``Annotated[float, Range(gt=0)]`` is a positive number."""
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def bounds(self) -> list[str]:
        ops = ((">", self.gt), (">=", self.ge), ("<", self.lt), ("<=", self.le))
        return [f"{op} {fmt(v)}" for op, v in ops if v is not None]

    def violation(self, key: str, value, whole: bool) -> str | None:
        """The sentence saying what ``value`` breaks, or None when it is in range."""
        low_ok = (self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
        high_ok = (self.lt is None or value < self.lt) and (self.le is None or value <= self.le)
        if low_ok and high_ok:
            return None
        one_sided = self.lt is None and self.le is None
        if one_sided and (self.gt, self.ge) in ((0, None), (None, 1)) and whole:
            return f"{key} must be at least 1"
        if one_sided and (self.gt, self.ge) == (0, None):
            return f"{key} must be positive"
        if one_sided and (self.gt, self.ge) == (None, 0):
            return f"{key} must not be negative"
        return f"{key} must be {' and '.join(self.bounds())}"


Positive = Annotated[T, Range(gt=0)]          # Positive[int]: at least 1; Positive[float]: > 0
NonNegative = Annotated[T, Range(ge=0)]
Beta = Annotated[float, Range(ge=0, lt=1)]    # an Adam beta, a momentum, a dropout probability
Fraction = Annotated[float, Range(ge=0, le=1)]
Seed = Annotated[int, Range(ge=0, lt=2**64)]  # what torch.manual_seed takes, without wrapping


class Refused(Exception):
    """``problem``: the sentence; ``in_kind``: the type was right, the value was not."""

    def __init__(self, problem: str, in_kind: bool = False):
        super().__init__(problem)
        self.problem, self.in_kind = problem, in_kind


# ------------------------------------------------------------------ one value against one type


def conform(key: str, value: Any, hint: Any) -> None:
    """Raise ``Refused`` unless ``value`` (a plain config value) fits the annotation ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (Any, inspect.Parameter.empty) or isinstance(hint, (str, TypeVar)):
        return  # unannotated (or an annotation that did not evaluate): nothing to check
    if origin is Annotated:
        conform(key, value, args[0])
        for mark in args[1:]:
            if isinstance(mark, Range):
                broken = mark.violation(key, value, whole=args[0] is int)
                if broken:
                    raise Refused(f"{broken} (got {key}={show(value)})", in_kind=True)
        return
    if origin in (Union, types.UnionType):
        refusals = []
        for member in args:
            try:
                return conform(key, value, member)
            except Refused as r:
                refusals.append(r)
        in_kind = [r for r in refusals if r.in_kind]  # right type, wrong value: the useful sentence
        raise in_kind[0] if in_kind else Refused(f"{key}={show(value)} is not {describe_type(hint)}")
    if origin is Literal:
        if not any(type(value) is type(choice) and value == choice for choice in args):
            raise Refused(f"{key}={show(value)} is not one of {describe_choices(args)}")
        return
    if hint is type(None):
        if value is not None:
            raise Refused(f"{key}={show(value)} is not null")
        return
    if hint is bool:
        if not isinstance(value, bool):
            raise Refused(f"{key}={show(value)} is not true or false")
        return
    if hint in (int, float):
        whole = hint is int
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            quoted = isinstance(value, str) and parses_as_number(value)
            if whole and isinstance(value, float) and value.is_integer():  # max_steps=1e3 reads as 1000.0
                raise Refused(f"{key}={show(value)} is a float, not {describe_type(hint)} (write {key}={int(value)})", in_kind=True)
            raise Refused(f"{key}={show(value)} is {'a string, ' if quoted else ''}not {describe_type(hint)}"
                          + (" (write it without quotes)" if quoted else ""))
        if not whole and not math.isfinite(value):
            raise Refused(f"{key} must be a finite number (got {key}={show(value)})", in_kind=True)
        return
    if hint is str:
        if not isinstance(value, str):
            raise Refused(f"{key}={show(value)} is not a string")
        return
    if origin in (list, tuple) or hint in (list, tuple) or origin in SEQUENCES:
        if not isinstance(value, (list, tuple)):
            raise Refused(f"{key}={show(value)} is not {describe_type(hint)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise Refused(f"{key}={show(value)} is not {describe_type(hint)}")
            items = list(zip(value, args))
        else:
            items = [(v, args[0] if args else Any) for v in value]
        for i, (item, item_hint) in enumerate(items):
            try:
                conform(f"{key}[{i}]", item, item_hint)
            except Refused as r:  # say the whole list, as it was written
                problem = r.problem.replace(f"(got {key}[{i}]={show(item)})", f"(got {key}={show(value)})")
                raise Refused(problem if problem != r.problem else f"{problem} in {key}={show(value)}",
                              r.in_kind) from None
        return
    if hint is dict or origin is dict or origin in MAPPINGS:
        if not isinstance(value, dict):
            raise Refused(f"{key}={show(value)} is not a mapping of keys to values")
        return
    # a class of its own (torch.device, a user's type): taken as it is


SEQUENCES = {collections.abc.Sequence}
MAPPINGS = {collections.abc.Mapping}


def parses_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


WORDS = {int: ("a whole number", "whole numbers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
         str: ("a string", "strings"), type(None): ("null", "nulls")}


def describe_type(hint: Any, plural: bool = False) -> str:
    """``hint`` in words: 'a number > 0', 'a list of 2 numbers >= 0 and < 1', 'one of auto, true or false'."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        bounds = [b for mark in args[1:] if isinstance(mark, Range) for b in mark.bounds()]
        return describe_type(args[0], plural) + (" " + " and ".join(bounds) if bounds else "")
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        choices = [c for a in members if typing.get_origin(a) is Literal for c in typing.get_args(a)]
        choices += [c for a in members if a is bool for c in (True, False)]
        others = list(dict.fromkeys(describe_type(a, plural) for a in members  # list[str] | tuple[str, ...]: said once
                                    if typing.get_origin(a) is not Literal and a is not bool))
        words = others + ([("one of " if not others else "") + describe_choices(choices)] if choices else [])
        return " or ".join(words) + (" (or null)" if type(None) in args else "")
    if origin is Literal:
        return "one of " + describe_choices(args)
    if origin in (list, tuple) or origin in SEQUENCES or hint in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            same = all(a == args[0] for a in args)
            inner = describe_type(args[0], plural=True) if same else ", ".join(describe_type(a) for a in args)
            return f"a list of {len(args)} {inner}" if same else f"a list of ({inner})"
        return f"a list of {describe_type(args[0], plural=True)}" if args else "a list"
    if hint in WORDS:
        return WORDS[hint][plural]
    return getattr(hint, "__name__", str(hint))


def describe_choices(choices) -> str:
    words = [c if isinstance(c, str) else show(c) for c in choices]
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]


def show(value: Any) -> str:
    """A value the way it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{show(v)}" for k, v in value.items()) + "}"
    return repr(value) if isinstance(value, str) else str(value)


def fmt(number: float) -> str:
    return "2**64" if number == 2**64 else f"{number:g}"


# ------------------------------------------------------------------ a set of keys against a signature


@dataclass
class Param:
    name: str
    hint: Any
    default: Any = MISSING   # MISSING: required
    fix: str | None = None   # a dataclass field's own advice (metadata "fix")

    @property
    def required(self) -> bool:
        return self.default is MISSING


def parameters(target: Any) -> tuple[dict[str, Param], bool] | None:
    """The keys ``target`` (a class, dataclass or function) takes, and whether it takes any
    further keyword (``**kwargs``). None when its signature cannot be read."""
    if is_dataclass(target):
        hints = type_hints(target)
        # a field whose key is a Python keyword names its key in metadata (``checkpoint.async``)
        params = {f.metadata.get("key", f.name): Param(f.metadata.get("key", f.name), hints.get(f.name, Any),
                                                       default_of(f), f.metadata.get("fix"))
                  for f in fields(target) if f.init}
        return params, False
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    hints = type_hints(target.__init__ if inspect.isclass(target) else target)
    params, extra = {}, False
    for p in signature.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            extra = True
        elif p.kind is not p.VAR_POSITIONAL:
            default = MISSING if p.default is p.empty else p.default
            params[p.name] = Param(p.name, hints.get(p.name, Any), default)
    return params, extra


def default_of(f) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else MISSING


def type_hints(obj: Any) -> dict:
    try:
        return typing.get_type_hints(obj, include_extras=True)
    except Exception:  # an annotation that names something not importable here: check the rest by name
        return {}


def dotted(target: Any) -> str:
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', target)}"


def public_path(target: Any, shortest: bool = False) -> str:
    """The shortest dotted path that names ``target`` (a class or function): its defining module,
    shortened while the package above exports the same object (``looplib.engines.ddp.DDP`` ->
    ``looplib.engines.DDP``), down to a top-level package's own modules (``looplib.precision.BF16``). The command line's ``conf/`` files and ``train_model``'s saved
    config both write it, so one class has one name in a run's config.yaml. ``shortest``: up to the
    top-level package where it exports the object too (``looplib.Precision``: for the docs)."""
    import importlib

    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if not module or not name:
        return dotted(target)
    while module.count(".") > (0 if shortest else 1):  # (never above a top-level package's own modules: ``looplib.precision.BF16``)
        try:
            parent = importlib.import_module(module.rsplit(".", 1)[0])
        except Exception:  # noqa: BLE001 - a package that does not import here: keep the longer path
            break
        if getattr(parent, name, None) is not target:
            break
        module = parent.__name__
    return f"{module}.{name}"


def same_target(a: Any, b: Any) -> bool:
    """Whether two ``_target_`` values name the same object (``looplib.engines.DDP`` and
    ``looplib.engines.ddp.DDP`` do): equal strings, or both import to one object."""
    if a == b:
        return True
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    import importlib

    def resolve(path: str):
        module, _, name = path.rpartition(".")
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj
    try:
        return resolve(a) is resolve(b)
    except Exception:  # noqa: BLE001 - one of them does not import: they differ as written
        return False


def check_options(prefix: str, target: Any, options: dict, said: str = "") -> None:
    """Hold ``options`` (plain values, interpolations resolved) against ``target``'s signature.

    ``prefix`` is the keys' path (``"optim."``; ``""`` at the top level); ``said`` is what chose
    the class (``"from optim=adamw"``, ``"from optim._target_=my.Class"``), for the messages.
    """
    owner = f"{dotted(target)} ({said})" if said else ""
    found = parameters(target)
    if found is None:
        return
    params, extra = found
    names = [k for k in options if not str(k).startswith("_")]  # _target_, _partial_, ...: Hydra's own
    allowed = set(params)
    if extra:
        more = getattr(target, "extra_keys", None)
        more = more(options) if callable(more) else None
        allowed = None if more is None else allowed | set(more)
    for key in names:
        if allowed is not None and key not in allowed:
            refuse_unknown(prefix, key, options[key], sorted(allowed), owner)
    for p in params.values():
        if p.required and p.name not in options and not options.get("_partial_"):  # a partial gets the rest later
            raise ConfigError(f"{prefix}{p.name}", f"{owner or 'the config'} needs {p.name}",
                              f"add +{prefix}{p.name}=VALUE")
    for key in names:
        if key not in params:
            continue
        p, value = params[key], options[key]
        if isinstance(value, dict) and "_target_" in value:
            continue  # built by Hydra first (recursive instantiation): checked on its own
        if is_dataclass(p.hint) and isinstance(p.hint, type):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{key}", f"{prefix}{key}={show(value)} is not a group of settings",
                                  f"set its keys, e.g. {prefix}{key}.NAME=VALUE")
            check_options(f"{prefix}{key}.", p.hint, value, said)
            continue
        try:
            conform(f"{prefix}{key}", value, p.hint)
        except Refused as r:
            problem = r.problem + (f" ({said})" if said else "")
            raise ConfigError(f"{prefix}{key}", problem, p.fix or advice(prefix + key, p)) from None


def advice(key: str, p: Param) -> str:
    text = f"use {describe_type(p.hint)}"
    if not p.required and not isinstance(p.default, (dict, set)) and p.default not in ((), [], ""):
        text += f", e.g. {key}={cli(p.default)} (the default)"
    return text


def cli(value: Any) -> str:
    """A value as typed after ``key=`` on the command line (strings unquoted)."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(cli(v) for v in value) + "]"
    return value if isinstance(value, str) else show(value)


def refuse_unknown(prefix: str, key: str, value: Any, known: list[str], owner: str = "") -> None:
    """An unknown key: the one-line error, with the closest known name when there is one."""
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    of = f" of {owner}" if owner else ""
    if close:
        example = "" if isinstance(value, dict) else f" (e.g. {prefix}{close[0]}={cli(value)})"
        fix = f"did you mean {prefix}{close[0]}?{example}"
    else:
        fix = f"remove it; {'its' if owner else 'the'} keys are: {', '.join(known)}" if known else "remove it"
    raise ConfigError(f"{prefix}{key}", f"{prefix}{key} is not a setting{of}", fix)
