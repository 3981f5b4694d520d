"""Former home of the corpora, kept so that existing imports and ``_target_: looplib.data.corpora.X``
paths keep working: ``corpus`` (the contract), ``synthetic``, ``pysource``, ``files``, ``records``."""
from .corpus import Corpus  # noqa: F401
from .files import FileCorpus, TextCorpus, describe, split_documents  # noqa: F401
from .pysource import PythonSource, python_files  # noqa: F401
from .records import ClassificationCorpus, InstructCorpus, label_ids, label_names  # noqa: F401
from .synthetic import RandomCorpus, RandomTokens  # noqa: F401
