"""``python -m looplib.tune [the job's overrides] [tune.* settings]``: see ``looplib.tune``."""
from looplib.cli import leave
from looplib.cli.tune import main

leave(main())
