"""``python -m looplib.tune``: the fastest configuration of a job that fits and trains the same,
measured on this machine.

    python -m looplib.tune model=gpt2_small data=text data.path=my_texts tune.memory_gib=24
    torchrun --nproc_per_node 8 -m looplib.tune model=bert_large ... tune.numerics=allow

The job is what ``python -m looplib.train`` would take; ``tune.*`` settings steer the search
(``looplib.tune.settings``). The memory planner prunes what cannot fit; each survivor runs real
steps of the real job in a fresh process (``measure``), in the order likely fastest first
(``search``); every candidate that changes the numbers is compared with the job's own loss on
the same batches. The run directory gets tune.json, tune.md and tune.png (``report``), and the
best command is printed last. A result is cached under ``$LOOPLIB_CACHE/tune/``, keyed by the
device, the library versions and the job: asking again is instant (``tune.fresh=true``
measures again). See docs/tune.md.
"""
