"""``python -m looplib.train [+group=option ...] [key=value ...]``: the command line (``looplib.cli``)."""


def __getattr__(name: str):
    """``looplib.train.main`` and friends moved to ``looplib.cli.main`` (a warning says so)."""
    from looplib.moved import attribute
    return attribute(__name__, name)


if __name__ == "__main__":
    from looplib.cli import train
    train()
