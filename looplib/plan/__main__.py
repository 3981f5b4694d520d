"""``python -m looplib.plan``: the planner's command line (``looplib.cli.plan``)."""
import sys

from looplib.cli.plan import main

sys.exit(main())
