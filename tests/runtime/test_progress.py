"""`LLM.generate`'s progress bar (runtime/progress.py): tqdm's redraw rate on a terminal, one line
at most every `LOG_INTERVAL` seconds in a log, nothing when disabled."""

import io

from vexact_models.runtime.progress import LOG_INTERVAL, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_redraws_at_tqdms_rate_on_a_terminal_and_rarely_in_a_log():
    on_terminal, in_log = Terminal(), io.StringIO()
    with progress_bar(5, True, on_terminal) as fast, progress_bar(5, True, in_log) as slow:
        assert fast.mininterval == 0.1 and slow.mininterval == LOG_INTERVAL == 30.0
        for _ in range(5):
            fast.update(1), slow.update(1)
    assert in_log.getvalue().count("generate") == 2  # the first line and the last
    assert "5/5" in in_log.getvalue() and "5/5" in on_terminal.getvalue()
    with progress_bar(5, False, in_log) as off:
        assert off.disable

