"""looplib's own configuration errors: one line naming the setting and the fix, exit status 2."""

EXIT_CONFIG = 2


class ConfigError(Exception):
    """A setting that looplib refuses. ``str(err)`` is the one line the user sees."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(" ".join(f"{key}: {problem}; {fix}".split()))  # always one line
