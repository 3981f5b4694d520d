"""From a composed config to live objects: top-level checks, group defaults, instantiation.

Every check that can be made before training happens here, once, and fails with a
``ConfigError``: one line naming the key and the fix. Which groups exist, which are appended
and what an absent one means come from ``looplib.groups``.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import fields
from importlib import resources
from typing import Any

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from .. import groups
from ..process.launcher import launched_world
from ..errors import ConfigError, RunEnded, disk_full
from ..loggers import Logger, Loggers
from ..run import launcher
from ..run.settings import Settings, refuse_renamed, settings_from
from ..schema import check_options, cli, parameters, refuse_unknown
from .resolvers import register_resolvers

log = logging.getLogger("looplib")
register_resolvers()  # the ${looplib.*} resolvers the conf/ files use (composing needs them)



def group_names(cfg: DictConfig) -> set[str]:
    """Every config group: a row of ``looplib.groups``, or one a --config-dir adds."""
    names = {row.name for row in groups.groups()}
    hydra_cfg = hydra_config()
    if hydra_cfg is not None:
        names |= {g for g in hydra_cfg.runtime.choices if not g.startswith("hydra")}
    return names


def hydra_config():
    from hydra.core.hydra_config import HydraConfig
    return HydraConfig.get() if HydraConfig.initialized() else None


def check_settings(cfg: DictConfig) -> Settings:
    """The top level: every key is a setting (``Settings``, ``loader.*``, ``checkpoint.*``) or a
    config group, and every setting has its type and range."""
    groups, names = group_names(cfg), [f.name for f in fields(Settings)]
    top = {k: v for k, v in resolved(cfg, None).items() if k not in groups and k != "hydra"}
    refuse_renamed(top)  # eval_batches=2: "now eval_samples", not "did you mean ..."
    for key in top:
        if key not in names:
            owners = [g for g in sorted(groups) if isinstance(cfg.get(g), DictConfig) and key in cfg[g]]
            if owners:  # n_layer=4 for model.n_layer=4, momentum=0.9 for optim.momentum=0.9
                raise ConfigError(key, f"{key} is not a top-level setting but a setting of {' and '.join(owners)}",
                                  "write " + " or ".join(f"{g}.{key}={cli(top[key])}" for g in owners))
            refuse_unknown("", key, top[key], sorted(names + list(groups)), "")
    return settings_from(top)


def resolved(cfg: DictConfig, group: str | None) -> dict:
    """A node as plain values, interpolations resolved (or the one-line error saying which does not)."""
    node = cfg if group is None else cfg[group]
    try:
        return OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as err:
        key = group or (err.full_key if getattr(err, "full_key", None) else "config")
        raise ConfigError(key, f"the {key} config does not resolve: {' '.join(str(err.msg).split())}",
                          f"fix the interpolation in {key}") from None


def fill_strategy_defaults(cfg: DictConfig) -> None:
    """Put the default option of every absent strategy group into ``cfg`` (so it is saved too).
    A group given only some keys (``+optim.eps=1e-6``) is those keys over its default option."""
    # strategy groups stay out of the defaults list (so `+group=option` works as typed); an absent
    # group means its default option, read from the same YAML file `+group=option` would use
    defaults = {**groups.appended_defaults(), **launcher_defaults(cfg)}  # torchrun without +engine: DDP
    with open_dict(cfg):
        for group, option in defaults.items():
            node = cfg.get(group)
            if node is None or (isinstance(node, DictConfig) and "_target_" not in node):
                default = OmegaConf.load(resources.files("looplib.conf") / group / f"{option}.yaml")
                cfg[group] = default if node is None else OmegaConf.merge(default, node)


def check_config(cfg: DictConfig) -> Settings:
    """Everything a user can set, checked before anything is built: the top level, then every
    group against the constructor of the class it selects. Returns the typed settings."""
    settings = check_settings(cfg)
    fill_strategy_defaults(cfg)
    refuse_one_process_engine(cfg)  # +engine=local under torchrun: refused on every rank
    functions_as_given(cfg)  # reward._target_=my_pkg.fn: the function itself, not what it returns
    for group in sorted(group_names(cfg), key=lambda g: (g in ("data", "model"), g)):  # those may import a library
        if isinstance(cfg.get(group), DictConfig) and "_target_" in cfg[group]:
            check_group(cfg, group)
    return settings


FUNCTION_GROUPS = ("reward",)  # groups whose option may be a plain function (looplib.reward)


def functions_as_given(cfg: DictConfig) -> None:
    """A group of ``FUNCTION_GROUPS`` whose ``_target_`` is a function is built as that function (Hydra's
    ``_partial_``: its other keys become keyword arguments), not called with no arguments."""
    for group in FUNCTION_GROUPS:
        node = cfg.get(group)
        if isinstance(node, DictConfig) and "_target_" in node and "_partial_" not in node:
            if inspect.isfunction(locate(group, resolved(cfg, group)["_target_"])):
                with open_dict(cfg):
                    cfg[group]["_partial_"] = True


def check_group(cfg: DictConfig, group: str) -> None:
    """One group's keys against its ``_target_``'s signature. An argument the class takes that is
    also a top-level setting (``lr``, ``weight_decay``, ``device``, ...) and that the group does
    not set receives the top-level value, so a class chosen by ``_target_`` gets ``lr=...`` too."""
    target_path = resolved(cfg, group).get("_target_")
    target = locate(group, target_path)
    found = parameters(target)
    if found is not None:
        shared = {f.name for f in fields(Settings)} & set(found[0]) - set(cfg[group])
        with open_dict(cfg):
            for name in sorted(shared):
                cfg[group][name] = f"${{{name}}}"
    options = resolved(cfg, group)
    if group == "model":
        options.pop("init_from", None)  # looplib's own key of every model group (looplib.store.init_from), not an argument
    check_options(f"{group}.", target, options, origin(group, target_path))


def locate(group: str, target_path: Any) -> Any:
    """The class (or function) a group's ``_target_`` names, or the error saying why it does not import."""
    from hydra.utils import _locate
    try:
        return _locate(str(target_path))
    except Exception as err:  # ImportError, or Hydra's own wrapping of it
        cause = err
        while cause.__cause__ is not None:
            cause = cause.__cause__  # the ImportError itself, not Hydra's wrapping of it
        reason = " ".join(str(cause).split()) or type(cause).__name__
        raise ConfigError(f"{group}._target_", f"{group}._target_={target_path!r} ({origin(group, target_path)}) "
                          f"does not import: {reason}",
                          "fix the dotted path, or install the package that provides it") from None


def origin(group: str, target: Any = None) -> str:
    """Which choice put this class here: ``from optim=adamw``, or ``from optim._target_=my.Class``
    when the command line named the class itself."""
    hydra_cfg = hydra_config()
    if hydra_cfg is None:  # composed without Hydra's runtime (tests, the planner): the class is all we know
        return f"from {group}._target_={target}"
    for override in hydra_cfg.overrides.task:
        key, _, value = override.lstrip("+~").partition("=")
        if key == f"{group}._target_":
            return f"from {group}._target_={value}"
    choice = hydra_cfg.runtime.choices.get(group)
    defaults = groups.appended_defaults()
    if choice is None and group in defaults:
        return f"from {group}={defaults[group]}, the default"
    return f"from {group}={choice}" if choice else f"from {group}._target_={target}"


def instantiate(cfg: DictConfig, group: str, **runtime: Any) -> Any:
    """``hydra.utils.instantiate`` of one config group, with errors that name the group."""
    node = cfg.get(group)
    if node is None or "_target_" not in node:
        raise ConfigError(group, f"the {group} config has no _target_", f"add {group}._target_=package.Class")
    target = resolved(cfg, group)["_target_"]
    if group == "model" and "init_from" in node:  # looplib's own key (looplib.store.init_from), not an argument
        node = {k: v for k, v in resolved(cfg, group).items() if k != "init_from"}
    try:
        return hydra.utils.instantiate(node, _convert_="all", **runtime)  # plain dicts and lists, never DictConfig
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, RunEnded):  # ConfigError, DiskFull, Interrupted: the ending itself
            raise cause from None
        full = disk_full(cause)
        if full is not None:  # a full disk while the data builds its token cache: not a setting to fix
            raise full from None
        if isinstance(cause, ImportError) or "Error locating target" in str(err):
            locate(group, target)  # raises the one-line error naming the import that failed
        reason = " ".join(str(cause or err).split())
        raise ConfigError(group, f"{group}._target_={target!r} ({origin(group, target)}) could not be built: {reason}",
                          f"check the keys of the {group} config against {target}'s arguments") from None
    except OmegaConfBaseException as err:
        raise ConfigError(group, f"the {group} config does not resolve: {err.msg}",
                          f"fix the values in {group}") from None


def launcher_defaults(cfg) -> dict:
    """Strategy defaults the launcher decides (``looplib.run.launcher``): several processes and no
    engine chosen -> the ``ddp`` option."""
    node = cfg.get("engine")
    option = launcher.default_engine(chosen=node is not None and "_target_" in node)
    return {"engine": option} if option else {}


def refuse_one_process_engine(cfg) -> None:
    """The engine the config names, under the launcher rules (``looplib.run.launcher``): one that
    runs in one process (``+engine=local``) started as one of several is refused on every rank."""
    target = cfg.get("engine", {}).get("_target_") if launched_world()[0] > 1 else None
    if target is None:
        return
    try:
        engine = hydra.utils.get_class(str(target))
    except Exception:  # noqa: BLE001 - a misspelt _target_: the group's own check names it
        return
    launcher.refuse_one_process(engine)


def build_loggers(cfg) -> Logger:
    """The loggers the config's ``logger`` node names (``{option: {_target_: ...}}``), as one.
    Each one's keys are checked against its class's signature first (``looplib.schema``)."""
    node = cfg.get("logger")
    if node is None:
        return Loggers()
    if "_target_" in node:
        raise ConfigError("logger", "the logger config names a class at its top",
                          "name each logger: +logger.NAME._target_=package.Class (or +logger=tensorboard)")
    built = []
    for name in node:
        options = resolved(node, name) if OmegaConf.is_dict(node[name]) else None
        if not options or "_target_" not in options:
            raise ConfigError(f"logger.{name}", f"logger.{name} names no class",
                              f"+logger.{name}._target_=package.Class, or +logger=tensorboard|mlflow|wandb")
        target = locate(f"logger.{name}", options["_target_"])
        check_options(f"logger.{name}.", target, options, f"from +logger={name}")
        try:
            built.append(instantiate(node, name))
        except ConfigError as err:  # name the setting as the user typed it: logger.<name>...
            key = err.key if err.key.startswith("logger.") else f"logger.{err.key}"
            raise ConfigError(key, err.problem, err.fix) from None
    return Loggers(*built)
