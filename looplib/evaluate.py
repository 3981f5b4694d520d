"""``python -m looplib.evaluate RUN data=prompts data.path=FILE +reward=NAME [n=8 k=1,4 ...]``: the mean
reward and pass@k of a run's completions of held-out prompts; ``--lm-eval TASKS``: lm-evaluation-harness
on local tasks (``looplib.cli.evaluate``)."""


if __name__ == "__main__":
    import sys

    from looplib.cli.evaluate import main
    sys.exit(main())
