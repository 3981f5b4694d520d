"""A run's life, without Hydra: everything ``train_model`` needs (and the command line uses too).

    session        the one front door: ``Session`` runs a typed ``JobSpec`` as named steps (check, claim, plan,
                   build, train, close); every ending a ``RunEnded``
    endings        the one line each ending says; a plain exception as an ending (full disk, lost rank)
    assembly       ``Parts`` (one typed field per config group), ``JobSpec``, ``check`` and ``build``
    training       ``train``: loaders, optimizer, resume, telemetry, ``looplib.fit``, the final checkpoint, export
    api            ``train_model``: Python objects -> a JobSpec -> the session
    settings       the job's top-level settings, typed and checked
    autobatch      ``batch_size=auto``: the largest micro-batch that fits, and the accumulation
    signals        SIGTERM, SIGUSR1 and Ctrl-C: a flag while training, a stop at once before it
    rules          which strategies combine: every rule between the parts, listed once
    plots          loss.png at the end of a run

What the run leaves on disk and reads back (the run directory, its lock, checkpoints, resume,
exports) lives in ``looplib.store``.
"""
