"""``python -m looplib.report SWEEP_OR_RUN_DIR``."""
import sys

from looplib.report import main

sys.exit(main())
