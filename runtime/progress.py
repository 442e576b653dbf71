"""The progress bar of `LLM.generate`: tqdm's, one line at a time where it writes to a log.

On a terminal tqdm redraws the bar in place; in a file or a pipe (an RL job's log) every redraw
is a new line, ten a second by default, so a long rollout would fill the log with copies of the
bar. There it redraws at most every `LOG_INTERVAL` seconds (and once at the end).
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import autonotebook, std
from tqdm.auto import tqdm

#: seconds between two redraws of the bar where its stream is not a terminal (nor a notebook)
LOG_INTERVAL = 30.0


def progress_bar(total: int, enabled: bool, stream: TextIO | None = None) -> tqdm:
    """A bar over `total` sequences, written to `stream` (default: stderr), disabled unless
    `enabled`: tqdm's own redraw rate on a terminal or in a notebook's widget, a line at most
    every `LOG_INTERVAL` seconds elsewhere."""
    stream = sys.stderr if stream is None else stream
    in_log = autonotebook.tqdm is std.tqdm and not stream.isatty()
    return tqdm(total=total, desc="generate", unit="seq", disable=not enabled, file=stream,
                **({"mininterval": LOG_INTERVAL} if in_log else {}))
