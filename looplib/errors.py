"""looplib's own configuration errors: one line naming the setting and the fix, exit status 2."""

EXIT_CONFIG = 2


class ConfigError(Exception):
    """A setting that looplib refuses. ``str(err)`` is the one line the user sees."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(" ".join(f"{key}: {problem}; {fix}".split()))  # always one line


def need(module: str, extra: str, setting: str, what: str | None = None, otherwise: str | None = None,
         package: str | None = None):
    """Import the optional ``module`` and return it, or raise the one ``ConfigError`` line that
    names ``setting`` and the extra that installs it (``pip install 'looplib[extra]'``).

    ``what``: who needs it, as the user chose it (default: ``setting``); ``otherwise``: a choice
    that works without it; ``package``: its name on the package index, where not ``module``'s."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = package or module.split(".")[0]
        raise ConfigError(setting, f"{what or setting} needs the {package} package, which does not import ({err})",
                          f"pip install 'looplib[{extra}]'" + (f", or {otherwise}" if otherwise else "")) from None
