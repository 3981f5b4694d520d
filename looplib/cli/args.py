"""The command line before Hydra: both spellings of a group, and Hydra's refusals as looplib's one line.

Every entry point (``python -m looplib.train``, the ``looplib-train`` script, ``python -m
looplib.tune``) goes through these before Hydra sees its arguments (``looplib.cli.entry.run``).

- **Both spellings.** Strategy groups (precision, optim, engine, ...: the groups that are *not*
  in conf/config.yaml's defaults list) are appended, so Hydra wants ``+precision=bf16``; the
  job's groups (model, data, loss) are in the defaults list, so Hydra wants ``model=x`` and
  refuses ``+model=x``. ``normalise`` writes each the way Hydra wants it, whichever way it was
  typed. Only the leading ``+`` changes: values, ``-m`` sweeps and sweeper syntax
  (``choice(...)``, ``range(...)``, lists) pass through as typed.
- **A key Hydra does not know** (``max_step=10``, ``model.dropout=0.1``) is appended (Hydra's own
  advice, followed once), so that looplib's check of the whole config names it with the closest
  setting ("did you mean max_steps?"), or accepts it where the class takes that argument.
- **Hydra's refusals** that remain (an unknown option of a group, an ambiguous value without
  ``-m``, an argument that does not parse) become one line (``explain``) naming the setting and
  the fix; ``looplib.cli.entry`` says it, exits 2 and leaves nothing written.
"""
from __future__ import annotations

import difflib
import re

from .. import groups as table

# Hydra's command-line flags that take the next argument as their value (not an override)
TAKES_VALUE = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun",
               "--package", "-p", "--cfg", "-c"}
INFO_TOPICS = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}  # --info [TOPIC]
OVERRIDE = re.compile(r"^(\+?)([A-Za-z_][\w-]*)(?==)")   # [+]group=...: a plain group (or top-level key)

# Hydra's refusals whose advice looplib follows for the user: (pattern naming the key, add or drop its "+")
FOLLOWED = [
    (re.compile(r"Could not override '([^']+)'\.(?: No match in the defaults list\.)?\s+To append to your "
                r"(?:default list|config) use \+"), "add"),
    (re.compile(r"Could not append to config\. An item is already at '([^']+)'"), "drop"),
    (re.compile(r"Multiple values for ([\w.-]+)\. To override a value use"), "drop"),
    (re.compile(r"([\w.-]+) appears more than once in the final defaults list"), "drop"),
]


def group_kinds() -> tuple[set[str], set[str]]:
    """(strategy groups, job groups): appended with ``+`` or switched in the defaults list
    (``looplib.groups``; tests/cli/test_config.py holds conf/ and its defaults list to the table)."""
    rows = table.groups()
    return {g.name for g in rows if g.appended}, {g.name for g in rows if not g.appended}


def normalise(args: list[str], groups: tuple[set[str], set[str]] | None = None) -> list[str]:
    """``precision=bf16`` -> ``+precision=bf16`` for every strategy group, ``+model=x`` ->
    ``model=x`` for the job's groups; every other argument as typed. Hydra's flags (``-m``,
    ``--cfg job``, ...) go ahead of the overrides, in their order: Hydra's argument parser takes
    the overrides as one run of words and answers ``x=1 -m y=2,3`` with its usage and
    "unrecognized arguments"."""
    flags, overrides, value_of = [], [], None
    for arg in args:
        if value_of is not None:
            flags.append(arg)
            value_of = None
        elif arg.startswith("-"):
            flags.append(arg)
            value_of = arg if arg in TAKES_VALUE else None
        elif flags and flags[-1] == "--info" and arg in INFO_TOPICS:
            flags.append(arg)
        else:
            overrides.append(arg)
    if any(a in ("--config-name", "-cn") or a.startswith("--config-name=") for a in flags):
        return flags + overrides  # another primary config: its own defaults list decides
    strategy, job = groups if groups is not None else group_kinds()
    group_of, last = [None] * len(overrides), {}  # a strategy group's overrides, and the index of its last
    for i, arg in enumerate(overrides):
        match = OVERRIDE.match(arg)
        if match:
            plus, key = match.groups()
            if key in strategy and not plus:
                overrides[i] = "+" + arg
            elif key in job and plus:
                overrides[i] = arg[1:]
            if key in strategy:
                group_of[i], last[key] = key, i
    # a strategy group given twice: the last wins, as for a setting or a job group (Hydra keeps the first
    # appended one without a word: +precision=bf16 ... +precision=fp16 trained in bf16)
    return flags + [arg for i, arg in enumerate(overrides) if group_of[i] is None or last[group_of[i]] == i]


def follow_advice(message: str, args: list[str]) -> list[str] | None:
    """Hydra's refusal ``message`` asks for a "+" added or dropped on one key: ``args`` with that
    done, or None when the refusal is of another kind (or the advice was followed already)."""
    for pattern, action in FOLLOWED:
        match = pattern.search(message)
        if not match:
            continue
        key = match.group(1)
        if key.startswith("hydra.") or key == "hydra":
            return None
        for i, arg in enumerate(args):
            if action == "add" and arg.startswith(f"{key}="):
                # a key of a strategy group: "++" (add, or override where the chosen option has it), as a
                # sweep over the group needs (-m +optim=sgd,adamw optim.lr=1e-3: the sweep's own config has
                # no optim yet, and each job's has optim.lr)
                plus = "++" if "." in key and key.split(".")[0] in group_kinds()[0] else "+"
                return args[:i] + [plus + arg] + args[i + 1:]
            if action == "drop" and arg.startswith(f"+{key}="):
                return args[:i] + [arg[1:]] + args[i + 1:]
    return None


def explain(err: BaseException) -> str:
    """Hydra's refusal as looplib's one line: the setting, what is wrong, the fix."""
    from hydra.errors import MissingConfigException, OverrideParseException
    text = " ".join(str(err).split())
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, option = err.missing_cfg_file.rsplit("/", 1)
        options = sorted(err.options or [])
        strategy, _ = group_kinds()
        plus = "+" if group in strategy else ""
        close = {o for o in options if o.startswith(option) or option.startswith(o)}  # adam -> adamw, adam8bit
        close |= set(difflib.get_close_matches(option, options, n=3, cutoff=0.6))
        close = sorted(close, key=lambda o: (not o.startswith(option), -difflib.SequenceMatcher(None, option, o).ratio()))
        guess = f"did you mean {' or '.join(close[:2])} ({plus}{group}={close[0]})? " if close else ""
        return f"{group}: there is no option '{option}'; {guess}the options are: {', '.join(options)}"
    ambiguous = re.search(r"Ambiguous value for argument '([^']*)'", text)
    if ambiguous:
        arg = ambiguous.group(1)
        key, _, value = arg.partition("=")
        return (f"{key.lstrip('+~')}: '{arg}' holds several values; to sweep over them add -m (python -m "
                f"looplib.train -m {arg}), for a list write {key}=[{value}], for one string quote it: {key}='{value}'")
    sweep = re.search(r"Sweep parameters '([^']*)' requires --multirun", text)
    if sweep:
        key = sweep.group(1).partition("=")[0].lstrip("+~")
        return f"{key}: '{sweep.group(1)}' is a sweep; add -m to run one job per value"
    if isinstance(err, OverrideParseException):
        key = OVERRIDE.match(err.override or "")
        name = key.group(2) if key else (err.override or "argument")
        first = " ".join(str(err.message).split("See https")[0].split())
        return (f"{name}: cannot read the argument '{err.override}' ({first}); write key=value, quote values "
                "holding spaces or brackets, see https://hydra.cc/docs/advanced/override_grammar/basic")
    cause = err.__cause__
    parent, key = getattr(cause, "parent_node", None), getattr(cause, "key", None)
    if str(getattr(cause, "full_key", "")).startswith("hydra.") and hasattr(parent, "keys") and key is not None:
        # a typo in one of Hydra's structured nodes (hydra.sweeper.n_trial): Hydra advises "+key", which
        # its schema then refuses as well; name the closest key instead
        known = [str(k) for k in parent.keys() if not str(k).startswith("_")]
        where = str(cause.full_key).rsplit(".", 1)[0]
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
        fix = f"did you mean {where}.{close[0]}?" if close else f"its keys are: {', '.join(known)}"
        elsewhere = options_with_key(where, str(key))
        if elsewhere and not close:  # hydra.sweeper.n_trials with the basic sweeper
            fix = f"{key} is a setting of {' and '.join(elsewhere)}: choose it (-m {elsewhere[0]} ...)"
        owner = getattr(cause, "object_type", None)
        return (f"{cause.full_key}: {key} is not a setting of {where}"
                f"{f' ({owner.__name__})' if isinstance(owner, type) else ''}; {fix}")
    if cause is not None and str(cause).strip():
        text += " (" + " ".join(str(cause).split()) + ")"
    return f"command line: {text}"


def options_with_key(where: str, key: str) -> list[str]:
    """``hydra/sweeper=optuna`` for ``("hydra.sweeper", "n_trials")``: the options of one of Hydra's
    groups whose node has ``key`` (from Hydra's ConfigStore, where plugins register them)."""
    from hydra.core.config_store import ConfigStore
    group = where.replace(".", "/")
    try:
        node = ConfigStore.instance().repo
        for part in group.split("/"):
            node = node[part]
    except (KeyError, TypeError):
        return []
    return [f"{group}={name[:-5]}" for name, entry in sorted(node.items())
            if name.endswith(".yaml") and hasattr(entry, "node") and key in entry.node]
