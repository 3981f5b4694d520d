"""``python -m looplib.train [+group=option ...] [key=value ...]``: the command line (``looplib.cli``)."""


if __name__ == "__main__":
    from looplib.cli import train
    train()
