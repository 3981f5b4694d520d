"""What a run leaves on disk, and reads back: the run directory and its lock, saved checkpoints (when,
what, atomically, in the background), which checkpoint a resume continues from and on what
geometry, a finished run's exports, and weights read from a finished run.

    rundir         what a run directory may hold; what a refused run leaves behind (nothing)
    lock           one run per directory (a lock file every launcher meets)
    saving         ``Checkpoints``: when and what to save, atomically; the bad-step rule
    background     checkpoint writes in the background (checkpoint.async)
    checkpoint_dir what a checkpoint directory holds, and the one check it passes before it is read
    formats        how a checkpoint holds model and optimizer state (whole tensors, DCP shards), named by the engine
    state_dicts    either torch form loaded by any torch engine on any number of processes
    resume         which checkpoint a run continues from, which config changes it accepts, the restore
    elastic        the geometry a checkpoint was saved on, and resuming on another
    export         a run's final exports (model.safetensors, adapter/, hf/), as its peft strategy declares
                   them: at the end of training, and on resume=auto of a run stopped before writing them
    finished       a finished run's model, loaded from what it left (hf/, model.safetensors, a checkpoint)
    init_from      a finished run's weights into a new run's model (model.init_from)

The run wing (``looplib.run``) drives these; nothing here imports the command line.
"""
