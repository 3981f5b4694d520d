"""The command line before Hydra: both spellings of a group, the forgiving ``+``, and every refusal
Hydra would make said as looplib's one line, all with Hydra's public API.

Every entry point (``python -m looplib.train``, the ``looplib-train`` script, ``python -m
looplib.tune``) goes through ``settle`` before Hydra sees its arguments (``looplib.cli.entry.run``).

- **Both spellings.** Strategy groups (precision, optim, engine, ...: the groups that are *not*
  in conf/config.yaml's defaults list) are appended, so Hydra wants ``+precision=bf16``; the
  job's groups (model, data, loss) are in the defaults list, so Hydra wants ``model=x`` and
  refuses ``+model=x``. ``normalise`` writes each the way Hydra wants it, whichever way it was
  typed (``looplib.groups`` knows which is which). Only the leading ``+`` changes: values, ``-m``
  sweeps and sweeper syntax (``choice(...)``, ``range(...)``, lists) pass through as typed.
- **A key the config does not have** (``max_step=10``, ``model.dropout=0.1``) is appended: ``settle``
  composes the config with the command line's group choices (``hydra.compose``) and looks the key
  up in it, so that looplib's check of the whole config names it with the closest setting ("did
  you mean max_steps?"), or accepts it where the class takes that argument. ``+key=v`` for a key
  the config has set loses its ``+``. Nothing here reads Hydra's messages.
- **Refusals** (an argument that does not parse, a group option that does not exist, several values
  without ``-m``, a typo in one of Hydra's own nodes) are found before ``@hydra.main`` runs, from
  the parsed overrides (Hydra's ``OverridesParser``), the groups and options of the config
  repository, and the exception types of a trial composition, and become one line (``Refusal``)
  naming the setting and the fix; ``looplib.cli.entry`` says it, exits 2, leaves nothing written.
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
# another primary config (its own defaults list decides), or no composition at all
NOT_CHECKED = {"--config-path", "-cp", "--config-name", "-cn", "--experimental-rerun",
               "--help", "-h", "--hydra-help", "--version", "--shell-completion", "-sc"}
CONFIG_DIR = {"--config-dir", "-cd"}  # a directory of the user's configs added to the search path
GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic"
ABSENT = object()


class Refusal(Exception):
    """The command line refused before Hydra runs: ``line`` (``key: problem; fix``), and Hydra's own
    exception where there is one (``HYDRA_FULL_ERROR=1`` lets Hydra report it)."""

    def __init__(self, line: str, args: list[str]):
        super().__init__(line)
        self.line, self.args_so_far = line, args


def group_kinds() -> tuple[set[str], set[str]]:
    """(strategy groups, job groups): appended with ``+`` or switched in the defaults list
    (``looplib.groups``; tests/cli/test_config.py holds conf/ and its defaults list to the table)."""
    rows = table.groups()
    return {g.name for g in rows if g.appended}, {g.name for g in rows if not g.appended}


def split(args: list[str]) -> tuple[list[str], list[str]]:
    """(Hydra's flags with their values, the overrides), each in its order."""
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
    return flags, overrides


def normalise(args: list[str], groups: tuple[set[str], set[str]] | None = None) -> list[str]:
    """``precision=bf16`` -> ``+precision=bf16`` for every strategy group, ``+model=x`` ->
    ``model=x`` for the job's groups; every other argument as typed. Hydra's flags (``-m``,
    ``--cfg job``, ...) go ahead of the overrides, in their order: Hydra's argument parser takes
    the overrides as one run of words and answers ``x=1 -m y=2,3`` with its usage and
    "unrecognized arguments"."""
    flags, overrides = split(args)
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


def settle(args: list[str], config_module: str = "looplib.conf", config_name: str = "config") -> list[str]:
    """The command line as Hydra is to run it: ``normalise``d, the ``+`` of each key decided by
    whether the config has that key, and checked as Hydra would check it (``Refusal`` where it
    would refuse). Sweeps (``-m``) are checked with each group option they name and the first value
    of each; a grid's every job is checked again as the sweep starts (``looplib.cli.sweep``)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    args = normalise(args)
    flags, overrides = split(args)
    if any(f.split("=", 1)[0] in NOT_CHECKED for f in flags):
        return args
    multirun = "-m" in flags or "--multirun" in flags
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as err:
        raise Refusal(unreadable(err), args) from err
    if not multirun:
        for o in parsed:
            if o.is_sweep_override():
                raise Refusal(several_values(o), args)
    strategy, _ = group_kinds()
    search = search_path(flags, parsed)
    with initialize_config_module(config_module=config_module, version_base="1.3"):
        repo = GlobalHydra.instance().config_loader()
        groups = set(all_groups(repo)) | user_groups(search)
        chosen, swept = [], set()  # the group choices (a sweep's first value), the groups a sweep switches
        for o in parsed:
            if o.key_or_group in groups and not o.is_delete() and o.package is None:
                values = choices(o)
                options = repo.get_group_options(o.key_or_group, config_name=config_name, overrides=search)
                for value in values:
                    if value not in options:
                        raise Refusal(no_option(o.key_or_group, value, options, strategy), args)
                if o.is_sweep_override():
                    swept.add(o.key_or_group)
                    if values:  # (interval(...) over a group: its sweeper's to sample)
                        chosen.append(f"{o.get_key_element()}={values[0]}")
                else:
                    chosen.append(o.input_line)
        try:
            probe = compose(config_name=config_name, overrides=chosen + search, return_hydra_config=True)
        except (HydraException, OmegaConfBaseException) as err:
            raise Refusal(explain(err), args) from err
        settled = [settled_override(o, probe, groups, strategy, swept) for o in parsed]
        try:
            compose(config_name=config_name, overrides=[trial_value(o, s) for o, s in zip(parsed, settled)
                                                         if trial_value(o, s) is not None] + search,
                    return_hydra_config=True)
        except (HydraException, OmegaConfBaseException) as err:
            raise Refusal(explain(err), flags + settled) from err
    return flags + settled


def search_path(flags: list[str], parsed) -> list[str]:
    """The search path the command line asks for, as one ``hydra.searchpath`` override for
    ``hydra.compose`` (``[]``: looplib's own configs only): its own ``hydra.searchpath=[...]``, then
    ``--config-dir DIR`` (which Hydra's command line adds itself)."""
    from pathlib import Path
    paths: list[str] = []
    for o in parsed:
        if o.key_or_group == "hydra.searchpath" and isinstance(o.value(), list):
            paths = [str(p) for p in o.value()]
    for i, flag in enumerate(flags):
        name, _, value = flag.partition("=")
        if name in CONFIG_DIR:
            value = value or (flags[i + 1] if i + 1 < len(flags) else "")
            if value:
                paths.append(f"file://{Path(value).absolute()}")
    if not paths:
        return []
    quoted = ",".join("'" + p.replace("\\", "\\\\").replace("'", "\\'") + "'" for p in paths)
    return [f"hydra.searchpath=[{quoted}]"]


def user_groups(search: list[str]) -> set[str]:
    """The config groups (folders holding a ``.yaml``) of the ``file://`` directories of the search path."""
    from pathlib import Path

    from hydra.core.override_parser.overrides_parser import OverridesParser
    found: set[str] = set()
    for o in OverridesParser.create().parse_overrides(search):
        for entry in o.value():
            if str(entry).startswith("file://"):
                root = Path(str(entry)[len("file://"):])
                found |= {str(p.parent.relative_to(root)) for p in root.glob("**/*.yaml") if p.parent != root}
    return found


def all_groups(repo, parent: str = "") -> list[str]:
    """Every config group of the repository (``optim``, ``hydra/launcher``, ...)."""
    out = []
    for name in repo.list_groups(parent):
        full = f"{parent}/{name}" if parent else name
        out += [full, *all_groups(repo, full)]
    return out


def choices(o) -> list[str]:
    """The options a group override names (each value of a sweep, each item of a list)."""
    if o.is_sweep_override():
        if not o.is_discrete_sweep():
            return []
        values = list(o.sweep_iterator())
    else:
        values = [o.value()]
    flat = []
    for v in values:
        flat += [str(x) for x in v if x is not None] if isinstance(v, list) else [] if v is None else [str(v)]
    return flat


def settled_override(o, cfg, groups: set[str], strategy: set[str], swept: set[str]) -> str:
    """One override with its ``+`` decided by the config: a key it does not have (or has only in a
    group option a sweep switches: the sweep's own config holds no option yet) is appended, ``++``
    under a strategy group (added, or set where the chosen option has it); a ``+key`` the config
    has set is a plain override. Groups, Hydra's own keys and deletions stay as typed."""
    key, line = o.key_or_group, o.input_line
    if key in groups or o.package is not None or key == "hydra" or key.startswith("hydra.") or o.is_delete():
        return line
    head = key.split(".")[0]
    value = OmegaConf_select(cfg, key)
    if not (o.is_add() or o.is_force_add()):
        if value is ABSENT or ("." in key and head in swept):
            return ("++" if "." in key and head in strategy else "+") + line
    elif o.is_add() and value is not ABSENT and value is not None:
        return line[1:]
    return line


def OmegaConf_select(cfg, key: str):  # noqa: N802 - OmegaConf.select, ABSENT where the key is not there
    from omegaconf import OmegaConf
    return OmegaConf.select(cfg, key, default=ABSENT, throw_on_missing=False, throw_on_resolution_failure=False)


def trial_value(o, settled: str) -> str | None:
    """The override as one job would have it: a sweep's first value (None: a sweep with no first value,
    ``interval(...)``, left to its sweeper)."""
    if not o.is_sweep_override():
        return settled
    if not o.is_discrete_sweep():
        return None
    prefix = settled[: len(settled) - len(settled.lstrip("+~"))]
    return f"{prefix}{o.get_key_element().lstrip('+~')}={next(iter(o.sweep_string_iterator()))}"


def unreadable(err) -> str:
    key = OVERRIDE.match((err.override or "").lstrip("+~"))
    name = key.group(2) if key else (err.override or "argument")
    first = " ".join(str(err.message).splitlines()[0].split()) if err.message else "it does not parse"
    return (f"{name}: cannot read the argument '{err.override}' ({first}); write key=value, quote values "
            f"holding spaces or brackets, see {GRAMMAR}")


def several_values(o) -> str:
    from hydra.core.override_parser.types import ValueType
    arg, key = o.input_line, o.key_or_group
    if o.value_type == ValueType.SIMPLE_CHOICE_SWEEP:
        value = arg.partition("=")[2]
        typed = arg.partition("=")[0]
        return (f"{key}: '{arg}' holds several values; to sweep over them add -m (python -m "
                f"looplib.train -m {arg}), for a list write {typed}=[{value}], for one string quote it: {typed}='{value}'")
    return f"{key}: '{arg}' is a sweep; add -m to run one job per value"


def no_option(group: str, option: str, options: list[str], strategy: set[str]) -> str:
    """``optim: there is no option 'adam'; did you mean adamw or adam8bit (+optim=adamw)? the options are: ...``"""
    options = sorted(options)
    plus = "+" if group in strategy else ""
    close = {o for o in options if o.startswith(option) or option.startswith(o)}  # adam -> adamw, adam8bit
    close |= set(difflib.get_close_matches(option, options, n=3, cutoff=0.6))
    close = sorted(close, key=lambda o: (not o.startswith(option), -difflib.SequenceMatcher(None, option, o).ratio(), o))
    guess = f"did you mean {' or '.join(close[:2])} ({plus}{group}={close[0]})? " if close else ""
    return f"{group}: there is no option '{option}'; {guess}the options are: {', '.join(options)}"


def explain(err: BaseException) -> str:
    """A composition Hydra refused, as looplib's one line, from the exception's type and its typed
    fields (never its wording): the setting, what is wrong, the fix."""
    from hydra.errors import MissingConfigException
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, option = err.missing_cfg_file.rsplit("/", 1)
        return no_option(group, option, list(err.options or []), group_kinds()[0])
    cause = err.__cause__
    parent, key = getattr(cause, "parent_node", None), getattr(cause, "key", None)
    if str(getattr(cause, "full_key", "")).startswith("hydra.") and hasattr(parent, "keys") and key is not None:
        # a typo in one of Hydra's structured nodes (hydra.sweeper.n_trial): name the closest key
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
    text = " ".join(str(err).split())
    if cause is not None and str(cause).strip():
        text += " (" + " ".join(str(cause).split()) + ")"
    return f"command line: {text}"


def options_with_key(where: str, key: str) -> list[str]:
    """``hydra/sweeper=optuna`` for ``("hydra.sweeper", "n_trials")``: the options of one of Hydra's
    groups whose node has ``key`` (from Hydra's ConfigStore, where plugins register them)."""
    from hydra.core.config_store import ConfigStore
    group = where.replace(".", "/")
    store = ConfigStore.instance()
    try:
        names = store.list(group)
    except (OSError, ValueError, KeyError):
        return []
    found = []
    for name in sorted(names):
        if not name.endswith(".yaml"):
            continue
        node = getattr(store.load(f"{group}/{name}"), "node", None)
        if node is not None and key in node:
            found.append(f"{group}={name[:-5]}")
    return found
