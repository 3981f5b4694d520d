"""``python -m looplib.generate RUN_DIR [--prompt TEXT] [--tokens N]``: sample from a run's result
(``looplib.cli.generate``)."""


if __name__ == "__main__":
    import sys

    from looplib.cli.generate import main
    sys.exit(main())
