"""``python -m looplib.tune [the job's overrides] [tune.* settings]``: see ``looplib.tune``."""
import sys

from looplib.cli.tune import main

sys.exit(main())
