"""A precision that refuses the job on one rank only (a setting only that rank sees): tests of
refusals under torchrun force the refusing rank with ``+precision._target_=refusing.RefuseOnRank
+precision.rank=N`` (tests/ on PYTHONPATH)."""
from looplib.process.launcher import launched_rank
from looplib.errors import ConfigError
from looplib.precision import FP32


class RefuseOnRank(FP32):
    def __init__(self, skip_nonfinite: bool = True, rank: int = 0):
        super().__init__(skip_nonfinite)
        if launched_rank() == rank:
            raise ConfigError("precision.rank", f"rank {rank} refuses this job (a test's setting)",
                              "leave precision.rank out")
