"""A run's life, without Hydra: everything ``train_model`` needs (and the command line uses too).

    session        the one front door: ``Session`` runs a typed ``JobSpec`` as named steps (check, claim, plan,
                   build, train, close); every ending a ``RunEnded``
    endings        the one line each ending says; a plain exception as an ending (full disk, lost rank)
    assembly       ``Parts`` (one typed field per config group), ``JobSpec``, ``check`` and ``build``
    training       ``train``: loaders, optimizer, resume, telemetry, ``looplib.fit``, the final checkpoint, export
    api            ``train_model``: Python objects -> a JobSpec -> the session
    settings       the job's top-level settings, typed and checked
    autobatch      ``batch_size=auto``: the largest micro-batch that fits, and the accumulation
    rundir         what a run directory may hold; what a refused run leaves behind (nothing)
    saving         ``Checkpoints``: when and what to save, atomically; the bad-step rule
    checkpoint_dir what a checkpoint directory holds, and the one check it passes before it is read
    resume         which checkpoint a run continues from, which config changes it accepts, the restore
    signals        SIGTERM, SIGUSR1 and Ctrl-C: a flag while training, a stop at once before it
    plots          loss.png at the end of a run
"""
