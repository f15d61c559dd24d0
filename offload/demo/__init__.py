"""The ``offload demo`` parts: a byte-level GPT, standard-library text, the loop and the report.

Only the names the command and the tests use are re-exported; each lives in its own module.
"""

from offload.demo.data import ByteCorpus, batches, get_batch, load_corpus, stdlib_source_files
from offload.demo.loop import TrainResult, evaluate, normalize_stats, train
from offload.demo.model import GPT, Block, GPTConfig, config_for_size, lm_loss, param_count
from offload.demo.report import MetricsWriter, format_summary, plot_report, read_metrics, summarize

__all__ = [
    "GPT",
    "Block",
    "ByteCorpus",
    "GPTConfig",
    "MetricsWriter",
    "TrainResult",
    "batches",
    "config_for_size",
    "evaluate",
    "format_summary",
    "get_batch",
    "lm_loss",
    "load_corpus",
    "normalize_stats",
    "param_count",
    "plot_report",
    "read_metrics",
    "stdlib_source_files",
    "summarize",
    "train",
]
