"""``python -m looplib.generate RUN_DIR [--prompt TEXT] [--tokens N]``: sample from a run's result
(``looplib.cli.generate``)."""


def __getattr__(name: str):
    """``looplib.generate.main`` moved to ``looplib.cli.generate`` (a warning says so)."""
    from looplib.moved import attribute
    return attribute(__name__, name)


if __name__ == "__main__":
    import sys

    from looplib.cli.generate import main
    sys.exit(main())
